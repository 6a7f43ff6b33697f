"""SIMULATION of speculation-depth policies under load, from a step-time table and acceptance traces.

    python benchmarks/adaptive_sim.py --steps benchmarks/traces/step_times_tiny_cpu.json \
        --trace benchmarks/traces/tiny_peagle_k7.json --trace synthetic:0.78 --out docs/benchmarks --stem adaptive_sim

Not a measurement: the engine's real policy classes (FixedDepth, AdaptiveDepth, BatchSizeTable, EmaTiers)
choose k every simulated step, and the clock advances by the step time the table gives for (batch, k);
each request's accepted run per verify step comes from its acceptance trace exactly as the benchmark
replay does (accept min(L, k); see adaptive_sweep.py). Closed loop at each concurrency C: C requests in
flight, a finished one replaced at once; prefill is not modelled (a new request starts decoding at once,
its first token free), so the figures are decode throughput. The adaptive policy starts from the
step-time grid the engine profiles at start-up (whole steps per batch bucket and k, which is what the
table's `seconds` grid measures) and refines it from the simulated step times, as in the engine.

Step-time table (JSON, `adaptive_sweep.py steps` writes it, on CPU or on the H200):
    {"format": "peagle-step-times/1", "K": 7,
     "seconds":       {"<B>": [T(B, k=0), ..., T(B, k=K)]},   # engine at depth K verifying k (adaptive, baselines)
     "seconds_fixed": {"<B>": [-, T_1(B, 1), ..., T_K(B, K)]},  # engine at depth k verifying k (fixed K), optional
     "seconds_none":  {"<B>": T(B)},                            # no drafter, optional
     "profile": {"points": {"<tokens>": s}, "draft_pass": s, "per_k_draft": false}}   # optional
A profile alone (`{"points": ..., "draft_pass": ...}`) also works: T(B, k) = target(B (1 + k)) + draft.

A measured engine sweep (`adaptive_sweep.py sweep` JSON, `--steps` pointing at it) also works: its fixed-K
cells' mean step time (wall / steps, median over rounds) at each concurrency is T(C, k) for k = 1, 3, 5, 7,
linear in k in between (k = 0 extrapolated), the same for the depth-K engine and the fixed-K engines (the engine
drafts what it verifies, so a depth-7 engine verifying k costs about what a depth-k engine does). Approximate:
those means include the cells' prefill steps and the drain at the end of a level. What the adaptive policy was
profiled with at start-up is not in a sweep; `--start-up-depth-scale R` hands it a grid that charges R x the
measured cost of depth (T(B, 0) + R (T(B, k) - T(B, 0))), the shape error the H200 sweep's policy had.

`adaptive_level` is the adaptive policy with the level-only correction of its step-time grid and no
exploration: the policy as it was before the grid learnt its shape across k, for before/after comparisons.
"""
from __future__ import annotations

import argparse
import bisect
import datetime as _dt
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from adaptive_sweep import (POLICIES_DEFAULT, STEPS_FORMAT, AcceptanceReplay, Trace, _ints, _names,  # noqa: E402
                            command_line, fixed_ks, fixed_policy, level_only, request_lengths, tune_batch_table,
                            write_report)
from peagle_core.spec.adaptive import AdaptiveDepth, Exploration, StepGrid, StepTimeModel  # noqa: E402
from peagle_core.spec.baselines import BatchSizeTable, EmaTiers  # noqa: E402
from peagle_core.spec.depth import DepthPolicy, FixedDepth, StepInfo, StepOutcome  # noqa: E402


