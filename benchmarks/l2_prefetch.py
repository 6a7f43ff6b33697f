"""What reading the o projection's weight into L2 beside the kernels before it buys (kernels/prefetch.py).

    python benchmarks/l2_prefetch.py --out "$OUT"     # one H200, under a minute

GPT-OSS-20B's attention projections at M = 1, as a decode graph runs them: the q/k/v GEMM (cuBLAS), then G
microseconds of other work that reads almost nothing (a spin kernel standing in for rope and attention), then
the o GEMV (the skinny Triton kernel), back to back in a CUDA graph, cycling through enough weight copies that
none is in L2 from an earlier step (`benchmarks/gemm_m.py`). Without the prefetch, and with it (`prefetch_l2`
forks the o weight's read after the q/k/v GEMM and joins before the GEMV), for several G; and the same with
nothing after the gap, whose time the difference to the others is the o GEMV's (or the wait for the prefetch).
Writes l2_prefetch.json and l2_prefetch.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gemm_m import cold_weights, time_cold  # noqa: E402
from benchmarks.moe_tiles import time_graph  # noqa: E402
from kernels.linear import linear  # noqa: E402
from kernels.prefetch import prefetch_l2  # noqa: E402

GAPS_US = (3.0, 6.0, 9.0, 12.0)


def spin_cycles_per_us() -> float:
    """Cycles of `torch.cuda._sleep` a microsecond, from a graph of long spins."""
    return 200_000 / time_graph(lambda: torch.cuda._sleep(200_000))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(1, 2880, device="cuda", dtype=torch.bfloat16)
    qkv = cold_weights(5120, 2880, 2880 ** -0.5)
    o = cold_weights(2880, 4096, 4096 ** -0.5)
    copies = min(len(qkv), len(o))
    pairs = [(qkv[i], o[i]) for i in range(copies)]
    per_us = spin_cycles_per_us()

    def layer(gap_us: float, prefetch: bool, gemv: bool):
        def run(w):
            w_qkv, w_o = w
            h = F.linear(x, w_qkv)[:, :4096]
            join = prefetch_l2(w_o, 1) if prefetch else (lambda: None)
            torch.cuda._sleep(int(gap_us * per_us))
            join()
            return linear(h, w_o) if gemv else h
        return run

    rows = []
    for gap in GAPS_US:
        row = {"gap_us": gap}
        for name, pf, gemv in (("without", False, True), ("with", True, True), ("gap_only", False, False),
                               ("gap_and_prefetch", True, False)):
            row[name] = time_cold(layer(gap, pf, gemv), pairs)
        row["o_us_without"] = row["without"] - row["gap_only"]
        row["o_us_with"] = row["with"] - row["gap_only"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    h1 = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    o_alone = time_cold(lambda w: linear(h1, w), o)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": str(date.today()),
            "command": "python benchmarks/l2_prefetch.py --out $OUT", "o_alone_cold_us": o_alone,
            "spin_cycles_per_us": per_us}
    (out / "l2_prefetch.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# The o weight read into L2 beside the kernels before its GEMV", "",
             f"Machine: {meta['gpu']}; torch {meta['torch']}; {meta['date']}.", "",
             f"Command: `{meta['command']}`", "",
             "Microseconds a layer (q/k/v GEMM, a G-us spin, the o GEMV), cold weights, in a CUDA graph. "
             f"The o GEMV alone, cold: {o_alone:.2f} us.", "",
             "| gap G us | without | with the prefetch | gap only | gap + prefetch, no GEMV | o GEMV without | o GEMV with |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['gap_us']:.0f} | {r['without']:.2f} | {r['with']:.2f} | {r['gap_only']:.2f} | "
              f"{r['gap_and_prefetch']:.2f} | {r['o_us_without']:.2f} | {r['o_us_with']:.2f} |" for r in rows]
    (out / "l2_prefetch.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
