"""Speculative rejection sampling keeps the target distribution (PyTorch reference, CPU).

Statistical tests draw 2.5*10^5 to 10^6 verify steps at vocabulary V = 8, in chunks, with fixed seeds. Each
request verifies two greedy-style drafts (rows 0, 1) and owns a bonus row (2); the drafts are
sampled from a draft distribution q that differs from the target. Every empirical distribution is
compared with its exact value by Pearson's chi-square (scipy, alpha = 1e-4) and by total variation
(< 0.005 at 10^6 draws; sqrt(V / n) for conditional subsets of n draws, ~2.5x the expected TV).
A negative control (rejection resampling from p instead of the residual) must fail the same check,
so the check can fail.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from kernel_utils import triton_interpret  # noqa: F401  (fixture)
from peagle_kernels.sampling import greedy_verify, rejection_sample_ref, target_probs

V = 8
ROWS = 3                  # two drafts + the bonus row
DRAWS = 1_000_000
CHUNK = 250_000
ALPHA = 1e-4

# Per-position target logits and the draft distribution (deliberately different from the target).
TARGET_LOGITS = torch.tensor([[1.2, 0.3, -0.5, 2.0, 0.0, -1.0, 0.8, -2.0],
                              [-0.4, 1.5, 0.9, -1.2, 0.2, 0.6, -0.3, 1.1],
                              [0.5, -0.5, 0.0, 0.7, -1.5, 1.3, 0.1, -0.2]])
DRAFT_Q = torch.tensor([0.02, 0.30, 0.25, 0.03, 0.15, 0.10, 0.05, 0.10])


def _run(seed: int, n: int = DRAWS, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
         fixed_draft: int | None = None, draft_q: torch.Tensor = DRAFT_Q
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n requests of ROWS rows each, in chunks. Returns (tokens [n, ROWS], num_accepted [n], drafts [n, 2])."""
    g = torch.Generator().manual_seed(seed)
    toks, accs, drafts = [], [], []
    for lo in range(0, n, CHUNK):
        b = min(CHUNK, n - lo)
        logits = TARGET_LOGITS.repeat(b, 1)                                   # [b*ROWS, V]
        if fixed_draft is None:
            d = torch.multinomial(draft_q, b * 2, replacement=True, generator=g).view(b, 2)
        else:
            d = torch.full((b, 2), fixed_draft)
        draft_ids = torch.cat([d, torch.full((b, 1), -1)], dim=1).reshape(-1)
        cu = torch.arange(0, b * ROWS + 1, ROWS)
        u = torch.rand(b * ROWS, generator=g)
        e = torch.empty(b * ROWS, V).exponential_(generator=g)
        t, a = rejection_sample_ref(logits, draft_ids, cu, torch.full((b,), temperature),
                                    torch.full((b,), top_k), torch.full((b,), top_p), u, e, max_rows=ROWS)
        toks.append(t), accs.append(a), drafts.append(d)
    return torch.cat(toks), torch.cat(accs), torch.cat(drafts)


def _probs(row: int, temperature: float = 1.0) -> np.ndarray:
    return torch.softmax(TARGET_LOGITS[row].double() / temperature, -1).numpy()


