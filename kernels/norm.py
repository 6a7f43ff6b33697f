"""RMSNorm with the residual add fused in front of it (vLLM's `fused_add_rms_norm`).

`add_rms_norm(x, residual, weight, eps) -> (normed, new_residual)`:
    new_residual = x if residual is None else x + residual       (rounded as PyTorch's `x + residual`)
    normed       = weight * new_residual / sqrt(mean(new_residual^2) + eps)
computed in fp32 and cast to new_residual's dtype. A decoder then carries (h, residual) from layer to layer
and every residual add rides along with the norm that follows it, instead of running as its own kernels.
"""
from __future__ import annotations

import torch

from kernels.dispatch import needs_grad, use_triton


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x) and not needs_grad(x, residual, weight):
        from kernels.triton_norm import add_rms_norm_triton
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype), x
