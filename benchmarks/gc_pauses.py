"""The garbage collector's pauses while the engine serves, with the heap frozen at start-up and without.

    python benchmarks/gc_pauses.py --out docs/benchmarks/gc_pauses_cpu.json

`LLMEngine` freezes the heap after start-up (`freeze_heap`): the ~300 k objects start-up leaves (modules, tokenizer
tables, graph bookkeeping) go to the collector's permanent generation, so a full collection walks only what serving
made since. `--variants unfrozen` undoes the freeze right after the build (`gc.unfreeze()`: the engine as it was
before the freeze, every object back in the oldest generation). Each variant serves the shipped tiny pair on the
CPU in a closed loop (`--requests` at once, each replaced as it finishes, fixed-length answers) for `--steps`
steps; variants alternate over `--reps`. Reports every collection by generation (count, total and longest pause),
the steps' wall times (median, p99, longest), and then, after the last step, the objects the collector tracks and
the pause of one full collection (`gc.collect()`): what a full collection mid-level costs. On the GPU probes one
came every ~2000 steps at 64 requests (policy_overhead_*_c64.json); the CPU's ~0.2 s steps rarely reach one.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Pauses:
    """The garbage collector's pauses while inside the `with` block: (generation, seconds) for each collection."""

    def __enter__(self) -> "Pauses":
        self.pauses: list[tuple[int, float]] = []
        self._started: list[float] = []
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started.append(time.perf_counter())
        elif self._started:
            self.pauses.append((info["generation"], time.perf_counter() - self._started.pop()))

    def total_ms(self) -> float:
        return 1e3 * sum(s for _, s in self.pauses)

    def max_ms(self) -> float:
        return 1e3 * max((s for _, s in self.pauses), default=0.0)


def serve(variant: str, requests: int, steps: int, max_tokens: int, k: int) -> dict:
    from host_time import Loop  # here: `Pauses` is imported by the sweep without the engine's modules

    loop = Loop(requests, max_tokens, "fixed", k, 1024)
    engine = loop.engine
    if variant == "unfrozen":
        gc.unfreeze()
    step_s = []
    with Pauses() as collections:
        for _ in range(steps):
            t0 = time.perf_counter()
            for u in engine.step():
                if u.req.finished:
                    loop.add()
            step_s.append(time.perf_counter() - t0)
    pauses = collections.pauses
    tracked = len(gc.get_objects())
    t0 = time.perf_counter()
    gc.collect()  # the pause a full collection costs now, mid-serving: what the collector walks
    full_ms = (time.perf_counter() - t0) * 1e3
    engine.shutdown()
    step_s.sort()
    gens = {}
    for g in sorted({g for g, _ in pauses}):
        ms = [s * 1e3 for gg, s in pauses if gg == g]
        gens[str(g)] = {"count": len(ms), "total_ms": round(sum(ms), 2), "max_ms": round(max(ms), 2)}
    return {"variant": variant, "steps": len(step_s), "requests_served": loop.added - requests,
            "step_ms": {"median": round(statistics.median(step_s) * 1e3, 3),
                        "p99": round(step_s[int(0.99 * (len(step_s) - 1))] * 1e3, 3),
                        "max": round(step_s[-1] * 1e3, 3)},
            "collections": gens, "tracked_objects": tracked, "full_collection_ms": round(full_ms, 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--variants", default="frozen,unfrozen")
    p.add_argument("--out")
    a = p.parse_args()
    runs = []
    for rep in range(a.reps):
        for variant in a.variants.split(","):
            run = {"rep": rep, **serve(variant, a.requests, a.steps, a.max_tokens, a.k)}
            print(json.dumps(run), flush=True)
            runs.append(run)
    result = {"command": "python benchmarks/gc_pauses.py " + " ".join(sys.argv[1:]),
              "python": sys.version.split()[0], "runs": runs}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
