"""Speculation depth policies: each step verifies the first k <= K drafts, k chosen here.

The engine asks `choose(info)` once per step (one k for the whole batch, so verify shapes stay
graph-friendly) and reports back with `observe(...)` after the step, so a policy can learn
acceptance rates and step times online.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepInfo:
    num_verify: int          # requests that will verify drafts this step
    num_prefill_tokens: int  # prompt tokens in the same step
    max_k: int               # K: drafts available per request


@dataclass(frozen=True)
class StepOutcome:
    k: int
    accepted: list[tuple[int, int]]  # (drafts verified, drafts accepted) per verifying request
    step_time: float                 # seconds, device work included
    num_tokens: int                  # target tokens in the step


class DepthPolicy:
    """Interface: subclasses pick k in 0..K."""

    def choose(self, info: StepInfo) -> int:
        raise NotImplementedError

    def observe(self, info: StepInfo, outcome: StepOutcome) -> None:
        pass

    def describe(self) -> dict[str, float]:
        """Inputs behind the last choice, exported as metrics."""
        return {}


class FixedDepth(DepthPolicy):
    def __init__(self, k: int):
        self.k = k

    def choose(self, info: StepInfo) -> int:
        return min(self.k, info.max_k)
