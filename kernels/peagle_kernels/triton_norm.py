"""Triton fused residual add + RMSNorm; same signature and semantics as `peagle_kernels.norm.add_rms_norm_ref`.

One program per row holds the whole row in registers (BLOCK = next power of two >= H; 4096 at GPT-OSS's
2880), so x and the residual are read once and the new residual and the normed row written once: one
launch where PyTorch runs ten in bf16 (the add, x.float(), pow, mean, + eps, rsqrt, two products,
weight.float(), the cast back).

Summands x [..., S, H] (S a constexpr: the MoE's top_k, fixed per model) are loaded S rows at a time and
added in fp32 in order s = 0..S-1, then rounded to x's dtype once: what `x.sum(-2)` stores. PyTorch's CPU
sum adds in the same order for S <= 4 (fp32 bit-identical); for bf16/fp16 summands of similar magnitude the
fp32 sum is exact, so order is moot and the GPU result equals PyTorch's reduce bit for bit.

The sum is rounded to the residual's dtype before the norm reads it, as the reference reads the stored
`x + residual`, so the new residual is bit-identical to PyTorch's add. The norm itself differs from the
reference only by summation order (and the GPU's rsqrt): ~1e-7 relative in fp32, at most one rounding
step of the output in bf16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from peagle_kernels.dispatch import pdl_launch
from peagle_kernels.norm import is_summands


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, H, eps,
                         stride_x, stride_xs, stride_res, stride_out,
                         S: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    x_row = x_ptr + row * stride_x + cols
    x = tl.load(x_row, mask=inside, other=0.0).to(tl.float32)
    if S > 1:  # summands: fp32 sum in order, rounded once to x's dtype (what `x.sum(-2)` stores)
        for s in tl.static_range(1, S):
            x += tl.load(x_row + s * stride_xs, mask=inside, other=0.0).to(tl.float32)
        x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
    if HAS_RESIDUAL:  # (summands always come with one)
        x += tl.load(res_ptr + row * stride_res + cols, mask=inside, other=0.0).to(tl.float32)
        stored = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_out + cols, stored, mask=inside)
        x = stored.to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)  # padding lanes are 0: they add nothing
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * (x * r)).to(out_ptr.dtype.element_ty), mask=inside)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual) for x [..., H], or for summands x [..., S, H] with a residual (`peagle_kernels.norm`);
    a None residual returns x itself as the new residual."""
    H = x.shape[-1]
    if weight.shape != (H,):
        raise ValueError(f"weight must be [{H}], got {tuple(weight.shape)}")
    S = 1
    if is_summands(x, residual):
        S = x.shape[-2]
        if S == 1:  # a single summand is the row itself: the plain kernel
            x = x.select(-2, 0)
    elif residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    shape = x.shape if S == 1 else x.shape[:-2] + x.shape[-1:]
    dtype = x.dtype if residual is None else torch.result_type(x, residual)
    out = torch.empty(shape, dtype=dtype, device=x.device)
    new_residual = x if residual is None else torch.empty_like(out)
    rows = out.numel() // H if H else 0
    if rows == 0:
        return out, new_residual
    x2 = _rows(x, H) if S == 1 else _rows(x, S, H)
    res2 = _rows(residual, H) if residual is not None else x2  # unread without a residual
    block = triton.next_power_of_2(H)
    _add_rms_norm_kernel[(rows,)](x2, res2, weight.contiguous(), out, new_residual, H, float(eps),
                                  x2.stride(0), x2.stride(1) if S > 1 else 0, res2.stride(0), H,
                                  S=S, HAS_RESIDUAL=residual is not None, BLOCK=block,
                                  num_warps=min(max(block // 512, 1), 8), **pdl_launch(x2))
    return out, new_residual


def _rows(t: torch.Tensor, *inner: int) -> torch.Tensor:
    """t as [rows, *inner] with unit last stride (a view for the usual contiguous or row-sliced tensors)."""
    t = t.reshape(-1, *inner)
    return t if t.stride(-1) == 1 else t.contiguous()
