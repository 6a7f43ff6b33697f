"""MoE over packed MXFP4 experts: the Triton kernels equal dequantise + reference, and the engine with
packed experts generates what it does with dequantised ones (TP=1 and TP=2); padded tensor-parallel shards
of packed experts (N = 1, 2, 4, 8, shares not whole blocks) sum to the dequantised layer.

CPU: Triton's interpreter. fp32 activations take the explicit FP4 decode + `tl.dot` (ieee), checked at
atol = rtol = 1e-4 (outputs of magnitude ~1-30; the decode itself is checked bit-exact). bf16/fp16
activations take `tl.dot_scaled`, checked against an fp32 oracle of the same routing at 3e-2 of the
output's scale (bf16 inputs, h and y). The interpreter cannot run a bf16 `tl.dot` (it multiplies the raw
16-bit patterns), so the explicit decode is only checked with fp32 activations here.
GPU (skipped here): the compiled kernels at the GPT-OSS layer shape, both expansions, and graph capture.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from kernel_utils import assert_graph_replays_exactly, pdl, triton_cuda, triton_interpret  # noqa: F401  (fixtures)
from peagle_kernels.dispatch import use_triton
from peagle_kernels.moe import moe_mxfp4, moe_mxfp4_ref, moe_ref, route, swiglu
from peagle_core import LLM, SamplingParams
from peagle_core.config import GptOssConfig
from peagle_core.engine.tp import target_shard
from peagle_core.loading.checkpoint import SafetensorsDir, init_random_, keep_mxfp4, load_target, save_target
from peagle_core.loading.mxfp4 import FP4_VALUES, dequantize
from peagle_core.models.gpt_oss import GptOss
from peagle_core.testing import build_drafter, build_target, tiny_target_config

TOL = dict(atol=1e-4, rtol=1e-4)
ALPHA = 1.702
_MX = None  # test_fp4_decode_is_bit_exact's handle on the kernel module


def _mxfp4_module(kernels, interpret: bool):
    """peagle_kernels.triton_moe_mxfp4 in the fixture's mode, bound to its (possibly reloaded) peagle_kernels.triton_moe."""
    from triton.runtime.jit import JITFunction

    module = importlib.import_module("peagle_kernels.triton_moe_mxfp4")
    compiled = any(isinstance(v, JITFunction) for v in vars(module).values())
    if module._expert_rows is not kernels.moe._expert_rows or compiled == interpret:
        module = importlib.reload(module)
    return module


@pytest.fixture
def mx(triton_interpret):
    return _mxfp4_module(triton_interpret, interpret=True)


@pytest.fixture
def mx_cuda(triton_cuda):
    return _mxfp4_module(triton_cuda, interpret=False)


