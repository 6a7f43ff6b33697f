"""MoE routing on one GPU: PyTorch (linear + topk + softmax, then the pair sort) against ours (up to 64 tokens one
Triton launch for the logits, top-k, softmax and the sort; beyond, cuBLAS's linear then one launch for the rest).

    python benchmarks/routing.py --out "$OUT"
    python benchmarks/routing.py --out "$OUT" --tokens 8,64 --splits 1,2,4,8   # + hidden-slice counts forced

GPT-OSS router shapes in bf16 (H = 2880; E = 32 for 20B, 128 for 120B; top-4). Each variant is captured in a
CUDA graph of 20 calls (launch costs as in the engine) and timed with CUDA events. Per row: `path` (`one launch`
or `linear + route`, as `peagle_kernels.triton_routing.one_launch` picks), `torch_us` (the reference), `triton_us`
(ours), `linear_us` (cuBLAS's router linear alone, what the one-launch path replaced along with the routing
launch), `weight_gb_s` (router weight bytes / triton_us) and, with --splits, `split_us` {slices: us} of the
one-launch path with `logit_splits` forced. Writes routing.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import peagle_kernels.triton_routing as tr  # noqa: E402
from benchmarks.moe_tiles import time_graph  # noqa: E402
from peagle_kernels.moe import route_ref  # noqa: E402
from peagle_kernels.triton_moe import route_and_sort, sort_pairs_by_expert  # noqa: E402

H, TOP_K = 2880, 4


def forced_splits(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, splits: list[int]) -> dict[int, float]:
    """Microseconds of the one-launch path with each hidden-slice count forced (`logit_splits` patched)."""
    shipped, times = tr.logit_splits, {}
    try:
        for s in splits:
            tr.logit_splits = lambda *_, s=s: s
            times[s] = time_graph(lambda: route_and_sort(x, w, b, TOP_K))
    finally:
        tr.logit_splits = shipped
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,32,64,512,4096")
    ap.add_argument("--splits", default="", help="comma-separated hidden-slice counts to force at one-launch sizes")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    splits = [int(s) for s in a.splits.split(",") if s]
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for E in (32, 128):
        w = (torch.randn(E, H, device="cuda", generator=g) / H ** 0.5).bfloat16()
        b = torch.randn(E, device="cuda", generator=g).bfloat16()
        for T in (int(t) for t in a.tokens.split(",")):
            x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
            one = tr.one_launch(T, E, TOP_K)
            torch_us = time_graph(lambda: sort_pairs_by_expert(route_ref(x, w, b, TOP_K)[1], E))
            triton_us = time_graph(lambda: route_and_sort(x, w, b, TOP_K))
            linear_us = time_graph(lambda: torch.nn.functional.linear(x, w, b))
            row = {"E": E, "T": T, "path": "one launch" if one else "linear + route", "torch_us": torch_us,
                   "triton_us": triton_us, "linear_us": linear_us,
                   "weight_gb_s": w.numel() * w.element_size() / triton_us / 1e3}
            if one:
                row["logit_splits"] = tr.logit_splits(T, E, H, x.element_size())
                if splits:
                    row["split_us"] = forced_splits(x, w, b, splits)
            rows.append(row)
            print(row, flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
