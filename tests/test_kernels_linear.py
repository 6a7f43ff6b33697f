"""The Triton skinny GEMM (`kernels.triton_linear`) equals `torch.nn.functional.linear` (`kernels.linear.linear_ref`).

CPU: Triton's interpreter, fp32 (and bf16 on exact values).
  Exact inputs (multiples of 1/4 within +-3/4, bias multiples of 1/4): every partial sum is exact in fp32, so
        the result equals the reference bit for bit whatever the summation order, slices and tiles.
  Gaussian inputs (weights scaled 1/sqrt(K), outputs O(1)): fp32 sums of the same products in another order:
        within 1e-5 absolute + 1e-5 relative (errors are ~1e-6 at K <= 1000).
  bf16 on a grid (x, w in {-1, 0, 1} and {-1, 0, 1}/16, bias a multiple of 1/16, |out| <= 16): every value
        exact in bf16, so bit for bit although the interpreter truncates where a GPU rounds.
GPU (skipped here): compiled, bf16 at GPT-OSS shapes (qkv 2880 -> 5120, o 4096 -> 2880, their TP=2 shards, the
drafter's fc): the kernel rounds its fp32 sum once, so it is within half a bf16 step (2^-8 relative) + 1e-4
(fp32 and tensor-core summation noise on O(1) outputs, K <= 8640) of the exact fp64 value; against cuBLAS (which also rounds an fp32 sum,
in another order) within one step, 2^-7 relative, or 2^-7 absolute (a step at |out| = 1: near cancellation, in
case cuBLAS rounds before adding the bias); fp32 exact inputs bit for bit; 200 back-to-back launches and
50 CUDA-graph replays give the same bits each time (the finishing program's counter is reset).
"""
from __future__ import annotations

import pytest
import torch

from kernel_utils import assert_graph_replays_exactly, triton_cuda, triton_interpret  # noqa: F401  (fixtures)
from kernels.dispatch import use_triton
from kernels.linear import SKINNY_MAX_M, linear, linear_ref, skinny


def exact_inputs(M: int, N: int, K: int, bias: bool, seed: int, dtype=torch.float32, device="cpu"):
    """Products are multiples of 1/16 and |sums| <= 9K/16: exact in fp32 for any K here."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (M, K), generator=g) / 4
    w = torch.randint(-3, 4, (N, K), generator=g) / 4
    b = torch.randint(-8, 9, (N,), generator=g) / 4 if bias else None
    return tuple(t if t is None else t.to(device, dtype) for t in (x, w, b))


def grid_inputs(M: int, N: int, K: int, bias: bool, seed: int):
    """bf16 values whose every partial sum and output is exact in bf16 (K <= 128: |x @ w^T| <= 8, |bias| <= 8)."""
    assert K <= 128
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (M, K), generator=g).float()
    w = torch.randint(-1, 2, (N, K), generator=g) / 16
    b = torch.randint(-128, 129, (N,), generator=g) / 16 if bias else None
    return tuple(t if t is None else t.bfloat16() for t in (x, w, b))


def gaussian_inputs(M: int, N: int, K: int, bias: bool, seed: int, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * K ** -0.5
    b = torch.randn(N, generator=g) if bias else None
    return tuple(t if t is None else t.to(device, dtype) for t in (x, w, b))


# (N, K): ragged against BLOCK_N = 64 and BLOCK_K = 64 (fp32), several K slices, or one small tile
SHAPES = [pytest.param(100, 300, id="N100-K300"), pytest.param(130, 700, id="N130-K700-11-slices"),
          pytest.param(17, 40, id="N17-K40-one-tile"), pytest.param(64, 64, id="N64-K64")]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("M", [1, 3, 8, 16])
def test_linear_exact_inputs(triton_interpret, M, N, K, bias):
    x, w, b = exact_inputs(M, N, K, bias, seed=M * 1000 + N + K)
    assert use_triton(x) and skinny(x, w, b)
    got = linear(x, w, b)  # through the dispatcher
    assert got.dtype == x.dtype and got.shape == (M, N)
    assert torch.equal(got, linear_ref(x, w, b))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("M", [1, 3, 8, 16])
def test_linear_gaussian_inputs(triton_interpret, M, N, K, bias):
    x, w, b = gaussian_inputs(M, N, K, bias, seed=M + N + K)
    torch.testing.assert_close(linear(x, w, b), linear_ref(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("M,N,K", [(1, 40, 128), (5, 70, 100), (16, 130, 96)])
def test_linear_bf16_grid_interpreted(triton_interpret, M, N, K):
    """bf16 through the interpreter's fp32 widening of the tl.dot operands (see `linear_triton`): exact."""
    x, w, b = grid_inputs(M, N, K, bias=True, seed=M)
    got = linear(x, w, b)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, linear_ref(x, w, b))
    assert torch.equal(got.float(), linear_ref(x.float(), w.float(), b.float()))


