"""SIMULATION of speculation-depth policies under load, from a step-time table and acceptance traces.

    python benchmarks/adaptive_sim.py --steps benchmarks/traces/step_times_tiny_cpu.json \
        --trace benchmarks/traces/tiny_peagle_k7.json --trace synthetic:0.78 --out docs/benchmarks --stem adaptive_sim

Not a measurement: the engine's real policy classes (FixedDepth, AdaptiveDepth, BatchSizeTable, EmaTiers)
choose k every simulated step, and the clock advances by the step time the table gives for (batch, k);
each request's accepted run per verify step comes from its acceptance trace exactly as the benchmark
replay does (accept min(L, k); see adaptive_sweep.py). Closed loop at each concurrency C: C requests in
flight, a finished one replaced at once. By default prefill is not modelled (a new request starts decoding at
once, its first token free), so the figures are decode throughput; `--prompt-len` models joins as the engine
schedules them (`Joins`), and with `--sweep-trace-order` a sweep's levels are replayed step for step (every
fixed-K cell of the graphed H200 sweep takes its measured number of steps). The adaptive policy starts from the
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
cells' mean step time (wall / steps, median or `--steps-statistic min` over rounds) at each concurrency is
T(C, k) for k = 1, 3, 5, 7,
linear in k in between (k = 0 extrapolated), the same for the depth-K engine and the fixed-K engines (the engine
drafts what it verifies, so a depth-7 engine verifying k costs about what a depth-k engine does). Approximate:
those means include the cells' prefill steps and the drain at the end of a level. What the adaptive policy was
profiled with at start-up is in a sweep's adaptive cells since they record `step_grid` (`--start-up-grid`, and
`--steps-from start-up-grid` to make that grid the simulated costs too); for older sweeps `--start-up-depth-scale
R` hands it a grid that charges R x the measured cost of depth (T(B, 0) + R (T(B, k) - T(B, 0))).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adaptive_sweep import (POLICIES_DEFAULT, STEPS_FORMAT, AcceptanceReplay, Trace, _ints, _names,  # noqa: E402
                            command_line, fixed_ks, fixed_policy, level_only, request_lengths, tune_batch_table,
                            write_report)
from peagle_core.depth.adaptive import AdaptiveDepth, Exploration, StepGrid, StepTimeModel  # noqa: E402
from peagle_core.depth.baselines import BatchSizeTable, EmaTiers  # noqa: E402
from peagle_core.depth.policy import DepthPolicy, FixedDepth, StepInfo, StepOutcome  # noqa: E402


class StepTable:
    """T(B, k) from a measured grid (linear in B between measured batch sizes) or from a profile."""

    def __init__(self, d: dict[str, Any], statistic: str = "median"):
        if d.get("kind") == "measured" and "cells" in d:  # an engine sweep: its fixed-K cells' step times
            d = sweep_step_table(d, statistic)
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
    def load(cls, path: str | Path, statistic: str = "median") -> "StepTable":
        p = Path(path)
        if not p.exists():
            raise ValueError(f"step-time table {p} does not exist (measure one with `adaptive_sweep.py steps`)")
        return cls(json.loads(p.read_text()), statistic)

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

    def start_up_model(self, depth_scale: float = 1.0, recorded: dict[int, list[float]] | None = None
                       ) -> "StepGrid | StepTimeModel":
        """What the adaptive policy gets at start-up. The engine profiles whole steps per batch bucket and k
        (`profile_step_grid`), the measurement this table's grid is, so a grid is handed over as such
        (the engine takes fewer repetitions, so its start-up grid is noisier); a profile-only table
        gives the token-count model. `depth_scale` != 1 charges that multiple of the measured cost of depth
        (a start-up profile whose shape across k is wrong). `recorded`: the grid a sweep's engine did profile
        (`recorded_start_up_grid`), used instead of the table's (and scaled alike)."""
        grid = recorded if recorded is not None else self.grid
        if grid is not None:
            return StepGrid({b: [row[0] + depth_scale * (t - row[0]) for t in row] for b, row in grid.items()})
        return _profile_model(self.profile)


