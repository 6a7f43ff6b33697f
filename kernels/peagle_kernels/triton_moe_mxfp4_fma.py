"""MXFP4 expert GEMVs on CUDA cores, for the few token rows an expert gets at decode (no MMA).

With one to a few rows an expert, an MMA tile is mostly padding, and on Hopper the packed operand must be expanded
into the MMA's register layout first: that expansion, not memory, is what the MMA kernels
(`peagle_kernels.triton_moe_mxfp4`) spend their time on at decode (`docs/benchmarks/moe_tiles.md`). Here each
thread decodes the int32 words it loaded, in the layout it loaded them in, and multiplies with fused FMAs:

- Word j of a row holds weights 8j..8j+7, weight 8j + i in nibble i. Nibbles i and i + 4 sit 16 bits apart, so one
  shift and two masks turn both into fp16 bit patterns (`_fp16_pairs`): 2 integer operations a weight.
- The activations are read in fp32 (no conversion in the loop) and "nibble-major" within each 32-weight block
  (`perm32`), so the values nibble i of four consecutive words needs are 4 consecutive elements: one vector load,
  laid out as the words are.
- Per block, the 4 words' sums are multiplied by the block's E8M0 scale; rows are summed once at the end.

The up kernel writes h already in that order for the down kernel. A program owns BLOCK_N output rows of one
expert over one K-chunk and walks that expert's token rows one at a time (each row re-reads the tile from L1/L2).
"""
from __future__ import annotations

import triton
import triton.language as tl

from peagle_kernels.triton_moe import _expert_rows, _swiglu


@triton.jit
def perm32(k):
    """Position of element k in the nibble-major order: inside each 32-block, k = 8w + i is stored at 4i + w."""
    return k - k % 32 + 4 * (k % 8) + (k % 32) // 8


