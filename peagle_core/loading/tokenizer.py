"""Tokenizer, harmony chat format, streaming detokenization and stop strings.

GPT-OSS checkpoints ship a Hugging Face fast tokenizer (`tokenizer.json`, byte-level BPE) and a
`generation_config.json` whose `eos_token_id` lists the tokens that end a turn. We wrap the
`tokenizers` library directly (no transformers import on the serving path) and render chats in
OpenAI's harmony format ourselves, because the model was trained on exactly that string.
"""
from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import Tokenizer as HFTokenizer, decoders

from peagle_core.loading.harmony_tools import TOOLS_CHANNEL_LINE, tools_section

# --------------------------------------------------------------------------------------------
# Harmony format (gpt-oss). Layout of one message: <|start|>{header}<|message|>{content}<|end|>
# --------------------------------------------------------------------------------------------

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
STARTOFTEXT, ENDOFTEXT = "<|startoftext|>", "<|endoftext|>"
HARMONY_SPECIAL_TOKENS = (STARTOFTEXT, ENDOFTEXT, RETURN, CONSTRAIN, CHANNEL, START, END, MESSAGE, CALL)

DEFAULT_MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
DEFAULT_KNOWLEDGE_CUTOFF = "2024-06"
DEFAULT_REASONING_EFFORT = "medium"  # harmony's and the HF template's default
REASONING_EFFORTS = ("low", "medium", "high")
CHANNELS_LINE = "# Valid channels: analysis, commentary, final. Channel must be included for every message."
ROLES = ("system", "developer", "user", "assistant", "tool")


def _content_text(message: dict, index: int) -> str:
    """OpenAI content: a string, or a list of {"type": "text", "text": ...} parts (joined by newlines, as vLLM does)."""
    role = message.get("role")
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and role == "assistant" and message.get("tool_calls"):
        return ""  # OpenAI: an assistant message that only calls tools has null content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"messages[{index}] ({role}): content part {j} must be {{'type': 'text', 'text': str}}, "
                    f"got {kind!r}; only text content is supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"messages[{index}] ({role}): content must be a string or a list of text parts, "
                     f"got {type(content).__name__}")


def validate_messages(messages: Any) -> list[tuple[str, str, dict]]:
    """Check chat messages and return (role, text, message) triples; ValueError names the bad one."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must contain at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]: role must be one of {', '.join(ROLES)}; got {role!r}")
        if "content" not in m and not (role == "assistant" and m.get("tool_calls")):
            raise ValueError(f"messages[{i}] ({role}) has no 'content'")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"messages[{i}] ({role}): name must be a string, got {type(name).__name__}")
        out.append((role, _content_text(m, i), m))
    return out


def harmony_system_content(reasoning_effort: str | None = None, model_identity: str = DEFAULT_MODEL_IDENTITY,
                           knowledge_cutoff: str = DEFAULT_KNOWLEDGE_CUTOFF, current_date: str | None = None,
                           has_tools: bool = False) -> str:
    """The body of harmony's system message: identity/dates block, reasoning level, valid channels."""
    effort = (reasoning_effort or DEFAULT_REASONING_EFFORT)
    if not isinstance(effort, str) or effort.lower() not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got {reasoning_effort!r}")
    head = [model_identity, f"Knowledge cutoff: {knowledge_cutoff}"]
    if current_date:
        head.append(f"Current date: {current_date}")
    channels = CHANNELS_LINE + ("\n" + TOOLS_CHANNEL_LINE if has_tools else "")
    return "\n\n".join(["\n".join(head), f"Reasoning: {effort.lower()}", channels])


def today() -> str:
    """The `Current date` gpt-oss's template writes (UTC, so every replica agrees)."""
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def _developer(instructions: str, tools: list[dict] | None = None) -> str:
    sections = [f"# Instructions\n\n{instructions}"] if instructions.strip() else []
    if tools:
        sections.append(tools_section(tools))
    return f"{START}developer{MESSAGE}" + "\n\n".join(sections) + END


def function_tools(tools: Any) -> list[dict]:
    """OpenAI's `tools` ([{"type": "function", "function": {...}}]) or bare function dicts -> function dicts."""
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list, got {type(tools).__name__}")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function", t) if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}")
        out.append(fn)
    return out


def _tool_call_header(name: str) -> str:
    return f"{START}assistant to=functions.{name}{CHANNEL}commentary {CONSTRAIN}json{MESSAGE}"