def sweep_step_table(sweep: dict[str, Any], statistic: str = "median") -> dict[str, Any]:
    """A step-time table from a measured sweep's fixed-K cells (see the module docstring for what it is).
    `statistic` over the rounds: the median, or the min (with two rounds the median is their mean, and one
    stalled round, outside the throughput window, can make a cell's steps look a third dearer)."""
    pick = min if statistic == "min" else statistics.median
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
        have = {k: pick(per[C, k]) for k in ks if (C, k) in per}
        if len(have) < 2:
            continue
        rows[str(C)] = [_interp_k(have, k) for k in range(K + 1)]
    return {"format": STEPS_FORMAT, "K": K, "seconds": rows, "seconds_fixed": rows,
            "device": sweep.get("device", "?"), "shape": sweep.get("shape", "?"), "mode": sweep.get("mode", "?"),
            "machine": sweep.get("machine", {}), "date": sweep.get("date"), "statistic": "sweep cells: wall / steps, "
            f"{statistic} over rounds, fixed-K engines, linear in k between measured depths",
            "command": f"(from the engine sweep) {sweep.get('command', '?')}"}


def recorded_start_up_grid(sweep: dict[str, Any]) -> dict[int, list[float]]:
    """The start-up grid a sweep's adaptive engines profiled (`step_grid.profiled_ms` of its adaptive cells), in
    seconds: per batch size and k, the median over the rounds (each round builds its engine and profiles once)."""
    by_round: dict[int, dict[int, list[float]]] = {}
    for c in sweep.get("cells_by_round") or sweep.get("cells", []):
        g = c.get("step_grid") if c.get("policy") == "adaptive" else None
        if g and "profiled_ms" in g:
            by_round.setdefault(c.get("round", 0), {b: [t / 1e3 for t in row]
                                                   for b, row in zip(g["batch_sizes"], g["profiled_ms"])})
    if not by_round:
        raise ValueError("the sweep has no adaptive cell with a recorded start-up grid (step_grid.profiled_ms)")
    grids = list(by_round.values())
    return {b: [statistics.median(g[b][k] for g in grids) for k in range(len(row))] for b, row in grids[0].items()}


def sweep_first_slots(concurrency: list[int], waves: int, min_requests: int, warmup: bool = True) -> dict[int, int]:
    """The acceptance trace each level's first request replays in a sweep: one replay serves an engine's whole
    life and hands traces out round-robin, so level C starts after the earlier levels' requests and, on CUDA,
    after the untimed warm-up wave of C requests that precedes every level (its own included)."""
    slots, used = {}, 0
    for C in concurrency:
        used += C if warmup else 0
        slots[C] = used
        used += max(waves * C, min_requests)
    return slots


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
                seed: int = 0, recorded: dict[int, list[float]] | None = None,
                explore: dict[str, float] | None = None) -> DepthPolicy:
    if name == "none":
        return FixedDepth(0)
    if (f := fixed_policy(name)) is not None:
        return FixedDepth(f[0])
    if name == "adaptive":
        # the traces are P-EAGLE's (its drafting is flat in depth): as the engine builds the policy for it
        return AdaptiveDepth(K, table.start_up_model(depth_scale, recorded),
                             explore=Exploration(seed=seed, **(explore or {})), flat_draft=True)
    if name == "adaptive_level":  # before the shape correction: the level only, no exploration
        policy = AdaptiveDepth(K, table.start_up_model(depth_scale, recorded))
        level_only(policy)
        return policy
    if name == "batch_table":
        if not batch_table:
            raise ValueError("batch_table needs the fixed-K cells first (or --batch-table)")
        return BatchSizeTable(K, batch_table)
    if name == "ema_tiers":
        return EmaTiers(K)
    raise ValueError(f"unknown policy {name!r}")


