"""`peagle train`: train a P-EAGLE (parallel) or EAGLE-3 (autoregressive) drafter head for a target.

    peagle train --target DIR --data FILE.jsonl --out DIR --method peagle --num-depths 8 --layers 4 \\
        --steps 1000 --sequence-partitions 4 --max-len 2048 --log-jsonl train.jsonl

Also runs standalone: `python -m peagle_core.training.cli [train] ...`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 2,12,21; got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one layer id")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    io = p.add_argument_group("inputs and outputs")
    io.add_argument("--target", required=True, help="target checkpoint directory (or 'tiny', or a Hub repo id)")
    io.add_argument("--data", required=True, help="JSONL: {'text'}, {'messages'} or {'input_ids'[, 'loss_mask']} per line")
    io.add_argument("--out", required=True, help="where the head is written (published EAGLE-3/P-EAGLE layout)")
    io.add_argument("--tokenizer", help="tokenizer directory (default: the target directory, if it has tokenizer.json)")
    io.add_argument("--log-jsonl", help="one JSON record per step (step, loss, per-depth acc, lr, tokens/s)")
    io.add_argument("--init", help="start from this drafter checkpoint instead of a fresh head")
    io.add_argument("--save-every", type=int, default=0, help="also write OUT/checkpoint-STEP every N steps")
    io.add_argument("--no-progress", action="store_true", help="no progress bar")

    m = p.add_argument_group("method")
    m.add_argument("--method", choices=["peagle", "eagle3"], default="peagle")
    m.add_argument("--num-depths", type=int, help="P-EAGLE: K_train parallel depths (default 8); "
                                                  "EAGLE-3: unrolled training-time-test steps (default 5)")
    m.add_argument("--layers", type=int, help="drafter layers (default: 4 for peagle, 1 for eagle3)")
    m.add_argument("--intermediate-size", type=int, help="drafter MLP width (default 4 x hidden)")
    m.add_argument("--aux-layers", type=_int_list, help="target layer ids whose input residuals feed the drafter "
                                                        "(default vLLM's 2,L/2,L-3)")
    m.add_argument("--mask-token-id", type=int, help="reserved token id for MASK slots (default: the tokenizer's "
                                                     "reserved mask/reserved special token, else the highest "
                                                     "id that is not an end/pad token)")
    m.add_argument("--cod-ratio", type=float, help="COD keep ratio r per depth (default 0.8 peagle, 1.0 eagle3)")
    m.add_argument("--cod-ratio-min", type=float, default=0.2, help="COD floor r_min")
    m.add_argument("--sequence-partitions", type=int, default=1, help="P-EAGLE: passes per sequence (memory / P^2)")
    m.add_argument("--pass-elements", type=int,
                   help="elements per drafter pass: shorter sequences are packed together up to it (default: on "
                        "cuda 16384, less for vocabularies above 8k, down to 4096; 1 on cpu, one sequence a pass)")
    m.add_argument("--compile", action="store_true",
                   help="torch.compile the drafter's forward and backward (fewer, fused kernels a pass; about a "
                        "minute of compilation first)")
    m.add_argument("--loss", choices=["kl", "ce"], default="kl", help="KL(target||draft) or CE vs target argmax")
    m.add_argument("--share-target-embeddings", action="store_true",
                   help="keep the embedding and LM head frozen at the target's and leave them out of the "
                        "checkpoint (smaller heads; loaders share the target's)")
    m.add_argument("--eagle3-feed", choices=["target", "draft"], default="target",
                   help="EAGLE-3: token fed to the next unrolled step (target greedy token or own draft)")

    o = p.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=1000)
    o.add_argument("--batch-size", type=int, default=1, help="sequences per optimizer step")
    o.add_argument("--lr", type=float, default=1e-4)
    o.add_argument("--warmup-ratio", type=float, default=0.0025)
    o.add_argument("--min-lr-ratio", type=float, default=0.0)
    o.add_argument("--weight-decay", type=float, default=0.0)
    o.add_argument("--grad-clip", type=float, default=1.0)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--time-budget-minutes", type=float,
                   help="fit --steps to this wall time (step time measured over the first steps)")
    o.add_argument("--max-len", type=int, default=2048, help="truncate sequences to this many tokens")

    r = p.add_argument_group("regeneration (train on the target's own responses)")
    r.add_argument("--regenerate", action="store_true", help="replace responses by the target's greedy output")
    r.add_argument("--regen-max-tokens", type=int, default=256)
    r.add_argument("--regen-prompt-tokens", type=int, default=16, help="prompt length taken from text records")

    d = p.add_argument_group("device")
    d.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    d.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16 on cuda, float32 on cpu")


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Register `train` on the `peagle` CLI's subparsers."""
    p = subparsers.add_parser("train", help="train a P-EAGLE or EAGLE-3 drafter head",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run_train)
    return p


