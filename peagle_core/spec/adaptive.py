"""Goodput-optimal speculation depth: pick k in [k_min, K] maximising expected tokens per second.

    goodput(k) = B * (1 + sum_{i<=k} prod_{j<=i} a_j) / T(B, k)

a_j is the conditional acceptance of draft j given drafts 1..j-1 were accepted, estimated online
with exponential forgetting, each position shrunk toward the one before it (the first toward a
prior): a depth abandoned after bad luck drifts back and is tried again, and a depth not tried yet
is judged by the evidence next to it.

T comes from a step-time model profiled at start-up and refined from live step times. The engine uses
`StepGrid`: whole steps measured per batch-size bucket and k, so the drafter's cost (constant in k for
P-EAGLE, one pass per draft for EAGLE-3) is in it. `StepTimeModel` (the target's cost as a function of
tokens plus a drafter pass) remains for profiles of that form.
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
        """Rescale every profiled size by the measured over predicted target share of a step (the level, not
        the shape: see `StepGrid`, whose live correction works the same way and for the same reason)."""
        if num_tokens <= 0:
            return
        draft = self.draft_pass * (max(k, 1) if self.per_k_draft else 1)
        ratio = max(seconds - draft, 1e-6) / self.target(num_tokens)
        self.times = rescaled(self.times, ratio, self.smoothing)


class StepGrid:
    """T(B, k) measured at start-up on real verify steps (`profile_step_grid`): B requests, each feeding
    1 + k tokens after a cached context, through the runner's whole step (target, sampling, drafter;
    CUDA graphs where the engine uses them). Linear in B between profiled batch sizes (the last slope
    past them), exact in k. Live decode steps refine its level, not its shape: the ratio of each measured
    to predicted step time rescales the whole rows it was interpolated from. Correcting only the cell of
    the k that ran would favour whichever k the policy happened to choose first: a profile that runs 30%
    slow everywhere (start-up jitter, clocks) leaves every other k 30% too dear, and the policy stays on
    its first choice (on the H200 sweep: mean k 1.7 at 16 requests, where k = 7 was best).

    The step is what the policy pays for, so it is measured whole: a model of the target's token count
    alone misses the attention over the context, the drafter's dependence on B (and, for P-EAGLE's
    input, on k) and the sampling, and on a CPU it was off by 2x either way."""

    def __init__(self, times: dict[int, list[float]], smoothing: float = 0.2):
        if not times or any(len(row) != len(next(iter(times.values()))) for row in times.values()):
            raise ValueError("a step grid needs rows of T(B, k) for k = 0..K, the same K for every batch size")
        self.sizes = sorted(times)
        self.rows = [list(times[b]) for b in self.sizes]
        self.K, self.smoothing = len(self.rows[0]) - 1, smoothing

    def _weights(self, batch: int) -> list[tuple[int, float]]:
        """(row, weight) pairs whose weighted sum is the linear interpolation (or extrapolation) at `batch`."""
        s = self.sizes
        if len(s) == 1:
            return [(0, batch / s[0])]
        i = bisect.bisect_left(s, batch)
        if i < len(s) and s[i] == batch:
            return [(i, 1.0)]
        if i == 0:
            return [(0, 1.0)]
        i = min(i, len(s) - 1)  # past the last size: the last segment's slope
        w = (batch - s[i - 1]) / (s[i] - s[i - 1])
        return [(i - 1, 1.0 - w), (i, w)]

    def step(self, batch: int, k: int, prefill_tokens: int = 0) -> float:
        k = min(k, self.K)
        # A deeper verify never costs less than a shallower one: the running max over k keeps timing
        # noise in the profile from making some k look cheaper than k - 1.
        t = sum(w * max(self.rows[r][:k + 1]) for r, w in self._weights(max(batch, 1)))
        if prefill_tokens:  # prompt tokens in the same step: the marginal cost of a verified token
            top = self.rows[-1]
            t += prefill_tokens * max(top[-1] - top[0], 0.0) / max(self.sizes[-1] * self.K, 1)
        return t

    def observe(self, num_tokens: int, k: int, seconds: float, batch: int) -> None:
        if batch <= 0 or k > self.K or num_tokens > batch * (1 + k):
            return  # a step with prompt tokens in it does not measure T(B, k)
        ratio = seconds / self.step(batch, k)
        for r, w in self._weights(batch):
            if 0 < w <= 1:
                self.rows[r] = rescaled(self.rows[r], ratio, self.smoothing * w)


def rescaled(times: list[float], ratio: float, rate: float) -> list[float]:
    """`times` moved a step `rate` of the way toward `ratio` x themselves (a measured / predicted ratio)."""
    scale = max(1.0 + rate * (ratio - 1.0), 1e-3)
    return [t * scale for t in times]


def profile_step_grid(runner, max_batch: int, K: int, context: int = 256, passes: int = 3) -> StepGrid:
    """Time `runner.execute` on synthetic decode batches: B = 1, 2, 4, ... max_batch requests with
    `context` tokens already cached (fewer when the KV cache is small), each verifying k = 0..K drafts.
    The engine calls this at start-up, before any request: the K/V it writes land in free blocks that a
    request overwrites before reading (every forward writes a position before attending to it). The drafts
    verified are the drafter's own proposals for those contexts (random tokens without a drafter).

    One untimed pass over the whole grid first (CUDA-graph capture, compilation, clocks coming up), then
    `passes` timed passes, each cell keeping its fastest: timing noise only ever adds, and one slow outlier
    must not shape the row. (With the median of two back-to-back calls, one slow k = 0 cell at start-up
    became the whole row's floor through `StepGrid.step`'s running max, every k looked equally dear, and
    the H200 sweep's policy verified 7 drafts where 1 was best.)"""
    import time

    import torch

    from peagle_core.engine.request import Request
    from peagle_core.engine.scheduler import Scheduled
    from peagle_core.engine.types import SamplingParams

    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch)
    bs, num_blocks = runner.block_size, runner.target_cache.shape[2]
    per_req = num_blocks // max_batch
    ctx = min(context, per_req * bs - 2 * K - 2, runner.max_model_len - 2 * K - 2)
    if ctx < 1:
        raise ValueError(f"the KV cache ({num_blocks} blocks of {bs}) is too small to profile {max_batch} requests")
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    vocab = runner.vocab_size
    gen = torch.Generator().manual_seed(0)

    def requests(B: int) -> list[Request]:
        out = []
        for i in range(B):
            ids = torch.randint(0, vocab, (ctx + 1,), generator=gen).tolist()
            req = Request(f"profile-{i}", ids, params)
            req.num_computed = ctx
            req.drafts = torch.randint(0, vocab, (K,), generator=gen).tolist()
            req.block_table = list(range(i * per_req, (i + 1) * per_req))
            out.append(req)
        return out

    reqs = {B: requests(B) for B in sizes}
    if getattr(runner, "drafter", None) is not None:
        # Verify what the drafter proposes, not random tokens: the experts a verify step reads depend on its
        # tokens, and random ones spread over more experts (H200, 20B shape: `peagle bench` verifies 7 random
        # drafts at 1.9x the cost of 1; in the replayed sweep a whole k = 7 step cost 1.12x a k = 1 step).
        for B in sizes:
            proposed = runner.execute([Scheduled(r, 1, 0) for r in reqs[B]], draft_len=K).drafts
            for r, d in zip(reqs[B], proposed):
                r.drafts = d[:K] + r.drafts[len(d):]
    batches = {(B, k): [Scheduled(r, 1, k) for r in reqs[B]] for B in sizes for k in range(K + 1)}
    times = {cell: float("inf") for cell in batches}
    for timed in [False] + [True] * passes:
        for (B, k), batch in batches.items():
            t0 = time.perf_counter()
            runner.execute(batch, draft_len=k)  # ends in the step's device-to-host copy
            if timed:
                times[B, k] = min(times[B, k], time.perf_counter() - t0)
    return StepGrid({B: [times[B, k] for k in range(K + 1)] for B in sizes})


class AdaptiveDepth(DepthPolicy):
    def __init__(self, K: int, times: "StepTimeModel | StepGrid", k_min: int = 0, prior: float = 0.6):
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
        if info.num_verify:  # k = 0 steps too: they are how the model learns what not speculating costs
            self.times.observe(outcome.num_tokens, outcome.k, outcome.step_time, info.num_verify)
        if info.num_verify:  # a request that verified nothing (k = 0) emits exactly one token
            self.last["realized_tokens_per_step"] = (sum(a + 1 for _, a in outcome.accepted)
                                                     + max(0, info.num_verify - len(outcome.accepted)))
            self.last["measured_step_s"] = outcome.step_time

    def describe(self) -> dict[str, float]:
        return {**self.tally.as_dict(), **self.last}
