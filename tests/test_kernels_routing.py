"""The Triton routing (the reference's router linear, then one launch for top-k + softmax, and the counting
sort it can fold in) equals the PyTorch reference `route_ref`.

Both sides pick from the same logits (one `F.linear`), so expert ids must be identical except between
exactly equal logits (torch.topk's order among ties is unspecified; the kernel takes the lowest index).
CPU: Triton's interpreter.
  fp32, exact inputs: x and router_w hold multiples of 1/4, the bias distinct multiples of 1/(16E): no two
        experts of a token tie, so expert ids (and their order) must be identical, gates within 1e-6.
  fp32 and bf16 Gaussian inputs: ids identical on every token without an exact tie among its top k + 1
        logits; gates within 1e-6 (fp32) or one bf16 step (the kernel rounds its fp32 softmax once).
GPU (skipped here): compiled, bf16, GPT-OSS shapes (H = 2880, E = 32 and 128, k = 4), and CUDA-graph capture.
"""
from __future__ import annotations

import pytest
import torch

from kernel_utils import assert_graph_replays_exactly, triton_cuda, triton_interpret  # noqa: F401  (fixtures)
from kernels.dispatch import use_triton
from kernels.moe import route, route_ref


def exact_inputs(T: int, H: int, E: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits exact in fp32 and pairwise distinct per token (gap >= 1/(16E)): products are multiples of
    1/16 and the bias adds a distinct fraction perm[e]/(16E) < 1/16 to each expert."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (T, H), generator=g) / 4
    w = torch.randint(-3, 4, (E, H), generator=g) / 4
    b = torch.randint(-2, 3, (E,), generator=g) / 4 + torch.randperm(E, generator=g) / (16 * E)
    return x, w, b


def gaussian_inputs(T: int, H: int, E: int, seed: int, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(T, H, generator=g), torch.randn(E, H, generator=g) * H ** -0.5, torch.randn(E, generator=g)
    return x.to(device, dtype), w.to(device, dtype), b.to(device, dtype)


def assert_valid_routing(gates, experts, x, w, b, top_k, tie_rtol: float, tie_atol: float, gate_tol: float,
                         min_clear: float) -> None:
    """The kernel's picks are a top-k of the reference logits up to near-ties (two logits within
    tie_atol + tie_rtol * |logit|, which the kernel's own rounding may order the other way), in descending
    order, distinct per token, and its gates are the softmax of the reference logits it picked. Ids and
    gates must be the reference's on every token whose top k+1 logits are further apart than that
    (at least `min_clear` of the tokens: not a vacuous comparison)."""
    ref_gates, ref_experts = route_ref(x, w, b, top_k)
    logits = torch.nn.functional.linear(x, w, b).float()  # rounded to x.dtype first, as the kernel does
    want = logits.topk(top_k, dim=-1).values
    picked = logits.gather(-1, experts)
    assert gates.dtype == x.dtype and experts.dtype == torch.int64
    assert gates.shape == experts.shape == (x.shape[0], top_k)
    assert ((experts >= 0) & (experts < w.shape[0])).all()
    assert (experts.sort(-1).values.diff(dim=-1) != 0).all()  # k distinct experts
    torch.testing.assert_close(picked, want, atol=tie_atol, rtol=tie_rtol)
    torch.testing.assert_close(gates.float(), picked.softmax(-1), atol=gate_tol, rtol=0)
    top = logits.topk(min(top_k + 1, w.shape[0]), dim=-1).values
    clear = (top.diff(dim=-1).abs() > tie_atol + tie_rtol * top.abs()[:, :-1]).all(-1)
    assert clear.float().mean() >= min_clear
    assert torch.equal(experts[clear], ref_experts[clear])
    torch.testing.assert_close(gates[clear].float(), ref_gates[clear].float(), atol=gate_tol, rtol=0)


# Same logits on both sides: only exact ties may order differently; gates within one bf16 step (2^-8 at 1).
BF16 = dict(tie_rtol=0, tie_atol=0, gate_tol=2 ** -8, min_clear=0.5)


SHAPES = [  # (T, H, E, k): decode (one program, sort folded in), verify, prefill (several programs)
    pytest.param(1, 64, 32, 4, id="decode-T1-E32"),
    pytest.param(1, 48, 128, 4, id="decode-T1-E128"),
    pytest.param(7, 40, 32, 2, id="T7-odd-ragged-H"),
    pytest.param(16, 64, 128, 1, id="T16-top1"),
    pytest.param(33, 72, 32, 4, id="T33-E32"),
    pytest.param(45, 24, 128, 4, id="T45-E128-unsorted"),
    pytest.param(150, 48, 32, 3, id="T150-k3-three-programs"),
    pytest.param(301, 24, 128, 2, id="T301-E128-five-programs"),
    pytest.param(9, 16, 20, 4, id="T9-E20-padding-experts"),
]


@pytest.mark.parametrize("T,H,E,k", SHAPES)
def test_route_exact_inputs(triton_interpret, T, H, E, k):
    x, w, b = exact_inputs(T, H, E, seed=T * 131 + E)
    want_gates, want_experts = route_ref(x, w, b, k)
    # Guards the oracle: every token's k logits are strictly decreasing, so swapping any two experts
    # (or returning them unsorted) changes `experts` and fails the equality below.
    vals = torch.nn.functional.linear(x, w, b).topk(k, dim=-1).values
    assert (vals[:, :-1] > vals[:, 1:]).all()
    assert use_triton(x)
    gates, experts = route(x, w, b, k)  # through the dispatcher
    assert experts.dtype == want_experts.dtype and gates.dtype == want_gates.dtype
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(gates, want_gates, atol=1e-6, rtol=0)


@pytest.mark.parametrize("T,H,E,k", SHAPES)
def test_route_gaussian_inputs(triton_interpret, T, H, E, k):
    x, w, b = gaussian_inputs(T, H, E, seed=T + E)
    gates, experts = route(x, w, b, k)
    assert_valid_routing(gates, experts, x, w, b, k, tie_rtol=0, tie_atol=0, gate_tol=1e-6, min_clear=0.9)


@pytest.mark.parametrize("T,E", [(3, 32), (70, 128)])
def test_route_bf16_interpreted(triton_interpret, T, E):
    """bf16 logits under the interpreter."""
    x, w, b = gaussian_inputs(T, 64, E, seed=T, dtype=torch.bfloat16)
    gates, experts = route(x, w, b, 4)
    assert_valid_routing(gates, experts, x, w, b, 4, **BF16)


def test_ties_take_the_lowest_expert(triton_interpret):
    """Exactly equal logits: the lowest expert index first (a stable descending sort)."""
    x = torch.ones(5, 16)
    w = torch.zeros(12, 16)
    b = torch.tensor([0.0, 1, 3, 1, 3, 3, 0, 1, 2, 2, 3, 0])
    gates, experts = route(x, w, b, 6)
    assert experts.tolist() == [[2, 4, 5, 10, 8, 9]] * 5
    torch.testing.assert_close(gates, torch.softmax(b[experts], -1), atol=1e-6, rtol=0)


def test_route_empty_and_leading_dims(triton_interpret):
    x, w, b = exact_inputs(6, 32, 16, seed=1)
    gates, experts = route(x[:0], w, b, 2)
    assert gates.shape == experts.shape == (0, 2)
    g3, e3 = route(x.view(2, 3, 32), w, b, 2)
    want = route_ref(x, w, b, 2)
    assert g3.shape == e3.shape == (2, 3, 2)
    assert torch.equal(e3.view(6, 2), want[1])
    with pytest.raises(ValueError, match="top_k"):
        route(x, w, b, 17)


def test_route_with_autograd_takes_the_reference(triton_interpret):
    """Training differentiates the router: the kernel has no backward, so such calls take the reference."""
    x, w, b = exact_inputs(4, 16, 8, seed=2)
    w.requires_grad_(True)
    gates, _ = route(x, w, b, 2)
    assert gates.grad_fn is not None
    with torch.no_grad():
        assert route(x, w, b, 2)[0].grad_fn is None


@pytest.mark.parametrize("T,E,k,folded", [(1, 32, 4, True), (16, 128, 4, True), (64, 32, 4, True),
                                          (3, 20, 3, True), (33, 128, 4, False), (65, 32, 4, False)])
def test_sort_folded_into_routing(triton_interpret, T, E, k, folded):
    """At decode sizes (GPT-OSS: E=32 up to 64 tokens, E=128 up to 32) the routing launch also sorts the
    pairs by expert, exactly as `sort_pairs_by_expert` does; else it leaves the sort to the caller."""
    x, w, b = exact_inputs(T, 32, E, seed=T)
    gates, experts, sorted_pairs = triton_interpret.routing.route_and_sort_pairs(x, w, b, k)
    want_gates, want_experts = route_ref(x, w, b, k)
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(gates, want_gates, atol=1e-6, rtol=0)
    assert (sorted_pairs is not None) == folded
    if folded:
        order, offsets = sorted_pairs
        want_order, want_offsets = triton_interpret.moe.sort_pairs_by_expert(experts, E)
        assert order.dtype == offsets.dtype == torch.int32
        assert torch.equal(order, want_order) and torch.equal(offsets, want_offsets)
        assert torch.equal(order.long(), torch.argsort(experts.flatten(), stable=True))


@pytest.mark.gpu
@pytest.mark.parametrize("E", [32, 128])
@pytest.mark.parametrize("T", [1, 4, 37, 64, 300, 2048])
def test_route_bf16_cuda(triton_cuda, T, E):
    """GPT-OSS router shapes in bf16, compiled."""
    x, w, b = gaussian_inputs(T, 2880, E, seed=T, dtype=torch.bfloat16, device="cuda")
    gates, experts = route(x, w, b, 4)
    assert_valid_routing(gates, experts, x, w, b, 4, **BF16)
    _, _, sorted_pairs = triton_cuda.routing.route_and_sort_pairs(x, w, b, 4)
    if sorted_pairs is not None:
        want = triton_cuda.moe.sort_pairs_by_expert(experts, E)
        assert all(torch.equal(got, ref) for got, ref in zip(sorted_pairs, want))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2, 500])  # one program with the sort folded in; several programs
def test_route_cuda_graph_capture(triton_cuda, T):
    x, w, b = gaussian_inputs(T, 2880, 32, seed=0, dtype=torch.bfloat16, device="cuda")

    def routed() -> torch.Tensor:
        gates, experts, sorted_pairs = triton_cuda.routing.route_and_sort_pairs(x, w, b, 4)
        parts = [gates.float().flatten(), experts.float().flatten()]
        return torch.cat(parts + [t.float() for t in sorted_pairs or ()])

    assert_graph_replays_exactly(routed, x)