def run_train(args: argparse.Namespace) -> int:
    """Entry point; user errors become one line on stderr and exit status 2."""
    from peagle_core.loading.checkpoint import CheckpointError

    try:
        summary = train_from_args(args)
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        print(f"peagle train: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def train_from_args(args: argparse.Namespace) -> dict:
    from peagle_core.loading.checkpoint import load_drafter, load_target
    from peagle_core.loading.hub import resolve
    from peagle_core.training import data as D
    from peagle_core.training.trainer import DTYPES, TrainConfig, Trainer, init_drafter

    if args.max_len < 4:
        raise ValueError(f"--max-len must be at least 4, got {args.max_len}")
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers must be at least 1, got {args.layers}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    torch.manual_seed(args.seed)

    target_dir = resolve(args.target)
    target = load_target(target_dir, DTYPES[dtype], device)
    tokenizer = None
    tok_dir = Path(args.tokenizer) if args.tokenizer else target_dir
    if args.tokenizer or (tok_dir / "tokenizer.json").exists():
        from peagle_core.loading.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_dir(tok_dir)

    if args.init:
        drafter = load_drafter(resolve(args.init), target, torch.float32, device)
        dc = drafter.config
        if args.mask_token_id is not None and args.mask_token_id != dc.mask_token_id:
            raise ValueError(f"--mask-token-id {args.mask_token_id} differs from --init's {dc.mask_token_id}")
        if args.aux_layers and args.aux_layers != dc.resolved_aux_layer_ids(target.config.num_hidden_layers):
            raise ValueError(f"--aux-layers {args.aux_layers} differ from --init's {dc.aux_layer_ids}")
    else:
        layers = args.layers or (4 if args.method == "peagle" else 1)
        special = tokenizer.special_token_ids if tokenizer is not None and hasattr(tokenizer, "special_token_ids") else None
        drafter = init_drafter(target, args.method, layers, args.seed, args.aux_layers, args.mask_token_id,
                               args.intermediate_size, device, special)
    aux = drafter.config.resolved_aux_layer_ids(target.config.num_hidden_layers)
    target.set_aux_layers(aux)

    if args.regenerate:
        stop = tokenizer.stop_token_ids if tokenizer is not None else target.config.eos_token_id
        examples = D.regenerate(D.read_jsonl(args.data), target, tokenizer, args.regen_max_tokens, args.max_len,
                                stop, args.regen_prompt_tokens)
    else:
        examples = D.load_examples(args.data, tokenizer, args.max_len)

    cfg = TrainConfig(method=args.method, num_depths=args.num_depths or (8 if args.method == "peagle" else 5),
                      steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_ratio=args.warmup_ratio,
                      min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                      cod_ratio=args.cod_ratio, cod_ratio_min=args.cod_ratio_min,
                      sequence_partitions=args.sequence_partitions, pass_elements=args.pass_elements,
                      loss=args.loss, feed=args.eagle3_feed,
                      seed=args.seed, dtype=dtype, share_target_embeddings=args.share_target_embeddings,
                      compile=args.compile,
                      time_budget_s=args.time_budget_minutes * 60 if args.time_budget_minutes else None)
    trainer = Trainer(target, drafter, examples, cfg)
    records = trainer.train(args.log_jsonl, progress=not args.no_progress, out=args.out, save_every=args.save_every)
    last = records[-1]
    return {"out": str(args.out), "method": cfg.method, "steps": last["step"], "loss": last["loss"],
            "acc": last["acc"], "sequences": len(examples), "mask_token_id": drafter.config.mask_token_id,
            "aux_layer_ids": aux}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="peagle train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_train(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
