"""Triton decode-sized linear equals `torch.nn.functional.linear` (the reference), and the dispatcher
sends only small, gradient-free batches to it.

CPU: Triton's interpreter, fp32 (atol = rtol = 1e-5 on outputs of magnitude ~1).
GPU (skipped here): compiled kernel in bf16 against the fp32 reference, and a CUDA-graph replay.
"""
from __future__ import annotations

import pytest
import torch

from kernel_utils import assert_graph_replays_exactly, triton_cuda, triton_interpret  # noqa: F401  (fixtures)
from kernels.dispatch import use_triton
from kernels.linear import linear, linear_ref


def make(M: int, N: int, K: int, bias: bool, seed: int = 0, device: str = "cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("M,N,K,bias", [(1, 64, 32, True), (3, 40, 200, True), (16, 17, 129, False),
                                        (7, 300, 64, True), (1, 1, 1, False)])
def test_linear_matches_reference(triton_interpret, M, N, K, bias):
    x, w, b = make(M, N, K, bias, seed=M * N)
    assert use_triton(x)
    out = triton_interpret.linear.linear_triton(x, w, b)
    torch.testing.assert_close(out, linear_ref(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(linear(x, w, b), out, atol=0, rtol=0)  # the dispatcher takes the kernel


def test_linear_strided_input(triton_interpret):
    x, w, b = make(4, 48, 96, True)
    wide = torch.randn(4, 200)
    wide[:, 10:106] = x
    xs = wide[:, 10:106]  # row stride 200, unit column stride
    torch.testing.assert_close(triton_interpret.linear.linear_triton(xs, w, b), linear_ref(x, w, b),
                               atol=1e-5, rtol=1e-5)


def test_dispatch_keeps_large_batches_and_autograd_on_the_reference(triton_interpret, monkeypatch):
    calls = []
    monkeypatch.setattr(triton_interpret.linear, "linear_triton", lambda *a: calls.append(a) or linear_ref(*a))
    x, w, b = make(17, 8, 16, True)
    linear(x, w, b)  # 17 rows: cuBLAS territory
    wg = w.clone().requires_grad_()
    y = linear(x[:2], wg, b)  # a weight that wants gradients: the kernel has no backward
    y.sum().backward()
    assert not calls and wg.grad is not None
    linear(x[:2], w, b)
    assert len(calls) == 1


def test_linear_rejects_bad_shapes(triton_interpret):
    x, w, b = make(2, 8, 16, True)
    with pytest.raises(ValueError, match="weight"):
        triton_interpret.linear.linear_triton(x, w[:, :8], b)
    with pytest.raises(ValueError, match="bias"):
        triton_interpret.linear.linear_triton(x, w, b[:4])
    with pytest.raises(ValueError, match="16 rows"):
        triton_interpret.linear.linear_triton(torch.randn(17, 16), w, b)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 4096, 2880), (8, 512, 2880), (16, 2880, 4096), (2, 201088, 2880)])
def test_linear_cuda_bf16(triton_cuda, M, N, K):
    x, w, b = make(M, N, K, True, device="cuda", dtype=torch.bfloat16)
    ref = linear_ref(x.float(), w.float(), b.float())
    out = linear(x, w, b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert_graph_replays_exactly(lambda: linear(x, w, b), x)
