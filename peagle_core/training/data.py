"""Training data for drafter heads: JSONL records -> token ids with a loss mask.

A record is one JSON object per line, one of:
  {"text": "..."}                           plain text, every token supervised
  {"messages": [{"role", "content"}, ...]}  a chat, rendered with the target's chat template;
                                            only assistant tokens are supervised
  {"input_ids": [...], "loss_mask": [...]}  already tokenized (loss_mask optional, default all 1)

The drafter learns the TARGET's distribution, so the paper regenerates the responses with the
target itself (`regenerate`): the prompt is kept and the continuation is the target's greedy output.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol, Sequence

import torch

from peagle_core.models.gpt_oss import GptOss
from peagle_core.models.layers import ForwardMeta


class ChatTokenizer(Protocol):
    """What the data pipeline needs from a tokenizer (peagle_core.loading.tokenizer.Tokenizer has it)."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = ...) -> str: ...


@dataclass
class Example:
    """One training sequence: `loss_mask[j]` says whether token j is a token the drafter should learn to predict."""

    input_ids: list[int]
    loss_mask: list[bool]

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(f"input_ids ({len(self.input_ids)}) and loss_mask ({len(self.loss_mask)}) differ in length")

    def truncate(self, max_len: int) -> "Example":
        return Example(self.input_ids[:max_len], self.loss_mask[:max_len])


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"training data {path} does not exist")
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not ({"text", "messages", "input_ids"} & rec.keys()):
                raise ValueError(f"{path}:{lineno}: a record must be an object with 'text', 'messages' or 'input_ids'")
            records.append(rec)
    if not records:
        raise ValueError(f"training data {path} holds no records")
    return records


def render_chat(messages: list[dict], tokenizer: ChatTokenizer) -> Example:
    """Tokenize a chat with the template; the loss mask covers each assistant message's content and
    the one token after it (the end-of-message marker, which the drafter must also predict).

    The template is rendered once, the assistant contents are located in the rendered string, and the
    string is encoded piece by piece at those boundaries. Chat templates put special tokens around
    message contents, so piecewise encoding gives the same ids as encoding the whole string.
    """
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError("chat records need a tokenizer with apply_chat_template (pass the target's tokenizer)")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    spans, cursor = [], 0
    for i, m in enumerate(messages):  # walk every message so a user text cannot be taken for a reply
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts
            content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str) or not content:
            continue
        at = text.find(content, cursor)
        if at < 0:
            if m.get("role") == "assistant":
                raise ValueError(f"messages[{i}]: the assistant content does not appear verbatim in the rendered "
                                 f"chat template, so its tokens cannot be masked")
            continue
        if m.get("role") == "assistant":
            spans.append((at, at + len(content)))
        cursor = at + len(content)
    ids: list[int] = []
    mask: list[bool] = []
    mark_next = False  # the first token after an assistant content is supervised too

    def add(piece: str, supervised: bool) -> None:
        nonlocal mark_next
        t = tokenizer.encode(piece) if piece else []
        if not t:
            return
        m = [supervised] * len(t)
        m[0] = m[0] or mark_next
        mark_next = False
        ids.extend(t)
        mask.extend(m)

    pos = 0
    for start, end in spans:
        add(text[pos:start], False)
        add(text[start:end], True)
        mark_next, pos = True, end
    add(text[pos:], False)
    return Example(ids, mask)


