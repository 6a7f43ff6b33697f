"""The q/k/v projection, rotation and KV write in one launch (`peagle_kernels.triton_qkv_rope`) against its reference
(`peagle_kernels.rope.qkv_rope_write_kv_ref`: `F.linear`, then the rotation and the cache write in PyTorch), and against
the two launches it replaces (the skinny GEMM, then `rope_write_kv`).

The projection's fp32 sums run in the skinny GEMM's order, so against `F.linear` a projected value may differ by
the summation order (fp32: 1e-5 here; bf16 on the GPU: one rounding step, which the rotation then carries); the
caches hold exactly the returned k and the projected v, the untouched rows keep their sentinel."""
from __future__ import annotations

import pytest
import torch

from kernel_utils import assert_graph_replays_exactly, pdl, triton_cuda, triton_interpret  # noqa: F401  (fixtures)
from peagle_kernels.attention import write_kv_ref
from peagle_kernels.dispatch import use_triton
from peagle_kernels.linear import SKINNY_MAX_TOKENS
from peagle_kernels.rope import qkv_rope_write_kv, qkv_rope_write_kv_ref
from peagle_core.models.layers import Rotary

SENTINEL = -7.0


def _inputs(T: int, H: int, hq: int, hkv: int, d: int, dtype, device: str = "cpu", seed: int = 0,
            num_pages: int = 6, page: int = 16):
    g = torch.Generator().manual_seed(seed * 7919 + T * 131 + hq * 17 + d)
    n = (hq + 2 * hkv) * d
    x = torch.randn(T, H, generator=g)
    w = torch.randn(n, H, generator=g) * H ** -0.5
    b = torch.randn(n, generator=g) * 0.1
    rotary = Rotary([1.0 / 150000 ** (2 * j / d) for j in range(d // 2)], attention_factor=1.3)
    cos, sin = rotary.cos_sin(torch.randint(0, 4096, (T,), generator=g), dtype)
    slots = torch.randperm(num_pages * page, generator=g)[:T]
    slots[::3] = -1  # holes: rejected or padding tokens write nothing
    caches = [torch.full((num_pages, page, hkv, d), SENTINEL, dtype=dtype) for _ in range(2)]
    to = lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)  # noqa: E731
    return to(x), to(w), to(b), to(cos), to(sin), [c.to(device) for c in caches], slots.to(device)


def _check(got, caches, x, w, b, hq, hkv, cos, sin, slots, atol):
    """The returned q and k against the reference; the caches against the reference's stores of the returned k
    and of v (which only the caches hold: checked against the reference's v within the same tolerance)."""
    ref_caches = [torch.full_like(c, SENTINEL) for c in caches]
    want = qkv_rope_write_kv_ref(x, w, b, hq, hkv, cos, sin, *ref_caches, slots)
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape and g_.dtype == w_.dtype and g_.is_contiguous()
        torch.testing.assert_close(g_.float(), w_.float(), atol=atol, rtol=0)
    exact_k = torch.full_like(caches[0], SENTINEL)
    write_kv_ref(got[1], got[1], exact_k, torch.full_like(caches[1], SENTINEL), slots)
    assert torch.equal(caches[0], exact_k)  # the cache holds the returned k, bit for bit
    torch.testing.assert_close(caches[1].float(), ref_caches[1].float(), atol=atol, rtol=0)
    kept = slots[slots >= 0]
    for cache in caches:  # the written rows, and only those, left the sentinel
        touched = (cache.flatten(0, 1) != SENTINEL).flatten(1).any(1)
        assert torch.equal(touched.nonzero().flatten().sort().values.cpu(), kept.sort().values.cpu())


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (4, 4, 32), (3, 1, 16)], ids=["gqa4-64", "mha-32", "gqa3-16"])
@pytest.mark.parametrize("T", [1, 5, SKINNY_MAX_TOKENS])
@pytest.mark.parametrize("H", [256, 300], ids=["even-K", "ragged-K"])
def test_one_launch_matches_the_reference(triton_interpret, T, H, hq, hkv, d):
    x, w, b, cos, sin, caches, slots = _inputs(T, H, hq, hkv, d, torch.float32)
    assert use_triton(x)
    got = qkv_rope_write_kv(x, w, b, hq, hkv, cos, sin, *caches, slots)
    _check(got, caches, x, w, b, hq, hkv, cos, sin, slots, atol=1e-5)


