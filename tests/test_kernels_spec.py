"""Triton speculative-decoding kernels equal their PyTorch references exactly.

Drafter-input preparation and hidden fill (peagle_kernels.triton_draft_inputs) and verification
(peagle_kernels.triton_sampling). Integer outputs, copies and argmaxes must be identical, so every
comparison is torch.equal. CPU: Triton's interpreter (small sizes); GPU (skipped here): the
compiled kernels on the same cases.
"""
from __future__ import annotations

import importlib
import sys

import pytest
import torch

from kernel_utils import enable_pdl, triton_cuda, triton_interpret  # noqa: F401  (fixtures)
from peagle_kernels.draft_inputs import fill_hidden, fill_hidden_ref, prepare_draft_inputs, prepare_draft_inputs_ref
from peagle_kernels.dispatch import use_triton
from peagle_kernels.sampling import rejection_sample, rejection_sample_ref

SPEC_MODULES = ("peagle_kernels.triton_draft_inputs", "peagle_kernels.triton_sampling")
M = -2  # mask (parallel-drafting) token id in the worked example


# One test per kernel also runs compiled with programmatic dependent launch (PEAGLE_PDL=1): "cuda-pdl", marked
# gpu so that benchmarks/gpu_run.sh's `-m gpu` run picks it (few shapes: few compilations in its time budget).
WITH_PDL = pytest.mark.parametrize("device", ["interpret", "cuda", pytest.param("cuda-pdl", marks=pytest.mark.gpu)],
                                   indirect=True)


@pytest.fixture(params=["interpret", "cuda"])
def device(request, monkeypatch) -> str:
    """Dispatch to Triton (interpreter on CPU, or compiled on CUDA); the modules match the mode."""
    from triton.runtime.jit import JITFunction
    interpret = request.param == "interpret"
    request.getfixturevalue("triton_interpret" if interpret else "triton_cuda")
    if request.param == "cuda-pdl":
        enable_pdl(monkeypatch)
    for name in SPEC_MODULES:  # kernel_utils reloads only its own modules
        module = sys.modules.get(name) or importlib.import_module(name)
        if any(isinstance(v, JITFunction) for v in vars(module).values()) == interpret:
            importlib.reload(module)
    return "cpu" if interpret else "cuda"


def _assert_same(got, want, names):
    for g, w, name in zip(got, want, names):
        assert g.dtype == w.dtype and g.shape == w.shape, \
            f"{name}: {g.dtype}{tuple(g.shape)} vs {w.dtype}{tuple(w.shape)}"
        assert torch.equal(g.cpu(), w.cpu()), f"{name}:\n got {g.tolist()}\nwant {w.tolist()}"


PREP_NAMES = ("input_ids", "positions", "is_rejected", "is_masked", "sample_indices", "hidden_map")


# ---------------------------------------------------------------------------------------------
# prepare_draft_inputs / fill_hidden
# ---------------------------------------------------------------------------------------------

@WITH_PDL
def test_worked_example_peagle_2_1(device):
    """reference/peagle.md §2.1 (vLLM test_set_inputs_first_pass_parallel_drafting): K = 3, two requests of 4."""
    dev = torch.device(device)
    args = (torch.tensor([10, 11, 12, 13, 20, 21, 22, 23], device=dev),
            torch.tensor([5, 6, 7, 8, 10, 11, 12, 13], device=dev),
            torch.tensor([100, 200], device=dev), torch.tensor([0, 4, 8], device=dev, dtype=torch.int32),
            torch.tensor([1, 0], device=dev, dtype=torch.int32), M, 3)
    flags = torch.zeros(12, dtype=torch.bool)
    want = (torch.tensor([11, 12, 100, M, M, 0, 21, 22, 23, 200, M, M]),
            torch.tensor([5, 6, 7, 8, 9, 0, 10, 11, 12, 13, 14, 15]),
            flags.index_fill(0, torch.tensor([5]), True),
            flags.index_fill(0, torch.tensor([3, 4, 10, 11]), True),
            torch.tensor([2, 3, 4, 9, 10, 11]),
            torch.tensor([0, 1, 2, 3, 6, 7, 8, 9]))            # target token j -> slot j of its request
    assert use_triton(args[0])
    _assert_same(prepare_draft_inputs(*args), want, PREP_NAMES)
    _assert_same(prepare_draft_inputs_ref(*args), want, PREP_NAMES)
    # Drafter query_start_loc = [0, 6, 12]: each request grows by P - 1 slots.
    assert (args[3].cpu() + torch.arange(3) * 2).tolist() == [0, 6, 12]