def _filtered(p: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Direct construction: keep the k most likely tokens, renormalise, keep the most likely tokens
    while the mass before them is < top_p, renormalise."""
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), dtype=bool)
    keep[order[:top_k if top_k > 0 else len(p)]] = True
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    before = 0.0
    for i in order:
        if keep[i] and before >= top_p:
            keep[i] = False
        before += q[i]
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def _assert_follows(tokens: torch.Tensor, p: np.ndarray, tv_bound: float | None = None) -> None:
    """Chi-square goodness of fit on the support of p, no mass outside it, and a TV bound."""
    n = tokens.numel()
    assert n > 10_000, f"too few samples ({n}) for a distribution check"
    counts = np.bincount(tokens.numpy(), minlength=V).astype(np.float64)
    assert counts.shape == (V,), "token outside the vocabulary"
    support = p > 0
    assert counts[~support].sum() == 0, f"tokens outside the support: {counts[~support]}"
    stat, pvalue = chisquare(counts[support], n * p[support] / p[support].sum())
    tv = 0.5 * np.abs(counts / n - p).sum()
    bound = tv_bound if tv_bound is not None else math.sqrt(V / n)
    assert pvalue > ALPHA, f"chi-square rejects: stat={stat:.1f} p={pvalue:.2e} counts={counts} expected={n * p}"
    assert tv < bound, f"total variation {tv:.4f} >= {bound:.4f}"


@pytest.fixture(scope="module")
def default_run():
    return _run(seed=1)


def test_first_token_follows_target(default_run):
    tokens, _, _ = default_run
    _assert_follows(tokens[:, 0], _probs(0), tv_bound=0.005)


def test_first_token_follows_target_whatever_the_draft(default_run):
    """Per draft value d: emitted token ~ p; given rejection, ~ p without d, renormalised; P(accept) = p(d)."""
    tokens, acc, drafts = default_run
    p = _probs(0)
    for d in (1, 2, 4):                                   # the draft's frequent values
        sel = drafts[:, 0] == d
        _assert_follows(tokens[sel, 0], p)
        rejected = sel & (acc == 0)
        residual = p.copy()
        residual[d] = 0.0
        _assert_follows(tokens[rejected, 0], residual / residual.sum())
        n, k = int(sel.sum()), int((sel & (acc > 0)).sum())
        z = (k - n * p[d]) / math.sqrt(n * p[d] * (1 - p[d]))
        assert abs(z) < 4.5, f"acceptance of draft {d}: {k}/{n} vs p={p[d]:.4f} (z={z:.1f})"


def test_first_token_with_a_fixed_unlikely_draft():
    tokens, acc, _ = _run(seed=2, n=DRAWS // 2, fixed_draft=7)          # p0(7) is the smallest target probability
    _assert_follows(tokens[:, 0], _probs(0), tv_bound=0.005)
    assert 0 < int((acc > 0).sum()) < DRAWS // 40


def test_second_token_follows_second_row_given_first_accepted(default_run):
    tokens, acc, _ = default_run
    first_ok = acc >= 1
    _assert_follows(tokens[first_ok, 1], _probs(1))
    # The acceptance count follows prod of sum_d q(d) p_i(d) (drafts drawn independently from q).
    alpha = [(DRAFT_Q.double().numpy() * _probs(i)).sum() for i in (0, 1)]
    expected = np.array([1 - alpha[0], alpha[0] * (1 - alpha[1]), alpha[0] * alpha[1]])
    counts = np.bincount(acc.numpy(), minlength=3)
    assert counts.shape == (3,)
    assert chisquare(counts, DRAWS * expected).pvalue > ALPHA, f"accepted counts {counts} vs {DRAWS * expected}"
    # Both drafts accepted: the bonus token comes from the last row.
    _assert_follows(tokens[acc == 2, 2], _probs(2))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 3, 1.0), (1.3, 0, 0.6), (1.0, 5, 0.8)])
def test_filtered_target(temperature, top_k, top_p):
    # Half the drafts are the target's favourite token, so enough first drafts pass to test position 1;
    # the other half (from q) often fall outside the filtered support and must always be rejected.
    draft_q = 0.5 * DRAFT_Q + 0.5 * torch.nn.functional.one_hot(torch.tensor(3), V).float()
    tokens, acc, drafts = _run(seed=3, n=DRAWS // 4, temperature=temperature, top_k=top_k, top_p=top_p,
                               draft_q=draft_q)
    p0 = _filtered(_probs(0, temperature), top_k, top_p)
    assert (p0 > 0).sum() < V, "the filter must remove tokens for this test to mean anything"
    _assert_follows(tokens[:, 0], p0, tv_bound=0.005)
    _assert_follows(tokens[acc >= 1, 1], _filtered(_probs(1, temperature), top_k, top_p))
    outside = torch.from_numpy(p0 == 0)[drafts[:, 0]]
    assert outside.any() and (acc[outside] == 0).all(), "a draft outside the filtered support was accepted"


def test_negative_control_is_rejected():
    """Resampling from p (not the residual) after a rejection biases the output: the check must see it."""
    g = torch.Generator().manual_seed(4)
    n = DRAWS // 4
    p = torch.softmax(TARGET_LOGITS[0], -1)
    d = torch.multinomial(DRAFT_Q, n, replacement=True, generator=g)
    accept = torch.rand(n, generator=g) < p[d]
    wrong = (p[None, :] / torch.empty(n, V).exponential_(generator=g)).argmax(-1)
    tokens = torch.where(accept, d, wrong)
    with pytest.raises(AssertionError):
        _assert_follows(tokens, _probs(0))


def _greedy_chain(logits: torch.Tensor, drafts: torch.Tensor) -> list[int]:
    out = []
    for row, d in zip(logits, drafts.tolist()):
        top = int(row.argmax())
        out.append(top)
        if d != top:
            break
    return out


def random_verify_batch(g: torch.Generator, B: int, Vb: int):
    """B requests of 1..5 rows each: (rows per request, cu, logits, drafts that are the argmax 70% of the time)."""
    n_rows = torch.randint(1, 6, (B,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), n_rows.cumsum(0)])
    N = int(cu[-1])
    logits = torch.randn(N, Vb, generator=g)
    drafts = torch.where(torch.rand(N, generator=g) < 0.7, logits.argmax(-1), torch.randint(0, Vb, (N,), generator=g))
    drafts[cu[1:] - 1] = -1
    return n_rows, cu, logits, drafts


@pytest.mark.parametrize("mixed", [False, True])
def test_greedy_rows_are_exact_argmax_chains(mixed):
    g = torch.Generator().manual_seed(5)
    B, Vb = 64, 50
    n_rows, cu, logits, drafts = random_verify_batch(g, B, Vb)
    N = int(cu[-1])
    temperature = torch.zeros(B)
    if mixed:
        temperature[1::2] = 0.8                            # odd requests sample
        u, e = torch.rand(N, generator=g), torch.empty(N, Vb).exponential_(generator=g)
    else:
        u = e = None
    tokens, acc = rejection_sample_ref(logits, drafts, cu, temperature, torch.zeros(B, dtype=torch.long),
                                       torch.ones(B), u, e)
    assert tokens.shape == (B, int(n_rows.max()))
    for b in range(0, B, 2 if mixed else 1):
        s, t = int(cu[b]), int(cu[b + 1])
        chain = _greedy_chain(logits[s:t], drafts[s:t])
        assert int(acc[b]) == len(chain) - 1
        assert tokens[b, :len(chain)].tolist() == chain
        assert (tokens[b, len(chain):] == -1).all()


def test_greedy_verify_from_argmax_alone_equals_greedy_rejection_sampling():
    """What a vocab-parallel LM head hands the verify (each row's argmax, no logits) gives the same tokens and
    acceptance as the greedy verify over the logits, for every acceptance length."""
    B = 48
    _, cu, logits, drafts = random_verify_batch(torch.Generator().manual_seed(6), B, 40)
    want = rejection_sample_ref(logits, drafts, cu, torch.zeros(B), None, None, None, None, max_rows=6)
    got = greedy_verify(logits.argmax(-1), drafts, cu, max_rows=6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert set(want[1].tolist()) == set(range(5))  # every acceptance length occurs


def test_seeded_noise_repeats_exactly():
    a = _run(seed=7, n=20_000)
    b = _run(seed=7, n=20_000)
    c = _run(seed=8, n=20_000)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_target_probs_matches_direct_construction():
    g = torch.Generator().manual_seed(9)
    R, Vp = 64, 40
    logits = torch.randn(R, Vp, generator=g) * 2
    temperature = torch.rand(R, generator=g) * 1.5 + 0.2
    top_k = torch.randint(0, Vp + 5, (R,), generator=g) * (torch.rand(R, generator=g) < 0.6)
    top_p = torch.where(torch.rand(R, generator=g) < 0.6, torch.rand(R, generator=g), torch.ones(R))
    got = target_probs(logits, temperature, top_k, top_p)
    for r in range(R):
        full = torch.softmax(logits[r].double() / temperature[r].double(), -1).numpy()
        want = _filtered(full, int(top_k[r]), float(top_p[r]))
        np.testing.assert_array_equal(got[r].numpy() > 0, want > 0, err_msg=f"support of row {r}")
        np.testing.assert_allclose(got[r].numpy(), want, atol=1e-6, err_msg=f"row {r}")


def test_target_probs_top_p_one_keeps_the_whole_vocabulary():
    """fp32 cumsums over a GPT-OSS-sized vocabulary reach 1.0 early; top_p = 1 must still keep every token."""
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(4, 201_088, generator=g) * 2
    p = target_probs(logits, torch.ones(4), torch.zeros(4, dtype=torch.long), torch.ones(4))
    assert (p > 0).all()
    torch.testing.assert_close(p, torch.softmax(logits, -1))


def test_target_probs_without_filters_is_the_unfiltered_result_bit_for_bit():
    """top_k = top_p = None (no sort) equals top_k = 0, top_p = 1 exactly, so callers may pick either."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(32, 1000, generator=g) * 3
    temperature = torch.rand(32, generator=g) + 0.1
    temperature[::4] = 0.0
    unfiltered = target_probs(logits, temperature, torch.zeros(32, dtype=torch.long), torch.ones(32))
    assert torch.equal(target_probs(logits, temperature, None, None), unfiltered)


@pytest.mark.parametrize("triton_on", [True, False])
def test_the_engine_warms_up_both_sampling_kernel_variants_when_it_runs_triton(tiny_pair, request, monkeypatch,
                                                                                triton_on):
    """On CUDA the verify's sampling kernel compiles a variant at first use (greedy, sampled): 0.1-0.4 s inside a
    live step. The engine runs both once at build (`ModelRunner.warm_up_sampling`); here the same launches run
    under Triton's interpreter, and nothing runs when the PyTorch reference is in use (nothing to compile)."""
    from peagle_kernels.dispatch import set_triton_enabled, triton_enabled
    from peagle_core import LLM
    from peagle_core.engine import model_runner

    if triton_on:
        request.getfixturevalue("triton_interpret")  # Triton's interpreter on CPU tensors
    spec = {"method": "eagle3", "model": tiny_pair["peagle"], "num_speculative_tokens": 3, "parallel_drafting": True}
    previous = triton_enabled()
    try:
        if not triton_on:
            set_triton_enabled(False)
        runner = LLM(tiny_pair["target"], device="cpu", speculative_config=spec).engine.runner
        calls, real = [], model_runner.rejection_sample
        monkeypatch.setattr(model_runner, "rejection_sample", lambda *a, **kw: calls.append(
            (float(a[3][0]), a[6] is None)) or real(*a, **kw))
        runner.warm_up_sampling()
    finally:
        set_triton_enabled(previous)
    assert calls == ([(0.0, True), (1.0, False)] if triton_on else [])