class StepTable:
    """T(B, k) from a measured grid (linear in B between measured batch sizes) or from a profile."""

    def __init__(self, d: dict[str, Any]):
        if d.get("kind") == "measured" and "cells" in d:  # an engine sweep: its fixed-K cells' step times
            d = sweep_step_table(d)
        self.source = d
        if "seconds" in d:
            if d.get("format") not in (None, STEPS_FORMAT):
                raise ValueError(f"step-time table format {d.get('format')!r}, want {STEPS_FORMAT!r}")
            self.K = int(d.get("K", len(next(iter(d["seconds"].values()))) - 1))
            self.grid = _grid(d["seconds"])
            self.fixed = _grid(d["seconds_fixed"]) if d.get("seconds_fixed") else None
            self.none = {int(b): float(v) for b, v in d["seconds_none"].items()} if d.get("seconds_none") else None
            self.profile = d.get("profile")
            self.model = None
        elif "points" in d:
            self.profile, self.grid, self.fixed, self.none = d, None, None, None
            self.model = _profile_model(d)
            self.K = int(d.get("K", 7))
        else:
            raise ValueError("a step-time table needs `seconds` (a measured grid) or `points` (a profile)")

    @classmethod
    def load(cls, path: str | Path) -> "StepTable":
        p = Path(path)
        if not p.exists():
            raise ValueError(f"step-time table {p} does not exist (measure one with `adaptive_sweep.py steps`)")
        return cls(json.loads(p.read_text()))

    def time(self, B: int, k: int, policy: str = "") -> float:
        if self.grid is None:
            return self.model.step(B, k)
        if policy == "none" and self.none:
            return _interp(self.none, B)
        f = fixed_policy(policy)
        if f is not None and f[1] is None and self.fixed and k > 0:  # an engine at depth k
            return _interp({b: row[k] for b, row in self.fixed.items()}, B)
        if f is not None and f[1] is not None and f[1] != self.K:
            raise ValueError(f"{policy}: the table's grid is at depth {self.K}, not {f[1]}")
        if k > self.K:
            raise ValueError(f"the step-time table covers k <= {self.K}, not {k}")
        return _interp({b: row[k] for b, row in self.grid.items()}, B)

    def start_up_model(self, depth_scale: float = 1.0) -> "StepGrid | StepTimeModel":
        """What the adaptive policy gets at start-up. The engine profiles whole steps per batch bucket and k
        (`profile_step_grid`), the measurement this table's grid is, so a grid is handed over as such
        (the engine takes fewer repetitions, so its start-up grid is noisier); a profile-only table
        gives the token-count model. `depth_scale` != 1 charges that multiple of the measured cost of depth
        (a start-up profile whose shape across k is wrong)."""
        if self.grid is not None:
            return StepGrid({b: [row[0] + depth_scale * (t - row[0]) for t in row] for b, row in self.grid.items()})
        return _profile_model(self.profile)


def sweep_step_table(sweep: dict[str, Any]) -> dict[str, Any]:
    """A step-time table from a measured sweep's fixed-K cells (see the module docstring for what it is)."""
    per: dict[tuple[int, int], list[float]] = {}
    for c in sweep.get("cells_by_round") or sweep["cells"]:
        f = fixed_policy(c["policy"]) if c.get("status") == "ok" and c.get("steps") else None
        if f is not None and f[1] is None:
            per.setdefault((c["concurrency"], f[0]), []).append(c["wall_s"] / c["steps"])
    ks = sorted({k for _, k in per})
    if len(ks) < 2:
        raise ValueError("the sweep needs fixed-K cells at two depths at least to give step times per k")
    K = ks[-1]
    rows = {}
    for C in sorted({C for C, _ in per}):
        have = {k: statistics.median(per[C, k]) for k in ks if (C, k) in per}
        if len(have) < 2:
            continue
        rows[str(C)] = [_interp_k(have, k) for k in range(K + 1)]
    return {"format": STEPS_FORMAT, "K": K, "seconds": rows, "seconds_fixed": rows,
            "device": sweep.get("device", "?"), "shape": sweep.get("shape", "?"), "mode": sweep.get("mode", "?"),
            "machine": sweep.get("machine", {}), "date": sweep.get("date"), "statistic": "sweep cells: wall / steps, "
            "median over rounds, fixed-K engines, linear in k between measured depths",
            "command": f"(from the engine sweep) {sweep.get('command', '?')}"}


