"""Why a tiny P-EAGLE head's acceptance is what it is: its first-draft accuracy on held-out greedy outputs,
split by how clear the target's own choice was.

    python scripts/tiny/diagnose_heads.py --pair peagle_core/assets/tiny --prompts 30 --max-tokens 64

For each held-out prompt (the sets `evaluate.py` uses) the target answers greedily; then one causal drafter
forward over the whole answer (every slot real, as for the first draft of a step: slot r holds token r + 1 and
the target's aux states of token r) predicts token r + 2 at every position, and is compared with the target's
greedy choice there. The target's top-1 minus top-2 probability at that position says how clear the choice was:
a near-tie flips on the smallest difference, which no drafter can follow. CPU, fp32.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate import load_prompts  # noqa: E402  (the held-out sets, as evaluated)

from peagle_core import LLM, SamplingParams  # noqa: E402
from peagle_core.models.layers import ForwardMeta  # noqa: E402
from peagle_core.training.data import Example  # noqa: E402
from peagle_core.training.features import extract_features  # noqa: E402

MARGINS = [0.0, 0.05, 0.1, 0.2, 0.4, 1.01]


@torch.no_grad()
def first_draft_hits(runner, ids: list[int], answer_from: int) -> list[tuple[float, bool]]:
    """(target's top-1 - top-2 probability, drafter's first draft == target's choice) per answer position."""
    target, drafter = runner.target, runner.drafter
    aux_ids = drafter.config.resolved_aux_layer_ids(target.config.num_hidden_layers)
    f = extract_features(target, [Example(ids, [True] * len(ids))], aux_ids, "cpu")
    n = len(ids)
    normed, _ = drafter(f.input_ids[1:], drafter.combine(f.aux[:-1]), ForwardMeta.for_sequences([n - 1], "cpu"))
    pred = drafter.to_target_ids(drafter.compute_logits(normed).argmax(-1))  # slot r -> token r + 2
    top = torch.softmax(target.compute_logits(f.hidden).float(), -1).topk(2, -1)  # row j -> token j + 1
    return [(float(top.values[r + 1, 0] - top.values[r + 1, 1]), int(pred[r]) == int(top.indices[r + 1, 0]))
            for r in range(max(answer_from - 2, 0), n - 2)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="peagle_core/assets/tiny")
    p.add_argument("--prompts", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=64)
    a = p.parse_args()
    llm = LLM(f"{a.pair}/target", device="cpu", speculative_config={
        "method": "eagle3", "model": f"{a.pair}/peagle", "num_speculative_tokens": 1, "parallel_drafting": True})
    report = {}
    for name, prompts in load_prompts(llm.tokenizer, a.prompts).items():
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=a.max_tokens))
        hits = [h for o in outs for h in first_draft_hits(llm.engine.runner, list(o.prompt_token_ids)
                                                          + list(o.outputs[0].token_ids), len(o.prompt_token_ids))]
        rows = []
        for lo, hi in zip(MARGINS, MARGINS[1:]):
            cell = [ok for m, ok in hits if lo <= m < hi]
            rows.append({"margin": [lo, min(hi, 1.0)], "share": len(cell) / len(hits),
                         "accuracy": sum(cell) / max(len(cell), 1)})
        report[name] = {"positions": len(hits), "accuracy": sum(ok for _, ok in hits) / len(hits), "by_margin": rows}
        print(name, json.dumps(report[name]))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
