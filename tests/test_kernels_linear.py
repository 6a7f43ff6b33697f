"""The Triton skinny GEMM equals `F.linear` (its reference), and the attention layers take it at decode sizes.

Tolerance, elementwise: |got - want| <= rtol * |want| + atol * (|x| @ |W|^T), the second term bounding what a
different order of the fp32 sums may move (scaled by the sums' own magnitude, so it is tight for every entry).
  fp32 (interpreter): rtol 0, atol 1e-6;
  bf16 (GPU, compiled, against cuBLAS): rtol 2^-7 (one rounding step of the output), atol 2^-12.
The interpreter's bf16 `tl.dot` is wrong (tests/test_kernels_compile.py), so bf16 is tested compiled only.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_utils import assert_graph_replays_exactly, pdl, triton_cuda, triton_interpret  # noqa: F401  (fixtures)
from peagle_kernels.dispatch import use_triton
from peagle_kernels.linear import SKINNY_MAX_TOKENS, linear, linear_ref, takes_skinny

TOL = {torch.float32: (0.0, 1e-6), torch.bfloat16: (2 ** -7, 2 ** -12)}


def _inputs(M: int, N: int, K: int, bias: bool, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed * 7919 + M * 131 + N + K)
    x = torch.randn(M, K, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(device=device, dtype=dtype)
    b = torch.randn(N, generator=g).to(device=device, dtype=dtype) if bias else None
    return x, w, b


def assert_linear_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    want = linear_ref(x, w, b)
    assert got.shape == want.shape and got.dtype == want.dtype
    rtol, atol = TOL[x.dtype]
    scale = x.float().abs() @ w.float().abs().T + (b.float().abs() if b is not None else 0)
    err = (got.float() - want.float()).abs()
    bound = rtol * want.float().abs() + atol * scale
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3g} at {err.argmax().item()}"


SHAPES = [  # (N, K): tile multiples, ragged N, a K that is no multiple of BLOCK_K, the tiny target's projections
    pytest.param(64, 256, id="even"), pytest.param(100, 300, id="ragged-N-K"), pytest.param(384, 256, id="tiny-qkv"),
    pytest.param(24, 40, id="small")]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("M", [1, 5, SKINNY_MAX_TOKENS])
def test_skinny_linear_matches_reference(triton_interpret, M, N, K, bias):
    x, w, b = _inputs(M, N, K, bias, torch.float32)
    assert use_triton(x)
    assert_linear_close(linear(x, w, b), x, w, b)


@pytest.mark.parametrize("block_n,block_k", [(32, 64), (16, 128), (64, 512)])
def test_other_launch_shapes_give_the_same_result(triton_interpret, block_n, block_k):
    from peagle_kernels.triton_linear import LinearTiles, linear_triton
    x, w, b = _inputs(3, 100, 300, True, torch.float32)
    assert_linear_close(linear_triton(x, w, b, LinearTiles(block_n, block_k, 4, 2)), x, w, b)


def test_strided_rows_and_the_limits(triton_interpret):
    from peagle_kernels.triton_linear import linear_triton
    x, w, b = _inputs(4, 48, 64, True, torch.float32)
    wide = torch.cat([x, torch.ones(4, 16)], 1)[:, :64]  # rows with a stride, unit last stride
    assert_linear_close(linear(wide, w, b), x, w, b)
    with pytest.raises(ValueError, match="at most 16 rows"):
        linear_triton(torch.zeros(SKINNY_MAX_TOKENS + 1, 64), w, b)
    with pytest.raises(ValueError, match="do not match"):
        linear_triton(x, w[:, :32], b)


def test_the_skinny_kernel_takes_the_shapes_where_it_beat_cublas():
    assert takes_skinny(2880, 4096)      # GPT-OSS o: cuBLAS splits K over two kernels
    assert takes_skinny(384, 256) and takes_skinny(256, 256)  # the tiny target: small, latency-bound weights
    assert not takes_skinny(5120, 2880)  # GPT-OSS q/k/v: cuBLAS was faster


def test_dispatch_takes_the_reference_outside_decode_sizes(triton_interpret, monkeypatch):
    """More than 16 rows, no rows, autograd, or a wide weight where cuBLAS wins: `F.linear`, and the kernel is
    never launched."""
    import peagle_kernels.triton_linear as tlin

    def fail(*a, **kw):
        raise AssertionError("the skinny kernel ran")
    monkeypatch.setattr(tlin, "linear_triton", fail)
    x, w, b = _inputs(SKINNY_MAX_TOKENS + 1, 48, 64, True, torch.float32)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), atol=0, rtol=0)
    assert linear(x[:0], w, b).shape == (0, 48)
    wide = torch.zeros(4096, 1024)
    assert linear(x[:1, :1].expand(1, 1024), wide).shape == (1, 4096)
    wg = w.clone().requires_grad_()
    out = linear(x[:2], wg, b)
    out.sum().backward()
    assert wg.grad is not None
    with pytest.raises(AssertionError, match="skinny kernel ran"):
        linear(x[:2], w, b)  # the decode case does reach it


def test_attention_projections_take_the_skinny_kernels_at_decode_sizes(triton_interpret, monkeypatch):
    """The paged attention path runs q/k/v through the one launch that also rotates and stores K/V
    (`peagle_kernels.triton_qkv_rope`) and o through `peagle_kernels.linear` at <= 16 tokens (2 launches a layer), and the
    prefill-sized step through cuBLAS and the rope kernel; the model's outputs are checked against the references by
    the models-with-Triton tests (test_kernels_norm_rope.py, test_kernels_routing.py)."""
    import peagle_kernels.triton_linear as tlin
    import peagle_kernels.triton_qkv_rope as tqkv
    from peagle_core.engine.model_runner import ModelRunner
    from peagle_core.loading.checkpoint import init_random_
    from peagle_core.models.gpt_oss import GptOss
    from peagle_core.models.layers import ForwardMeta
    from peagle_core.testing import tiny_target_config

    cfg = tiny_target_config()
    model = GptOss(cfg).eval()
    init_random_(model, seed=0)
    runner = ModelRunner(model, None, "none", 0, 16, 8, 64, torch.device("cpu"), torch.float32, cfg.vocab_size)
    calls = []
    real, real_qkv = tlin.linear_triton, tqkv.qkv_rope_write_kv_triton
    monkeypatch.setattr(tlin, "linear_triton", lambda *a, **kw: calls.append(("o", a[0].shape[0])) or real(*a, **kw))
    monkeypatch.setattr(tqkv, "qkv_rope_write_kv_triton",
                        lambda *a, **kw: calls.append(("qkv", a[0].shape[0])) or real_qkv(*a, **kw))
    for T in (3, SKINNY_MAX_TOKENS + 4):
        calls.clear()
        meta = ForwardMeta(positions=torch.arange(T), query_start_loc=torch.tensor([0, T]),
                           seq_lens=torch.tensor([T]), slot_mapping=torch.arange(T),
                           block_tables=torch.arange(4)[None])
        with torch.inference_mode():
            runner.target(torch.arange(T) % cfg.vocab_size, meta)
        assert calls == ([("qkv", T), ("o", T)] * cfg.num_hidden_layers if T <= SKINNY_MAX_TOKENS else [])


# ---------------------------------------------------------------------------------------------
# GPU: compiled at the GPT-OSS-20B attention projections (hidden 2880, 64 q heads and 8 kv heads of 64)
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(5120, 2880), (2880, 4096)], ids=["qkv", "o"])
@pytest.mark.parametrize("M", [1, 8, SKINNY_MAX_TOKENS])
def test_compiled_skinny_linear_bf16_matches_cublas(triton_cuda, pdl, M, N, K):
    """The kernel itself at both shapes (the engine's dispatch sends q/k/v to cuBLAS, `takes_skinny`)."""
    from peagle_kernels.triton_linear import linear_triton
    x, w, b = _inputs(M, N, K, True, torch.bfloat16, device="cuda")
    assert_linear_close(linear_triton(x, w, b), x, w, b)
    assert_graph_replays_exactly(lambda: linear_triton(x, w, b), x)
