"""Triton skinny GEMM: `out = x @ weight^T + bias` for x [M <= 16, K]; same semantics as `kernels.linear.linear_ref`
(`torch.nn.functional.linear`): fp32 accumulation, one rounding to x's dtype, bias added before it.

Why: at decode sizes a linear layer only streams its weight, and cuBLAS leaves bandwidth behind there. On an
H200, GPT-OSS-20B at batch size 1 (docs/benchmarks/profile.md): the qkv projection (2880 -> 5120, bias) ran at
2.9 TB/s (66% of the 4.36 TB/s measured peak read), the o projection (4096 -> 2880, bias) at 2.1 TB/s: a split-K
GEMM plus a second `splitKreduce_kernel` launch, 24 layers each.

Grid (N blocks, K splits): program (j, s) computes the fp32 partial product of output channels
[j*BLOCK_N, (j+1)*BLOCK_N) over K slice s for every row of x:
    acc [BLOCK_N, M_PAD] = W[block j, slice s] @ x[:, slice s]^T
with `tl.dot`, the weight as its left operand. The MMA's wide side is then the weight's BLOCK_N rows and its
16-wide side the tokens (M padded to M_PAD = 16 with masked zeros): the tensor cores' spare work at M = 1
costs nothing in a kernel bound by reading the weight, and Triton's software pipeline keeps NUM_STAGES weight
tiles [BLOCK_N, BLOCK_K] in flight per program, each row of a tile contiguous along K (256 bytes: wide,
coalesced loads). x is tiny and read from L2 by every N block.

Combining the slices, in the same launch (no reduce kernel): with one slice the program adds the bias, rounds
and stores. With several, each program stores its fp32 partial to a scratch buffer [splits, M, N], then counts
itself done on its N block's int32 counter (`tl.atomic_add`, acq_rel, after a barrier so that every thread's
stores precede the release; the pattern of `kernels.triton_routing`). The program that arrives last resets the
counter to 0 (so the next launch, CUDA-graph replays included, counts from 0 again), adds the partials in
slice order 0..splits-1 (deterministic: the same inputs give the same bits whichever program finishes last),
adds the bias and rounds once to x's dtype. The partials make a small round trip through L2: splits*M*N*4
bytes, a few percent of the weight at GPT-OSS shapes (capped at 1/8 by `plan`).

The plan (BLOCK_N, BLOCK_K, splits) is a pure function of (M, N, K, element size), with no runtime autotuning
(the engine captures CUDA graphs and the result must not depend on timing). The counters and the scratch
buffer are cached per (device, N, plan): the first call of a shape allocates them and must run outside
CUDA-graph capture (the engine warms every graph up eagerly first); later calls, captured or not, allocate
nothing but the output. Like the routing counter, a workspace assumes that launches of one shape on a device
do not run concurrently on two streams (the engine runs its forwards on one stream).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.dispatch import interpret_mode

M_PAD = 16                # the tokens' side of the MMA (tl.dot pads smaller sizes to 16 anyway): M <= 16
BLOCK_N = 64              # output channels a program: the MMA's wide side (one Hopper warpgroup MMA is 64 rows)
TILE_ROW_BYTES = 256      # a weight tile row: two 128-byte lines (BLOCK_K = 128 in bf16, 64 in fp32)
# Programs a launch aims at: one wave of three per SM of an H200 (132 SMs). In bf16 a program holds NUM_STAGES
# tiles of 64 x 128 weights + 128 x 16 of x in shared memory (60 KB; 48 registers a thread, Triton 3.9 for
# sm_90), so three fit an SM's 227 KB, each with NUM_STAGES - 1 weight tiles in flight while it multiplies one.
# A constant, not the device's SM count: the plan must be a function of the shape alone.
TARGET_PROGRAMS = 3 * 132
MAX_SPLITS = 16           # the finishing program reads splits partials of [BLOCK_N, M]: keep that short
PARTIAL_FRACTION = 8      # partials (splits*M*N*4 bytes) at most 1/8 of the weight's bytes
NUM_STAGES = 3
NUM_WARPS = 4


@dataclass(frozen=True)
class Plan:
    """How a launch tiles the problem: BLOCK_N output channels and a K slice of `slice_len` (a multiple of
    BLOCK_K, the last slice shorter) a program; `splits` slices."""

    block_n: int
    block_k: int
    splits: int
    slice_len: int


@functools.lru_cache(maxsize=None)
def plan(M: int, N: int, K: int, elem_bytes: int) -> Plan:
    """The launch plan for x [M, K] and weight [N, K] of `elem_bytes`-byte elements (deterministic).

    N blocks of BLOCK_N; K cut into BLOCK_K chunks, grouped into as many slices as bring the grid up to about
    TARGET_PROGRAMS (one wave), at most MAX_SPLITS and one chunk a slice at least, and few enough that the fp32
    partials stay under 1/PARTIAL_FRACTION of the weight. GPT-OSS bf16: qkv 5120 x 2880 -> 80 blocks x 4
    slices of 768; o 2880 x 4096 -> 45 blocks x 8 slices of 512."""
    block_n = min(BLOCK_N, max(16, triton.next_power_of_2(N)))
    block_k = min(TILE_ROW_BYTES // elem_bytes, max(16, triton.next_power_of_2(K)))
    n_blocks, chunks = triton.cdiv(N, block_n), triton.cdiv(K, block_k)
    partial_cap = (K * elem_bytes) // (PARTIAL_FRACTION * 4 * M)  # splits*M*N*4 <= N*K*elem / PARTIAL_FRACTION
    splits = max(1, min(TARGET_PROGRAMS // n_blocks, MAX_SPLITS, chunks, partial_cap))
    per_slice = triton.cdiv(chunks, splits)
    return Plan(block_n, block_k, triton.cdiv(chunks, per_slice), per_slice * block_k)  # no empty slice


@triton.jit
def _slice_product(x_ptr, w_ptr, n, m, M, N, K, slice_len, stride_xm, stride_wn, DOT_PRECISION: tl.constexpr,
                   DOT_FP32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr):
    """acc [BLOCK_N, M_PAD] fp32: sum over this program's K slice of w[n, k] * x[m, k]; zeros where n >= N or
    m >= M."""
    k_start = tl.program_id(1) * slice_len
    k_end = tl.minimum(k_start + slice_len, K)
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]: tile rows contiguous along k
    x_cols = x_ptr + m.to(tl.int64)[None, :] * stride_xm  # [1, M_PAD]: x^T, the MMA's right operand
    n_ok, m_ok = n < N, m < M
    acc = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K):
        k = k0 + ks
        k_ok = k < k_end
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_cols + k[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        if DOT_FP32:  # (interpreter only: see `linear_triton`) the same products, exact in fp32
            w, xt = w.to(tl.float32), xt.to(tl.float32)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _store_output(acc, b_ptr, out_ptr, n, m, M, N, stride_om, HAS_BIAS: tl.constexpr):
    """out[m, n] = acc + bias, rounded once to out's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
    mask = (n < N)[:, None] & (m < M)[None, :]
    tl.store(out_ptr + m.to(tl.int64)[None, :] * stride_om + n[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M of a shape (no M == 1 variant)
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, partial_ptr, counter_ptr, M, N, K, slice_len,
                          stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, M_PAD: tl.constexpr):
    """Program (j, s): output block j's partial product over K slice s; one slice: the output itself; several:
    the last of block j's SPLITS programs to finish adds the partials (see the module docstring)."""
    block = tl.program_id(0)
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_PAD)
    acc = _slice_product(x_ptr, w_ptr, n, m, M, N, K, slice_len, stride_xm, stride_wn, DOT_PRECISION, DOT_FP32,
                         BLOCK_N, BLOCK_K, M_PAD)
    if SPLITS == 1:
        _store_output(acc, b_ptr, out_ptr, n, m, M, N, stride_om, HAS_BIAS)
    else:
        mask = (n < N)[:, None] & (m < M)[None, :]
        rows = m[None, :] * N + n[:, None]  # partial[s, m, n] at s*M*N + rows
        tl.store(partial_ptr + tl.program_id(1) * M * N + rows, acc, mask=mask)
        # Every thread's stores precede the barrier, the barrier precedes the release (one thread's atomic):
        # the program that acquires the final count sees all SPLITS partials of its block.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + block, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            tl.store(counter_ptr + block, 0)  # the next launch counts from 0 (the kernel boundary orders it)
            total = tl.zeros([BLOCK_N, M_PAD], tl.float32)
            for s in tl.static_range(SPLITS):  # in slice order: deterministic
                # .cg: from L2 (other SMs wrote them; this SM's L1 may hold lines from an earlier launch)
                total += tl.load(partial_ptr + s * M * N + rows, mask=mask, other=0.0, cache_modifier=".cg")
            _store_output(total, b_ptr, out_ptr, n, m, M, N, stride_om, HAS_BIAS)


