"""Triton MoE equals the PyTorch reference (routing, interleaved gate/up, clamped SwiGLU, biases).

CPU: Triton's interpreter, fp32, atol = rtol = 1e-4 on outputs of magnitude ~1-10; the summands of
reduce=False add up to the reduced output exactly.
GPU (skipped here): compiled kernels in bf16 against the fp32 reference on the same inputs.
"""
from __future__ import annotations

import pytest
import torch

from kernel_utils import assert_graph_replays_exactly, pdl, triton_cuda, triton_interpret  # noqa: F401  (fixtures)
from peagle_kernels.dispatch import use_triton
from peagle_kernels.moe import moe, moe_ref, route, swiglu

TOL = dict(atol=1e-4, rtol=1e-4)
ALPHA = 1.702


def make_moe(T: int, H: int, I: int, E: int, seed: int = 0, device: str = "cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(device=device, dtype=dtype)  # noqa: E731
    return dict(x=rand(T, H), router_w=rand(E, H), router_b=rand(E), w1=rand(E, 2 * I, H, s=H ** -0.5),
                b1=rand(E, 2 * I), w2=rand(E, H, I, s=I ** -0.5), b2=rand(E, H))


CASES = [  # (T, H, I, E, top_k, limit): sizes not multiples of the tiles; decode, verify and GEMM paths
    pytest.param(1, 32, 16, 8, 4, 7.0, id="decode-T1"),
    pytest.param(3, 40, 24, 5, 2, 1.0, id="T3-ragged-dims-clamped"),
    pytest.param(24, 32, 48, 4, 1, 0.7, id="T24-top1"),
    pytest.param(64, 16, 32, 6, 3, 1.0, id="T64-largest-gemv"),
    pytest.param(150, 24, 16, 8, 4, 1.0, id="T150-grouped-gemm"),
]


@pytest.mark.parametrize("T,H,I,E,top_k,limit", CASES)
def test_moe_matches_reference(triton_interpret, T, H, I, E, top_k, limit):
    p = make_moe(T, H, I, E, seed=T)
    ref = moe_ref(**p, top_k=top_k, alpha=ALPHA, limit=limit)
    assert use_triton(p["x"])
    out = moe(**p, top_k=top_k, alpha=ALPHA, limit=limit)  # through the dispatcher
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("T,H,I,E,top_k,limit", [CASES[0], CASES[1], CASES[4]])
def test_moe_summands_sum_to_the_reduced_output(triton_interpret, T, H, I, E, top_k, limit):
    """reduce=False: the Triton path's k weighted expert rows per token, unsummed; their torch sum is the reduced
    output bit for bit (what `add_rms_norm` over summands adds). The reference gives its output as one summand."""
    p = make_moe(T, H, I, E, seed=T)
    out = moe(**p, top_k=top_k, alpha=ALPHA, limit=limit)
    summands = moe(**p, top_k=top_k, alpha=ALPHA, limit=limit, reduce=False)
    assert summands.shape == (T, top_k, H) and summands.dtype == out.dtype
    assert torch.equal(summands.sum(1), out)
    assert not torch.equal(summands[:, 0], out)  # really unsummed
    ref = moe_ref(**p, top_k=top_k, alpha=ALPHA, limit=limit)
    ref_summands = moe_ref(**p, top_k=top_k, alpha=ALPHA, limit=limit, reduce=False)
    assert ref_summands.shape == (T, 1, H) and torch.equal(ref_summands[:, 0], ref)


def test_clamp_bites_in_clamped_cases():
    """Guards the oracle: with limit 1.0 the clamps change the activation, so a kernel without
    them (or with gate/up swapped) would fail test_moe_matches_reference."""
    p = make_moe(3, 40, 24, 5, seed=3)
    z = torch.einsum("th,enh->ten", p["x"], p["w1"]) + p["b1"]
    assert not torch.allclose(swiglu(z, ALPHA, 1.0), swiglu(z, ALPHA, 1e9))
    swapped = z.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # gate <-> up
    assert not torch.allclose(swiglu(z, ALPHA, 1.0), swiglu(swapped, ALPHA, 1.0))


@pytest.mark.parametrize("T,E,k", [(9, 6, 3), (1, 32, 4), (3000, 40, 4)])  # one-program sort; torch sort
def test_sort_pairs_by_expert(triton_interpret, T, E, k):
    g = torch.Generator().manual_seed(T)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    order, offsets = triton_interpret.moe.sort_pairs_by_expert(experts, E)
    flat = experts.flatten()
    assert order.dtype == offsets.dtype == torch.int32
    assert torch.equal(order.long(), torch.argsort(flat, stable=True))  # by expert, then by pair
    assert offsets.tolist() == [0] + torch.bincount(flat, minlength=E).cumsum(0).tolist()


@pytest.mark.parametrize("T,E,k", [(1, 32, 4), (3, 5, 2), (64, 6, 3), (150, 8, 4)])
def test_m_tiles_at_decode_sizes_are_the_selected_experts(triton_interpret, T, E, k):
    """Where every expert's rows fit one M-tile (T <= BLOCK_M: an expert gets at most one row a token), the
    grouped GEMMs launch min(E, T*k) M-tiles, one per expert that can have rows; the general tiling would launch
    T*k // BLOCK_M + E (at decode, T = 1 with 32 experts: 32 M-tiles, 28 of them empty). The outputs of both
    tilings are checked against the reference in test_moe_matches_reference (T = 1, 3, 24, 64: one tile; 150:
    general)."""
    p = make_moe(T, 16, 8, E, seed=T)
    r = triton_interpret.moe.route_and_sort(p["x"], p["router_w"], p["router_b"], k)
    selected = len(set(route(p["x"], p["router_w"], p["router_b"], k)[1].flatten().tolist()))
    if T <= r.tiles.block_m:
        assert r.one_tile and r.m_tiles == min(E, T * k) >= selected
    else:
        assert not r.one_tile and r.m_tiles == T * k // r.tiles.block_m + E
    assert r.kernel_args() == dict(BLOCK_M=r.tiles.block_m, ONE_TILE=r.one_tile, E_PAD=1 << (E - 1).bit_length())


def test_moe_empty_batch(triton_interpret):
    p = make_moe(0, 16, 16, 4)
    assert moe(**p, top_k=2, alpha=ALPHA, limit=7.0).shape == (0, 16)
    assert moe(**p, top_k=2, alpha=ALPHA, limit=7.0, reduce=False).shape == (0, 2, 16)


def test_moe_rejects_bad_shapes(triton_interpret):
    p = make_moe(2, 16, 16, 4)
    p["w2"] = p["w2"][:, :, :8]
    with pytest.raises(ValueError, match="w2"):
        moe(**p, top_k=2, alpha=ALPHA, limit=7.0)
    with pytest.raises(ValueError, match="top_k"):
        moe(**make_moe(2, 16, 16, 4), top_k=5, alpha=ALPHA, limit=7.0)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 37, 64, 300, 2048])
