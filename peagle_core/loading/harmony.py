"""Split a streamed GPT-OSS (harmony) reply into reasoning, content and tool calls.

GPT-OSS answers in channels: `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final
<|message|>...<|return|>`. OpenAI's chat API has no channels, so (as vLLM does) the analysis channel becomes
`reasoning` and the rest `content`, except a message addressed to a tool (`to=functions.NAME` in its header,
on the commentary channel, ending in <|call|>): its body is that call's arguments. Header text (role,
channel name, recipient) is never shown. When the decoded text carries no markers (a tokenizer that drops special tokens, a model that
answers plainly) it all passes through as content. Works on arbitrary chunk boundaries: a trailing
fragment that could start a marker is held back until the next delta. A request's reply is decoded (special tokens
kept) and fed here by `peagle_core.engine.output.OutputState`.
"""
from __future__ import annotations

import re
from typing import NamedTuple

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>",
           "<|endoftext|>", "<|startoftext|>")
_SPLIT = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")


class Delta(NamedTuple):
    content: str
    reasoning: str
    tool_calls: list[dict]  # {"index", "name", "arguments"}: name on a call's first delta only


class HarmonyParser:
    def __init__(self) -> None:
        self.mode = "body"  # "header" between <|start|>/<|channel|> and <|message|>; "body" after it
        self.channel = "final"
        self.recipient: str | None = None  # the current message's `to=...`: a tool call's body is its arguments
        self.header = ""
        self.pending = ""  # a tail that may be the start of a marker
        self.num_calls = 0

    def feed(self, delta: str, final: bool = False) -> Delta:
        """Returns the content, reasoning and tool-call arguments this delta adds."""
        text = self.pending + delta
        self.pending = ""
        if not final:
            cut = _partial_marker_start(text)
            text, self.pending = text[:cut], text[cut:]
        content, reasoning, calls = [], [], []
        for piece in _SPLIT.split(text):
            if not piece:
                continue
            if piece in MARKERS:
                if self._marker(piece):
                    calls.append({"index": self.num_calls - 1, "name": self.recipient.removeprefix("functions."),
                                  "arguments": ""})
            elif self.mode == "header":
                self.header += piece
            elif self.recipient is not None:
                calls.append({"index": self.num_calls - 1, "arguments": piece})
            else:
                (reasoning if self.channel == "analysis" else content).append(piece)
        return Delta("".join(content), "".join(reasoning), merge_calls(calls))

    def _marker(self, m: str) -> bool:
        """Applies a marker; True when it opens a tool call's body."""
        if m in ("<|start|>", "<|channel|>", "<|constrain|>"):
            if self.mode == "body":
                self.header = ""
            self.mode = "header"
            if m == "<|channel|>":
                self.header += " channel="
        elif m == "<|message|>":
            self.channel = _channel(self.header)
            self.recipient = _recipient(self.header)
            self.mode, self.header = "body", ""
            if self.recipient is not None:
                self.num_calls += 1
                return True
        else:  # <|end|>, <|return|>, <|call|>, <|endoftext|>: the message is over; await the next header
            self.mode, self.header = "body", ""
            self.channel, self.recipient = "final", None
        return False


def merge_calls(calls: list[dict]) -> list[dict]:
    """One delta per call: a call's opening and its argument pieces in one feed come out together."""
    out: list[dict] = []
    for c in calls:
        if out and out[-1]["index"] == c["index"]:
            out[-1]["arguments"] += c["arguments"]
        else:
            out.append(dict(c))
    return out


def _channel(header: str) -> str:
    m = re.search(r"channel=\s*([A-Za-z_]+)", header)
    return m.group(1) if m else "final"


def _recipient(header: str) -> str | None:
    """`to=functions.NAME` in a header (before or after the channel); messages to the user have none."""
    m = re.search(r"\bto=([^\s<]+)", header)
    return m.group(1) if m and m.group(1) not in ("assistant", "user", "all") else None


def _partial_marker_start(text: str) -> int:
    """Index where a possible incomplete marker begins at the end of `text` (len(text) if none)."""
    i = text.rfind("<")
    tail = text[i:] if i >= 0 else ""
    if tail and tail not in MARKERS and any(m.startswith(tail) for m in MARKERS):
        return i
    return len(text)


def supports_harmony(tokenizer) -> bool:
    """True for tokenizers with harmony's special tokens (GPT-OSS and the tiny model)."""
    ids = getattr(tokenizer, "special_token_ids", None)
    return isinstance(ids, dict) and "<|message|>" in ids and "<|channel|>" in ids
