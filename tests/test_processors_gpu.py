"""GPU: logits processors and log-probabilities on the engine with CUDA graphs stay exact under speculation.

The processors run on the verify step's logits outside the graphs, the target's forward inside them: greedy
with processors gives the same tokens with P-EAGLE / EAGLE-3 as without speculation, and the log-probability
of every emitted token equals a per-position reference from a plain forward (tests/test_logits_processors.py's,
on the CPU) within fp32 tolerance. Run: pytest -m gpu tests/test_processors_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from peagle_core import LLM, SamplingParams
from peagle_core.loading.checkpoint import load_target
from peagle_core.loading.hub import resolve

from test_logits_processors import SPEC, assert_logprobs_follow_the_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROCESSORS = [dict(presence_penalty=0.5, frequency_penalty=0.3), dict(repetition_penalty=1.3),
              dict(logit_bias={280: -5.0, 13: 2.0}, min_tokens=12), dict(min_p=0.05, presence_penalty=-0.4),
              dict(allowed_token_ids=list(range(30, 600))), dict(bad_words=["the universe", "and"])]
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def engines():
    """CUDA graphs on (the default off the CPU), fp32 so greedy ties are the model's, not rounding's."""
    out = {m: LLM("tiny", device="cuda", dtype="float32", max_model_len=256, max_num_seqs=4, speculative_config=s)
           for m, s in SPEC.items()}
    out["none"] = LLM("tiny", device="cuda", dtype="float32", max_model_len=256, max_num_seqs=4)
    return out


@pytest.mark.parametrize("kw", PROCESSORS, ids=[",".join(k) for k in PROCESSORS])
def test_greedy_with_processors_under_graphs_is_the_same_with_or_without_speculation(engines, kw):
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, **kw)
    plain = [o.outputs[0].token_ids for o in engines["none"].generate(PROMPTS, sp)]
    free = [o.outputs[0].token_ids for o in engines["none"].generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))]
    assert plain != free  # the setting changes the answer
    for mode in SPEC:
        outs = engines[mode].generate(PROMPTS, sp)
        assert [o.outputs[0].token_ids for o in outs] == plain, mode
        assert sum(o.spec_decode_stats.num_accepted_tokens for o in outs) > 0
        graphs = engines[mode].engine.runner.graphs
        assert graphs is not None and graphs.num_graphs > 0  # the steps ran in graphs


@pytest.mark.parametrize("mode", ["none", *SPEC])
def test_logprobs_with_processors_under_graphs_equal_a_plain_forward(engines, mode):
    target = load_target(resolve("tiny"), torch.float32, "cpu")
    llm = engines[mode]
    prompt = llm.tokenizer.encode("Once upon a time")
    for sp in (SamplingParams(temperature=0.7, top_k=50, max_tokens=32, seed=3, logprobs=0, presence_penalty=0.4,
                              frequency_penalty=0.2, repetition_penalty=1.2, min_p=0.02, logit_bias={13: 1.5},
                              min_tokens=8),
               SamplingParams(temperature=0.8, max_tokens=32, seed=4, logprobs=0,
                              allowed_token_ids=list(range(30, 400)), bad_words=["the", " there was"])):
        assert_logprobs_follow_the_reference(llm, target, prompt, sp, tol=2e-3)  # GPU against CPU, in fp32
