"""Triton GPT-OSS mixture of experts over MXFP4 experts kept packed in memory (W4A16).

Same signature and semantics as `peagle_kernels.moe.moe_mxfp4_ref`, and the same plan as the bf16 kernels
in `peagle_kernels.triton_moe` (routing and the device-side sort by expert, grouped M-tiles per expert,
the clamped-SwiGLU and weighted un-permuting epilogues are shared from there). Only the weight
operand differs: each K-step reads BLOCK_K/2 bytes of FP4 codes and BLOCK_K/32 E8M0 scale bytes
per output row, 4.25 bits a weight instead of 16, and expands them in registers. Hopper has no
FP4 tensor cores, so the MMA itself runs in bf16; what shrinks is the memory traffic, which is
what bounds decode (and what lets GPT-OSS-120B's experts fit one GPU).

Two ways to expand a tile (constexpr `DOT_SCALED`):
- `tl.dot_scaled(x, None, "bf16", codes, scales, "e2m1")`: Triton's microscaling dot; on Hopper the
  compiler upcasts the FP4 operand to bf16 in registers with its own conversion sequence and
  feeds the bf16 MMA. Used for bf16/fp16 activations (the GPU path).
- `_unpack_mxfp4`: the codes decoded by building fp32 bit patterns (no table), times the scale,
  then an ordinary `tl.dot`. Exact and dtype-agnostic: used for fp32 activations (the CPU tests
  under TRITON_INTERPRET=1) and as the fallback if `dot_scaled` misbehaves on a GPU
  (`PEAGLE_MXFP4_DOT=unpack`).

At decode and verify sizes (`triton_moe.use_gemv`: while experts average at most 3 routed rows, through 64 tokens)
the experts run instead as GEMVs on CUDA cores (`_mxfp4_gemv_kernel`,
`MoeTiles.gemv_rows`): activations held in registers for a whole K-chunk, a loop over weight rows that loads only
codes and scales. bf16/fp16 activations meet the codes as fp16 pairs (two products an instruction, each word's
eight summed in fp16, then fp32), fp32 activations in fp32. On an H100 they ran the 120B layer 1.4-2.0x faster than
the MMA kernels at 1-64 tokens (docs/benchmarks/moe_tiles.md); PEAGLE_MXFP4_DECODE=mma keeps the MMA kernels at
every size.

Layout: a packed matrix [E, N, K/32, 16] is read as bytes [E, N, K/2] (byte j of a row holds
weights 2j (low nibble) and 2j+1 (high nibble)); its scales [E, N, K/32]. H and I must be
multiples of 32 (whole MXFP4 blocks), not of the tiles: partial K-tiles are masked by whole blocks.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from peagle_kernels.dispatch import interpret_mode, pdl_launch
from peagle_kernels.moe import Routing, check_moe_shapes, mxfp4_shape
from peagle_kernels.triton_moe import (_expert_rows, _swiglu, _swiglu_store, _weighted_store, moe_tiles,
                                       route_and_sort, token_outputs)

# "scaled" (default): tl.dot_scaled for bf16/fp16 activations; "unpack": always the explicit decode.
DOT_MODE = os.environ.get("PEAGLE_MXFP4_DOT", "scaled")
# The GEMVs' word products on a GPU: "1" (default) inline PTX, "0" the Triton they equal bit for bit (slower).
GEMV_PTX = os.environ.get("PEAGLE_MXFP4_PTX", "1") != "0"


@triton.jit
def _e8m0(scale):
    """E8M0 scale bytes (as int32) -> 2^(scale - 127) in fp32, exactly: the fp32 with exponent field `scale`
    (scale >= 1); scale = 0 (2^-127) is an fp32 subnormal, built as 2^-126 / 2."""
    two_pow = (tl.maximum(scale, 1) << 23).to(tl.float32, bitcast=True)
    return tl.where(scale == 0, two_pow * 0.5, two_pow)


@triton.jit
def _fp4_times_scale(code, scale):
    """FP4 E2M1 codes (int32, 0..15) times 2^(scale - 127) (E8M0 bytes as int32) -> fp32, exactly.

    A code is sign | exponent e (2 bits) | mantissa m (1 bit). For e >= 1 its value 2^(e-1) * (1 + m/2)
    is the fp32 with exponent field e + 126 and mantissa top bit m: bits (code & 7) << 22 plus 126 << 23.
    Code 1 (0.5, subnormal in E2M1) is 126 << 23; code 0 is 0.
    """
    mag = code & 7
    bits = tl.where(mag >= 2, (mag << 22) + (126 << 23), tl.where(mag == 1, 126 << 23, 0))
    value = bits.to(tl.float32, bitcast=True)
    return tl.where(code >= 8, -value, value) * _e8m0(scale)


@triton.jit
def _unpack_mxfp4(codes, scales, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """codes [BLOCK_K/2, BLOCK_N] uint8 (K-packed) and scales [BLOCK_N, BLOCK_K/32] uint8 -> fp32 [BLOCK_K, BLOCK_N]."""
    c = codes.to(tl.int32)
    s = tl.trans(scales.to(tl.int32))  # [BLOCK_K/32, BLOCK_N]: one scale per 16 bytes of K
    s = tl.reshape(tl.broadcast_to(s[:, None, :], (BLOCK_K // 32, 16, BLOCK_N)), (BLOCK_K // 2, BLOCK_N))
    lo = _fp4_times_scale(c & 15, s)   # weights 2j
    hi = _fp4_times_scale(c >> 4, s)   # weights 2j + 1
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_K, BLOCK_N))


@triton.jit
def _mxfp4_step(acc, a, w_rows, s_rows, n_ok, k0, K, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_SCALED: tl.constexpr, LHS_FMT: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc [BM, BN] += a [BM, BLOCK_K] @ W[n, k0:k0 + BLOCK_K]^T for the packed rows n of this tile.

    w_rows [BN]: pointers to each row's code bytes (K/2 a row); s_rows [BN]: to its scales (K/32)."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    codes = tl.load(w_rows[None, :] + kb[:, None], mask=(kb < K // 2)[:, None] & n_ok[None, :], other=0)
    sb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    # Masked (past-K or past-N) codes are 0, so their value is 0 whatever the scale: 127 = 2^0 keeps it finite.
    scales = tl.load(s_rows[:, None] + sb[None, :], mask=n_ok[:, None] & (sb < K // 32)[None, :], other=127)
    if DOT_SCALED:
        acc = tl.dot_scaled(a, None, LHS_FMT, codes, scales, "e2m1", acc)
    else:
        w = _unpack_mxfp4(codes, scales, BLOCK_K, BLOCK_N)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _moe_mxfp4_up_kernel(x_ptr, wb_ptr, ws_ptr, b1_ptr, h_ptr, part_ptr, order_ptr, offsets_ptr,
                         num_experts, hidden, inter, alpha, limit, k_chunk,
                         stride_xt, stride_wbe, stride_wbn, stride_wse, stride_wsn, stride_be, stride_ht,
                         stride_ps, stride_pr, SPLIT: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_SCALED: tl.constexpr, LHS_FMT: tl.constexpr, DOT_PREC: tl.constexpr,
                         ONE_TILE: tl.constexpr, E_PAD: tl.constexpr, USE_PDL: tl.constexpr = False):
    """h[row] = clamped-SwiGLU(x[token] @ W1[e]^T + b1[e]) for the expert-sorted rows of this M-tile. With SPLIT > 1,
    program (., ., s) sums only K-chunk s and stores its fp32 partial sums (b1 in chunk 0's) in part[s];
    `_swiglu_finish_kernel` adds the chunks up."""
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    e, first, end = _expert_rows(offsets_ptr, num_experts, BLOCK_M, ONE_TILE, E_PAD)
    if first >= end:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    token = tl.load(order_ptr + rows, mask=row_ok, other=0) // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # SwiGLU channels c: W1 rows 2c (gate), 2c+1 (up)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)

    x_rows = x_ptr + token.to(tl.int64)[:, None] * stride_xt
    gate_n = (2 * cols).to(tl.int64)
    gate_b = wb_ptr + e.to(tl.int64) * stride_wbe + gate_n * stride_wbn
    gate_s = ws_ptr + e.to(tl.int64) * stride_wse + gate_n * stride_wsn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_begin = tl.program_id(2) * k_chunk
    for k0 in range(k_begin, tl.minimum(k_begin + k_chunk, hidden), BLOCK_K):
        a = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & (k0 + ks < hidden)[None, :], other=0.0)
        acc_gate = _mxfp4_step(acc_gate, a, gate_b, gate_s, col_ok, k0, hidden, BLOCK_K, BLOCK_N,
                               DOT_SCALED, LHS_FMT, DOT_PREC)
        acc_up = _mxfp4_step(acc_up, a, gate_b + stride_wbn, gate_s + stride_wsn, col_ok, k0, hidden, BLOCK_K,
                             BLOCK_N, DOT_SCALED, LHS_FMT, DOT_PREC)
    b_row = b1_ptr + e.to(tl.int64) * stride_be
    if SPLIT == 1:
        _swiglu_store(acc_gate, acc_up, b_row, h_ptr, stride_ht, rows, row_ok, cols, col_ok, alpha, limit)
    else:
        _store_partial(acc_gate, b_row + 2 * cols, part_ptr, stride_ps, stride_pr, rows, row_ok, 2 * cols, col_ok)
        _store_partial(acc_up, b_row + 2 * cols + 1, part_ptr, stride_ps, stride_pr, rows, row_ok, 2 * cols + 1,
                       col_ok)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


@triton.jit
def _moe_mxfp4_down_kernel(h_ptr, wb_ptr, ws_ptr, b2_ptr, gates_ptr, y_ptr, part_ptr, order_ptr, offsets_ptr,
                           num_experts, hidden, inter, k_chunk,
                           stride_ht, stride_wbe, stride_wbn, stride_wse, stride_wsn, stride_be, stride_yt,
                           stride_ps, stride_pr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           DOT_SCALED: tl.constexpr, LHS_FMT: tl.constexpr, DOT_PREC: tl.constexpr,
                           ONE_TILE: tl.constexpr, E_PAD: tl.constexpr, USE_PDL: tl.constexpr = False):
    """y[pair] = gate * (h[row] @ W2[e]^T + b2[e]), stored token-major (un-permuted). With SPLIT > 1, as the up
    kernel: fp32 partial sums of K-chunk s in part[s] (b2 in chunk 0's), finished by `_scatter_finish_kernel`."""
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
    w_b = wb_ptr + e.to(tl.int64) * stride_wbe + cols.to(tl.int64) * stride_wbn
    w_s = ws_ptr + e.to(tl.int64) * stride_wse + cols.to(tl.int64) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_begin = tl.program_id(2) * k_chunk
    for k0 in range(k_begin, tl.minimum(k_begin + k_chunk, inter), BLOCK_K):
        a = tl.load(h_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & (k0 + ks < inter)[None, :], other=0.0)
        acc = _mxfp4_step(acc, a, w_b, w_s, col_ok, k0, inter, BLOCK_K, BLOCK_N, DOT_SCALED, LHS_FMT, DOT_PREC)
    b_row = b2_ptr + e.to(tl.int64) * stride_be
    if SPLIT == 1:
        _weighted_store(acc, b_row, gates_ptr, y_ptr, stride_yt, pair, row_ok, cols, col_ok)
    else:
        _store_partial(acc, b_row + cols, part_ptr, stride_ps, stride_pr, rows, row_ok, cols, col_ok)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


@triton.jit
def _shl(w, bits: tl.constexpr):
    """w << bits, or w >> -bits (arithmetic; callers mask the bits that shifts in)."""
    if bits >= 0:
        return w << bits
    else:
        return w >> -bits


@triton.jit
def _fp4_pair(words, I: tl.constexpr):
    """Weights I and I + 4 of each int32 word (nibbles I and I + 4; the word's 8 codes in nibble order) as an fp16
    pair in an int32 (weight I in the low half): each the code's value times 2^-14, exactly.

    Nibbles I and I + 4 are 16 bits apart, so one word makes the pair: sign to bits 15 and 31, exponent and
    mantissa bits to 11..9 and 27..25. E2M1's exponent-0 codes (0 and 0.5) land on fp16 subnormals, so no table
    and no select. (`_WORD_DOT_PTX` builds the same pairs with fewer instructions.)"""
    return (_shl(words, 12 - 4 * I) & -0x7FFF8000) | (_shl(words, 9 - 4 * I) & 0x0E000E00)  # 0x80008000 as int32


@triton.jit
def _halves(pair):
    """An fp16 pair in an int32 -> (low, high) fp16."""
    return pair.to(tl.int16).to(tl.float16, bitcast=True), (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _f16x2(lo, hi):
    """Two fp32 tensors -> fp16 pairs in int32s (lo in the low half), rounded to nearest."""
    lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo16 | (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _x_pair(x_row, blk, q, blk_ok, I: tl.constexpr):
    """The activations that meet `_fp4_pair(words, I)`: weights 8q + I and 8q + I + 4 of each block, fp32."""
    at = x_row + blk * 32 + 8 * q + I
    return tl.load(at, mask=blk_ok, other=0.0).to(tl.float32), tl.load(at + 4, mask=blk_ok, other=0.0).to(tl.float32)


@triton.jit
def _pow2_scale(amax):
    """(2^c, 2^-c) in fp32 with amax * 2^c in [2^14, 2^15) (amax >= 0; clamped so that both stay normal)."""
    e = tl.minimum(tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 15), 254)  # amax's exponent field
    return ((268 - e) << 23).to(tl.float32, bitcast=True), ((e - 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _word_dot_f32(words, x0l, x0h, x1l, x1h, x2l, x2h, x3l, x3h):
    """Each word's 8 weights (times 2^-14) times their fp32 activations (`_x_pair`'s), summed in fp32."""
    acc = _pair_fma(tl.zeros(words.shape, tl.float32), words, x0l, x0h, 0)
    acc = _pair_fma(_pair_fma(acc, words, x1l, x1h, 1), words, x2l, x2h, 2)
    return _pair_fma(acc, words, x3l, x3h, 3)


@triton.jit
def _pair_fma(acc, words, x_lo, x_hi, I: tl.constexpr):
    """acc += each word's weights I and I + 4 (fp32) times their fp32 activations."""
    lo, hi = _halves(_fp4_pair(words, I))
    return tl.fma(hi.to(tl.float32), x_hi, tl.fma(lo.to(tl.float32), x_lo, acc))


# `_word_dot_f16` on a GPU: the same products and roundings in 17 instructions a word (Triton's own code for it
# takes ~25: benchmarks/sass_mix.py). The pairs: the odd nibbles' magnitude bits moved down 3 to sit 6 below their
# sign bits, as a pair's do at bits 9..11 and 15 (one shift and select, `lop3` 0xE4 = c ? a : b), so pair 3 is one
# mask and pair 1 a shift and a mask; the even nibbles' sign bits moved up 3 the same way. Then one fp16x2 FMA a
# pair, the halves added and widened.
_WORD_DOT_PTX = tl.constexpr("""{
.reg .b32 odd, even, t, p, acc;
.reg .f16 lo, hi, sum;
shr.b32 t, $1, 3;
lop3.b32 odd, t, $1, 0x0E0E0E0E, 0xE4;
shl.b32 t, $1, 3;
lop3.b32 even, t, $1, 0x40404040, 0xE4;
shl.b32 t, even, 9;
and.b32 p, t, 0x8E008E00;
mul.rn.f16x2 acc, p, $2;
shl.b32 t, odd, 8;
and.b32 p, t, 0x8E008E00;
fma.rn.f16x2 acc, p, $3, acc;
shl.b32 t, even, 1;
and.b32 p, t, 0x8E008E00;
fma.rn.f16x2 acc, p, $4, acc;
and.b32 p, odd, 0x8E008E00;
fma.rn.f16x2 acc, p, $5, acc;
mov.b32 {lo, hi}, acc;
add.rn.f16 sum, lo, hi;
cvt.f32.f16 $0, sum;
}""")


@triton.jit
def _word_dot_f16(words, x0, x1, x2, x3, PTX: tl.constexpr):
    """Each word's 8 weights (times 2^-14) times their activations, given as fp16 pairs x_I (`_f16x2`, the
    activations of `_fp4_pair(words, I)`): the products of a pair of lanes in fp16 (exact for bf16 activations
    scaled into fp16's range: 2 significant bits times 8), summed along each lane in fp16 (4 roundings), the lanes
    added in fp16, then widened to fp32. PTX: the same in inline PTX (GPUs; the interpreter runs this Triton)."""
    if PTX:
        xs = [tl.broadcast_to(x0, words.shape), tl.broadcast_to(x1, words.shape), tl.broadcast_to(x2, words.shape),
              tl.broadcast_to(x3, words.shape)]
        return tl.inline_asm_elementwise(_WORD_DOT_PTX, "=r,r,r,r,r,r", [words] + xs, dtype=tl.float32, is_pure=True,
                                         pack=1)
    wl, wh = _halves(_fp4_pair(words, 0))
    xl, xh = _halves(x0)
    al, ah = _half_fma(wl * xl, wh * xh, words, x1, 1)
    al, ah = _half_fma(al, ah, words, x2, 2)
    al, ah = _half_fma(al, ah, words, x3, 3)
    return (al + ah).to(tl.float32)


@triton.jit
def _half_fma(al, ah, words, x, I: tl.constexpr):
    """The fp16 lanes (al, ah) += pair I's weights times the fp16 pair x."""
    wl, wh = _halves(_fp4_pair(words, I))
    xl, xh = _halves(x)
    return tl.fma(wl, xl, al), tl.fma(wh, xh, ah)


@triton.jit
def _mxfp4_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, part_ptr, order_ptr, offsets_ptr, num_experts, N, K, n_chunk,
                       stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_ps, stride_pr,
                       GATHER: tl.constexpr, TOP_K: tl.constexpr, ROWS: tl.constexpr, E_PAD: tl.constexpr,
                       F16: tl.constexpr, PTX: tl.constexpr, USE_PDL: tl.constexpr = False):
    """part[s, r, n] = sum over K-chunk s of x[src(r), k] * W_e[n, k], plus b_e[n] in chunk 0 (fp32), for the
    expert-sorted row r = program_id(0) of expert e; src(r) is r's token (GATHER: the up projection) or r (down).

    A GEMV on CUDA cores for decode sizes. A K-chunk is 32 MXFP4 blocks, and its activations are loaded once,
    before the loop, and stay in registers: the loop walks this program's weight rows, ROWS at a time, and reads
    only their codes and scale bytes. A row's chunk is 128 int32 words, held as [4 groups, 32 words] (word 32 g + v
    is word v % 4 of block 8 g + v // 4): a lane's 16-byte load is one block's four words, 8 lanes cover a group,
    and the groups stay in registers, so a row's sum crosses 8 lanes, not 32. (stride_we and stride_wn count
    blocks of 16 bytes, so the compiler sees the alignment; a row of K/2 = 1440 bytes is 360 words, not a multiple
    of 16.) Word j holds weights 8q..8q+7 of block j // 4 (q = j % 4), weight 8q + i in nibble i. Each word's
    products are summed (`_word_dot_f16`, or in fp32 for fp32 activations: `_word_dot_f32`) and scaled once a
    block. F16: the chunk's activations times a power of two (`_pow2_scale`, undone on the row's sum) as fp16."""
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    ex = tl.arange(0, E_PAD)
    ends = tl.load(offsets_ptr + ex + 1, mask=ex < num_experts, other=2**30)
    e = tl.sum((ends <= row).to(tl.int32), 0)  # the expert whose sorted rows hold this one
    src = tl.load(order_ptr + row) // TOP_K if GATHER else row
    split = tl.program_id(2)
    g = tl.arange(0, 4)[None, :, None]
    v = tl.arange(0, 32)[None, None, :]
    blk = split * 32 + 8 * g + v // 4  # [1, 4, 32]: each word's block
    blk_ok = blk < K // 32
    x_row = x_ptr + src.to(tl.int64) * stride_xt
    x0l, x0h = _x_pair(x_row, blk, v % 4, blk_ok, 0)
    x1l, x1h = _x_pair(x_row, blk, v % 4, blk_ok, 1)
    x2l, x2h = _x_pair(x_row, blk, v % 4, blk_ok, 2)
    x3l, x3h = _x_pair(x_row, blk, v % 4, blk_ok, 3)
    unscale = 16384.0  # 2^14 undoes the pairs' 2^-14
    if F16:
        m = tl.maximum(tl.maximum(tl.abs(x0l), tl.abs(x0h)), tl.maximum(tl.abs(x1l), tl.abs(x1h)))
        m = tl.maximum(m, tl.maximum(tl.maximum(tl.abs(x2l), tl.abs(x2h)), tl.maximum(tl.abs(x3l), tl.abs(x3h))))
        scale, inv = _pow2_scale(tl.max(m))  # one reduction over the chunk
        unscale *= inv
        x0, x1 = _f16x2(x0l * scale, x0h * scale), _f16x2(x1l * scale, x1h * scale)
        x2, x3 = _f16x2(x2l * scale, x2h * scale), _f16x2(x3l * scale, x3h * scale)

    w_e = w_ptr + (e.to(tl.int64) * stride_we + split * 32) * 4 + 32 * g + v
    s_blk = split * 32 + 8 * g + tl.arange(0, 8)[None, None, :]  # [1, 4, 8]: the chunk's blocks, one a scale byte
    s_e = s_ptr + e.to(tl.int64) * stride_se + s_blk
    b_e = b_ptr + e.to(tl.int64) * stride_be
    out = part_ptr + split * stride_ps + row.to(tl.int64) * stride_pr
    n_begin = tl.program_id(1) * n_chunk
    for n0 in range(n_begin, tl.minimum(n_begin + n_chunk, N), ROWS):
        n = n0 + tl.arange(0, ROWS)
        n_ok = n < N
        n3 = n[:, None, None]
        words = tl.load(w_e + n3.to(tl.int64) * stride_wn * 4, mask=(n3 < N) & blk_ok, other=0)
        scales = tl.load(s_e + n3.to(tl.int64) * stride_sn, mask=(n3 < N) & (s_blk < K // 32), other=127)
        if F16:
            p = _word_dot_f16(words, x0, x1, x2, x3, PTX)
        else:
            p = _word_dot_f32(words, x0l, x0h, x1l, x1h, x2l, x2h, x3l, x3h)
        block_sums = tl.sum(tl.reshape(p, [ROWS, 4, 8, 4]), 3)
        y = tl.sum(tl.sum(block_sums * _e8m0(scales.to(tl.int32)), 2), 1) * unscale
        y += tl.load(b_e + n, mask=n_ok, other=0.0).to(tl.float32) * (split == 0).to(tl.float32)
        tl.store(out + n, y, mask=n_ok)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


@triton.jit
def _store_partial(acc, bias_ptrs, part_ptr, stride_ps, stride_pr, rows, row_ok, cols, col_ok):
    """part[s, rows, cols] = acc, plus the bias in K-chunk 0's partial (so the finish needs no expert ids)."""
    split = tl.program_id(2)
    bias = tl.load(bias_ptrs, mask=col_ok, other=0.0).to(tl.float32) * (split == 0).to(tl.float32)
    tl.store(part_ptr + split * stride_ps + rows[:, None].to(tl.int64) * stride_pr + cols[None, :],
             acc + bias[None, :], mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_partials(part_ptr, stride_ps, stride_pr, rows, cols, mask, SPLIT: tl.constexpr):
    """The K-chunks' partial sums of rows x cols, added in chunk order (deterministic)."""
    total = tl.zeros(mask.shape, tl.float32)
    for s in tl.static_range(SPLIT):
        total += tl.load(part_ptr + s * stride_ps + rows[:, None].to(tl.int64) * stride_pr + cols[None, :], mask=mask,
                         other=0.0)
    return total


@triton.jit
def _swiglu_finish_kernel(part_ptr, h_ptr, num_rows, inter, alpha, limit, stride_ps, stride_pr, stride_ht,
                          SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                          USE_PDL: tl.constexpr = False):
    """h[row, c] = clamped-SwiGLU of the up projection's K-chunks summed (gate at 2c, up at 2c + 1)."""
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < num_rows)[:, None] & (cols < inter)[None, :]
    gate = _sum_partials(part_ptr, stride_ps, stride_pr, rows, 2 * cols, mask, SPLIT)
    up = _sum_partials(part_ptr, stride_ps, stride_pr, rows, 2 * cols + 1, mask, SPLIT)
    h = _swiglu(gate, up, alpha, limit)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_ht + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


@triton.jit
def _scatter_finish_kernel(part_ptr, gates_ptr, order_ptr, y_ptr, num_rows, hidden, stride_ps, stride_pr, stride_yt,
                           SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                           USE_PDL: tl.constexpr = False):
    """y[pair] = gate * (the down projection's K-chunks summed), at each sorted row's own pair (un-permuting)."""
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols < hidden)[None, :]
    pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
    gate = tl.load(gates_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    y = _sum_partials(part_ptr, stride_ps, stride_pr, rows, cols, mask, SPLIT) * gate[:, None]
    tl.store(y_ptr + pair[:, None].to(tl.int64) * stride_yt + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


_LHS_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _packed(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of bytes with unit stride inside a row (a no-op for parameters, which are contiguous)."""
    if blocks.stride(-1) != 1 or blocks.stride(-2) != 16:
        blocks = blocks.contiguous()
    return blocks, scales if scales.stride(-1) == 1 else scales.contiguous()


def moe_mxfp4_triton(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, w1_blocks: torch.Tensor,
                     w1_scales: torch.Tensor, b1: torch.Tensor, w2_blocks: torch.Tensor, w2_scales: torch.Tensor,
                     b2: torch.Tensor, top_k: int, alpha: float, limit: float, *,
                     dot_scaled: bool | None = None, split_k: int | None = None, gemv: bool | None = None,
                     reduce: bool = True, routing: Routing | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H], or summands [T, k, H] with reduce=False (`peagle_kernels.moe`). `dot_scaled`: None picks
    `tl.dot_scaled` for bf16/fp16 activations (unless PEAGLE_MXFP4_DOT=unpack) and the explicit decode
    otherwise; True/False force one (tests). `split_k`: None takes the tiles' (`MoeTiles.split_k`), a number
    forces it. Both are the MMA kernels' knobs; the GEMVs ignore them. `gemv`: None lets the tiles choose
    (`MoeTiles.gemv_rows`: the GEMVs at decode and verify sizes, `triton_moe.use_gemv`); True/False force the
    CUDA-core GEMVs or the MMA kernels. `routing`: x's routing worked out already (`peagle_kernels.moe.Routing`)."""
    w1_shape, w2_shape = mxfp4_shape(w1_blocks, w1_scales, "w1"), mxfp4_shape(w2_blocks, w2_scales, "w2")
    check_moe_shapes(x, router_w, router_b, w1_shape, b1, w2_shape, b2, top_k, "w1_blocks", "w2_blocks")
    if dot_scaled is None:
        dot_scaled = x.dtype in _LHS_FORMATS and DOT_MODE != "unpack"
    elif dot_scaled and x.dtype not in _LHS_FORMATS:
        raise ValueError(f"moe_mxfp4: tl.dot_scaled takes bf16 or fp16 activations, got {x.dtype}")
    T, H = x.shape
    E, two_i, _ = w1_shape
    inter = two_i // 2
    if T == 0:
        return token_outputs(x.new_zeros(0, H), 0, top_k, reduce)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w1_blocks, w1_scales = _packed(w1_blocks, w1_scales)
    w2_blocks, w2_scales = _packed(w2_blocks, w2_scales)
    b1, b2 = b1.contiguous(), b2.contiguous()

    r = route_and_sort(x, router_w, router_b, top_k, mxfp4=True, routing=routing)
    if gemv is not None and gemv != bool(r.tiles.gemv_rows):
        forced = moe_tiles(T, top_k, mxfp4=True, gemv=gemv, num_experts=E)
        r = dataclasses.replace(r, tiles=forced, one_tile=T <= forced.block_m)
    rows = T * top_k
    h = torch.empty(rows, inter, device=x.device, dtype=x.dtype)  # expert-sorted rows
    y = torch.empty(rows, H, device=x.device, dtype=x.dtype)  # token-major rows: pair t*k + j
    if r.tiles.gemv_rows:
        _moe_gemv(x, w1_blocks, w1_scales, b1, w2_blocks, w2_scales, b2, h, y, r, top_k, alpha, limit)
        return token_outputs(y, T, top_k, reduce)

    tiles = r.tiles if split_k is None else dataclasses.replace(r.tiles, split_k=split_k)
    # BLOCK_K (64 or 128) is a power of two >= 32: whole MXFP4 blocks per K-step
    common = dict(BLOCK_K=tiles.block_k, DOT_SCALED=dot_scaled, **r.kernel_args(),
                  LHS_FMT=_LHS_FORMATS.get(x.dtype, "bf16"), DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_launch(x))
    split = tiles.split_k
    # K split over `split` programs (decode sizes): fp32 partial sums, K-chunks whole BLOCK_K steps
    part = torch.empty(split, rows, max(2 * inter, H), device=x.device, dtype=torch.float32) if split > 1 else y
    chunk = lambda k: triton.cdiv(triton.cdiv(k, tiles.block_k), split) * tiles.block_k  # noqa: E731

    _moe_mxfp4_up_kernel[(r.m_tiles, triton.cdiv(inter, tiles.up_n), split)](
        x, w1_blocks, w1_scales, b1, h, part, r.order, r.offsets, E, H, inter, float(alpha), float(limit), chunk(H),
        x.stride(0), w1_blocks.stride(0), w1_blocks.stride(1), w1_scales.stride(0), w1_scales.stride(1),
        b1.stride(0), h.stride(0), part.stride(0), part.stride(1), SPLIT=split, TOP_K=top_k, BLOCK_N=tiles.up_n,
        **common)
    if split > 1:
        _swiglu_finish(part, h, split, alpha, limit)
    _moe_mxfp4_down_kernel[(r.m_tiles, triton.cdiv(H, tiles.down_n), split)](
        h, w2_blocks, w2_scales, b2, r.gates, y, part, r.order, r.offsets, E, H, inter, chunk(inter),
        h.stride(0), w2_blocks.stride(0), w2_blocks.stride(1), w2_scales.stride(0), w2_scales.stride(1),
        b2.stride(0), y.stride(0), part.stride(0), part.stride(1), SPLIT=split, BLOCK_N=tiles.down_n, **common)
    if split > 1:
        _scatter_finish(part, r, y, split)
    return token_outputs(y, T, top_k, reduce)


def _finish_tiles(rows: int, split: int) -> dict:
    return dict(BLOCK_R=min(16, triton.next_power_of_2(rows)), BLOCK_C=128, SPLIT=split, num_warps=4)


def _swiglu_finish(part: torch.Tensor, h: torch.Tensor, split: int, alpha: float, limit: float) -> None:
    """h = clamped-SwiGLU of the up projection's `split` partial sums in part."""
    rows, inter = h.shape
    f = _finish_tiles(rows, split)
    _swiglu_finish_kernel[(triton.cdiv(rows, f["BLOCK_R"]), triton.cdiv(inter, f["BLOCK_C"]))](
        part, h, rows, inter, float(alpha), float(limit), part.stride(0), part.stride(1), h.stride(0), **f,
        **pdl_launch(h))


def _scatter_finish(part: torch.Tensor, r, y: torch.Tensor, split: int) -> None:
    """y[pair] = gate * the down projection's `split` partial sums in part, un-permuted."""
    rows, H = y.shape
    f = _finish_tiles(rows, split)
    _scatter_finish_kernel[(triton.cdiv(rows, f["BLOCK_R"]), triton.cdiv(H, f["BLOCK_C"]))](
        part, r.gates, r.order, y, rows, H, part.stride(0), part.stride(1), y.stride(0), **f, **pdl_launch(y))


def _gemv(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor, part: torch.Tensor, r,
          n_chunk: int, gather: bool, top_k: int) -> int:
    """part[s] = K-chunk s's fp32 partial products (`_mxfp4_gemv_kernel`); returns the number of chunks."""
    E, N, nb, _ = blocks.shape
    split = triton.cdiv(nb, 32)  # a K-chunk is 32 MXFP4 blocks, one a lane
    words = blocks.view(torch.int32)  # [E, N, K/32, 4]
    t = r.tiles
    _mxfp4_gemv_kernel[(r.order.shape[0], triton.cdiv(N, n_chunk), split)](
        x, words, scales, bias, part, r.order, r.offsets, E, N, nb * 32, n_chunk, x.stride(0), blocks.stride(0) // 16,
        blocks.stride(1) // 16, scales.stride(0), scales.stride(1), bias.stride(0), part.stride(0), part.stride(1),
        GATHER=gather, TOP_K=top_k, ROWS=t.gemv_rows, E_PAD=triton.next_power_of_2(E), F16=x.dtype in _LHS_FORMATS,
        PTX=GEMV_PTX and x.is_cuda and not interpret_mode(), num_warps=t.num_warps, num_stages=t.num_stages,
        **pdl_launch(x))
    return split


def _moe_gemv(x, w1_blocks, w1_scales, b1, w2_blocks, w2_scales, b2, h, y, r, top_k, alpha, limit) -> None:
    """Decode sizes: both projections as `_mxfp4_gemv_kernel`s, each finished by its split-K kernel."""
    rows, H = y.shape
    part = torch.empty(triton.cdiv(max(H, h.shape[1]), 32 * 32), rows, max(w1_blocks.shape[1], H), device=x.device,
                       dtype=torch.float32)
    _swiglu_finish(part, h, _gemv(x, w1_blocks, w1_scales, b1, part, r, r.tiles.up_n, True, top_k), alpha, limit)
    _scatter_finish(part, r, y, _gemv(h, w2_blocks, w2_scales, b2, part, r, r.tiles.down_n, False, top_k))


__all__ = ["moe_mxfp4_triton", "DOT_MODE"]