def _interp_k(have: dict[int, float], k: int) -> float:
    """Linear in k through the measured depths, the nearest segment's slope outside them (k = 0 included)."""
    ks = sorted(have)
    i = min(max(bisect.bisect_left(ks, k), 1), len(ks) - 1)
    k0, k1 = ks[i - 1], ks[i]
    return have[k0] + (have[k1] - have[k0]) * (k - k0) / (k1 - k0)


def _grid(d: dict[str, list]) -> dict[int, list[float]]:
    return {int(b): [float(x) if x is not None else float("nan") for x in row] for b, row in d.items()}


def _profile_model(p: dict[str, Any]) -> StepTimeModel:
    return StepTimeModel({int(n): float(t) for n, t in p["points"].items()}, draft_pass=float(p.get("draft_pass", 0.0)),
                         per_k_draft=bool(p.get("per_k_draft", False)))


def _interp(by_b: dict[int, float], B: int) -> float:
    bs = sorted(by_b)
    i = bisect.bisect_left(bs, B)
    if i < len(bs) and bs[i] == B:
        return by_b[B]
    if i == 0:
        return by_b[bs[0]]
    if i == len(bs):  # past the largest measured batch: the last slope
        if len(bs) == 1:
            return by_b[bs[0]] * B / bs[0]
        b0, b1 = bs[-2], bs[-1]
    else:
        b0, b1 = bs[i - 1], bs[i]
    return by_b[b0] + (by_b[b1] - by_b[b0]) * (B - b0) / (b1 - b0)


def make_policy(name: str, K: int, table: StepTable, batch_table: list | None, depth_scale: float = 1.0,
                seed: int = 0) -> DepthPolicy:
    if name == "none":
        return FixedDepth(0)
    if (f := fixed_policy(name)) is not None:
        return FixedDepth(f[0])
    if name == "adaptive":
        return AdaptiveDepth(K, table.start_up_model(depth_scale), explore=Exploration(seed=seed))
    if name == "adaptive_level":  # before the shape correction: the level only, no exploration
        policy = AdaptiveDepth(K, table.start_up_model(depth_scale))
        level_only(policy)
        return policy
    if name == "batch_table":
        if not batch_table:
            raise ValueError("batch_table needs the fixed-K cells first (or --batch-table)")
        return BatchSizeTable(K, batch_table)
    if name == "ema_tiers":
        return EmaTiers(K)
    raise ValueError(f"unknown policy {name!r}")


