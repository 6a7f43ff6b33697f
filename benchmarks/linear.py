"""cuBLAS (`torch.nn.functional.linear`) against the Triton skinny GEMM (`kernels.triton_linear`) at decode sizes.

    python benchmarks/linear.py --out "$OUT"                          # writes linear.json
    python benchmarks/linear.py --out "$OUT" --into gemm_m.json       # adds a "linear" key to that file instead
    python benchmarks/linear.py --out "$OUT" --splits 1,2,4,8,16 --block-n 32,64,128   # + forced plans

Shapes, bf16: GPT-OSS's attention projections, the same in 20B and 120B (hidden 2880; 64 query heads and 8 KV
heads of 64): qkv 2880 -> 5120 and o 4096 -> 2880, both with bias; their TP=2 shards (2880 -> 2560 and
2048 -> 2880); the P-EAGLE drafter's fc 8640 -> 2880 (no bias). M = 1, 2, 4, 8, 16 rows.

Each variant: 20 calls captured in one CUDA graph (launch costs amortised as in the engine's graphs), cycling
through enough weight copies that no call reads its weight from L2 (as gemm_m.py), best of five replays
(`moe_tiles.time_graph`). Bytes = weight + bias + x + out. Per row: `cublas_us`/`triton_us`, their TB/s and
fraction of `peak_tb_s` (this GPU's read bandwidth, a 2 GB `x.sum()` timed alike), `speedup` (cuBLAS time /
ours), `dispatch` (what `kernels.linear.linear` runs there), the plan, and with --splits/--block-n `forced`:
{"bn<block_n>/s<splits>": us} of the kernel with the plan forced. Prints a table: where cuBLAS is faster, the
dispatch rule in kernels/linear.py should keep it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels.triton_linear as tl_lin  # noqa: E402
from benchmarks.moe_tiles import time_graph  # noqa: E402
from kernels.linear import skinny  # noqa: E402

# (name, out features N, in features K, bias)
SHAPES = [("qkv", 5120, 2880, True), ("o", 2880, 4096, True), ("qkv tp2", 2560, 2880, True),
          ("o tp2", 2880, 2048, True), ("drafter fc", 2880, 8640, False)]
L2_FLUSH_BYTES = 200 << 20  # well past the H200's 50 MB L2
REPS = 20
DEVICE = "cuda"


def peak_read_tb_s() -> float:
    """Read bandwidth of a plain reduction over 2 GB (what a weight-streaming kernel can hope for)."""
    big = torch.empty(1 << 30, device=DEVICE, dtype=torch.bfloat16).fill_(1)
    us = time_graph(lambda: big.sum(), reps=5)
    return (2 << 30) / (us * 1e-6) / 1e12


def forced_plan(N: int, K: int, block_n: int, splits: int) -> tl_lin.Plan:
    """A plan with `splits` K slices (fewer if K has fewer chunks) of whole BLOCK_K chunks, as `plan` cuts them."""
    block_k = tl_lin.TILE_ROW_BYTES // 2
    chunks = triton.cdiv(K, block_k)
    per_slice = triton.cdiv(chunks, min(splits, chunks))
    return tl_lin.Plan(block_n, block_k, triton.cdiv(chunks, per_slice), per_slice * block_k)


def bench_shape(name: str, n: int, k: int, bias: bool, ms: list[int], forced: list[tuple[int, int]],
                peak: float) -> list[dict]:
    copies = max(1, math.ceil(L2_FLUSH_BYTES / (n * k * 2)))
    g = torch.Generator(device=DEVICE).manual_seed(n + k)
    weights = [(torch.randn(n, k, device=DEVICE, generator=g) * k ** -0.5).bfloat16() for _ in range(copies)]
    b = torch.randn(n, device=DEVICE, generator=g).bfloat16() if bias else None
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=DEVICE, generator=g).bfloat16()
        nbytes = (n * k + (n if bias else 0) + m * k + m * n) * 2

        def timed(fn) -> float:
            it = iter(range(1 << 62))
            return time_graph(lambda: fn(x, weights[next(it) % copies], b), reps=REPS)

        cublas_us = timed(torch.nn.functional.linear)
        triton_us = timed(tl_lin.linear_triton)
        p = tl_lin.plan(m, n, k, 2)
        row = {"shape": name, "M": m, "N": n, "K": k, "bias": bias, "cublas_us": cublas_us, "triton_us": triton_us,
               "cublas_tb_s": nbytes / cublas_us / 1e6, "triton_tb_s": nbytes / triton_us / 1e6,
               "speedup": cublas_us / triton_us, "dispatch": "triton" if skinny(x, weights[0], b) else "cublas",
               "plan": {"block_n": p.block_n, "block_k": p.block_k, "splits": p.splits, "slice_len": p.slice_len}}
        row["cublas_peak_frac"], row["triton_peak_frac"] = row["cublas_tb_s"] / peak, row["triton_tb_s"] / peak
        if forced:
            row["forced"] = {}
            for block_n, splits in forced:
                fp = forced_plan(n, k, block_n, splits)
                key = f"bn{fp.block_n}/s{fp.splits}"
                if key not in row["forced"]:
                    row["forced"][key] = timed(lambda xx, ww, bb, fp=fp: tl_lin.linear_triton(xx, ww, bb, plan_=fp))
        rows.append(row)
        print(f"{name:>10} M={m:<2} cuBLAS {cublas_us:6.2f} us {row['cublas_tb_s']:5.2f} TB/s | triton "
              f"{triton_us:6.2f} us {row['triton_tb_s']:5.2f} TB/s ({row['triton_peak_frac']:.0%} of peak) | "
              f"x{row['speedup']:.2f} | dispatch {row['dispatch']} | splits {p.splits}"
              + (f" | forced {row['forced']}" if forced else ""), flush=True)
    return rows


def write(out: Path, into: str | None, result: dict) -> Path:
    """linear.json, or `result` under the key "linear" of an existing JSON file (the bench section keeps $OUT
    within its file budget)."""
    out.mkdir(parents=True, exist_ok=True)
    if into is None:
        (out / "linear.json").write_text(json.dumps(result, indent=1))
        return out / "linear.json"
    path = out / into
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc["linear"] = result
    path.write_text(json.dumps(doc, indent=1))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,2,4,8,16", help="comma-separated row counts")
    ap.add_argument("--splits", default="", help="comma-separated K-slice counts to force (with --block-n)")
    ap.add_argument("--block-n", default="64", help="comma-separated BLOCK_N for forced plans")
    ap.add_argument("--into", default=None, help="add the results to this JSON file in --out instead of linear.json")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ms = [int(m) for m in a.m.split(",") if m]
    forced = [(int(bn), int(s)) for bn in a.block_n.split(",") if bn for s in a.splits.split(",") if s]
    peak = peak_read_tb_s()
    print(f"read bandwidth (2 GB x.sum()): {peak:.2f} TB/s", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "peak_tb_s": peak, "reps": REPS, "rows": []}
    for name, n, k, bias in SHAPES:
        result["rows"] += bench_shape(name, n, k, bias, ms, forced, peak)
        torch.cuda.empty_cache()  # the shape's weight copies
        path = write(Path(a.out), a.into, result)  # after every shape: a timeout keeps what ran
    slower = [f"{r['shape']} M={r['M']}" for r in result["rows"] if r["dispatch"] == "triton" and r["speedup"] < 1]
    print("triton slower than cuBLAS where dispatched:", ", ".join(slower) or "nowhere", flush=True)
    print("wrote", path)


if __name__ == "__main__":
    main()