def _ragged(g: torch.Generator, q_lens: list[int], rejected: list[int], dev, idx_dtype=torch.long):
    T = sum(q_lens)
    tokens = torch.randint(1000, 2000, (T,), generator=g).to(dev, idx_dtype)
    starts = torch.randint(0, 500, (len(q_lens),), generator=g)
    positions = torch.cat([s + torch.arange(q) for s, q in zip(starts.tolist(), q_lens)]).to(dev, idx_dtype)
    next_ids = torch.randint(3000, 4000, (len(q_lens),), generator=g).to(dev, idx_dtype)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(dev, idx_dtype)
    return tokens, positions, next_ids, qsl, torch.tensor(rejected).to(dev, idx_dtype)


CASES = {  # (q_lens, num_rejected per request)
    "decode_mixed": ([4, 4, 4], [0, 2, 3]),
    "q_len_1": ([1, 1, 1, 1], [0, 0, 0, 0]),
    "all_rejected": ([5, 3, 2], [4, 2, 1]),
    "none_rejected": ([6, 2, 3], [0, 0, 0]),
    "prefill_and_decode": ([17, 1, 4, 9], [0, 0, 1, 0]),
    "single_long": ([300], [0]),
}


@pytest.mark.parametrize("P", [1, 2, 3, 8])          # P = 1: EAGLE-3 first pass
@pytest.mark.parametrize("case", list(CASES))
def test_prepare_matches_reference(device, case, P):
    g = torch.Generator().manual_seed(P * 31 + len(case))
    q_lens, rejected = CASES[case]
    for idx_dtype in (torch.long, torch.int32):
        args = (*_ragged(g, q_lens, rejected, torch.device(device), idx_dtype), M, P, 7)
        _assert_same(prepare_draft_inputs(*args), prepare_draft_inputs_ref(*args), PREP_NAMES)


def test_prepare_random_batches(device):
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        B = int(torch.randint(1, 9, (1,), generator=g))
        P = int(torch.randint(1, 7, (1,), generator=g))
        q_lens = torch.randint(1, 10, (B,), generator=g)
        rejected = (torch.rand(B, generator=g) * q_lens).long().clamp(max=q_lens - 1)
        args = (*_ragged(g, q_lens.tolist(), rejected.tolist(), torch.device(device)), M, P)
        _assert_same(prepare_draft_inputs(*args), prepare_draft_inputs_ref(*args), PREP_NAMES)


def test_prepare_with_empty_padding_requests(device):
    """CUDA-graph padding requests own no token: the real request is longer than T - B + P slots,
    so the kernel's per-request loop must run past its first block."""
    g = torch.Generator().manual_seed(1)
    args = (*_ragged(g, [0, 256], [0, 3], torch.device(device)), M, 2)
    got, want = prepare_draft_inputs(*args), prepare_draft_inputs_ref(*args)
    _assert_same(got[:4] + got[5:], want[:4] + want[5:], PREP_NAMES[:4] + PREP_NAMES[5:])
    # Entry 0 of the empty request is never written (it has no bonus slot): compare the others.
    assert torch.equal(got[4][1:].cpu(), want[4][1:].cpu())


def test_prepare_rejects_bad_num_slots(device):
    args = _ragged(torch.Generator().manual_seed(0), [3], [0], torch.device(device))
    with pytest.raises(ValueError, match="num_slots"):
        prepare_draft_inputs(*args, M, 0)


