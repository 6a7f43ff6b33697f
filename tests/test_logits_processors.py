"""Penalties, min_tokens, logit_bias, min_p, allowed_token_ids and bad_words stay exact under speculative
verification; min_tokens holds stop strings back as vLLM does; n samples are the seeded single requests.

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
            dict(logit_bias={280: -5.0, 13: 2.0}), dict(presence_penalty=-0.4, repetition_penalty=0.8, min_p=0.05),
            dict(allowed_token_ids=list(range(40, 120))), dict(bad_words=["the universe", "and"])]


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


def reference_logprobs(target, prompt: list[int], out: list[int], sp: SamplingParams, stop_ids: set[int],
                       bad: list[list[int]] = ()):
    """One position at a time: plain-forward logits, then allowed ids, bad words (`bad`, as token ids), bias,
    min_tokens, penalties on the true history, temperature, min_p, top-k, top-p; log-softmax."""
    ids = torch.tensor(prompt + out)
    with torch.no_grad():
        h, _ = target(ids, ForwardMeta.for_sequences([len(ids)]))
        logits = target.compute_logits(h)[len(prompt) - 1:-1].float()
    rows = []
    for t, x in enumerate(logits):
        x = x.clone()
        if sp.allowed_token_ids is not None:
            keep = x[sp.allowed_token_ids].clone()
            x[:] = float("-inf")
            x[sp.allowed_token_ids] = keep
        for word in bad:
            if len(word) - 1 <= t and out[t - len(word) + 1:t] == word[:-1]:
                x[word[-1]] = float("-inf")
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
    assert_logprobs_follow_the_reference(llm, target, prompt, sp).spec_decode_stats.num_accepted_tokens > 0


def assert_logprobs_follow_the_reference(llm, target, prompt: list[int], sp: SamplingParams, tol: float = 2e-4):
    """The emitted tokens' log-probabilities against `reference_logprobs` on their true histories."""
    from peagle_core.engine.logits_processors import bad_words_ids

    o = llm.generate([prompt], sp)[0]
    out = o.outputs[0]
    ref = reference_logprobs(target, prompt, out.token_ids, sp, llm.engine.stop_ids,
                             bad_words_ids(llm.tokenizer, sp.bad_words))
    got = [d[t].logprob for t, d in zip(out.token_ids, out.logprobs)]
    want = [ref[i, t].item() for i, t in enumerate(out.token_ids)]
    assert all(math.isfinite(w) for w in want)
    assert got == pytest.approx(want, abs=tol)
    return o


def _contains(ids: list[int], word: list[int]) -> bool:
    return any(ids[i:i + len(word)] == word for i in range(len(ids) - len(word) + 1))


def test_allowed_token_ids_and_bad_words_hold_with_and_without_speculation(engines):
    from peagle_core.engine.logits_processors import bad_words_ids

    llm = engines["none"]
    prompt = llm.tokenizer.encode("The quick brown fox")
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    allowed = sorted(set(free.token_ids[2:6]) | set(range(100, 140)))  # some of what it says, and others
    words = [llm.tokenizer.decode(free.token_ids[i:i + 2]) for i in (0, 6, 12)]  # two-token words it says
    bad = bad_words_ids(llm.tokenizer, words)
    assert any(_contains(free.token_ids, w) for w in bad)
    for kw in (dict(allowed_token_ids=allowed), dict(bad_words=words), dict(allowed_token_ids=allowed, bad_words=words)):
        for temperature, seed in ((0, None), (1.0, 5)):
            sp = SamplingParams(temperature=temperature, seed=seed, max_tokens=40, ignore_eos=True, **kw)
            outs = {m: engines[m].generate([prompt], sp)[0].outputs[0].token_ids for m in engines}
            for ids in outs.values():
                assert "allowed_token_ids" not in kw or set(ids) <= set(allowed)
                assert "bad_words" not in kw or not any(_contains(ids, w) for w in bad)
            if temperature == 0:  # greedy: speculation changes nothing
                assert outs["peagle"] == outs["eagle3"] == outs["none"] != free.token_ids


@pytest.mark.parametrize("mode", list(SPEC))
def test_sampled_logprobs_with_allowed_ids_and_bad_words_follow_each_positions_true_history(engines, mode):
    target = load_target(resolve("tiny"), torch.float32, "cpu")
    llm = engines[mode]
    prompt = llm.tokenizer.encode("Once upon a time")
    sp = SamplingParams(temperature=0.8, max_tokens=32, seed=4, logprobs=0, allowed_token_ids=list(range(30, 400)),
                        bad_words=["the", " there was", "once upon"])
    assert assert_logprobs_follow_the_reference(llm, target, prompt, sp).spec_decode_stats.num_accepted_tokens > 0


def test_bad_words_are_each_word_as_written_and_after_a_space(engines):
    from peagle_core.engine.logits_processors import bad_words_ids

    tok = engines["none"].tokenizer
    (bare, spaced) = bad_words_ids(tok, ["  fox"])
    assert tok.decode(bare) == "fox" and tok.decode(spaced) == " fox"
    assert bad_words_ids(tok, ["fox jumped"])[0] == tok.encode("fox jumped")


def test_min_tokens_holds_stop_strings_back(engines):
    """vLLM's: a stop string counts only where it ends after the text of the first min_tokens tokens."""
    llm = engines["none"]
    tok = llm.tokenizer
    prompt = tok.encode("Once upon a time")
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0].outputs[0]
    text = free.text
    stop = next(text[i:i + 2] for i in range(len(text)) if text.count(text[i:i + 2]) >= 2
                and text.index(text[i:i + 2]) < len(tok.decode(free.token_ids[:4])))  # early, and again later
    for m in (0, 8, 20):
        early = len(tok.decode(free.token_ids[:m]))
        cut = next((i for i in range(len(text)) if text.startswith(stop, i) and i + len(stop) > early), None)
        sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[stop], min_tokens=m)
        for mode, e in engines.items():
            out = e.generate([prompt], sp)[0].outputs[0]
            assert out.text == (text if cut is None else text[:cut]), (mode, m)
            assert len(out.token_ids) >= m


def test_n_samples_are_the_seeded_single_requests(engines):
    llm = engines["peagle"]
    prompt = "Once upon a time"
    sp = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=2**64 - 2, n=3)
    (o,) = llm.generate([prompt], sp)
    assert [c.index for c in o.outputs] == [0, 1, 2]
    singles = [llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=s))[0]
               for s in (2**64 - 2, 2**64 - 1, 0)]  # the seeds wrap around 64 bits
    assert [c.token_ids for c in o.outputs] == [s.outputs[0].token_ids for s in singles]
    assert [c.text for c in o.outputs] == [s.outputs[0].text for s in singles]
    assert o.spec_decode_stats.num_drafts == sum(s.spec_decode_stats.num_drafts for s in singles)
    unseeded = llm.generate([prompt, prompt], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, n=2))
    samples = [c.token_ids for r in unseeded for c in r.outputs]
    assert len(samples) == 4 and all(len(s) == 16 for s in samples)
    assert len({tuple(s) for s in samples}) == 4  # independent draws (16 tokens alike by chance: negligible)
