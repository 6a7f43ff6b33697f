"""Memory and time per step of the P-EAGLE objective with sequence partitioning (P = 1, 2, 4, ...).

    python -m peagle_core.training.bench --len 1024 --partitions 1,2,4 [--device cuda --dtype bfloat16]

One random sequence of `--len` tokens, one COD sample shared by every P, a random drafter; each row
runs forward+backward of that sequence in P passes. Memory: on CUDA the peak allocated bytes; on CPU
the process's peak resident set (VmHWM, reset through /proc/self/clear_refs before each row) above
the resident set at the row's start. The largest pass's attention matrix (heads x T x T fp32 scores)
is reported too, since that is what partitioning shrinks.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from peagle_core.loading.checkpoint import init_random_
from peagle_core.models.gpt_oss import GptOss
from peagle_core.testing import tiny_target_config
from peagle_core.training.data import Example
from peagle_core.training.features import extract_features
from peagle_core.training.losses import DepthStats
from peagle_core.training.peagle import cod_sample, passes_to, peagle_pass_loss, plan_passes
from peagle_core.training.trainer import DTYPES, init_drafter


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def bench_partitions(n: int, partitions: list[int], num_depths: int = 8, ratio: float = 0.8, ratio_min: float = 0.2,
                     layers: int = 2, steps: int = 3, device: str = "cpu", dtype: str = "float32",
                     seed: int = 0, hidden: int | None = None, heads: int | None = None) -> list[dict]:
    dev = torch.device(device)
    over = {}
    if hidden:
        h = heads or max(1, hidden // 64)
        over = dict(hidden_size=hidden, num_attention_heads=h, num_key_value_heads=max(1, h // 4),
                    head_dim=hidden // h, intermediate_size=hidden)
    tcfg = tiny_target_config(max_position_embeddings=max(4096, 2 * n), **over)
    target = init_random_(GptOss(tcfg), seed).to(dev, DTYPES[dtype]).eval().requires_grad_(False)
    base = init_drafter(target, "peagle", layers, seed + 1, [1, 2, 3], intermediate_size=2 * tcfg.hidden_size,
                        device=dev)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, tcfg.vocab_size - 3, (n,), generator=g).tolist()
    feats = extract_features(target, [Example(ids, [True] * n)], [1, 2, 3], dev)
    sample = cod_sample(n - 1, num_depths, ratio, ratio_min, g)
    valid = torch.ones(n - 1, dtype=torch.bool)
    autocast = torch.autocast(dev.type, dtype=DTYPES[dtype]) if dtype != "float32" else None
    rows = []
    for P in partitions:
        drafter = copy.deepcopy(base)
        times, cpu, loss = [], [], 0.0
        passes = passes_to(plan_passes([sample], [valid], [0], P), dev)
        denom = sum(len(p.charged) for p in passes)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start_mem = torch.cuda.memory_allocated()
        else:
            exact = _reset_peak()
            start_mem = _status_kb("VmRSS") * 1024
        for _ in range(steps + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            stats, loss = DepthStats(num_depths, dev), 0.0
            with autocast or contextlib.nullcontext():
                for p in passes:
                    part = peagle_pass_loss(drafter, feats, p, drafter.config.mask_token_id, stats, denom)
                    part.backward()
                    loss += part.item()
            drafter.zero_grad(set_to_none=False)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated() - start_mem
        else:
            peak = (_status_kb("VmHWM") if exact else _status_kb("VmPeak")) * 1024 - start_mem
        T = stats.max_attn_tokens
        h = drafter.config.num_attention_heads
        rows.append({"P": P, "len": n, "elements": len(sample[0]), "largest_pass_tokens": T,
                     "attn_scores_mb": h * T * T * 4 / 2**20, "peak_mem_mb": peak / 2**20,
                     "time_per_step_s": sum(times[1:]) / max(1, len(times) - 1),
                     "cpu_time_per_step_s": sum(cpu[1:]) / max(1, len(cpu) - 1), "loss": loss,
                     "device": str(dev), "dtype": dtype})
        del drafter
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| P | tokens | elements | largest pass (tokens) | attention scores (MB) | peak memory (MB) "
            "| wall time/step (s) | CPU time/step (s) | loss |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['P']} | {r['len']} | {r['elements']} | {r['largest_pass_tokens']} | "
                     f"{r['attn_scores_mb']:.0f} | {r['peak_mem_mb']:.0f} | {r['time_per_step_s']:.2f} | "
                     f"{r['cpu_time_per_step_s']:.2f} | {r['loss']:.6f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m peagle_core.training.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--len", type=int, default=1024)
    p.add_argument("--partitions", default="1,2,4")
    p.add_argument("--num-depths", type=int, default=8)
    p.add_argument("--cod-ratio", type=float, default=0.8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, help="drafter/target width (default: the tiny test config's 64)")
    p.add_argument("--heads", type=int)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--json", help="also write the rows here")
    a = p.parse_args(argv)
    parts = [int(x) for x in a.partitions.split(",")]
    if a.device == "cpu" and len(parts) > 1:
        # a fresh process per P: freed heap stays resident, so a shared process under-reports later rows
        rows = []
        for P in parts:
            args = [x for x in (argv if argv is not None else sys.argv[1:])]
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "row.json"
                subprocess.run([sys.executable, "-m", "peagle_core.training.bench", *args, "--partitions", str(P),
                                "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
                rows += json.loads(out.read_text())
    else:
        rows = bench_partitions(a.len, parts, a.num_depths, a.cod_ratio, layers=a.layers, steps=a.steps,
                                device=a.device, dtype=a.dtype, hidden=a.hidden, heads=a.heads)
    print(markdown(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
