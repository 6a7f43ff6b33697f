"""Triton NeoX rotary embedding of q and k in one launch, optionally storing the rotated k and v in the paged
KV cache in the same launch; same signatures and semantics as `peagle_kernels.rope.apply_rope_ref` and
`peagle_kernels.rope.rope_write_kv_ref`.

Grid (T, 2): program (t, 0) rotates every head of q[t], program (t, 1) every head of k[t], sharing one
load of cos/sin[t]. PyTorch runs seven kernels per tensor (four products, a difference, a sum, the
concatenation), fourteen for q and k. With WRITE_KV, program (t, 1) also stores its rotated k[t] and a copy
of v[t] at cache slot `slot_mapping[t]` (-1: nothing), saving what was a separate KV-write launch (and its launch
gap) per attention layer; the q programs are the same code as without it.

Bit-identical to the reference in fp32, bf16 and fp16: values are widened to fp32 and each product and
sum is rounded to x's dtype, as PyTorch's elementwise ops round them (a product of two bf16/fp16 numbers
is exact in fp32, so rounding it once gives PyTorch's product). FMA contraction is switched off at
launch, so the compiled kernel rounds a * b before subtracting c * d, as the separate PyTorch ops do.
(Triton's CPU interpreter truncates fp32 to bf16 instead of rounding to nearest: there bf16 is only close.)
The cached k is the returned k_rot, from the same registers, converted to the cache's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from peagle_kernels.dispatch import pdl_launch


@triton.jit
def rounded(v, dtype: tl.constexpr):
    return v.to(dtype).to(tl.float32)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, H, HALF, stride_h, stride_d, cos, sin,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotates the H heads of one token: x at x_ptr (strided), out at out_ptr (contiguous [H, 2*HALF]).
    Returns the two stored halves [BLOCK_H, BLOCK_D], in out's dtype, for the KV cache store."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    inside = (h < H) & (d < HALF)
    src = x_ptr + h * stride_h + d * stride_d
    x1 = tl.load(src, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF * stride_d, mask=inside, other=0.0).to(tl.float32)
    dt: tl.constexpr = out_ptr.dtype.element_ty
    o1 = (rounded(x1 * cos, dt) - rounded(x2 * sin, dt)).to(dt)
    o2 = (rounded(x2 * cos, dt) + rounded(x1 * sin, dt)).to(dt)
    dst = out_ptr + h * (2 * HALF) + d
    tl.store(dst, o1, mask=inside)
    tl.store(dst + HALF, o2, mask=inside)
    return o1, o2


@triton.jit
def _store_kv_token(k1, k2, v_ptr, k_cache_ptr, v_cache_ptr, slot, H, HALF, sv_h, sv_d,
                    skc_b, skc_s, skc_h, svc_b, svc_s, svc_h,
                    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Stores one token's rotated k (halves k1, k2) and its v (strided at v_ptr) at flat cache slot `slot`
    (`page * PAGE + row`; caches contiguous in head_dim), both converted to their cache's dtype."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    inside = (h < H) & (d < HALF)
    page, row = slot // PAGE, slot % PAGE
    kc = k_cache_ptr + page * skc_b + row * skc_s + h * skc_h + d
    tl.store(kc, k1.to(k_cache_ptr.dtype.element_ty), mask=inside)
    tl.store(kc + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=inside)
    src = v_ptr + h * sv_h + d * sv_d
    vc = v_cache_ptr + page * svc_b + row * svc_s + h * svc_h + d
    tl.store(vc, tl.load(src, mask=inside).to(v_cache_ptr.dtype.element_ty), mask=inside)
    tl.store(vc + HALF, tl.load(src + HALF * sv_d, mask=inside).to(v_cache_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out, k_out, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                 Hq, Hkv, HALF,
                 sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sc_t, sc_d, ss_t, ss_d,
                 sv_t, sv_h, sv_d, skc_b, skc_s, skc_h, svc_b, svc_s, svc_h,
                 BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr,
                 PAGE: tl.constexpr, WRITE_KV: tl.constexpr, USE_PDL: tl.constexpr = False):
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + t * sc_t + d * sc_d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * ss_t + d * ss_d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    if tl.program_id(1) == 0:
        _rotate_heads(q_ptr + t * sq_t, q_out + t * Hq * 2 * HALF, Hq, HALF, sq_h, sq_d, cos, sin,
                      BLOCK_HQ, BLOCK_D)
    else:
        k1, k2 = _rotate_heads(k_ptr + t * sk_t, k_out + t * Hkv * 2 * HALF, Hkv, HALF, sk_h, sk_d, cos, sin,
                               BLOCK_HKV, BLOCK_D)
        if WRITE_KV:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            if slot >= 0:  # -1: padding / rejected token, nothing to store
                _store_kv_token(k1, k2, v_ptr + t * sv_t, k_cache_ptr, v_cache_ptr, slot, Hkv, HALF, sv_h, sv_d,
                                skc_b, skc_s, skc_h, svc_b, svc_s, svc_h, PAGE, BLOCK_HKV, BLOCK_D)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


def check_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """The shapes the paged KV write needs."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"rope_write_kv: k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"rope_write_kv: caches must be [num_blocks, block_size, {k.shape[1]}, {k.shape[2]}], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"rope_write_kv: slot_mapping must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("rope_write_kv: caches must be contiguous in head_dim")


def apply_rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_rot, k_rot), new contiguous tensors, for q [T, Hq, D], k [T, Hkv, D], cos/sin [T, 1, D/2]."""
    return _launch(q, k, cos, sin, None)


def rope_write_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope_triton`, and in the same launch k_rot and v [T, Hkv, D] stored in the paged caches
    [num_blocks, block_size, Hkv, D] at flat slots `slot_mapping` [T] (slot < 0 writes nothing)."""
    check_write_kv(k, v, k_cache, v_cache, slot_mapping)
    return _launch(q, k, cos, sin, (v, k_cache, v_cache, slot_mapping))


def _launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One `_rope_kernel` launch; kv = (v, k_cache, v_cache, slot_mapping) also writes the cache."""
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
    cache_args, page = _cache_args(kv, k_out)
    _rope_kernel[(T, 2)](q, k, cos, sin, q_out, k_out, *cache_args[:4], Hq, Hkv, half,
                         *q.stride(), *k.stride(), cos.stride(0), cos.stride(2), sin.stride(0), sin.stride(2),
                         *cache_args[4:],
                         BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_HKV=triton.next_power_of_2(Hkv),
                         BLOCK_D=triton.next_power_of_2(half), PAGE=page, WRITE_KV=kv is not None,
                         enable_fp_fusion=False, **pdl_launch(q))
    return q_out, k_out


def _cache_args(kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None, placeholder: torch.Tensor
                ) -> tuple[tuple, int]:
    """The kernel's (v, k_cache, v_cache, slots, v and cache strides) arguments and its PAGE (block_size).
    Without a cache write the kernel never reads them: any tensor and zero strides stand in."""
    if kv is None:
        return (placeholder,) * 4 + (0,) * 9, 1
    v, k_cache, v_cache, slot_mapping = kv
    return (v, k_cache, v_cache, slot_mapping, *v.stride(), *k_cache.stride()[:3], *v_cache.stride()[:3]), \
        k_cache.shape[1]