@dataclass(frozen=True)
class Joins:
    """How requests join a level, as in the engine (`--prompt-len` > 0): each prompt is prefilled in chunks
    under the step's token budget, decoding requests first (the scheduler's order), so a deep k at a large batch
    leaves little room and joiners wait; a joining request verifies nothing until its prefill is done, and a
    step carrying prompt tokens costs `seconds_per_token` more per token and is not used by the policy's grid
    (the engine's rule). prompt_len 0: the old model (a request decodes at once, its first token free; no prefill steps)."""

    prompt_len: int = 0
    budget: int = 512
    seconds_per_token: float = 0.0


@dataclass
class _Request:
    id: str
    n: int             # output tokens
    left: int          # still to emit
    prefill: int       # prompt tokens still to prefill
    first: float = 0.0  # time of its first token
    held: int = 0       # drafts it holds: what the step that sampled its last token drafted


def simulate(policy: DepthPolicy, name: str, table: StepTable, trace: Trace, C: int, K: int, waves: int,
             max_tokens: int, seed: int, jitter: float = 0.0, min_requests: int = 0, joins: Joins = Joins(),
             first_slot: int = 0, old_accounting: bool = False, switch_s: float = 0.0) -> dict[str, Any]:
    """One closed-loop level; the same throughput window and TPOT as the engine sweep. `jitter`: each step's
    time is the table's times a uniform factor in 1 +- jitter (seeded: every policy sees the same draws).
    `first_slot`: the acceptance trace the level's first request replays (the sweep's replay hands traces out
    round-robin over the engine's life, so its level C starts where the earlier levels and warm-ups stopped).
    As in the engine, the choice is the depth a step drafts for the next one (`draft_depth`: at least it), and a
    step verifies at most the drafts its requests hold (one k for all). `old_accounting`: the engine before it told
    the policy (the policy predicted, and its grid learnt, the depth it asked for, whatever was verified), for
    before/after figures. `switch_s`: a decode step after a step of another shape (another batch size or k, or
    one with prompt tokens) costs this much more: on the tiny pair's H200 probes a k = 7 step after one of another
    shape took 57-90 us more, for every policy."""
    n = max(C * waves, min_requests)
    noise = random.Random(seed + 7 * C)
    lengths = request_lengths(n, max_tokens, seed)
    replay = AcceptanceReplay(trace, max(K, 1) if K else trace.K, first_slot=first_slot)
    clock, admitted = 0.0, 0
    active: list[_Request] = []
    tpots, tokens_total, steps, depth_sum = [], 0, 0, 0
    window_start = window_end = None
    tokens_in_window = 0
    accepted_total = verifies = 0
    k_steps: dict[int, int] = {}
    last_shape = None
    while admitted < n or active:
        while admitted < n and len(active) < C:
            # without prefill steps (prompt_len 0) a request decodes at once, as if its prompt step drafted K
            r = _Request(f"r{admitted}", lengths[admitted], lengths[admitted] - 1, joins.prompt_len, clock,
                         held=0 if joins.prompt_len else K)
            active.append(r)
            admitted += 1
            if not joins.prompt_len:
                tokens_total += 1  # the old model: the first token is free
            if admitted == n:
                window_end = clock
        decoding = [r for r in active if not r.prefill]
        B = len(decoding)
        held = min((r.held for r in decoding), default=K)
        info = StepInfo(num_verify=B, num_prefill_tokens=0, max_k=K,  # the engine passes no prompt tokens
                        drafts=None if old_accounting else held, num_requests=len(active),
                        token_budget=joins.budget if joins.prompt_len else 0,
                        prompt_backlog=sum(r.prefill for r in active) if joins.prompt_len else None)
        want = policy.choose(info) if K else 0
        k = min(want, held)
        drafts = [k] * len(decoding)  # not cut to the tokens a request has left (the scheduler does not either)
        budget = joins.budget - sum(1 + d for d in drafts)  # decoders first (64 x 8 tokens just fill 512)
        prompt_tokens, first_tokens = _prefill(active, budget, joins)
        dt = (table.time(B, k, name) if B else table.time(1, 0, name)) + prompt_tokens * joins.seconds_per_token
        dt *= 1.0 + jitter * (2.0 * noise.random() - 1.0)
        shape = (B, k) if B and not prompt_tokens else None  # None: not a graph's uniform decode step
        if switch_s and shape is not None and shape != last_shape:
            dt += switch_s
        last_shape = shape
        accepted, emitted, finished = [], len(first_tokens), []
        for r, d in zip(decoding, drafts):
            acc = min(replay.run_length(r.id), d) if d else 0
            if d:
                accepted.append((d, acc))
                accepted_total += acc
                verifies += 1
            got = min(acc + 1, r.left)
            r.left -= got
            emitted += got
            if r.left <= 0:
                finished.append(r)
        clock += dt
        for r in first_tokens:
            r.first = clock
        for r in decoding + first_tokens:  # every request that sampled drafts for the next step
            r.held = max(policy.draft_depth(want), 1)  # the drafter drafts at least one
        steps += 1
        if B:
            depth_sum += k
            k_steps[k] = k_steps.get(k, 0) + 1
        tokens_total += emitted
        if window_start is not None and window_end is None:
            tokens_in_window += emitted
        policy.observe(info, StepOutcome(want if old_accounting else k, accepted, dt,
                                         sum(1 + d for d in drafts) + prompt_tokens))
        for r in finished:
            active.remove(r)
            if r.n > 1:
                tpots.append((clock - r.first) / (r.n - 1))
        if finished and window_start is None:
            window_start = clock
    if window_start is not None and window_end is not None and window_end > window_start:
        throughput = tokens_in_window / (window_end - window_start)
    else:
        throughput = tokens_total / clock
    decode_steps = sum(k_steps.values())
    return {"throughput_tok_s": throughput, "tpot_ms_mean": 1e3 * sum(tpots) / len(tpots) if tpots else None,
            "mean_k": depth_sum / decode_steps if decode_steps else 0.0, "requests": n, "output_tokens": tokens_total,
            "steps": steps, "simulated_s": clock,
            "k_share": {str(k): c / decode_steps for k, c in sorted(k_steps.items())} if decode_steps else {},
            "acceptance_length": 1 + accepted_total / verifies if verifies else 1.0}


