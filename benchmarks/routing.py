"""MoE routing on one GPU: PyTorch (linear + topk + softmax, then the pair sort) against ours (the same linear,
then one Triton launch for top-k, softmax and the sort).

    python benchmarks/routing.py --out "$OUT"

GPT-OSS router shapes in bf16 (H = 2880; E = 32 for 20B, 128 for 120B; top-4). Each variant is captured in a
CUDA graph of 20 calls (launch costs as in the engine) and timed with CUDA events. Writes routing.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.moe_tiles import time_graph  # noqa: E402
from kernels.moe import route_ref  # noqa: E402
from kernels.triton_moe import route_and_sort, sort_pairs_by_expert  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,4,16,64,512,4096")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for E in (32, 128):
        w = (torch.randn(E, 2880, device="cuda", generator=g) / 2880 ** 0.5).bfloat16()
        b = torch.randn(E, device="cuda", generator=g).bfloat16()
        for T in (int(t) for t in a.tokens.split(",")):
            x = torch.randn(T, 2880, device="cuda", generator=g).bfloat16()
            torch_us = time_graph(lambda: sort_pairs_by_expert(route_ref(x, w, b, 4)[1], E))
            triton_us = time_graph(lambda: route_and_sort(x, w, b, 4))
            rows.append({"E": E, "T": T, "torch_us": torch_us, "triton_us": triton_us})
            print(rows[-1], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
