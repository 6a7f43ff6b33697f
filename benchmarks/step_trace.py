"""Per-step timings of an engine run, split where a host-bound step spends its time.

`StepTrace(engine)` is a context manager: while it is open, every `engine.step()` adds one row:
    total    the whole `step()` call
    choose   the policy's choice           observe  the policy's bookkeeping after the step
    launch   `runner.execute` up to its device-to-host copy, less `learn`
    learn    the policy's work while the device runs (`while_busy`)
    wait     the device-to-host copy (the device's remainder of the step, then the copy)
    gc       the garbage collector's pauses inside the call
    between  the caller's time since the previous `step()` returned (adding requests, its own bookkeeping)
and the step's shape: requests, tokens, whether it was a uniform decode step (the graph family), k, drafts,
and `compiles`: Triton kernel variants of `kernels/` compiled inside the call (a JIT stall, 0.1-0.4 s on an H200).
Everything is wrapped on the instances, so the engine's code is the one measured (plus a few us of wrapping).
`compare(a, b)` sets two traces of the same step sequence side by side (policy_overhead.py --trace).
"""
from __future__ import annotations

import gc
import time
from typing import Any

from peagle_kernels.dispatch import compiled_variants, triton_kernels
from peagle_core.engine.graphs import is_uniform_decode

FIELDS = ("total", "choose", "launch", "learn", "wait", "observe", "gc", "between")


class StepTrace:
    def __init__(self, engine):
        self.engine, self.rows = engine, []
        self.kernels = triton_kernels()  # loaded by the engine's build (its captures and warm-up)
        self._row: dict[str, Any] = {}
        self._gc_start = self._last_end = None

    def __enter__(self) -> "StepTrace":
        e, policy, runner = self.engine, self.engine.policy, self.engine.runner
        step, execute, to_host = e.step, runner.execute, runner._to_host
        choose, observe, learn = policy.choose, policy.observe, policy.learn

        def timed(name: str, fn):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._row[name] = self._row.get(name, 0.0) + time.perf_counter() - t0
            return wrapper

        def traced_execute(batch, draft_len=None, while_busy=None):
            self._row.update(requests=len(batch), tokens=sum(s.num_tokens for s in batch),
                             decode=is_uniform_decode(batch), k=max((s.num_drafts for s in batch), default=0),
                             drafted=draft_len)
            t0 = time.perf_counter()
            out = execute(batch, draft_len=draft_len, while_busy=while_busy)
            self._row["launch"] = time.perf_counter() - t0 - self._row.get("wait", 0.0) - self._row.get("learn", 0.0)
            return out

        def traced_step():
            compiled = sum(compiled_variants(self.kernels).values())  # outside the timed span
            t0 = time.perf_counter()
            self._row = {"between": t0 - self._last_end if self._last_end is not None else 0.0, "gc": 0.0}
            out = step()
            end = time.perf_counter()
            self._row["total"] = end - t0
            self._row["compiles"] = sum(compiled_variants(self.kernels).values()) - compiled
            self._last_end = time.perf_counter()  # `between` starts after the counting
            if "requests" in self._row:  # a call that ran a step
                self.rows.append(self._row)
            return out

        # the policy's own instance attributes (policy_overhead.py wraps some), to put back; the rest are methods
        self._policy = policy
        self._originals = {n: policy.__dict__[n] for n in ("choose", "observe", "learn") if n in policy.__dict__}
        e.step, runner.execute, runner._to_host = traced_step, traced_execute, timed("wait", to_host)
        policy.choose, policy.observe, policy.learn = timed("choose", choose), timed("observe", observe), \
            timed("learn", learn)
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)
        for o, name in ((self.engine, "step"), (self.engine.runner, "execute"), (self.engine.runner, "_to_host")):
            o.__dict__.pop(name, None)  # the class's method again
        for name in ("choose", "observe", "learn"):
            self._policy.__dict__.pop(name, None)
        self._policy.__dict__.update(self._originals)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self._row["gc"] = self._row.get("gc", 0.0) + time.perf_counter() - self._gc_start
            self._gc_start = None


def totals(rows: list[dict], decode: bool | None = None) -> dict[str, float]:
    """Milliseconds per field summed over the rows (only decode or only mixed steps if `decode` is given)."""
    pick = [r for r in rows if decode is None or r["decode"] == decode]
    return {"steps": len(pick), "compiles": sum(r.get("compiles", 0) for r in pick),
            **{f: 1e3 * sum(r.get(f, 0.0) for r in pick) for f in FIELDS}}


def stalls(rows: list[dict], ms: float = 10.0) -> list[dict]:
    """The steps that took over `ms` milliseconds (a tiny-pair step takes ~1): index, shape and parts, in ms."""
    return [{"step": i, **{k: r[k] for k in ("decode", "requests", "tokens", "k", "drafted", "compiles") if k in r},
             **{f: round(1e3 * r.get(f, 0.0), 2) for f in FIELDS}} for i, r in enumerate(rows) if r["total"] > ms / 1e3]


def compare(a: list[dict], b: list[dict]) -> dict[str, Any]:
    """Two traces of one step sequence (same shapes step for step): where `a` spent more time than `b`."""
    same = len(a) == len(b) and all((x["requests"], x["tokens"], x["decode"]) == (y["requests"], y["tokens"], y["decode"])
                                    for x, y in zip(a, b))
    out: dict[str, Any] = {"aligned": same}
    for name, d in (("all", None), ("decode", True), ("mixed", False)):
        ta, tb = totals(a, d), totals(b, d)
        out[name] = {f: round(ta[f] - tb[f], 3) for f in FIELDS} | {
            "steps": (ta["steps"], tb["steps"]), "compiles": (ta["compiles"], tb["compiles"])}
    if same:  # where the extra time sits: the steps with the largest differences
        diffs = sorted(((1e3 * (x["total"] - y["total"]), i) for i, (x, y) in enumerate(zip(a, b))), reverse=True)
        out["largest_ms"] = [(round(d, 3), i, a[i]["decode"], a[i]["k"], a[i]["compiles"]) for d, i in diffs[:10]]
        out["median_diff_ms"] = round(sorted(d for d, _ in diffs)[len(diffs) // 2], 4)
    return out
