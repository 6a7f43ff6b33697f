"""Where the tiny pair's GPU throughput noise comes from: the same engine, the same level, run again and again.

    python benchmarks/host_noise.py --out OUT        # on the GPU host: the shipped tiny pair (needs data/heldout.json)

The tiny pair's sweep on an H200 is host-bound (a step is ~1 ms, most of it Python and launches), and its
cells of one configuration differed up to 2x between rounds (`docs/adaptive_log.md`). This runs one fixed-K
engine's level `--reps` times per engine, for `--engines` freshly built engines, under each host setting:
`default`; `pinned` (the process and its threads on one CPU core, torch on one thread); `pinned+frozen`
(also `gc.freeze()` after the build, so collections skip the engine's objects). Spread within an engine says
the noise is in time (the machine); spread between engines says it is in the build. Writes host_noise.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adaptive_sweep import build_engine, build_models, make_prompts, policy_spec, run_level  # noqa: E402


def settle(setting: str, cpus: set[int], threads: int) -> None:
    """`pinned*`: the process and torch on the first of `cpus`; otherwise all of them, as found."""
    pinned = setting.startswith("pinned")
    os.sched_setaffinity(0, {min(cpus)} if pinned else cpus)
    torch.set_num_threads(1 if pinned else threads)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--policy", default="K3")
    p.add_argument("--concurrency", default="4,16")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--min-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--settings", default="default,pinned,pinned+frozen")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in a.concurrency.split(",")]
    device = torch.device(a.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    models = build_models("tiny", "peagle", device, getattr(torch, dtype))
    cpus, threads = set(os.sched_getaffinity(0)), torch.get_num_threads()
    core = min(cpus)
    info = {"cpus": sorted(cpus), "core_pinned": core, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None, "loadavg": os.getloadavg()}
    for cmd in (["nvidia-smi", "topo", "-m"], ["lscpu"]):
        try:
            info[cmd[0] + " " + " ".join(cmd[1:])] = subprocess.run(cmd, capture_output=True, text=True).stdout
        except OSError as e:
            info[cmd[0]] = str(e)
    runs = []
    prompts = None
    for setting in a.settings.split(","):
        settle(setting, cpus, threads)
        for e in range(a.engines):
            engine = build_engine(models, policy_spec(a.policy, models, 7, None), max(levels), a.device, dtype,
                                  2048, None, False)
            if prompts is None:
                prompts = make_prompts("tiny", "heldout", engine.tokenizer, 64, 0, 0, 0)
            if setting.endswith("frozen"):
                gc.collect()
                gc.freeze()
            for C in levels:
                run_level(engine, prompts, C, 1, a.max_tokens, 1, tag="warm")
                for r in range(a.reps):
                    t0 = time.perf_counter()
                    cell = run_level(engine, prompts, C, 6, a.max_tokens, 0, min_requests=a.min_requests)
                    runs.append({"setting": setting, "engine": e, "rep": r, "concurrency": C,
                                 "throughput_tok_s": cell["throughput_tok_s"], "steps": cell["steps"],
                                 "wall_s": cell["wall_s"], "host_ms_per_step": cell["host_ms_per_step"],
                                 "device_ms_per_step": 1e3 * cell["wall_s"] / cell["steps"] - cell["host_ms_per_step"],
                                 "seconds": time.perf_counter() - t0})
                    print(json.dumps(runs[-1]), flush=True)
            del engine
            models.release()
            gc.unfreeze()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    summary = []
    for setting in a.settings.split(","):
        for C in levels:
            xs = [r["throughput_tok_s"] for r in runs if r["setting"] == setting and r["concurrency"] == C]
            per_engine = [statistics.median([r["throughput_tok_s"] for r in runs if r["setting"] == setting
                                             and r["concurrency"] == C and r["engine"] == e]) for e in range(a.engines)]
            summary.append({"setting": setting, "concurrency": C, "median": statistics.median(xs),
                            "spread": (max(xs) - min(xs)) / statistics.median(xs),
                            "engine_medians": per_engine})
            print(json.dumps(summary[-1]), flush=True)
    (out / "host_noise.json").write_text(json.dumps({"info": info, "command": " ".join(sys.argv),
                                                     "runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
