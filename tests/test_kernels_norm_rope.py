"""Fused residual add + RMSNorm and the one-launch rotary embedding equal their PyTorch references, and the
models that carry (h, residual) compute what the unfused `h = h + block(norm(h))` forward computes.

CPU: Triton's interpreter. Tolerances, Triton against reference:
  norm   fp32: new residual exact, normed within 1e-6 (summation order of mean(x^2));
         fp16: new residual exact, normed within one fp16 step (2^-10 relative);
         bf16: new residual within one bf16 step (2^-7 relative), normed within two (2^-6): the interpreter
               truncates fp32 to bf16 where the GPU and PyTorch round to nearest.
  norm over MoE summands [T, S, H]: the new residual equals PyTorch's `x.sum(1) + residual` bit for bit in
         fp32 and fp16, and in bf16 on values where no rounding happens (so truncation cannot differ).
  rope   fp32 and fp16: bit-identical; bf16: within 2^-6 of |x1*cos| + |x2*sin| per element (the interpreter
         truncates each of the three roundings).
GPU (skipped here): the compiled kernels at GPT-OSS-20B shapes, bf16, where the new residual and the rotation
are bit-identical, and CUDA-graph replay.
"""
from __future__ import annotations

import pytest
import torch

from kernel_utils import assert_graph_replays_exactly, pdl, triton_cuda, triton_interpret  # noqa: F401  (fixtures)
from peagle_kernels.dispatch import use_triton
from peagle_kernels.norm import add_rms_norm, add_rms_norm_ref
from peagle_kernels.rope import apply_rope, apply_rope_ref
from peagle_core.loading.checkpoint import init_random_
from peagle_core.models.drafter import Drafter
from peagle_core.models.gpt_oss import GptOss
from peagle_core.models.layers import ForwardMeta, Rotary
from peagle_core.testing import tiny_drafter_config, tiny_target_config

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NORM_TOL = {torch.float32: (0.0, 1e-6), torch.float16: (0.0, 2 ** -10), torch.bfloat16: (2 ** -7, 2 ** -6)}


