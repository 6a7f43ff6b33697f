"""The drafter's step: from a verified target step to the next step's drafts.

P-EAGLE runs ONE drafter forward over `[accepted drafts, bonus, MASK x (n-1)]` a request and reads n drafts;
EAGLE-3 runs one forward over `[accepted drafts, bonus]`, then n-1 single-token passes feeding itself back.
`Proposer` holds nothing but the drafter and the numbers it needs, so the CUDA graph of a whole drafter step
(`graphs.DraftSteps`) can call it without reaching back into the runner that owns the KV cache.
"""
from __future__ import annotations

from typing import Callable

import torch

from peagle_kernels.draft_inputs import fill_hidden, prepare_draft_inputs
from peagle_core.models.drafter import Drafter
from peagle_core.models.layers import ForwardMeta

# (drafter, input ids, hidden, meta, uniform) -> (normed, prenorm): one drafter forward, eager or replayed
DrafterForward = Callable[[Drafter, torch.Tensor, torch.Tensor, ForwardMeta, bool], tuple[torch.Tensor, torch.Tensor]]


def plain_forward(model: Drafter, ids: torch.Tensor, hidden: torch.Tensor, meta: ForwardMeta, uniform: bool):
    return model(ids, hidden, meta)


def cache_slots(positions: torch.Tensor, req_index: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                max_model_len: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Flat cache slot of each token; -1 (no write) when invalid or past max_model_len."""
    ok = positions < max_model_len
    if valid is not None:
        ok &= valid
    p = positions.clamp(0, max_model_len - 1)
    block = block_tables[req_index, p // block_size]
    return torch.where(ok, block * block_size + p % block_size, torch.full_like(p, -1))


class Proposer:
    """Drafts for the next step, from the target's step inputs, its aux hidden states and the verification."""

    def __init__(self, drafter: Drafter, mode: str, block_size: int, max_model_len: int, device: torch.device):
        self.drafter, self.mode, self.block_size, self.max_model_len, self.device = \
            drafter, mode, block_size, max_model_len, device
        self.shared_hidden, self.mask_token_id = None, 0
        if mode == "peagle":
            with torch.no_grad():
                self.shared_hidden = drafter.shared_hidden()  # fc(mask_hidden), projected once
            self.mask_token_id = drafter.config.mask_token_id

    def propose(self, input_ids, aux, meta: ForwardMeta, next_ids, num_rejected, n: int, uniform: bool,
                forward: DrafterForward = plain_forward) -> torch.Tensor:
        """`n` drafts per request [B, n] after the target step `meta` over `input_ids`, given each request's next
        token and its rejected-draft count. `forward` runs one drafter forward (`uniform`: a decode step's shape).

        The whole step is also captured as one graph behind the target's decode graphs (`graphs.DraftSteps`),
        where dummy requests (seq_len 0) pad the batch: they must write no K/V (their block-table rows are
        stale) and read none."""
        dev, B, drafter = self.device, meta.seq_lens.shape[0], self.drafter
        live = meta.seq_lens > 0
        num_rejected = num_rejected * live  # a dummy's stale count could exceed its tokens
        P = n if self.mode == "peagle" else 1  # P-EAGLE drafts all n in one pass; EAGLE-3's first pass has the bonus
        qsl = meta.query_start_loc
        d_ids, d_pos, is_rejected, is_masked, sample_idx, hidden_map = prepare_draft_inputs(
            input_ids, meta.positions, next_ids, qsl, num_rejected, self.mask_token_id, P)
        target_h = drafter.combine(aux)
        shared = self.shared_hidden if self.shared_hidden is not None else torch.zeros_like(target_h[0])
        hidden = fill_hidden(target_h, hidden_map, is_masked, shared)
        d_qsl = qsl + torch.arange(B + 1, device=dev) * (P - 1)
        d_seq = (meta.seq_lens + P - 1 - num_rejected).clamp(max=self.max_model_len) * live
        req = torch.repeat_interleave(torch.arange(B, device=dev), d_qsl[1:] - d_qsl[:-1], output_size=d_ids.shape[0])
        slots = self._slots(d_pos, req, meta.block_tables, valid=~is_rejected & live[req])
        d_meta = ForwardMeta(positions=d_pos, query_start_loc=d_qsl, seq_lens=d_seq, slot_mapping=slots,
                             block_tables=meta.block_tables)
        normed, prenorm = forward(drafter, d_ids, hidden, d_meta, uniform)
        first = drafter.to_target_ids(drafter.compute_logits(normed[sample_idx]).argmax(-1)).view(B, P)
        if self.mode == "peagle":
            return first
        # EAGLE-3: n-1 more passes, one token per request, feeding back the drafter's own pre-norm state.
        out, h, last_pos = [first[:, 0]], prenorm[sample_idx], d_pos[sample_idx]
        ar = torch.arange(B + 1, device=dev)
        for i in range(1, n):
            p = last_pos + i
            meta_i = ForwardMeta(positions=p, query_start_loc=ar, seq_lens=(p + 1).clamp(max=self.max_model_len) * live,
                                 slot_mapping=self._slots(p, ar[:-1], meta.block_tables, valid=live),
                                 block_tables=meta.block_tables)
            normed, h = forward(drafter, out[-1], h, meta_i, True)  # one token per request: uniform
            out.append(drafter.to_target_ids(drafter.compute_logits(normed).argmax(-1)))
        return torch.stack(out, dim=1)

    def _slots(self, positions, req_index, block_tables, valid=None) -> torch.Tensor:
        return cache_slots(positions, req_index, block_tables, self.block_size, self.max_model_len, valid)
