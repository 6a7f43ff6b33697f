"""Time to first token with a long shared prompt prefix, prefix caching on against off, on one GPU.

    python benchmarks/prefix_ttft.py --shape 20b --prefix 2048 --concurrency 4 --out "$OUT"

Random weights at a `peagle bench` shape (no speculation), built once and shared by two engines, one with
`enable_prefix_caching` and one without. Each engine runs a closed loop at the given concurrency: every request is
the shared prefix plus its own 32 tokens and generates 16 tokens. TTFT = first token time - arrival, p50 and p90
over the requests after each engine's first wave (the wave that fills the cache). Cells alternate off, on, off, on.
Writes prefix_ttft.json.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adaptive_sweep import build_models  # noqa: E402


def run(engine, prefix: list[int], C: int, n: int, seed: int, tag: str, vocab: int) -> list[dict]:
    from peagle_core import SamplingParams

    rng = random.Random(seed)
    prompts = [prefix + [rng.randrange(100, vocab - 100) for _ in range(32)] for _ in range(n)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    pending, reqs, inflight = deque(range(n)), [], 0
    while pending or engine.has_work():
        while pending and inflight < C:
            i = pending.popleft()
            reqs.append(engine.add_request(f"{tag}-{i}", prompts[i], sp))
            inflight += 1
        inflight -= sum(1 for u in engine.step() if u.req.finished)
    return [{"ttft_ms": 1e3 * (r.first_token_time - r.arrival_time), "cached": r.num_cached_tokens or 0} for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="20b")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--waves", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from peagle_core.config import parse_engine_config
    from peagle_core.engine.llm_engine import LLMEngine

    device = torch.device(a.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    models = build_models(a.shape, "peagle", device, getattr(torch, dtype))
    vocab = models.modules[0].config.vocab_size
    prefix = [random.Random(0).randrange(100, vocab - 100) for _ in range(a.prefix)]
    C, n = a.concurrency, a.concurrency * a.waves
    cells = []
    for rnd in range(a.rounds):
        for cache in (False, True):
            cfg = parse_engine_config(model=models.target_name, device=a.device, dtype=dtype, max_num_seqs=C,
                                      max_model_len=a.prefix + 256, enable_prefix_caching=cache)
            with models.loading():
                engine = LLMEngine(cfg)
            run(engine, prefix, C, C, seed=99, tag="warm", vocab=vocab)  # compiles, captures; fills the cache when on
            t0 = time.perf_counter()
            rows = run(engine, prefix, C, n, seed=rnd, tag=f"r{rnd}", vocab=vocab)
            ttft = sorted(r["ttft_ms"] for r in rows)
            cell = {"round": rnd, "prefix_caching": cache, "requests": n, "wall_s": time.perf_counter() - t0,
                    "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p90": ttft[int(0.9 * (len(ttft) - 1))],
                    "hit_rate": sum(r["cached"] for r in rows) / (n * (a.prefix + 32))}
            cells.append(cell)
            print(cell, flush=True)
            engine.shutdown()
            del engine
            models.release()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    off = statistics.median(c["ttft_ms_p50"] for c in cells if not c["prefix_caching"])
    on = statistics.median(c["ttft_ms_p50"] for c in cells if c["prefix_caching"])
    out = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "shape": a.shape, "prefix_tokens": a.prefix, "concurrency": C,
           "cells": cells, "ttft_p50_on_over_off": on / off}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "prefix_ttft.json").write_text(json.dumps(out, indent=1))
    print(f"TTFT p50 cache on / off: {on:.1f} / {off:.1f} ms = {on / off:.3f}")


if __name__ == "__main__":
    main()
