"""Train the shipped tiny pair end to end on one GPU: target, then P-EAGLE and EAGLE-3 heads.

    python scripts/tiny/prepare_data.py            # on any machine: corpus tokens, prompts, held-out sets
    python scripts/tiny/train_pair.py --out out/tiny --pretrain-minutes 4

Steps: (1) pretrain the target (scripts/tiny/pretrain.py); (2) regenerate responses to corpus
prompts with the target itself through our engine (the paper trains drafters on target outputs);
(3) train both heads with `peagle train`; (4) measure acceptance on the held-out MT-Bench and
HumanEval prompts. Every step logs; the result is a directory ready for peagle_core/assets/tiny.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def run(*cmds: list[str]) -> float:
    """Run the commands side by side, one GPU each when there are enough (else they share); fail if any fails."""
    t0 = time.time()
    procs = []
    gpus = torch.cuda.device_count()
    for i, cmd in enumerate(cmds):
        print("+", " ".join(cmd), flush=True)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i)) if len(cmds) > 1 and gpus >= len(cmds) else None
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a training command failed (exit codes {codes})")
    return time.time() - t0


def regenerate(target: Path, prompts_file: Path, out: Path, max_tokens: int, limit: int, shard: tuple[int, int] = (0, 1),
               minutes: float | None = None, batch: int = 128) -> dict:
    """Target-generated responses: {"input_ids", "loss_mask"} records for `peagle train`.

    `shard` (i, n) takes every n-th prompt from the i-th (one process per GPU); `minutes` stops after the chunk
    that passes the time budget (the prompts are shuffled, so what finishes is a random subset)."""
    from peagle_core import LLM, SamplingParams

    llm = LLM(str(target), max_num_seqs=batch, max_model_len=1024)
    recs = [json.loads(line) for line in prompts_file.open()][:limit][shard[0]::shard[1]]
    prompts = [llm.tokenizer.apply_chat_template(r["messages"]) if "messages" in r else r["text"] for r in recs]
    prompt_ids = [llm.tokenizer.encode(p)[-640:] for p in prompts]
    t0, n_tok, n_rec = time.time(), 0, 0
    with out.open("w") as f:
        for start in range(0, len(prompt_ids), 8 * batch):
            chunk = prompt_ids[start:start + 8 * batch]
            outs = llm.generate(chunk, SamplingParams(temperature=0.0, max_tokens=max_tokens))
            for p, o in zip(chunk, outs):
                resp = o.outputs[0].token_ids
                n_tok, n_rec = n_tok + len(resp), n_rec + 1
                f.write(json.dumps({"input_ids": p + resp, "loss_mask": [0] * len(p) + [1] * len(resp)}) + "\n")
            print(f"regenerated {n_rec}/{len(prompt_ids)} ({n_tok} tokens, {time.time() - t0:.0f} s)", flush=True)
            if minutes and time.time() - t0 > minutes * 60:
                break
    return {"records": n_rec, "generated_tokens": n_tok, "seconds": time.time() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data", help="folder written by prepare_data.py")
    ap.add_argument("--out", default="out/tiny")
    ap.add_argument("--target", help="an already trained target directory: skip pretraining")
    ap.add_argument("--regen-data", help="already regenerated responses (JSONL): skip regeneration")
    ap.add_argument("--stop-after", choices=["regen", "heads", "eval"], default="eval")
    ap.add_argument("--pretrain-minutes", type=float, default=4.0)
    ap.add_argument("--regen-prompts", type=int, default=6144)
    ap.add_argument("--regen-tokens", type=int, default=160)
    ap.add_argument("--regen-shard", default="0/1", help="I/N: regenerate every N-th prompt from the I-th")
    ap.add_argument("--regen-minutes", type=float, help="stop regenerating after about this long")
    ap.add_argument("--regen-batch", type=int, default=128, help="the engine's max_num_seqs while regenerating")
    ap.add_argument("--head-steps", type=int, default=600)
    ap.add_argument("--head-minutes", type=float, help="fit the head steps to this wall time")
    ap.add_argument("--head-batch-size", type=int, default=16, help="sequences per head optimizer step")
    ap.add_argument("--head-lr", type=float, default=1e-3)
    ap.add_argument("--head-pass-elements", type=int, help="elements per drafter pass (`peagle train --pass-elements`; "
                    "default: its own, 16384 on a GPU for this vocabulary)")
    ap.add_argument("--head-compile", action="store_true", help="torch.compile the heads (`peagle train --compile`)")
    ap.add_argument("--aux-layers", default="1,3,5", help="target layer ids whose input residuals feed the heads "
                    "(6 = the target's last residual)")
    ap.add_argument("--peagle-layers", type=int, default=2, help="P-EAGLE head layers (each ~1.7 MB in bf16 at this "
                    "width; the package holds 40 MB in all: 4 fit)")
    ap.add_argument("--init-heads", help="a pair directory whose peagle/ and eagle3/ heads the training continues "
                    "from (`peagle train --init`; their layers, aux layers and mask token then hold)")
    ap.add_argument("--eval-tokens", type=int, default=128)
    args = ap.parse_args()
    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "torch": torch.__version__, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    py = sys.executable
    target = Path(args.target) if args.target else out / "target"
    if not args.target:
        report["pretrain_s"] = run([py, "scripts/tiny/pretrain.py", "--tokens", str(data / "tiny_tokens.pt"),
                                    "--out", str(target), "--minutes", str(args.pretrain_minutes)])
    regen = Path(args.regen_data) if args.regen_data else out / "regen.jsonl"
    if not args.regen_data:
        shard = tuple(int(v) for v in args.regen_shard.split("/"))
        report["regenerate"] = regenerate(target, data / "regen_prompts.jsonl", regen, args.regen_tokens,
                                          args.regen_prompts, shard, args.regen_minutes, args.regen_batch)
    if args.stop_after == "regen":
        return finish(out, report)
    heads = {"peagle": out / "peagle", "eagle3": out / "eagle3"}
    common = ["--target", str(target), "--data", str(regen), "--steps", str(args.head_steps),
              "--batch-size", str(args.head_batch_size), "--max-len", "896", "--lr", str(args.head_lr), "--warmup-ratio", "0.05",
              "--aux-layers", args.aux_layers, "--intermediate-size", "768", "--share-target-embeddings", "--no-progress"]
    if args.head_minutes:
        common += ["--time-budget-minutes", str(args.head_minutes)]
    if args.head_pass_elements:
        common += ["--pass-elements", str(args.head_pass_elements)]
    if args.head_compile:
        common += ["--compile"]
    def init(method: str) -> list[str]:  # continue from earlier heads (several calls of a time-limited machine)
        return ["--init", str(Path(args.init_heads) / method)] if args.init_heads else []
    report["heads_train_s"] = run(
        [py, "-m", "peagle_core.training.cli", "train", *common, "--method", "peagle", "--num-depths", "8",
         "--layers", str(args.peagle_layers), "--mask-token-id", "9", *init("peagle"), "--out", str(heads["peagle"]),
         "--log-jsonl", str(out / "peagle_train.jsonl")],
        [py, "-m", "peagle_core.training.cli", "train", *common, "--method", "eagle3", "--num-depths", "5",
         "--layers", "1", *init("eagle3"), "--out", str(heads["eagle3"]), "--log-jsonl", str(out / "eagle3_train.jsonl")])
    if args.stop_after == "heads":
        return finish(out, report)
    report["eval_s"] = run([py, "scripts/tiny/evaluate.py", "--pair", str(out), "--prompts", "80",
                            "--max-tokens", str(args.eval_tokens), "--out", str(out / "eval"),
                            "--device", "cuda" if torch.cuda.is_available() else "cpu"])
    finish(out, report)


def finish(out: Path, report: dict) -> None:
    (out / "train_report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
