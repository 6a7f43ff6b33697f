"""Triton drafter-input preparation and hidden-state fill.

Same signatures and semantics as `peagle_kernels.draft_inputs.prepare_draft_inputs_ref` / `fill_hidden_ref`
(see there and reference/peagle.md §2.1, §3.1-3.2 for the slot layout).

Both are one launch with no host sync: every output size comes from tensor shapes and Python
arguments (`n_out = T + B * (P - 1)`), so they can be captured in a CUDA graph.

- prepare: grid (num_reqs, token blocks). A program reads its request's counts and writes its
  slots' fields. The number of token blocks is sized for the longest request the shapes allow
  (every request owning at least one token: `T - B + P` slots); programs loop with a stride of the
  grid, so a longer request (only possible with empty requests) is still fully written.
- fill: grid (output-row blocks, hidden blocks), a pure gather: each output row finds the target
  token mapped to it by binary search in `hidden_map` (strictly increasing, as `prepare` makes it),
  then writes the shared hidden state (MASK slot), the target row (mapped slot) or zeros (neither).
  Every row is written exactly once, so no memset launch and no write races.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from peagle_kernels.dispatch import pdl_launch


# The engine launches both kernels eagerly in every step with prompt chunks, whose token counts vary step by step:
# Triton would compile a variant for each new pattern of these integers (== 1, divisible by 16) and each BLOCK,
# a 0.1-0.4 s stall in a live step on an H200. Neither kernel gains from those hints.
@triton.jit(do_not_specialize=["T", "P", "num_blocks"])
def _prepare_kernel(tok_ptr, pos_ptr, next_ptr, qsl_ptr, nrej_ptr,
                    ids_out, pos_out, rej_out, mask_out, sample_out, map_out,
                    mask_token_id, padding_token_id, T, P, num_blocks,
                    BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0)
    blk = tl.program_id(1)
    qs = tl.load(qsl_ptr + r).to(tl.int64)
    q_len = tl.load(qsl_ptr + r + 1).to(tl.int64) - qs
    num_valid = q_len - 1 - tl.load(nrej_ptr + r).to(tl.int64)   # accepted drafts = shifted target tokens
    out_len = q_len - 1 + P
    out_start = qs + r.to(tl.int64) * (P - 1)
    start_pos = tl.load(pos_ptr + tl.minimum(qs, T - 1), mask=T > 0, other=0).to(tl.int64)  # T - 1: empty requests
    next_tok = tl.load(next_ptr + r).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    for s in range(blk * BLOCK, out_len, num_blocks * BLOCK):
        j = s + lanes                                   # local slot index
        inside = j < out_len
        is_valid = j < num_valid
        is_bonus = j == num_valid
        is_masked = (j > num_valid) & (j < num_valid + P)
        is_rejected = j >= num_valid + P
        tok = tl.load(tok_ptr + qs + 1 + j, mask=inside & is_valid, other=0).to(tl.int64)
        ids = tl.where(is_valid, tok, padding_token_id)
        ids = tl.where(is_bonus, next_tok, ids)
        ids = tl.where(is_masked, mask_token_id, ids)
        pos = tl.where(is_rejected, 0, start_pos + j)
        o = out_start + j
        tl.store(ids_out + o, ids.to(tl.int64), mask=inside)
        tl.store(pos_out + o, pos.to(tl.int64), mask=inside)
        tl.store(rej_out + o, is_rejected.to(tl.uint8), mask=inside)
        tl.store(mask_out + o, is_masked.to(tl.uint8), mask=inside)
        # The bonus slot and the P-1 MASK slots give request r's P drafts, in slot order.
        tl.store(sample_out + r.to(tl.int64) * P + (j - num_valid), o, mask=inside & (is_bonus | is_masked))
        # Target token j (rejected ones included) hands its hidden state to slot j: not shifted.
        tl.store(map_out + qs + j, o, mask=j < q_len)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


PREPARE_BLOCK = 128  # slots a program handles per pass: one size for every step (a decode step has <= 2K slots)


def prepare_draft_inputs_triton(target_token_ids: torch.Tensor, target_positions: torch.Tensor,
                                next_token_ids: torch.Tensor, query_start_loc: torch.Tensor,
                                num_rejected: torch.Tensor, mask_token_id: int, num_slots: int,
                                padding_token_id: int = 0
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor]:
    """Returns (input_ids, positions, is_rejected, is_masked, sample_indices [B*P], hidden_map [T])."""
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    device = target_token_ids.device
    B, T, P = next_token_ids.shape[0], target_token_ids.shape[0], int(num_slots)
    if query_start_loc.shape[0] != B + 1 or num_rejected.shape[0] != B:
        raise ValueError(f"query_start_loc must have {B + 1} entries and num_rejected {B} "
                         f"(got {query_start_loc.shape[0]} and {num_rejected.shape[0]})")
    n_out = T + B * (P - 1)
    # 1-D inputs are read with unit stride (no-ops for the usual contiguous buffers).
    target_token_ids, target_positions, next_token_ids, query_start_loc, num_rejected = (
        x.contiguous() for x in (target_token_ids, target_positions, next_token_ids, query_start_loc, num_rejected))
    ids = torch.empty(n_out, dtype=torch.long, device=device)
    positions = torch.empty(n_out, dtype=torch.long, device=device)
    is_rejected = torch.empty(n_out, dtype=torch.uint8, device=device)
    is_masked = torch.empty(n_out, dtype=torch.uint8, device=device)
    sample_indices = torch.empty(B * P, dtype=torch.long, device=device)
    hidden_map = torch.empty(T, dtype=torch.long, device=device)
    if B > 0:
        longest = max(T - B + P, 1)                     # slots of the longest request if each has >= 1 token
        num_blocks = triton.cdiv(longest, PREPARE_BLOCK)
        _prepare_kernel[(B, num_blocks)](
            target_token_ids, target_positions, next_token_ids, query_start_loc, num_rejected,
            ids, positions, is_rejected, is_masked, sample_indices, hidden_map,
            int(mask_token_id), int(padding_token_id), T, P, num_blocks, BLOCK=PREPARE_BLOCK,
            **pdl_launch(target_token_ids))
    return ids, positions, is_rejected.view(torch.bool), is_masked.view(torch.bool), sample_indices, hidden_map


@triton.jit(do_not_specialize=["T", "n_out", "search_steps"])
def _fill_hidden_kernel(src_ptr, map_ptr, masked_ptr, shared_ptr, out_ptr,
                        T, n_out, H, stride_src, stride_out, search_steps,
                        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr = False):
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < n_out
    col_ok = cols < H
    rows64 = rows.to(tl.int64)
    # Upper bound: lo = number of target tokens t with hidden_map[t] <= row.
    lo = tl.zeros([BLOCK_R], dtype=tl.int64)
    hi = tl.zeros([BLOCK_R], dtype=tl.int64) + T
    for _ in range(search_steps):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(map_ptr + mid, mask=active, other=0)
        right = active & (v <= rows64)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & (v > rows64), mid, hi)
    t = tl.maximum(lo - 1, 0)
    covered = (lo > 0) & (tl.load(map_ptr + t, mask=(lo > 0) & row_ok, other=-1) == rows64)
    masked = tl.load(masked_ptr + rows, mask=row_ok, other=0) != 0
    x = tl.load(src_ptr + t[:, None] * stride_src + cols[None, :],
                mask=(covered & row_ok)[:, None] & col_ok[None, :], other=0.0)
    shared = tl.load(shared_ptr + cols, mask=col_ok, other=0.0)
    out = tl.where(masked[:, None], shared[None, :], x.to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + rows64[:, None] * stride_out + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


def fill_hidden_triton(target_hidden: torch.Tensor, hidden_map: torch.Tensor, is_masked: torch.Tensor,
                       shared_hidden: torch.Tensor) -> torch.Tensor:
    """Draft hidden states [n_out, H]: target rows at `hidden_map`, `shared_hidden` on MASK slots, zeros elsewhere.

    `hidden_map` must be strictly increasing (as `prepare_draft_inputs` builds it).
    """
    if target_hidden.dim() != 2 or shared_hidden.shape != (target_hidden.shape[1],):
        raise ValueError(f"target_hidden must be [T, H] and shared_hidden [H]; got {tuple(target_hidden.shape)} "
                         f"and {tuple(shared_hidden.shape)}")
    if hidden_map.shape[0] != target_hidden.shape[0]:
        raise ValueError(f"hidden_map has {hidden_map.shape[0]} entries for {target_hidden.shape[0]} target rows")
    T, H = target_hidden.shape
    n_out = is_masked.shape[0]
    if target_hidden.stride(1) != 1:
        target_hidden = target_hidden.contiguous()
    out = torch.empty(n_out, H, dtype=target_hidden.dtype, device=target_hidden.device)
    if n_out == 0 or H == 0:
        return out
    block_r = 16
    block_h = min(triton.next_power_of_2(H), 256)
    grid = (triton.cdiv(n_out, block_r), triton.cdiv(H, block_h))
    # Cast in torch (a no-op when the engine caches it in the model dtype): round-to-nearest on every backend.
    shared = shared_hidden.to(out.dtype).contiguous()
    masked = is_masked.contiguous().view(torch.uint8)
    _fill_hidden_kernel[grid](target_hidden, hidden_map.contiguous(), masked, shared, out,
                              T, n_out, H, target_hidden.stride(0), out.stride(0), max(T, 1).bit_length(),
                              BLOCK_R=block_r, BLOCK_H=block_h, **pdl_launch(out))
    return out
