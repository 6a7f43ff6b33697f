"""cuBLAS `F.linear` time against the number of tokens M, at the P-EAGLE drafter's shapes (bf16, one GPU).

    python benchmarks/gemm_m.py --out "$OUT"

A P-EAGLE step drafts K tokens in one forward over 2K slots, so its GEMMs run at M = 2..14 (bs 1). Every one of
them is bound by reading the weight, so its time should stay flat in M; `peagle bench` found the K = 7 step
1.25x the K = 1 step, with a jump between 4 and 6 slots. This times each drafter GEMM shape (the 20B-shaped
head of `peagle bench`: hidden 2880, 64 heads of 64, 8 KV heads, MLP 14336, vocabulary 201088) at M = 1..16:
calls captured in a CUDA graph, cycling through enough weight copies that none is read from L2, best of five
replays. Writes gemm_m.json (microseconds and read bandwidth per shape and M).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.moe_tiles import time_graph  # noqa: E402

# (name, out features N, in features K) of one drafter layer, plus its input fc and the LM head
SHAPES = [("qkv", 4096 + 2 * 512, 2880), ("o_proj", 2880, 4096), ("gate/up", 14336, 2880),
          ("down", 2880, 14336), ("fc", 2880, 3 * 2880), ("lm_head", 201088, 2880)]
L2_FLUSH_BYTES = 200 << 20  # well past the H200's 50 MB L2


def cold_weights(n: int, k: int, scale: float = 1.0) -> list[torch.Tensor]:
    """Enough bf16 [n, k] weight copies that cycling through them reads none from L2."""
    copies = max(1, math.ceil(L2_FLUSH_BYTES / (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * scale for _ in range(copies)]


def time_cold(call, weights: list[torch.Tensor]) -> float:
    """Microseconds of `call(w)` back to back in a CUDA graph, cycling through `weights` (`cold_weights`)."""
    it = iter(range(1 << 62))
    return time_graph(lambda: call(weights[next(it) % len(weights)]), reps=2 * len(weights))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-m", type=int, default=16)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    for name, n, k in SHAPES:
        nbytes = n * k * 2
        weights = cold_weights(n, k)
        for m in range(1, a.max_m + 1):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = time_cold(lambda w: torch.nn.functional.linear(x, w), weights)
            rows.append({"shape": name, "N": n, "K": k, "M": m, "us": us, "tb_s": nbytes / (us * 1e-6) / 1e12})
            print(rows[-1], flush=True)
        del weights
        torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_m.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                 "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
