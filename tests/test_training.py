"""Drafter training: COD sampling, the P-EAGLE mask, sequence partitioning, objectives vs inference, data, CLI."""
from __future__ import annotations

import json

import pytest
import torch

from peagle_core.loading.checkpoint import load_drafter, load_target
from peagle_core.models.layers import ForwardMeta, masked_attention
from peagle_core.testing import build_target, tiny_target_config
from peagle_core.training.data import Example, greedy_generate, load_examples, read_jsonl, regenerate, render_chat
from peagle_core.training.eagle3 import eagle3_pass_loss, eagle3_unroll
from peagle_core.training.features import extract_features, slot_valid
from peagle_core.training.losses import DepthStats, element_loss
from peagle_core.training.peagle import (assign_segments, cod_counts, cod_sample, passes_to, peagle_forward,
                                         peagle_mask, peagle_pass_loss, plan_passes, segment_elements)
from peagle_core.training.trainer import TrainConfig, Trainer, default_pass_elements, init_drafter

MASK_ID = 253
AUX = [1, 2, 3]



@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("train_target")
    build_target(d, tiny_target_config(), seed=0, scale=4.0)
    return d


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir, torch.float32, "cpu")


def random_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g).tolist()


def rule(qa: int, qd: int, ka: int, kd: int) -> bool:
    """The mask rule written out independently of the implementation."""
    if kd == 0:
        return ka <= qa
    return ka == qa and kd <= qd


# --------------------------------------------------------------------------------------------
# mask
# --------------------------------------------------------------------------------------------