def simulate(policy: DepthPolicy, name: str, table: StepTable, trace: Trace, C: int, K: int, waves: int,
             max_tokens: int, seed: int, jitter: float = 0.0, min_requests: int = 0) -> dict[str, Any]:
    """One closed-loop level; the same throughput window and TPOT as the engine sweep. `jitter`: each step's
    time is the table's times a uniform factor in 1 +- jitter (seeded: every policy sees the same draws)."""
    n = max(C * waves, min_requests)
    noise = random.Random(seed + 7 * C)
    lengths = request_lengths(n, max_tokens, seed)
    replay = AcceptanceReplay(trace, max(K, 1) if K else trace.K)
    clock, admitted = 0.0, 0
    active: list[dict[str, Any]] = []
    tpots, tokens_total, steps, depth_sum = [], 0, 0, 0
    window_start = window_end = None
    tokens_in_window = 0
    accepted_total = verifies = 0
    while admitted < n or active:
        while admitted < n and len(active) < C:
            active.append({"id": f"r{admitted}", "left": lengths[admitted] - 1, "n": lengths[admitted],
                           "first": clock})
            admitted += 1
            tokens_total += 1
            if admitted == n:
                window_end = clock
        B = len(active)
        info = StepInfo(num_verify=B, num_prefill_tokens=0, max_k=K)
        k = policy.choose(info) if K else 0
        dt = table.time(B, k, name) * (1.0 + jitter * (2.0 * noise.random() - 1.0))
        accepted, emitted, finished = [], 0, []
        for r in active:
            acc = min(replay.run_length(r["id"]), k) if k else 0
            if k:
                accepted.append((k, acc))
                accepted_total += acc
                verifies += 1
            got = min(acc + 1, r["left"])
            r["left"] -= got
            emitted += got
            if r["left"] <= 0:
                finished.append(r)
        clock += dt
        steps += 1
        depth_sum += k
        tokens_total += emitted
        if window_start is not None and window_end is None:
            tokens_in_window += emitted
        policy.observe(info, StepOutcome(k, accepted, dt, B * (1 + k)))
        for r in finished:
            active.remove(r)
            if r["n"] > 1:
                tpots.append((clock - r["first"]) / (r["n"] - 1))
        if finished and window_start is None:
            window_start = clock
    if window_start is not None and window_end is not None and window_end > window_start:
        throughput = tokens_in_window / (window_end - window_start)
    else:
        throughput = tokens_total / clock
    return {"throughput_tok_s": throughput, "tpot_ms_mean": 1e3 * sum(tpots) / len(tpots) if tpots else None,
            "mean_k": depth_sum / steps if steps else 0.0, "requests": n, "output_tokens": tokens_total,
            "steps": steps, "simulated_s": clock,
            "acceptance_length": 1 + accepted_total / verifies if verifies else 1.0}