def tool_call_prefill(name: str | None) -> str:
    """Text after the generation prompt that makes the reply a call: to `name`, or (None) to a tool the
    model names. OpenAI's `tool_choice` required / a named function."""
    if name is None:
        return " to=functions."
    return _tool_call_header(name).removeprefix(f"{START}assistant")


def apply_chat_template(messages: list[dict], add_generation_prompt: bool = True,
                        reasoning_effort: str | None = None, system_prompt: str | None = None, *,
                        tools: list[dict] | None = None,
                        model_identity: str = DEFAULT_MODEL_IDENTITY,
                        knowledge_cutoff: str = DEFAULT_KNOWLEDGE_CUTOFF,
                        current_date: str | None = None) -> str:
    """Render OpenAI-style chat messages as a harmony prompt string.

    - The harmony system message (identity, knowledge cutoff, optional date, reasoning, channels) comes first.
    - Leading "system"/"developer" messages become ONE developer message "# Instructions\\n\\n{content}"
      (OpenAI's system role is harmony's developer role); `system_prompt` is used when there are none.
      `tools` (OpenAI function definitions) follow as its "# Tools" section. A system/developer message
      later in the chat renders in place as its own developer message.
    - Assistant history renders on the final channel. Its reasoning (`reasoning`, or `reasoning_content`)
      renders on the analysis channel only after the last user message (the turn in progress, which may
      be calling tools), as gpt-oss's template does; earlier turns' reasoning is dropped.
    - An assistant's `tool_calls` render as calls to `functions.NAME` on the commentary channel, ending in
      <|call|>; tool results as `functions.NAME to=assistant`, NAME found by `tool_call_id`.
    - The generation prompt is `<|start|>assistant`; the model writes the channel itself.
    """
    items = validate_messages(messages)
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"system_prompt must be a string, got {type(system_prompt).__name__}")
    fns = function_tools(tools)
    parts = [f"{START}system{MESSAGE}"
             f"{harmony_system_content(reasoning_effort, model_identity, knowledge_cutoff, current_date, bool(fns))}"
             f"{END}"]

    n_lead = 0
    while n_lead < len(items) and items[n_lead][0] in ("system", "developer"):
        n_lead += 1
    lead = [text for _, text, _ in items[:n_lead] if text.strip()]
    instructions = "\n\n".join(lead) if n_lead else (system_prompt or "")
    if instructions.strip() or fns:
        parts.append(_developer(instructions, fns))

    last_user = max((i for i, (role, _, _) in enumerate(items) if role == "user"), default=-1)
    call_names: dict[str, str] = {}
    for i, (role, text, m) in enumerate(items[n_lead:], start=n_lead):
        if role in ("system", "developer"):
            parts.append(_developer(text))
        elif role == "user":
            parts.append(f"{START}user{MESSAGE}{text}{END}")
        elif role == "assistant":
            parts.extend(_assistant(i, text, m, keep_reasoning=i > last_user, call_names=call_names))
        else:  # tool
            name = m.get("name") or call_names.get(m.get("tool_call_id"))
            if name is None and m.get("tool_call_id") is None:
                name = "tool"  # an anonymous result: nothing to name it by
            if name is None:
                raise ValueError(f"messages[{i}] (tool): tool_call_id {m.get('tool_call_id')!r} matches no earlier "
                                 "assistant tool call, and the message has no name")
            parts.append(f"{START}functions.{name} to=assistant{CHANNEL}commentary{MESSAGE}{text}{END}")
    if add_generation_prompt:
        parts.append(f"{START}assistant")
    return "".join(parts)


