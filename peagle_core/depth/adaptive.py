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

When the step's token budget cannot hold every request at some k, the ranking is of steady states instead
(`AdaptiveDepth._sustained`): a deep k leaves prompts less of the budget, so fewer requests decode at once.
"""
from __future__ import annotations

import bisect
import functools
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from peagle_core.depth.policy import DepthPolicy, StepInfo, StepOutcome, is_decode_step


@dataclass
class AcceptanceEstimate:
    """Per-position conditional acceptance: forgetful evidence, shrunk toward the previous position.

    A position no request judged in a step (the step verified fewer drafts, or every request stopped before
    it) forgets faster than one that was judged: the choices that skip it cannot refresh its evidence, so a
    low early rate must not outlive them (a policy dropped to k = 1 at a level's start and, at the slow rate,
    stayed there for a quarter of the level). A position that keeps being judged keeps the slow rate, so its
    estimate stays precise where acceptance is steady.

    Position 1 always forgets at the slow rate. Nobody judges it only in k = 0 steps, and leaving k = 0 costs a
    drafter pass plus the catch-up of the positions skipped, for one probe step; forgetting it fast sent a policy
    that had settled at k = 0 (sampled requests the drafter rarely guesses) back to a probe every ~15 steps. It still
    drifts back to the prior, only slower, and exploration tries k > 0 meanwhile, so k = 0 is not absorbing."""

    K: int
    prior: float = 0.6
    prior_weight: float = 4.0
    decay: float = 0.98  # per step, for a position some request judged: the estimate follows the workload
    unjudged_decay: float = 0.9  # per step, for a position past 1 nobody judged: back to its neighbour's rate in ~20
    reached: list[float] = field(default_factory=list)   # (decayed) times position j was judged
    accepted: list[float] = field(default_factory=list)  # (decayed) times it passed

    def __post_init__(self) -> None:
        self.reached = [0.0] * self.K
        self.accepted = [0.0] * self.K

    def observe(self, verified: list[tuple[int, int]]) -> None:
        # Positions 0..judged-1 were judged by at least one request (a request judges a prefix of positions).
        # Counted per request as histograms, then summed from the deep end: a request judging positions
        # 0..m-1 adds one to reached[j] for every j < m. Position j was judged iff all before it passed, so a
        # request that accepted a of d drafts judged a + 1 of them (a if it accepted all) and passed a. (A plain
        # loop without calls: it runs per request every step, and min() in it cost 4x.)
        K = self.K
        judged_to, passed_to = [0] * (K + 1), [0] * (K + 1)
        for num_draft, num_acc in verified:
            judged_to[num_acc + (num_acc < num_draft)] += 1
            passed_to[num_acc] += 1
        judged = passed = 0
        for j in range(K - 1, -1, -1):
            judged += judged_to[j + 1]
            passed += passed_to[j + 1]
            # forget: without new evidence a position returns to its neighbour's rate (position 1: slowly, above)
            decay = self.decay if judged or j == 0 else self.unjudged_decay
            self.reached[j] = self.reached[j] * decay + judged
            self.accepted[j] = self.accepted[j] * decay + passed

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
        return self.expected_tokens_by_k()[min(k, self.K)]

    def expected_tokens_by_k(self, rates: list[float] | None = None) -> list[float]:
        """`expected_tokens(k)` for k = 0..K in one pass (the policy's host time is paid every step)."""
        out, total, run = [1.0], 1.0, 1.0
        for a in self.rates() if rates is None else rates:
            run *= a
            total += run
            out.append(total)
        return out


@dataclass
class PromptShare:
    """Prompt tokens fed per token emitted (rho), over the last steps: what the requests in the engine ask of the
    token budget besides their drafts. Per step, so it reads the regime the engine is in: high while a burst of
    arrivals is prefilled, the workload's prompt / output ratio in a steady stream. (Counted over finished
    requests it knew nothing until the first ones finished, and then only the short ones.)"""

    decay: float = 0.9  # per step: about the last 10 weigh
    prompt: float = 0.0
    output: float = 0.0

    def observe(self, prompt_tokens: int, emitted: int) -> None:
        self.prompt = self.prompt * self.decay + prompt_tokens
        self.output = self.output * self.decay + emitted

    @property
    def rho(self) -> float:
        return self.prompt / self.output if self.output > 0 else 0.0


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

    def steps(self, batch: int, max_k: int, prefill_tokens: int = 0) -> list[float]:
        """`step(batch, k)` for k = 0..max_k."""
        return [self.step(batch, k, prefill_tokens) for k in range(max_k + 1)]

    def observe(self, num_tokens: int, k: int, seconds: float, batch: int) -> None:
        """Rescale every profiled size by the measured over predicted target share of a step (the level, not
        the shape: see `StepGrid`, whose live correction works the same way and for the same reason)."""
        if num_tokens <= 0:
            return
        draft = self.draft_pass * (max(k, 1) if self.per_k_draft else 1)
        ratio = max(seconds - draft, 1e-6) / self.target(num_tokens)
        self.times = rescaled(self.times, ratio, self.smoothing)

    def observe_run(self, num_tokens: int, k: int, times: list[float], batch: int) -> None:
        """Several steps of one shape (`StepGrid.observe_run`), one after another."""
        for seconds in times:
            self.observe(num_tokens, k, seconds, batch)


# Step times a fold may queue for `learn` (`AdaptiveDepth.fold`) before it learns them itself: a long run of steps
# with prompt tokens, or no `learn` at all (a CPU), must not grow the queue without bound.
MAX_UNLEARNT = 16

# A ranking prepared while the device ran the last step serves the next choice unless that step added more
# than this share to the acceptance evidence (`AdaptiveDepth.choose`).
PREPARED_NEW_EVIDENCE = 0.1

# `AdaptiveDepth.learn` ranks afresh, and folds the step times it holds into the step-time model, once in this many
# steps (sooner for a batch size it has no ranking for, or while the evidence grows fast): in between, the last
# rankings serve.
RANK_EVERY = 4

# A ranking round `AdaptiveDepth.learn` leaves while the device is done waits at most this many `rank_every`s
# since the last round ended; then it is finished whatever the device.
STALE_ROUND = 2

# StepGrid's shape learning (see its docstring).
SHAPE_PRIOR = 1.0                # pseudo-observations that hold a cell's estimate toward its nearest observed neighbour
SHAPE_STEP_CLIP = math.log(1.5)  # one step moves a cell's estimate by at most this factor's share


class StepGrid:
    """T(B, k) measured at start-up on real verify steps (`profile_step_grid`): B requests, each feeding
    1 + k tokens after a cached context, through the runner's whole step (target, sampling, drafter;
    CUDA graphs where the engine uses them). Linear in B between profiled batch sizes (the last slope
    past them), exact in k.

    Live decode steps correct it in two parts, so that neither can lock the policy onto its first choice:

    - the LEVEL (`rows`): each step's measured / predicted ratio rescales the whole rows it was interpolated
      from. Correcting only the cell of the k that ran would leave every other k as wrong as the profile (a
      profile 30% slow everywhere keeps the policy on its first choice).
    - the SHAPE across k (`shape`): per (row, k) cell, a forgetful mean of the log error against the level's
      prediction. A cell's correction is its mean minus the evidence-weighted mean of the row's observed
      cells: an error common to every k is the level's business, only differences between k move a cell. The
      level alone never learns that the profile mis-charged depth. A row whose live steps all ran at one k
      gets no shape correction (the relative part is not observable), so `AdaptiveDepth` explores a little;
      a cell never run takes the error of the nearest cell that was (a profile errs smoothly in k).

    The step is what the policy pays for, so it is measured whole: a model of the target's token count alone
    misses the attention over the context, the drafter's dependence on B and k, and the sampling."""

    def __init__(self, times: dict[int, list[float]], smoothing: float = 0.2, shape_decay: float = 0.98,
                 learn_shape: bool = True):
        if not times or any(len(row) != len(next(iter(times.values()))) for row in times.values()):
            raise ValueError("a step grid needs rows of T(B, k) for k = 0..K, the same K for every batch size")
        self.sizes = sorted(times)
        self.rows = [list(times[b]) for b in self.sizes]
        self.K, self.smoothing = len(self.rows[0]) - 1, smoothing
        self.profile = [list(row) for row in self.rows]  # the start-up profile, never rescaled (sweeps record it)
        self.shape_decay, self.learn_shape = shape_decay, learn_shape
        n = len(self.sizes)
        self.log_err = [[0.0] * (self.K + 1) for _ in range(n)]   # forgetful mean of log(measured / profiled)
        self.evidence_rows = [[0.0] * (self.K + 1) for _ in range(n)]  # its (decayed) weight; 0: never observed
        self.shape = [[0.0] * (self.K + 1) for _ in range(n)]     # log shape correction per cell (0: none)
        self._monotone: list[list[float] | None] = [None] * n      # `monotone(r)`, until the next observation
        self._weights_at: dict[int, list[tuple[int, float]]] = {}
        self._at: dict[int, tuple[list[float], list[float]]] = {}  # `_batch(b)`, until the next observation

    def _weights(self, batch: int) -> list[tuple[int, float]]:
        """(row, weight) pairs whose weighted sum is the linear interpolation (or extrapolation) at `batch`;
        the sizes never change, so each batch's pairs are worked out once."""
        w = self._weights_at.get(batch)
        if w is None:
            w = self._weights_at[batch] = self._interpolation(batch)
        return w

    def _interpolation(self, batch: int) -> list[tuple[int, float]]:
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

    def _batch(self, batch: int) -> tuple[list[float], list[float]]:
        """T(batch, k) for k = 0..K and how much live evidence (decayed steps) the cells behind it hold, worked
        out once between two observations: a choice reads both every step, and `observe` works them out for
        the batch it saw while the device runs the next step (the next choice's batch, more often than not)."""
        got = self._at.get(batch)
        if got is None:
            times, evidence = [0.0] * (self.K + 1), [0.0] * (self.K + 1)
            for r, w in self._weights(batch):
                times = [t + w * c for t, c in zip(times, self.monotone(r))]
                if 0 < w <= 1:
                    evidence = [e + w * x for e, x in zip(evidence, self.evidence_rows[r])]
            got = self._at[batch] = (times, evidence)
        return got

    def evidence(self, batch: int) -> list[float]:
        """How much live evidence (decayed steps) the cells behind T(batch, k) hold, for k = 0..K (read only)."""
        return self._batch(max(batch, 1))[1]

    def cell(self, r: int, k: int) -> float:
        """The current estimate of row r's step time at k: level-corrected profile times shape correction."""
        return self.rows[r][k] * math.exp(self.shape[r][k])

    def step(self, batch: int, k: int, prefill_tokens: int = 0) -> float:
        """T(batch, k) alone (`steps`' entry k, without building the row: the budget-bound ranking reads one k at
        each of up to K + 1 batch sizes, each met once: interpolated here from the one or two rows, as `_batch`
        would, without building and caching their whole rows)."""
        batch, k = max(batch, 1), min(k, self.K)
        got = self._at.get(batch)
        if got is not None:
            t = got[0][k]
        else:
            t = 0.0
            for r, w in self._weights(batch):
                t += w * self.monotone(r)[k]
        return t + self._prefill_extra(prefill_tokens) if prefill_tokens else t

    def monotone(self, r: int) -> list[float]:
        """Row r's cells, each the max over k' <= k: a deeper verify never costs less than a shallower one, so
        timing noise in the profile cannot make some k look cheaper than k - 1. Kept until the next
        observation (a choice reads every k of one or two rows each step)."""
        row = self._monotone[r]
        if row is None:
            row, run, exp = [], 0.0, math.exp
            for t, s in zip(self.rows[r], self.shape[r]):  # `cell(r, k)` inline: this runs on every observed step
                c = t * exp(s)
                if c > run:
                    run = c
                row.append(run)
            self._monotone[r] = row
        return row

    def steps(self, batch: int, max_k: int, prefill_tokens: int = 0) -> list[float]:
        """T(batch, k) for k = 0..max_k (k past K costs what K does)."""
        out = self._batch(max(batch, 1))[0]
        if prefill_tokens:
            extra = self._prefill_extra(prefill_tokens)
            out = [t + extra for t in out]
        return out[:max_k + 1] + [out[-1]] * (max_k - self.K)

    def _prefill_extra(self, prefill_tokens: int) -> float:
        """Prompt tokens in the same step: the marginal cost of a verified token."""
        top = self.rows[-1]
        return prefill_tokens * max(top[-1] - top[0], 0.0) / max(self.sizes[-1] * self.K, 1)

    def observe(self, num_tokens: int, k: int, seconds: float, batch: int) -> None:
        self.observe_run(num_tokens, k, [seconds], batch)

    def observe_run(self, num_tokens: int, k: int, times: list[float], batch: int) -> None:
        """Steps of one shape that ran one after another, in one update: the level and the cell move as far as
        they would in that many single steps toward the run's mean (each step's ratio clipped on its own), at
        the cost of one (`AdaptiveDepth.learn` folds a few steps in at a time: on a host-bound engine the
        update's host time is the step's)."""
        times = [t for t in times if t > 0]
        if batch <= 0 or k > self.K or not is_decode_step(num_tokens, batch, k) or not times:
            return  # a step with prompt tokens in it does not measure T(B, k)
        n = len(times)
        interpolation = self._weights(batch)
        weights = [(r, w) for r, w in interpolation if 0 < w <= 1]
        # One stalled step (a GC pause, a late compile) must not multiply a whole row: the linear update
        # below would scale a row by 1 + 0.2 (r - 1), 2.8x for a 10x stall. Halving or doubling is plenty
        # for a genuine level error to be pulled in within a few steps.
        predicted = self.step(batch, k)
        ratio = sum(min(max(t / predicted, 0.5), 2.0) for t in times) / n
        level = sum(w * self.rows[r][k] for r, w in interpolation)  # the level's prediction, before any shape
        if self.learn_shape and level > 0:
            self._learn_shape(weights, k, math.log(sum(times) / n / level), n)
        for r, w in weights:
            rate = self.smoothing * w if n == 1 else 1.0 - (1.0 - self.smoothing * w) ** n
            self.rows[r] = rescaled(self.rows[r], ratio, rate)
            self._monotone[r] = None  # its shape (`_learn_shape`) may have moved too
        self._at.clear()
        self._batch(batch)  # now, while the device runs a step (`AdaptiveDepth.learn`), not in the next choice

    def _learn_shape(self, weights: list[tuple[int, float]], k: int, log_level_err: float, n: int = 1) -> None:
        """Fold one step's log(measured / level's prediction) into the cells (r, k) it was interpolated from.

        Against the level, which follows the host within a few steps, a step measures how its k differs from the
        others at the same moment; against the fixed start-up profile it also measured the host's speed, and
        the k that happened to run while the host was slow was charged for good. The row's current mean error
        is added back because the level has absorbed it: without it the errors of the k being run would drift
        to zero and take what was learnt of the others with them."""
        for r, w in weights:
            w *= n  # a run of n steps weighs n
            err, ev = self.log_err[r], self.evidence_rows[r]
            total = sum(ev)
            log_err = log_level_err + (sum(e * x for e, x in zip(ev, err)) / total if total > 0 else 0.0)
            decay = self.shape_decay ** w  # forget per step of this row, so a cell tracks a drifting workload
            ev = self.evidence_rows[r] = [e * decay for e in ev]
            if ev[k] == 0 and any(ev):  # a first look is clipped against what it was predicted with
                err[k] = _neighbours(err, [j for j, e in enumerate(ev) if e > 0])[k]
            if any(ev):  # a stalled step moves a cell by a bounded factor, never by the stall
                log_err = err[k] + min(max(log_err - err[k], -SHAPE_STEP_CLIP), SHAPE_STEP_CLIP)
            ev[k] += w
            err[k] += (w / ev[k]) * (log_err - err[k])  # a mean over the (forgetful) evidence
            self.shape[r] = _relative_shape(err, ev)


def _relative_shape(log_err: list[float], evidence: list[float]) -> list[float]:
    """Per k: the cell's log error, held toward its nearest observed neighbour's by `SHAPE_PRIOR`
    pseudo-observations (a cell never observed takes the neighbour's), minus the evidence-weighted mean over
    the observed cells: what differs between k, the common part being the level's. A cell the policy stopped
    running loses its evidence and drifts back to its neighbour, so a k abandoned after a few slow steps is
    tried again (as the acceptance estimate's neighbour prior does for a_j)."""
    seen = [k for k, e in enumerate(evidence) if e > 0]
    total = sum(evidence[k] for k in seen)
    if len(seen) < 2 or total <= 0:
        return [0.0] * len(log_err)  # one k observed (or none): nothing relative to learn
    mean = sum(evidence[k] * log_err[k] for k in seen) / total
    return [(x * e + SHAPE_PRIOR * near) / (x + SHAPE_PRIOR) - mean
            for e, x, near in zip(log_err, evidence, _neighbours(log_err, seen))]


def _neighbours(log_err: list[float], seen: list[int]) -> list[float]:
    """Per k: the log error of the observed cell (k in `seen`, ascending) nearest to k other than k itself, the
    mean of both at equal distance (k's own if it is the only one). It runs on every observed step, and which
    cells are observed rarely changes, so the cells each k reads are worked out once per `seen`."""
    return [log_err[a] if a == b else (log_err[a] + log_err[b]) / 2
            for a, b in _neighbour_cells(tuple(seen), len(log_err))]


@functools.lru_cache(maxsize=256)
def _neighbour_cells(seen: tuple[int, ...], size: int) -> tuple[tuple[int, int], ...]:
    """For `_neighbours`: per k the one or two cells (the same one twice if one) whose mean it takes."""
    out, i, n = [], 0, len(seen)
    for k in range(size):
        while i < n and seen[i] < k:
            i += 1  # seen[i]: the first observed cell at or after k
        j = i + 1 if i < n and seen[i] == k else i  # the first after k
        if i == 0:
            c = seen[j] if j < n else k  # none before k (k alone: its own)
            out.append((c, c))
        elif j == n or k - seen[i - 1] < seen[j] - k:
            out.append((seen[i - 1], seen[i - 1]))
        elif seen[j] - k < k - seen[i - 1]:
            out.append((seen[j], seen[j]))
        else:
            out.append((seen[i - 1], seen[j]))
    return tuple(out)


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
    `passes` timed passes, each cell keeping its fastest: timing noise only ever adds, and one slow cell
    would become its row's floor through the monotone-in-k rule and make every k look equally dear."""
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
    # At most the blocks of one max_model_len sequence a request: a wider block table than any request can
    # have is not a shape the CUDA graphs cover, and every profiled step ran eagerly (on the H200 sweeps a
    # flat ~20 ms host-bound grid at every B and k, where the graphs replay 3-10 ms steps).
    per_req = min(num_blocks // max_batch, -(-runner.max_model_len // bs))
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
            for s in batch:  # k = 0 drafted nothing and kept the drafter's inputs: the next cell must not catch up
                s.req.behind = None
    return StepGrid({B: [times[B, k] for k in range(K + 1)] for B in sizes})


@dataclass(slots=True)
class Ranking:
    """What a choice at one batch size is made from: per k = 0..K the acceptance rates, the tokens a request
    emits and the step's seconds; the best k, the alternative exploration would run, and whether that one is
    within the exploration margin of the best."""

    rates: list[float]
    tokens: list[float]
    seconds: list[float]
    best: int
    alt: int | None
    near: bool
    sustained: int | None = None  # requests the token budget keeps decoding at the best k, if it binds
    made: int = 0  # the policy's steps observed when it was ranked (its age: `AdaptiveDepth.choose`)
    serves: int = 0  # steps after `made` it may serve choices for (`AdaptiveDepth._rank`)
    weight: float = 0.0  # the acceptance evidence it was ranked with (position 1's decayed count of judgements)
    demand: tuple[int, int] = (0, 0)  # the requests and token budget it was ranked for (`_demand_of`)
    unbound: "Ranking | None" = None  # where the budget bound it: the ranking without the bound (`AdaptiveDepth.choose`)


@dataclass
class Exploration:
    """How often the adaptive policy runs another k than its best guess. `StepGrid` learns the shape of
    T(B, k) across k only from the k it sees run, and a policy that only ever runs its favourite never finds
    out that another k is relatively cheaper than profiled (the H200 sweep's fault). The alternative run is
    the best-ranked k after the favourite (the one that could overturn the choice, usually a neighbour) whose
    cells hold less than `fresh` recent evidence (one step measured at that batch size fades below it in
    about 20 steps): the cheapest informative measurement. Once it is measured, k's further away borrow its
    correction (`StepGrid`), so the policy can walk, or jump, toward the truly best k.

    Cost is bounded twice: an alternative within `margin` of the best predicted goodput is run with
    probability `near`, costing at most `margin` on those steps by the model's own account; a farther one only
    with probability `far`; and exploratory steps never exceed `cap` of the decode steps (a hard budget).
    Deterministic for a given `seed` (tests, simulations)."""

    margin: float = 0.03
    near: float = 0.20
    far: float = 0.03
    cap: float = 0.10
    fresh: float = 1.0  # an alternative whose cells hold this much recent evidence is not run again yet
    seed: int = 0

    @classmethod
    def off(cls) -> "Exploration":
        return cls(near=0.0, far=0.0, cap=0.0)


class AdaptiveDepth(DepthPolicy):
    def __init__(self, K: int, times: "StepTimeModel | StepGrid", k_min: int = 0, prior: float = 0.6,
                 explore: Exploration | None = None, rank_every: int = RANK_EVERY, flat_draft: bool = False):
        """`flat_draft`: the drafter proposes any depth in one pass (P-EAGLE), so a step exploring a shallower k
        still drafts the favourite's depth (`draft_depth`) and the next step can go back to it; drafting only
        the explored k, one exploration cost two shallow steps. Not for EAGLE-3, whose draft costs a pass a
        token."""
        if not 0 <= k_min <= K:
            raise ValueError(f"adaptive depth bounds must satisfy 0 <= min <= K, got {k_min}..{K}")
        self.K, self.k_min, self.times, self.flat_draft = K, k_min, times, flat_draft
        self.favourite = K  # the last choice's best-ranked k (what an exploring step drafts, with `flat_draft`)
        self.acceptance = AcceptanceEstimate(K, prior=prior)
        self.prompts = PromptShare()
        self._rate_keys = [f"accept_rate_{j + 1}" for j in range(K)]
        # the last choice: (k verified, k asked, batch, its ranking, whether it measures an alternative); `last`
        # spells it out only when read: metrics are polled, choices are made every step
        self._choice: tuple[int, int, int, Ranking, bool] | None = None
        self.learnt: dict[str, float] = {}  # the last step observed: realised tokens and its time
        # Exploring only pays where the step-time model learns per k (a grid); the token-count model
        # learns one level from any step, so it gets none.
        self.explore = explore if explore is not None else Exploration()
        if not getattr(times, "learn_shape", False):
            self.explore = Exploration.off()
        self.rng = random.Random(self.explore.seed)
        self.decisions = self.explored = 0  # decode-step choices, and how many of them explored
        self.pending: int | None = None  # a deeper alternative drafted this step, to measure (verify) in the next
        self.unlearnt: list[tuple[int, int, float, int]] = []  # step times not yet in the model, until `learn`
        # batch size -> ranking, worked out by `learn` for the next choices (kept until too old to serve: `choose`)
        self.prepared: dict[int, Ranking] = {}
        self._demand = (0, 0)  # the last choice's (requests, token budget): what `learn` ranks for
        self._kept: list[tuple] = []  # the steps observed and not folded in yet, in order (`observe`, `fold`)
        self.rank_every = max(1, rank_every)  # `learn`'s cadence, in steps
        self._steps = self._last_round = 0  # steps observed, and their count when `learn` last finished a round
        self._round: set[int] | None = None  # batch sizes ranked in a round `learn` has not finished (`busy`)

    def goodput(self, batch: int, k: int, prefill_tokens: int = 0) -> float:
        return batch * self.acceptance.expected_tokens(k) / self.times.step(batch, k, prefill_tokens)

    def _expected(self) -> tuple[list[float], list[float]]:
        """Acceptance rates and the tokens a request emits, for k = 0..K (the same at every batch size)."""
        rates = self.acceptance.rates()
        return rates, self.acceptance.expected_tokens_by_k(rates)

    def _rank(self, batch: int, K: int, prefill_tokens: int = 0,
              expected: tuple[list[float], list[float]] | None = None, demand: tuple[int, int] = (0, 0),
              serves: int | None = None) -> Ranking:
        """Acceptance rates, tokens a request emits and step seconds for k = 0..K at this batch size, the k of
        the best goodput (ties to the shallower) and the alternative exploration would run. `demand`: the
        requests in the engine and its token budget (`_sustained`). `serves`: the steps it may serve choices for
        (`_max_age` by default, for `learn`'s). (Plain loops: it runs on every step, and `max` with a key cost
        twice as much.)"""
        rates, tokens = expected or self._expected()
        seconds = self.times.steps(batch, K, prefill_tokens)
        lo = min(self.k_min, K)
        sustained = self._sustained(tokens, K, lo, *demand)
        free = [t / s for t, s in zip(tokens, seconds)]  # per request: the batch size is common to all
        serves = self._max_age() if serves is None else serves
        weight = self.acceptance.reached[0]
        if sustained is None:
            return Ranking(rates, tokens, seconds, *self._pick(free, lo, K, batch), None, self._steps, serves, weight,
                           demand)
        goodput = [b * t / self.times.step(b, k, prefill_tokens) for k, (b, t) in enumerate(zip(sustained, tokens))]
        best, alt, near = self._pick(goodput, lo, K, batch)
        # the same ranking without the bound, for the next choices if their budget is unbounded (`_demand_of`: the
        # prompts waiting fit the step), as a decode step's after the last prompt is in: else each ranked afresh
        unbound = Ranking(rates, tokens, seconds, *self._pick(free, lo, K, batch), None, self._steps, serves, weight,
                          (demand[0], 0))
        return Ranking(rates, tokens, seconds, best, alt, near, sustained[best], self._steps, serves, weight, demand,
                       unbound)

    def _pick(self, goodput: list[float], lo: int, K: int, batch: int) -> tuple[int, int | None, bool]:
        """The k of the best goodput in lo..K (ties to the shallower), the alternative exploration would run and
        whether it is within the exploration margin of the best."""
        best = lo
        for k in range(lo + 1, K + 1):
            if goodput[k] > goodput[best]:
                best = k
        alt = None
        if self.explore.cap > 0:  # the best-ranked k after the favourite whose cells were not measured lately:
            # re-measuring what was just measured says little, and when the runner-up is fresh the informative
            # k is often the next one (the other side of the favourite)
            evidence, fresh, top = self.times.evidence(batch), self.explore.fresh, self.times.K
            for k in range(lo, K + 1):
                if k != best and evidence[min(k, top)] < fresh and (alt is None or goodput[k] > goodput[alt]):
                    alt = k
        return best, alt, alt is not None and goodput[alt] >= (1.0 - self.explore.margin) * goodput[best]

    @staticmethod
    def _demand_of(info: StepInfo, K: int) -> tuple[int, int]:
        """The requests wanting a step and the token budget they share (`_sustained`). The budget counts as
        unbounded (0) when this step holds every prompt token waiting even at depth K (N - B (1 + K) >= the
        backlog): then no depth keeps a prompt out, whatever the prompt share says (a burst inflates it for the
        steps after it has been fed, and the policy kept verifying shallowly for prompts already in)."""
        budget, backlog = info.token_budget, info.prompt_backlog
        if budget and backlog is not None and backlog <= budget - info.num_verify * (1 + K):
            budget = 0
        return info.num_requests, budget

    def _sustained(self, tokens: list[float], K: int, lo: int, requests: int, budget: int) -> list[int] | None:
        """Decoding requests a step of `budget` tokens keeps going at each k, if at some k in lo..K it cannot keep
        all `requests` going; None if it can at every k (then the step's own batch is what k changes, the
        usual ranking).

        In a steady stream each request verifying k drafts feeds 1 + k tokens a step and emits E(k), and each
        emitted token brings rho prompt tokens behind it (`PromptShare`: a finished request is replaced), so the
        budget N holds at most N / ((1 + k) + rho E(k)) decoding requests. Past that, a deeper k does not make a
        step dearer but the batch smaller: prompts wait for budget while running requests verify deep drafts
        (the scheduler serves running requests first). Ranked by b_k E(k) / T(b_k, k), b_k = min(requests,
        that bound). Example: 64 requests, a 512-token budget, rho = 2 and the tiny head's acceptance give
        b = 64, 50, 36, 28 at k = 1, 3, 5, 7, and K3 ranks first (as the 20B-shape sweep measured). Prompt time
        is left out: it is the same per emitted token whatever k, so it does not change the order."""
        if requests <= 0 or budget <= 0:
            return None
        rho = self.prompts.rho
        bound = [budget / ((1 + k) + rho * tokens[k]) for k in range(K + 1)]
        if min(bound[lo:]) >= requests:
            return None
        return [max(1, min(requests, int(b))) for b in bound]

    def choose(self, info: StepInfo) -> int:
        """The depth to draft for the next step (at least: `draft_depth`), and to verify now as far as the drafts
        held allow (`StepInfo.verifiable`): the prediction and, through the engine's `StepOutcome.k`, the
        step-time model are for the depth verified (for the depth asked, a step that verified less taught the
        grid that its depth was cheap).

        The choice is made on the host between two device steps, so its work adds to every step. It uses the
        ranking `learn` prepared for this batch size while the device ran the last step, or one an earlier
        choice made, while either is young enough; it ranks afresh only when there is none, when the demand it
        was ranked for differs and the budget binds, or when the steps since add a large share of evidence."""
        K = min(self.K, info.max_k)
        if info.num_verify == 0:
            self.favourite = K
            return K  # nothing to verify: the choice only sets how far EAGLE-3 drafts
        verifiable = min(info.verifiable, K)
        demand = self._demand_of(info, K)
        r = self.prepared.get(info.num_verify) if not info.num_prefill_tokens and K == self.K else None
        # rankings age through steps without `learn` (host-bound steps: the device done before the host)
        if r is not None and self._steps - r.made >= r.serves:
            r = None
        if r is not None and demand != r.demand:  # ranked for another demand
            if r.sustained is not None:
                # the budget bound it: its unbound twin serves a demand whose budget is unbounded
                r = r.unbound if demand[1] == 0 else None
            elif demand[1]:  # a budget to check now (0: unbounded, e.g. the backlog fits: no fold needed)
                # the check reads the prompt share, which the last step moved (the step times: below)
                self.fold(learn_times=self.rank_every == 1)
                if self._sustained(r.tokens, K, min(self.k_min, K), *demand) is not None:
                    r = None  # it binds now
            if r is not None:
                r.demand = demand  # unbounded for this demand too: the next choice need not check again
        # ... and none serves if the steps since were a large part of all the evidence (a level's first steps,
        # where a choice behind on one step doubles a wrong early signal)
        if r is None or self._outgrows(r):
            self.fold(learn_times=self.rank_every == 1)  # the step times keep `learn`'s cadence
            r = self._rank(info.num_verify, K, info.num_prefill_tokens, demand=demand, serves=self.rank_every)
            if not info.num_prefill_tokens and K == self.K:
                # it serves this batch size's next choices for `learn`'s cadence, as a ranking `learn` made would:
                # where `learn` did not run (the device done first), every choice at the size ranked afresh
                self.prepared[info.num_verify] = r
        self._demand, self.favourite = demand, r.best
        pending, self.pending = self.pending, None
        if pending is not None and pending <= verifiable:
            k, measures = pending, True  # an alternative drafted last step (its budget spent then): measured now
        else:
            explored = r.alt is not None and self._explores(r.near)
            k = r.alt if explored else r.best
            self.explored += explored
            measures = explored and k <= verifiable
            if explored and not measures:
                self.pending = k  # deeper than the drafts held: drafted now, verified (measured) next step
        self.decisions += 1
        self._choice = (min(k, verifiable), k, info.num_verify, r, measures)
        return k

    @property
    def last(self) -> dict[str, float]:
        """The last choice's inputs and predictions (metrics): the k verified and asked, the batch, the tokens and
        seconds predicted for the step, whether it measured an alternative, the batch the budget sustains."""
        if self._choice is None:
            return {}
        v, k, batch, r, measures = self._choice
        predicted = batch * r.tokens[v]
        return {"k": v, "asked": k, "batch": batch, "predicted_tokens_per_step": predicted,
                "predicted_step_s": r.seconds[v], "predicted_tokens_per_s": predicted / r.seconds[v],
                "explored": float(measures), "sustained_batch": r.sustained if r.sustained is not None else batch}

    @property
    def last_rates(self) -> list[float]:
        """The acceptance rates behind the last choice (named in `describe`)."""
        return self._choice[3].rates if self._choice is not None else []

    def _max_age(self) -> int:
        """Steps after which a ranking no longer serves: older than `learn` ever leaves one (a round starts after
        `rank_every` steps and ends by STALE_ROUND x that), so it has not been running (host-bound steps: the device
        done before the host) or the batch size has not come back since."""
        return 2 * STALE_ROUND * self.rank_every

    def draft_depth(self, k: int) -> int:
        return max(k, self.favourite) if self.flat_draft else k

    def _explores(self, near: bool) -> bool:
        """Whether this step runs the alternative: by chance (`near` if its predicted goodput is within
        `margin` of the best, `far` otherwise), within the hard budget."""
        e = self.explore
        draw = self.rng.random()  # drawn before the budget check: the budget never shifts later draws
        if self.explored + 1 > e.cap * (self.decisions + 1):
            return False
        return draw < (e.near if near else e.far)

    def observe(self, info: StepInfo, outcome: StepOutcome) -> None:
        """Keep the step for `fold`: the next `learn` (while the device works on the next step), or the next choice
        that ranks afresh or checks the budget, or `describe`, folds the kept steps in, in order. A choice that
        finds its ranking needs of them only how much acceptance evidence they add (`_outgrows`), so every
        choice is the one folding each step at once would give (tests/test_depth_policies.py), and no fold sits
        on the critical path of a step `learn` did not run in (the device done first)."""
        self._steps += 1  # the rankings age by the step whether `learn` ran in it or not (`choose`, `learn`)
        if self._choice is None:
            self._kept.append((info, outcome, None, None, False))
        else:
            v, _, batch, r, measures = self._choice
            self._kept.append((info, outcome, batch * r.tokens[v], r.seconds[v], measures))

    def fold(self, learn_times: bool = True) -> None:
        """Fold the steps `observe` kept, in order, into the tally, the prompt share and the acceptance estimate,
        and queue their times for the step-time model. `learn_times` is for the last one; those before it are
        steps `learn` did not fold while the next one ran, and go in with their times learnt, as the immediate
        fold at the end of the step after each gave.

        Times are learnt here (`learn_times`) only after a decode step. `learn` and a choice that ranks afresh
        pass it only with `rank_every` 1, and otherwise keep `learn`'s cadence. After a step with prompt tokens
        (told by its token count: the engine chooses before it schedules) the times wait for the next `learn`:
        the engine skips `learn` in those steps, and learning on the critical path costs the step.

        No ranking is made on an estimate behind the steps observed (every maker folds first): a choice ranked
        without the step just before it doubles a wrong early signal at a level's start
        (tests/test_depth_policies.py)."""
        kept, self._kept = self._kept, []
        last = len(kept) - 1
        for i, step in enumerate(kept):
            self._fold_step(*step, learn_times=learn_times or i < last)

    def _fold_step(self, info: StepInfo, outcome: StepOutcome, predicted_tokens: float | None,
                   predicted_s: float | None, explored: bool, learn_times: bool) -> None:
        decode = is_decode_step(outcome.num_tokens, info.num_verify, outcome.k)
        if (learn_times and decode) or len(self.unlearnt) >= MAX_UNLEARNT:
            self._learn_time()
        realized, drafts = self.record(info, outcome, predicted_tokens, predicted_s, explored=explored)
        # the verifying requests fed one token each and their drafts; the rest of the step's tokens were prompts
        self.prompts.observe(max(outcome.num_tokens - info.num_verify - drafts, 0), realized)
        if not info.num_verify:
            return  # a prefill-only step: nothing could be judged (no sign a position went unjudged) or timed
        self.acceptance.observe(outcome.accepted)
        if outcome.timed:  # k = 0 steps too: they are how the model learns what not speculating costs
            self.unlearnt.append((outcome.num_tokens, outcome.k, outcome.step_time, info.num_verify))
        self.learnt = {"realized_tokens_per_step": realized, "measured_step_s": outcome.step_time}

    def _outgrows(self, r: Ranking) -> bool:
        """Whether the kept steps add more than PREPARED_NEW_EVIDENCE to the evidence `r` was ranked on. An upper
        bound on the weight first (no decay, every listed request judging position 1), the exact weight only when
        the bound passes the limit: in a steady state it never does, and the exact count walks the batch."""
        limit = (1.0 + PREPARED_NEW_EVIDENCE) * r.weight
        bound = self.acceptance.reached[0]
        for step in self._kept:
            bound += len(step[1].accepted)
        return bound > limit and self._weight() > limit

    def _weight(self) -> float:
        """Position 1's decayed count of judgements (the acceptance evidence's weight) once the kept steps are
        folded in, without folding them: every request that verified a draft judged position 1."""
        a = self.acceptance
        weight = a.reached[0]
        for info, outcome, *_ in self._kept:
            if info.num_verify:  # a prefill-only step is not folded into the estimate (`_fold_step`)
                judged = sum(d > 0 for d, _ in outcome.accepted)
                weight = weight * (a.decay if judged else a.unjudged_decay) + judged
        return weight

    def _learn_time(self) -> None:
        """The step times held, in the order the steps ran; consecutive steps of one shape in one update."""
        timings, self.unlearnt = self.unlearnt, []
        for (num_tokens, k, batch), run in itertools.groupby(timings, key=lambda t: (t[0], t[1], t[3])):
            self.times.observe_run(num_tokens, k, [t[2] for t in run], batch)

    def learn(self, busy: Callable[[], bool] | None = None) -> None:
        """While the device runs a step: the kept steps folded in; then, once in `rank_every` steps or when a batch
        size the next choice may meet has no ranking, the step times held into the step-time model and the
        rankings the next choice will most likely need (this step's batch size, one request fewer or more: a
        request finishing or one done with its prompt; one more only while requests wait to join).

        Not every step: on a host-bound engine the device finishes tens of microseconds after the last launch,
        and ranking every step outlasted it. The model and the rankings move over tens of steps, so a choice a
        few steps behind on them loses little; one whose batch size or demand was not ranked for, or that
        follows a large share of new evidence, still ranks afresh (`choose`).

        `busy` (the engine's probe of the device): past the fold, each part of a round (the step times, then
        each batch size's ranking) starts only while the device still runs the step, and the rest waits for
        the next call, so a round is spread over steps whose device time hides it. A round left for
        `STALE_ROUND` x `rank_every` steps is finished whatever the device. Without `busy` (tests, simulations)
        a round is done at once."""
        # every `rank_every` steps the times held go in as runs of one shape (`_learn_time`); learning every step,
        # the one folded in now goes in alone, as each step's did before the cadence
        self.fold(learn_times=self.rank_every == 1)
        batch = self._choice[2] if self._choice is not None else 0
        sizes = [b for b in ((batch - 1, batch, batch + 1) if self._demand[0] > batch else (batch - 1, batch)) if b > 0]
        age = self._steps - self._last_round  # the steps since the last round ended
        # ... unless the next choice would rank afresh for the evidence it adds (the next step judges position 1
        # at most `batch` times): while the evidence grows fast, at a level's start, ranking stays here
        weight = self.acceptance.reached[0] + batch
        if self._round is None and age < self.rank_every and all(
                (r := self.prepared.get(b)) is not None and self._serves(r)
                and weight <= (1.0 + PREPARED_NEW_EVIDENCE) * r.weight for b in sizes):
            return  # the last rankings serve
        forced = busy is None or age >= STALE_ROUND * self.rank_every
        if self._round is None:
            if not forced and not busy():
                return
            self._learn_time()
            self._round = set()
            # other batch sizes keep their rankings made in the last `rank_every` steps: a burst of finishes moves
            # the batch by more than one and back, and a round that kept only its own sizes left over a third of
            # the choices unprepared; older ones go (kept longer, they chose less often as a fresh ranking would)
            self.prepared = {b: r for b, r in self.prepared.items()
                             if b in sizes or self._steps - r.made < self.rank_every}
        expected = self._expected()
        for b in sizes:
            if b not in self._round:
                if not forced and not busy():
                    return  # the device is done: the rest of the round waits for the next step's call
                self.prepared[b] = self._rank(b, self.K, expected=expected, demand=self._demand_for(b))
                self._round.add(b)
        self._last_round, self._round = self._steps, None

    def _serves(self, r: Ranking) -> bool:
        """Whether `r` serves the last choice's demand as it is: ranked for it, or bound by a budget that is
        unbounded now (its twin serves: `choose`)."""
        return r.demand == self._demand or (r.unbound is not None and self._demand[1] == 0)

    def _demand_for(self, batch: int) -> tuple[int, int]:
        """The demand `learn` ranks this batch size for: the last choice's, except that a ranking the budget bound
        is made again for its own demand while the budget is unbounded, its twin serving the unbounded choices. In
        a stream the steps with prompt chunks (bound) and the decode steps between them (unbounded) alternate, and
        ranking for the last one alone left the next of the other kind to rank afresh on the critical path."""
        r = self.prepared.get(batch)
        if self._demand[1] == 0 and r is not None and r.unbound is not None:
            return r.demand
        return self._demand

    def describe(self) -> dict[str, float]:
        self.fold()  # the metrics count every step, the last one before the engine idles too
        return {**self.tally.as_dict(), **self.last, **self.learnt, **dict(zip(self._rate_keys, self.last_rates)),
                "prompt_tokens_per_output_token": self.prompts.rho}
