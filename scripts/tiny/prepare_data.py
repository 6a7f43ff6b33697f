"""Prepare everything the GPU run of train_pair.py reads, offline, from packages on this machine.

Writes data/tiny_tokens.pt (the tokenized corpus), data/regen_prompts.jsonl (prompts whose answers
the target regenerates for drafter training) and data/heldout.json (MT-Bench questions and
HumanEval prompts, used only for evaluation).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def corpus_module():
    spec = importlib.util.spec_from_file_location("tiny_corpus", ROOT / "scripts/tiny/corpus.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


# A function header with its docstring, the way code-completion prompts end: the target then writes the body.
DOCSTRING_DEF = re.compile(r'(?m)^[ \t]*def \w+\([^)]*\)[^:\n]*:\n[ \t]+("""|\'\'\')[\s\S]{10,600}?\1\n')


def documented_defs(corpus: Path):
    """(text, match) for each documented function header in the corpus's Python source, in corpus order."""
    for line in corpus.open():
        text = json.loads(line).get("text", "")
        for m in DOCSTRING_DEF.finditer(text):
            yield text, m


def code_prompts(corpus: Path, n: int, rng: random.Random) -> list[dict]:
    """Up to n prompts from the corpus's Python source: some preceding context, then `def ...:` and its
    docstring. Drawn from the training corpus (HumanEval itself stays held out)."""
    found = [{"text": text[max(0, m.start() - 200):m.end()]} for text, m in documented_defs(corpus)]
    rng.shuffle(found)
    return found[:n]


def body_prompts(corpus: Path, n: int, rng: random.Random, cuts: int = 2) -> list[dict]:
    """Up to n prompts that stop `cuts` random depths (1-8 lines) past a documented function's docstring, each at a
    non-blank line: the target continues real code mid-function (or just past a short one), contexts the docstring
    prompts never reach."""
    if n <= 0:
        return []  # draws nothing, so the default prompt set stays what it was
    found = []
    for text, m in documented_defs(corpus):
        body = text[m.end():m.end() + 2000].split("\n")
        for lines in rng.sample(range(1, 9), cuts):
            if lines < len(body) and body[lines - 1].strip():
                found.append({"text": text[max(0, m.start() - 200):m.end()] + "\n".join(body[:lines]) + "\n"})
    rng.shuffle(found)
    return found[:n]


def chat_prompts(doc: dict, turns: int, with_history: bool) -> list[dict]:
    """A chat's first `turns` user turns as prompts; with_history, its later user turns each with the
    conversation before them (ShareGPT's own replies), so the target answers in contexts the first turns lack."""
    msgs = [m for m in doc["messages"] if m["role"] in ("user", "assistant")]
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    if not with_history:
        return [{"messages": [{"role": "user", "content": msgs[i]["content"]}]} for i in users[:turns]
                if 8 < len(msgs[i]["content"]) < 2000]
    # the history is cut from the front to ~2000 characters (the regeneration keeps at most 640 tokens)
    out = []
    for i in users[1:turns + 1]:
        if 8 < len(msgs[i]["content"]) < 2000:
            start, chars = i, len(msgs[i]["content"])
            while start > 0 and chars + len(msgs[start - 1]["content"]) < 2000:
                start -= 1
                chars += len(msgs[start]["content"])
            start += msgs[start]["role"] == "assistant"  # a chat opens with a user turn
            out.append({"messages": [{"role": m["role"], "content": m["content"]} for m in msgs[start:i + 1]]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="data")
    ap.add_argument("--corpus", default="data/tiny_corpus.jsonl")
    ap.add_argument("--num-prompts", type=int, default=4096)
    ap.add_argument("--num-code-prompts", type=int, default=2048,
                    help="extra prompts ending after a Python function's signature and docstring")
    ap.add_argument("--per-doc", type=int, default=1,
                    help="prompts drawn from each corpus document: its first N user turns, or N text windows")
    ap.add_argument("--chat-history", action="store_true",
                    help="chat prompts are the N user turns after the first, each with the conversation before it")
    ap.add_argument("--num-body-prompts", type=int, default=0,
                    help="extra prompts ending 1-8 lines past a documented Python function's docstring")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = Path(args.corpus)
    if not corpus.exists():
        subprocess.run([sys.executable, "scripts/tiny/corpus.py", "--out", str(corpus)], check=True, cwd=ROOT)
    if not (out / "tiny_tokens.pt").exists():
        subprocess.run([sys.executable, "scripts/tiny/tokenize_corpus.py", "--corpus", str(corpus),
                        "--out", str(out / "tiny_tokens.pt")], check=True, cwd=ROOT)
    rng = random.Random(args.seed)
    prompts = []
    for line in corpus.open():
        doc = json.loads(line)
        if "messages" in doc:
            prompts += chat_prompts(doc, args.per_doc, args.chat_history)
        else:
            for _ in range(args.per_doc):
                start = rng.randrange(0, max(1, len(doc["text"]) - 400))
                prompts.append({"text": doc["text"][start:start + 300]})
    rng.shuffle(prompts)
    prompts = (prompts[:args.num_prompts] + code_prompts(corpus, args.num_code_prompts, rng)
               + body_prompts(corpus, args.num_body_prompts, rng))
    rng.shuffle(prompts)
    with (out / "regen_prompts.jsonl").open("w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    mod = corpus_module()
    heldout = {"mtbench": mod.load_heldout("mtbench"), "humaneval": mod.load_heldout("humaneval")}
    (out / "heldout.json").write_text(json.dumps(heldout))
    print({k: len(v) for k, v in heldout.items()}, len(prompts), "regeneration prompts")


if __name__ == "__main__":
    main()
