"""One request's state. Speculative decoding is mostly bookkeeping over these lengths."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from peagle_core.engine.types import SamplingParams, SpecDecodeStats


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)   # prompt + accepted output
    num_computed: int = 0          # positions whose target (and drafter, but for `behind`) K/V are valid
    drafts: list[int] = field(default_factory=list)      # proposals for the next positions, verified next step
    # (first position, [rows]): positions since which steps drafted nothing, and the drafter's input rows for them,
    # written into its cache by the next step that drafts (`ModelRunner._catch_up`)
    behind: tuple[int, list[torch.Tensor]] | None = None
    block_table: list[int] = field(default_factory=list)
    block_digests: list[bytes] = field(default_factory=list)  # prefix-cache identity of its first blocks (`BlockManager`)
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at its first scheduling
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    generator: torch.Generator | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    logprobs: list[dict] | None = None  # with params.logprobs: one {token_id: Logprob} per output token
    num_steps: int = 0  # steps that emitted tokens for it: the first from its prompt, each later one a decode step
    bad_words_ids: list[list[int]] = field(default_factory=list)  # params.bad_words as token ids
    output: Any = None  # its `OutputState` (engine/output.py): the text it has streamed

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def num_output(self) -> int:
        """len(output_ids) without copying them: the engine asks every step, and outputs run to thousands."""
        return len(self.token_ids) - self.num_prompt

    @property
    def num_uncomputed(self) -> int:
        """Tokens known but not yet in the cache: the prompt (or a chunk of it), or the last sampled token."""
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
