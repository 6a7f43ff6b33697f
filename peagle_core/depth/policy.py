"""Speculation depth policies: each step verifies the first k <= K drafts, k chosen here.

The engine asks `choose(info)` once per step (one k for the whole batch, so verify shapes stay
graph-friendly) and reports back with `observe(...)` after the step, so a policy can learn
acceptance rates and step times online; `learn()` runs while the device executes the next step.
The step drafts `draft_depth(k)` (k for every policy but one) for the next one and verifies what the previous
step drafted, at most k: `StepOutcome.k` is the depth it verified.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepInfo:
    """What a step's choice is made from. The choice k is also how many drafts the step makes for the next
    one, so a step verifies min(k, drafts): the drafts its requests hold are those the previous step made."""

    num_verify: int           # requests that will verify drafts this step
    num_prefill_tokens: int   # prompt tokens in the same step
    max_k: int                # K: the deepest a policy may ask for
    drafts: int | None = None  # drafts every verifying request holds (None: max_k)
    num_requests: int = 0     # requests that want a step: running or waiting, at most max_num_seqs (0: unknown)
    token_budget: int = 0     # tokens one step may feed the target (0: unbounded)
    prompt_backlog: int | None = None  # prompt tokens waiting to be fed: those of running requests still in their
    # prompts, and of waiting ones that may join (up to max_num_seqs); None: unknown

    @property
    def verifiable(self) -> int:
        return self.max_k if self.drafts is None else min(self.drafts, self.max_k)


def is_decode_step(num_tokens: int, num_verify: int, k: int) -> bool:
    """Whether a step fed exactly its verifying requests' 1 + k tokens each: no prompt tokens, and no request
    verifying fewer drafts than k (the token budget or max_model_len cut them). That is the uniform decode step
    T(B, k) stands for, the one the CUDA graphs replay; the others can cost ~2x, and counted as decode steps they
    would charge the k that ran for it. The engine
    decides k before it schedules, so `StepInfo.num_prefill_tokens` cannot say this; the step's token count can."""
    return num_tokens == num_verify * (1 + k)


@dataclass(frozen=True)
class StepOutcome:
    k: int                           # drafts the step verified (min of the choice and the drafts held)
    accepted: list[tuple[int, int]]  # (drafts verified, drafts accepted) per verifying request
    step_time: float                 # seconds, device work included
    num_tokens: int                  # target tokens in the step
    timed: bool = True               # False: the step also captured a CUDA graph, so step_time is not its cost
    drafted: int = 0                 # drafts the step made for the next one (`DepthPolicy.draft_depth`)


