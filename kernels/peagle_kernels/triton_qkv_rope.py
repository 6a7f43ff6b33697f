"""Triton q/k/v projection, rotary embedding and paged KV write in one launch, at decode sizes; same signature and
semantics as `peagle_kernels.rope.qkv_rope_write_kv_ref`.

At a bs-1 decode step each attention layer ran the q/k/v GEMV (cuBLAS), then `_rope_kernel` (rotation and the KV
store): two launches, a gap between them, and a 2.2 us kernel that only moves a few KB. Here each program computes
16 of the projection's columns with the skinny GEMM's loop (`peagle_kernels.triton_linear.skinny_tile`): PIECE = 8 dims
of one head's first half and the 8 dims HALF further on, the pairs the NeoX rotation mixes. So the rotation
happens in registers, right after the bias: q's programs store the rotated q, k's store the rotated k and its
cache entry, v's store the cache entry only. Measured on an H200 (docs/benchmarks/kernels.md, 20B shape, bs 1):
264 us a step against 242 (cuBLAS) + 53 (rope), the decode graph 2.227 ms against 2.260, the step 80 us shorter.

The projection is rounded to x's dtype before the rotation reads it, as `F.linear` stores it; the rotation then
rounds every product and sum as PyTorch's ops do, with FMA contraction off at launch (`peagle_kernels.triton_rope`
explains why that is bit-identical there). Against the reference the result differs only by the order of the
GEMM's fp32 sums (`peagle_kernels.triton_linear`), which can move a projected value by one rounding step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from peagle_kernels.dispatch import pdl_launch
from peagle_kernels.rope import QKV_ROPE_PIECE as PIECE  # dims of a head's half a program rotates
from peagle_kernels.triton_linear import SHIPPED_TILES, skinny_tile
from peagle_kernels.triton_rope import check_write_kv, rounded


@triton.jit
def _qkv_rope_kernel(x_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, q_out, k_out, k_cache_ptr, v_cache_ptr, slot_ptr,
                     M, K, Hq, Hkv, stride_xm, stride_wn, sc_t, sc_d, ss_t, ss_d,
                     skc_b, skc_s, skc_h, svc_b, svc_s, svc_h,
                     HALF: tl.constexpr, PIECE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr, PAGE: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    pieces: tl.constexpr = HALF // PIECE
    head = tl.program_id(0) // pieces  # q heads, then k heads, then v heads, as the packed weight's rows
    j = (tl.program_id(0) % pieces) * PIECE
    c = tl.arange(0, 2 * PIECE)
    cols = head * (2 * HALF) + j + c % PIECE + (c // PIECE) * HALF  # dims j.. of the first half, then j + HALF..
    acc = skinny_tile(x_ptr, w_ptr, cols, cols >= 0, M, K, stride_xm, stride_wn, BLOCK_M, BLOCK_K, EVEN_K, DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    dt: tl.constexpr = q_out.dtype.element_ty
    y = acc.to(dt).to(tl.float32)  # the projection as F.linear stores it
    x1, x2 = tl.split(tl.permute(tl.reshape(y, [BLOCK_M, 2, PIECE]), (0, 2, 1)))  # [BLOCK_M, PIECE] each

    rows = tl.arange(0, BLOCK_M)
    row_ok = (rows < M)[:, None]
    d = (j + tl.arange(0, PIECE))[None, :]
    t = rows.to(tl.int64)[:, None]
    if head < Hq + Hkv:
        cos = tl.load(cos_ptr + t * sc_t + d * sc_d, mask=row_ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * ss_t + d * ss_d, mask=row_ok, other=0.0).to(tl.float32)
        o1 = (rounded(x1 * cos, dt) - rounded(x2 * sin, dt)).to(dt)
        o2 = (rounded(x2 * cos, dt) + rounded(x1 * sin, dt)).to(dt)
    else:  # v: no rotation
        o1, o2 = x1.to(dt), x2.to(dt)
    if head < Hq:
        dst = q_out + (t * Hq + head) * (2 * HALF) + d
        tl.store(dst, o1, mask=row_ok)
        tl.store(dst + HALF, o2, mask=row_ok)
    else:
        kv_head = head - Hq
        is_k = kv_head < Hkv
        if is_k:
            dst = k_out + (t * Hkv + kv_head) * (2 * HALF) + d
            tl.store(dst, o1, mask=row_ok)
            tl.store(dst + HALF, o2, mask=row_ok)
        else:
            kv_head -= Hkv
        slot = tl.load(slot_ptr + rows, mask=rows < M, other=-1).to(tl.int64)[:, None]
        ok = row_ok & (slot >= 0)  # -1: padding / rejected token, nothing to store
        page, row = slot // PAGE, slot % PAGE
        if is_k:
            dst = k_cache_ptr + page * skc_b + row * skc_s + kv_head * skc_h + d
            tl.store(dst, o1.to(k_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + HALF, o2.to(k_cache_ptr.dtype.element_ty), mask=ok)
        else:
            dst = v_cache_ptr + page * svc_b + row * svc_s + kv_head * svc_h + d
            tl.store(dst, o1.to(v_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + HALF, o2.to(v_cache_ptr.dtype.element_ty), mask=ok)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


def qkv_rope_write_kv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                             num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    T, K = x.shape
    D = k_cache.shape[-1]
    half = D // 2
    n = (num_heads + 2 * num_kv_heads) * D
    if weight.shape != (n, K) or weight.stride(-1) != 1 or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"qkv_rope_write_kv: x {tuple(x.shape)} needs a packed weight [{n}, {K}] (contiguous rows) "
                         f"and bias [{n}], got {tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}")
    if cos.shape != (T, 1, half) or sin.shape != cos.shape or not x.dtype == weight.dtype == cos.dtype == sin.dtype:
        raise ValueError(f"qkv_rope_write_kv: cos/sin must be [{T}, 1, {half}] in x's dtype {x.dtype}, got "
                         f"{tuple(cos.shape)} {cos.dtype} and {tuple(sin.shape)} {sin.dtype} (weight {weight.dtype})")
    q_out = x.new_empty(T, num_heads, D)
    k_out = x.new_empty(T, num_kv_heads, D)
    check_write_kv(k_out, k_out, k_cache, v_cache, slot_mapping)
    if T == 0:
        return q_out, k_out
    x = x if x.stride(-1) == 1 else x.contiguous()
    t = SHIPPED_TILES
    _qkv_rope_kernel[((num_heads + 2 * num_kv_heads) * (half // PIECE),)](
        x, weight, bias if bias is not None else weight, cos, sin, q_out, k_out, k_cache, v_cache, slot_mapping,
        T, K, num_heads, num_kv_heads, x.stride(0), weight.stride(0), cos.stride(0), cos.stride(2),
        sin.stride(0), sin.stride(2), *k_cache.stride()[:3], *v_cache.stride()[:3],
        HALF=half, PIECE=PIECE, HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_K=t.block_k, EVEN_K=K % t.block_k == 0,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", PAGE=k_cache.shape[1],
        num_warps=t.num_warps, num_stages=t.num_stages, enable_fp_fusion=False, **pdl_launch(x))
    return q_out, k_out


__all__ = ["qkv_rope_write_kv_triton"]
