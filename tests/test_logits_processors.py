"""Penalties, min_tokens, logit_bias and min_p stay exact under speculative verification.

Two oracles: greedy decoding with them gives the same tokens with P-EAGLE / EAGLE-3 as without
speculation, and the log-probability of every emitted token (drafted or not) equals a reference that
processes one position at a time from a plain forward of the target, with that position's true history.
"""
from __future__ import annotations

import math

import pytest
import torch

from peagle_core import LLM, SamplingParams
from peagle_core.loading.checkpoint import load_target
from peagle_core.loading.hub import resolve
from peagle_core.models.layers import ForwardMeta

SPEC = {"peagle": {"method": "eagle3", "model": "tiny-peagle", "num_speculative_tokens": 3, "parallel_drafting": True},
        "eagle3": {"method": "eagle3", "model": "tiny-eagle3", "num_speculative_tokens": 3}}
SETTINGS = [dict(presence_penalty=0.5, frequency_penalty=0.3), dict(repetition_penalty=1.3),
            dict(logit_bias={280: -5.0, 13: 2.0}), dict(presence_penalty=-0.4, repetition_penalty=0.8, min_p=0.05)]


@pytest.fixture(scope="module")
def engines():
    out = {m: LLM("tiny", device="cpu", dtype="float32", max_model_len=256, speculative_config=s)
           for m, s in SPEC.items()}
    out["none"] = LLM("tiny", device="cpu", dtype="float32", max_model_len=256)
    return out


@pytest.mark.parametrize("kw", SETTINGS, ids=[",".join(k) for k in SETTINGS])
def test_greedy_with_processors_is_the_same_with_or_without_speculation(engines, kw):
    prompt = engines["none"].tokenizer.encode("The quick brown fox")
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **kw)
    plain = engines["none"].generate([prompt], sp)[0].outputs[0].token_ids
    unprocessed = engines["none"].generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert plain != unprocessed[0].outputs[0].token_ids  # the setting changes the answer
    for mode in SPEC:
        out = engines[mode].generate([prompt], sp)[0]
        assert out.outputs[0].token_ids == plain, mode
        assert out.spec_decode_stats.num_accepted_tokens > 0


def test_min_tokens_holds_stop_tokens_back(engines):
    prompt = engines["none"].tokenizer.encode("The quick brown fox")
    free = engines["none"].generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stop = free[0].outputs[0].token_ids[3]
    sp = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop], min_tokens=10)
    early = engines["none"].generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop]))
    assert len(early[0].outputs[0].token_ids) <= 4
    plain = engines["none"].generate([prompt], sp)[0].outputs[0]
    assert len(plain.token_ids) >= 10 and stop not in plain.token_ids[:10]
    for mode in SPEC:
        assert engines[mode].generate([prompt], sp)[0].outputs[0].token_ids == plain.token_ids


def reference_logprobs(target, prompt: list[int], out: list[int], sp: SamplingParams, stop_ids: set[int]):
    """One position at a time: plain-forward logits, then bias, min_tokens, penalties on the true history,
    temperature, min_p, top-k, top-p; log-softmax."""
    ids = torch.tensor(prompt + out)
    with torch.no_grad():
        h, _ = target(ids, ForwardMeta.for_sequences([len(ids)]))
        logits = target.compute_logits(h)[len(prompt) - 1:-1].float()
    rows = []
    for t, x in enumerate(logits):
        x = x.clone()
        for tok, b in (sp.logit_bias or {}).items():
            x[tok] += b
        if t < sp.min_tokens:
            x[list(set(sp.stop_token_ids) | (set() if sp.ignore_eos else stop_ids))] = float("-inf")
        hist = out[:t]
        counts = torch.bincount(torch.tensor(hist, dtype=torch.long), minlength=len(x)).float() if hist \
            else torch.zeros(len(x))
        seen = set(prompt) | set(hist)
        for tok in seen:
            x[tok] = x[tok] / sp.repetition_penalty if x[tok] > 0 else x[tok] * sp.repetition_penalty
        x -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).float()
        x = x / sp.temperature
        if sp.min_p:
            p = torch.softmax(x, -1)
            x[p < sp.min_p * p.max()] = float("-inf")
        if sp.top_k > 0:
            x[x < x.topk(sp.top_k).values[-1]] = float("-inf")
        rows.append(torch.log_softmax(x, -1))
    return torch.stack(rows)


@pytest.mark.parametrize("mode", list(SPEC))
def test_sampled_logprobs_follow_each_positions_true_history(engines, mode):
    target = load_target(resolve("tiny"), torch.float32, "cpu")
    llm = engines[mode]
    prompt = llm.tokenizer.encode("Once upon a time")
    sp = SamplingParams(temperature=0.7, top_k=50, max_tokens=32, seed=3, logprobs=0, presence_penalty=0.4,
                        frequency_penalty=0.2, repetition_penalty=1.2, min_p=0.02, logit_bias={13: 1.5},
                        min_tokens=8)
    o = llm.generate([prompt], sp)[0]
    out = o.outputs[0]
    assert o.spec_decode_stats.num_accepted_tokens > 0
    ref = reference_logprobs(target, prompt, out.token_ids, sp, llm.engine.stop_ids)
    got = [d[t].logprob for t, d in zip(out.token_ids, out.logprobs)]
    want = [ref[i, t].item() for i, t in enumerate(out.token_ids)]
    assert all(math.isfinite(w) for w in want)
    assert got == pytest.approx(want, abs=2e-4)
