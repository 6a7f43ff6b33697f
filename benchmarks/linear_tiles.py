"""Decode-sized linear on the GPU: cuBLAS (`torch.nn.functional.linear`) against the Triton GEMV
(`kernels/triton_linear.py`) over a grid of tiles, at the GPT-OSS-20B projection shapes.

    python benchmarks/linear_tiles.py --out "$OUT"     # writes linear_tiles.json and linear_tiles.md

Each cell is the median of CUDA-event timings of 20 back-to-back calls (bf16, bias), in microseconds,
with the weight's bytes over that time (TB/s).
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch

SHAPES = [(4096, 2880, "q_proj"), (512, 2880, "k/v_proj"), (2880, 4096, "o_proj"), (32, 2880, "router")]
TILES = [(bn, bk, w, 4) for bn, bk, w in itertools.product((16, 32, 64), (128, 256, 512), (4, 8))]


def time_us(fn, reps: int = 20, trials: int = 15) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from kernels.triton_linear import linear_triton

    rows = [int(r) for r in a.rows.split(",")]
    results = []
    for (N, K, name), M in itertools.product(SHAPES, rows):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = torch.nn.functional.linear(x, w, b)
        row = {"name": name, "M": M, "N": N, "K": K, "cublas_us": time_us(lambda: torch.nn.functional.linear(x, w, b))}
        triton_us = {}
        for t in TILES:
            try:
                err = (linear_triton(x, w, b, tiles=t).float() - ref.float()).abs().max().item()
                triton_us[str(t)] = time_us(lambda: linear_triton(x, w, b, tiles=t)) if err < 0.1 else None
            except Exception as e:  # a tile the compiler rejects (registers, shared memory)
                triton_us[str(t)] = None
                print(f"{name} M={M} tiles {t}: {type(e).__name__}")
        ok = {k: v for k, v in triton_us.items() if v is not None}
        best = min(ok, key=ok.get)
        row.update(triton_us=triton_us, best_tiles=best, best_us=ok[best],
                   best_tb_s=N * K * 2 / ok[best] / 1e6, cublas_tb_s=N * K * 2 / row["cublas_us"] / 1e6)
        results.append(row)
        print(f"{name:>9} M={M:<2} cuBLAS {row['cublas_us']:7.2f} us  best Triton {ok[best]:7.2f} us {best}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "linear_tiles.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                      "results": results}, indent=1))
    lines = ["# Decode-sized linear: cuBLAS vs Triton GEMV tiles (bf16, bias)", "",
             f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}. "
             "Command: `python benchmarks/linear_tiles.py --out OUT`", "",
             "| proj | M | N x K | cuBLAS us (TB/s) | best Triton us (TB/s) | tiles (BLOCK_N, BLOCK_K, warps, stages) |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['name']} | {r['M']} | {r['N']} x {r['K']} | {r['cublas_us']:.2f} ({r['cublas_tb_s']:.2f}) | "
              f"{r['best_us']:.2f} ({r['best_tb_s']:.2f}) | {r['best_tiles']} |" for r in results]
    (out / "linear_tiles.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