def test_mask_hand_example():
    # slots 0,1,2 at depth 0, then (0,1) and (1,1)
    anchor, depth = torch.tensor([0, 1, 2, 0, 1]), torch.tensor([0, 0, 0, 1, 1])
    expect = torch.tensor([[1, 0, 0, 0, 0],
                           [1, 1, 0, 0, 0],
                           [1, 1, 1, 0, 0],
                           [1, 0, 0, 1, 0],
                           [1, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(peagle_mask(anchor, depth, torch.zeros_like(anchor)), expect)


@pytest.mark.parametrize("n,K,r,r_min", [(1, 3, 0.8, 0.2), (2, 4, 1.0, 0.2), (7, 3, 0.8, 0.2), (12, 5, 0.6, 0.3),
                                         (20, 8, 0.8, 0.2), (9, 6, 1.0, 1.0)])
def test_mask_equals_direct_rule(n, K, r, r_min):
    g = torch.Generator().manual_seed(n * 10 + K)
    anchor, depth = cod_sample(n, K, r, r_min, g)
    zero = torch.zeros_like(anchor)
    a, d = anchor.tolist(), depth.tolist()
    direct = torch.tensor([[rule(a[i], d[i], a[j], d[j]) for j in range(len(a))] for i in range(len(a))])
    assert torch.equal(peagle_mask(anchor, depth, zero), direct)
    # a segment's forward (depth-0 prefix + owned elements) keeps the rule among its elements
    seg = assign_segments(anchor, depth, n, 3)
    idx, _ = segment_elements(depth, seg, 1)
    assert torch.equal(peagle_mask(anchor[idx], depth[idx], zero[idx]), direct[idx][:, idx])
    # packed after another unit, then reordered depth-major: the same rule inside, nothing across
    (p,) = plan_passes([(anchor, depth)] * 2, [torch.ones(n, dtype=torch.bool)] * 2, [0, 100], max_elements=10**6)
    unit = (p.start > 0).long()
    a2, d2 = (p.key - p.start).tolist(), p.depth.tolist()
    packed = torch.tensor([[unit[i] == unit[j] and rule(a2[i], d2[i], a2[j], d2[j]) for j in range(len(p))]
                           for i in range(len(p))])
    assert torch.equal(peagle_mask(p.key, p.depth, p.start), packed)
    assert torch.equal(p.row - p.key + p.start, 100 * unit)  # feature rows follow each unit's sequence start



@pytest.mark.parametrize("T,S", [(13, 13), (7, 20), (16, 16)])
def test_masked_attention_padded_to_a_bucket_gives_the_same_outputs_and_gradients(T, S):
    """The shape buckets that keep cuDNN's per-shape graphs few change nothing: the padded queries and keys
    neither leak into real rows nor pass gradient back (a P-EAGLE mask; EAGLE-3's [T, prefix + T] too)."""
    g = torch.Generator().manual_seed(T * 100 + S)
    if T == S:
        anchor, depth = cod_sample(T, 4, 0.8, 0.2, g)
        T = S = len(anchor)
        mask = peagle_mask(anchor, depth, torch.zeros_like(anchor))
    else:
        mask = torch.rand(T, S, generator=g) < 0.5
        mask[:, 0] = True  # every real query sees a key, as in training
    assert T % 8 and S % 8  # the bucket below pads both
    q = torch.randn(T, 4, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(S, 2, 8, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(T, 4, 8, generator=g)
    results = []
    for bucket in (1, 8):
        out = masked_attention(q, k, v, mask, 0.35, bucket=bucket)
        grads = torch.autograd.grad((out * dout).sum(), (q, k, v))
        results.append((out, *grads))
    for exact, padded in zip(*results):
        assert padded.shape == exact.shape
        torch.testing.assert_close(padded, exact, rtol=1e-5, atol=1e-6)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_masked_attention_default_bucket_on_cuda_equals_unpadded_bf16():
    """On CUDA (cuDNN's attention, bf16 as training autocasts it) the default 1024-bucket gives the unpadded
    call's outputs and gradients, for a packed P-EAGLE pass whose length is no multiple of the bucket."""
    from peagle_core.models.layers import MASKED_ATTENTION_BUCKET

    g = torch.Generator().manual_seed(0)
    samples = [cod_sample(n, 8, 0.8, 0.2, g) for n in (300, 517, 129)]
    (p,) = plan_passes(samples, [torch.ones(n, dtype=torch.bool) for n in (300, 517, 129)], [0, 300, 817],
                       max_elements=10**6)
    assert len(p) % MASKED_ATTENTION_BUCKET
    mask = peagle_mask(p.key, p.depth, p.start).cuda()
    q, k, v = (torch.randn(len(p), h, 32, generator=g).cuda().bfloat16().requires_grad_() for h in (8, 2, 2))
    dout = torch.randn(len(p), 8, 32, generator=g).cuda().bfloat16()
    results = []
    for bucket in (1, None):
        out = masked_attention(q, k, v, mask, 32 ** -0.5, bucket=bucket)
        results.append((out, *torch.autograd.grad((out * dout).sum(), (q, k, v))))
    for exact, padded in zip(*results):
        torch.testing.assert_close(padded.float(), exact.float(), rtol=2e-2, atol=2e-2)

# --------------------------------------------------------------------------------------------
# COD sampling
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [30, 100, 257])
def test_cod_keeps_documented_counts(n):
    K, r, r_min = 8, 0.8, 0.2
    anchor, depth = cod_sample(n, K, r, r_min, torch.Generator().manual_seed(n))
    counts = torch.bincount(depth, minlength=K).tolist()
    assert counts == [n] + [int((n - d) * max(r ** d, r_min)) for d in range(1, K)]
    assert counts == cod_counts(n, K, r, r_min)
    keys = set(zip(anchor.tolist(), depth.tolist()))
    assert len(keys) == len(anchor)                                  # no duplicates
    for a, d in keys:
        assert 0 <= a and a + d < n                                  # target distribution exists
        assert d == 0 or (a, d - 1) in keys                          # the whole chain is kept
    for d in range(K):                                               # sorted anchors within a depth
        a = anchor[depth == d]
        assert torch.equal(a, a.sort().values)
    assert torch.equal(anchor[:n], torch.arange(n)) and not depth[:n].any()


def test_cod_is_seeded_random_and_respects_loss_mask():
    n, K = 60, 4
    s1 = cod_sample(n, K, 0.7, 0.2, torch.Generator().manual_seed(1))
    s1b = cod_sample(n, K, 0.7, 0.2, torch.Generator().manual_seed(1))
    s2 = cod_sample(n, K, 0.7, 0.2, torch.Generator().manual_seed(2))
    assert all(torch.equal(x, y) for x, y in zip(s1, s1b))
    assert not torch.equal(s1[0], s2[0])
    valid = torch.zeros(n, dtype=torch.bool)
    valid[20:50] = True  # e.g. an assistant turn
    anchor, depth = cod_sample(n, K, 0.7, 0.2, torch.Generator().manual_seed(3), valid)
    deep = depth > 0
    assert valid[(anchor + depth)[deep]].all()
    m = int(valid.sum())
    assert torch.bincount(depth, minlength=K).tolist()[1:] == [int((m - d) * 0.7 ** d) for d in range(1, K)]


def test_cod_draws_stay_what_a_seed_always_drew():
    # recorded from the torch implementation before planning moved to NumPy: a seed keeps its elements
    valid = torch.tensor([j % 7 != 3 for j in range(16)])
    anchor, depth = cod_sample(16, 4, 0.7, 0.2, torch.Generator().manual_seed(5), valid)
    assert anchor.dtype == depth.dtype == torch.long
    assert torch.equal(anchor[:16], torch.arange(16)) and not depth[:16].any()
    assert anchor[16:].tolist() == [0, 1, 3, 5, 6, 8, 10, 13, 14, 0, 3, 6, 10, 13, 3, 6, 10]
    assert depth[16:].tolist() == [1] * 9 + [2] * 5 + [3] * 3


def test_cod_floor_is_capped_by_the_candidate_pool():
    # r = r_min = 0.3 holds the ratio flat, so a depth may want as many elements as its parent depth
    # has; when the parent holds the last slot, its shifted copy falls off the end and the pool is smaller
    n, K = 10, 5
    capped = 0
    for seed in range(20):
        anchor, depth = cod_sample(n, K, 0.3, 0.3, torch.Generator().manual_seed(seed))
        for d in range(1, K):
            pool = {r + 1 for r in (anchor + depth)[depth == d - 1].tolist() if r + 1 < n}
            want = int((n - d) * 0.3)
            assert int((depth == d).sum()) == min(want, len(pool))
            capped += len(pool) < want
    assert capped > 0


def test_cod_rejects_bad_arguments():
    with pytest.raises(ValueError, match="ratio"):
        cod_sample(5, 3, 1.5, 0.2, torch.Generator())
    with pytest.raises(ValueError, match="at least one slot"):
        cod_sample(0, 3, 0.8, 0.2, torch.Generator())


# --------------------------------------------------------------------------------------------
# sequence partitioning
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("S", [1, 2, 3, 5])
def test_segments_partition_elements_and_keep_every_dependency(S):
    n = 23
    anchor, depth = cod_sample(n, 6, 0.8, 0.2, torch.Generator().manual_seed(S))
    seg = assign_segments(anchor, depth, n, S)
    owned_total = torch.zeros(len(anchor), dtype=torch.long)
    a, d = anchor.tolist(), depth.tolist()
    for s in range(S):
        idx, owned = segment_elements(depth, seg, s)
        owned_total[idx[owned]] += 1
        inside = set(idx.tolist())
        n0 = int((depth[idx] == 0).sum())
        assert torch.equal(anchor[idx[:n0]], torch.arange(n0))      # depth-0 prefix stays contiguous
        for q in idx[owned].tolist():
            needed = {k for k in range(len(a)) if rule(a[q], d[q], a[k], d[k])}
            assert needed <= inside, f"segment {s} misses a dependency of element {q}"
    assert torch.equal(owned_total, torch.ones_like(owned_total))  # every element charged exactly once


def make_drafter(target, method="peagle", layers=2, seed=1):
    return init_drafter(target, method, layers, seed, AUX, MASK_ID if method == "peagle" else None, 128)


def single(target, n: int, seed: int) -> tuple:
    """Features of one all-supervised random sequence and its `slot_valid`."""
    return extract_features(target, [Example(random_ids(n, seed), [True] * n)], AUX, "cpu"), torch.ones(n - 1, dtype=torch.bool)


def test_partitioned_loss_and_gradients_equal_single_pass(target):
    feats, valid = single(target, 48, 0)
    sample = cod_sample(47, 5, 0.8, 0.2, torch.Generator().manual_seed(0))
    base = make_drafter(target)
    results = {}
    for P in (1, 2, 4):
        drafter = make_drafter(target)
        drafter.load_state_dict(base.state_dict())
        passes = plan_passes([sample], [valid], [0], P)
        denom, stats, loss = sum(len(p.charged) for p in passes), DepthStats(5), 0.0
        for p in passes:
            part = peagle_pass_loss(drafter, feats, p, MASK_ID, stats, denom)
            part.backward()
            loss += part.item()
        grads = {k: p.grad.clone() for k, p in drafter.named_parameters()}
        results[P] = (loss, grads, stats.max_attn_tokens, stats.summary()[1], denom)
    loss1, grads1, tok1, count1, denom = results[1]
    assert sum(count1) == denom == len(sample[0])
    for P in (2, 4):
        loss, grads, tok, count, _ = results[P]
        assert abs(loss - loss1) / loss1 <= 1e-4
        assert count == count1
        for k in grads1:
            torch.testing.assert_close(grads[k], grads1[k], rtol=1e-4, atol=1e-6, msg=f"grad {k} (P={P})")
    assert tok1 == len(sample[0]) > results[2][2] > results[4][2]          # the largest pass shrinks with P
    # the loss is the count-normalised KL(target || draft), computed here the long way
    drafter = make_drafter(target)
    drafter.load_state_dict(base.state_dict())
    (p,) = plan_passes([sample], [valid], [0])
    with torch.no_grad():
        logq = torch.log_softmax(drafter.compute_logits(peagle_forward(drafter, feats, p, MASK_ID)), -1)
        probs = torch.softmax(target.compute_logits(feats.hidden[p.row + p.depth + 1]), -1)
        kl = (probs * (probs.log() - logq)).sum(-1).mean().item()
    assert abs(kl - loss1) / kl <= 1e-4


def test_trainer_same_loss_every_step_for_p1_and_p4(target):
    examples = [Example(random_ids(40 + 3 * i, i), [True] * (40 + 3 * i)) for i in range(4)]
    losses = {}
    for P in (1, 4):
        cfg = TrainConfig(method="peagle", num_depths=4, steps=4, batch_size=2, lr=1e-3, sequence_partitions=P, seed=7)
        tr = Trainer(target, make_drafter(target), examples, cfg)
        losses[P] = [tr.step()["loss"] for _ in range(4)]
    for a, b in zip(losses[1], losses[4]):
        assert abs(a - b) / a <= 1e-4, losses


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_trainer_same_step_whether_sequences_are_packed_or_not(target, method):
    examples = [Example(random_ids(30 + 5 * i, i), [j >= 6 for j in range(30 + 5 * i)]) for i in range(4)]
    records = {}
    for budget in (1, 10**6):  # one sequence per pass; the whole batch in one pass
        cfg = TrainConfig(method=method, num_depths=3, steps=3, batch_size=3, lr=1e-3, seed=3, pass_elements=budget)
        tr = Trainer(target, make_drafter(target, method), examples, cfg)
        records[budget] = [tr.step() for _ in range(3)]
    for a, b in zip(records[1], records[10**6]):
        assert a["passes"] == 3 and b["passes"] == 1
        assert abs(a["loss"] - b["loss"]) / a["loss"] <= 1e-4 and a["elements"] == b["elements"]
        assert abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] <= 1e-4


def test_unique_rows_equals_numpy_unique():
    import numpy as np

    from peagle_core.training.peagle import unique_rows

    g = np.random.default_rng(0)
    for values in (np.zeros(0, dtype=np.int64), np.array([7]), g.integers(0, 50, 200), g.integers(3, 9, 40)):
        rows, inverse = unique_rows(values)
        want_rows, want_inverse = np.unique(values, return_inverse=True)
        assert rows.tolist() == want_rows.tolist() and inverse.tolist() == want_inverse.tolist()


def test_passes_reach_the_device_as_views_of_one_copy():
    samples = [cod_sample(n, 4, 0.8, 0.2, torch.Generator().manual_seed(n)) for n in (9, 14, 6)]
    passes = plan_passes(samples, [torch.ones(n, dtype=torch.bool) for n in (9, 14, 6)], [0, 10, 25], 2, 12)
    moved = passes_to(passes, "cpu")
    assert len(passes) > 1 and len(moved) == len(passes)
    bases = set()
    for p, q in zip(passes, moved):
        assert (q.ends, q.charged_ends) == (p.ends, p.charged_ends)
        for name, t in p.tensors().items():
            got = q.tensors()[name]
            assert torch.equal(got, t) and got.dtype == torch.long, name
            bases.add(id(got._base))
    assert len(bases) == 1  # one buffer, one transfer


def test_default_pass_size_is_large_on_a_gpu_and_bounded_by_the_vocabulary(target):
    assert default_pass_elements("cpu", 8192) == 1
    assert default_pass_elements("cuda", 8192) == 16384     # the tiny pair: a few passes a step, not 13
    assert default_pass_elements("cuda", 256) == 16384      # capped by the dense [T, T] attention
    assert default_pass_elements("cuda", 32000) == 4096
    assert default_pass_elements("cuda", 201088) == 4096    # GPT-OSS: [T, vocab] fp32 logits bound it
    tr = Trainer(target, make_drafter(target), [Example(random_ids(20, 0), [True] * 20)],
                 TrainConfig(num_depths=2, steps=1))
    assert tr.pass_elements == 1 and tr.optimizer.defaults["fused"]  # CPU: one sequence a pass; fused AdamW


def test_depth_stats_counts_come_from_the_host_and_sums_from_one_read():
    stats = DepthStats(3)
    stats.add(torch.tensor([0, 0, 1]), [2, 1], torch.tensor([1.0, 2.0, 4.0]), torch.tensor([True, False, True]))
    stats.add(torch.tensor([1, 2]), [0, 1, 1], torch.tensor([0.5, 3.0]), torch.tensor([False, True]))
    want = ([3.0, 4.5, 3.0], [2, 2, 1], [0.5, 0.5, 1.0])
    assert stats.summary() == want and stats.summary(stats.sums.tolist()) == want


@pytest.mark.slow
@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_compiled_drafter_trains_like_the_eager_one(target, method, monkeypatch):
    """`compile=True` traces the drafter (the unrolled EAGLE-3 steps grow a key/value dict inside it) into
    graphs that compute what eager mode computes. aot_eager runs the traced graphs without code generation,
    which is all a CPU test can afford; a GPU run adds Inductor's kernels."""
    import functools
    import torch._dynamo

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    examples = [Example(random_ids(30 + 5 * i, i), [j >= 6 for j in range(30 + 5 * i)]) for i in range(3)]
    records = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        cfg = TrainConfig(method=method, num_depths=3, steps=2, batch_size=3, lr=1e-3, seed=3, pass_elements=40,
                          compile=compiled)
        tr = Trainer(target, make_drafter(target, method, layers=1), examples, cfg)
        assert (tr.model is not tr.drafter) == compiled
        records[compiled] = [tr.step() for _ in range(2)]
    for a, b in zip(records[False], records[True]):
        assert a["passes"] > 1 and a["acc"] == b["acc"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"]
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]


# --------------------------------------------------------------------------------------------
# the batched objective equals a plain per-sequence, per-element computation
# --------------------------------------------------------------------------------------------


def oracle_loss(target, drafter, examples, samples, method, kind="kl", feed="target"):
    """One step's objective the slow, obvious way: each sequence alone, its mask pair by pair, each
    element's target distribution from its own LM-head row. Backpropagates; returns (loss, counts per depth)."""
    terms = []
    for e, (anchor, depth) in zip(examples, samples):
        n, a, d = len(e.input_ids), anchor.tolist(), depth.tolist()
        with torch.no_grad():
            hidden, aux = target(torch.tensor(e.input_ids), ForwardMeta.for_sequences([n]))
        valid = e.loss_mask[2:] + e.loss_mask[-1:]
        real = drafter.combine(aux)

        def run(sel, ids, hid):
            mask = torch.tensor([[rule(a[i], d[i], a[j], d[j]) for j in sel] for i in sel])
            meta = ForwardMeta(positions=torch.tensor([a[i] + d[i] for i in sel]),
                               query_start_loc=torch.tensor([0, len(sel)]), attn_mask=mask)
            return drafter(torch.tensor(ids), torch.stack(hid), meta)

        def charge(i, normed_row):
            if valid[a[i] + d[i]]:
                logq = torch.log_softmax(drafter.compute_logits(normed_row), -1)
                t = target.compute_logits(hidden[a[i] + d[i] + 1])
                logp = torch.log_softmax(t, -1)
                terms.append((d[i], (logp.exp() * (logp - logq)).sum() if kind == "kl" else -logq[t.argmax()]))

        if method == "peagle":
            ids = [e.input_ids[x + 1] if y == 0 else MASK_ID for x, y in zip(a, d)]
            normed, _ = run(range(len(a)), ids, [real[x] if y == 0 else drafter.shared_hidden() for x, y in zip(a, d)])
            for i in range(len(a)):
                charge(i, normed[i])
            continue
        sel = [i for i in range(len(a)) if d[i] == 0]
        ids, hid = [e.input_ids[a[i] + 1] for i in sel], [real[a[i]] for i in sel]
        for j in range(max(d) + 1):  # unrolled: forward j recomputes every depth <= j
            normed, prenorm = run(sel, ids, hid)
            for k, i in enumerate(sel):
                if d[i] == j:
                    charge(i, normed[k])
            children = [i for i in range(len(a)) if d[i] == j + 1]
            for i in children:
                k = next(k for k, q in enumerate(sel) if a[q] == a[i] and d[q] == j)
                logits = target.compute_logits(hidden[a[i] + j + 1]) if feed == "target" else drafter.compute_logits(normed[k])
                ids.append(int(logits.argmax()))
                hid.append(prenorm[k])
            sel = sel + children
    loss = sum(t for _, t in terms) / len(terms)
    loss.backward()
    return loss.item(), torch.bincount(torch.tensor([dd for dd, _ in terms]), minlength=len(samples[0])).tolist()


@pytest.mark.parametrize("method,P,budget,kind,feed", [
    ("peagle", 1, 1, "kl", "target"), ("peagle", 2, 1, "kl", "target"), ("peagle", 3, 10**6, "ce", "target"),
    ("peagle", 1, 100, "kl", "target"), ("eagle3", 1, 1, "kl", "target"), ("eagle3", 1, 10**6, "kl", "draft"),
    ("eagle3", 1, 100, "ce", "target")])
def test_packed_passes_equal_the_per_sequence_oracle(target, method, P, budget, kind, feed):
    examples = [Example(random_ids(n, i), [j >= 8 + i for j in range(n)]) for i, n in enumerate([30, 41, 25])]
    valid = [slot_valid(e.loss_mask) for e in examples]
    g = torch.Generator().manual_seed(P + budget)
    K = 4 if method == "peagle" else 3
    samples = [cod_sample(ok.numel(), K, 0.8, 0.2, g, ok) for ok in valid]
    base = make_drafter(target, method)
    drafter = make_drafter(target, method)
    drafter.load_state_dict(base.state_dict())
    passes = plan_passes(samples, valid, [0, 30, 71], P, budget)
    feats = extract_features(target, examples, AUX, "cpu")
    denom, stats, loss = sum(len(p.charged) for p in passes), DepthStats(K), 0.0
    for p in passes:
        part = (peagle_pass_loss(drafter, feats, p, MASK_ID, stats, denom, kind) if method == "peagle"
                else eagle3_pass_loss(drafter, feats, p, stats, denom, kind, feed))
        part.backward()
        loss += part.item()
    oracle = make_drafter(target, method)
    oracle.load_state_dict(base.state_dict())
    ref_loss, ref_counts = oracle_loss(target, oracle, examples, samples, method, kind, feed)
    assert stats.summary()[1] == ref_counts and sum(ref_counts) == denom
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for (k, got), want in zip(drafter.named_parameters(), oracle.parameters()):
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6, msg=f"grad {k}")


# --------------------------------------------------------------------------------------------
# the objectives compute exactly what the engine computes at inference
# --------------------------------------------------------------------------------------------


def causal_run(drafter, ids, hidden):
    """Plain causal drafter pass over one sequence at positions 0..T-1 (how the engine's cache sees it)."""
    meta = ForwardMeta.for_sequences([len(ids)])
    return drafter(torch.tensor(ids) if not torch.is_tensor(ids) else ids, hidden, meta)


def test_peagle_elements_equal_one_engine_style_parallel_pass(target):
    n, K = 20, 4
    feats, valid = single(target, n, 3)
    drafter = make_drafter(target)
    (p,) = plan_passes([cod_sample(n - 1, K, 1.0, 1.0, torch.Generator())], [valid], [0])  # the full grid
    anchor, depth = p.key, p.depth
    with torch.no_grad():
        logits = drafter.compute_logits(peagle_forward(drafter, feats, p, MASK_ID))
        real = drafter.combine(feats.aux)
        for a in (0, 5, 14):
            # context slots 0..a-1, the bonus slot a, then K-1 MASK slots with the shared hidden state
            ids = feats.input_ids[1:a + 2].tolist() + [MASK_ID] * (K - 1)
            hidden = torch.cat([real[:a + 1], drafter.shared_hidden().expand(K - 1, -1)])
            normed, _ = causal_run(drafter, ids, hidden)
            ref = drafter.compute_logits(normed[a:])
            for d in range(K):
                i = int(((anchor == a) & (depth == d)).nonzero())
                torch.testing.assert_close(logits[i], ref[d], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("feed", ["target", "draft"])
def test_eagle3_unroll_equals_sequential_drafting(target, feed):
    n, K = 18, 3
    feats, valid = single(target, n, 4)
    drafter = make_drafter(target, "eagle3", layers=2)
    (p,) = plan_passes([cod_sample(n - 1, K, 1.0, 1.0, torch.Generator())], [valid], [0])
    anchor = p.key
    with torch.no_grad():
        steps = {j: (new, drafter.compute_logits(normed)) for j, new, normed in eagle3_unroll(drafter, feats, p, feed)}
        real = drafter.combine(feats.aux)
        for a in (0, 6, 13):
            ids = feats.input_ids[1:a + 2].tolist()
            hidden = real[:a + 1]
            for j in range(K):
                normed, prenorm = causal_run(drafter, ids, hidden)
                ref = drafter.compute_logits(normed[-1])
                new, lg = steps[j]
                i = int(((anchor[new] == a)).nonzero())
                torch.testing.assert_close(lg[i], ref, rtol=1e-4, atol=1e-4)
                # next step: the fed-back token at position a+j+1 and this step's pre-norm state
                tok = int(target.compute_logits(feats.hidden[a + j + 1]).argmax()) if feed == "target" else int(ref.argmax())
                ids = ids + [tok]
                hidden = torch.cat([hidden, prenorm[-1:]])


def test_eagle3_unroll_computes_each_element_once(target):
    """Step j runs the drafter over depth j's elements only (earlier depths' keys/values are reused, not
    recomputed): the unrolled forwards see len(p) query rows in all, and attend to the whole prefix."""
    feats, valid = single(target, 30, 5)
    drafter = make_drafter(target, "eagle3", layers=2)
    (p,) = plan_passes([cod_sample(29, 4, 1.0, 1.0, torch.Generator())], [valid], [0])
    rows, keys = [], []

    def record(module, args):  # (x, meta) of the second layer's attention
        rows.append(args[0].shape[0])
        keys.append(args[1].attn_mask.shape[1])

    hook = drafter.layers["1"].self_attn.register_forward_pre_hook(record)
    with torch.no_grad():
        for _ in eagle3_unroll(drafter, feats, p):
            pass
    hook.remove()
    assert rows == [b - a for a, b in zip([0] + p.ends[:-1], p.ends)] and sum(rows) == len(p)
    assert keys == p.ends


def test_element_loss_kinds():
    t = torch.tensor([[2.0, 0.0, -1.0]])
    logp, top = torch.log_softmax(t, -1), t.argmax(-1)
    assert element_loss(t, logp, top, "kl").abs().item() < 1e-6
    d = torch.tensor([[0.0, 1.0, 0.0]])
    ce = element_loss(d, logp, top, "ce").item()
    assert abs(ce - (-torch.log_softmax(d, -1)[0, 0].item())) < 1e-6
    with pytest.raises(ValueError, match="unknown loss"):
        element_loss(d, logp, top, "mse")


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


class CharTokenizer:
    """One token per character; a simple chat template with markers around each message."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 250 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=False):
        out = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return out + ("<assistant>" if add_generation_prompt else "")


def test_chat_loss_mask_covers_assistant_content_and_end_marker():
    tok = CharTokenizer()
    msgs = [{"role": "user", "content": "hi ok"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "sure"}]
    ex = render_chat(msgs, tok)
    text = tok.apply_chat_template(msgs)
    assert ex.input_ids == tok.encode(text)
    supervised = "".join(c for c, m in zip(text, ex.loss_mask) if m)
    assert supervised == "ok|sure|"  # the user's "ok" is not taken for the reply


def test_chat_with_the_harmony_template():
    from peagle_core.loading.tokenizer import apply_chat_template

    class Harmony(CharTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=False):
            return apply_chat_template(messages, add_generation_prompt)

    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    ex = render_chat(msgs, Harmony())
    text = apply_chat_template(msgs, False)
    assert "".join(c for c, m in zip(text, ex.loss_mask) if m) == "4<"  # content + first char of <|end|>


def test_jsonl_records_and_errors(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "abcdef"}\n\n{"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1]}\n'
                 '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "answer"}]}\n')
    exs = load_examples(p, CharTokenizer(), max_len=40)
    assert [len(e.input_ids) for e in exs] == [6, 5, 26]
    assert exs[0].loss_mask == [True] * 6 and exs[1].loss_mask == [False, False, True, True, True]
    assert sum(exs[2].loss_mask) == len("answer|")
    # truncation; a chat cut before its reply has nothing to learn and is dropped
    assert [len(e.input_ids) for e in load_examples(p, CharTokenizer(), max_len=5)] == [5, 5]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_jsonl(bad)
    with pytest.raises(ValueError, match="tokenizer"):
        load_examples(p, None, max_len=16)
    with pytest.raises(ValueError, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_regenerate_keeps_prompt_and_supervises_the_targets_greedy_continuation(target):
    recs = [{"input_ids": random_ids(12, 9)}, {"input_ids": random_ids(20, 10)}]
    exs = regenerate(recs, target, None, max_new_tokens=6, max_len=64, prompt_tokens=5)
    for rec, ex in zip(recs, exs):
        assert ex.input_ids[:5] == rec["input_ids"][:5] and len(ex.input_ids) == 11
        assert ex.loss_mask == [False] * 5 + [True] * 6
        with torch.no_grad():  # teacher-forced argmax over the whole sequence reproduces the continuation
            h, _ = target(torch.tensor(ex.input_ids), ForwardMeta.for_sequences([11]))
            assert target.compute_logits(h[4:10]).argmax(-1).tolist() == ex.input_ids[5:]
    # generation stops at a stop token
    first = greedy_generate(target, [recs[0]["input_ids"][:5]], 6)[0]
    assert greedy_generate(target, [recs[0]["input_ids"][:5]], 6, stop_ids=[first[1]])[0] == first[:2]


# --------------------------------------------------------------------------------------------
# trainer / CLI
# --------------------------------------------------------------------------------------------


def test_bf16_autocast_step_runs(target_dir):
    t = load_target(target_dir, torch.bfloat16, "cpu")
    examples = [Example(random_ids(24, i), [True] * 24) for i in range(2)]
    for method in ("peagle", "eagle3"):
        d = init_drafter(t, method, 1, 0, AUX, MASK_ID if method == "peagle" else None, 64)
        rec = Trainer(t, d, examples, TrainConfig(method=method, num_depths=3, steps=2, batch_size=2,
                                                  dtype="bfloat16")).step()
        assert torch.isfinite(torch.tensor(rec["loss"])) and rec["loss"] > 0
        assert d.fc.weight.dtype == torch.float32  # fp32 master weights


def test_time_budget_fits_the_step_count_and_stretches_the_schedule(target):
    examples = [Example(random_ids(24, i), [True] * 24) for i in range(2)]
    cfg = TrainConfig(method="eagle3", num_depths=2, steps=1000, batch_size=2, lr=1e-3, warmup_ratio=0.1,
                      time_budget_s=10.0)
    tr = Trainer(target, make_drafter(target, "eagle3", 1), examples, cfg)
    tr.step_num = 10
    records = [{"step_time_s": 3.0}] + [{"step_time_s": 0.125}] * 9  # the first step (compilation) is not counted
    tr.fit_steps_to_budget(elapsed=4.0, records=records)
    assert cfg.steps == 10 + 48 and cfg.warmup_steps == 6  # (10 s - 4 s) / 0.125 s more steps
    tr.fit_steps_to_budget(elapsed=20.0, records=records)  # already over: at least one more step
    assert cfg.steps == 11
    with pytest.raises(ValueError, match="time budget"):
        TrainConfig(time_budget_s=0)


def test_cli_trains_and_writes_a_loadable_head(target_dir, tmp_path, capsys):
    from peagle_core.training.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": random_ids(30, i)}) + "\n" for i in range(4)))
    out, log = tmp_path / "head", tmp_path / "log.jsonl"
    rc = main(["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--method", "peagle",
               "--num-depths", "3", "--layers", "2", "--steps", "3", "--seed", "1", "--sequence-partitions", "2",
               "--max-len", "24", "--log-jsonl", str(log), "--device", "cpu", "--dtype", "float32",
               "--aux-layers", "1,2,3", "--mask-token-id", str(MASK_ID), "--lr", "1e-3", "--batch-size", "2",
               "--no-progress", "--intermediate-size", "64"])
    assert rc == 0, capsys.readouterr().err
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(len(r["acc"]) == 3 and r["loss"] > 0 and r["tokens_per_s"] > 0 and "lr" in r for r in recs)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["ptd_token_id"] == MASK_ID and cfg["parallel_drafting"] is True
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX and cfg["num_hidden_layers"] == 2
    head = load_drafter(out, load_target(target_dir, torch.float32, "cpu"), torch.float32, "cpu")
    assert head.mask_hidden is not None and head.config.mask_token_id == MASK_ID


@pytest.mark.parametrize("extra,msg", [(["--method", "eagle3", "--sequence-partitions", "2"], "peagle only"),
                                       (["--aux-layers", "1,9"], "outside"),
                                       (["--cod-ratio", "0"], "COD ratios")])
def test_cli_reports_bad_input_in_one_line(target_dir, tmp_path, capsys, extra, msg):
    from peagle_core.training.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input_ids": random_ids(30, 0)}) + "\n")
    rc = main(["--target", str(target_dir), "--data", str(data), "--out", str(tmp_path / "o"), "--steps", "1",
               "--no-progress", "--device", "cpu", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and "Traceback" not in err
    rc = main(["--target", str(target_dir), "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o"),
               "--no-progress", "--device", "cpu"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_default_mask_token_prefers_a_reserved_special_token():
    from peagle_core.training.trainer import default_mask_token_id

    cfg = tiny_target_config()  # vocab 256, eos 255, pad 254
    assert default_mask_token_id(cfg) == 253
    assert default_mask_token_id(cfg, {"<|end|>": 6, "<|reserved_1|>": 20, "<|reserved_2|>": 30}) == 30
    assert default_mask_token_id(cfg, {"<|reserved_2|>": 30, "<|reserved_mask|>": 9}) == 9
