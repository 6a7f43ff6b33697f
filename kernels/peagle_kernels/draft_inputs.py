"""Drafter input preparation for EAGLE-style drafting (P-EAGLE: one pass, K slots per request).

From the target's verified batch, build the drafter's padded batch: per request, the accepted tokens
shifted left by one (slot j holds token j+1 and later receives the target hidden state of token j),
then the next token (bonus/sampled), then P-1 MASK slots, then one padding slot per rejected draft,
so every request keeps `q_len - 1 + P` slots and nothing needs a host sync. Positions are consecutive
from the request's first target position; rejected slots get position 0 and are flagged.
(Semantics as in vLLM's unified parallel-drafting kernel; see reference/peagle.md §2.1, §3.1.)
"""
from __future__ import annotations

import torch

from peagle_kernels.dispatch import use_triton


def prepare_draft_inputs(target_token_ids: torch.Tensor, target_positions: torch.Tensor, next_token_ids: torch.Tensor,
                         query_start_loc: torch.Tensor, num_rejected: torch.Tensor, mask_token_id: int,
                         num_slots: int, padding_token_id: int = 0
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (input_ids, positions, is_rejected, is_masked, sample_indices [B*P], hidden_map [T]).

    `hidden_map[t]` is the draft slot that receives target token t's hidden state;
    `sample_indices[b*P + i]` is the slot whose logits give request b's draft i (bonus slot, then MASKs).
    """
    if use_triton(target_token_ids):
        from peagle_kernels.triton_draft_inputs import prepare_draft_inputs_triton
        return prepare_draft_inputs_triton(target_token_ids, target_positions, next_token_ids, query_start_loc,
                                           num_rejected, mask_token_id, num_slots, padding_token_id)
    return prepare_draft_inputs_ref(target_token_ids, target_positions, next_token_ids, query_start_loc,
                                    num_rejected, mask_token_id, num_slots, padding_token_id)


def prepare_draft_inputs_ref(target_token_ids, target_positions, next_token_ids, query_start_loc, num_rejected,
                             mask_token_id, num_slots, padding_token_id=0):
    """Vectorised PyTorch version: every output slot computes its fields from its request's counts."""
    device = target_token_ids.device
    B, T, P = next_token_ids.shape[0], target_token_ids.shape[0], num_slots
    qs, qe = query_start_loc[:-1], query_start_loc[1:]
    q_len = qe - qs
    out_len = q_len - 1 + P                                  # slots per request
    out_start = qs + torch.arange(B, device=device) * (P - 1)
    n_out = T + B * (P - 1)
    req = torch.repeat_interleave(torch.arange(B, device=device), out_len, output_size=n_out)
    j = torch.arange(n_out, device=device) - out_start[req]  # local slot index
    num_valid = (q_len - 1 - num_rejected)[req]
    is_valid, is_bonus = j < num_valid, j == num_valid
    is_masked = (j > num_valid) & (j < num_valid + P)
    is_rejected = j >= num_valid + P
    src = (qs[req] + 1 + j).clamp(max=max(T - 1, 0))
    ids = torch.where(is_valid, target_token_ids[src], torch.full_like(j, padding_token_id))
    ids = torch.where(is_bonus, next_token_ids[req], ids)
    ids = torch.where(is_masked, torch.full_like(j, mask_token_id), ids)
    positions = torch.where(is_rejected, torch.zeros_like(j), target_positions[qs[req]] + j)
    slot = torch.arange(n_out, device=device)
    sample_slot = (j - num_valid).clamp(0, P - 1)
    sample_indices = torch.empty(B * P, dtype=torch.long, device=device)
    draft_slot = is_bonus | is_masked
    sample_indices[(req * P + sample_slot)[draft_slot]] = slot[draft_slot]
    tok_req = torch.repeat_interleave(torch.arange(B, device=device), q_len, output_size=T)
    hidden_map = torch.arange(T, device=device) + tok_req * (P - 1)
    return ids, positions, is_rejected, is_masked, sample_indices, hidden_map


def fill_hidden(target_hidden: torch.Tensor, hidden_map: torch.Tensor, is_masked: torch.Tensor,
                shared_hidden: torch.Tensor) -> torch.Tensor:
    """Draft hidden states: target hidden scattered to its slot, the shared hidden state on MASK slots."""
    if use_triton(target_hidden):
        from peagle_kernels.triton_draft_inputs import fill_hidden_triton
        return fill_hidden_triton(target_hidden, hidden_map, is_masked, shared_hidden)
    return fill_hidden_ref(target_hidden, hidden_map, is_masked, shared_hidden)


def fill_hidden_ref(target_hidden, hidden_map, is_masked, shared_hidden):
    out = torch.zeros(is_masked.shape[0], target_hidden.shape[1], dtype=target_hidden.dtype, device=target_hidden.device)
    out[hidden_map] = target_hidden
    return torch.where(is_masked[:, None], shared_hidden.to(out.dtype)[None, :], out)
