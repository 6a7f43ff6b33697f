"""The engine loop's host time per step: its wall time outside `ModelRunner.execute` (choosing k, scheduling,
appending tokens, detokenizing, the policy's bookkeeping), which a GPU step does not hide.

    python benchmarks/host_time.py --requests 32 --max-tokens 960                 # fixed K = 3, the shipped pair
    python benchmarks/host_time.py --requests 64 --max-tokens 48 --policy adaptive --k 7
    python benchmarks/host_time.py --stop-filter        # one request's stop-string filter alone, as outputs grow
    python benchmarks/host_time.py --requests 64 --max-tokens 128 --policy adaptive --k 7 --closed-loop 300

On the shipped tiny pair on a CPU the device step is slow, but the host work around it is the same Python as on
a GPU host. Prints one JSON line: steps, the mean host microseconds a step, and the same over the first and last
quarter of the steps (a cost that grows with the output's length shows in the last quarter), and the parts of
it timed by wrapping them: the depth policy's `choose` + `observe`, the scheduler, appending tokens, the text
updates (detokenizing). `--closed-loop STEPS` keeps
`--requests` in flight (each finished request replaced), so the batch size moves as in a serving engine. It only
wraps methods, so the script also runs on older commits (copy it into a checkout's `benchmarks/` and run it there)
for before/after figures.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peagle_core import SamplingParams  # noqa: E402
from peagle_core.config import parse_engine_config  # noqa: E402
from peagle_core.engine.llm_engine import LLMEngine  # noqa: E402
from peagle_core.engine.output import OutputState  # noqa: E402


class Loop:
    """The shipped tiny pair on the CPU (P-EAGLE at depth k, `policy` fixed or a depth-policy name) with `requests`
    fixed-length requests in it; `add()` puts in one more (a closed loop replaces each finished one)."""

    def __init__(self, requests: int, max_tokens: int, policy: str, k: int, max_model_len: int):
        spec = {"method": "eagle3", "model": "tiny-peagle", "num_speculative_tokens": k, "parallel_drafting": True}
        if policy != "fixed":
            spec["depth_policy"] = policy
        self.engine = LLMEngine(parse_engine_config(model="tiny", device="cpu", dtype="float32",
                                                    max_num_seqs=requests, max_model_len=max_model_len,
                                                    speculative_config=spec))
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.added = 0
        for _ in range(requests):
            self.add()

    def add(self) -> None:
        self.engine.add_request(f"r{self.added}", f"def f{self.added}(n):", self.params)
        self.added += 1


def measure(requests: int, max_tokens: int, policy: str, k: int, max_model_len: int, closed_loop: int = 0) -> dict:
    loop = Loop(requests, max_tokens, policy, k, max_model_len)
    engine, add = loop.engine, loop.add
    parts: dict[str, float] = {}
    wrapped = [(engine.runner, "execute", "execute"), (engine.policy, "choose", "choose"),
               (engine.policy, "observe", "observe"), (engine.scheduler, "schedule", "schedule"),
               (engine, "_append", "append"), (OutputState, "update", "text")]
    originals = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in wrapped]
    for obj, name, part in wrapped:
        timed(obj, name, part, parts)
    host = []
    try:
        while engine.has_work() and (not closed_loop or len(host) < closed_loop):
            executing, t0 = parts.get("execute", 0.0), time.perf_counter()
            updates = engine.step()
            host.append(time.perf_counter() - t0 - (parts["execute"] - executing))
            if closed_loop:  # a finished request's place taken by a new one: joins and a moving batch size
                for u in updates:
                    if u.req.finished:
                        add()
    finally:  # unwrap (the class's method too: it outlives this engine)
        for obj, name, original in originals:
            if original is None:
                delattr(obj, name)
            else:
                setattr(obj, name, original)
    q = max(len(host) // 4, 1)
    us = lambda xs: round(1e6 * sum(xs) / len(xs), 1)
    return {"requests": requests, "max_tokens": max_tokens, "policy": policy, "k": k, "steps": len(host),
            "host_us_per_step": us(host), "first_quarter_us": us(host[:q]), "last_quarter_us": us(host[-q:]),
            **{f"{part}_us_per_step": round(1e6 * t / len(host), 1) for part, t in parts.items() if part != "execute"},
            "policy_us_per_step": round(1e6 * (parts.get("choose", 0.0) + parts.get("observe", 0.0)) / len(host), 1),
            "closed_loop": bool(closed_loop), "torch": torch.__version__}


def timed(obj, name: str, part: str, parts: dict[str, float]) -> None:
    """Wrap obj.name (an instance's or a class's method) so that its time adds to parts[part]."""
    method = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            parts[part] = parts.get(part, 0.0) + time.perf_counter() - t0

    setattr(obj, name, functools.wraps(method)(wrapper))


def stop_filter_pushes(pushes: int = 8000, piece: int = 4) -> dict:
    """`StopFilter.push` alone, microseconds a push over a long output of `piece`-character pushes, with two stop
    strings that never occur and with none: the mean over all pushes and over the last eighth (a cost that grows
    with the text already pushed shows there)."""
    import random

    from peagle_core.loading.tokenizer import StopFilter

    rng = random.Random(0)
    pieces = ["".join(rng.choice("abcdefgh ") for _ in range(piece)) for _ in range(pushes)]
    out = {"pushes": pushes}
    for name, stops in (("no_stops", []), ("two_stops", ["</answer>", "\n\nUser:"])):
        f, times = StopFilter(stops), []
        for text in pieces:
            t0 = time.perf_counter()
            f.push(text, final=False)
            times.append(time.perf_counter() - t0)
        tail = times[-pushes // 8:]
        out[f"{name}_us"] = round(1e6 * sum(times) / len(times), 2)
        out[f"{name}_last_eighth_us"] = round(1e6 * sum(tail) / len(tail), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=960)
    p.add_argument("--policy", default="fixed", help="fixed (K = --k) or a depth policy name, e.g. adaptive")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--stop-filter", action="store_true", help="time the stop-string filter alone instead")
    p.add_argument("--closed-loop", type=int, default=0, metavar="STEPS",
                   help="replace each finished request by a new one, for STEPS steps (the batch size moves)")
    a = p.parse_args(argv)
    if a.stop_filter:
        print(json.dumps(stop_filter_pushes()))
        return 0
    print(json.dumps(measure(a.requests, a.max_tokens, a.policy, a.k, a.max_model_len, a.closed_loop)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