def test_moe_bf16_cuda(triton_cuda, T):
    """GPT-OSS-20B layer shape in bf16; the reference runs in fp32 on the same bf16 weights but with
    the routing taken from the bf16 run (near-ties in router logits may pick other experts)."""
    p = make_moe(T, 2880, 2880, 32, seed=T, device="cuda", dtype=torch.bfloat16)
    out = moe(**p, top_k=4, alpha=ALPHA, limit=7.0)
    assert out.dtype == torch.bfloat16
    assert torch.equal(moe(**p, top_k=4, alpha=ALPHA, limit=7.0, reduce=False).sum(1), out)
    gates, experts = route(p["x"], p["router_w"], p["router_b"], 4)
    f = {name: t.float() for name, t in p.items()}
    ref = torch.zeros(T, 2880, device="cuda")
    for e in experts.unique().tolist():  # fp32 oracle of the same routing
        tok, slot = torch.where(experts == e)
        h = swiglu(f["x"][tok] @ f["w1"][e].T + f["b1"][e], ALPHA, 7.0)
        ref.index_add_(0, tok, (h @ f["w2"][e].T + f["b2"][e]) * gates[tok, slot, None].float())
    torch.testing.assert_close(out.float(), ref, atol=3e-2 * ref.abs().max().item(), rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2, 700])  # one-program sort and torch sort
