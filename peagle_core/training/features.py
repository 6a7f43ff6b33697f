"""What the frozen target gives the drafter objective: auxiliary hidden states and its own distribution.

The target runs online (no feature files on disk), once per batch as one flat varlen batch, without
gradients. The features stay flat (row = sequence start + position); passes index them by row. We keep
the final normed hidden state rather than the logits and apply the target's LM head only at the rows
a pass charges a loss on, once per row: a [n, vocab] fp32 tensor per sequence would be the largest
thing in memory at GPT-OSS's 201k vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from peagle_core.models.gpt_oss import GptOss
from peagle_core.models.layers import ForwardMeta
from peagle_core.training.data import Example


@dataclass
class Features:
    input_ids: torch.Tensor   # [N] long: the batch's sequences back to back
    aux: torch.Tensor         # [N, n_aux * H_t]: residual streams entering the aux layers at each row
    hidden: torch.Tensor      # [N, H_t]: final normed hidden (logits at row j = distribution of token j + 1)
    lm_head: Callable[[torch.Tensor], torch.Tensor]

    @torch.no_grad()
    def target_dist(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities [U, V] fp32, argmax [U]) of the target's next-token distribution at `rows`."""
        logits = self.lm_head(self.hidden[rows]).float()
        return torch.log_softmax(logits, dim=-1), logits.argmax(-1)


def slot_valid(loss_mask: list[bool]) -> torch.Tensor:
    """Per drafter slot r = 0..n-2 (input token r+1, aux of r): may a loss be charged on it? (CPU bool)

    Slot r learns the target's distribution at r+1, i.e. predicts token r+2; it is supervised when
    that token is. The last slot's token lies past the sequence, so it follows the last token.
    """
    return torch.tensor(loss_mask[2:] + loss_mask[-1:], dtype=torch.bool)


@torch.no_grad()
def extract_features(target: GptOss, examples: list[Example], aux_layer_ids: list[int],
                     device: torch.device | str) -> Features:
    """One batched target forward over `examples`."""
    if target.aux_layer_ids != list(aux_layer_ids):
        target.set_aux_layers(list(aux_layer_ids))
    vocab = target.config.vocab_size
    flat = torch.tensor([t for e in examples for t in e.input_ids], dtype=torch.long)
    if flat.numel() and int(flat.max()) >= vocab:  # checked on the host: no device sync
        raise ValueError(f"token id {int(flat.max())} is outside the target vocabulary ({vocab})")
    flat = flat.to(device, non_blocking=True)
    hidden, aux = target(flat, ForwardMeta.for_sequences([len(e.input_ids) for e in examples], device))
    return Features(flat, aux, hidden, target.compute_logits)