def run(a: argparse.Namespace) -> dict[str, Any]:
    table = StepTable.load(a.steps)
    if a.policies is None:
        a.policies = list(POLICIES_DEFAULT) + ([f"K{k}@{table.K}" for k in (1, 3, 5, 7) if k <= table.K]
                                               if table.grid is not None else [])
    fixed = fixed_ks(a.policies)
    K = max(fixed) if fixed else table.K
    if K > table.K:
        raise ValueError(f"fixed K up to {K} but the step-time table covers k <= {table.K}")
    cells, scenarios, tables = [], [], {}
    for spec in a.trace:
        trace = Trace.load(spec)
        label = trace.source.get("label") or Path(str(spec)).stem
        synthetic = bool(trace.source.get("synthetic"))
        desc = (f"Acceptance: {'SYNTHETIC, ' if synthetic else 'recorded, '}{label}; acceptance length at K={trace.K}: "
                f"{trace.acceptance_length():.2f}; conditional per position: "
                f"{' '.join(f'{x:.2f}' for x in trace.conditional_rates())}.")
        if not synthetic:
            desc += f" Source: {json.dumps({k: v for k, v in trace.source.items() if k != 'command'})}."
        else:
            desc += (" Not measured: i.i.d. acceptance at these rates, standing in for a strong drafter (a rate of "
                     "0.78 gives acceptance length 3.9 at K = 7, the published P-EAGLE figure for GPT-OSS-20B on "
                     "HumanEval); the step times are still the measured ones.")
        scenarios.append({"name": label, "description": desc, "synthetic": synthetic})
        sc_cells: list[dict[str, Any]] = []
        order = [p for p in a.policies if p != "batch_table"] + [p for p in a.policies if p == "batch_table"]
        for name in order:
            bt = (json.loads(a.batch_table) if a.batch_table else tune_batch_table(sc_cells, fixed, a.concurrency)) \
                if name == "batch_table" else None
            if name == "batch_table":
                tables[label] = bt
            for C in a.concurrency:
                pol = make_policy(name, K, table, bt, a.start_up_depth_scale, a.seed)
                f = fixed_policy(name)
                kk = 0 if name == "none" else (f[1] or f[0]) if f else K
                cell = {"scenario": label, "policy": name, "concurrency": C, "K": kk, "status": "ok"}
                cell.update(simulate(pol, name, table, trace, C, kk, a.waves, a.max_tokens, a.seed, a.step_jitter,
                                     a.min_requests))
                if isinstance(pol, AdaptiveDepth) and pol.decisions:
                    cell["explored_share"] = pol.explored / pol.decisions
                sc_cells.append(cell)
        cells += sc_cells
    return {"kind": "simulation", "command": command_line(), "date": _dt.date.today().isoformat(),
            "device": f"simulated ({table.source.get('device', 'table')})",
            "machine": table.source.get("machine", {}), "step_table": {k: v for k, v in table.source.items()
                                                                     if k not in ("machine",)},
            "concurrency": a.concurrency, "policies": a.policies, "fixed": fixed, "max_tokens": a.max_tokens,
            "waves": a.waves, "min_requests": a.min_requests, "step_jitter": a.step_jitter,
            "start_up_depth_scale": a.start_up_depth_scale, "scenarios": scenarios, "batch_tables": tables,
            "cells": cells,
            "notes": [f"Step times: `{a.steps}` ({table.source.get('shape', '?')} shape, "
                      f"{table.source.get('mode', '?')}, "
                      f"measured on {table.source.get('device', '?')}; command `{table.source.get('command', '?')}`). "
                      "Decode only (prefill not modelled); closed loop, C requests in flight, output lengths uniform "
                      f"in 0.5..1.5 x {a.max_tokens}; throughput over the steady window (first completion to last "
                      "admission). batch_table = vLLM's static schedule tuned from the fixed-K cells of the same "
                      "scenario (best K per concurrency); ema_tiers = SGLang-like tiers 1/3/7. The adaptive policy's "
                      "start-up step-time model: " + ("the table's grid (the engine profiles the same whole-step "
                                                      "measurement at start-up, with fewer repetitions), refined "
                                                      "online." if table.grid is not None else
                                                      "the table's token-count profile, refined online.")
                      + (f" Start-up grid distorted: it charges {a.start_up_depth_scale:g} x the table's cost of depth "
                         "(T(B, 0) + R (T(B, k) - T(B, 0))); the simulated steps cost what the table says."
                         if a.start_up_depth_scale != 1.0 else "")
                      + (f" Step times jittered by a uniform factor in 1 +- {a.step_jitter:g} per step (seeded)."
                         if a.step_jitter else "")
                      + (" adaptive_level = the adaptive policy before the shape correction (level-only grid "
                         "correction, no exploration)." if "adaptive_level" in a.policies else "")]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", required=True, help="step-time table JSON, or a measured sweep's JSON")
    ap.add_argument("--trace", action="append", required=True,
                    help="acceptance trace JSON or synthetic:A[,A2,...] (repeat: one scenario each)")
    ap.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--policies", type=_names, default=None,
                    help="default: none, K1..K7, adaptive, batch_table, ema_tiers, and K1/3/5/7@<table depth>")
    ap.add_argument("--batch-table", help="vLLM schedule JSON (default: tuned from the simulated fixed-K cells)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--waves", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-requests", type=int, default=0, help="at least this many requests a level (as the sweep)")
    ap.add_argument("--step-jitter", type=float, default=0.0, help="uniform +- fraction on each simulated step time")
    ap.add_argument("--start-up-depth-scale", type=float, default=1.0,
                    help="the adaptive policies' start-up grid charges this multiple of the table's cost of depth")
    ap.add_argument("--out", required=True)
    ap.add_argument("--stem", default="adaptive_sim")
    a = ap.parse_args(argv)
    try:
        result = run(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    st = result["step_table"]
    write_report(result, Path(a.out), a.stem, f"Adaptive speculation depth: SIMULATION from step times measured on "
                 f"{st.get('device', '?')} ({st.get('shape', '?')} shape, {st.get('mode', '?')})")
    print((Path(a.out) / f"{a.stem}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
