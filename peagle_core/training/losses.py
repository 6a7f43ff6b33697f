"""Per-element losses against the target's distribution, and per-depth bookkeeping."""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

LossKind = Literal["kl", "ce"]


def element_loss(draft_logits: torch.Tensor, target_logp: torch.Tensor, target_argmax: torch.Tensor,
                 kind: LossKind) -> torch.Tensor:
    """[E] losses: KL(target || draft) over the vocabulary, or CE against the target's argmax.

    The target side comes as log-probabilities (and their argmax), computed once per position and
    shared by every element charged against that position."""
    logp_d = F.log_softmax(draft_logits.float(), dim=-1)
    if kind == "kl":
        return F.kl_div(logp_d, target_logp, log_target=True, reduction="none").sum(-1)
    if kind == "ce":
        return -logp_d.gather(-1, target_argmax[:, None]).squeeze(-1)
    raise ValueError(f"unknown loss {kind!r} (expected 'kl' or 'ce')")


class DepthStats:
    """Sums per depth of the charged loss (before the count normalisation) and argmax matches, and the
    element counts.

    The sums stay on the device and are read once per step (`summary`, or with the step's other
    values in one read): reading them per pass would wait for the GPU every time. The counts come
    from the host's plan, so the device never has to count."""

    def __init__(self, num_depths: int, device: torch.device | str = "cpu"):
        self.sums = torch.zeros(2, num_depths, dtype=torch.float64, device=device)  # loss, correct
        self.counts = [0] * num_depths
        self.max_attn_tokens = 0  # largest query (= key) length of one drafter forward

    def add(self, depth: torch.Tensor, counts: list[int], losses: torch.Tensor, correct: torch.Tensor) -> None:
        """`counts`: how many of the elements sit at each depth (the host knows it from the plan)."""
        self.sums.index_add_(1, depth, torch.stack([losses.detach(), correct.to(losses.dtype)]).double())
        for d, c in enumerate(counts):
            self.counts[d] += c

    def summary(self, sums: list[list[float]] | None = None) -> tuple[list[float], list[int], list[float | None]]:
        """(loss sums, element counts, accuracies) per depth; `sums`: `self.sums` already read back."""
        loss, correct = self.sums.tolist() if sums is None else sums
        return loss, list(self.counts), [c / n if n else None for c, n in zip(correct, self.counts)]


def charge(stats: DepthStats, depth: torch.Tensor, counts: list[int], draft_logits: torch.Tensor,
           target_logp: torch.Tensor, target_argmax: torch.Tensor, kind: LossKind, denom: int) -> torch.Tensor:
    """Loss of a set of elements divided by the batch's total count, recorded per depth (`counts` per depth)."""
    losses = element_loss(draft_logits, target_logp, target_argmax, kind)
    stats.add(depth, counts, losses, draft_logits.argmax(-1) == target_argmax)
    return losses.sum() / denom
