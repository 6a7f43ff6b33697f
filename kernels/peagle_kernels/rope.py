"""NeoX half-split rotary embedding of q and k together.

q [T, Hq, D] and k [T, Hkv, D] are rotated with cos/sin [T, 1, D/2] (in q's dtype, already scaled):
`cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])` with x1, x2 the two halves of the last dimension,
every product and sum rounded to x's dtype as PyTorch rounds them. Returns new tensors.

`rope_write_kv` also stores the rotated k and v in the paged KV cache (`peagle_kernels.attention.write_kv_ref`): on
the GPU one launch instead of two per attention layer of the paged (engine) path. `qkv_rope_write_kv` starts one
step earlier, from the attention's input and its packed q/k/v weight: at decode sizes on the GPU the projection,
the rotation and the cache write are one launch (`peagle_kernels.triton_qkv_rope`).
"""
from __future__ import annotations

import torch

from peagle_kernels.attention import write_kv_ref
from peagle_kernels.dispatch import needs_grad, use_triton
from peagle_kernels.linear import SKINNY_MAX_TOKENS, linear, linear_ref

# Dims of a head's half one program of the fused q/k/v kernel rotates (with their partners, 16 columns: one tl.dot
# tile): it covers heads whose half is a whole number of them (GPT-OSS's 64 and the tiny pair's 32 dims).
QKV_ROPE_PIECE = 8


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q) and not needs_grad(q, k, cos, sin):
        from peagle_kernels.triton_rope import apply_rope_triton
        return apply_rope_triton(q, k, cos, sin)
    return apply_rope_ref(q, k, cos, sin)


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    return rotate(q, cos, sin), rotate(k, cos, sin)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_rot, k_rot) as `apply_rope`, with k_rot and v [T, Hkv, D] stored in k_cache/v_cache
    [num_blocks, block_size, Hkv, D] at flat slots `slot_mapping` [T] as `peagle_kernels.attention.write_kv_ref` stores them (-1: nothing)."""
    if use_triton(q) and not needs_grad(q, k, cos, sin):
        from peagle_kernels.triton_rope import rope_write_kv_triton
        return rope_write_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return rope_write_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def rope_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    q_rot, k_rot = apply_rope_ref(q, k, cos, sin)
    write_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot, k_rot


def qkv_rope_write_kv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                      num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_rot [T, Hq, D], k_rot [T, Hkv, D]) of x [T, H] through the packed q/k/v weight [(Hq + 2 Hkv) D, H] (and
    bias), rotated as `apply_rope`, with k_rot and v stored in the paged caches as `rope_write_kv` stores them.
    One launch at decode sizes on the GPU; elsewhere `linear` then `rope_write_kv`, each dispatched as usual."""
    D = k_cache.shape[-1]
    if (use_triton(x) and x.dim() == 2 and 0 < x.shape[0] <= SKINNY_MAX_TOKENS and D % (2 * QKV_ROPE_PIECE) == 0
            and not needs_grad(x, weight, bias, cos, sin)):
        from peagle_kernels.triton_qkv_rope import qkv_rope_write_kv_triton
        return qkv_rope_write_kv_triton(x, weight, bias, num_heads, num_kv_heads, cos, sin, k_cache, v_cache,
                                        slot_mapping)
    q, k, v = _heads(linear(x, weight, bias), num_heads, num_kv_heads, D)
    return rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def qkv_rope_write_kv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                          num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = _heads(linear_ref(x, weight, bias), num_heads, num_kv_heads, k_cache.shape[-1])
    return rope_write_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def _heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, D: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed projection [T, (Hq + 2 Hkv) D] as q [T, Hq, D], k and v [T, Hkv, D] (views)."""
    T = qkv.shape[0]
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], -1)
    return q.view(T, num_heads, D), k.view(T, num_kv_heads, D), v.view(T, num_kv_heads, D)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
