"""The tiny pair on this CPU as `configs/tiny.yaml` serves it (max_num_seqs 4): plain decoding, fixed K = 3 and the
adaptive policy (K up to 7), greedy or sampled, over held-out MT-Bench prompts; one line of JSON per mode (for the
adaptive one also the steps by k chosen, the exploring steps and its estimate of the first draft's acceptance).

    python benchmarks/tiny_sampled_speed.py --temperature 1.0 --prompts 24

At temperature 1 the tiny target is uncertain enough that drafts are seldom accepted: this shows what speculation
costs then, and how much of it the adaptive policy wins back (a step at k = 0 that drafts nothing runs no drafter; the
next step that drafts catches the drafter's cache up).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from adaptive_sweep import heldout_prompts  # noqa: E402
from peagle_core import LLM, SamplingParams  # noqa: E402

PEAGLE = {"method": "eagle3", "model": "tiny-peagle", "parallel_drafting": True}
MODES = {"none": None, "K3": {**PEAGLE, "num_speculative_tokens": 3},
         "adaptive7": {**PEAGLE, "num_speculative_tokens": 7, "adaptive": True}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    for name, spec in MODES.items():
        llm = LLM("tiny", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=1024, speculative_config=spec)
        prompts = heldout_prompts(llm.tokenizer, args.prompts)["mtbench"]
        params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=i)
                  for i in range(len(prompts))]
        llm.generate(prompts[:4], params[:4])  # warm-up
        llm.engine.stats = type(llm.engine.stats)()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        secs = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {"mode": name, "temperature": args.temperature, "tokens_per_s": round(tokens / secs, 1),
               "acceptance_length": round(llm.engine.stats.acceptance_length, 3)}
        if spec and spec.get("adaptive"):  # where its steps went (warm-up included): k chosen, explorations, a_1
            d = llm.engine.policy.describe()
            row["policy"] = {k: round(v, 3) for k, v in d.items()
                             if k.startswith("steps_at_k.") or k in ("steps", "explored_steps", "accept_rate_1")}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
