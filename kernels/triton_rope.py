"""Triton NeoX rotary embedding of q and k in one launch; same signature and semantics as
`kernels.rope.apply_rope_ref`.

Grid (T, 2): program (t, 0) rotates every head of q[t], program (t, 1) every head of k[t], sharing one
load of cos/sin[t]. PyTorch runs seven kernels per tensor (four products, a difference, a sum, the
concatenation), fourteen for q and k.

Bit-identical to the reference in fp32, bf16 and fp16: values are widened to fp32 and each product and
sum is rounded to x's dtype, as PyTorch's elementwise ops round them (a product of two bf16/fp16 numbers
is exact in fp32, so rounding it once gives PyTorch's product). FMA contraction is switched off at
launch, so the compiled kernel rounds a * b before subtracting c * d, as the separate PyTorch ops do.
(Triton's CPU interpreter truncates fp32 to bf16 instead of rounding to nearest: there bf16 is only close.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rounded(v, dtype: tl.constexpr):
    return v.to(dtype).to(tl.float32)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, H, HALF, stride_h, stride_d, cos, sin,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotates the H heads of one token: x at x_ptr (strided), out at out_ptr (contiguous [H, 2*HALF])."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    inside = (h < H) & (d < HALF)
    src = x_ptr + h * stride_h + d * stride_d
    x1 = tl.load(src, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF * stride_d, mask=inside, other=0.0).to(tl.float32)
    dt: tl.constexpr = out_ptr.dtype.element_ty
    o1 = _rounded(x1 * cos, dt) - _rounded(x2 * sin, dt)
    o2 = _rounded(x2 * cos, dt) + _rounded(x1 * sin, dt)
    dst = out_ptr + h * (2 * HALF) + d
    tl.store(dst, o1.to(dt), mask=inside)
    tl.store(dst + HALF, o2.to(dt), mask=inside)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out, k_out, Hq, Hkv, HALF,
                 sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sc_t, sc_d, ss_t, ss_d,
                 BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + t * sc_t + d * sc_d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * ss_t + d * ss_d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    if tl.program_id(1) == 0:
        _rotate_heads(q_ptr + t * sq_t, q_out + t * Hq * 2 * HALF, Hq, HALF, sq_h, sq_d, cos, sin,
                      BLOCK_HQ, BLOCK_D)
    else:
        _rotate_heads(k_ptr + t * sk_t, k_out + t * Hkv * 2 * HALF, Hkv, HALF, sk_h, sk_d, cos, sin,
                      BLOCK_HKV, BLOCK_D)


def apply_rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_rot, k_rot), new contiguous tensors, for q [T, Hq, D], k [T, Hkv, D], cos/sin [T, 1, D/2]."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    half = D // 2
    if D % 2 or k.shape != (T, Hkv, D) or cos.shape != (T, 1, half) or sin.shape != cos.shape:
        raise ValueError(f"need q [T, Hq, D] (D even), k [T, Hkv, D], cos/sin [T, 1, D/2]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if not q.dtype == k.dtype == cos.dtype == sin.dtype:
        raise ValueError(f"q, k, cos and sin must share a dtype, got {q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype}")
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    if q_out.numel() == 0 and k_out.numel() == 0:
        return q_out, k_out
    _rope_kernel[(T, 2)](q, k, cos, sin, q_out, k_out, Hq, Hkv, half,
                         *q.stride(), *k.stride(), cos.stride(0), cos.stride(2), sin.stride(0), sin.stride(2),
                         BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_HKV=triton.next_power_of_2(Hkv),
                         BLOCK_D=triton.next_power_of_2(half), enable_fp_fusion=False)
    return q_out, k_out
