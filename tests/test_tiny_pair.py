"""The shipped tiny pair (`peagle_core/assets/tiny`): it loads, its greedy output is pinned, speculation with
either trained head reproduces it, and the heads are trained (they accept far more than a random head would)."""
from __future__ import annotations

import pytest
import torch

from peagle_core import LLM, SamplingParams
from peagle_core.tiny import ASSETS

# Greedy continuations of the shipped target, 32 tokens (fp32, CPU). transformers' GPT-OSS gives the same argmax
# chain; the smallest top-1/top-2 logit margin along them is 0.084 and 0.024, far above fp32 round-off.
PINNED = {
    "def fibonacci(n):": [230, 26, 21, 318, 35] * 6 + [230, 26],
    "The capital of France is": [280, 1695, 3732, 306, 367, 301, 280, 2512, 23, 452, 1853, 339, 377, 280, 1853, 339,
                                 480, 270, 4624, 8059, 306, 280, 1853, 21, 305, 280, 1853, 339, 480, 270, 4624, 8059],
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def generate(spec: dict | None = None) -> tuple[list[list[int]], LLM]:
    llm = LLM(model="tiny", device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4, speculative_config=spec)
    return [o.outputs[0].token_ids for o in llm.generate(list(PINNED), GREEDY)], llm


def test_the_shipped_target_gives_the_pinned_greedy_output():
    outs, _ = generate()
    assert outs == list(PINNED.values())


def test_the_pinned_output_is_transformers_argmax_chain():
    transformers = pytest.importorskip("transformers")
    from peagle_core.loading.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ASSETS)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ASSETS / "target"), torch_dtype=torch.float32).eval()
    for prompt, out in PINNED.items():
        ids = tok.encode(prompt)
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0]
        assert logits[len(ids) - 1:-1].argmax(-1).tolist() == out, prompt


@pytest.mark.parametrize("mode,k,min_acceptance", [("peagle", 7, 1.8), ("peagle", 3, 1.6), ("eagle3", 3, 1.6)])
def test_trained_heads_keep_the_pinned_output_and_accept_many(mode, k, min_acceptance):
    """Lossless: the same tokens as plain greedy. Trained: 2.4 (P-EAGLE, K = 7) and 2.0 (EAGLE-3, K = 3) tokens a
    step on these prompts when pinned; a head that had learnt nothing would sit near 1."""
    spec = {"method": "eagle3", "model": f"tiny-{mode}", "num_speculative_tokens": k,
            "parallel_drafting": mode == "peagle"}
    outs, llm = generate(spec)
    assert outs == list(PINNED.values())
    assert llm.engine.stats.acceptance_length >= min_acceptance


def test_the_shipped_pair_fits_the_40_mb_the_package_allows():
    size = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    assert size <= 40_000_000, f"peagle_core/assets/tiny is {size / 1e6:.1f} MB"
