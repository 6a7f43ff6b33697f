"""The Triton routing equals the PyTorch reference `route_ref`.

Two paths (`one_launch` picks): up to 64 tokens, when one program can also sort the pairs, one launch computes
the logits itself (programs over expert blocks and hidden slices, the last to finish routes and sorts);
otherwise the reference's router linear, then one launch for top-k + softmax.
CPU: Triton's interpreter (which casts fp32 to bf16 by truncation where a GPU rounds to nearest).
  Exact inputs, logits exact whatever the summation order, so the one-launch path's logits equal the
        reference's bit for bit: fp32 (multiples of 1/4 and distinct bias fractions: no two experts of a
        token tie, ids and their order identical, gates within 1e-6) and bf16 (a grid of 1/16 within +-16,
        exact in bf16; ties possible: ids identical on every token without an exact tie among its top k + 1
        logits, gates within one bf16 step, the kernel rounds its fp32 softmax once).
  Gaussian inputs: through F.linear (the fallback) both sides pick from the same logits, so the same rule
        with no tolerance on ties. The one-launch path's own logits differ from the reference's by summation
        order: fp32 within ~1e-6, so ties within 1e-5 may order either way; bf16 within one bf16 step
        (2^-7 |logit|; on CPU also the truncating cast), so picks may swap logits within two steps and a gate
        moves by at most half the largest logit change (softmax's inf-norm Lipschitz constant is 1/2):
        gates within 2^-6 (|logit| < 8, steps <= 2^-5) plus one bf16 step.
  The sort of the pairs by expert: exactly `sort_pairs_by_expert` (stable).
GPU (skipped here): compiled, bf16, GPT-OSS shapes (H = 2880, E = 32 and 128, k = 4), repeated launches
(the finishing program's reads of the other programs' partial sums), and CUDA-graph capture.
"""
from __future__ import annotations

import sys

import pytest
import torch

from kernel_utils import assert_graph_replays_exactly, pdl, triton_cuda, triton_interpret  # noqa: F401  (fixtures)
from peagle_kernels.dispatch import use_triton
from peagle_kernels.moe import norm_and_route, route, route_ref
from peagle_kernels.norm import add_rms_norm_ref


def exact_inputs(T: int, H: int, E: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits exact in fp32 and pairwise distinct per token (gap >= 1/(16E)): products are multiples of
    1/16 and the bias adds a distinct fraction perm[e]/(16E) < 1/16 to each expert."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (T, H), generator=g) / 4
    w = torch.randint(-3, 4, (E, H), generator=g) / 4
    b = torch.randint(-2, 3, (E,), generator=g) / 4 + torch.randperm(E, generator=g) / (16 * E)
    return x, w, b


def grid_inputs(T: int, H: int, E: int, seed: int, dtype=torch.bfloat16) -> tuple[torch.Tensor, ...]:
    """Logits on a grid of 1/16 within +-16 (H <= 128), so exact in bf16 and every partial sum exact in fp32:
    x in {-1, 0, 1}, w in {-1, 0, 1}/16, the bias a multiple of 1/16 within +-8."""
    assert H <= 128
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (T, H), generator=g).float()
    w = torch.randint(-1, 2, (E, H), generator=g) / 16
    b = torch.randint(-128, 129, (E,), generator=g) / 16
    return x.to(dtype), w.to(dtype), b.to(dtype)


