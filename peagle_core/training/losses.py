"""Per-element losses against the target's distribution, and per-depth bookkeeping."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

LossKind = Literal["kl", "ce"]


def element_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, kind: LossKind) -> torch.Tensor:
    """[E] losses: KL(target || draft) over the vocabulary, or CE against the target's argmax."""
    logp_d = F.log_softmax(draft_logits.float(), dim=-1)
    if kind == "kl":
        logp_t = F.log_softmax(target_logits.float(), dim=-1)
        return F.kl_div(logp_d, logp_t, log_target=True, reduction="none").sum(-1)
    if kind == "ce":
        return -logp_d.gather(-1, target_logits.argmax(-1, keepdim=True)).squeeze(-1)
    raise ValueError(f"unknown loss {kind!r} (expected 'kl' or 'ce')")


@dataclass
class DepthStats:
    """Sums per depth: charged loss (before the count normalisation), elements, argmax matches."""

    num_depths: int
    loss: list[float] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    correct: list[int] = field(default_factory=list)
    max_attn_tokens: int = 0  # largest query (= key) length of one drafter forward

    def __post_init__(self) -> None:
        self.loss = self.loss or [0.0] * self.num_depths
        self.count = self.count or [0] * self.num_depths
        self.correct = self.correct or [0] * self.num_depths

    def add(self, depth: torch.Tensor, losses: torch.Tensor, correct: torch.Tensor) -> None:
        k = self.num_depths
        self.loss = [a + b for a, b in zip(self.loss, torch.bincount(depth, losses.detach().double(), k).tolist())]
        self.count = [a + int(b) for a, b in zip(self.count, torch.bincount(depth, minlength=k).tolist())]
        self.correct = [a + int(b) for a, b in zip(self.correct, torch.bincount(depth, correct.double(), k).tolist())]

    def merge(self, other: "DepthStats") -> None:
        self.loss = [a + b for a, b in zip(self.loss, other.loss)]
        self.count = [a + b for a, b in zip(self.count, other.count)]
        self.correct = [a + b for a, b in zip(self.correct, other.correct)]
        self.max_attn_tokens = max(self.max_attn_tokens, other.max_attn_tokens)

    def accuracy(self) -> list[float | None]:
        return [c / n if n else None for c, n in zip(self.correct, self.count)]

    def mean_loss(self) -> float:
        total = sum(self.count)
        return sum(self.loss) / total if total else 0.0


def charge(stats: DepthStats, depth: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
           kind: LossKind, denom: int) -> torch.Tensor:
    """Loss of a set of elements divided by the batch's total count, recorded per depth."""
    losses = element_loss(draft_logits, target_logits, kind)
    correct = draft_logits.argmax(-1) == target_logits.argmax(-1)
    stats.add(depth, losses, correct)
    return losses.sum() / denom
