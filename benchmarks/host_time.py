"""The engine loop's host time per step: its wall time outside `ModelRunner.execute` (choosing k, scheduling,
appending tokens, detokenizing, the policy's bookkeeping), which a GPU step does not hide.

    python benchmarks/host_time.py --requests 32 --max-tokens 960                 # fixed K = 3, the shipped pair
    python benchmarks/host_time.py --requests 64 --max-tokens 48 --policy adaptive --k 7

On the shipped tiny pair on a CPU the device step is slow, but the host work around it is the same Python as on
a GPU host. Prints one JSON line: steps, the mean host microseconds a step, and the same over the first and last
quarter of the steps (a cost that grows with the output's length shows in the last quarter).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peagle_core import SamplingParams  # noqa: E402
from peagle_core.config import parse_engine_config  # noqa: E402
from peagle_core.engine.llm_engine import LLMEngine  # noqa: E402


def measure(requests: int, max_tokens: int, policy: str, k: int, max_model_len: int) -> dict:
    spec = {"method": "eagle3", "model": "tiny-peagle", "num_speculative_tokens": k, "parallel_drafting": True}
    if policy != "fixed":
        spec["depth_policy"] = policy
    engine = LLMEngine(parse_engine_config(model="tiny", device="cpu", dtype="float32", max_num_seqs=requests,
                                           max_model_len=max_model_len, speculative_config=spec))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(requests):
        engine.add_request(f"r{i}", f"def f{i}(n):", params)
    host = []
    while engine.has_work():
        executing, t0 = engine.execute_seconds, time.perf_counter()
        engine.step()
        host.append(time.perf_counter() - t0 - (engine.execute_seconds - executing))
    q = max(len(host) // 4, 1)
    us = lambda xs: round(1e6 * sum(xs) / len(xs), 1)
    return {"requests": requests, "max_tokens": max_tokens, "policy": policy, "k": k, "steps": len(host),
            "host_us_per_step": us(host), "first_quarter_us": us(host[:q]), "last_quarter_us": us(host[-q:]),
            "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=960)
    p.add_argument("--policy", default="fixed", help="fixed (K = --k) or a depth policy name, e.g. adaptive")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=1024)
    a = p.parse_args(argv)
    print(json.dumps(measure(a.requests, a.max_tokens, a.policy, a.k, a.max_model_len)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
