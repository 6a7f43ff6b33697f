"""Goodput-optimal speculation depth: pick k in [k_min, K] maximising expected tokens per second.

    goodput(k) = B * (1 + sum_{i<=k} prod_{j<=i} a_j) / T(B, k)

a_j is the conditional acceptance of draft j given drafts 1..j-1 were accepted, estimated online
with exponential forgetting, each position shrunk toward the one before it (the first toward a
prior): a depth abandoned after bad luck drifts back and is tried again, and a depth not tried yet
is judged by the evidence next to it. T comes from a step-time model: the target's cost as a function of the tokens it
verifies, profiled at start-up and refined from live step times, plus the drafter's cost (constant
in k for P-EAGLE, one pass per draft for EAGLE-3).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from peagle_core.spec.depth import DepthPolicy, StepInfo, StepOutcome


@dataclass
class AcceptanceEstimate:
    """Per-position conditional acceptance: forgetful evidence, shrunk toward the previous position."""

    K: int
    prior: float = 0.6
    prior_weight: float = 4.0
    decay: float = 0.98  # per step: older evidence weighs less, so the estimate follows the workload
    reached: list[float] = field(default_factory=list)   # (decayed) times position j was judged
    accepted: list[float] = field(default_factory=list)  # (decayed) times it passed

    def __post_init__(self) -> None:
        self.reached = [0.0] * self.K
        self.accepted = [0.0] * self.K

    def observe(self, verified: list[tuple[int, int]]) -> None:
        for j in range(self.K):  # forget: without new evidence a position returns to its neighbour's rate
            self.reached[j] *= self.decay
            self.accepted[j] *= self.decay
        for num_draft, num_acc in verified:
            for j in range(min(num_draft, num_acc + 1)):  # position j was judged iff all before it passed
                self.reached[j] += 1
                self.accepted[j] += j < num_acc

    def rates(self) -> list[float]:
        """a_j = (passed_j + w a_{j-1}) / (judged_j + w), a_0 = prior: `prior_weight` pseudo-observations at
        the previous position's rate. Positions a shallow policy never reaches (the deep ones) so take
        the rate next to them, not a fixed guess, and the policy can find out that going deeper pays."""
        out, prev = [], self.prior
        for a, r in zip(self.accepted, self.reached):
            prev = (a + self.prior_weight * prev) / (r + self.prior_weight)
            out.append(prev)
        return out

    def expected_tokens(self, k: int) -> float:
        """1 + sum_{i<=k} prod_{j<=i} a_j: tokens one request emits when verifying k drafts."""
        total, run = 1.0, 1.0
        for a in self.rates()[:k]:
            run *= a
            total += run
        return total


class StepTimeModel:
    """Step time as a piecewise-linear function of target tokens, plus the drafter's cost."""

    def __init__(self, points: dict[int, float], draft_pass: float = 0.0, per_k_draft: bool = False,
                 smoothing: float = 0.2):
        if not points:
            raise ValueError("the step-time model needs at least one profiled point")
        self.sizes = sorted(points)
        self.times = [points[n] for n in self.sizes]
        self.draft_pass, self.per_k_draft, self.smoothing = draft_pass, per_k_draft, smoothing

    def target(self, n: int) -> float:
        i = bisect.bisect_left(self.sizes, n)
        if i < len(self.sizes) and self.sizes[i] == n:
            return self.times[i]
        if i == 0:
            return self.times[0]
        if i == len(self.sizes):  # extrapolate with the last slope
            if len(self.sizes) == 1:
                return self.times[0] * n / self.sizes[0]
            n0, n1, t0, t1 = self.sizes[-2], self.sizes[-1], self.times[-2], self.times[-1]
        else:
            n0, n1, t0, t1 = self.sizes[i - 1], self.sizes[i], self.times[i - 1], self.times[i]
        return t0 + (t1 - t0) * (n - n0) / (n1 - n0)

    def step(self, batch: int, k: int, prefill_tokens: int = 0) -> float:
        draft = self.draft_pass * (max(k, 1) if self.per_k_draft else 1)
        return self.target(batch * (1 + k) + prefill_tokens) + draft

    def observe(self, num_tokens: int, k: int, seconds: float, batch: int) -> None:
        """Refine the nearest profiled size with the target share of a measured step."""
        draft = self.draft_pass * (max(k, 1) if self.per_k_draft else 1)
        i = min(range(len(self.sizes)), key=lambda j: abs(self.sizes[j] - num_tokens))
        measured = max(seconds - draft, 1e-6) * self.sizes[i] / max(num_tokens, 1) if self.sizes[i] != num_tokens \
            else max(seconds - draft, 1e-6)
        if abs(self.sizes[i] - num_tokens) <= 0.25 * self.sizes[i]:
            self.times[i] += self.smoothing * (measured - self.times[i])


class AdaptiveDepth(DepthPolicy):
    def __init__(self, K: int, times: StepTimeModel, k_min: int = 0, prior: float = 0.6):
        if not 0 <= k_min <= K:
            raise ValueError(f"adaptive depth bounds must satisfy 0 <= min <= K, got {k_min}..{K}")
        self.K, self.k_min, self.times = K, k_min, times
        self.acceptance = AcceptanceEstimate(K, prior=prior)
        self.last: dict[str, float] = {}

    def goodput(self, batch: int, k: int, prefill_tokens: int = 0) -> float:
        return batch * self.acceptance.expected_tokens(k) / self.times.step(batch, k, prefill_tokens)

    def choose(self, info: StepInfo) -> int:
        K = min(self.K, info.max_k)
        if info.num_verify == 0:
            return K  # nothing to verify: the choice only sets how far EAGLE-3 drafts
        best = max(range(min(self.k_min, K), K + 1),
                   key=lambda k: (self.goodput(info.num_verify, k, info.num_prefill_tokens), -k))
        tokens = info.num_verify * self.acceptance.expected_tokens(best)
        seconds = self.times.step(info.num_verify, best, info.num_prefill_tokens)
        self.last = {"k": best, "batch": info.num_verify, "predicted_tokens_per_step": tokens,
                     "predicted_step_s": seconds, "predicted_tokens_per_s": tokens / seconds,
                     **{f"accept_rate_{j + 1}": a for j, a in enumerate(self.acceptance.rates())}}
        return best

    def observe(self, info: StepInfo, outcome: StepOutcome) -> None:
        self.record(info, outcome, self.last.get("predicted_tokens_per_step"), self.last.get("predicted_step_s"))
        self.acceptance.observe(outcome.accepted)
        if outcome.accepted:
            self.times.observe(outcome.num_tokens, outcome.k, outcome.step_time, len(outcome.accepted))
        if info.num_verify:  # a request that verified nothing (k = 0) emits exactly one token
            self.last["realized_tokens_per_step"] = (sum(a + 1 for _, a in outcome.accepted)
                                                     + max(0, info.num_verify - len(outcome.accepted)))
            self.last["measured_step_s"] = outcome.step_time

    def describe(self) -> dict[str, float]:
        return {**self.tally.as_dict(), **self.last}
