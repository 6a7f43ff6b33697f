"""RMSNorm with the residual add fused in front of it (vLLM's `fused_add_rms_norm`).

`add_rms_norm(x, residual, weight, eps) -> (normed, new_residual)`:
    new_residual = x if residual is None else x + residual       (rounded as PyTorch's `x + residual`)
    normed       = weight * new_residual / sqrt(mean(new_residual^2) + eps)
computed in fp32 and cast to new_residual's dtype. A decoder then carries (h, residual) from layer to layer
and every residual add rides along with the norm that follows it, instead of running as its own kernels.

Summands: x may also be `[..., S, H]` with residual `[..., H]` (one dimension fewer), S partial rows whose
sum is the row: then x stands for `x.sum(-2)` (fp32 accumulation, rounded to x's dtype once, as PyTorch
sums a bf16 tensor) and the outputs are `[..., H]`. This is how the MoE hands over its top-k weighted
expert outputs (`moe(..., reduce=False)`): the k-sum rides along with the norm after it too, one launch
fewer a layer (the separate PyTorch reduce it replaces cost 4.3 us a layer at batch size 1 on an H200,
GPT-OSS-20B: k = 4 rows of 2880, plus its launch gap in the CUDA graph).
The form is read from the shapes: summands always come with a residual (the MoE's output never opens the
stream), and a 3-D x alone stays rows to normalise.
"""
from __future__ import annotations

import torch

from peagle_kernels.dispatch import needs_grad, use_triton


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x) and not needs_grad(x, residual, weight):
        from peagle_kernels.triton_norm import add_rms_norm_triton
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    if is_summands(x, residual):
        x = x[..., 0, :] if x.shape[-2] == 1 else x.sum(-2)  # one summand: the value itself, no copy
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype), x


def is_summands(x: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether x is `[..., S, H]` summands (see the module docstring): x has one dimension more than the
    residual. ValueError for a summand form that cannot be one."""
    if residual is None or x.dim() != residual.dim() + 1:
        return False
    if x.shape[-2] < 1:
        raise ValueError(f"add_rms_norm: summands must be [..., S >= 1, H], got {tuple(x.shape)}")
    if residual.shape != x.shape[:-2] + x.shape[-1:]:
        raise ValueError(f"add_rms_norm: summands {tuple(x.shape)} need a residual of shape "
                         f"{tuple(x.shape[:-2] + x.shape[-1:])}, got {tuple(residual.shape)}")
    return True