def test_moe_cuda_graph_capture(triton_cuda, pdl, T):
    """No host sync anywhere: the whole op captures into a CUDA graph and replays exactly (with and without
    programmatic dependent launch)."""
    p = make_moe(T, 256, 128, 16, device="cuda", dtype=torch.bfloat16)
    assert_graph_replays_exactly(lambda: moe(**p, top_k=4, alpha=ALPHA, limit=7.0), p["x"])


# --------------------------------------------------------------------------------------------
# moe_ref: dense-over-experts and per-expert formulations against the per-expert oracle
# --------------------------------------------------------------------------------------------


def moe_per_expert(x, router_w, router_b, w1, b1, w2, b2, top_k, alpha, limit):
    """The obvious oracle: each selected expert on its tokens, added in ascending expert order."""
    gates, experts = route(x, router_w, router_b, top_k)
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        tok, slot = torch.where(experts == e)
        y = torch.nn.functional.linear(swiglu(torch.nn.functional.linear(x[tok], w1[e], b1[e]), alpha, limit), w2[e], b2[e])
        out = out.index_add(0, tok, (y * gates[tok, slot, None]).to(x.dtype))
    return out


def ops_of(fn) -> set[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    with Record() as r:
        fn()
    return r.seen


@pytest.mark.parametrize("T,H,I,E,top_k,limit,dense", [
    pytest.param(37, 32, 16, 8, 2, 7.0, True, id="dense-T37-E8-top2"),
    pytest.param(5, 40, 24, 5, 3, 1.0, True, id="dense-T5-clamped-top3"),
    pytest.param(1, 32, 16, 4, 4, 7.0, True, id="dense-T1-all-experts"),
    pytest.param(900, 128, 128, 8, 2, 7.0, False, id="loop-T900"),
])
def test_moe_ref_matches_per_expert_oracle(T, H, I, E, top_k, limit, dense):
    """Values and gradients (x, router, expert weights and biases) equal the oracle; the size picks the
    formulation (dense over all experts at small sizes on a CPU, and always on a GPU; else the loop)."""
    p = {name: t.requires_grad_() for name, t in make_moe(T, H, I, E, seed=T).items()}
    want = moe_per_expert(**p, top_k=top_k, alpha=ALPHA, limit=limit)
    got = moe_ref(**p, top_k=top_k, alpha=ALPHA, limit=limit)
    torch.testing.assert_close(got, want, **TOL)
    w = torch.randn_like(want)
    for name, a, b in zip(p, torch.autograd.grad((want * w).sum(), list(p.values())),
                          torch.autograd.grad((got * w).sum(), list(p.values()))):
        torch.testing.assert_close(b, a, **TOL, msg=lambda m: f"grad {name}: {m}")
    with torch.no_grad():
        ops = ops_of(lambda: moe_ref(**p, top_k=top_k, alpha=ALPHA, limit=limit))
    assert ("baddbmm" in ops) == dense and ("nonzero" in ops) != dense  # the dense path never syncs


def test_moe_ref_dense_bf16_is_bitwise_the_per_expert_sum():
    """bf16: the dense path adds a token's expert outputs in the oracle's order (ascending expert, rounding
    after each add), so on a CPU, whose GEMMs round a row alike at any row count, the results are equal
    bit for bit (adding in top-k slot order instead is off by up to 1.6e-2 here)."""
    p = make_moe(16, 32, 16, 6, seed=5, dtype=torch.bfloat16)
    want = moe_per_expert(**p, top_k=3, alpha=ALPHA, limit=7.0)
    assert torch.equal(moe_ref(**p, top_k=3, alpha=ALPHA, limit=7.0), want)
