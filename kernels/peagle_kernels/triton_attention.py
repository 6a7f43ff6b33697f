"""Triton paged attention (sinks, sliding window, GQA); the paged KV write rides in the RoPE kernel
(`peagle_kernels.triton_rope.rope_write_kv_triton`).

Same signature and semantics as `peagle_kernels.attention.paged_attention_ref`.

One attention kernel serves prefill chunks, multi-token verify/draft queries and single-token
decode. A program owns a tile of up to BLOCK_Q query tokens of one request and one kv head, and
takes all GROUP query heads of that kv head at once (rows = token x head), so each K/V tile is read
once per group. Tiles never straddle requests: request b owns the tile ids
`[qsl[b] // BLOCK_Q + b, qsl[b+1] // BLOCK_Q + b + 1)` and a program finds its request by binary
search, so the grid `T // BLOCK_Q + B` is known from shapes alone (no host sync, CUDA-graph safe);
the few tiles left without tokens exit at once.

The softmax is online, in fp32, on log2-scaled logits (exp2). The sink is a logit with a zero value
vector, so it starts the running state: m = sink, l = 1, acc = 0. Only KV positions inside
`[max(0, min_qpos - W + 1), min(max_qpos + 1, seq_len))` are visited; per row, the exact mask
`kv_pos <= q_pos` and `kv_pos > q_pos - W` is applied inside that range.

With few programs (decode at small batch) the KV range of a tile is split across NUM_SPLITS
programs ("flash decoding"); each stores its partial (m, l, acc) and a second kernel merges them
together with the sink. (Merging in the attention kernel instead, the last split of each tile counting
in on an atomic, was tried on an H200 in a one-off microbenchmark, not kept: a little faster for small
decode tiles, slower for verify tiles and at the 32 splits that batch-1 decode gets with the graphs' KV
capacity; not worth a second merge path.)

Tokens after the last request (CUDA-graph padding) belong to no tile: tile i zeroes the i-th BLOCK_Q
of them, and there are more than T // BLOCK_Q tiles, so every output token is written and the output
needs no memset (one CUDA-graph node less a layer).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from peagle_kernels.dispatch import pdl_launch

LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max: avoids (-inf) - (-inf) = nan


# ---------------------------------------------------------------------------------------------
# KV write
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# Paged attention
# ---------------------------------------------------------------------------------------------

@triton.jit
def segment_of_tile(starts_ptr, num_segments, tile, BLOCK: tl.constexpr):
    """Segment s owning `tile` when segment s (rows [starts[s], starts[s+1])) owns the tile ids
    `[starts[s] // BLOCK + s, starts[s+1] // BLOCK + s + 1)`: the largest s with
    starts[s] // BLOCK + s <= tile (strictly increasing in s, so binary search)."""
    lo = tl.program_id(0) * 0  # int32 tensors (not constexprs) so the loop-carried types are stable
    hi = lo + num_segments - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(starts_ptr + mid) // BLOCK + mid
        ok = first_tile <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _paged_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, pos_ptr, sinks_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    num_seqs, num_tokens, window, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # Which request, and which of its query tokens, this tile holds.
    b = segment_of_tile(qsl_ptr, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(qsl_ptr + b)
    q_end = tl.load(qsl_ptr + b + 1)
    first = q_begin + (tile - (q_begin // BLOCK_Q + b)) * BLOCK_Q

    # Rows are (token, head-in-group) pairs: row r = token r // GROUP_PAD, head r % GROUP_PAD.
    ROWS: tl.constexpr = BLOCK_Q * GROUP_PAD
    r = tl.arange(0, ROWS)
    head = kvh * GROUP + r % GROUP_PAD
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < HEAD_DIM
    # Padding tokens (after the last request) read zeros: tile i (split 0) writes the i-th BLOCK_Q of them.
    # There are T // BLOCK_Q + num_seqs > T // BLOCK_Q tiles, so they cover all T - qsl[num_seqs] of them.
    if split == 0:
        pad_tok = tl.load(qsl_ptr + num_seqs) + tile * BLOCK_Q + r // GROUP_PAD
        pad_ok = (pad_tok < num_tokens) & (r % GROUP_PAD < GROUP)
        tl.store(out_ptr + pad_tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 tl.zeros([ROWS, BLOCK_D], out_ptr.dtype.element_ty), mask=pad_ok[:, None] & d_ok[None, :])
    if first >= q_end:
        return
    tok = first + r // GROUP_PAD
    row_ok = (tok < q_end) & (r % GROUP_PAD < GROUP)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = tl.load(pos_ptr + tok, mask=row_ok, other=0)

    # KV range this tile can see, then (split-KV) this program's share of it.
    seq_len = tl.load(seq_lens_ptr + b)
    kv_end = tl.minimum(tl.max(tl.where(row_ok, q_pos, -1)) + 1, seq_len)
    kv_begin = kv_end * 0
    if HAS_WINDOW:
        min_pos = tl.min(tl.where(row_ok, q_pos, 2147483647))
        kv_begin = tl.maximum(min_pos - window + 1, 0)
    kv_begin = (kv_begin // BLOCK_N) * BLOCK_N  # aligned tiles; the mask drops the extra keys
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_begin, BLOCK_N), NUM_SPLITS) * BLOCK_N
        kv_begin = kv_begin + split * per_split
        kv_end = tl.minimum(kv_end, kv_begin + per_split)

    m = tl.full([ROWS], NEG_BIG, tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    if HAS_SINKS and NUM_SPLITS == 1:  # with splits, the merge kernel adds the sink
        m = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l = tl.full([ROWS], 1.0, tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)

    bt_row = block_tables_ptr + b * stride_bt
    head_off = kvh * stride_ch
    for start in range(kv_begin, kv_end, BLOCK_N):
        kv_pos = start + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < kv_end
        page = tl.load(bt_row + kv_pos // PAGE, mask=kv_ok, other=0).to(tl.int64)
        kv_off = page * stride_cb + (kv_pos % PAGE) * stride_cs + head_off
        kv_mask = kv_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=DOT_PREC) * qk_scale
        allowed = kv_ok[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (kv_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        rescale = tl.exp2(m - m_new)
        l = l * rescale + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # l == 0: no key and no sink -> zeros
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        idx = (split * num_tokens + tok) * NUM_HEADS + head  # partials are [S, T, Hq(, D)]
        tl.store(part_m_ptr + idx, m, mask=row_ok)
        tl.store(part_l_ptr + idx, l, mask=row_ok)
        tl.store(part_acc_ptr + idx[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


@triton.jit
def _merge_splits_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr, out_ptr, qsl_ptr,
                         num_seqs, num_tokens, stride_ot, stride_oh,
                         NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr, HAS_SINKS: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Merge the partial softmax states of one token's query heads of one kv head: [GROUP, S]."""
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0)
    g = tl.arange(0, GROUP_PAD)
    head = tl.program_id(1) * GROUP + g
    sp = tl.arange(0, SPLITS_PAD)
    # A token outside every request gets all loads masked, hence zeros (as in the reference).
    num_covered = tl.load(qsl_ptr + num_seqs)
    ok = (g[:, None] < GROUP) & (sp[None, :] < NUM_SPLITS) & (t + 0 * sp[None, :] < num_covered)
    idx = (sp[None, :] * num_tokens + t) * NUM_HEADS + head[:, None]  # [GROUP_PAD, SPLITS_PAD]
    m = tl.load(part_m_ptr + idx, mask=ok, other=NEG_BIG)
    l = tl.load(part_l_ptr + idx, mask=ok, other=0.0)
    m_all = tl.max(m, 1)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=g < GROUP, other=0.0).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_all, sink)
    w = tl.exp2(m - m_all[:, None])
    l_all = tl.sum(l * w, 1)
    if HAS_SINKS:
        l_all += tl.exp2(sink - m_all)
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < HEAD_DIM
    acc = tl.load(part_acc_ptr + idx[:, :, None] * HEAD_DIM + dims[None, None, :],
                  mask=ok[:, :, None] & d_ok[None, None, :], other=0.0)
    out = tl.sum(acc * w[:, :, None], 1) / tl.where(l_all == 0.0, 1.0, l_all)[:, None]
    tl.store(out_ptr + t * stride_ot + head[:, None] * stride_oh + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(g[:, None] < GROUP) & d_ok[None, :])
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclass(frozen=True)
class AttnLaunch:
    """Launch shapes, chosen from tensor shapes alone (so fixed per captured CUDA graph)."""
    block_q: int      # query tokens per tile; rows per tile = block_q * group_pad
    block_n: int      # keys per inner step
    num_splits: int   # KV splits per tile (1: no split-KV)
    num_warps: int
    num_stages: int


def kv_splits(programs: int, sms: int, kv_extent: int, block_n: int) -> int:
    """KV splits per tile: only when the grid cannot fill the GPU (small-batch decode/verify), enough programs
    for ~2 waves, each split still reading a few KV tiles of the `kv_extent` keys a tile can see."""
    if programs >= sms:
        return 1
    splits = min(triton.next_power_of_2(triton.cdiv(2 * sms, programs)), 32)
    return max(1, min(splits, triton.cdiv(kv_extent, 4 * block_n)))


def attention_launch(q: torch.Tensor, num_kv_heads: int, num_seqs: int, kv_capacity: int,
                     window: int | None = None) -> AttnLaunch:
    """`kv_capacity`: the keys a block table can hold (what a captured graph knows of the context). A sliding
    window bounds the keys a tile sees to the window plus the tile's span: GPT-OSS's 128-token layers then take
    one split and no merge launch (at bs 1 they took 32 splits, one of them with keys, and the merge)."""
    T, Hq, D = q.shape
    group_pad = triton.next_power_of_2(Hq // num_kv_heads)
    # Rows per tile: at least 16 (tl.dot), more when requests carry many query tokens.
    avg_q = triton.cdiv(T, num_seqs)
    rows = 16 if avg_q <= 1 else min(128, max(16, triton.next_power_of_2(avg_q) * group_pad))
    block_q = max(1, rows // group_pad)
    # Decode/verify tiles (<= 64 rows) stream longer KV steps: measured ~20% faster on an H200.
    block_n = (128 if rows <= 64 else 64) if D <= 64 else 32
    programs = (T // block_q + num_seqs) * num_kv_heads
    splits = 1
    if q.is_cuda:
        sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
        extent = min(kv_capacity, window + block_q - 1) if window else kv_capacity
        splits = kv_splits(programs, sms, extent, block_n)
    return AttnLaunch(block_q, block_n, splits, num_warps=8 if rows >= 128 else 4, num_stages=3)


def _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, sinks):
    if q.dim() != 3:
        raise ValueError(f"paged_attention: q must be [T, Hq, D], got {tuple(q.shape)}")
    T, Hq, D = q.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != D:
        raise ValueError(f"paged_attention: k_cache/v_cache must both be [num_blocks, block_size, Hkv, {D}], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("paged_attention: k_cache and v_cache must share strides and be contiguous in head_dim")
    Hkv = k_cache.shape[2]
    if Hq % Hkv:
        raise ValueError(f"paged_attention: {Hq} query heads is not a multiple of {Hkv} kv heads")
    B = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.stride(-1) != 1:
        raise ValueError(f"paged_attention: block_tables must be a row-contiguous [{B}, max_blocks], "
                         f"got {tuple(block_tables.shape)}")
    if query_start_loc.shape != (B + 1,):
        raise ValueError(f"paged_attention: query_start_loc must have {B + 1} entries, got {tuple(query_start_loc.shape)}")
    if positions.shape != (T,):
        raise ValueError(f"paged_attention: positions must be [{T}], got {tuple(positions.shape)}")
    if sinks is not None and sinks.shape != (Hq,):
        raise ValueError(f"paged_attention: sinks must be [{Hq}], got {tuple(sinks.shape)}")


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           positions: torch.Tensor, sinks: torch.Tensor | None, sliding_window: int | None,
                           scale: float, *, num_kv_splits: int | None = None) -> torch.Tensor:
    """Attention of q [T, Hq, D] over the paged cache; returns [T, Hq, D] in q's dtype.

    `num_kv_splits` forces the split-KV path (tests); by default it is chosen from the shapes.
    """
    _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, sinks)
    if q.stride(-1) != 1:
        q = q.contiguous()
    T, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    B = seq_lens.shape[0]
    if T == 0 or B == 0:
        return torch.zeros_like(q)

    group = Hq // Hkv
    group_pad = triton.next_power_of_2(group)
    launch = attention_launch(q, Hkv, B, block_tables.shape[1] * page, sliding_window)
    block_q, block_n = launch.block_q, launch.block_n
    splits = num_kv_splits or launch.num_splits
    block_d = max(16, triton.next_power_of_2(D))
    num_tiles = T // block_q + B
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"

    out = torch.empty_like(q)  # every token written: by its tile, or zeroed (padding) by the kernel
    if splits > 1:
        part_m = torch.empty(splits, T, Hq, device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(splits, T, Hq, D, device=q.device, dtype=torch.float32)
    else:
        part_m = part_l = part_acc = out  # unused
    sinks_arg = sinks if sinks is not None else q  # unused when HAS_SINKS is False
    _paged_attn_kernel[(num_tiles, Hkv, splits)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, positions, sinks_arg,
        part_m, part_l, part_acc,
        B, T, int(sliding_window or 0), float(scale) * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], block_tables.stride(0),
        NUM_HEADS=Hq, GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n, HEAD_DIM=D,
        BLOCK_D=block_d, PAGE=page, HAS_SINKS=sinks is not None, HAS_WINDOW=bool(sliding_window),
        NUM_SPLITS=splits, DOT_PREC=dot_prec, num_warps=launch.num_warps, num_stages=launch.num_stages,
        **pdl_launch(q))
    if splits > 1:
        _merge_splits_kernel[(T, Hkv)](
            part_m, part_l, part_acc, sinks_arg, out, query_start_loc, B, T, out.stride(0), out.stride(1),
            NUM_HEADS=Hq, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=D, BLOCK_D=block_d, NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits), HAS_SINKS=sinks is not None, **pdl_launch(q))
    return out


__all__ = ["paged_attention_triton", "segment_of_tile", "attention_launch", "kv_splits", "AttnLaunch"]
