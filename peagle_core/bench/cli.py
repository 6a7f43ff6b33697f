"""`peagle bench`'s flags, their checks and defaults, and the entry point."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from peagle_kernels import set_triton_enabled, triton_enabled
from peagle_core.bench.batches import Layout
from peagle_core.bench.models import DTYPES, target_config
from peagle_core.bench.session import Bench


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`peagle bench`'s flags (the `peagle` CLI and the tests build their parsers with it)."""
    p.add_argument("--shape", choices=["tiny", "20b", "120b"], default="20b",
                   help="20b: every measurement, then the 120B bs-1 decode figures; 120b: only those; "
                        "tiny: the shipped tiny architecture (CPU smoke run)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--out", default="docs/benchmarks", help="directory for summary.json and summary.md")
    p.add_argument("--context", type=int, help="tokens already in each request's cache (default 1024; tiny 64)")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 32, 64], help="decode batch sizes (must include 1)")
    p.add_argument("--max-k", type=int, default=7, help="verify depths k and drafter K run 1..max-k")
    p.add_argument("--warmup", type=int, help="untimed calls before each measurement (default: 5 on CUDA, 1 on CPU)")
    p.add_argument("--iters", type=int, help="timed calls per measurement, median reported (default: 30 CUDA, 3 CPU)")
    p.add_argument("--hf-tokens", type=int, help="tokens transformers generates (default: 64 CUDA, 8 CPU)")
    p.add_argument("--hf-experts", help="transformers experts_implementation (default: transformers' own choice)")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers comparison")
    p.add_argument("--skip-draft", action="store_true", help="skip the drafter timings")
    p.add_argument("--skip-120b", action="store_true", help="with --shape 20b/tiny: skip the 120B section")
    p.add_argument("--layers", type=int,
                   help="120B section depth: run a model truncated to N layers and extrapolate (default: the "
                        "full depth if it fits, else the deepest that fits; 0: record as not run)")
    p.add_argument("--no-triton", action="store_true", help="force the PyTorch reference kernels")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (by default decode-shaped steps replay "
                                                       "graphs on CUDA with the Triton kernels)")
    p.add_argument("--seed", type=int, default=0)


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Validate the arguments and fill defaults that depend on the device."""
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r} (use cuda or cpu)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"unsupported device {name!r} (use cuda or cpu)")
    gpu = device.type == "cuda"
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if gpu else torch.float32)
    context = args.context if args.context is not None else (64 if args.shape == "tiny" else 1024)
    r = {"device": device, "dtype": dtype, "context": context, "batch_sizes": sorted(set(args.batch_sizes)),
         "max_k": args.max_k, "warmup": args.warmup if args.warmup is not None else (5 if gpu else 1),
         "iters": args.iters if args.iters is not None else (30 if gpu else 3),
         "hf_tokens": args.hf_tokens if args.hf_tokens is not None else (64 if gpu else 8)}
    if context < 1:
        raise ValueError(f"--context must be at least 1, got {context}")
    if 1 not in r["batch_sizes"]:
        raise ValueError(f"--batch-sizes must include 1 (the bs-1 figures need it), got {args.batch_sizes}")
    if not 1 <= r["max_k"] <= 16:
        raise ValueError(f"--max-k must be in 1..16, got {r['max_k']}")
    if r["warmup"] < 0 or r["iters"] < 1 or r["hf_tokens"] < 2:
        raise ValueError("--warmup must be >= 0, --iters >= 1 and --hf-tokens >= 2")
    if args.layers is not None and args.layers < 0:
        raise ValueError(f"--layers must be >= 0, got {args.layers}")
    limit = target_config(args.shape).max_position_embeddings
    if Layout.for_run(context, r["max_k"], r["hf_tokens"]).max_model_len > limit:
        raise ValueError(f"--context {context} leaves no room for generation under max_position_embeddings={limit}")
    return r


def run(args: argparse.Namespace) -> int:
    """`peagle bench`: every section in one run; writes summary.json and summary.md into --out."""
    r = resolve(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    previous_triton = triton_enabled()
    if args.no_triton:
        set_triton_enabled(False)
    try:
        Bench(args, r, out).run()
    finally:
        set_triton_enabled(previous_triton)
    return 0