@triton.jit
def _fp16_pairs(w, I: tl.constexpr, ASM: tl.constexpr):
    """Nibbles I and I + 4 of the int32 words w (FP4 codes, 16 bits apart) -> their values x 2^-14 as fp32 (low,
    high): each code's magnitude bits move to an fp16's bits 9-11 and its sign to bit 15, both codes at once (0.5,
    the E2M1 subnormal, lands on the fp16 subnormal 2^-15, so no case is special). Two shifts and two masks make two
    weights. ASM (compiled): each half converted where it sits (the conversion reads a register's half); the
    interpreter runs the same steps in Triton."""
    mag = w << (9 - 4 * I) if I < 3 else w >> (4 * I - 9)
    h = (mag & 0x0E000E00) | ((w << (12 - 4 * I)) & -0x7FFF8000)  # -0x7FFF8000: the int32 0x80008000
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b16 l, u; mov.b32 {l, u}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, u; }",
            "=r,=r,r", [h], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo = (h & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (h >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _k_step(acc, a_row, w_rows, s_rows, n_ok, k0, K, BLOCK_R: tl.constexpr, BW: tl.constexpr, TAIL: tl.constexpr,
            ASM: tl.constexpr):
    """acc [BLOCK_R, BW/4] += the K-step at k0's per-block dot products, scaled. Only the TAIL step (past K) masks K
    (weights 0 there, activations 0 too: 0 x garbage could be NaN); rows past N load garbage nobody stores."""
    j = k0 // 8 + tl.arange(0, BW)
    b = k0 // 32 + tl.arange(0, BW // 4)
    a_at = a_row + 32 * (j // 4) + j % 4  # nibble 0 of word j; nibble i is 4i further (nibble-major)
    a_at = a_at[None, :] + tl.zeros([BLOCK_R, 1], tl.int32)  # the same for every row: loads laid out as the words
    # one scale a thread: loaded in the layout the block sums come in (no shuffle through shared memory)
    s_at = tl.max_contiguous(s_rows[:, None] + b[None, :], [1, 1])
    if TAIL:
        j_ok = (j // 4 < K // 32)[None, :]  # whole blocks: constant over a block's 4 words (vector loads stay)
        words = tl.load(w_rows[:, None] + j[None, :], mask=n_ok[:, None] & j_ok, other=0)
        s = tl.load(s_at, mask=n_ok[:, None] & (b < K // 32)[None, :], other=127)
    else:
        words = tl.load(w_rows[:, None] + j[None, :], mask=n_ok[:, None])
        s = tl.load(s_at, mask=n_ok[:, None])
    p = tl.zeros([BLOCK_R, BW], tl.float32)
    for i in tl.static_range(4):
        lo, hi = _fp16_pairs(words, i, ASM)
        if TAIL:
            p += lo * tl.load(a_at + 4 * i, mask=j_ok, other=0.0)
            p += hi * tl.load(a_at + 4 * i + 16, mask=j_ok, other=0.0)
        else:
            p += lo * tl.load(a_at + 4 * i)
            p += hi * tl.load(a_at + 4 * i + 16)
    s = s.to(tl.int32)
    scale = ((s << 23) | ((s == 0).to(tl.int32) << 22)).to(tl.float32, bitcast=True)  # 2^(s-127); 0: subnormal
    return acc + tl.sum(tl.reshape(p, (BLOCK_R, BW // 4, 4)), 2) * scale


@triton.jit
def _rows_dot(a_row, w_rows, s_rows, n_ok, k_begin, k_end, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
              ASM: tl.constexpr):
    """[BLOCK_R] fp32: each packed weight row (w_rows: int32 words, K/8 a row; s_rows: E8M0 bytes, K/32 a row) dotted
    with the activation row a_row (fp32, nibble-major: `perm32`) over K in [k_begin, k_end); k_begin is a multiple
    of BLOCK_K, so a's 4-element runs are aligned."""
    BW: tl.constexpr = BLOCK_K // 8  # words a K-step
    acc = tl.zeros([BLOCK_R, BW // 4], tl.float32)
    k_full = k_begin + (k_end - k_begin) // BLOCK_K * BLOCK_K
    for k0 in range(k_begin, k_full, BLOCK_K):
        acc = _k_step(acc, a_row, w_rows, s_rows, n_ok, k0, K, BLOCK_R, BW, False, ASM)
    if k_full < k_end:
        acc = _k_step(acc, a_row, w_rows, s_rows, n_ok, k_full, K, BLOCK_R, BW, True, ASM)
    return tl.sum(acc, 1) * 16384.0  # the fp16 patterns were the values x 2^-14


@triton.jit
def _store_row_partial(acc, bias_ptrs, part_ptr, stride_ps, stride_pr, row, cols, col_ok):
    """part[s, row, cols] = acc, plus the bias in K-chunk 0's partial (`triton_moe_mxfp4._store_partial`, one row)."""
    split = tl.program_id(2)
    bias = tl.load(bias_ptrs, mask=col_ok, other=0.0).to(tl.float32) * (split == 0).to(tl.float32)
    tl.store(part_ptr + split * stride_ps + row * stride_pr + cols, acc + bias, mask=col_ok)


@triton.jit
def moe_up_fma_kernel(x_ptr, wb_ptr, ws_ptr, b1_ptr, h_ptr, part_ptr, order_ptr, offsets_ptr,
                      num_experts, hidden, inter, alpha, limit, k_chunk,
                      stride_xt, stride_wbe, stride_wbn, stride_wse, stride_wsn, stride_be, stride_ht,
                      stride_ps, stride_pr, SPLIT: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr, E_PAD: tl.constexpr,
                      ASM: tl.constexpr = True, USE_PDL: tl.constexpr = False):
    """h[row] = clamped-SwiGLU(x[token] @ W1[e]^T + b1[e]); x and h are fp32 and nibble-major (`perm32`).
    The tile's 2 * BLOCK_N W1 rows are adjacent (gate 2c, up 2c + 1). SPLIT > 1: fp32 partials, as the MMA kernel."""
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    e, first, end = _expert_rows(offsets_ptr, num_experts, BLOCK_M, ONE_TILE, E_PAD)
    n = 2 * tl.program_id(1) * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
    w_rows = tl.multiple_of(wb_ptr + e.to(tl.int64) * stride_wbe + n.to(tl.int64) * stride_wbn, 16)  # 16-byte rows
    s_rows = ws_ptr + e.to(tl.int64) * stride_wse + n.to(tl.int64) * stride_wsn
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    b_row = b1_ptr + e.to(tl.int64) * stride_be
    k_begin = tl.program_id(2) * (k_chunk // BLOCK_K) * BLOCK_K  # (chunks are whole K-steps; this says so)
    for row in range(first, end):
        token = tl.load(order_ptr + row) // TOP_K
        acc = _rows_dot(x_ptr + token * stride_xt, w_rows, s_rows, n < 2 * inter, k_begin,
                        tl.minimum(k_begin + k_chunk, hidden), hidden, 2 * BLOCK_N, BLOCK_K, ASM)
        gate, up = tl.split(tl.reshape(acc, (BLOCK_N, 2)))
        if SPLIT == 1:
            gate += tl.load(b_row + 2 * cols, mask=col_ok, other=0.0).to(tl.float32)
            up += tl.load(b_row + 2 * cols + 1, mask=col_ok, other=0.0).to(tl.float32)
            h = _swiglu(gate, up, alpha, limit)
            tl.store(h_ptr + row * stride_ht + perm32(cols), h.to(h_ptr.dtype.element_ty), mask=col_ok)
        else:
            _store_row_partial(gate, b_row + 2 * cols, part_ptr, stride_ps, stride_pr, row, 2 * cols, col_ok)
            _store_row_partial(up, b_row + 2 * cols + 1, part_ptr, stride_ps, stride_pr, row, 2 * cols + 1, col_ok)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


@triton.jit
def moe_down_fma_kernel(h_ptr, wb_ptr, ws_ptr, b2_ptr, gates_ptr, y_ptr, part_ptr, order_ptr, offsets_ptr,
                        num_experts, hidden, inter, k_chunk,
                        stride_ht, stride_wbe, stride_wbn, stride_wse, stride_wsn, stride_be, stride_yt,
                        stride_ps, stride_pr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr, E_PAD: tl.constexpr,
                        ASM: tl.constexpr = True, USE_PDL: tl.constexpr = False):
    """y[pair] = gate * (h[row] @ W2[e]^T + b2[e]), stored token-major; h is the up kernel's (fp32, nibble-major)."""
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    e, first, end = _expert_rows(offsets_ptr, num_experts, BLOCK_M, ONE_TILE, E_PAD)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_rows = tl.multiple_of(wb_ptr + e.to(tl.int64) * stride_wbe + cols.to(tl.int64) * stride_wbn, 16)
    s_rows = ws_ptr + e.to(tl.int64) * stride_wse + cols.to(tl.int64) * stride_wsn
    b_row = b2_ptr + e.to(tl.int64) * stride_be
    k_begin = tl.program_id(2) * (k_chunk // BLOCK_K) * BLOCK_K
    for row in range(first, end):
        acc = _rows_dot(h_ptr + row * stride_ht, w_rows, s_rows, col_ok, k_begin,
                        tl.minimum(k_begin + k_chunk, inter), inter, BLOCK_N, BLOCK_K, ASM)
        if SPLIT == 1:
            pair = tl.load(order_ptr + row)
            y = (acc + tl.load(b_row + cols, mask=col_ok, other=0.0).to(tl.float32)) * tl.load(gates_ptr + pair)
            tl.store(y_ptr + pair * stride_yt + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)
        else:
            _store_row_partial(acc, b_row + cols, part_ptr, stride_ps, stride_pr, row, cols, col_ok)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)