@dataclass
class DepthTally:
    """Cumulative counts over decode steps (steps with requests that could verify drafts).

    The replica polls these and exports the differences as counters, so every step is counted
    even though metrics are only sampled: the distribution of k, tokens per request per verify,
    and predicted against realised tokens and step time.
    """

    steps: int = 0
    depth_sum: int = 0
    steps_at_k: list[int] = field(default_factory=list)         # [k] -> steps that chose k
    tokens_per_verify: list[int] = field(default_factory=list)  # [n] -> request-steps that emitted n tokens
    realized_tokens: int = 0
    step_seconds: float = 0.0
    predicted_steps: int = 0          # steps whose policy made a prediction (adaptive)
    predicted_tokens: float = 0.0
    predicted_step_seconds: float = 0.0
    measured_step_seconds: float = 0.0  # the same steps, as measured
    predicted_realized_tokens: int = 0  # the same steps, as realised
    explored_steps: int = 0           # steps that ran another k than the policy's best guess, to measure it
    # Pure decode steps (no prompt tokens, no capture) by the k verified: their count and seconds, so a run can
    # set one engine's step cost at k beside another's (a depth-7 engine's k = 1 steps beside a K1 engine's).
    decode_steps_at_k: list[int] = field(default_factory=list)
    decode_seconds_at_k: list[float] = field(default_factory=list)
    decode_drafted_at_k: list[int] = field(default_factory=list)  # and the drafts they made (P-EAGLE: input size)

    def record(self, info: StepInfo, outcome: StepOutcome, predicted_tokens: float | None = None,
               predicted_step_s: float | None = None, explored: bool = False) -> tuple[int, int]:
        """Count one step; returns the tokens its verifying requests emitted and the drafts they verified (0, 0
        for a prefill-only step): with the step's token count these say how many of its tokens were prompts."""
        if info.num_verify == 0:
            return 0, 0  # prefill only: k just sets how far EAGLE-3 drafts
        k = outcome.k
        self.steps += 1
        self.depth_sum += k
        self.explored_steps += explored
        _bump(self.steps_at_k, k)
        # The engine lists only requests that verified drafts; the others (k = 0, or drafts capped by
        # max_tokens) emitted exactly one token each.
        counts, size = self.tokens_per_verify, max(k, info.max_k) + 2  # a request emits at most K + 1 tokens
        if len(counts) < size:
            counts.extend([0] * (size - len(counts)))
        realized = drafts = 0
        for d, a in outcome.accepted:  # a plain loop: it runs per request on every step (host time)
            counts[a + 1] += 1
            realized += a + 1
            drafts += d
        ones = max(0, info.num_verify - len(outcome.accepted))
        counts[1] += ones
        realized += ones
        self.realized_tokens += realized
        self.step_seconds += outcome.step_time
        if outcome.timed and is_decode_step(outcome.num_tokens, info.num_verify, k):
            _bump(self.decode_steps_at_k, k)
            _bump(self.decode_seconds_at_k, k, outcome.step_time)
            _bump(self.decode_drafted_at_k, k, outcome.drafted)
        if predicted_tokens is not None and predicted_step_s is not None and outcome.timed:
            self.predicted_steps += 1
            self.predicted_tokens += predicted_tokens
            self.predicted_step_seconds += predicted_step_s
            self.measured_step_seconds += outcome.step_time
            self.predicted_realized_tokens += realized
        return realized, drafts

    def as_dict(self) -> dict[str, float]:
        d = {name: float(getattr(self, name)) for name in (
            "steps", "depth_sum", "realized_tokens", "step_seconds", "predicted_steps", "predicted_tokens",
            "predicted_step_seconds", "measured_step_seconds", "predicted_realized_tokens", "explored_steps")}
        d.update({f"steps_at_k.{k}": float(n) for k, n in enumerate(self.steps_at_k) if n})
        d.update({f"tokens_per_verify.{n}": float(c) for n, c in enumerate(self.tokens_per_verify) if c})
        d.update({f"decode_steps_at_k.{k}": float(n) for k, n in enumerate(self.decode_steps_at_k) if n})
        d.update({f"decode_seconds_at_k.{k}": s for k, s in enumerate(self.decode_seconds_at_k) if s})
        d.update({f"decode_drafted_at_k.{k}": float(n) for k, n in enumerate(self.decode_drafted_at_k) if n})
        return d


def _bump(counts: list, i: int, by: float = 1) -> None:
    if len(counts) <= i:
        counts.extend([0] * (i + 1 - len(counts)))
    counts[i] += by


class DepthPolicy:
    """Interface: subclasses pick k in 0..K.

    `observe` and `describe` keep a `DepthTally` for every policy; a subclass that overrides
    `observe` calls `self.record(...)` (with its prediction, if it makes one).
    """

    def choose(self, info: StepInfo) -> int:
        raise NotImplementedError

    def draft_depth(self, k: int) -> int:
        """The drafts this step makes for the next one, its choice being k: k itself, unless a policy knows the next
        step wants more (`AdaptiveDepth` with a drafter whose cost is flat in depth)."""
        return k

    def observe(self, info: StepInfo, outcome: StepOutcome) -> None:
        self.record(info, outcome)

    def describe(self) -> dict[str, float]:
        """Inputs behind the last choice and the cumulative tally, exported as metrics."""
        return self.tally.as_dict()

    @property
    def tally(self) -> DepthTally:
        # Created on first use, so subclasses need not call a base __init__.
        t = self.__dict__.get("_tally")
        if t is None:
            t = self.__dict__["_tally"] = DepthTally()
        return t

    def record(self, info: StepInfo, outcome: StepOutcome, predicted_tokens: float | None = None,
               predicted_step_s: float | None = None, explored: bool = False) -> tuple[int, int]:
        """`DepthTally.record`: returns the tokens the step's verifying requests emitted and the drafts verified."""
        return self.tally.record(info, outcome, predicted_tokens, predicted_step_s, explored)


class FixedDepth(DepthPolicy):
    def __init__(self, k: int):
        self.k = k

    def choose(self, info: StepInfo) -> int:
        return min(self.k, info.max_k)

    def describe(self) -> dict[str, float]:
        return {**self.tally.as_dict(), "k": float(self.k)}