def make_packed(T: int, H: int, I: int, E: int, seed: int = 0, dtype=torch.float32, hot_expert: int | None = None):
    """Random MXFP4 experts (every code, scales spread over 4 octaves around 1/sqrt(fan_in)) and inputs.
    `hot_expert`: router biases that send every token to it (one expert spans several M-tiles) and none to the
    last three experts."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(dtype)  # noqa: E731

    def packed(n: int, k: int):
        base = 127 - 2 - round(0.5 * torch.log2(torch.tensor(float(k))).item())  # 2.93 * 2^(s-127) ~ k^-1/2
        blocks = torch.randint(0, 256, (E, n, k // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(base - 2, base + 2, (E, n, k // 32), generator=g, dtype=torch.uint8)
        return blocks, scales

    w1_blocks, w1_scales = packed(2 * I, H)
    w2_blocks, w2_scales = packed(H, I)
    router_b = rand(E)
    if hot_expert is not None:
        router_b[hot_expert], router_b[-3:] = 1e3, -1e3  # and the last three experts never win
    return dict(x=rand(T, H), router_w=rand(E, H), router_b=router_b, w1_blocks=w1_blocks, w1_scales=w1_scales,
                b1=rand(E, 2 * I), w2_blocks=w2_blocks, w2_scales=w2_scales, b2=rand(E, H))


CASES = [  # (T, H, I, E, top_k, limit): H and I multiples of 32, not of the tiles (K-steps of 64 / 128)
    pytest.param(1, 64, 32, 8, 4, 7.0, id="decode-T1"),
    pytest.param(3, 96, 96, 5, 2, 1.0, id="T3-clamped"),
    pytest.param(24, 160, 32, 4, 1, 0.7, id="T24-top1"),
    pytest.param(40, 32, 64, 6, 3, 1.0, id="T40-block64"),
    pytest.param(150, 32, 96, 8, 4, 1.0, id="T150-grouped-gemm"),
]


@pytest.mark.parametrize("T,H,I,E,top_k,limit", CASES)
def test_moe_mxfp4_matches_reference(mx, T, H, I, E, top_k, limit):
    p = make_packed(T, H, I, E, seed=T)
    ref = moe_mxfp4_ref(**p, top_k=top_k, alpha=ALPHA, limit=limit)
    assert use_triton(p["x"])
    out = moe_mxfp4(**p, top_k=top_k, alpha=ALPHA, limit=limit)  # through the dispatcher
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert ref.abs().max() > 1.0  # not a vacuous comparison of near-zeros
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("split_k", [2, 3, 5])
@pytest.mark.parametrize("T,H,I,E,top_k,limit", [CASES[0], CASES[1], CASES[3]])
def test_split_k_matches_reference(mx, T, H, I, E, top_k, limit, split_k):
    """K split over several programs (fp32 partial sums, then the finishing kernels): the same function. 5 splits
    of these 2-5 K-steps leave some programs with no K at all."""
    p = make_packed(T, H, I, E, seed=T + 3)
    kw = dict(top_k=top_k, alpha=ALPHA, limit=limit, split_k=split_k, gemv=False)  # the MMA kernels at every T
    out = mx.moe_mxfp4_triton(**p, **kw, dot_scaled=False)
    torch.testing.assert_close(out, moe_mxfp4_ref(**p, top_k=top_k, alpha=ALPHA, limit=limit), **TOL)
    summands = mx.moe_mxfp4_triton(**p, **kw, reduce=False)
    assert torch.equal(summands.sum(1), out)


@pytest.mark.parametrize("T", [5, 70])
def test_ragged_routing_one_hot_expert(mx, T):
    """Every token picks expert 2 (at T=70 it spans two 64-row M-tiles) plus one other; some experts get none."""
    p = make_packed(T, 64, 96, 8, seed=7, hot_expert=2)
    _, experts = route(p["x"], p["router_w"], p["router_b"], 2)
    counts = torch.bincount(experts.flatten(), minlength=8)
    assert counts[2] == T and (counts[-3:] == 0).all()
    torch.testing.assert_close(moe_mxfp4(**p, top_k=2, alpha=ALPHA, limit=7.0),
                               moe_mxfp4_ref(**p, top_k=2, alpha=ALPHA, limit=7.0), **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)  # explicit decode; tl.dot_scaled
@pytest.mark.parametrize("T", [1, 37])
def test_moe_mxfp4_summands_sum_to_the_reduced_output(mx, dtype, T):
    """reduce=False: the k weighted expert rows per token, unsummed; their torch sum is the reduced output bit for
    bit. The reference gives its output as one summand."""
    p = make_packed(T, 64, 96, 6, seed=T, dtype=dtype)
    out = moe_mxfp4(**p, top_k=4, alpha=ALPHA, limit=7.0)
    summands = moe_mxfp4(**p, top_k=4, alpha=ALPHA, limit=7.0, reduce=False)
    assert summands.shape == (T, 4, 64) and summands.dtype == dtype
    assert torch.equal(summands.sum(1), out)
    assert not torch.equal(summands[:, 0], out)  # really unsummed
    ref = moe_mxfp4_ref(**p, top_k=4, alpha=ALPHA, limit=7.0, reduce=False)
    assert ref.shape == (T, 1, 64) and torch.equal(ref[:, 0], moe_mxfp4_ref(**p, top_k=4, alpha=ALPHA, limit=7.0))


GEMV_CASES = [  # (T, H, I, E, top_k, limit, hot_expert)
    pytest.param(1, 64, 32, 8, 4, 7.0, None, id="decode-T1"),
    pytest.param(3, 96, 96, 5, 2, 1.0, None, id="T3-clamped"),
    pytest.param(5, 64, 96, 8, 2, 7.0, 2, id="T5-one-hot-expert"),
    pytest.param(2, 1056, 64, 4, 2, 7.0, None, id="two-K-chunks"),  # 33 blocks: a chunk of 32 and one of 1
]


@pytest.mark.parametrize("T,H,I,E,top_k,limit,hot", GEMV_CASES)
def test_gemv_matches_reference(mx, T, H, I, E, top_k, limit, hot):
    """The CUDA-core GEMV kernels (one sorted row a program, K in chunks of 32 blocks, activations held in
    registers): the reference's function, on ragged routings (an expert with every token, experts with none) and K
    over more than one chunk. The summands add up to the output bit for bit."""
    p = make_packed(T, H, I, E, seed=T + 11, hot_expert=hot)
    ref = moe_mxfp4_ref(**p, top_k=top_k, alpha=ALPHA, limit=limit)
    out = mx.moe_mxfp4_triton(**p, top_k=top_k, alpha=ALPHA, limit=limit, gemv=True)
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(out, ref, **TOL)
    summands = mx.moe_mxfp4_triton(**p, top_k=top_k, alpha=ALPHA, limit=limit, gemv=True, reduce=False)
    assert torch.equal(summands.sum(1), out)


def test_gemv_fp4_pairs_are_bit_exact(mx):
    """`_fp4_pair` on every code in every nibble of a word gives an fp16 pair of its E2M1 values times 2^-14,
    exactly (the block's scale, times 2^14, is applied to the block's sum)."""
    import triton
    import triton.language as tl

    global _MX
    _MX = mx

    @triton.jit
    def pairs(words_ptr, out_ptr):
        w = tl.load(words_ptr + tl.arange(0, 16))[None, :]  # [1, 16]
        for i in tl.static_range(4):
            lo, hi = _MX._halves(_MX._fp4_pair(w, i))
            tl.store(out_ptr + tl.arange(0, 16)[None, :] * 8 + i, lo.to(tl.float32))
            tl.store(out_ptr + tl.arange(0, 16)[None, :] * 8 + i + 4, hi.to(tl.float32))

    w, b = torch.arange(16)[:, None], torch.arange(4)[None, :]  # word w, byte b: low nibble w, high (w + b) % 16
    blocks = (w | ((w + b) % 16) << 4).to(torch.uint8).view(4, 16)  # so every code in every nibble of a word
    out = torch.empty(16, 8)
    pairs[(1,)](blocks.view(torch.int32).flatten(), out)
    want = dequantize(blocks.view(1, 4, 16), torch.full((1, 4), 127, dtype=torch.uint8)).view(16, 8)
    assert torch.equal(out * 2.0 ** 14, want)
    assert set(FP4_VALUES) <= set(want.flatten().tolist())


def gemv_sums(mx, x: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's GEMV (`_gemv`, no gather: row r is x[r]) over K = 1056 (33 blocks: chunks of 32 and 1), its
    K-chunks' partial sums added, and the float64 product it computes."""
    from peagle_kernels.triton_moe import GEMV_TILES, RoutedPairs

    g = torch.Generator().manual_seed(seed)
    T, K = x.shape
    N = 48
    blocks = torch.randint(0, 256, (1, N, K // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 124, (1, N, K // 32), generator=g, dtype=torch.uint8)
    bias = torch.zeros(1, N, dtype=x.dtype)  # (a bias would hide the products at small magnitudes)
    dev = dict(device=x.device, dtype=torch.int32)
    r = RoutedPairs(torch.ones(T, device=x.device), torch.arange(T, **dev), torch.tensor([0, T], **dev), GEMV_TILES,
                    one_tile=True)
    part = torch.zeros(2, T, N, device=x.device)
    split = mx._gemv(x, blocks.to(x.device), scales.to(x.device), bias.to(x.device), part, r, 64, False, 1)
    assert split == 2
    want = x.double().cpu() @ dequantize(blocks, scales)[0].double().T
    return part.sum(0).double().cpu(), want


@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e5])
def test_gemv_half_activations_keep_their_precision(mx, magnitude):
    """bf16 activations meet the codes as fp16 pairs: scaled by a power of two into fp16's range (1e5 would
    overflow it, 1e-6 fall into its subnormals), the products exact, each word's eight summed in fp16. The GEMV's
    sums stay within 1e-3 of the exact product (relative L2; bf16's own rounding is ~2e-3); fp32 activations take
    fp32 products."""
    x = torch.randn(3, 1056, generator=torch.Generator().manual_seed(1)) * magnitude
    got, want = gemv_sums(mx, x.bfloat16())
    assert ((got - want).norm() / want.norm()).item() < 1e-3
    got, want = gemv_sums(mx, x)
    assert ((got - want).norm() / want.norm()).item() < 1e-6


