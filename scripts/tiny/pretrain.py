"""Pretrain the tiny GPT-OSS target on the shipped-package corpus (one command, fixed seeds).

    python scripts/tiny/tokenize_corpus.py --corpus data/tiny_corpus.jsonl --out data/tiny_tokens.pt
    python scripts/tiny/pretrain.py --tokens data/tiny_tokens.pt --out out/tiny/target --minutes 5

Chats are rendered with the harmony template (so the model learns the chat format and to end its
answer with <|return|>), code as plain text. Packed sequences of --seq-len tokens, AdamW with
warmup + cosine decay, bf16 autocast on CUDA; writes a Hugging Face GPT-OSS checkpoint plus the
tokenizer files, and a JSON log.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from peagle_core.loading.checkpoint import init_random_, save_target
from peagle_core.models.gpt_oss import GptOss
from peagle_core.models.layers import ForwardMeta
from peagle_core.tiny import ASSETS, TOKENIZER_FILES, target_config


def batches(tokens: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator):
    n = (tokens.numel() - 1) // seq_len
    while True:
        for idx in torch.randperm(n, generator=gen).split(batch):
            if len(idx) < batch:
                break
            starts = idx * seq_len
            rows = torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()]).long()
            yield rows[:, :-1], rows[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=5.0, help="wall-clock budget for the optimisation loop")
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    dev = torch.device(args.device)
    tokens = torch.load(args.tokens)
    model = init_random_(GptOss(target_config()), seed=args.seed, std=0.02).to(dev).train()
    with torch.no_grad():  # a small output layer at start keeps the first steps stable
        model.lm_head.weight.mul_(0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup, budget = 100, args.minutes * 60
    meta = ForwardMeta.for_sequences([args.seq_len] * args.batch, dev)
    log, t0, step = [], time.time(), 0
    bar = tqdm(total=args.max_steps, desc="pretrain")
    for x, y in batches(tokens, args.seq_len, args.batch, gen):
        elapsed = time.time() - t0
        if step >= args.max_steps or elapsed > budget:
            break
        frac = min(elapsed / budget, step / args.max_steps)
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            h, _ = model(x.flatten().to(dev), meta)
            logits = model.compute_logits(h).float()
        loss = torch.nn.functional.cross_entropy(logits, y.flatten().to(dev))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 20 == 0:
            log.append({"step": step, "loss": loss.item(), "lr": lr, "elapsed_s": time.time() - t0})
            bar.set_postfix(loss=f"{log[-1]['loss']:.3f}")
        bar.update(1)
    bar.close()
    out = Path(args.out)
    save_target(model.to(torch.bfloat16).cpu().eval(), out)
    for f in TOKENIZER_FILES:
        shutil.copy(ASSETS / f, out / f)
    (out / "pretrain_log.json").write_text(json.dumps({"args": vars(args), "steps": step,
                                                        "seconds": time.time() - t0, "log": log}, indent=1))
    print(f"saved {out} after {step} steps, final loss {log[-1]['loss'] if log else float('nan'):.3f}")


if __name__ == "__main__":
    main()
