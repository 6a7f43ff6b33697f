"""Linear layers at decode sizes: y = x @ w^T + b for a handful of rows.

At bs 1 a GPT-OSS-20B step spends ~1 ms in cuBLAS on its q/k/v/o projections, about 2x what their bytes
need: for a few rows cuBLAS picks split-K GEMMs plus a separate reduce kernel (two launches, a round trip
through memory). `kernels.triton_linear` reads the weight once, spread over many programs that each own
a slice of output channels and loop over all of K: one launch, no split. Larger M (prefill, wide verify
batches) stays with cuBLAS, which is compute-efficient there.
"""
from __future__ import annotations

import torch

from kernels.dispatch import needs_grad, use_triton

SMALL_M = 16  # rows up to which the Triton kernel runs (one tensor-core tile of rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, like `torch.nn.functional.linear`."""
    if x.dim() == 2 and 0 < x.shape[0] <= SMALL_M and use_triton(x) and not needs_grad(x, weight, bias):
        from kernels.triton_linear import linear_triton
        return linear_triton(x, weight, bias)
    return linear_ref(x, weight, bias)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)