def fp32_oracle(p: dict, top_k: int) -> torch.Tensor:
    """fp32 math on the same (half-precision) inputs, with the routing the half-precision run takes
    (near-ties in the router logits may pick other experts in fp32)."""
    gates, experts = route(p["x"], p["router_w"], p["router_b"], top_k)
    f = {k: v.float() for k, v in p.items() if v.is_floating_point()}
    w1, w2 = dequantize(p["w1_blocks"], p["w1_scales"]), dequantize(p["w2_blocks"], p["w2_scales"])
    ref = torch.zeros_like(f["x"])
    for e in experts.unique().tolist():
        tok, slot = torch.where(experts == e)
        h = swiglu(f["x"][tok] @ w1[e].T + f["b1"][e], ALPHA, 7.0)
        ref.index_add_(0, tok, (h @ w2[e].T + f["b2"][e]) * gates[tok, slot, None].float())
    return ref


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H,I", [(1, 96, 64), (37, 64, 96)])
def test_dot_scaled_path_half_precision(mx, dtype, T, H, I, split_k):
    """bf16/fp16 activations go through tl.dot_scaled, with K whole or split."""
    p = make_packed(T, H, I, 6, seed=T + 1, dtype=dtype)
    out = mx.moe_mxfp4_triton(**p, top_k=3, alpha=ALPHA, limit=7.0, split_k=split_k, gemv=False)
    assert out.dtype == dtype
    ref = fp32_oracle(p, 3)
    torch.testing.assert_close(out.float(), ref, atol=3e-2 * ref.abs().max().item(), rtol=3e-2)


