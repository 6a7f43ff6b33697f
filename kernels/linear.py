"""Linear layers at decode sizes: `linear(x, weight, bias)` = `torch.nn.functional.linear` (x [..., K], weight
[N, K], bias [N] or None -> [..., N] in x's dtype, fp32 accumulation).

On CUDA a skinny call (`skinny`: at most SKINNY_MAX_M rows, N and K up to SKINNY_MAX_N / SKINNY_MAX_K, one
floating dtype, the weight's rows contiguous) runs `kernels.triton_linear`: one launch that reads the weight
once, bias fused, no separate split-K reduce. Everything else, and every CPU tensor, takes the reference,
which is `torch.nn.functional.linear` itself (so CPU results are PyTorch's, bit for bit), as do calls that
autograd records (the kernel has no backward).

The range is a plain M/N/K rule; `benchmarks/linear.py` times the kernel against cuBLAS at the model's shapes
and M = 1..16 and prints where each is faster: where cuBLAS wins, narrow the rule here. The LM head
(N = 201088) and the MoE experts never call this.
"""
from __future__ import annotations

import torch

from kernels.dispatch import needs_grad, use_triton

SKINNY_MAX_M = 16       # rows the kernel holds at once (M_PAD): decode and verify sizes
SKINNY_MAX_N = 16384    # attention projections (5120, 2880) and the drafter's fc; not the vocabulary
SKINNY_MAX_K = 16384
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(x) and not needs_grad(x, weight, bias) and skinny(x, weight, bias):
        from kernels.triton_linear import linear_triton
        return linear_triton(x, weight, bias)
    return linear_ref(x, weight, bias)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the Triton kernel covers this call: x [..., K] with 1..SKINNY_MAX_M rows, weight [N, K] with
    N <= SKINNY_MAX_N, K <= SKINNY_MAX_K and rows contiguous along K (a sharded view is fine), bias [N] or
    None, all of one dtype (bf16, fp16 or fp32) on x's device. Anything else (including shapes that do not
    match, which the reference then reports) takes the reference."""
    if x.dim() < 1 or weight.dim() != 2 or x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return False
    N, K = weight.shape
    if x.shape[-1] != K or not (1 <= N <= SKINNY_MAX_N and 1 <= K <= SKINNY_MAX_K) or weight.stride(1) != 1:
        return False
    if not 1 <= x.numel() // K <= SKINNY_MAX_M or weight.device != x.device:
        return False
    return bias is None or (tuple(bias.shape) == (N,) and bias.dtype == x.dtype and bias.device == x.device)
