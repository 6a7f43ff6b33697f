"""NeoX half-split rotary embedding of q and k together.

q [T, Hq, D] and k [T, Hkv, D] are rotated with cos/sin [T, 1, D/2] (in q's dtype, already scaled):
`cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])` with x1, x2 the two halves of the last dimension,
every product and sum rounded to x's dtype as PyTorch rounds them. Returns new tensors.
"""
from __future__ import annotations

import torch

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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