@pytest.mark.parametrize("block_n,block_k,splits,slice_len", [
    (16, 16, 1, 304),    # one slice over all of K, 16-wide blocks
    (32, 32, 4, 96),     # three full slices and a short last one (K = 300)
    (64, 64, 5, 64),     # one chunk a slice, the last ragged
    (16, 128, 3, 128),   # a tile wider than the last slice's remainder
])
def test_forced_plans(triton_interpret, block_n, block_k, splits, slice_len):
    """Any plan (tile sizes, slice counts, short last slices) gives the same bits on exact inputs."""
    lin = triton_interpret.linear
    x, w, b = exact_inputs(7, 90, 300, True, seed=block_n + splits)
    p = lin.Plan(block_n=block_n, block_k=block_k, splits=splits, slice_len=slice_len)
    assert (splits - 1) * slice_len < 300 <= splits * slice_len  # every slice non-empty
    assert torch.equal(lin.linear_triton(x, w, b, plan_=p), linear_ref(x, w, b))


def test_plan_heuristic(triton_interpret):
    """GPT-OSS bf16 plans (module docstring), and for every shape: slices non-empty and covering K, within
    MAX_SPLITS, partials at most 1/8 of the weight, a deterministic function of (M, N, K, element size)."""
    lin = triton_interpret.linear
    assert SKINNY_MAX_M == lin.M_PAD  # the dispatcher's row limit is what one program holds
    assert lin.plan(1, 5120, 2880, 2) == lin.Plan(block_n=64, block_k=128, splits=4, slice_len=768)
    assert lin.plan(1, 2880, 4096, 2) == lin.Plan(block_n=64, block_k=128, splits=8, slice_len=512)
    assert lin.plan(16, 2880, 4096, 2) == lin.plan(1, 2880, 4096, 2)
    for M in (1, 2, 8, 16):
        for N, K in [(5120, 2880), (2880, 4096), (2560, 2880), (2880, 2048), (2880, 8640), (384, 256), (17, 40)]:
            for elem in (2, 4):
                p = lin.plan(M, N, K, elem)
                assert p == lin.plan.__wrapped__(M, N, K, elem)
                assert 1 <= p.splits <= lin.MAX_SPLITS and p.slice_len % p.block_k == 0
                assert (p.splits - 1) * p.slice_len < K <= p.splits * p.slice_len
                assert p.splits == 1 or p.splits * M * N * 4 <= N * K * elem // lin.PARTIAL_FRACTION
                assert -(-N // p.block_n) * p.splits <= max(lin.TARGET_PROGRAMS, -(-N // p.block_n))


def test_repeated_calls_reset_the_counters(triton_interpret):
    """The finishing program of each N block resets its counter: a second call on the same shape (another
    shape's launch between) gives the same bits, and the counters are 0 after every launch."""
    lin = triton_interpret.linear
    x, w, b = gaussian_inputs(3, 130, 700, True, seed=1)
    first = linear(x, w, b)
    p = lin.plan(3, 130, 700, 4)
    assert p.splits > 1
    _, counters = lin._WORKSPACES[(x.device, 130, p)]
    assert counters.tolist() == [0, 0, 0]
    linear(*gaussian_inputs(5, 100, 300, False, seed=2))  # another grid
    again = linear(x, w, b)
    assert counters.tolist() == [0, 0, 0]
    assert torch.equal(first, again)
    torch.testing.assert_close(again, linear_ref(x, w, b), atol=1e-5, rtol=1e-5)


def test_leading_dims_strided_x_and_sharded_weight(triton_interpret):
    """x [..., K] and x [K] as F.linear takes them; x rows sliced from a wider tensor; a weight that is a column
    slice of a wider one (tensor parallelism's o_proj shard: rows contiguous, row stride > K)."""
    x, w, b = exact_inputs(6, 50, 80, True, seed=3)
    assert torch.equal(linear(x.view(2, 3, 80), w, b), linear_ref(x, w, b).view(2, 3, 50))
    assert torch.equal(linear(x[0], w, b), linear_ref(x[0], w, b))
    wide_x = exact_inputs(6, 1, 200, False, seed=4)[0]
    assert torch.equal(linear(wide_x[:, 40:120], w, b), linear_ref(wide_x[:, 40:120], w, b))
    full_w = exact_inputs(1, 50, 240, False, seed=5)[1]
    shard = full_w.narrow(1, 80, 80)
    assert shard.stride() == (240, 1) and skinny(x, shard, b)
    assert torch.equal(linear(x, shard, b), linear_ref(x, shard, b))


def test_dispatch_range(triton_interpret, monkeypatch):
    """The kernel runs inside the skinny range only; everything else takes the reference (F.linear)."""
    calls = []
    lin = triton_interpret.linear
    launch = lin.linear_triton
    monkeypatch.setattr(lin, "linear_triton", lambda *a: calls.append(a[0].shape) or launch(*a))
    x, w, b = exact_inputs(SKINNY_MAX_M + 1, 40, 32, True, seed=6)
    assert torch.equal(linear(x[:SKINNY_MAX_M], w, b), linear_ref(x[:SKINNY_MAX_M], w, b))
    assert len(calls) == 1
    outside = [
        (x, w, b),                                   # 17 rows
        (x[:0], w, b),                               # no rows
        (x[:4], w.t().contiguous().t(), b),          # weight columns contiguous, not rows
        (x[:4], w.double(), b),                      # dtypes differ
        (x[:4], w, b.double()),
        (x[:4].long(), w.long(), None),              # not a floating dtype
        (x[:4], torch.zeros(20000, 32), None),       # N past SKINNY_MAX_N (an LM head)
    ]
    for args in outside:
        assert not skinny(*args)
        if args[0].dtype == torch.float32 and args[1].dtype == torch.float32 and (args[2] is None or
                                                                                  args[2].dtype == torch.float32):
            assert torch.equal(linear(*args), linear_ref(*args))
    assert len(calls) == 1
    with pytest.raises(RuntimeError):  # shapes that do not match: the reference's own error
        linear(x[:4], w[:, :16], b)
    w.requires_grad_(True)  # autograd records: the reference (the kernel has no backward)
    out = linear(x[:4], w, b)
    assert out.grad_fn is not None and len(calls) == 1
    with torch.no_grad():
        assert linear(x[:4], w, b).grad_fn is None
    assert len(calls) == 2


def test_cpu_without_triton_is_pytorch_bit_for_bit():
    """Unforced, CPU tensors take `torch.nn.functional.linear` itself: the engine's CPU results are unchanged."""
    x, w, b = gaussian_inputs(4, 96, 200, True, seed=7)
    assert not use_triton(x)
    assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))


