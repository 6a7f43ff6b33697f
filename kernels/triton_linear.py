"""Triton linear for a few rows (decode-sized M): same signature and semantics as `kernels.linear.linear_ref`.

Bandwidth-bound, so the design is about reading the weight [N, K] once at full speed: program p owns
output channels [p * BLOCK_N, (p+1) * BLOCK_N) for all M rows (padded to one 16-row tensor-core tile)
and streams its weight rows over K in BLOCK_K chunks, accumulating in fp32; the bias is added to the
fp32 sum and the result rounded once. BLOCK_N is small enough that the grid covers every SM about
twice (e.g. 4096 channels -> 256 programs of 16).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_PREC: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None] * stride_xm
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        a = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N]; M <= 16. `tiles` (BLOCK_N, BLOCK_K, warps, stages)
    overrides the default choice (benchmarks/linear_tiles.py sweeps them)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    M, K = x.shape
    N = weight.shape[0]
    if M > 16:
        raise ValueError(f"linear_triton serves at most 16 rows, got {M}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"linear: bias must be [{N}], got {tuple(bias.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return y
    if tiles is None:
        sms = _num_sms(x.device.index or 0) if x.is_cuda else 132
        tiles = (32 if triton.cdiv(N, 32) >= 2 * sms else 16, 128, 4, 4)
    block_n, block_k, warps, stages = tiles
    _linear_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else y, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)
    return y