@pytest.mark.parametrize("H,dtype", [(37, torch.float32), (300, torch.float32), (64, torch.bfloat16)])
def test_fill_hidden_matches_reference(device, H, dtype):
    g = torch.Generator().manual_seed(H)
    dev = torch.device(device)
    for q_lens, rejected, P in [([4, 4, 4], [0, 2, 3], 4), ([1, 7, 2], [0, 6, 1], 3), ([5], [0], 1)]:
        ids, pos, rej, masked, samp, hmap = prepare_draft_inputs_ref(*_ragged(g, q_lens, rejected, dev), M, P)
        # Non-contiguous target rows (a slice of a wider buffer) and a shared state of another dtype.
        wide = torch.randn(sum(q_lens), H + 5, generator=g).to(dev, dtype)
        target = wide[:, 2:H + 2]
        shared = torch.randn(H, generator=g).to(dev)
        got = fill_hidden(target, hmap, masked, shared)
        want = fill_hidden_ref(target, hmap, masked, shared)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.cpu(), want.cpu())
        uncovered = torch.ones(len(ids), dtype=torch.bool)
        uncovered[hmap.cpu()] = False
        uncovered &= ~masked.cpu()
        assert (got.cpu()[uncovered] == 0).all()


@WITH_PDL
def test_fill_hidden_sparse_map(device):
    """Any strictly increasing map: rows beyond and between mapped rows are zeros."""
    dev = torch.device(device)
    hmap = torch.tensor([1, 2, 5, 9, 10], device=dev)
    masked = torch.zeros(14, dtype=torch.bool, device=dev)
    masked[[2, 3, 12]] = True
    target = torch.arange(5 * 3, dtype=torch.float32, device=dev).view(5, 3) + 1
    shared = torch.full((3,), -7.0, device=dev)
    got = fill_hidden(target, hmap, masked, shared)
    assert torch.equal(got.cpu(), fill_hidden_ref(target, hmap, masked, shared).cpu())
    assert (got[[0, 4, 6, 7, 8, 11, 13]] == 0).all()


# ---------------------------------------------------------------------------------------------
# rejection_sample
# ---------------------------------------------------------------------------------------------

def _verify_batch(g: torch.Generator, B: int, V: int, dev, *, max_rows_pad: int = 0, greedy_frac: float = 0.4,
                  noise: bool = True, noise_dtype=torch.float32, tie_logits: bool = False):
    n_rows = torch.randint(1, 6, (B,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), n_rows.cumsum(0)])
    N = int(cu[-1])
    if tie_logits:  # few distinct values: many tied maxima, so the first-index rule matters
        logits = torch.randint(0, 3, (N, V), generator=g).float()
    else:
        logits = torch.randn(N, V, generator=g) * 2
    temperature = torch.where(torch.rand(B, generator=g) < greedy_frac, 0.0, torch.rand(B, generator=g) + 0.3)
    top_k = torch.randint(0, V + 2, (B,), generator=g) * (torch.rand(B, generator=g) < 0.5)
    top_p = torch.where(torch.rand(B, generator=g) < 0.5, torch.rand(B, generator=g) * 0.9 + 0.05, torch.ones(B))
    drafts = torch.where(torch.rand(N, generator=g) < 0.7, logits.argmax(-1), torch.randint(0, V, (N,), generator=g))
    drafts[cu[1:] - 1] = -1
    u = torch.rand(N, generator=g, dtype=noise_dtype) if noise else None
    e = torch.empty(N, V, dtype=noise_dtype).exponential_(generator=g) if noise else None
    args = [logits, drafts, cu, temperature, top_k, top_p, u, e]
    args = [a.to(dev) if a is not None else None for a in args]
    return args, int(n_rows.max()) + max_rows_pad


def _check_rejection(args, max_rows):
    got = rejection_sample(*args, max_rows=max_rows)
    want = rejection_sample_ref(*args, max_rows=max_rows)
    _assert_same(got, want, ("tokens", "num_accepted"))
    return got


