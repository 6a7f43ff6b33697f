"""Triton paged attention and KV write (alone, and fused with the rotary embedding) equal their PyTorch references.

CPU: Triton's interpreter, fp32, atol = rtol = 1e-4 (differences are summation order only). The fused rope + KV
write is exact: its rotation equals apply_rope's kernel bit for bit and its cache stores equal write_kv_ref's of
that rotation (in fp32 also the whole reference; in bf16 the interpreter truncates where PyTorch rounds).
GPU (skipped here): compiled kernels in bf16 against the fp32 reference on the same inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernel_utils import pdl, triton_cuda, triton_interpret  # noqa: F401  (fixtures)
from peagle_kernels.attention import attend, paged_attention, paged_attention_ref, varlen_attention, write_kv_ref
from peagle_kernels.dispatch import set_triton_enabled, use_triton
from peagle_kernels.rope import apply_rope, rope_write_kv, rope_write_kv_ref
from peagle_core.models.layers import Attention, ForwardMeta, Rotary

TOL = dict(atol=1e-4, rtol=1e-4)


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    positions: torch.Tensor

    def args(self, sinks, window, scale):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc,
                self.positions, sinks, window, scale)


def make_batch(requests: list[tuple[int, int]], hq: int, hkv: int, d: int, page: int, *, pad_tokens: int = 0,
               padding_slots: int = 0, device: str = "cpu", dtype=torch.float32, seed: int = 0) -> Batch:
    """requests: (query tokens, seq_len) each; queries are the last tokens of the sequence.

    Pages are a random permutation (so reads really gather), `padding_slots` query tokens of the
    last non-empty request are replaced by drafter-style padding at position 0, and `pad_tokens`
    trailing tokens belong to no request (their output must stay zero).
    """
    g = torch.Generator().manual_seed(seed)
    max_pages = max(-(-L // page) for _, L in requests)
    num_pages = len(requests) * max_pages + 3
    perm = torch.randperm(num_pages, generator=g)[: len(requests) * max_pages]
    block_tables = perm.view(len(requests), max_pages).to(torch.int32)
    positions = [torch.arange(L - n, L) for n, L in requests]
    if padding_slots:
        last = max(i for i, (n, _) in enumerate(requests) if n > 0)
        positions[last][:padding_slots] = 0  # non-contiguous positions: 0, 0, p, p+1 ...
    T = sum(n for n, _ in requests)
    positions = torch.cat(positions + [torch.zeros(pad_tokens, dtype=torch.long)])
    qsl = torch.tensor([0] + [n for n, _ in requests], dtype=torch.int32).cumsum(0).to(torch.int32)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return Batch(q=rand(T + pad_tokens, hq, d), k_cache=rand(num_pages, page, hkv, d),
                 v_cache=rand(num_pages, page, hkv, d), block_tables=block_tables.to(device),
                 seq_lens=torch.tensor([L for _, L in requests], dtype=torch.int32, device=device),
                 query_start_loc=qsl.to(device), positions=positions.to(device))


# A mixed batch: prefill chunk from 0, a prefill chunk continuing a long sequence (crosses the
# window and several KV tiles), an empty request, a verify query, a decode token, and a drafter
# request with padding slots at position 0.
MIXED = [(9, 9), (30, 150), (0, 20), (5, 77), (1, 130), (6, 40)]
DECODE = [(1, 5), (1, 140), (1, 33), (1, 1)]
LONG_DECODE = [(1, 3000), (1, 700), (2, 50)]  # H200, GPT-OSS heads: the split-KV path

CASES = [  # (requests, Hq, Hkv, D, page, window, sinks, splits)
    pytest.param(MIXED, 8, 2, 16, 16, None, True, None, id="mixed-g4-full-sinks"),
    pytest.param(MIXED, 6, 2, 32, 32, 8, True, None, id="mixed-g3-window8-sinks"),
    pytest.param(MIXED, 2, 2, 16, 16, 8, False, None, id="mixed-g1-window8-nosinks"),
    pytest.param(MIXED, 8, 1, 64, 16, None, False, 3, id="mixed-g8-d64-split3"),
    pytest.param(DECODE, 8, 1, 64, 32, 8, True, None, id="decode-g8-window8"),
    pytest.param(DECODE, 4, 2, 32, 16, None, True, 4, id="decode-g2-split4-sinks"),
    pytest.param(DECODE, 5, 5, 16, 32, 8, True, 2, id="decode-g1-window8-split2"),
    # one KV tile in the window: 7 of 8 splits have no keys (their empty partials merge to nothing)
    pytest.param(DECODE, 8, 2, 16, 16, 8, False, 8, id="decode-g4-window8-split8-nosinks"),
    pytest.param(MIXED, 8, 2, 16, 16, 8, True, 5, id="mixed-g4-window8-split5-sinks"),
]


@pytest.mark.parametrize("requests,hq,hkv,d,page,window,with_sinks,splits", CASES)
def test_paged_attention_matches_reference(triton_interpret, requests, hq, hkv, d, page, window, with_sinks,
                                           splits):
    b = make_batch(requests, hq, hkv, d, page, padding_slots=2, pad_tokens=1)
    sinks = torch.randn(hq) * 2 if with_sinks else None
    scale = d ** -0.5
    ref = paged_attention_ref(*b.args(sinks, window, scale))
    if splits is None:
        assert use_triton(b.q)
        out = paged_attention(*b.args(sinks, window, scale))  # through the dispatcher
    else:
        out = triton_interpret.attention.paged_attention_triton(*b.args(sinks, window, scale), num_kv_splits=splits)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **TOL)
    assert out[-1].abs().max() == 0  # the token outside every request


@pytest.mark.parametrize("splits", [1, 4])
def test_paged_attention_writes_every_output_token(triton_interpret, monkeypatch, splits):
    """The output is not zeroed first: the tiles write their tokens and zero the padding tokens, here more than a
    tile holds (20, BLOCK_Q = 8), after an empty request. A NaN-filled output buffer shows any token left out."""
    b = make_batch([(2, 40), (0, 9), (1, 17), (1, 3)], 4, 2, 16, 16, pad_tokens=20)
    sinks = torch.randn(4)
    ref = paged_attention_ref(*b.args(sinks, None, 0.25))
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: empty_like(t, **kw).fill_(float("nan")))
    out = triton_interpret.attention.paged_attention_triton(*b.args(sinks, None, 0.25), num_kv_splits=splits)
    torch.testing.assert_close(out, ref, **TOL)
    assert out[4:].abs().max() == 0


def test_kv_splits_follow_the_keys_a_tile_can_see(triton_interpret):
    """The split count (a GPU's choice; CPU launches never split): bs-1 decode on an H200's 132 SMs splits a
    full-attention layer's 16384-key capacity 32 ways, but a 128-token sliding-window layer not at all (its tile
    sees at most 129 keys: one split, no merge launch); a full grid never splits."""
    kv_splits = triton_interpret.attention.kv_splits
    assert kv_splits(16, 132, 16384, 128) == 32
    assert kv_splits(16, 132, 128 + 2 - 1, 128) == 1
    assert kv_splits(16, 132, 1024, 128) == 2
    assert kv_splits(132, 132, 8192, 128) == 1


def test_window_and_sinks_change_the_result(triton_interpret):
    """Guards the oracle: the cases above would not notice a kernel that ignored window or sinks."""
    b = make_batch(MIXED, 4, 2, 16, 16)
    full = paged_attention(*b.args(None, None, 0.25))
    assert not torch.allclose(full, paged_attention(*b.args(None, 8, 0.25)), **TOL)
    assert not torch.allclose(full, paged_attention(*b.args(torch.ones(4), None, 0.25)), **TOL)


def test_paged_attention_all_requests_empty(triton_interpret):
    b = make_batch([(0, 4), (0, 0)], 4, 2, 16, 16, pad_tokens=3)
    out = paged_attention(*b.args(torch.zeros(4), 8, 0.25))
    assert out.shape == (3, 4, 16) and out.abs().max() == 0


def test_paged_attention_rejects_bad_shapes(triton_interpret):
    b = make_batch([(2, 4)], 6, 4, 16, 16)  # 6 query heads over 4 kv heads
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(*b.args(None, None, 0.25))
    b = make_batch([(2, 4)], 4, 2, 16, 16)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention(*b.args(None, None, 0.25)[:5], b.query_start_loc[:1], b.positions, None, None, 0.25)


# --------------------------------------------------------------------------------------------
# rope_write_kv: rotation of q and k and the paged K/V store in one launch
# --------------------------------------------------------------------------------------------

SENTINEL = -7.0  # what the caches hold before the write: a stray store shows


def _rope_kv_inputs(g: torch.Generator, T: int, hq: int, hkv: int, d: int, dtype, cache_dtype, page: int = 16,
                    num_pages: int = 5):
    """q, k, v as views of one fused projection output (as the model makes them), cos/sin from `Rotary`, slots
    a random choice of the flat cache rows with -1 holes, and sentinel-filled caches."""
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = (t.view(T, h, d) for t, h in zip(qkv.split([hq * d, hkv * d, hkv * d], dim=-1), (hq, hkv, hkv)))
    rotary = Rotary([1.0 / 150000 ** (2 * j / d) for j in range(d // 2)], attention_factor=1.3)
    cos, sin = rotary.cos_sin(torch.randint(0, 4096, (T,), generator=g), dtype)
    slots = torch.randperm(num_pages * page, generator=g)[:T]
    slots[torch.rand(T, generator=g) < 0.3] = -1
    slots[::4] = -1  # a hole at the start and every few tokens whatever the draw
    caches = [torch.full((num_pages, page, hkv, d), SENTINEL, dtype=cache_dtype) for _ in range(2)]
    return q, k, v, cos, sin, caches, slots


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "bf16-in-fp32"])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)], ids=["gqa4", "mha"])
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("T", [0, 1, 5, 33])
def test_rope_write_kv_equals_rope_then_write_kv(triton_interpret, T, hq, hkv, d, dtype, cache_dtype):
    g = torch.Generator().manual_seed(T * 1000 + hq * 10 + d)
    q, k, v, cos, sin, caches, slots = _rope_kv_inputs(g, T, hq, hkv, d, dtype, cache_dtype)
    assert use_triton(q)
    q_rot, k_rot = rope_write_kv(q, k, v, cos, sin, *caches, slots)  # through the dispatcher
    want_q, want_k = apply_rope(q, k, cos, sin)  # the separate rope kernel
    assert q_rot.is_contiguous() and k_rot.is_contiguous()
    assert torch.equal(q_rot, want_q) and torch.equal(k_rot, want_k)
    expected = [torch.full_like(c, SENTINEL) for c in caches]
    write_kv_ref(want_k, v, *expected, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    kept = slots[slots >= 0]
    for cache in caches:  # guards the oracle: the written rows, and only those, left the sentinel
        touched = (cache.flatten(0, 1) != SENTINEL).flatten(1).any(1)
        assert torch.equal(touched.nonzero().flatten().sort().values, kept.sort().values)
    if dtype == torch.float32:  # fp32: the interpreter rounds as PyTorch does, so the whole reference holds too
        ref_caches = [torch.full_like(c, SENTINEL) for c in caches]
        ref = rope_write_kv_ref(q, k, v, cos, sin, *ref_caches, slots)
        assert torch.equal(q_rot, ref[0]) and torch.equal(k_rot, ref[1])
        assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


def test_rope_write_kv_rejects_bad_slot_mapping(triton_interpret):
    g = torch.Generator().manual_seed(0)
    q, k, v, cos, sin, caches, slots = _rope_kv_inputs(g, 3, 4, 2, 16, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_write_kv(q, k, v, cos, sin, *caches, slots[:2])


def test_paged_attention_layer_with_fused_rope_write_matches_the_references(triton_interpret):
    """The wiring in `Attention.forward`'s paged path: kernels on (interpreted) and off give the same caches and
    the same output. Two requests (a prefill from 0, a continuation over cached keys) and a padding token (slot
    -1). The caches agree to fp32 rounding, not bit for bit: with kernels on, the q/k/v projection of these 9
    tokens runs the skinny Triton GEMM's loop (in `peagle_kernels.triton_qkv_rope`, with the rotation and the write),
    which sums in another order than `F.linear`; slots no token writes stay bit-identical."""
    torch.manual_seed(0)
    hq, hkv, d, page = 4, 2, 16, 16
    rotary = Rotary([1.0 / 10000 ** (2 * j / d) for j in range(d // 2)])
    attn = Attention(32, 32, hq, hkv, d, bias=True, sinks=True, sliding_window=None, rotary=rotary).eval()
    attn.pack_qkv()
    block_tables = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32)
    positions = torch.cat([torch.arange(5), torch.arange(20, 23), torch.zeros(1, dtype=torch.long)])
    rows = torch.cat([torch.zeros(5, dtype=torch.long), torch.ones(3, dtype=torch.long)])
    slots = torch.cat([block_tables[rows, positions[:8] // page].long() * page + positions[:8] % page,
                       torch.tensor([-1])])
    meta = ForwardMeta(positions=positions, query_start_loc=torch.tensor([0, 5, 8], dtype=torch.int32),
                       seq_lens=torch.tensor([5, 23], dtype=torch.int32), slot_mapping=slots, block_tables=block_tables)
    x, cache = torch.randn(9, 32), torch.randn(2, 5, page, hkv, d)  # cache: keys of request 1's first 20 positions
    outs = {}
    with torch.no_grad():
        for kernels_on in (True, False):
            set_triton_enabled(kernels_on)
            attn.kv_cache = tuple(cache.clone())
            with rotary.once_for(positions, x.dtype):
                outs[kernels_on] = (attn(x, meta), *attn.kv_cache)
    set_triton_enabled(True)  # the fixture restores the previous setting
    torch.testing.assert_close(outs[True][0], outs[False][0], **TOL)
    written = torch.zeros(5 * page, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for on, off, before in zip(outs[True][1:], outs[False][1:], cache):
        on, off, before = (t.flatten(0, 1) for t in (on, off, before))
        torch.testing.assert_close(on[written], off[written], atol=1e-6, rtol=1e-6)
        assert torch.equal(on[~written], before[~written]) and torch.equal(off[~written], before[~written])
        assert not torch.equal(on[written], before[written])  # the layer did write


@pytest.mark.gpu
@pytest.mark.parametrize("requests,hq,hkv,d,page,window", [
    (MIXED, 64, 8, 64, 16, 128), (MIXED, 64, 8, 64, 16, None), (DECODE, 64, 8, 64, 16, None),
    ([(1, 3000)], 64, 8, 64, 16, None), ([(8, 3000)] * 3, 64, 8, 64, 32, 128)])
def test_paged_attention_bf16_cuda(triton_cuda, requests, hq, hkv, d, page, window):
    b = make_batch(requests, hq, hkv, d, page, padding_slots=2, pad_tokens=1, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(hq, device="cuda")
    args = b.args(sinks, window, d ** -0.5)
    ref = paged_attention_ref(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args])
    out = paged_attention(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for splits in (1, 4):
        forced = triton_cuda.attention.paged_attention_triton(*args, num_kv_splits=splits)
        torch.testing.assert_close(forced.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_rope_write_kv_bf16_cuda(triton_cuda):
    """Compiled: the rotation bit-identical to the rope-only launch, the caches to `write_kv_ref` of its output."""
    g = torch.Generator().manual_seed(1)
    q, k, v, cos, sin, caches, slots = (t.cuda() if torch.is_tensor(t) else [c.cuda() for c in t] for t in
                                        _rope_kv_inputs(g, 37, 64, 8, 64, torch.bfloat16, torch.bfloat16, num_pages=64))
    q_rot, k_rot = rope_write_kv(q, k, v, cos, sin, *caches, slots)
    want_q, want_k = apply_rope(q, k, cos, sin)
    assert torch.equal(q_rot, want_q) and torch.equal(k_rot, want_k)
    expected = [torch.full_like(c, SENTINEL) for c in caches]
    write_kv_ref(want_k, v, *expected, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.gpu
@pytest.mark.parametrize("requests", [MIXED, LONG_DECODE], ids=["one-pass", "split-kv"])
def test_paged_attention_cuda_graph_capture(triton_cuda, pdl, requests):
    """No host sync: the fused rope + KV write and attention capture into a CUDA graph and replay exactly (also
    with programmatic dependent launch: rope, attention and the split merge then overlap back to back)."""
    b = make_batch(requests, 64, 8, 64, 16, pad_tokens=2, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(b.q.shape[0], 8, 64, device="cuda", dtype=torch.bfloat16)
    cos, sin = (torch.randn(b.q.shape[0], 1, 32, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots = torch.full((b.q.shape[0],), -1, device="cuda")
    sinks = torch.randn(64, device="cuda")

    def step():
        rope_write_kv(b.q.clone(), k_new, k_new, cos, sin, b.k_cache, b.v_cache, slots)
        return paged_attention(*b.args(sinks, 128, 0.125))

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    b.q.normal_()
    graph.replay()
    torch.testing.assert_close(out, step(), atol=0, rtol=0)
    assert not torch.equal(out, eager) and out[-2:].abs().max() == 0  # the padding tokens


# --------------------------------------------------------------------------------------------
# varlen_attention (cache-free; training and feature extraction) against one `attend` per sequence
# --------------------------------------------------------------------------------------------


def varlen_per_sequence(q, k, v, qsl, positions, sinks, window, scale):
    """The obvious oracle: each sequence on its own."""
    out = torch.zeros_like(q)
    for s, e in zip(qsl[:-1].tolist(), qsl[1:].tolist()):
        if e > s:
            out[s:e] = attend(q[s:e], k[s:e], v[s:e], positions[s:e], positions[s:e], sinks, window, scale)
    return out


def make_varlen(lengths: list[int], hq: int, hkv: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv))
    qsl = torch.tensor([0, *lengths]).cumsum(0)
    positions = torch.cat([torch.arange(n) for n in lengths])
    sinks = torch.randn(hq, generator=g, requires_grad=True)
    return q, k, v, qsl, positions, sinks


RAGGED = [7, 0, 19, 1, 12, 19]  # unequal, empty and one-token sequences, two of the longest


@pytest.mark.parametrize("lengths", [RAGGED, [9, 9, 9], [5]], ids=["ragged", "equal", "one"])
@pytest.mark.parametrize("window,with_sinks", [(None, True), (4, True), (4, False), (None, False)])
@pytest.mark.parametrize("max_seqlen_known", [True, False])
def test_varlen_attention_matches_per_sequence(lengths, window, with_sinks, max_seqlen_known):
    """Values and gradients (q, k, v, sinks) of the batched, padded formulation equal the per-sequence loop."""
    q, k, v, qsl, pos, sinks = make_varlen(lengths, 8, 2, 16)
    sinks = sinks if with_sinks else None
    grads = [t for t in (q, k, v, sinks) if t is not None]
    want = varlen_per_sequence(q, k, v, qsl, pos, sinks, window, 0.25)
    got = varlen_attention(q, k, v, qsl, pos, sinks, window, 0.25, max(lengths) if max_seqlen_known else None)
    torch.testing.assert_close(got, want, **TOL)
    w = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((want * w).sum(), grads), torch.autograd.grad((got * w).sum(), grads)):
        torch.testing.assert_close(b, a, **TOL)


def test_varlen_attention_in_memory_bounded_groups(monkeypatch):
    """A batch larger than the score budget is attended a few sequences at a time, with the same result;
    int32 query_start_loc (the engine's) works too."""
    import peagle_kernels.attention as A
    q, k, v, qsl, pos, sinks = make_varlen(RAGGED, 4, 4, 8, seed=1)
    want = varlen_per_sequence(q, k, v, qsl, pos, sinks, 3, 0.3)
    monkeypatch.setattr(A, "VARLEN_SCORE_ELEMENTS", 2 * 4 * 19 * 20)  # two sequences a group
    torch.testing.assert_close(varlen_attention(q, k, v, qsl.int(), pos, sinks, 3, 0.3, 19), want, **TOL)


def test_varlen_attention_reads_nothing_back_with_max_seqlen():
    """Given max_seqlen, nothing is copied to the host (on a GPU, no sync): no .item()/.tolist() on any input."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            assert func.__name__.split(".")[0] not in ("_local_scalar_dense", "nonzero", "_unique2"), func
            return func(*args, **(kwargs or {}))

    q, k, v, qsl, pos, sinks = make_varlen(RAGGED, 4, 2, 8)
    with torch.no_grad(), NoReads():
        varlen_attention(q, k, v, qsl, pos, sinks, 4, 0.3, max(RAGGED))
