"""Split a streamed GPT-OSS (harmony) reply into `reasoning_content` and `content`.

GPT-OSS answers in channels: `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final
<|message|>...<|return|>`. OpenAI's chat API has no channels, so (as vLLM does) the analysis channel becomes
`reasoning_content` and everything else becomes `content`. Header text (role, channel name, recipient) is
never shown. When the decoded text carries no markers (a tokenizer that drops special tokens, a model that
answers plainly) it all passes through as content. Works on arbitrary chunk boundaries: a trailing
fragment that could start a marker is held back until the next delta.
"""
from __future__ import annotations

import re

from peagle_core.loading.tokenizer import IncrementalDetokenizer, StopFilter

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>",
           "<|endoftext|>", "<|startoftext|>")
_SPLIT = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")


class HarmonyParser:
    def __init__(self) -> None:
        self.mode = "body"  # "header" between <|start|>/<|channel|> and <|message|>; "body" after it
        self.channel = "final"
        self.header = ""
        self.pending = ""  # a tail that may be the start of a marker

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """Returns (content, reasoning) to emit for this delta."""
        text = self.pending + delta
        self.pending = ""
        if not final:
            cut = _partial_marker_start(text)
            text, self.pending = text[:cut], text[cut:]
        content, reasoning = [], []
        for piece in _SPLIT.split(text):
            if not piece:
                continue
            if piece in MARKERS:
                self._marker(piece)
            elif self.mode == "header":
                self.header += piece
            else:
                (reasoning if self.channel == "analysis" else content).append(piece)
        return "".join(content), "".join(reasoning)

    def _marker(self, m: str) -> None:
        if m in ("<|start|>", "<|channel|>", "<|constrain|>"):
            if self.mode == "body":
                self.header = ""
            self.mode = "header"
            if m == "<|channel|>":
                self.header += " channel="
        elif m == "<|message|>":
            self.channel = _channel(self.header)
            self.mode, self.header = "body", ""
        else:  # <|end|>, <|return|>, <|call|>, <|endoftext|>: the message is over; await the next header
            self.mode, self.header = "body", ""
            self.channel = "final"


def _channel(header: str) -> str:
    m = re.search(r"channel=\s*([A-Za-z_]+)", header)
    return m.group(1) if m else "final"


def _partial_marker_start(text: str) -> int:
    """Index where a possible incomplete marker begins at the end of `text` (len(text) if none)."""
    i = text.rfind("<")
    tail = text[i:] if i >= 0 else ""
    if tail and tail not in MARKERS and any(m.startswith(tail) for m in MARKERS):
        return i
    return len(text)


class ChatDecoder:
    """Token ids of a chat reply -> (content, reasoning) deltas.

    The engine's text deltas drop special tokens, and with them the channel boundaries, so chat
    replies are decoded here with special tokens kept (incrementally, so multi-byte characters split
    across steps come out whole) and split by `HarmonyParser`. Stop strings apply to the content,
    with the same hold-back as the engine's own text: a suffix that may still grow into a stop
    string is not sent yet.
    """

    def __init__(self, tokenizer, stops: list[str] | None = None):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
        self.parser = HarmonyParser()
        self.content = StopFilter(stops)

    def push(self, ids: list[int], final: bool) -> tuple[str, str]:
        text = self.detok.push(ids)
        if final:
            text += self.detok.flush()
        content, reasoning = self.parser.feed(text, final=final)
        return self.content.push(content, final), reasoning

    @property
    def stopped(self) -> bool:
        return self.content.stopped


def supports_harmony(tokenizer) -> bool:
    """True for tokenizers with harmony's special tokens (GPT-OSS and the tiny model)."""
    ids = getattr(tokenizer, "special_token_ids", None)
    return isinstance(ids, dict) and "<|message|>" in ids and "<|channel|>" in ids
