"""Log-probabilities of emitted tokens equal the target's processed distribution, drafted or not.

Oracle: one plain forward of the target over prompt + output (no paging, no speculation; test_target_parity
checks that forward against transformers), then softmax(logits / T) after top-k and top-p.
"""
from __future__ import annotations

import pytest
import torch

from peagle_core import LLM, SamplingParams
from peagle_core.loading.checkpoint import load_target
from peagle_core.loading.hub import resolve
from peagle_core.models.layers import ForwardMeta

SPEC = {"peagle": {"method": "eagle3", "model": "tiny-peagle", "num_speculative_tokens": 3, "parallel_drafting": True},
        "eagle3": {"method": "eagle3", "model": "tiny-eagle3", "num_speculative_tokens": 3}, "none": None}
PARAMS = [SamplingParams(temperature=0, max_tokens=24, logprobs=5, ignore_eos=True),
          SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=24, logprobs=3, seed=1, ignore_eos=True),
          SamplingParams(temperature=1.3, max_tokens=24, logprobs=0, seed=2, ignore_eos=True)]


@pytest.fixture(scope="module")
def target():
    return load_target(resolve("tiny"), torch.float32, "cpu")


def reference(target, prompt: list[int], out: list[int], sp: SamplingParams) -> torch.Tensor:
    """log of the processed distribution at each output position, [len(out), V]."""
    ids = torch.tensor(prompt + out)
    with torch.no_grad():
        h, _ = target(ids, ForwardMeta.for_sequences([len(ids)]))
        x = target.compute_logits(h)[len(prompt) - 1:-1].float()
    if sp.temperature > 0:
        x = x / sp.temperature
    if sp.top_k > 0:
        x = x.masked_fill(x < x.topk(sp.top_k, dim=-1).values[:, -1:], float("-inf"))
    if sp.top_p < 1:
        p, order = torch.softmax(x, -1).sort(-1, descending=True)
        drop = (p.cumsum(-1) - p) >= sp.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    return torch.log_softmax(x, -1)


@pytest.mark.parametrize("mode", list(SPEC))
def test_logprobs_are_the_targets_processed_distribution(target, mode):
    llm = LLM("tiny", device="cpu", dtype="float32", max_model_len=256, speculative_config=SPEC[mode])
    prompt = llm.tokenizer.encode("The quick brown fox")
    accepted = 0
    for sp in PARAMS:
        o = llm.generate([prompt], sp)[0]
        out = o.outputs[0]
        assert len(out.logprobs) == len(out.token_ids) == sp.max_tokens
        accepted += o.spec_decode_stats.num_accepted_tokens
        ref = reference(target, prompt, out.token_ids, sp)
        for i, (tok, d) in enumerate(zip(out.token_ids, out.logprobs)):
            assert d[tok].logprob == pytest.approx(ref[i, tok].item(), abs=1e-4)
            assert d[tok].rank == 1 + int((ref[i] > ref[i, tok] + 1e-5).sum())
            top = sorted((lp.rank, t, lp.logprob) for t, lp in d.items() if t != tok or lp.rank <= sp.logprobs)
            assert [r for r, _, _ in top][:sp.logprobs] == list(range(1, sp.logprobs + 1))
            want = ref[i].topk(sp.logprobs)
            assert [t for _, t, _ in top[:sp.logprobs]] == want.indices.tolist()
            assert [v for _, _, v in top[:sp.logprobs]] == pytest.approx(want.values.tolist(), abs=1e-4)
        if sp.temperature == 0:
            assert all(d[t].rank == 1 for t, d in zip(out.token_ids, out.logprobs))
    assert (accepted > 0) == (mode != "none")  # some of the checked tokens were drafts the target accepted


def test_no_logprobs_unless_asked():
    llm = LLM("tiny", device="cpu", dtype="float32", max_model_len=128, speculative_config=SPEC["peagle"])
    assert llm.generate("Hello", SamplingParams(max_tokens=4))[0].outputs[0].logprobs is None
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