def _assistant(i: int, text: str, m: dict, keep_reasoning: bool, call_names: dict[str, str]) -> list[str]:
    out = []
    reasoning = m.get("reasoning") or m.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f"messages[{i}] (assistant): reasoning must be a string")
    if reasoning and keep_reasoning:
        out.append(f"{START}assistant{CHANNEL}analysis{MESSAGE}{reasoning}{END}")
    calls = m.get("tool_calls") or []
    if not calls:
        return out + [f"{START}assistant{CHANNEL}final{MESSAGE}{text}{END}"]
    if text:  # a preamble the model said to the user before calling
        out.append(f"{START}assistant{CHANNEL}commentary{MESSAGE}{text}{END}")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"messages[{i}].tool_calls[{j}] must have function.name and function.arguments")
        args = fn.get("arguments") or "{}"
        if not isinstance(args, str):
            raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON string")
        if call.get("id"):
            call_names[call["id"]] = fn["name"]
        out.append(f"{_tool_call_header(fn['name'])}{args}{CALL}")
    return out


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_name(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the token ids serving needs (stop, eos, bos, pad)."""

    def __init__(self, tokenizer: HFTokenizer, generation_config: dict | None = None,
                 tokenizer_config: dict | None = None) -> None:
        self._tok = tokenizer
        self.generation_config = generation_config or {}
        self.tokenizer_config = tokenizer_config or {}
        self._special_ids = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._stop_ids = self._find_stop_ids()
        self._token_bytes: dict[bool, list[bytes] | None] = {}

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        if path.is_file() and path.name == "tokenizer.json":
            path = path.parent
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory {path} does not exist")
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found: a tokenizer directory needs tokenizer.json "
                                    f"(the Hugging Face fast-tokenizer file)")
        try:
            hf = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"could not load {tok_file}: {e}") from None
        gen = path / "generation_config.json"
        cfg = path / "tokenizer_config.json"
        return cls(hf, _read_json(gen) if gen.is_file() else None, _read_json(cfg) if cfg.is_file() else None)

    # ---- ids -----------------------------------------------------------------------------

    def _find_stop_ids(self) -> list[int]:
        eos = self.generation_config.get("eos_token_id")
        if eos is None and (name := _token_name(self.tokenizer_config.get("eos_token"))) is not None:
            eos = self.token_id(name)
        if eos is None:  # no config at all: harmony's end-of-turn tokens, where this vocabulary has them
            eos = [i for i in (self.token_id(RETURN), self.token_id(CALL)) if i is not None]
        ids = [eos] if isinstance(eos, int) else list(eos)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"generation_config eos_token_id must be an int or a list of ints, got {eos!r}")
        return ids

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self._stop_ids)

    @property
    def eos_token_id(self) -> int | None:
        name = _token_name(self.tokenizer_config.get("eos_token"))
        if name is not None and (i := self.token_id(name)) is not None:
            return i
        return self._stop_ids[0] if self._stop_ids else None

    @property
    def bos_token_id(self) -> int | None:
        bos = self.generation_config.get("bos_token_id")
        if isinstance(bos, int):
            return bos
        name = _token_name(self.tokenizer_config.get("bos_token"))
        return self.token_id(name) if name else None

    @property
    def pad_token_id(self) -> int | None:
        pad = self.generation_config.get("pad_token_id")
        if isinstance(pad, int):
            return pad
        name = _token_name(self.tokenizer_config.get("pad_token"))
        return self.token_id(name) if name else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_token_ids(self) -> dict[str, int]:
        return dict(self._special_ids)

    def token_id(self, name: str) -> int | None:
        """Id of one token (e.g. "<|start|>"), or None when the vocabulary lacks it."""
        return self._tok.token_to_id(name)

    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    # ---- text <-> ids --------------------------------------------------------------------

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids for `text`; no BOS (harmony prompts start with <|start|>).

        allow_special=True turns special-token strings such as "<|start|>" into their single ids, which a
        rendered chat prompt needs; False encodes them as plain text (for untrusted text).
        """
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {type(text).__name__}")
        if allow_special:
            return self._tok.encode(text, add_special_tokens=False).ids
        previous = self._tok.encode_special_tokens
        self._tok.encode_special_tokens = True
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = previous

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = [i for i in ids if i < 0 or i >= self.vocab_size]
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """Each id's bytes, where decoding is concatenating them (a ByteLevel decoder, as GPT-OSS's): a stream
        can then decode bytes as they come, without calling the tokenizer twice a step. None for other
        decoders, or where decoding any single id disagrees with `decode` (checked once, every id)."""
        skip = bool(skip_special_tokens)
        if skip not in self._token_bytes:
            self._token_bytes[skip] = self._byte_table(skip)
        return self._token_bytes[skip]

    def _byte_table(self, skip: bool) -> list[bytes] | None:
        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            return None
        special = set(self._special_ids.values())
        table = []
        for i in range(self.vocab_size):
            token = self._tok.id_to_token(i)
            if token is None or (skip and i in special):
                table.append(b"")
            elif all(c in _BYTE_OF_CHAR for c in token):  # the byte-level alphabet: one character a byte
                table.append(bytes(_BYTE_OF_CHAR[c] for c in token))
            else:  # an added token written as plain text
                table.append(token.encode())
        alone = self._tok.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=skip)
        if any(text != b.decode("utf-8", "replace") for text, b in zip(alone, table)):
            return None
        return table

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            reasoning_effort: str | None = None, system_prompt: str | None = None,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        text = apply_chat_template(messages, add_generation_prompt, reasoning_effort, system_prompt, **kwargs)
        return self.encode(text) if tokenize else text

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, stop_token_ids={self._stop_ids})"


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet, character -> byte: printable Latin-1 bytes stand for themselves, every
    other byte for the character 256 + its rank among those."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_alphabet()

