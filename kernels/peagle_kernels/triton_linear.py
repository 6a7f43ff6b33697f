"""Triton skinny GEMM: y = x @ W^T + b for at most 16 rows of x; same signature as `peagle_kernels.linear.linear_ref`.

One 16-row M-tile covers every row, so each program streams its BLOCK_N rows of W from memory exactly once
over the whole K (no split-K, no second reduce kernel) while x's rows stay in L1/L2. N is cut small so that
enough programs share the weight's read (GPT-OSS-20B's o projection: 180). The bias is
added in fp32 before the one rounding, as cuBLAS's epilogue does, so the result differs from `F.linear` only
by the order of the fp32 sums.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from peagle_kernels.dispatch import pdl_launch
from peagle_kernels.linear import SKINNY_MAX_TOKENS


@triton.jit
def skinny_tile(x_ptr, w_ptr, cols, col_ok, M, K, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """fp32 [BLOCK_M, len(cols)] = x[:M] @ W[cols]^T over the whole K (rows past M are zeros): each of W's rows
    `cols` streamed once, K contiguous. Shared by the plain GEMM below and `peagle_kernels.triton_qkv_rope`."""
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None] * stride_xm
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_wn  # W^T tile [BLOCK_K, n]: K contiguous
    acc = tl.zeros([BLOCK_M, cols.shape[0]], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None], other=0.0)
            w = tl.load(w_cols + (k0 + ks)[:, None], mask=col_ok[None, :], other=0.0)
        else:
            k_ok = k0 + ks < K
            a = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_cols + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
                          USE_PDL: tl.constexpr = False):
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = skinny_tile(x_ptr, w_ptr, cols, col_ok, M, K, stride_xm, stride_wn, BLOCK_M, BLOCK_K, EVEN_K, DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & col_ok[None, :])
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


@dataclass(frozen=True)
class LinearTiles:
    """Launch shape of `_skinny_linear_kernel` (M is always one 16-row tile)."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# 16 output columns a program (the most programs per weight byte; 512-byte runs of each row per K step) and two
# warps: fastest of the H200 sweep's launch shapes at every shape and M (`benchmarks/skinny_linear.py`; 20B o
# 9.8 us against 13.0 with four warps).
SHIPPED_TILES = LinearTiles(16, 256, 2, 4)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tiles: LinearTiles | None = None) -> torch.Tensor:
    """x [M, K] (M <= SKINNY_MAX_TOKENS) -> [M, N]; `tiles` overrides the launch shape (benchmarks)."""
    M, K = x.shape
    N = weight.shape[0]
    if M > SKINNY_MAX_TOKENS:
        raise ValueError(f"linear_triton: at most {SKINNY_MAX_TOKENS} rows, got {M}")
    if weight.shape[1] != K or (bias is not None and bias.shape != (N,)):
        raise ValueError(f"linear_triton: x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not match")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return y
    t = tiles or SHIPPED_TILES
    _skinny_linear_kernel[(triton.cdiv(N, t.block_n),)](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=t.block_n, BLOCK_K=t.block_k, EVEN_K=K % t.block_k == 0,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=t.num_warps, num_stages=t.num_stages, **pdl_launch(x))
    return y


__all__ = ["linear_triton", "SHIPPED_TILES", "LinearTiles"]
