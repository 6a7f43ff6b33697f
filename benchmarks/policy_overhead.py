"""What a varying depth costs a host-bound step: one depth-K engine, one level, several policies swapped in.

    python benchmarks/policy_overhead.py --out OUT      # on the GPU host: the shipped tiny pair (data/heldout.json)

On the tiny pair's shared-engine sweep (`adaptive_tiny_shared.md`) the adaptive policy's steps cost ~1.5x a
fixed k = 3 step on the same engine. This separates the suspects, each policy on the same build, `--reps`
interleaved repetitions of the level:
- `K2`, `K3`: fixed k (the reference);
- `alternate`: asks k = 2, 2, 3, 3, ... (a varying depth, no policy work: the cost of switching graphs);
- `adaptive`: the engine's adaptive policy as built;
- `adaptive_quiet`: the same, without learning step times while the device runs (`learn` a no-op) and
  without exploring (the cost of the policy's work inside a step);
- `adaptive_k3`: the adaptive policy doing all its work every step, but k = 3 run (its work without its mix);
- `replay`: the k the last `adaptive` run asked for, replayed with no policy work (its mix without its work).
Writes policy_overhead.json: per policy and repetition, throughput, the loop's host ms a step and the decode
steps' mean ms at each k. `--trace` also times every step's parts (`step_trace.py`): their totals and the steps over
10 ms go in policy_overhead.json, `adaptive` against `replay` (the same steps) and `adaptive_k3` against `K3`
compared part by part, and every step's row in policy_overhead_trace.json.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adaptive_sweep import build_engine, build_models, cell_summary, make_prompts, policy_spec, run_level  # noqa: E402
from step_trace import StepTrace, compare, stalls, totals  # noqa: E402
from peagle_core.spec.adaptive import Exploration  # noqa: E402
from peagle_core.spec.depth import DepthPolicy, FixedDepth, StepInfo  # noqa: E402


class Alternate(DepthPolicy):
    """k = ks[0], ks[1], ... in turn: a depth that changes every step, with no decision behind it."""

    def __init__(self, ks: list[int]):
        self.ks, self.i = ks, 0

    def choose(self, info: StepInfo) -> int:
        self.i += 1
        return self.ks[(self.i - 1) % len(self.ks)]


def make_policy(name: str, built, asked: list[int]) -> DepthPolicy:
    """The policy called `name`; `asked` collects what an `adaptive` run asks for, for the next `replay`."""
    if name.startswith("K"):
        return FixedDepth(int(name[1:]))
    if name == "alternate":
        return Alternate([2, 2, 3, 3])
    if name == "replay":
        return Alternate(list(asked) or [3])
    policy = copy.deepcopy(built)
    choose = policy.choose
    if name == "adaptive":
        asked.clear()
        policy.choose = lambda info: asked.append(choose(info)) or asked[-1]
    elif name == "adaptive_k3":
        policy.choose = lambda info: (choose(info), 3)[1]
    elif name == "adaptive_quiet":
        policy.learn = lambda busy=None: None
        policy.explore = Exploration.off()
    else:
        raise ValueError(f"unknown policy {name!r}")
    return policy


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--min-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--policies", default="K3,alternate,adaptive,replay,adaptive_k3,adaptive_quiet,K2")
    p.add_argument("--trace", action="store_true", help="time every step's parts (step_trace.py)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(a.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    models = build_models("tiny", "peagle", device, getattr(torch, dtype))
    engine = build_engine(models, policy_spec("adaptive", models, 7, None), a.concurrency, a.device, dtype, 2048,
                          None, False)
    built = copy.deepcopy(engine.policy)
    prompts = make_prompts("tiny", "heldout", engine.tokenizer, 64, 0, 0, 0)
    names = a.policies.split(",")
    runs, asked, traces = [], [], {}
    for rep in range(a.reps):
        for name in names:
            engine.policy = make_policy(name, built, asked)
            run_level(engine, prompts, a.concurrency, 1, 16, 1, tag="warm")  # the policy's start, not measured
            engine.stats = type(engine.stats)()
            with StepTrace(engine) if a.trace else contextlib.nullcontext() as trace:
                cell = run_level(engine, prompts, a.concurrency, 6, a.max_tokens, 0, min_requests=a.min_requests)
            summary = cell_summary(engine)
            runs.append({"policy": name, "rep": rep, "throughput_tok_s": cell["throughput_tok_s"],
                         "host_ms_per_step": cell["host_ms_per_step"], "steps": cell["steps"],
                         "mean_k": summary["mean_k"], "decode_step_ms_at_k": summary["decode_step_ms_at_k"],
                         "acceptance_length": summary["acceptance_length"],
                         **({"step_grid": summary["step_grid"]} if "step_grid" in summary else {})})
            if trace is not None:
                traces[name, rep] = trace.rows
                runs[-1]["trace_ms"] = {"decode": totals(trace.rows, True), "mixed": totals(trace.rows, False)}
                runs[-1]["stalls"] = stalls(trace.rows)
            print(json.dumps(runs[-1]), flush=True)
    summary = {n: {"throughput_tok_s": statistics.median(r["throughput_tok_s"] for r in runs if r["policy"] == n),
                   "host_ms_per_step": statistics.median(r["host_ms_per_step"] for r in runs if r["policy"] == n)}
               for n in names}
    print(json.dumps(summary), flush=True)
    result = {"command": " ".join(sys.argv), "runs": runs, "summary": summary}
    if traces:  # each policy against the one that runs the same steps without its mix or without its work
        result["compared"] = {f"{x} - {y}, rep {rep}": compare(traces[x, rep], traces[y, rep])
                              for x, y in (("adaptive", "replay"), ("adaptive_k3", "K3"))
                              for rep in range(a.reps) if (x, rep) in traces and (y, rep) in traces}
        for name, c in result["compared"].items():
            print(name, json.dumps({k: c[k] for k in ("aligned", "all", "median_diff_ms") if k in c}), flush=True)
        (out / "policy_overhead_trace.json").write_text(json.dumps(
            [{"policy": n, "rep": r, "rows": rows} for (n, r), rows in traces.items()]))
    (out / "policy_overhead.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
