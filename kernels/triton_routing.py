"""Triton MoE routing: top-k + softmax over the router logits (+ the sort of the pairs by expert), one launch.

Same signature and semantics as `kernels.moe.route_ref`: logits = x @ router_w^T + router_b, computed by
the same `F.linear` as the reference (so both pick from identical logits), then the top k by value in
descending order (ties: the lowest expert index first) and gates = softmax over those k logits in fp32,
stored in x.dtype. PyTorch spends four launches after the GEMV on this (topk's sort and gather, softmax,
the pair sort); at decode sizes each costs more than its arithmetic.

Why the GEMV stays in cuBLAS: a first version computed the logits inside this kernel, one program per 64
tokens so that the router weight streams once. On an H200 that program read the 184 KB weight of
GPT-OSS-20B at ~13 GB/s (14.7 us a layer in an H200 profile not kept, as slow as the PyTorch launches it
replaced); one SM
cannot keep enough loads in flight. cuBLAS spreads the GEMV over the whole GPU.

A program owns BLOCK_T tokens and all experts: k rounds of row max + lowest-index argmax + mask pick
the experts, and a softmax over the k picked values gives the gates. Up to 64 tokens (decode and verify)
one program holds the whole batch and can also do the MoE's counting sort of the T*k (token, expert)
pairs by expert (`counting_sort`, shared with `kernels.triton_moe`): `route_and_sort_pairs`.
No host sync anywhere: CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Largest counting-sort one-hot matrix (EXPERTS_PAD x PAIRS_PAD int32) kept in one program's registers.
SORT_MAX_ELEMS = 32768


@triton.jit
def counting_sort(expert, pair, order_ptr, offsets_ptr, num_pairs, num_experts, EXPERTS_PAD: tl.constexpr):
    """A stable counting sort of pairs by expert, in one program.

    expert [P]: each entry's expert, EXPERTS_PAD (> num_experts) for padding entries, which sort nowhere;
    pair [P]: its pair id, entries in increasing pair order. Writes `order[offsets[e] + i]` = the i-th pair
    of expert e and `offsets [num_experts + 1]`. onehot[e, p] = (expert of entry p == e): its row sums are
    the counts, their exclusive cumsum the offsets, its running sum along p each entry's rank in its expert.
    """
    e = tl.arange(0, EXPERTS_PAD)
    onehot = (expert[None, :] == e[:, None]).to(tl.int32)  # [EXPERTS_PAD, P]
    counts = tl.sum(onehot, 1)
    starts = tl.cumsum(counts, 0) - counts
    rank = tl.sum(onehot * (tl.cumsum(onehot, 1) - 1), 0)
    start = tl.sum(onehot * starts[:, None], 0)
    tl.store(order_ptr + start + rank, pair, mask=expert < num_experts)
    tl.store(offsets_ptr + e, tl.where(e < num_experts, starts, num_pairs), mask=e <= num_experts)


@triton.jit
def _route_kernel(logits_ptr, gates_ptr, experts_ptr, order_ptr, offsets_ptr, num_tokens, num_experts, stride_lt,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                  SORT: tl.constexpr, SORT_E_PAD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    cols = tl.arange(0, E_PAD)  # experts
    col_ok = cols < num_experts
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + cols[None, :],
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)

    # Top-k: k rounds of (max, lowest expert holding it, take it). `free` rather than overwriting taken
    # logits with -inf, so a row whose logits are all -inf still picks k distinct experts. Padding rows
    # pick too (zeros; never stored), which keeps them free of -inf - -inf = NaN.
    slots = tl.arange(0, K_PAD)
    free = tl.broadcast_to(col_ok[None, :], (BLOCK_T, E_PAD))
    top = tl.full([BLOCK_T, K_PAD], float("-inf"), tl.float32)
    picks = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(free, logits, float("-inf")), 1)
        pick = tl.min(tl.where(free & (logits == best[:, None]), cols[None, :], E_PAD), 1)
        pick = tl.minimum(pick, num_experts - 1)  # NaN logits match nothing: keep the id in range anyway
        free = free & (cols[None, :] != pick[:, None])
        top = tl.where(slots[None, :] == j, best[:, None], top)
        picks = tl.where(slots[None, :] == j, pick[:, None], picks)

    p = tl.exp(top - tl.max(top, 1)[:, None])  # padding slots: exp(-inf) = 0
    gates = p / tl.sum(p, 1)[:, None]
    pair = rows[:, None] * TOP_K + slots[None, :]  # [BLOCK_T, K_PAD]: pair t*k + j
    pair_ok = row_ok[:, None] & (slots < TOP_K)[None, :]
    tl.store(gates_ptr + pair, gates.to(gates_ptr.dtype.element_ty), mask=pair_ok)
    tl.store(experts_ptr + pair, picks.to(experts_ptr.dtype.element_ty), mask=pair_ok)

    if SORT:  # only launched with a single program holding every token
        expert = tl.where(pair_ok, picks, SORT_E_PAD)  # padding rows and slots sort nowhere
        counting_sort(tl.reshape(expert, [BLOCK_T * K_PAD]), tl.reshape(pair, [BLOCK_T * K_PAD]),
                      order_ptr, offsets_ptr, num_tokens * TOP_K, num_experts, SORT_E_PAD)


def route_triton(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, top_k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(gates [..., k] in x.dtype, experts [..., k] int64, by descending logit) for x [..., H]."""
    H = x.shape[-1]
    gates, experts, _ = _route(x.reshape(-1, H), router_w, router_b, top_k, sort=False)
    return gates.view(*x.shape[:-1], top_k), experts.view(*x.shape[:-1], top_k)


