"""Tokenize the tiny corpus once on the CPU (chats through the harmony template) into a uint16 tensor."""
from __future__ import annotations

import argparse
import json

import torch
from tqdm.auto import tqdm

from peagle_core.loading.tokenizer import Tokenizer
from peagle_core.tiny import ASSETS


def render(doc: dict, tok: Tokenizer) -> str:
    if "messages" in doc:
        text = tok.apply_chat_template(doc["messages"], add_generation_prompt=False)
        head, sep, tail = text.rpartition("<|end|>")  # the final answer ends the turn
        return head + "<|return|>" + tail if sep else text
    return doc["text"] + "<|endoftext|>"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tok = Tokenizer.from_dir(ASSETS)
    ids: list[int] = []
    with open(args.corpus) as f:
        for line in tqdm(f, desc="tokenize"):
            ids += tok.encode(render(json.loads(line), tok))
    torch.save(torch.tensor(ids, dtype=torch.int16 if tok.vocab_size <= 32767 else torch.int32), args.out)
    print(f"{len(ids)} tokens -> {args.out}")


if __name__ == "__main__":
    main()
