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
import math
import random
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
        # loop: it runs per request every step.)
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
        """`expected_tokens(k)` for k = 0..K in one pass."""
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
        """Rescale every profiled size by the measured over predicted target share of a step (the level, as
        `StepGrid` corrects it)."""
        if num_tokens <= 0:
            return
        draft = self.draft_pass * (max(k, 1) if self.per_k_draft else 1)
        ratio = max(seconds - draft, 1e-6) / self.target(num_tokens)
        self.times = rescaled(self.times, ratio, self.smoothing)


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
        """T(batch, k) for k = 0..K, and how much live evidence (decayed steps) the cells behind it hold."""
        times, evidence = [0.0] * (self.K + 1), [0.0] * (self.K + 1)
        for r, w in self._weights(batch):
            times = [t + w * c for t, c in zip(times, self.monotone(r))]
            if 0 < w <= 1:
                evidence = [e + w * x for e, x in zip(evidence, self.evidence_rows[r])]
        return times, evidence

    def evidence(self, batch: int) -> list[float]:
        """How much live evidence (decayed steps) the cells behind T(batch, k) hold, for k = 0..K."""
        return self._batch(max(batch, 1))[1]

    def cell(self, r: int, k: int) -> float:
        """The current estimate of row r's step time at k: level-corrected profile times shape correction."""
        return self.rows[r][k] * math.exp(self.shape[r][k])

    def step(self, batch: int, k: int, prefill_tokens: int = 0) -> float:
        return self.steps(batch, k, prefill_tokens)[k]

    def monotone(self, r: int) -> list[float]:
        """Row r's cells, each the max over k' <= k: a deeper verify never costs less than a shallower one, so
        timing noise in the profile cannot make some k look cheaper than k - 1. Kept until the next
        observation."""
        row = self._monotone[r]
        if row is None:
            row, run, exp = [], 0.0, math.exp
            for t, s in zip(self.rows[r], self.shape[r]):  # `cell(r, k)`
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
        """One live step: the level of the rows it was interpolated from, and the shape of its cells."""
        if batch <= 0 or k > self.K or seconds <= 0 or not is_decode_step(num_tokens, batch, k):
            return  # a step with prompt tokens in it does not measure T(B, k)
        interpolation = self._weights(batch)
        weights = [(r, w) for r, w in interpolation if 0 < w <= 1]
        # One stalled step (a GC pause, a late compile) must not multiply a whole row: the linear update
        # below would scale a row by 1 + 0.2 (r - 1), 2.8x for a 10x stall. Halving or doubling is plenty
        # for a genuine level error to be pulled in within a few steps.
        ratio = min(max(seconds / self.step(batch, k), 0.5), 2.0)
        level = sum(w * self.rows[r][k] for r, w in interpolation)  # the level's prediction, before any shape
        if self.learn_shape and level > 0:
            self._learn_shape(weights, k, math.log(seconds / level))
        for r, w in weights:
            self.rows[r] = rescaled(self.rows[r], ratio, self.smoothing * w)
            self._monotone[r] = None  # its shape may have moved too

    def _learn_shape(self, weights: list[tuple[int, float]], k: int, log_level_err: float) -> None:
        """Fold one step's log(measured / level's prediction) into the cells (r, k) it was interpolated from.

        Against the level, which follows the host within a few steps, a step measures how its k differs from the
        others at the same moment; against the fixed start-up profile it also measured the host's speed, and
        the k that happened to run while the host was slow was charged for good. The row's current mean error
        is added back because the level has absorbed it: without it the errors of the k being run would drift
        to zero and take what was learnt of the others with them."""
        for r, w in weights:
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