def route_and_sort_pairs(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, top_k: int
                         ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """`route_triton` for x [T, H], plus (order, offsets) of the pairs sorted by expert (as
    `kernels.triton_moe.sort_pairs_by_expert` returns them) when the same launch could sort them, else None."""
    return _route(x, router_w, router_b, top_k, sort=True)


def _route(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, top_k: int, sort: bool
           ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    T, H = x.shape
    E = router_w.shape[0]
    if tuple(router_w.shape) != (E, H) or tuple(router_b.shape) != (E,):
        raise ValueError(f"route: router_w must be [E, {H}] and router_b [E], got {list(router_w.shape)} "
                         f"and {list(router_b.shape)}")
    if not 1 <= top_k <= E:
        raise ValueError(f"route: top_k={top_k} must be in [1, {E}]")
    gates = torch.empty(T, top_k, device=x.device, dtype=x.dtype)
    experts = torch.empty(T, top_k, device=x.device, dtype=torch.int64)  # torch.topk's index dtype
    if T == 0:
        return gates, experts, None
    logits = torch.nn.functional.linear(x, router_w, router_b)  # [T, E] in x.dtype, as in route_ref

    e_pad, k_pad = max(16, triton.next_power_of_2(E)), triton.next_power_of_2(top_k)
    sort_e_pad = triton.next_power_of_2(E + 1)  # room for the padding sentinel
    block_t = max(16, triton.next_power_of_2(T)) if T <= 64 else 64  # up to 64 tokens: one program
    sorted_pairs = None
    order = offsets = experts  # unread unless sorting
    if sort and T <= block_t and block_t * k_pad * sort_e_pad <= SORT_MAX_ELEMS:
        order = torch.empty(T * top_k, device=x.device, dtype=torch.int32)
        offsets = torch.empty(E + 1, device=x.device, dtype=torch.int32)
        sorted_pairs = (order, offsets)
    # 8 warps once the logits or the sort's one-hot would crowd 4 warps' registers
    num_warps = 8 if block_t * max(e_pad, k_pad * sort_e_pad) > 4096 else 4
    _route_kernel[(triton.cdiv(T, block_t),)](
        logits, gates, experts, order, offsets, T, E, logits.stride(0),
        TOP_K=top_k, K_PAD=k_pad, E_PAD=e_pad, BLOCK_T=block_t, SORT=sorted_pairs is not None,
        SORT_E_PAD=sort_e_pad, num_warps=num_warps)
    return gates, experts, sorted_pairs


__all__ = ["route_triton", "route_and_sort_pairs", "counting_sort", "SORT_MAX_ELEMS"]
