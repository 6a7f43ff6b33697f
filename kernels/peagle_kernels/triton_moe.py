"""Triton GPT-OSS mixture of experts: grouped GEMMs over expert-sorted (token, expert) pairs.

Same signature and semantics as `peagle_kernels.moe.moe_ref`. Steps:
1. routing (`peagle_kernels.triton_routing`): up to 64 tokens one Triton launch computes the router logits, top-k
   and the softmax over the k logits; larger batches take the router linear from cuBLAS, then that launch;
2. sort the T*k (token, expert) pairs by expert, never syncing with the host (CUDA-graph
   friendly): a counting sort inside the routing launch for small batches (as at decode), else a
   stable torch argsort plus searchsorted for the per-expert row offsets;
3. `_moe_up_kernel`: h = clamped-SwiGLU(x[token] @ w1[e]^T + b1[e]) for each sorted pair; the gate
   and up channels are the even and odd rows of w1[e], read as two tiles and combined in registers;
4. `_moe_down_kernel`: y[pair] = gate * (h @ w2[e]^T + b2[e]), stored at the pair's own row
   (token-major), which un-permutes for free;
5. out = sum over the k pairs of each token (torch sum, fp32 accumulation; deterministic, no atomics),
   or with reduce=False the [T, k, H] pair rows unsummed: the norm after the MoE adds them (`peagle_kernels.norm`).

Both GEMMs are "grouped": expert e owns the M-tile ids `[off[e] // BLOCK_M + e, off[e+1] // BLOCK_M + e + 1)`
(`segment_of_tile`, the same scheme as the attention kernel), so the grid is fixed by the shapes.
At decode sizes (T <= 64) BLOCK_M covers every token, so each selected expert is one M-tile and
its weights stream from memory exactly once: GEMV-like, bandwidth-bound (H200, GPT-OSS-20B shape:
~2.4 TB/s of expert weights at T=1, ~3.9 TB/s at T=16..64); N is cut small to spread those
weights over many programs. There M-tile i is simply the i-th expert with rows, and the grid launches
min(E, T*k) M-tiles instead of T*k // BLOCK_M + E (`_expert_rows`): at T = 1, 4 of 32 rather than 32 of
which 28 only find their expert empty (2,520 of the up-projection's 2,880 programs at the 20B shape).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from peagle_kernels.dispatch import pdl_launch
from peagle_kernels.moe import Routing, check_moe_shapes
from peagle_kernels.triton_attention import segment_of_tile
from peagle_kernels.triton_routing import SORT_MAX_ELEMS, counting_sort, route_and_sort_pairs


@triton.jit
def _expert_rows(offsets_ptr, num_experts, BLOCK_M: tl.constexpr, ONE_TILE: tl.constexpr, E_PAD: tl.constexpr):
    """Expert of this M-tile and its sorted rows; `first >= end` means the tile is empty.

    ONE_TILE (every expert's rows fit one M-tile, BLOCK_M >= T; `RoutedPairs`): M-tile i is the i-th expert
    that has rows, found from one vector load of the offsets, and the grid has min(E, T*k) M-tiles. Otherwise
    expert e owns the tile ids of `segment_of_tile`, found by binary search, and the grid has one M-tile per
    expert more than the rows need (T*k // BLOCK_M + E), since any expert may hold a partial tile."""
    tile = tl.program_id(0)
    if ONE_TILE:
        ex = tl.arange(0, E_PAD)
        ok = ex < num_experts
        begins = tl.load(offsets_ptr + ex, mask=ok, other=0)
        ends = tl.load(offsets_ptr + ex + 1, mask=ok, other=0)
        has_rows = ok & (ends > begins)
        mine = has_rows & (tl.cumsum(has_rows.to(tl.int32), 0) == tile + 1)  # at most one expert; none: empty
        e = tl.sum(tl.where(mine, ex, 0), 0)
        first = tl.sum(tl.where(mine, begins, 0), 0)
        end = tl.sum(tl.where(mine, ends, 0), 0)
    else:
        e = segment_of_tile(offsets_ptr, num_experts, tile, BLOCK_M)
        begin = tl.load(offsets_ptr + e)
        end = tl.load(offsets_ptr + e + 1)
        first = begin + (tile - (begin // BLOCK_M + e)) * BLOCK_M
    return e, first, end


@triton.jit
def _swiglu(gate, up, alpha, limit):
    """GPT-OSS's clamped SwiGLU, with the +1 on the linear branch."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate * tl.sigmoid(alpha * gate) * (up + 1.0)


@triton.jit
def _swiglu_store(acc_gate, acc_up, b_row, h_ptr, stride_ht, rows, row_ok, cols, col_ok, alpha, limit):
    """Up-projection epilogue: add the gate/up biases (b_row: this expert's b1, interleaved), clamp,
    SwiGLU with the +1 on the linear branch, store h at the sorted rows."""
    gate = acc_gate + tl.load(b_row + 2 * cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    up = acc_up + tl.load(b_row + 2 * cols + 1, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    h = _swiglu(gate, up, alpha, limit)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_ht + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _weighted_store(acc, b_row, gates_ptr, y_ptr, stride_yt, pair, row_ok, cols, col_ok):
    """Down-projection epilogue: add this expert's b2 (b_row), weight by the pair's gate, store at the
    pair's own (token-major) row, which un-permutes."""
    bias = tl.load(b_row + cols, mask=col_ok, other=0.0).to(tl.float32)
    gate = tl.load(gates_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    y = (acc + bias[None, :]) * gate[:, None]
    tl.store(y_ptr + pair[:, None].to(tl.int64) * stride_yt + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_up_kernel(x_ptr, w1_ptr, b1_ptr, h_ptr, order_ptr, offsets_ptr,
                   num_experts, hidden, inter, alpha, limit,
                   stride_xt, stride_we, stride_wn, stride_be, stride_ht,
                   TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_PREC: tl.constexpr, ONE_TILE: tl.constexpr, E_PAD: tl.constexpr, USE_PDL: tl.constexpr = False):
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    e, first, end = _expert_rows(offsets_ptr, num_experts, BLOCK_M, ONE_TILE, E_PAD)
    if first >= end:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    token = tl.load(order_ptr + rows, mask=row_ok, other=0) // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # SwiGLU channels c: w1 rows 2c, 2c+1
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)

    x_rows = x_ptr + token.to(tl.int64)[:, None] * stride_xt
    w_base = w1_ptr + e.to(tl.int64) * stride_we
    gate_rows = w_base + (2 * cols)[None, :].to(tl.int64) * stride_wn
    up_rows = gate_rows + stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = k0 + ks < hidden
        a = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(gate_rows + (k0 + ks)[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        w_up = tl.load(up_rows + (k0 + ks)[:, None], mask=w_mask, other=0.0)
        acc_gate = tl.dot(a, w_gate.to(a.dtype), acc_gate, input_precision=DOT_PREC)
        acc_up = tl.dot(a, w_up.to(a.dtype), acc_up, input_precision=DOT_PREC)

    _swiglu_store(acc_gate, acc_up, b1_ptr + e.to(tl.int64) * stride_be, h_ptr, stride_ht, rows, row_ok, cols, col_ok,
                  alpha, limit)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


@triton.jit
def _moe_down_kernel(h_ptr, w2_ptr, b2_ptr, gates_ptr, y_ptr, order_ptr, offsets_ptr,
                     num_experts, hidden, inter,
                     stride_ht, stride_we, stride_wn, stride_be, stride_yt,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
                     ONE_TILE: tl.constexpr, E_PAD: tl.constexpr, USE_PDL: tl.constexpr = False):
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    e, first, end = _expert_rows(offsets_ptr, num_experts, BLOCK_M, ONE_TILE, E_PAD)
    if first >= end:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output (hidden) channels
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)

    h_rows = h_ptr + rows[:, None].to(tl.int64) * stride_ht
    w_rows = w2_ptr + e.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = k0 + ks < inter
        a = tl.load(h_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PREC)

    _weighted_store(acc, b2_ptr + e.to(tl.int64) * stride_be, gates_ptr, y_ptr, stride_yt, pair, row_ok, cols, col_ok)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


@triton.jit
def _sort_pairs_kernel(experts_ptr, order_ptr, offsets_ptr, num_pairs, num_experts,
                       PAIRS_PAD: tl.constexpr, EXPERTS_PAD: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One program: a stable counting sort of the pairs by expert (small batches only)."""
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    p = tl.arange(0, PAIRS_PAD)
    expert = tl.load(experts_ptr + p, mask=p < num_pairs, other=EXPERTS_PAD)  # padding matches no expert
    counting_sort(expert, p, order_ptr, offsets_ptr, num_pairs, num_experts, EXPERTS_PAD)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


def sort_pairs_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, offsets): `order[i]` is the pair (t*k + j) at sorted row i, pairs of one expert in
    token order; expert e's rows are `[offsets[e], offsets[e+1])`. Device-side only (no .item(),
    no bincount), so graph-capturable. Small batches use one Triton program (one launch instead
    of a radix sort's several); large ones a stable torch sort."""
    flat = experts.flatten()
    pairs_pad, experts_pad = triton.next_power_of_2(max(flat.numel(), 1)), triton.next_power_of_2(num_experts + 1)
    if pairs_pad * experts_pad <= SORT_MAX_ELEMS:
        order = torch.empty(flat.numel(), device=flat.device, dtype=torch.int32)
        offsets = torch.empty(num_experts + 1, device=flat.device, dtype=torch.int32)
        _sort_pairs_kernel[(1,)](flat.contiguous(), order, offsets, flat.numel(), num_experts,
                                 PAIRS_PAD=pairs_pad, EXPERTS_PAD=experts_pad, num_warps=8, **pdl_launch(flat))
        return order, offsets
    order = torch.argsort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype)
    offsets = torch.searchsorted(flat[order].contiguous(), bounds)
    return order.to(torch.int32), offsets.to(torch.int32)


# MXFP4 decode: "gemv" (`_mxfp4_gemv_kernel` while `use_gemv` says so) or "mma" (the tensor-core kernels at every
# size). A GEMV program reads its expert's weights once a sorted row, the MMA kernels once an expert: the GEMVs win
# while an expert has few rows. On an H100 (docs/benchmarks/moe_tiles.md) they ran the 120B layer (E = 128) 1.6x
# (1 token) to 1.95x (24 tokens) faster than the MMA kernels, still 1.37x at 64 tokens (2 rows an expert); the 20B
# layer (E = 32) 1.7-1.9x at 1-8 tokens, 1.1x at 24 (3 rows an expert), 0.92x at 32 (4).
MXFP4_DECODE = os.environ.get("PEAGLE_MXFP4_DECODE", "gemv")
GEMV_MAX_TOKENS = 64  # measured no further
GEMV_MAX_ROWS_PER_EXPERT = 3


def use_gemv(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether MXFP4 experts run as GEMVs (`PEAGLE_MXFP4_DECODE=gemv`): through 64 tokens while the routed rows
    average at most 3 an expert (GPT-OSS-120B: 64 tokens; 20B: 24)."""
    return (MXFP4_DECODE == "gemv" and num_tokens <= GEMV_MAX_TOKENS
            and num_tokens * top_k <= GEMV_MAX_ROWS_PER_EXPERT * num_experts)


@dataclass(frozen=True)
class MoeTiles:
    """Launch shapes, chosen from the batch size alone (so fixed per captured CUDA graph).

    `up_n` counts SwiGLU channels (2 * up_n rows of w1), `down_n` output columns. Measured on an
    H200 (`benchmarks/moe_tiles.py`): bf16 at the GPT-OSS-20B shape (H = I = 2880, E = 32, k = 4), MXFP4 at
    the 120B shape (E = 128).
    """
    block_m: int
    up_n: int
    down_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # MXFP4 at decode sizes: K split over this many programs (triton_moe_mxfp4)
    gemv_rows: int = 0  # MXFP4: > 0 runs the CUDA-core GEMV kernels, this many weight rows a loop step (up_n and
    # down_n are then the rows a program covers; K is cut in chunks of 32 blocks)


# MXFP4 experts as CUDA-core GEMVs: one sorted row a program, 64 w1 rows or 32 w2 rows a program (twice that past 16
# tokens), 16 a loop step. Of the launch shapes timed at 1-64 tokens (120B and 20B, H100), the best or within 7% of it
# at every size; the wider one was 2-6% faster from 24 tokens up (more rows share a program's activations).
GEMV_TILES = MoeTiles(1, 64, 32, 32 * 32, 2, 1, gemv_rows=16)
GEMV_TILES_WIDE = MoeTiles(1, 128, 64, 32 * 32, 2, 1, gemv_rows=16)


def moe_tiles(num_tokens: int, top_k: int, mxfp4: bool = False, gemv: bool | None = None,
              num_experts: int = 0) -> MoeTiles:
    """`gemv` (MXFP4 only): None follows `use_gemv` (which needs `num_experts`); True/False force."""
    if mxfp4 and (gemv or (gemv is None and use_gemv(num_tokens, top_k, num_experts))):
        return GEMV_TILES if num_tokens <= 16 else GEMV_TILES_WIDE
    if mxfp4 and num_tokens <= 64:
        # Packed experts, measured on an H100 at the 120B and 20B shapes (docs/benchmarks/moe_tiles.md): two warps
        # and 32-wide N tiles through 64 tokens (1.36-1.47x the grouped tiles below at 64), K split in two at one
        # token (18-20% faster: twice the programs in flight; no gain from 2 tokens up).
        return MoeTiles(16, 32, 32, 128, 2, 4, split_k=2 if num_tokens == 1 else 1)
    if num_tokens <= 32:
        # An expert gets at most one row per token, so BLOCK_M >= T makes each selected expert a
        # single M-tile: its weights stream from memory once (GEMV-like, bandwidth-bound).
        return MoeTiles(max(16, triton.next_power_of_2(num_tokens)), 32, 64, 128, 4, 4)
    if num_tokens * top_k <= 4096:
        return MoeTiles(64, 64, 128, 64, 4, 3)
    return MoeTiles(128, 64, 128, 64, 8, 3)


@dataclass(frozen=True)
class RoutedPairs:
    """One batch's T*k (token, expert) pairs, routed and sorted by expert, and its launch shapes."""

    gates: torch.Tensor    # [T*k]: the routing weight of pair t*k + j
    order: torch.Tensor    # [T*k] int32: the pair at each expert-sorted row
    offsets: torch.Tensor  # [E+1] int32: expert e owns sorted rows [offsets[e], offsets[e+1])
    tiles: MoeTiles
    one_tile: bool         # every expert's rows fit one M-tile (an expert has at most T rows; T <= BLOCK_M)

    @property
    def num_experts(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def m_tiles(self) -> int:
        """Grid size along M: enough M-tiles for any routing (fixed by T, k and E, so by a captured graph)."""
        pairs = self.order.shape[0]
        return min(self.num_experts, pairs) if self.one_tile else pairs // self.tiles.block_m + self.num_experts

    def kernel_args(self) -> dict:
        """The M-tiling constexprs every grouped MoE kernel takes (`_expert_rows`)."""
        return dict(BLOCK_M=self.tiles.block_m, ONE_TILE=self.one_tile,
                    E_PAD=triton.next_power_of_2(self.num_experts))


def route_and_sort(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, top_k: int,
                   mxfp4: bool = False, routing: Routing | None = None) -> RoutedPairs:
    """Steps 1-2 of every grouped MoE (bf16 or MXFP4 weights), on device: one launch at decode sizes (the
    routing kernel sorts the pairs too), else the routing kernel then `sort_pairs_by_expert`. A `routing`
    worked out already (`peagle_kernels.moe.norm_and_route`) is only sorted, if it is not yet."""
    T, E = x.shape[0], router_w.shape[0]
    if routing is not None and tuple(routing.experts.shape) != (T, top_k):
        raise ValueError(f"moe: routing for {tuple(routing.experts.shape)} pairs, x needs ({T}, {top_k})")
    gates, experts, sorted_pairs = routing or route_and_sort_pairs(x, router_w, router_b, top_k)
    order, offsets = sorted_pairs if sorted_pairs is not None else sort_pairs_by_expert(experts, E)
    tiles = moe_tiles(T, top_k, mxfp4, num_experts=E)
    return RoutedPairs(gates.flatten().contiguous(), order, offsets, tiles, one_tile=T <= tiles.block_m)


def token_outputs(y: torch.Tensor, num_tokens: int, top_k: int, reduce: bool) -> torch.Tensor:
    """The MoE's output from its token-major pair rows y [T*k, H]: each token's k rows summed (torch sum, fp32
    accumulation, one rounding), or with reduce=False the [T, k, H] summands whose sum that is."""
    y = y.view(num_tokens, top_k, y.shape[-1])
    return y.sum(1) if reduce else y


def moe_triton(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, w1: torch.Tensor,
               b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, top_k: int, alpha: float,
               limit: float, *, reduce: bool = True, routing: Routing | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H], or summands [T, k, H] with reduce=False."""
    check_moe_shapes(x, router_w, router_b, tuple(w1.shape), b1, tuple(w2.shape), b2, top_k)
    T, H = x.shape
    E, two_i, _ = w1.shape
    inter = two_i // 2
    if T == 0:
        return token_outputs(x.new_zeros(0, H), 0, top_k, reduce)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w1 = w1 if w1.stride(-1) == 1 else w1.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    b1, b2 = b1.contiguous(), b2.contiguous()

    r = route_and_sort(x, router_w, router_b, top_k, routing=routing)
    tiles = r.tiles
    dot_prec = "ieee" if x.dtype == torch.float32 else "tf32"

    h = torch.empty(T * top_k, inter, device=x.device, dtype=x.dtype)  # expert-sorted rows
    _moe_up_kernel[(r.m_tiles, triton.cdiv(inter, tiles.up_n))](
        x, w1, b1, h, r.order, r.offsets, E, H, inter, float(alpha), float(limit),
        x.stride(0), w1.stride(0), w1.stride(1), b1.stride(0), h.stride(0),
        TOP_K=top_k, BLOCK_N=tiles.up_n, BLOCK_K=tiles.block_k, DOT_PREC=dot_prec, **r.kernel_args(),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_launch(x))

    y = torch.empty(T * top_k, H, device=x.device, dtype=x.dtype)  # token-major rows: pair t*k + j
    _moe_down_kernel[(r.m_tiles, triton.cdiv(H, tiles.down_n))](
        h, w2, b2, r.gates, y, r.order, r.offsets, E, H, inter,
        h.stride(0), w2.stride(0), w2.stride(1), b2.stride(0), y.stride(0),
        BLOCK_N=tiles.down_n, BLOCK_K=tiles.block_k, DOT_PREC=dot_prec, **r.kernel_args(),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_launch(x))
    return token_outputs(y, T, top_k, reduce)


__all__ = ["moe_triton", "token_outputs", "sort_pairs_by_expert", "moe_tiles", "use_gemv", "GEMV_TILES", "MoeTiles",
           "route_and_sort", "RoutedPairs"]
