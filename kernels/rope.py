"""NeoX half-split rotary embedding of q and k together.

q [T, Hq, D] and k [T, Hkv, D] are rotated with cos/sin [T, 1, D/2] (in q's dtype, already scaled):
`cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])` with x1, x2 the two halves of the last dimension,
every product and sum rounded to x's dtype as PyTorch rounds them. Returns new tensors.

`rope_write_kv` also stores the rotated k and v in the paged KV cache (`kernels.attention.write_kv_ref`): on
the GPU one launch instead of two per attention layer of the paged (engine) path.
"""
from __future__ import annotations

import torch

from kernels.attention import write_kv_ref
from kernels.dispatch import needs_grad, use_triton


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q) and not needs_grad(q, k, cos, sin):
        from kernels.triton_rope import apply_rope_triton
        return apply_rope_triton(q, k, cos, sin)
    return apply_rope_ref(q, k, cos, sin)


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    return rotate(q, cos, sin), rotate(k, cos, sin)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_rot, k_rot) as `apply_rope`, with k_rot and v [T, Hkv, D] stored in k_cache/v_cache
    [num_blocks, block_size, Hkv, D] at flat slots `slot_mapping` [T] as `kernels.attention.write_kv_ref` stores them (-1: nothing)."""
    if use_triton(q) and not needs_grad(q, k, cos, sin):
        from kernels.triton_rope import rope_write_kv_triton
        return rope_write_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return rope_write_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def rope_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    q_rot, k_rot = apply_rope_ref(q, k, cos, sin)
    write_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot, k_rot


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