# (device, N, plan) -> (fp32 partials [splits * M_PAD * N], int32 arrival counters [N blocks], zero between
# launches). Sized for M_PAD rows, so every M of a shape shares one.
_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, N: int, p: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, N, p)
    ws = _WORKSPACES.get(key)
    if ws is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Zeroed inside a capture, the counters would hold garbage for eager calls (the graph's memset
            # runs only on replay). The engine warms every graph up eagerly before capturing it.
            raise RuntimeError(f"linear: the first Triton call at N={N} with {p} on {device} must run outside "
                               "CUDA-graph capture (warm up first)")
        partial = torch.empty(p.splits * M_PAD * N, device=device, dtype=torch.float32)
        counters = torch.zeros(triton.cdiv(N, p.block_n), device=device, dtype=torch.int32)
        ws = _WORKSPACES[key] = (partial, counters)
    return ws


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  plan_: Plan | None = None) -> torch.Tensor:
    """x [..., K] (at most M_PAD rows) @ weight [N, K]^T + bias [N] -> [..., N] in x's dtype. `plan_`
    overrides `plan` (tests, benchmarks). The weight's rows must be contiguous along K."""
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if not 1 <= M <= M_PAD or tuple(weight.shape) != (N, K) or weight.stride(-1) != 1:
        raise ValueError(f"linear_triton: needs x [1..{M_PAD} rows, K] and weight [N, K] contiguous along K, got "
                         f"x {tuple(x.shape)}, weight {tuple(weight.shape)} with strides {weight.stride()}")
    if bias is not None:
        bias = bias.contiguous()
    p = plan_ or plan(M, N, K, x.element_size())
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    partial, counters = _workspace(x.device, N, p) if p.splits > 1 else (out, out)  # unread with one slice
    # Triton's interpreter (3.9) multiplies bf16 tl.dot operands as their raw uint16 bits: there the tiles are
    # widened to fp32 first, which gives the same products (exact in fp32) and the same fp32 accumulation.
    dot_fp32 = x.dtype == torch.bfloat16 and interpret_mode()
    _skinny_linear_kernel[(triton.cdiv(N, p.block_n), p.splits)](
        x2, weight, bias if bias is not None else out, out, partial, counters, M, N, K, p.slice_len,
        x2.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, SPLITS=p.splits,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or dot_fp32 else "tf32",  # fp32 as PyTorch: no TF32
        DOT_FP32=dot_fp32,
        BLOCK_N=p.block_n, BLOCK_K=p.block_k, M_PAD=M_PAD, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out.view(*x.shape[:-1], N)


__all__ = ["linear_triton", "plan", "Plan", "M_PAD"]
