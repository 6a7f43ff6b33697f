"""Baseline depth policies from other engines, run on our engine for comparison with `AdaptiveDepth`.

BatchSizeTable  vLLM's `num_speculative_tokens_per_batch_size`: a static schedule [start_bs, end_bs, k];
                the batch size alone picks k (the table is tuned offline, acceptance is not looked at).
EmaTiers        SGLang-like adaptive tiers: an exponential moving average of the accepted drafts per
                verify picks k among a few candidate depths, with warm-up, an update interval and
                hysteresis; the batch size is not looked at.

Both are emulations written from the published descriptions (docs, PR text), not ports: the exact
rules are in the docstrings. Neither reads step times, so neither can tell when speculation costs
more than it brings at a given load, which is what `AdaptiveDepth` adds.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

from peagle_core.depth.policy import DepthPolicy, StepInfo, StepOutcome

if TYPE_CHECKING:
    from peagle_core.config import SpeculativeConfig


class BatchSizeTable(DepthPolicy):
    """k = the entry whose [start_bs, end_bs] holds the batch size (requests verifying this step).

    Entries must be contiguous from batch size 1 (vLLM's docs write them so); batch sizes past the
    last entry use its k. A step with nothing to verify looks up batch size 1 (for EAGLE-3 that
    choice only sets how far the next step's drafts reach).
    """

    def __init__(self, K: int, table: Sequence[Sequence[int]]):
        from peagle_core.config import check_batch_table

        self.K = K
        self.table = [(int(s), int(e), int(k)) for s, e, k in table]
        if not self.table:
            raise ValueError("a batch-size table needs at least one [start_bs, end_bs, k] entry")
        check_batch_table(self.table, K)
        self.last: dict[str, float] = {}

    def lookup(self, batch: int) -> int:
        for start, end, k in self.table:
            if start <= batch <= end:
                return k
        return self.table[-1][2]

    def choose(self, info: StepInfo) -> int:
        batch = max(info.num_verify, 1)
        k = min(self.lookup(batch), info.max_k)
        if info.num_verify:
            self.last = {"k": float(k), "batch": float(info.num_verify)}
        return k

    def describe(self) -> dict[str, float]:
        return {**self.tally.as_dict(), **self.last}


class EmaTiers(DepthPolicy):
    """SGLang-like tiers (its parameter names and defaults; the rule as written here).

    After each step that verified drafts, `ema <- (1 - alpha) * ema + alpha * mean accepted drafts per
    verifying request` (the first observation sets it). The tier starts at the largest candidate and,
    once `warmup_steps` such steps have passed, is revisited every `update_interval` of them. The depth
    aimed for is one more than the accepted run, `ema + 1`, rounded half up and mapped to the smallest
    candidate at least that deep (the largest if none is):

        up   = tier(round(ema + 1 + up_hysteresis));    move up   if up   > current
        down = tier(round(ema + 1 + down_hysteresis));  else move down if down < current

    A step that verifies nothing keeps the current tier.
    """

    def __init__(self, K: int, candidate_steps: Sequence[int] = (1, 3, 7), ema_alpha: float = 0.2,
                 update_interval: int = 5, warmup_steps: int = 10, up_hysteresis: float = 0.0,
                 down_hysteresis: float = -0.25):
        tiers = sorted({min(int(t), K) for t in candidate_steps})
        if not tiers or tiers[0] < 1:  # a tier of 0 verifies nothing, so the EMA could never leave it
            raise ValueError(f"candidate_steps must be depths >= 1, got {list(candidate_steps)}")
        if not 0 < ema_alpha <= 1 or update_interval < 1 or warmup_steps < 0:
            raise ValueError("ema tiers need 0 < ema_alpha <= 1, update_interval >= 1 and warmup_steps >= 0")
        self.K, self.tiers = K, tiers
        self.alpha, self.interval, self.warmup = ema_alpha, update_interval, warmup_steps
        self.up_h, self.down_h = up_hysteresis, down_hysteresis
        self.current = tiers[-1]
        self.ema: float | None = None
        self.observed = 0  # steps that verified drafts

    def tier(self, depth: int) -> int:
        return next((t for t in self.tiers if t >= depth), self.tiers[-1])

    def choose(self, info: StepInfo) -> int:
        return min(self.current, info.max_k)

    def observe(self, info: StepInfo, outcome: StepOutcome) -> None:
        self.record(info, outcome)
        if not outcome.accepted:
            return
        mean = sum(a for _, a in outcome.accepted) / len(outcome.accepted)
        self.ema = mean if self.ema is None else (1 - self.alpha) * self.ema + self.alpha * mean
        self.observed += 1
        if self.observed > self.warmup and (self.observed - self.warmup) % self.interval == 0:
            up = self.tier(_round_half_up(self.ema + 1 + self.up_h))
            down = self.tier(_round_half_up(self.ema + 1 + self.down_h))
            if up > self.current:
                self.current = up
            elif down < self.current:
                self.current = down

    def describe(self) -> dict[str, float]:
        d = {**self.tally.as_dict(), "k": float(self.current)}
        if self.ema is not None:
            d["ema_accepted"] = self.ema
        return d


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def from_config(spec: "SpeculativeConfig") -> DepthPolicy:
    """The baseline policy a `speculative_config` asks for (`batch_table` or `ema_tiers`)."""
    K = spec.num_speculative_tokens
    if spec.policy == "batch_table":
        return BatchSizeTable(K, spec.num_speculative_tokens_per_batch_size or [])
    if spec.policy == "ema_tiers":
        from peagle_core.config import EmaTiersConfig

        c = spec.ema_tiers or EmaTiersConfig()
        return EmaTiers(K, c.candidate_steps, c.ema_alpha, c.update_interval, c.warmup_steps, c.up_hysteresis,
                        c.down_hysteresis)
    raise ValueError(f"depth policy {spec.policy!r} is not a baseline (batch_table or ema_tiers)")