def to_example(rec: dict, tokenizer: ChatTokenizer | None, where: str = "record") -> Example:
    if "input_ids" in rec:
        ids = rec["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise ValueError(f"{where}: input_ids must be a list of non-negative ints")
        mask = rec.get("loss_mask", [1] * len(ids))
        return Example(list(ids), [bool(m) for m in mask])
    if tokenizer is None:
        raise ValueError(f"{where}: 'text'/'messages' records need a tokenizer (--tokenizer DIR, or a target "
                         f"directory with tokenizer.json)")
    if "messages" in rec:
        try:
            return render_chat(rec["messages"], tokenizer)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if not isinstance(rec["text"], str):
        raise ValueError(f"{where}: 'text' must be a string")
    ids = tokenizer.encode(rec["text"])
    return Example(ids, [True] * len(ids))


def load_examples(path: str | Path, tokenizer: ChatTokenizer | None, max_len: int, min_len: int = 4) -> list[Example]:
    """Read, tokenize and truncate; sequences shorter than `min_len` or with nothing to learn are dropped."""
    out = []
    for i, rec in enumerate(read_jsonl(path)):
        ex = to_example(rec, tokenizer, f"{path} record {i}").truncate(max_len)
        if len(ex.input_ids) >= min_len and any(ex.loss_mask[2:]):
            out.append(ex)
    if not out:
        raise ValueError(f"no usable sequences in {path} (each needs at least {min_len} tokens and supervised tokens)")
    return out


def prompt_of(rec: dict, tokenizer: ChatTokenizer | None, prompt_tokens: int) -> list[int]:
    """The part of a record the target continues when regenerating: a chat up to its last assistant
    message (with the generation prompt), or the first `prompt_tokens` tokens of a text."""
    if "messages" in rec:
        if tokenizer is None:
            raise ValueError("regenerating chat records needs a tokenizer")
        msgs = list(rec["messages"])
        while msgs and msgs[-1].get("role") == "assistant":
            msgs.pop()
        if not msgs:
            raise ValueError("a chat record has no prompt before its assistant message")
        return tokenizer.encode(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
    ids = to_example(rec, tokenizer).input_ids
    return ids[:prompt_tokens]


# --------------------------------------------------------------------------------------------
# Regeneration by the target (greedy)
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_generate(target: GptOss, prompts: Sequence[list[int]], max_new_tokens: int,
                    stop_ids: Sequence[int] = (), batch_size: int = 16) -> list[list[int]]:
    """Greedy continuations with the cache-free forward (O(n^2) per sequence: fine at small scale).

    All unfinished sequences of a batch run as one flat varlen batch per new token.
    """
    device = target.lm_head.weight.device
    stop = set(stop_ids)
    outs: list[list[int]] = []
    for b in range(0, len(prompts), batch_size):
        seqs = [list(p) for p in prompts[b:b + batch_size]]
        new: list[list[int]] = [[] for _ in seqs]
        live = [i for i, p in enumerate(seqs) if p]
        for _ in range(max_new_tokens):
            if not live:
                break
            flat = torch.tensor([t for i in live for t in seqs[i]], device=device)
            lens = [len(seqs[i]) for i in live]
            hidden, _ = target(flat, ForwardMeta.for_sequences(lens, device))
            last = torch.tensor(lens, device=device).cumsum(0) - 1
            nxt = target.compute_logits(hidden[last]).argmax(-1).tolist()
            still = []
            for i, t in zip(live, nxt):
                seqs[i].append(t)
                new[i].append(t)
                if t not in stop:
                    still.append(i)
            live = still
        outs += new
    return outs


def regenerate(records: list[dict], target: GptOss, tokenizer: ChatTokenizer | None, max_new_tokens: int,
               max_len: int, stop_ids: Sequence[int] = (), prompt_tokens: int = 16, batch_size: int = 16) -> list[Example]:
    """Replace each record's response by the target's greedy continuation of its prompt.
    Only the generated tokens are supervised."""
    prompts = [prompt_of(r, tokenizer, prompt_tokens)[: max(max_len - 1, 1)] for r in records]
    budget = [min(max_new_tokens, max_len - len(p)) for p in prompts]
    conts = greedy_generate(target, prompts, max(budget), stop_ids, batch_size)
    out = []
    for p, c, n in zip(prompts, conts, budget):
        c = c[:n]
        ex = Example(p + c, [False] * len(p) + [True] * len(c))
        if len(ex.input_ids) >= 4 and any(ex.loss_mask[2:]):
            out.append(ex)
    if not out:
        raise ValueError("regeneration produced no usable sequences (prompts too long for --max-len?)")
    return out


# --------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------


def batches(examples: list[Example], batch_size: int, seed: int) -> Iterator[list[Example]]:
    """Endless shuffled epochs of `batch_size` examples (a reshuffle per epoch, deterministic in `seed`)."""
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            epoch = list(range(len(examples)))
            rng.shuffle(epoch)
            order += epoch
        yield [examples[i] for i in order[:batch_size]]
        order = order[batch_size:]