def test_models_route_projections_through_linear(monkeypatch):
    """Attention's packed qkv and o projections and the drafter's fc call `kernels.linear.linear` (CPU: the
    reference, so the results are those of the modules); the LM head and the MoE do not."""
    import peagle_core.models.drafter as drafter_mod
    import peagle_core.models.layers as layers_mod
    from peagle_core.loading.checkpoint import init_random_
    from peagle_core.models.drafter import Drafter
    from peagle_core.models.gpt_oss import GptOss
    from peagle_core.models.layers import ForwardMeta, pack_qkv
    from peagle_core.testing import tiny_drafter_config, tiny_target_config

    calls = []
    spy = lambda x, w, b=None: calls.append((x.shape[0], *w.shape)) or linear(x, w, b)  # noqa: E731
    monkeypatch.setattr(layers_mod, "linear", spy)
    monkeypatch.setattr(drafter_mod, "linear", spy)
    cfg = tiny_target_config()
    target = init_random_(GptOss(cfg), 0).eval()
    target.set_aux_layers([1, 2, 3])
    pack_qkv(target)
    drafter = init_random_(Drafter(tiny_drafter_config(cfg), 3), 1).eval()
    pack_qkv(drafter)
    ids = torch.randint(0, cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, aux = target(ids, ForwardMeta.for_sequences([5]))
        drafter(ids, drafter.combine(aux), ForwardMeta.for_sequences([5]))
    def projections(attn) -> list[tuple[int, ...]]:
        return [(5, *attn.qkv[0].shape), (5, *attn.o_proj.weight.shape)]

    want = [p for a in target.attention_layers() for p in projections(a)]
    want += [(5, *drafter.fc.weight.shape)] + [p for a in drafter.attention_layers() for p in projections(a)]
    assert calls == want


# ---------------------------------------------------------------------------------------------
# GPU: compiled, bf16 at GPT-OSS shapes (the 20B and 120B attention shapes are the same)
# ---------------------------------------------------------------------------------------------

GPU_SHAPES = [  # (M, N, K, bias)
    (1, 5120, 2880, True), (1, 2880, 4096, True),     # qkv and o at batch size 1
    (8, 5120, 2880, True), (8, 2880, 4096, True),     # verify sizes
    (16, 5120, 2880, True), (2, 2880, 4096, True),
    (3, 2560, 2880, True), (5, 2880, 2048, True),     # their TP=2 shards
    (4, 2880, 8640, False),                           # the drafter's fc
]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,bias", GPU_SHAPES)
def test_linear_bf16_cuda(triton_cuda, M, N, K, bias):
    x, w, b = gaussian_inputs(M, N, K, bias, seed=M + N, dtype=torch.bfloat16, device="cuda")
    assert skinny(x, w, b)
    got = linear(x, w, b)
    torch.testing.assert_close(got, linear_ref(x, w, b), rtol=2 ** -7, atol=2 ** -7)  # cuBLAS: a bf16 step
    exact = linear_ref(x.double(), w.double(), None if b is None else b.double())
    assert ((got.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-4).all()  # rounded once


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 5120, 2880), (8, 2880, 4096), (16, 384, 256)])
def test_linear_fp32_exact_cuda(triton_cuda, M, N, K):
    """fp32 exact inputs (sums exact): the kernel's fp32 path (no TF32) equals cuBLAS bit for bit."""
    x, w, b = exact_inputs(M, N, K, True, seed=M, device="cuda")
    assert torch.equal(linear(x, w, b), linear_ref(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 5120, 2880), (1, 2880, 4096), (8, 2880, 4096)])