@WITH_PDL
def test_rejection_greedy_one_hot(device):
    """Hand-made: drafts [hit, hit, miss | hit] (+ bonus rows); -1 after the emitted token."""
    dev = torch.device(device)
    top = torch.tensor([3, 1, 4, 0, 2, 2, 5])                 # per-row argmax
    logits = torch.full((7, 6), -100.0).scatter(1, top[:, None], 100.0).to(dev)
    drafts = torch.tensor([3, 1, 2, -1, 2, 2, -1], device=dev)  # request 0: rows 0-3, request 1: rows 4-6
    cu = torch.tensor([0, 4, 7], device=dev)
    args = [logits, drafts, cu, torch.zeros(2, device=dev), torch.zeros(2, dtype=torch.long, device=dev),
            torch.ones(2, device=dev), None, None]
    tokens, acc = _check_rejection(args, 4)
    assert tokens.tolist() == [[3, 1, 4, -1], [2, 2, 5, -1]]
    assert acc.tolist() == [2, 2]


@pytest.mark.parametrize("greedy_frac", [0.0, 0.5, 1.0])
def test_rejection_random_mixed(device, greedy_frac):
    g = torch.Generator().manual_seed(int(greedy_frac * 10))
    for trial in range(8):
        args, max_rows = _verify_batch(g, B=int(torch.randint(1, 7, (1,), generator=g)),
                                       V=int(torch.randint(2, 70, (1,), generator=g)), dev=torch.device(device),
                                       max_rows_pad=trial % 2, greedy_frac=greedy_frac)
        _check_rejection(args, max_rows)


@WITH_PDL
def test_rejection_without_filters(device):
    """top_k = top_p = None (no request filters) matches the reference and the explicit 0 / 1 filters."""
    g = torch.Generator().manual_seed(16)
    args, max_rows = _verify_batch(g, B=6, V=50, dev=torch.device(device), greedy_frac=0.3)
    explicit = list(args)
    explicit[4], explicit[5] = torch.zeros_like(args[4]), torch.ones_like(args[5])
    args[4] = args[5] = None
    got = _check_rejection(args, max_rows)
    _assert_same(got, rejection_sample_ref(*explicit, max_rows=max_rows), ("tokens", "num_accepted"))


def test_rejection_all_greedy_without_noise(device):
    g = torch.Generator().manual_seed(11)
    for tie_logits in (False, True):
        args, max_rows = _verify_batch(g, B=6, V=33, dev=torch.device(device), greedy_frac=1.0, noise=False,
                                       tie_logits=tie_logits)
        _check_rejection(args, max_rows)


def test_rejection_ties_large_vocab_and_fp64_noise(device):
    """Several vocabulary tiles (V > BLOCK_V_MAX = 16384, not a power of two), tied logits, fp64 noise."""
    g = torch.Generator().manual_seed(12)
    args, max_rows = _verify_batch(g, B=3, V=20000, dev=torch.device(device), greedy_frac=0.5, tie_logits=True)
    _check_rejection(args, max_rows)
    args, max_rows = _verify_batch(g, B=4, V=300, dev=torch.device(device), noise_dtype=torch.float64)
    _check_rejection(args, max_rows)


def test_rejection_bf16_logits(device):
    g = torch.Generator().manual_seed(15)
    for noise in (False, True):
        args, max_rows = _verify_batch(g, B=5, V=40, dev=torch.device(device), greedy_frac=0.5 if noise else 1.0,
                                       noise=noise, tie_logits=True)
        args[0] = args[0].bfloat16()
        _check_rejection(args, max_rows)


def test_rejection_small_max_rows_matches_reference(device):
    """max_rows below the longest request (a caller error) still matches the reference and stays in bounds."""
    g = torch.Generator().manual_seed(13)
    args, max_rows = _verify_batch(g, B=5, V=20, dev=torch.device(device))
    _check_rejection(args, max(max_rows - 2, 1))


def test_rejection_bad_noise_arguments(device):
    g = torch.Generator().manual_seed(14)
    args, max_rows = _verify_batch(g, B=2, V=10, dev=torch.device(device))
    args[7] = None
    with pytest.raises(ValueError, match="together"):
        rejection_sample(*args, max_rows=max_rows)