def gaussian_inputs(T: int, H: int, E: int, seed: int, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(T, H, generator=g), torch.randn(E, H, generator=g) * H ** -0.5, torch.randn(E, generator=g)
    return x.to(device, dtype), w.to(device, dtype), b.to(device, dtype)


def assert_valid_routing(gates, experts, x, w, b, top_k, tie_rtol: float, tie_atol: float, gate_tol: float,
                         min_clear: float, max_logit: float = float("inf")) -> None:
    """The kernel's picks are a top-k of the reference logits up to near-ties (two logits within
    tie_atol + tie_rtol * |logit|, which the kernel's own rounding may order the other way), in descending
    order, distinct per token, and its gates are the softmax of the reference logits it picked. Ids and
    gates must be the reference's on every token whose top k+1 logits are further apart than that
    (at least `min_clear` of the tokens: not a vacuous comparison). `max_logit`: the tolerances assume
    smaller logits."""
    ref_gates, ref_experts = route_ref(x, w, b, top_k)
    logits = torch.nn.functional.linear(x, w, b).float()  # rounded to x.dtype first, as the kernel does
    assert logits.abs().max() < max_logit
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
FP32 = dict(tie_rtol=0, tie_atol=0, gate_tol=1e-6, min_clear=0.9)
# The one-launch path's own logits (summation order; see the module docstring). Among 128 bf16 logits, two
# of a token's top five are often within two steps: fewer tokens are clear.
BF16_OWN = dict(tie_rtol=2 ** -6, tie_atol=0, gate_tol=2 ** -8 + 2 ** -6, min_clear=0.25, max_logit=8.0)
FP32_OWN = dict(tie_rtol=0, tie_atol=1e-5, gate_tol=1e-6, min_clear=0.9)


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
    own = triton_interpret.routing.one_launch(T, E, k)
    assert_valid_routing(gates, experts, x, w, b, k, **(FP32_OWN if own else FP32))


@pytest.mark.parametrize("T,E", [(3, 32), (32, 128), (64, 32), (70, 128)])
def test_route_bf16_interpreted(triton_interpret, T, E):
    """bf16 logits under the interpreter: the kernel's own (T <= 64 here) or the reference's (T = 70)."""
    x, w, b = gaussian_inputs(T, 64, E, seed=T, dtype=torch.bfloat16)
    gates, experts = route(x, w, b, 4)
    own = triton_interpret.routing.one_launch(T, E, 4)
    assert_valid_routing(gates, experts, x, w, b, 4, **(BF16_OWN if own else BF16))


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
    assert (sorted_pairs is not None) == folded == triton_interpret.routing.one_launch(T, E, k)
    if folded:
        assert_sorted_pairs(triton_interpret, sorted_pairs, experts, E)


def assert_sorted_pairs(kernels, sorted_pairs, experts: torch.Tensor, E: int) -> None:
    """(order, offsets) are exactly the stable counting sort of the pairs by expert."""
    order, offsets = sorted_pairs
    want_order, want_offsets = kernels.moe.sort_pairs_by_expert(experts, E)
    assert order.dtype == offsets.dtype == torch.int32
    assert torch.equal(order, want_order) and torch.equal(offsets, want_offsets)
    assert torch.equal(order.long(), torch.argsort(experts.flatten(), stable=True))


ONE_LAUNCH_CASES = [pytest.param(T, E, k, id=f"T{T}-E{E}-k{k}") for T in (1, 3, 8, 17, 64) for E in (8, 32, 128)
                    for k in (1, 2, 4)]


@pytest.mark.parametrize("T,E,k", ONE_LAUNCH_CASES)
def test_one_launch_exact_inputs(triton_interpret, T, E, k):
    """The one-launch path (and, at E = 128, T = 64, k = 4, the fallback) on logits exact whatever the
    summation order: fp32 with no ties (ids identical), bf16 on a grid (ids identical where no exact tie)."""
    routing = triton_interpret.routing
    H = 64 + (7 * T + 3 * E + k) % 65  # 64..128, ragged against the tiles
    folded = routing.one_launch(T, E, k)
    assert folded == ((T, E, k) != (64, 128, 4))  # E = 128 sorts in the launch up to 32 tokens at k = 4
    x, w, b = exact_inputs(T, H, E, seed=1000 * T + 10 * E + k)
    gates, experts, sorted_pairs = routing.route_and_sort_pairs(x, w, b, k)
    want_gates, want_experts = route_ref(x, w, b, k)
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(gates, want_gates, atol=1e-6, rtol=0)
    assert (sorted_pairs is not None) == folded
    if folded:
        assert_sorted_pairs(triton_interpret, sorted_pairs, experts, E)

    x, w, b = grid_inputs(T, H, E, seed=1000 * T + 10 * E + k)
    gates, experts, sorted_pairs = routing.route_and_sort_pairs(x, w, b, k)
    assert_valid_routing(gates, experts, x, w, b, k, **{**BF16, "min_clear": 0.4 if T >= 8 else 0.0})
    if folded:
        assert_sorted_pairs(triton_interpret, sorted_pairs, experts, E)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,E,k", [(1, 200, 32, 4), (8, 96, 128, 2), (17, 150, 8, 1), (64, 200, 32, 4)])
def test_one_launch_hidden_slices(triton_interpret, monkeypatch, dtype, T, H, E, k):
    """Several hidden slices (small slices forced at small H): partial sums over slices, added by the
    finishing program, on exact inputs (fp32) and on a bf16 grid, and on Gaussian inputs (tolerances)."""
    routing = triton_interpret.routing
    elem = torch.empty(0, dtype=dtype).element_size()
    monkeypatch.setattr(routing, "LOGIT_SLICE_BYTES", T * H * elem // 3)  # 3 or 4 slices, the last one short
    assert routing.logit_splits(T, E, H, elem) in (3, 4)
    x, w, b = exact_inputs(T, H, E, seed=T) if dtype == torch.float32 else grid_inputs(T, min(H, 128), E, seed=T)
    gates, experts, sorted_pairs = routing.route_and_sort_pairs(x, w, b, k)
    assert_valid_routing(gates, experts, x, w, b, k, **(FP32 if dtype == torch.float32 else {**BF16, "min_clear": 0}))
    assert_sorted_pairs(triton_interpret, sorted_pairs, experts, E)
    x, w, b = gaussian_inputs(T, H, E, seed=T, dtype=dtype)
    gates, experts = routing.route_triton(x, w, b, k)
    assert_valid_routing(gates, experts, x, w, b, k, **(FP32_OWN if dtype == torch.float32 else BF16_OWN))


def test_logit_splits(triton_interpret):
    """One hidden slice at decode (T = 1); more as x grows, never past the finishing program's budget."""
    routing = triton_interpret.routing
    logit_splits, LOGIT_PARTIAL_BYTES = routing.logit_splits, routing.LOGIT_PARTIAL_BYTES
    assert logit_splits(1, 32, 2880, 2) == logit_splits(1, 128, 2880, 2) == 1
    for T, E in [(8, 32), (64, 32), (32, 128)]:
        splits = logit_splits(T, E, 2880, 2)
        assert 1 < splits and splits * T * E * 4 <= LOGIT_PARTIAL_BYTES
    assert logit_splits(64, 32, 16, 4) == 1  # never slices narrower than 16


def test_one_launch_repeats_and_resets_its_counter(triton_interpret):
    """The finishing program resets the arrival counter: back-to-back launches (other grids between) give the
    same results, and the counter is 0 after each."""
    routing = triton_interpret.routing
    x, w, b = exact_inputs(9, 80, 32, seed=5)
    first = routing.route_and_sort_pairs(x, w, b, 4)
    counter = routing._COUNTERS[x.device]
    assert counter.tolist() == [0]
    routing.route_and_sort_pairs(*exact_inputs(64, 48, 128, seed=6), 2)  # another grid
    assert counter.tolist() == [0]
    again = routing.route_and_sort_pairs(x, w, b, 4)
    assert counter.tolist() == [0]
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert all(torch.equal(p, q) for p, q in zip(first[2], again[2]))
    assert torch.equal(first[1], route_ref(x, w, b, 4)[1])


def test_empty_batch_and_fallback_past_64_tokens(triton_interpret, monkeypatch):
    """T = 0 launches nothing; 64 tokens route in one launch (no F.linear), 65 take the reference's linear and
    match it, with the sort left to the caller."""
    routing = triton_interpret.routing
    gates, experts, sorted_pairs = routing.route_and_sort_pairs(torch.empty(0, 32), torch.ones(32, 32),
                                                                torch.zeros(32), 4)
    assert gates.shape == experts.shape == (0, 4) and sorted_pairs is None
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: calls.append(a[0].shape[0]) or linear(*a))
    for T in (64, 65):
        x, w, b = exact_inputs(T, 40, 32, seed=T)
        gates, experts, sorted_pairs = routing.route_and_sort_pairs(x, w, b, 4)
        assert calls == ([] if T == 64 else [65])
        assert (sorted_pairs is None) == (T == 65)
        assert torch.equal(experts, torch.topk(linear(x, w, b), 4).indices)
        torch.testing.assert_close(gates, torch.softmax(torch.topk(linear(x, w, b), 4).values, -1),
                                   atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# The MoE's norm in the routing launch (`peagle_kernels.moe.norm_and_route`)
# ---------------------------------------------------------------------------------------------

def unfused_norm_and_route(kernels, h, residual, norm_w, w, b, k):
    """The two launches the fused one replaces: the Triton norm, then the Triton routing of its output."""
    from peagle_kernels.norm import add_rms_norm
    x, new_residual = add_rms_norm(h, residual, norm_w, 1e-5)
    return x, new_residual, *kernels.routing.route_and_sort_pairs(x, w, b, k)


NORM_ROUTE_CASES = [  # (T, H, E, k, slice bytes or None): one slice, several slices (the last one short)
    pytest.param(1, 200, 32, 4, None, id="decode-T1"), pytest.param(3, 96, 8, 2, None, id="T3-E8"),
    pytest.param(8, 150, 128, 4, None, id="T8-E128"), pytest.param(5, 130, 32, 4, 5 * 130 * 4 // 3, id="T5-slices"),
    pytest.param(8, 72, 20, 3, 8 * 72 * 4 // 4, id="T8-slices-E20")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,E,k,slice_bytes", NORM_ROUTE_CASES)
def test_norm_rides_in_the_routing_launch(triton_interpret, monkeypatch, dtype, T, H, E, k, slice_bytes):
    """Up to NORM_ROUTE_MAX_TOKENS tokens, `norm_and_route` is one routing launch (no norm launch) whose outputs
    are those of the norm kernel and the routing kernel run one after the other: the new residual exactly, the
    normed rows within the rounding of a sum taken in another order (fp32 1e-6, bf16 one step), the routing a
    valid top-k of the normed rows' own logits, sorted by expert; and, against the references, within the
    tolerances of each kernel alone."""
    routing = triton_interpret.routing
    if slice_bytes is not None:  # several hidden slices: each program normalises its tokens' whole rows anyway
        monkeypatch.setattr(routing, "LOGIT_SLICE_BYTES", slice_bytes)
        assert routing.logit_splits(T, E, H, 4) > 1
    g = torch.Generator().manual_seed(100 * T + E)
    h, residual = torch.randn(T, H, generator=g).to(dtype), torch.randn(T, H, generator=g).to(dtype)
    norm_w = (1 + 0.2 * torch.randn(H, generator=g)).to(dtype)
    w, b = (torch.randn(E, H, generator=g) * H ** -0.5).to(dtype), torch.randn(E, generator=g).to(dtype)
    assert routing.fuses_norm(h, residual, E, k)
    norm_launches = []
    norm = sys.modules["peagle_kernels.norm"]
    monkeypatch.setattr(norm, "add_rms_norm", lambda *a: norm_launches.append(1) or norm.add_rms_norm_ref(*a))
    x, new_residual, routed = norm_and_route(h, residual, norm_w, 1e-5, w, b, k)
    assert norm_launches == [] and routed.sorted_pairs is not None
    monkeypatch.undo()

    want_x, want_residual, *_ = unfused_norm_and_route(triton_interpret, h, residual, norm_w, w, b, k)
    assert torch.equal(new_residual, want_residual)
    torch.testing.assert_close(x, want_x, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    assert_valid_routing(routed.gates, routed.experts, x, w, b, k,
                         **(FP32_OWN if dtype == torch.float32 else {**BF16_OWN, "min_clear": 0.0}))
    assert_sorted_pairs(triton_interpret, routed.sorted_pairs, routed.experts, E)
    ref_x, ref_residual = add_rms_norm_ref(h, residual, norm_w, 1e-5)
    if dtype == torch.float32:  # (bf16: the interpreter truncates where PyTorch rounds, tests/test_kernels_norm_rope.py)
        assert torch.equal(new_residual, ref_residual)
        torch.testing.assert_close(x, ref_x, rtol=1e-5, atol=1e-6)


def test_norm_and_route_outside_the_fused_sizes(triton_interpret):
    """More tokens than NORM_ROUTE_MAX_TOKENS, MoE summands or no residual: the norm runs on its own, and the
    outputs are the references' (fp32: the residual exactly, the normed rows to 1e-5, a valid routing of them);
    on the references themselves when autograd records."""
    routing = triton_interpret.routing
    g = torch.Generator().manual_seed(0)
    T, H, E, k = routing.NORM_ROUTE_MAX_TOKENS + 1, 64, 32, 4
    w, b, norm_w = torch.randn(E, H, generator=g) / 8, torch.randn(E, generator=g), torch.randn(H, generator=g)
    for h, residual in ((torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)),
                        (torch.randn(3, k, H, generator=g), torch.randn(3, H, generator=g)),  # summands
                        (torch.randn(3, H, generator=g), None)):
        assert not routing.fuses_norm(h, residual, E, k)
        x, new_residual, routed = norm_and_route(h, residual, norm_w, 1e-5, w, b, k)
        ref_x, ref_residual = add_rms_norm_ref(h, residual, norm_w, 1e-5)
        assert torch.equal(new_residual, ref_residual)
        torch.testing.assert_close(x, ref_x, rtol=1e-5, atol=1e-6)
        assert_valid_routing(routed.gates, routed.experts, x, w, b, k, **FP32_OWN)
    w.requires_grad_(True)
    x, new_residual, routed = norm_and_route(h, residual, norm_w, 1e-5, w, b, k)
    assert routed.gates.grad_fn is not None and routed.sorted_pairs is None
    want_x = add_rms_norm_ref(h, residual, norm_w, 1e-5)[0]
    assert torch.equal(x, want_x) and torch.equal(routed.experts, route_ref(want_x, w, b, k)[1])


@pytest.mark.gpu
@pytest.mark.parametrize("E", [32, 128])
@pytest.mark.parametrize("T", [1, 2, 8])
def test_norm_and_route_bf16_cuda(triton_cuda, T, E):
    """Compiled, GPT-OSS shapes: the fused launch gives the unfused pair's residual exactly and its normed rows
    within one bf16 step, and a valid routing of them, also replayed from a CUDA graph."""
    g = torch.Generator().manual_seed(1000 + T)  # not `gaussian_inputs`' seed: h and w must not share draws
    h, residual = (torch.randn(T, 2880, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    norm_w = (1 + 0.2 * torch.randn(2880, generator=g)).to("cuda", torch.bfloat16)
    _, w, b = gaussian_inputs(T, 2880, E, seed=T, dtype=torch.bfloat16, device="cuda")
    x, new_residual, routed = norm_and_route(h, residual, norm_w, 1e-5, w, b, 4)
    want = unfused_norm_and_route(triton_cuda, h, residual, norm_w, w, b, 4)
    assert torch.equal(new_residual, want[1])
    torch.testing.assert_close(x, want[0], rtol=2 ** -7, atol=1e-6)
    assert_valid_routing(routed.gates, routed.experts, x, w, b, 4, **{**BF16_OWN, "min_clear": 0.0})
    assert_sorted_pairs(triton_cuda, routed.sorted_pairs, routed.experts, E)
    assert_graph_replays_exactly(lambda: norm_and_route(h, residual, norm_w, 1e-5, w, b, 4)[2].experts, h)


@pytest.mark.gpu
@pytest.mark.parametrize("E", [32, 128])
@pytest.mark.parametrize("T", [1, 4, 37, 64, 300, 2048])
def test_route_bf16_cuda(triton_cuda, T, E):
    """GPT-OSS router shapes in bf16, compiled."""
    x, w, b = gaussian_inputs(T, 2880, E, seed=T, dtype=torch.bfloat16, device="cuda")
    gates, experts = route(x, w, b, 4)
    own = triton_cuda.routing.one_launch(T, E, 4)
    tol = dict(BF16_OWN if own else BF16)
    if T < 4:  # one or three tokens: among 128 logits a token's top five are often within the tie tolerance,
        tol["min_clear"] = 0.0  # so "most tokens clear" cannot be asked; the top-k-up-to-ties check still holds
    assert_valid_routing(gates, experts, x, w, b, 4, **tol)
    _, _, sorted_pairs = triton_cuda.routing.route_and_sort_pairs(x, w, b, 4)
    assert (sorted_pairs is not None) == own
    if sorted_pairs is not None:
        want = triton_cuda.moe.sort_pairs_by_expert(experts, E)
        assert all(torch.equal(got, ref) for got, ref in zip(sorted_pairs, want))


@pytest.mark.gpu
@pytest.mark.parametrize("T,E", [(1, 32), (8, 32), (64, 32), (8, 128), (32, 128)])
def test_one_launch_repeats_cuda(triton_cuda, pdl, T, E):
    """Many back-to-back launches on two alternating inputs: the finishing program must see every other
    program's partial sums each time (an early or stale read, say of the other input's sums left in the
    reused scratch buffer, would change a result), and leaves the counter at 0. With programmatic dependent
    launch each launch starts while the previous one finishes: its wait must precede the counter's use."""
    routing = triton_cuda.routing
    inputs = [gaussian_inputs(T, 2880, E, seed=T + i, dtype=torch.bfloat16, device="cuda") for i in range(2)]
    firsts = [routing.route_and_sort_pairs(*xwb, 4) for xwb in inputs]
    for (x, w, b), (gates, experts, _) in zip(inputs, firsts):
        assert_valid_routing(gates, experts, x, w, b, 4, **BF16_OWN)
    runs = [routing.route_and_sort_pairs(*inputs[i % 2], 4) for i in range(200)]
    for i, run in enumerate(runs):
        first = firsts[i % 2]
        assert torch.equal(run[0], first[0]) and torch.equal(run[1], first[1])
        assert all(torch.equal(p, q) for p, q in zip(run[2], first[2]))
    assert routing._COUNTERS[inputs[0][0].device].tolist() == [0]


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2, 64, 500])  # one launch (one hidden slice; several); the fallback
def test_route_cuda_graph_capture(triton_cuda, pdl, T):
    x, w, b = gaussian_inputs(T, 2880, 32, seed=0, dtype=torch.bfloat16, device="cuda")

    def routed() -> torch.Tensor:
        gates, experts, sorted_pairs = triton_cuda.routing.route_and_sort_pairs(x, w, b, 4)
        parts = [gates.float().flatten(), experts.float().flatten()]
        return torch.cat(parts + [t.float() for t in sorted_pairs or ()])

    assert_graph_replays_exactly(routed, x)
