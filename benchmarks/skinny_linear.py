"""The attention projections at decode sizes: cuBLAS `F.linear` against the Triton skinny GEMM (`peagle_kernels.linear`).

    python benchmarks/skinny_linear.py --out "$OUT"     # one H200, about a minute

For GPT-OSS-20B's q/k/v (N 5120, K 2880) and o (N 2880, K 4096) projections, with biases, and the tiny
target's, at M = 1, 8, 16 rows: cuBLAS, then `linear_triton` with each launch shape of TILES (the shipped
`SHIPPED_TILES` marked). Calls captured in a CUDA graph back to back, as a decode graph runs them,
cycling through enough weight copies that none is read from L2; best of five replays (`peagle_core.timing.time_graph`).
Writes skinny_linear.json and skinny_linear.md (microseconds, read bandwidth, the best shape per row).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peagle_kernels.linear import takes_skinny  # noqa: E402
from peagle_kernels.triton_linear import SHIPPED_TILES, LinearTiles, linear_triton  # noqa: E402
from peagle_core.timing import time_graph  # noqa: E402

# GPT-OSS-20B/120B attention (hidden 2880, 64 q heads and 8 kv heads of 64), the same at TP = 2, the tiny target's
SHAPES = [("20b qkv", 5120, 2880), ("20b o", 2880, 4096), ("tp2 qkv", 2560, 2880), ("tp2 o", 2880, 2048),
          ("tiny qkv", 384, 256), ("tiny o", 256, 256)]
# around a wider first sweep's best (16 columns, K steps of 256, two warps)
TILES = [LinearTiles(*t) for t in ((16, 256, 2, 4), (16, 256, 1, 4), (16, 256, 2, 3), (16, 256, 2, 6),
                                   (16, 512, 2, 3), (16, 512, 2, 4), (16, 512, 1, 3), (16, 128, 1, 6),
                                   (16, 128, 2, 8), (32, 256, 2, 4), (32, 512, 4, 3), (16, 256, 4, 4))]

L2_FLUSH_BYTES = 200 << 20  # well past the H200's 50 MB L2


def cold_weights(n: int, k: int, scale: float = 1.0) -> list[torch.Tensor]:
    """Enough bf16 [n, k] weight copies that cycling through them reads none from L2."""
    copies = max(1, math.ceil(L2_FLUSH_BYTES / (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * scale for _ in range(copies)]


def time_cold(call, weights: list[torch.Tensor]) -> float:
    """Microseconds of `call(w)` back to back in a CUDA graph, cycling through `weights` (`cold_weights`)."""
    it = iter(range(1 << 62))
    return time_graph(lambda: call(weights[next(it) % len(weights)]), torch.device("cuda"), reps=2 * len(weights))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    for name, n, k in SHAPES:
        nbytes = n * k * 2
        weights = cold_weights(n, k, k ** -0.5)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for m in map(int, a.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = time_cold(lambda w: F.linear(x, w, bias), weights)
            row = {"shape": name, "N": n, "K": k, "M": m, "cublas_us": cublas, "triton_us": {},
                   "engine_takes": "triton" if takes_skinny(n, k) else "cublas"}
            for t in TILES:
                row["triton_us"][_name(t)] = time_cold(lambda w: linear_triton(x, w, bias, t), weights)
            best = min(row["triton_us"], key=row["triton_us"].get)
            row |= {"best": best, "best_us": row["triton_us"][best], "shipped": _name(SHIPPED_TILES),
                    "weight_bytes": nbytes}
            rows.append(row)
            print(f"{name} M={m}: cuBLAS {cublas:.2f} us, shipped {row['triton_us'][row['shipped']]:.2f} us, "
                  f"best {best} {row['best_us']:.2f} us; the engine takes {row['engine_takes']}", flush=True)
        del weights
        torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": date.today().isoformat(),
            "command": "python benchmarks/skinny_linear.py --out $OUT"}
    (out / "skinny_linear.json").write_text(json.dumps(meta | {"rows": rows}, indent=1))
    (out / "skinny_linear.md").write_text(render(meta, rows))


def _name(t: LinearTiles) -> str:
    return f"n{t.block_n}_k{t.block_k}_w{t.num_warps}_s{t.num_stages}"


def render(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Attention projections at decode sizes: cuBLAS against the skinny Triton GEMM", "",
             f"Machine: {meta['gpu']}; torch {meta['torch']}; {meta['date']}.", "", f"Command: `{meta['command']}`", "",
             "Microseconds a call, back to back in a CUDA graph, weights never in L2 (TB/s: weight bytes read).", "",
             "| shape | M | cuBLAS us (TB/s) | shipped tiles us (TB/s) | best tiles | best us | engine takes |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        tb = lambda us: r["weight_bytes"] / (us * 1e-6) / 1e12  # noqa: E731
        shipped = r["triton_us"][r["shipped"]]
        lines.append(f"| {r['shape']} | {r['M']} | {r['cublas_us']:.2f} ({tb(r['cublas_us']):.2f}) | {shipped:.2f} "
                     f"({tb(shipped):.2f}) | {r['best']} | {r['best_us']:.2f} | {r['engine_takes']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