def test_linear_repeats_cuda(triton_cuda, M, N, K):
    """200 back-to-back launches on two alternating inputs: the finishing programs see every partial each time
    (a stale read of the other input's partials in the shared scratch would change bits); counters end at 0."""
    lin = triton_cuda.linear
    inputs = [gaussian_inputs(M, N, K, True, seed=i, dtype=torch.bfloat16, device="cuda") for i in range(2)]
    firsts = [linear(*xwb) for xwb in inputs]
    runs = [linear(*inputs[i % 2]) for i in range(200)]
    for i, run in enumerate(runs):
        assert torch.equal(run, firsts[i % 2])
    p = lin.plan(M, N, K, 2)
    assert p.splits > 1
    assert not lin._WORKSPACES[(inputs[0][0].device, N, p)][1].any()


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 5120, 2880), (8, 2880, 4096)])
def test_linear_cuda_graph(triton_cuda, M, N, K):
    """Captured once (after an eager warm-up), replayed 50 times: the same bits every time, equal to eager calls;
    new values written into x change the replay as they change an eager call."""
    x, w, b = gaussian_inputs(M, N, K, True, seed=M, dtype=torch.bfloat16, device="cuda")
    eager = linear(x, w, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x, w, b)
    for _ in range(50):
        out.zero_()
        graph.replay()
        assert torch.equal(out, eager)
    assert_graph_replays_exactly(lambda: linear(x, w, b), x)