def _prefill(active: list[_Request], budget: int, joins: Joins) -> tuple[int, list[_Request]]:
    """Prompt chunks in admission order within what the decoding requests left of the token budget; returns the
    prompt tokens fed and the requests whose prefill ended (each samples its first token in this step)."""
    fed, done = 0, []
    for r in active:
        if not r.prefill or budget <= 0:
            continue
        chunk = min(r.prefill, budget)
        r.prefill -= chunk
        budget -= chunk
        fed += chunk
        if not r.prefill:
            done.append(r)
    return fed, done


def parse_explore(text: str) -> dict[str, float]:
    """`--explore`'s FIELD=VALUE,... as `Exploration` keyword arguments (a plain ValueError for anything else)."""
    fields = {f for f in Exploration.__dataclass_fields__ if f != "seed"}
    out = {}
    for item in filter(None, text.split(",")):
        name, eq, value = item.partition("=")
        if not eq or name not in fields:
            raise ValueError(f"--explore takes FIELD=VALUE items with FIELD one of {sorted(fields)}, got {item!r}")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--explore {name} needs a number, got {value!r}") from None
    return out


def run(a: argparse.Namespace) -> dict[str, Any]:
    src = json.loads(Path(a.start_up_grid).read_text()) if a.start_up_grid else None
    recorded = recorded_start_up_grid(src) if src is not None else None
    explore = parse_explore(a.explore)
    if a.steps_from == "start-up-grid":  # the recorded profile as the true step costs too: no shape error
        if recorded is None:
            raise ValueError("--steps-from start-up-grid needs --start-up-grid")
        rows = {str(b): row for b, row in recorded.items()}
        table = StepTable({"format": STEPS_FORMAT, "K": len(next(iter(rows.values()))) - 1, "seconds": rows,
                           "seconds_fixed": rows, "device": src.get("device", "?"), "shape": src.get("shape", "?"),
                           "mode": src.get("mode", "?"), "machine": src.get("machine", {}),
                           "statistic": "the sweep's recorded start-up grid (median over rounds)",
                           "command": f"(start-up grid of the engine sweep) {src.get('command', '?')}"})
    elif a.steps:
        table = StepTable.load(a.steps, a.steps_statistic)
    else:
        raise ValueError("--steps is required (a step-time table or a sweep's JSON)")
    joins = Joins(a.prompt_len, a.token_budget, a.prefill_s_per_token)
    first_slots = sweep_first_slots(a.concurrency, a.waves, a.min_requests) if a.sweep_trace_order else {}
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
                f = fixed_policy(name)
                kk = 0 if name == "none" else (f[1] or f[0]) if f else K
                runs = []
                for seed in range(a.seed, a.seed + a.seeds):
                    pol = make_policy(name, K, table, bt, a.start_up_depth_scale, seed, recorded, explore)
                    r = simulate(pol, name, table, trace, C, kk, a.waves, a.max_tokens, seed, a.step_jitter,
                                 a.min_requests, joins, first_slots.get(C, 0), a.old_draft_accounting, a.switch_s)
                    if isinstance(pol, AdaptiveDepth) and pol.decisions:
                        r["explored_share"] = pol.explored / pol.decisions
                    runs.append(r)
                cell = {"scenario": label, "policy": name, "concurrency": C, "K": kk, "status": "ok"}
                cell.update(_mean_of_seeds(runs))
                sc_cells.append(cell)
        cells += sc_cells
    return {"kind": "simulation", "command": command_line(), "date": _dt.date.today().isoformat(),
            "device": f"simulated ({table.source.get('device', 'table')})",
            "machine": table.source.get("machine", {}), "step_table": {k: v for k, v in table.source.items()
                                                                     if k not in ("machine",)},
            "concurrency": a.concurrency, "policies": a.policies, "fixed": fixed, "max_tokens": a.max_tokens,
            "waves": a.waves, "min_requests": a.min_requests, "step_jitter": a.step_jitter, "switch_s": a.switch_s,
            "explore": explore,
            "start_up_depth_scale": a.start_up_depth_scale, "start_up_grid": a.start_up_grid,
            "steps_from": a.steps_from, "seeds": a.seeds, "prompt_len": a.prompt_len, "token_budget": a.token_budget,
            "prefill_s_per_token": a.prefill_s_per_token, "sweep_trace_order": a.sweep_trace_order,
            "scenarios": scenarios, "batch_tables": tables, "cells": cells,
            "notes": [f"Step times: `{a.steps or a.start_up_grid}` ({table.source.get('shape', '?')} shape, "
                      f"{table.source.get('mode', '?')}, "
                      f"measured on {table.source.get('device', '?')}; command `{table.source.get('command', '?')}`"
                      f"; {table.source.get('statistic', 'as measured')}). "
                      + ("Decode only (prefill not modelled); " if not a.prompt_len else
                         f"Prompts of {a.prompt_len} tokens prefilled in chunks under a {a.token_budget}-token step "
                         f"budget (decoding requests first), {1e6 * a.prefill_s_per_token:g} us a prompt token; a "
                         "joining request verifies nothing until its prefill is done. ")
                      + "Closed loop, C requests in flight, output lengths uniform "
                      f"in 0.5..1.5 x {a.max_tokens}; throughput over the steady window (first completion to last "
                      "admission). batch_table = vLLM's static schedule tuned from the fixed-K cells of the same "
                      "scenario (best K per concurrency); ema_tiers = SGLang-like tiers 1/3/7. The adaptive policy's "
                      "start-up step-time model: " + (f"the grid the sweep's engines profiled at start-up "
                                                      f"(`{a.start_up_grid}`, step_grid.profiled_ms, median over "
                                                      "rounds), refined online." if recorded is not None else
                                                      "the table's grid (the engine profiles the same whole-step "
                                                      "measurement at start-up, with fewer repetitions), refined "
                                                      "online." if table.grid is not None else
                                                      "the table's token-count profile, refined online.")
                      + (" Acceptance traces handed out in the sweep's order (level C's first request takes the "
                         "trace after the earlier levels' and the warm-up waves' requests)." if a.sweep_trace_order
                         else "")
                      + (f" Mean over seeds {a.seed}..{a.seed + a.seeds - 1} (request lengths, jitter, exploration)."
                         if a.seeds > 1 else "")
                      + (f" Start-up grid distorted: it charges {a.start_up_depth_scale:g} x the table's cost of depth "
                         "(T(B, 0) + R (T(B, k) - T(B, 0))); the simulated steps cost what the table says."
                         if a.start_up_depth_scale != 1.0 else "")
                      + (f" Step times jittered by a uniform factor in 1 +- {a.step_jitter:g} per step (seeded)."
                         if a.step_jitter else "")
                      + (f" A decode step after a step of another shape costs {1e6 * a.switch_s:g} us more (a CUDA "
                         "graph switch)." if a.switch_s else "")
                      + (f" The adaptive policy explores with {explore} (the other `Exploration` fields at their "
                         "defaults)." if explore else "")
                      + (" adaptive_level = the adaptive policy before the shape correction (level-only grid "
                         "correction, no exploration)." if "adaptive_level" in a.policies else "")]}