# --------------------------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    A byte-level token may end in the middle of a UTF-8 character; decoding it alone yields U+FFFD.
    We keep two offsets into the ids (the scheme vLLM and HF's TextStreamer use): `prefix` is where the
    last emitted text's decoding window starts, `read` is where emitted text ends. Each push decodes
    ids[prefix:] and ids[prefix:read] and emits the difference, unless it ends in U+FFFD (an incomplete
    character), in which case the text is held until more ids arrive or `flush()` is called.
    The window only advances at points where decoding sat on a character boundary, so the deltas
    concatenate to exactly `decode(all_ids)`.

    Where the tokenizer decodes by concatenating bytes (`Tokenizer.token_bytes`), the stream instead feeds
    each new id's bytes to an incremental UTF-8 decoder, which holds an incomplete character's bytes back by
    itself: the same text, with no call into the tokenizer (two a request a step, ~10 us, were most of the
    engine's host time per step after the device's). `bytewise=False` keeps the windowed decode.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, bytewise: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []  # the windowed decode's (bytewise, the decoder holds what it needs)
        self._prefix = 0
        self._read = 0
        self._emitted: list[str] = []  # every delta (`text`); an attribute's += would copy the whole text a step
        self._bytes = tokenizer.token_bytes(skip_special_tokens) if bytewise else None
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens) if ids else ""

    def push(self, new_ids: Iterable[int]) -> str:
        if self._bytes is not None:
            return self._push_bytes(list(new_ids))
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        full_text = self._decode(self.ids[self._prefix:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self.ids)
        self._emitted.append(delta)
        return delta

    def _push_bytes(self, new_ids: list[int]) -> str:
        if new_ids and (min(new_ids) < 0 or max(new_ids) >= len(self._bytes)):
            self.tokenizer.decode(new_ids)  # raises decode's error for ids out of range
        delta = self._utf8.decode(b"".join([self._bytes[i] for i in new_ids]))
        self._emitted.append(delta)
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character becomes U+FFFD, as decode() would show it)."""
        if self._bytes is not None:
            delta = self._utf8.decode(b"", final=True)
            self._emitted.append(delta)
            return delta
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        full_text = self._decode(self.ids[self._prefix:])
        delta = full_text[len(prefix_text):]
        self._prefix = self._read = len(self.ids)
        self._emitted.append(delta)
        return delta


def stop_string_match(text: str, stops: Sequence[str]) -> int | None:
    """Index in `text` where the earliest stop string starts, or None. Empty stop strings are ignored."""
    best: int | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s)
        if i != -1 and (best is None or i < best):
            best = i
    return best


def stop_length_at(text: str, at: int, stops: Sequence[str]) -> int:
    """Length of the stop string `stop_string_match` found at `at` (the first listed that starts there)."""
    return next(len(s) for s in stops if s and text.startswith(s, at))


def holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` could be the start of a stop string.

    A streamer emits text[:len(text) - holdback(text, stops)] so it never sends characters that a stop
    string completed by later tokens would have to take back.
    """
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if s.startswith(text[len(text) - k:]):
                n = k
                break
    return n


class StopFilter:
    """Streams text up to the first stop string, holding back any suffix that may still become one.

    Only the held-back tail and the new text are searched: a stop string cannot start in text already sent
    (while it could still become one it was held back), so a push costs what its text does, not what the
    whole output does."""

    def __init__(self, stops: Sequence[str] | None, include: bool = False):
        self.stops = [s for s in (stops or []) if s]
        self.include = include  # vLLM's include_stop_str_in_output: the stop string ends the text, kept
        self.pending = ""  # pushed but not sent: shorter than the longest stop string
        self._sent: list[str] = []
        self.stopped = False

    def push(self, new: str, final: bool, check: bool = True) -> str:
        """Add decoded text; returns what may be sent now (`stopped` turns True at a stop string). `check=False`:
        text not searched for stop strings (vLLM's min_tokens), though its tail may still begin one."""
        if self.stopped:
            return ""
        text = self.pending + new
        hit = stop_string_match(text, self.stops) if check else None
        if hit is not None:
            self.stopped, upto = True, hit + (stop_length_at(text, hit, self.stops) if self.include else 0)
        else:
            upto = len(text) - (0 if final else holdback(text, self.stops))
        delta, self.pending = text[:upto], text[upto:]
        if delta:
            self._sent.append(delta)
        return delta

    @property
    def emitted(self) -> str:
        return "".join(self._sent)
