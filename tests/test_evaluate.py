"""`scripts/tiny/evaluate.py --temperature` on the shipped pair: sampled runs sample, and are not compared with plain
decoding (speculation keeps the distribution, not the draws). Its greedy runs are tested in test_tokenizer.py."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = {"mtbench": ["Tell me about the sea."], "humaneval": ["def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n"]}


@pytest.fixture
def evaluate(monkeypatch):
    spec = importlib.util.spec_from_file_location("tiny_evaluate", ROOT / "scripts/tiny/evaluate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "load_prompts", lambda tokenizer, n: {k: v[:n] for k, v in PROMPTS.items()})
    return mod


def run(mod, temperature: float) -> list[dict]:
    return mod.evaluate(ROOT / "peagle_core/assets/tiny", 1, 12, ks=(3,), temperature=temperature, device="cpu",
                        max_num_seqs=4, max_model_len=256)


def test_sampled_rows_sample_and_are_not_compared(evaluate):
    greedy, sampled = run(evaluate, 0.0), run(evaluate, 1.0)
    assert all(r["identical_to_plain"] is None for r in sampled)
    key = lambda rows: [(r["method"], r["dataset"], r["output_tokens"], r["acceptance_length"]) for r in rows]
    assert key(sampled) != key(greedy)
    table = evaluate.markdown(sampled, {"machine": "m", "torch": "t", "date": "d", "command": "c", "plot": "p",
                                        "temperature": 1.0})
    assert "-/1" in table and "Sampled at temperature 1.0" in table