def test_one_launch_equals_the_two_it_replaces_and_needs_no_bias(triton_interpret):
    """Against the skinny GEMM then the rope-and-write launch (both interpreted): the same sums in the same order,
    the same rounding, so bit for bit; and without a bias."""
    from peagle_kernels.rope import rope_write_kv
    from peagle_kernels.triton_linear import linear_triton
    for bias in (True, False):
        x, w, b, cos, sin, caches, slots = _inputs(7, 256, 8, 2, 64, torch.float32, seed=3)
        b = b if bias else None
        got = qkv_rope_write_kv(x, w, b, 8, 2, cos, sin, *caches, slots)
        two = [torch.full_like(c, SENTINEL) for c in caches]
        q, k, v = linear_triton(x, w, b).split([8 * 64, 2 * 64, 2 * 64], -1)
        want = rope_write_kv(q.reshape(7, 8, 64), k.reshape(7, 2, 64), v.reshape(7, 2, 64), cos, sin, *two, slots)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(caches[0], two[0]) and torch.equal(caches[1], two[1])


def test_outside_decode_sizes_the_two_launches_run(triton_interpret, monkeypatch):
    """More than SKINNY_MAX_TOKENS rows, or a head the kernel's pieces do not tile: `linear` then `rope_write_kv`."""
    import peagle_kernels.triton_qkv_rope as fused

    def fail(*a, **kw):
        raise AssertionError("the fused kernel ran")
    monkeypatch.setattr(fused, "qkv_rope_write_kv_triton", fail)
    for T, (hq, hkv, d) in ((SKINNY_MAX_TOKENS + 3, (8, 2, 64)), (4, (4, 2, 8))):
        x, w, b, cos, sin, caches, slots = _inputs(T, 64, hq, hkv, d, torch.float32, num_pages=8)
        got = qkv_rope_write_kv(x, w, b, hq, hkv, cos, sin, *caches, slots)
        _check(got, caches, x, w, b, hq, hkv, cos, sin, slots, atol=1e-5)
    with pytest.raises(AssertionError, match="fused kernel ran"):
        x, w, b, cos, sin, caches, slots = _inputs(2, 64, 8, 2, 64, torch.float32)
        qkv_rope_write_kv(x, w, b, 8, 2, cos, sin, *caches, slots)


def test_bad_shapes_are_refused(triton_interpret):
    x, w, b, cos, sin, caches, slots = _inputs(3, 64, 4, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="packed weight"):
        qkv_rope_write_kv(x, w[:-32], b, 4, 2, cos, sin, *caches, slots)
    with pytest.raises(ValueError, match="cos/sin"):
        qkv_rope_write_kv(x, w, b, 4, 2, cos[:2], sin[:2], *caches, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        qkv_rope_write_kv(x, w, b, 4, 2, cos, sin, *caches, slots[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, SKINNY_MAX_TOKENS])
def test_compiled_one_launch_bf16_at_the_20b_shape(triton_cuda, pdl, T):
    """Compiled at GPT-OSS-20B's attention (hidden 2880, 64 q heads and 8 kv heads of 64): within a rounding step
    of the reference (bf16 carries the summation order's difference through the rotation), the caches exact to the
    returned k; and it replays from a CUDA graph exactly."""
    x, w, b, cos, sin, caches, slots = _inputs(T, 2880, 64, 8, 64, torch.bfloat16, device="cuda", num_pages=8)
    got = qkv_rope_write_kv(x, w, b, 64, 8, cos, sin, *caches, slots)
    _check(got, caches, x, w, b, 64, 8, cos, sin, slots, atol=3e-2)
    assert_graph_replays_exactly(lambda: qkv_rope_write_kv(x, w, b, 64, 8, cos, sin, *caches, slots)[0], x)