def _rand(g: torch.Generator, *shape: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _assert_norm_close(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    residual_rtol, normed_rtol = NORM_TOL[want[0].dtype]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
    torch.testing.assert_close(got[1], want[1], rtol=residual_rtol, atol=0)
    torch.testing.assert_close(got[0], want[0], rtol=normed_rtol, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# add_rms_norm
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["no-residual", "residual"])
@pytest.mark.parametrize("rows,H", [(0, 64), (1, 2880), (7, 256), (5, 64), (3, 100)])
def test_add_rms_norm_matches_reference(triton_interpret, rows, H, with_residual, dtype):
    g = torch.Generator().manual_seed(rows * 1000 + H)
    x = _rand(g, rows, H, dtype=dtype) * 3
    residual = _rand(g, rows, H, dtype=dtype) if with_residual else None
    weight = _rand(g, H, dtype=dtype)
    assert use_triton(x)
    got = add_rms_norm(x, residual, weight, 1e-5)
    _assert_norm_close(got, add_rms_norm_ref(x, residual, weight, 1e-5))
    if residual is None:
        assert got[1] is x  # nothing added: the stream is x itself, no copy


def test_add_rms_norm_strided_and_batched_inputs(triton_interpret):
    """Rows sliced out of a wider tensor (row stride > H) and leading batch dimensions."""
    g = torch.Generator().manual_seed(0)
    wide = _rand(g, 6, 200)
    x, residual, weight = wide[:, :64], _rand(g, 6, 64), _rand(g, 64)
    _assert_norm_close(add_rms_norm(x, residual, weight, 1e-6), add_rms_norm_ref(x, residual, weight, 1e-6))
    x3, r3 = _rand(g, 2, 3, 64), _rand(g, 2, 3, 64)
    _assert_norm_close(add_rms_norm(x3, r3, weight, 1e-6), add_rms_norm_ref(x3, r3, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,H", [(0, 64), (1, 2880), (7, 37), (3, 100)])
@pytest.mark.parametrize("S", [1, 2, 4])
def test_add_rms_norm_over_summands_matches_reference(triton_interpret, S, rows, H, dtype):
    """x [T, S, H] with a residual [T, H] (the form read from the shapes) stands for x.sum(1). The new residual
    is PyTorch's `x.sum(1) + residual` (fp32 sum, rounded once, then the add)."""
    g = torch.Generator().manual_seed(rows * 1000 + H + S)
    x = _rand(g, rows, S, H, dtype=dtype) * 3
    residual = _rand(g, rows, H, dtype=dtype)
    weight = _rand(g, H, dtype=dtype)
    got = add_rms_norm(x, residual, weight, 1e-5)
    want = add_rms_norm_ref(x, residual, weight, 1e-5)
    pytorch = x.sum(1) + residual
    assert torch.equal(want[1], pytorch)
    if dtype != torch.bfloat16:
        _assert_norm_close(got, want)
        assert torch.equal(got[1], pytorch)
        return
    # bf16: the interpreter truncates the sum and the add, each within one step (2^-7) of what it rounds, so the
    # new residual is bounded elementwise (cancellation makes a relative check meaningless; the next test is
    # exact), and the norm is checked on the residual it was given.
    assert got[0].shape == got[1].shape == (rows, H) and got[1].dtype == dtype
    bound = 2 ** -7 * (x.sum(1).float().abs() + 2 * pytorch.float().abs())
    assert ((got[1].float() - pytorch.float()).abs() <= bound).all()
    _assert_norm_close(got, add_rms_norm_ref(got[1], None, weight, 1e-5))


@pytest.mark.parametrize("S", [2, 4])
def test_add_rms_norm_over_bf16_summands_adds_each_once(triton_interpret, S):
    """bf16, multiples of 1/8 below 2 in magnitude: every sum is exact in bf16, so no rounding (which the
    interpreter truncates) can hide a summand dropped or added twice; the new residual is PyTorch's bit for bit."""
    g = torch.Generator().manual_seed(S)
    grid = lambda *shape: (torch.randint(-16, 16, shape, generator=g) / 8).bfloat16()  # noqa: E731
    x, weight = grid(5, S, 2880), _rand(g, 2880, dtype=torch.bfloat16)
    residual = grid(5, 2880)
    normed, new_residual = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, x.sum(1) + residual)
    torch.testing.assert_close(normed, add_rms_norm_ref(x, residual, weight, 1e-5)[0],
                               rtol=2 ** -6, atol=1e-6)


def test_add_rms_norm_summand_form_and_shape_errors(triton_interpret):
    """A 3-D x alone is rows to normalise (as before summands existed); summands need a residual that drops
    their S dimension."""
    g = torch.Generator().manual_seed(2)
    x, weight = _rand(g, 3, 4, 64), _rand(g, 64)
    for fn in (add_rms_norm, add_rms_norm_ref):
        normed, new_residual = fn(x, None, weight, 1e-5)
        assert normed.shape == (3, 4, 64) and new_residual is x
        with pytest.raises(ValueError, match="residual of shape"):
            fn(x, _rand(g, 4, 64), weight, 1e-5)
        with pytest.raises(ValueError, match="S >= 1"):
            fn(x[:, :0], _rand(g, 3, 64), weight, 1e-5)


def test_add_rms_norm_takes_the_reference_when_autograd_records(triton_interpret):
    """The kernels have no backward: a call that needs gradients (drafter training) runs the reference."""
    g = torch.Generator().manual_seed(1)
    x, residual, weight = _rand(g, 4, 64), _rand(g, 4, 64), _rand(g, 64).requires_grad_()
    normed, _ = add_rms_norm(x, residual, weight, 1e-5)
    assert normed.grad_fn is not None
    assert torch.equal(normed, add_rms_norm_ref(x, residual, weight, 1e-5)[0])


# ---------------------------------------------------------------------------------------------
# apply_rope
# ---------------------------------------------------------------------------------------------

def _rope_inputs(g: torch.Generator, T: int, hq: int, hkv: int, d: int, dtype, device="cpu"):
    """q and k as views of one fused projection output (non-contiguous rows), cos/sin as the model makes them."""
    qkv = _rand(g, T, (hq + hkv) * d, dtype=dtype, device=device)
    q, k = qkv[:, : hq * d].view(T, hq, d), qkv[:, hq * d:].view(T, hkv, d)
    rotary = Rotary([1.0 / 150000 ** (2 * j / d) for j in range(d // 2)], attention_factor=1.3)
    cos, sin = rotary.cos_sin(torch.randint(0, 4096, (T,), generator=g).to(device), dtype)
    return q, k, cos, sin


def _assert_rope_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    if want.dtype != torch.bfloat16:
        assert torch.equal(got, want)
        return
    x1, x2 = x.float().abs().chunk(2, dim=-1)
    c, s = cos.float().abs(), sin.float().abs()
    bound = torch.cat([x1 * c + x2 * s, x2 * c + x1 * s], dim=-1) * 2 ** -6
    assert ((got.float() - want.float()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,hq,hkv,d", [(0, 8, 2, 64), (1, 64, 8, 64), (5, 8, 2, 64), (3, 6, 1, 32), (4, 3, 3, 16)])
def test_apply_rope_matches_reference(triton_interpret, T, hq, hkv, d, dtype):
    g = torch.Generator().manual_seed(T * 100 + hq)
    q, k, cos, sin = _rope_inputs(g, T, hq, hkv, d, dtype)
    assert use_triton(q)
    got, want = apply_rope(q, k, cos, sin), apply_rope_ref(q, k, cos, sin)
    _assert_rope_close(got[0], want[0], q, cos, sin)
    _assert_rope_close(got[1], want[1], k, cos, sin)


def test_apply_rope_rejects_bad_shapes(triton_interpret):
    q, k, cos, sin = _rope_inputs(torch.Generator().manual_seed(0), 2, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="cos/sin"):
        triton_interpret.rope.apply_rope_triton(q, k, cos[:, :, :4], sin[:, :, :4])
    with pytest.raises(ValueError, match="dtype"):
        triton_interpret.rope.apply_rope_triton(q, k, cos.double(), sin.double())


# ---------------------------------------------------------------------------------------------
# The models: (h, residual) carried between blocks
# ---------------------------------------------------------------------------------------------

def test_target_carrying_the_residual_equals_the_unfused_forward():
    """fp32, references: the final normed hidden and the aux states (streams entering layers 0 and 2, and the
    stream before the final norm) are bit-identical to `h = h + block(norm(h))` layer by layer."""
    cfg = tiny_target_config()
    model = init_random_(GptOss(cfg), 0).eval()
    model.set_aux_layers([0, 2, cfg.num_hidden_layers])
    ids = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    meta = ForwardMeta.for_sequences([7, 5])
    with torch.no_grad():
        normed, aux = model(ids, meta)
        h, streams = model.model.embed_tokens(ids), []
        for layer in model.model.layers:
            streams.append(h)
            h = h + layer.self_attn(layer.input_layernorm(h), meta)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        streams.append(h)
    assert torch.equal(normed, model.model.norm(h))
    assert torch.equal(aux, torch.cat([streams[0], streams[2], streams[-1]], dim=-1))


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_drafter_carrying_the_residual_equals_the_unfused_forward(norm_before_residual):
    cfg = tiny_drafter_config(tiny_target_config(), layers=3, norm_before_residual=norm_before_residual)
    drafter = init_random_(Drafter(cfg, 3), 0).eval()
    g = torch.Generator().manual_seed(0)
    ids, hidden = torch.randint(0, cfg.vocab_size, (9,), generator=g), torch.randn(9, cfg.hidden_size, generator=g)
    meta = ForwardMeta.for_sequences([4, 5])
    with torch.no_grad():
        normed, prenorm = drafter(ids, hidden, meta)
        mid = drafter.midlayer
        h = mid.hidden_norm(hidden)
        residual = h if norm_before_residual else hidden
        x = torch.cat([mid.input_layernorm(drafter.embed_tokens(ids)), h], dim=-1)
        for layer in [mid, *drafter.layers.values()]:
            if layer is not mid:
                residual = x + residual
                x = layer.input_layernorm(residual)
            residual = layer.self_attn(x, meta) + residual
            x = layer.mlp(layer.post_attention_layernorm(residual))
    assert torch.equal(prenorm, x + residual)
    assert torch.equal(normed, drafter.norm(x + residual))


def test_target_moe_sum_folded_into_the_next_norm_changes_nothing(triton_interpret):
    """Without tensor parallelism each layer hands its MoE's k summands to the next norm (the next layer's or the
    final one), which adds them. Forced off (an all-reduce that adds nothing, as at TP=1 but not the default
    function), the MoE sums them itself; the final hidden and aux states (streams entering layers 0 and 1, from
    summands, and the one before the final norm) are bit-identical (fp32: both add the k rows in order)."""
    cfg = tiny_target_config(num_local_experts=6, num_experts_per_tok=4)
    model = init_random_(GptOss(cfg), 0).eval()
    model.set_aux_layers([0, 1, 3, cfg.num_hidden_layers])
    ids = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    meta = ForwardMeta.for_sequences([7, 5])
    shapes = []
    model.model.layers[0].register_forward_hook(lambda module, args, out: shapes.append(tuple(out[0].shape)))
    with torch.no_grad():
        folded = model(ids, meta)
        for layer in model.model.layers:
            layer.all_reduce = lambda t: t
        unfolded = model(ids, meta)
    assert shapes == [(12, 4, cfg.hidden_size), (12, cfg.hidden_size)]  # summands, then the MoE's own sum
    for got, want in zip(folded, unfolded):
        assert torch.equal(got, want)


@pytest.mark.parametrize("lengths", [[7, 5], [3, 2]])  # 12 tokens: the MoE's norm on its own; 5: in the routing launch
def test_models_with_triton_norm_and_rope_match_the_references(triton_interpret, lengths):
    """The wiring: target and drafter forwards with the Triton kernels (interpreted) agree with the references."""
    from peagle_kernels.dispatch import set_triton_enabled

    cfg = tiny_target_config()
    target = init_random_(GptOss(cfg), 0).eval()
    target.set_aux_layers([1, 2, 3])
    drafter = init_random_(Drafter(tiny_drafter_config(cfg), 3), 1).eval()
    assert triton_interpret.routing.fuses_norm(torch.empty(5, 1), torch.empty(5, 1), cfg.num_local_experts,
                                               cfg.num_experts_per_tok)
    ids = torch.randint(0, cfg.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    meta = ForwardMeta.for_sequences(lengths)
    outs = {}
    with torch.no_grad():
        for kernels_on in (True, False):
            set_triton_enabled(kernels_on)
            normed, aux = target(ids, meta)
            outs[kernels_on] = (normed, aux, *drafter(ids, drafter.combine(aux), meta))
    for got, want in zip(outs[True], outs[False]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# GPU: compiled kernels at GPT-OSS-20B shapes (hidden 2880, 64 q heads, 8 kv heads, head_dim 64)
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 37])
def test_compiled_kernels_bf16_bit_exact_where_pytorch_rounds_once(triton_cuda, pdl, T):
    g = torch.Generator().manual_seed(T)
    x, residual, weight = (_rand(g, *s, dtype=torch.bfloat16, device="cuda") for s in ((T, 2880), (T, 2880), (2880,)))
    normed, new_residual = add_rms_norm(x, residual, weight, 1e-5)
    want = add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, want[1])
    torch.testing.assert_close(normed, want[0], rtol=2 ** -7, atol=1e-6)  # one bf16 step at most
    q, k, cos, sin = _rope_inputs(g, T, 64, 8, 64, torch.bfloat16, device="cuda")
    for got, want in zip(apply_rope(q, k, cos, sin), apply_rope_ref(q, k, cos, sin)):
        assert torch.equal(got, want)
    assert_graph_replays_exactly(lambda: add_rms_norm(x, residual, weight, 1e-5)[0], x)
    assert_graph_replays_exactly(lambda: apply_rope(q, k, cos, sin)[0], q)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 37])
def test_compiled_norm_over_bf16_summands_is_pytorchs_sum(triton_cuda, T):
    """GPT-OSS-20B's MoE summands (k = 4 rows of 2880): the new residual is PyTorch's `x.sum(1) + residual`."""
    g = torch.Generator().manual_seed(T)
    x, residual, weight = (_rand(g, *shape, dtype=torch.bfloat16, device="cuda")
                           for shape in ((T, 4, 2880), (T, 2880), (2880,)))
    normed, new_residual = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, x.sum(1) + residual)
    torch.testing.assert_close(normed, add_rms_norm_ref(x, residual, weight, 1e-5)[0], rtol=2 ** -7, atol=1e-6)
