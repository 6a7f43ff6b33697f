"""y = x @ W^T + b, the attention projections' linear: a Triton skinny GEMM at decode sizes, cuBLAS otherwise.

At a bs-1 decode step the q/k/v and o projections are GEMVs bound by reading their weights. cuBLAS runs GPT-OSS's
o projection (K 4096 > N 2880) as a split-K GEMM plus a separate reduce kernel; the Triton kernel
(`peagle_kernels.triton_linear`) streams each weight once, in one launch, up to `SKINNY_MAX_TOKENS` rows. Measured on an
H200 (`benchmarks/skinny_linear.py`, docs/benchmarks/kernels.md), back to back in a CUDA graph, weights
never in L2: 20B o 9.8 against cuBLAS's 11.5 us, the tiny target's projections 2.4 against 3.1 us, but 20B q/k/v
(N 5120 > K 2880) 11.0 against 10.1 us. `takes_skinny` is that finding; larger batches are compute-shaped and
stay with cuBLAS. (The attention layers' own q/k/v at decode sizes take neither: `peagle_kernels.rope.qkv_rope_write_kv`
runs the skinny loop with the rotation and the KV write fused, which saves more than the 1 us it loses.)
Same signature and result as `linear_ref` (`F.linear`), up to fp32 summation order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from peagle_kernels.dispatch import needs_grad, use_triton

SKINNY_MAX_TOKENS = 16  # one 16-row M-tile: every weight tile is read once
SMALL_WEIGHT_ELEMS = 1 << 21  # 4 MB of bf16: a latency-bound GEMV, where one light launch beats cuBLAS's


def takes_skinny(n: int, k: int) -> bool:
    """Whether a [n, k] weight runs faster in the skinny kernel than in cuBLAS at decode sizes (module docstring):
    a reduction at least as long as the output, which cuBLAS splits over two kernels, or a small weight."""
    return k >= n or n * k <= SMALL_WEIGHT_ELEMS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] with weight [N, K] and bias [N] (or None)."""
    if (x.dim() == 2 and 0 < x.shape[0] <= SKINNY_MAX_TOKENS and takes_skinny(*weight.shape) and use_triton(x)
            and not needs_grad(x, weight, bias)):
        from peagle_kernels.triton_linear import linear_triton
        return linear_triton(x, weight, bias)
    return linear_ref(x, weight, bias)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)