def test_fp4_decode_is_bit_exact(mx):
    """Every code under extreme and typical scale bytes (incl. 0 = 2^-127, a subnormal) equals dequantize."""
    import triton
    import triton.language as tl

    global _MX  # the interpreter resolves names in a kernel through the module's globals
    _MX = mx

    @triton.jit
    def unpack(codes_ptr, scales_ptr, out_ptr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        kb, n, sb = tl.arange(0, BLOCK_K // 2), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K // 32)
        codes = tl.load(codes_ptr + n[None, :] * (BLOCK_K // 2) + kb[:, None])
        scales = tl.load(scales_ptr + n[:, None] * (BLOCK_K // 32) + sb[None, :])
        w = _MX._unpack_mxfp4(codes, scales, BLOCK_K, BLOCK_N)
        tl.store(out_ptr + tl.arange(0, BLOCK_K)[:, None] * BLOCK_N + n[None, :], w)

    N = 8
    j = torch.arange(32)
    blocks = torch.stack([(17 * j + 5 * n) % 256 for n in range(N)]).to(torch.uint8).view(N, 2, 16)  # every code in
    # both nibbles
    scales = torch.tensor([[0, 1], [100, 127], [127, 140], [200, 250], [120, 121], [126, 128], [3, 250], [127, 0]],
                          dtype=torch.uint8)
    out = torch.empty(64, N)
    unpack[(1,)](blocks, scales, out, BLOCK_K=64, BLOCK_N=N)
    want = dequantize(blocks, scales)  # [N, 64]
    assert torch.equal(out.T, want)
    assert set(FP4_VALUES) <= set((want[1, 32:]).tolist())  # scale 127: every code's own value appears


def test_bad_inputs(mx):
    p = make_packed(2, 64, 32, 4)
    with pytest.raises(ValueError, match="w2_scales"):
        moe_mxfp4(**{**p, "w2_scales": p["w2_scales"][..., :0]}, top_k=2, alpha=ALPHA, limit=7.0)
    with pytest.raises(ValueError, match="uint8"):
        moe_mxfp4(**{**p, "w1_blocks": p["w1_blocks"].float()}, top_k=2, alpha=ALPHA, limit=7.0)
    with pytest.raises(ValueError, match="b1"):
        moe_mxfp4(**{**p, "b1": p["b1"][:, :8]}, top_k=2, alpha=ALPHA, limit=7.0)
    with pytest.raises(ValueError, match="dot_scaled takes bf16 or fp16"):
        mx.moe_mxfp4_triton(**p, top_k=2, alpha=ALPHA, limit=7.0, dot_scaled=True)
    assert moe_mxfp4(**make_packed(0, 64, 32, 4), top_k=2, alpha=ALPHA, limit=7.0).shape == (0, 64)
    assert moe_mxfp4(**make_packed(0, 64, 32, 4), top_k=2, alpha=ALPHA, limit=7.0, reduce=False).shape == (0, 2, 64)
    with pytest.raises(ValueError, match="multiples of 32"):
        GptOss(tiny_target_config(intermediate_size=48), mxfp4_experts=True)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [None, 1, 4])
@pytest.mark.parametrize("dot_scaled", [True, False])
@pytest.mark.parametrize("T", [1, 4, 37, 64, 300])
def test_moe_mxfp4_bf16_cuda(mx_cuda, T, dot_scaled, split_k):
    """GPT-OSS layer shape (H = I = 2880 = 90 blocks, E = 32, k = 4), compiled, both ways of expanding FP4, K
    whole or split (None: the tiles' choice)."""
    p = {k: v.cuda() for k, v in make_packed(T, 2880, 2880, 32, seed=T, dtype=torch.bfloat16).items()}
    kw = dict(top_k=4, alpha=ALPHA, limit=7.0, dot_scaled=dot_scaled, split_k=split_k, gemv=False)
    out = mx_cuda.moe_mxfp4_triton(**p, **kw)
    assert out.dtype == torch.bfloat16
    summands = mx_cuda.moe_mxfp4_triton(**p, **kw, reduce=False)
    assert torch.equal(summands.sum(1), out)
    ref = fp32_oracle(p, 4)
    torch.testing.assert_close(out.float(), ref, atol=3e-2 * ref.abs().max().item(), rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 16, 37])
def test_gemv_bf16_cuda(mx_cuda, T):
    """The CUDA-core GEMV kernels at the GPT-OSS layer shape (90 blocks: chunks of 32, 32 and 26), compiled."""
    p = {k: v.cuda() for k, v in make_packed(T, 2880, 2880, 32, seed=T, dtype=torch.bfloat16).items()}
    out = mx_cuda.moe_mxfp4_triton(**p, top_k=4, alpha=ALPHA, limit=7.0, gemv=True)
    ref = fp32_oracle(p, 4)
    torch.testing.assert_close(out.float(), ref, atol=3e-2 * ref.abs().max().item(), rtol=3e-2)
    mma = mx_cuda.moe_mxfp4_triton(**p, top_k=4, alpha=ALPHA, limit=7.0, gemv=False)
    assert ((out.float() - mma.float()).norm() / mma.float().norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
def test_gemv_ptx_equals_its_triton_twin(mx_cuda, monkeypatch, T):
    """The GEMVs' inline PTX (`_WORD_DOT_PTX`) computes what `_word_dot_f16`'s Triton does (the code the CPU tests
    run), bit for bit, at the GPT-OSS layer shape."""
    p = {k: v.cuda() for k, v in make_packed(T, 2880, 2880, 32, seed=T, dtype=torch.bfloat16).items()}
    out = mx_cuda.moe_mxfp4_triton(**p, top_k=4, alpha=ALPHA, limit=7.0, gemv=True)
    x = torch.randn(3, 1056, generator=torch.Generator().manual_seed(1)).bfloat16().cuda() * 1e3
    sums = gemv_sums(mx_cuda, x)[0]
    monkeypatch.setattr(mx_cuda, "GEMV_PTX", False)
    assert torch.equal(mx_cuda.moe_mxfp4_triton(**p, top_k=4, alpha=ALPHA, limit=7.0, gemv=True), out)
    assert torch.equal(gemv_sums(mx_cuda, x)[0], sums)


@pytest.mark.gpu
@pytest.mark.parametrize("gemv", [False, True])
def test_moe_mxfp4_cuda_graph_capture(mx_cuda, pdl, gemv):
    """No host sync: the packed MoE (MMA or GEMV kernels) captures into a CUDA graph and replays exactly."""
    p = {k: v.cuda() for k, v in make_packed(2, 256, 128, 16, dtype=torch.bfloat16).items()}
    assert_graph_replays_exactly(lambda: mx_cuda.moe_mxfp4_triton(**p, top_k=4, alpha=ALPHA, limit=7.0, gemv=gemv),
                                 p["x"])


# --------------------------------------------------------------------------------------------
# Packed experts in the model and the engine
# --------------------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7, 7, 7]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("mxfp4")
    cfg = tiny_target_config()  # H = I = 64: two MXFP4 blocks, one per rank at TP=2
    build_target(d / "target", cfg, seed=0, mxfp4=True, scale=4.0)
    build_drafter(d / "peagle", cfg, parallel=True)
    return {"target": d / "target", "peagle": d / "peagle", "config": cfg}


def test_loader_keeps_experts_packed_only_when_asked(ckpt, tmp_path):
    auto = load_target(ckpt["target"], torch.float32, "cpu")  # "auto" dequantises on CPU
    packed = load_target(ckpt["target"], torch.float32, "cpu", quantization="mxfp4")
    assert not auto.mxfp4_experts and packed.mxfp4_experts
    e = packed.model.layers[0].mlp.experts
    assert e.w1_blocks.dtype == torch.uint8 and tuple(e.w1_blocks.shape) == (4, 128, 2, 16)
    assert not hasattr(e, "w1") and e.b1.dtype == torch.float32
    assert torch.equal(dequantize(e.w1_blocks, e.w1_scales), auto.model.layers[0].mlp.experts.w1)
    assert torch.equal(dequantize(e.w2_blocks, e.w2_scales), auto.model.layers[0].mlp.experts.w2)
    save_target(packed, tmp_path / "again", mxfp4_experts=True)  # packed bytes written back as they are
    again = load_target(tmp_path / "again", torch.float32, "cpu", quantization="mxfp4")
    assert torch.equal(again.model.layers[3].mlp.experts.w2_scales, packed.model.layers[3].mlp.experts.w2_scales)
    save_target(packed, tmp_path / "unpacked")  # or dequantised
    assert torch.equal(load_target(tmp_path / "unpacked", torch.float32, "cpu").model.layers[0].mlp.experts.w1,
                       auto.model.layers[0].mlp.experts.w1)
    dense = tmp_path / "dense"
    build_target(dense, tiny_target_config())
    with pytest.raises(ValueError, match="quantization='mxfp4' needs a checkpoint with MXFP4 experts"):
        load_target(dense, torch.float32, "cpu", quantization="mxfp4")
    with pytest.raises(ValueError, match="quantization must be"):
        load_target(ckpt["target"], torch.float32, "cpu", quantization="fp8")


def test_packed_moe_layers_through_triton_match_dequantized(ckpt, mx):
    """Every layer's MoE module on packed experts (Triton kernel) equals the dequantised model's (reference)."""
    packed = load_target(ckpt["target"], torch.float32, "cpu", quantization="mxfp4")
    dense = load_target(ckpt["target"], torch.float32, "cpu", quantization="none")
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    for a, b in zip(packed.model.layers, dense.model.layers):
        assert use_triton(x)
        got = a.mlp(x)
        assert torch.equal(a.mlp(x, reduce=False).sum(1), got)  # the summands a layer hands to the next norm
        e = b.mlp.experts
        want = moe_ref(x, b.mlp.router.weight, b.mlp.router.bias, e.w1, e.b1, e.w2, e.b2, 2, ALPHA, 7.0)
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("speculative", [False, True])
def test_engine_greedy_packed_equals_dequantized(ckpt, speculative):
    spec = {"method": "eagle3", "model": str(ckpt["peagle"]), "num_speculative_tokens": 3,
            "parallel_drafting": True} if speculative else None
    outs = {}
    for q in ("none", "mxfp4"):
        llm = LLM(str(ckpt["target"]), device="cpu", quantization=q, speculative_config=spec)
        assert llm.engine.target.mxfp4_experts == (q == "mxfp4")
        outs[q] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert outs["mxfp4"] == outs["none"]
    assert len(set(map(tuple, outs["none"]))) > 1  # distinct prompts, distinct continuations


def test_tp_shards_of_packed_experts_sum_to_the_full_layer(ckpt):
    cfg = ckpt["config"]
    full = load_target(ckpt["target"], torch.float32, "cpu", quantization="mxfp4")
    shards = [load_target(ckpt["target"], torch.float32, "cpu", 2, target_shard(r), "mxfp4") for r in range(2)]
    assert shards[1].mxfp4_experts and tuple(shards[1].model.layers[0].mlp.experts.w2_blocks.shape) == (4, 64, 1, 16)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    for i in range(cfg.num_hidden_layers):
        got = sum(s.model.layers[i].mlp(x) for s in shards)
        torch.testing.assert_close(got, full.model.layers[i].mlp(x), rtol=1e-5, atol=1e-5)


def test_when_experts_stay_packed(ckpt):
    """"auto": packed on CUDA, at every tensor-parallel size (ranks split whole blocks); "mxfp4": packed anywhere."""
    files = SafetensorsDir(ckpt["target"])
    assert keep_mxfp4(files, "cuda") and keep_mxfp4(files, "cuda:1")
    assert not keep_mxfp4(files, "cpu") and keep_mxfp4(files, "cpu", "mxfp4")
    assert not keep_mxfp4(files, "cuda", "none")


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_padded_shards_of_packed_experts_sum_to_the_dequantized_layer(tmp_path, world):
    """I = 224 (7 blocks): a rank's share 224 / N (112, 56, 28) is not whole blocks, as 2880 / 4 = 720 is not. Each
    rank keeps ceil(7 / N) whole blocks, the last ranks' padded with zero channels (at N = 8 rank 7 holds padding
    only): every rank's experts stay packed, the padding contributes exactly nothing, and the ranks' partial outputs
    sum to the unpadded dequantised layer's."""
    cfg = tiny_target_config(intermediate_size=224)
    build_target(tmp_path, cfg, seed=2, mxfp4=True)
    dense = load_target(tmp_path, torch.float32, "cpu", quantization="none")
    shards = [load_target(tmp_path, torch.float32, "cpu", world, target_shard(r), "mxfp4") for r in range(world)]
    blocks = -(-7 // world)
    real = [max(0, min(blocks, 7 - r * blocks)) for r in range(world)]  # whole blocks of real channels per rank
    x = torch.randn(10, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    for i in range(cfg.num_hidden_layers):
        parts = []
        for r, s in enumerate(shards):
            e = s.model.layers[i].mlp.experts
            assert e.mxfp4 and tuple(e.w2_blocks.shape) == (4, 64, blocks, 16)
            assert not e.w2_blocks[:, :, real[r]:].any() and not e.w1_blocks[:, 2 * 32 * real[r]:].any()
            assert not e.b1[:, 2 * 32 * real[r]:].any()
            parts.append(s.model.layers[i].mlp(x))
        if real[-1] == 0:  # a rank of padding only (and no b2: rank 0 adds it): exactly zero
            assert not parts[-1].any()
        torch.testing.assert_close(sum(parts), dense.model.layers[i].mlp(x), rtol=1e-5, atol=1e-5)


def test_tp2_packed_greedy_equals_tp1(ckpt):
    want = [o.outputs[0].token_ids for o in LLM(str(ckpt["target"]), device="cpu").generate(PROMPTS, GREEDY)]
    llm = LLM(str(ckpt["target"]), device="cpu", tensor_parallel_size=2, quantization="mxfp4")
    try:
        assert llm.engine.target.mxfp4_experts  # rank 0's shard; the workers load theirs the same way
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    finally:
        llm.engine.shutdown()


def test_expert_bytes_packed_vs_bf16():
    """GPT-OSS-120B with packed experts fits one H200 (141 GB); with bf16 experts it does not. Random packed
    weights come without a dense copy (how a benchmark builds the 120B shape)."""
    def sizes(cfg: GptOssConfig, packed: bool) -> tuple[int, int]:
        with torch.device("meta"):
            m = GptOss(cfg, mxfp4_experts=packed).to(torch.bfloat16)
        nbytes = {n: p.numel() * p.element_size() for n, p in m.named_parameters()}
        experts = sum(v for n, v in nbytes.items() if ".experts.w" in n)
        return experts, sum(nbytes.values())

    tiny = init_random_(GptOss(tiny_target_config(), mxfp4_experts=True))  # random packed weights (bench shapes)
    w2 = tiny.model.layers[0].mlp.experts
    rms = dequantize(w2.w2_blocks, w2.w2_scales).pow(2).mean().sqrt().item()
    assert 0.5 < rms * 64 ** 0.5 < 2  # about fan_in^-1/2, like the dense init

    big = GptOssConfig(num_hidden_layers=36, num_local_experts=128)
    weights = 36 * 128 * 3 * 2880 * 2880  # w1 (2I x H) + w2 (H x I) per expert
    packed, total_packed = sizes(big, True)
    dense, total_dense = sizes(big, False)
    assert packed == weights * 17 // 32 and dense == weights * 2  # 4.25 bits vs 16
    assert total_packed < 70e9 < 141e9 < total_dense
