"""What the frozen target gives the drafter objective: auxiliary hidden states and its own distribution.

The target runs online (no feature files on disk), once per batch as one flat varlen batch, without
gradients. We keep the final normed hidden state rather than the logits and apply the target's LM head
only at the positions a loss is charged on: a [n, vocab] fp32 tensor per sequence would be the
largest thing in memory at GPT-OSS's 201k vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from peagle_core.models.gpt_oss import GptOss
from peagle_core.models.layers import ForwardMeta
from peagle_core.training.data import Example


@dataclass
class SequenceFeatures:
    input_ids: torch.Tensor   # [n] long
    loss_mask: torch.Tensor   # [n] bool: token j is supervised
    aux: torch.Tensor         # [n, n_aux * H_t]: residual streams entering the aux layers at each position
    hidden: torch.Tensor      # [n, H_t]: final normed hidden (logits at j = distribution of token j + 1)
    lm_head: Callable[[torch.Tensor], torch.Tensor]

    @property
    def n(self) -> int:
        return self.input_ids.shape[0]

    @torch.no_grad()
    def target_logits(self, positions: torch.Tensor) -> torch.Tensor:
        """The target's next-token logits at `positions` (fp32)."""
        return self.lm_head(self.hidden[positions]).float()

    def slot_valid(self) -> torch.Tensor:
        """Per drafter slot r = 0..n-2 (input token r+1, aux of r): may a loss be charged on it?

        Slot r learns the target's distribution at r+1, i.e. predicts token r+2; it is supervised when
        that token is. The last slot's token lies past the sequence, so it follows the last token.
        """
        lm = self.loss_mask
        nxt = torch.cat([lm[2:], lm[-1:]])
        return nxt[: self.n - 1]


@torch.no_grad()
def extract_features(target: GptOss, examples: list[Example], aux_layer_ids: list[int],
                     device: torch.device | str) -> list[SequenceFeatures]:
    """One batched target forward over `examples`; split back per sequence."""
    if target.aux_layer_ids != list(aux_layer_ids):
        target.set_aux_layers(list(aux_layer_ids))
    vocab = target.config.vocab_size
    lengths = [len(e.input_ids) for e in examples]
    flat = torch.tensor([t for e in examples for t in e.input_ids], dtype=torch.long, device=device)
    if flat.numel() and (int(flat.max()) >= vocab):
        raise ValueError(f"token id {int(flat.max())} is outside the target vocabulary ({vocab})")
    hidden, aux = target(flat, ForwardMeta.for_sequences(lengths, device))
    out = []
    start = 0
    for e, n in zip(examples, lengths):
        sl = slice(start, start + n)
        out.append(SequenceFeatures(flat[sl], torch.tensor(e.loss_mask, dtype=torch.bool, device=device),
                                    aux[sl], hidden[sl], target.compute_logits))
        start += n
    return out