@dataclass
class Exploration:
    """How often the adaptive policy runs another k than its best guess. `StepGrid` learns the shape of
    T(B, k) across k only from the k it sees run, and a policy that only ever runs its favourite never finds
    out that another k is relatively cheaper than profiled. The alternative run is
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
    """Each step: rank k = 0..K by goodput at this batch size (`_rank`), run the best, or now and then the
    alternative exploration picks; fold the step back into the acceptance estimate and the step-time model."""

    def __init__(self, K: int, times: "StepTimeModel | StepGrid", k_min: int = 0, prior: float = 0.6,
                 explore: Exploration | None = None, flat_draft: bool = False):
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
        # Exploring only pays where the step-time model learns per k (a grid); the token-count model
        # learns one level from any step, so it gets none.
        self.explore = explore if explore is not None else Exploration()
        if not getattr(times, "learn_shape", False):
            self.explore = Exploration.off()
        self.rng = random.Random(self.explore.seed)
        self.decisions = self.explored = 0  # decode-step choices, and how many of them explored
        self.pending: int | None = None  # a deeper alternative drafted this step, to measure (verify) in the next
        self.last: dict[str, float] = {}  # the last choice's inputs and predictions (metrics)
        self.learnt: dict[str, float] = {}  # the last step observed: realised tokens and its time
        self._prediction: tuple[float, float, bool] | None = None  # the last choice's tokens, seconds, exploring

    def goodput(self, batch: int, k: int, prefill_tokens: int = 0) -> float:
        return batch * self.acceptance.expected_tokens(k) / self.times.step(batch, k, prefill_tokens)

    def _rank(self, batch: int, K: int, prefill_tokens: int, demand: tuple[int, int]):
        """Tokens a request emits and step seconds for k = 0..K, goodput per k, and the requests the token budget
        keeps decoding at each k (None where it holds them all: `_sustained`)."""
        tokens = self.acceptance.expected_tokens_by_k()
        seconds = self.times.steps(batch, K, prefill_tokens)
        sustained = self._sustained(tokens, K, min(self.k_min, K), *demand)
        if sustained is None:
            goodput = [t / s for t, s in zip(tokens, seconds)]  # per request: the batch size is common to all
        else:
            goodput = [b * t / self.times.step(b, k, prefill_tokens) for k, (b, t) in enumerate(zip(sustained, tokens))]
        return tokens, seconds, goodput, sustained

    def _pick(self, goodput: list[float], lo: int, K: int, batch: int) -> tuple[int, int | None, bool]:
        """The k of the best goodput in lo..K (ties to the shallower), the alternative exploration would run and
        whether it is within the exploration margin of the best."""
        best = lo
        for k in range(lo + 1, K + 1):
            if goodput[k] > goodput[best]:
                best = k
        alt = None
        if self.explore.cap > 0:  # the best-ranked k after the favourite whose cells were not measured lately:
            # re-measuring what was just measured says little
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
        steps after it has been fed)."""
        budget, backlog = info.token_budget, info.prompt_backlog
        if budget and backlog is not None and backlog <= budget - info.num_verify * (1 + K):
            budget = 0
        return info.num_requests, budget

    def _sustained(self, tokens: list[float], K: int, lo: int, requests: int, budget: int) -> list[int] | None:
        """Decoding requests a step of `budget` tokens keeps going at each k, if at some k in lo..K it cannot keep
        all `requests` going; None if it can at every k (then the step's own batch is what k changes).

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
        step-time model are for the depth verified (for the depth asked, a step that verified less would teach
        the grid that its depth was cheap)."""
        K = min(self.K, info.max_k)
        if info.num_verify == 0:
            self.favourite = K
            return K  # nothing to verify: the choice only sets how far EAGLE-3 drafts
        verifiable, lo = min(info.verifiable, K), min(self.k_min, K)
        tokens, seconds, goodput, sustained = self._rank(info.num_verify, K, info.num_prefill_tokens,
                                                         self._demand_of(info, K))
        best, alt, near = self._pick(goodput, lo, K, info.num_verify)
        self.favourite = best
        pending, self.pending = self.pending, None
        if pending is not None and pending <= verifiable:
            k, measures = pending, True  # an alternative drafted last step (its budget spent then): measured now
        else:
            explored = alt is not None and self._explores(near)
            k = alt if explored else best
            self.explored += explored
            measures = explored and k <= verifiable
            if explored and not measures:
                self.pending = k  # deeper than the drafts held: drafted now, verified (measured) next step
        self.decisions += 1
        v, batch = min(k, verifiable), info.num_verify
        predicted = batch * tokens[v]
        self._prediction = (predicted, seconds[v], measures)
        self.last = {"k": v, "asked": k, "batch": batch, "predicted_tokens_per_step": predicted,
                     "predicted_step_s": seconds[v], "predicted_tokens_per_s": predicted / seconds[v],
                     "explored": float(measures),
                     "sustained_batch": sustained[best] if sustained is not None else batch}
        return k

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
        """The step into the tally, the prompt share, the acceptance estimate and the step-time model."""
        predicted, seconds, explored = self._prediction or (None, None, False)
        self._prediction = None
        realized, drafts = self.record(info, outcome, predicted, seconds, explored=explored)
        # the verifying requests fed one token each and their drafts; the rest of the step's tokens were prompts
        self.prompts.observe(max(outcome.num_tokens - info.num_verify - drafts, 0), realized)
        if not info.num_verify:
            return  # a prefill-only step: nothing could be judged (no sign a position went unjudged) or timed
        self.acceptance.observe(outcome.accepted)
        if outcome.timed:  # k = 0 steps too: they are how the model learns what not speculating costs
            self.times.observe(outcome.num_tokens, outcome.k, outcome.step_time, info.num_verify)
        self.learnt = {"realized_tokens_per_step": realized, "measured_step_s": outcome.step_time}

    def describe(self) -> dict[str, float]:
        rates = dict(zip((f"accept_rate_{j + 1}" for j in range(self.K)), self.acceptance.rates()))
        return {**self.tally.as_dict(), **self.last, **self.learnt, **rates,
                "prompt_tokens_per_output_token": self.prompts.rho}
