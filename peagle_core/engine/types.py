"""Public request and result types, shaped like vLLM's."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# The engine packs top_k as int64 and seeds torch generators, which take any 64-bit seed (signed or not).
INT64_MAX = 2**63 - 1
SEED_RANGE = (-2**63, 2**64 - 1)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # per emitted token: its log-probability and this many most likely (vLLM's)
    # vLLM's logits processors, exact under speculation (engine/logits_processors.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1  # independent samples of the prompt (LLM.generate; the server fans them out)
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    bad_words: list[str] | None = None  # vLLM's: a word's last token is banned where its other tokens precede it

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Clear ValueErrors before any work (the HTTP layer turns them into 400s)."""
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1 or self.top_k > INT64_MAX:
            raise ValueError(f"top_k must be -1 (disabled) or in [1, 2**63), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logit_bias and not all(type(t) is int and t >= 0 and -100 <= b <= 100
                                       for t, b in self.logit_bias.items()):
            raise ValueError("logit_bias maps token ids (>= 0) to biases in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")
        if type(self.n) is not int or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n}")
        if self.allowed_token_ids is not None and not (
                self.allowed_token_ids and all(type(t) is int and t >= 0 for t in self.allowed_token_ids)):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids (>= 0)")
        if self.bad_words is not None and not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be a list of non-empty strings")

    def sample(self, i: int) -> "SamplingParams":
        """The i-th of `n` independent samples, as one request (`sample_seed`)."""
        return SamplingParams(**{**self.__dict__, "n": 1, "seed": sample_seed(self.seed, i)})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample_seed(seed: int | None, i: int) -> int | None:
    """Sample i of a seeded request with n samples is seeded `seed + i` (vLLM's), so it is the single request
    with that seed; unseeded samples draw from the engine's generator."""
    if seed is None:
        return None
    seed += i
    return seed - 2**64 if seed > SEED_RANGE[1] else seed  # wraps around the 64-bit seeds


@dataclass
class SpecDecodeStats:
    """vLLM's speculative counters; acceptance length = 1 + accepted / drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft:
            self.num_accepted_tokens_per_pos += [0] * (num_draft - len(self.num_accepted_tokens_per_pos))
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    def merge(self, other: "SpecDecodeStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        n = max(len(self.num_accepted_tokens_per_pos), len(other.num_accepted_tokens_per_pos))
        a = self.num_accepted_tokens_per_pos + [0] * (n - len(self.num_accepted_tokens_per_pos))
        b = other.num_accepted_tokens_per_pos + [0] * (n - len(other.num_accepted_tokens_per_pos))
        self.num_accepted_tokens_per_pos = [x + y for x, y in zip(a, b)]

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    logprobs: list[dict] | None = None  # with SamplingParams.logprobs: {token_id: Logprob} per token (vLLM's)
    reasoning: str | None = None  # LLM.chat: the harmony reply's analysis channel (`text` is its content)
    tool_calls: list[dict] | None = None  # LLM.chat: the calls the reply made, {"name", "arguments"}


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    spec_decode_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's name)
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first_token, finished times (monotonic s)