def _mean_of_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from a level simulated with several seeds: numbers averaged, k shares too, each seed's throughput
    kept."""
    out = dict(runs[0])
    if len(runs) > 1:
        for key, v in runs[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                vals = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
                out[key] = sum(vals) / len(vals)
        ks = sorted({k for r in runs for k in r.get("k_share", {})}, key=int)
        out["k_share"] = {k: sum(r.get("k_share", {}).get(k, 0.0) for r in runs) / len(runs) for k in ks}
        out["throughput_by_seed"] = [r["throughput_tok_s"] for r in runs]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", help="step-time table JSON, or a measured sweep's JSON (required unless "
                    "--steps-from start-up-grid)")
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
    ap.add_argument("--steps-statistic", default="median", choices=["median", "min"],
                    help="with a sweep's JSON as --steps: each fixed-K cell's step time over its rounds")
    ap.add_argument("--start-up-grid", help="a sweep's JSON: the adaptive policies start from the grid its engines "
                    "profiled (step_grid.profiled_ms of its adaptive cells), not from the step-time table")
    ap.add_argument("--steps-from", default="steps", choices=["steps", "start-up-grid"],
                    help="start-up-grid: the simulated steps cost what the recorded start-up grid says "
                    "(no shape error)")
    ap.add_argument("--seeds", type=int, default=1, help="simulate every cell with this many seeds from --seed, mean")
    ap.add_argument("--prompt-len", type=int, default=0,
                    help="model joins as the engine does: prompts of this many tokens, chunked prefill "
                    "(0: not modelled)")
    ap.add_argument("--token-budget", type=int, default=512, help="tokens a step (the engine's max_num_batched_tokens)")
    ap.add_argument("--prefill-s-per-token", type=float, default=0.0, help="added step time per prompt token")
    ap.add_argument("--sweep-trace-order", action="store_true",
                    help="hand acceptance traces out in the sweep's order (warm-up waves and earlier levels first)")
    ap.add_argument("--old-draft-accounting", action="store_true",
                    help="the engine before a step's choice and verified depth were told apart (before/after)")
    ap.add_argument("--switch-s", type=float, default=0.0,
                    help="added time of a decode step after a step of another shape (e.g. 7e-5: the tiny pair's H200)")
    ap.add_argument("--explore", default="",
                    help="the adaptive policy's exploration, FIELD=VALUE,... of `Exploration` (e.g. far=0.01,near=0.1)")
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
