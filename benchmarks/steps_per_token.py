"""Engine steps per generated token, one request at a time (CPU is fine): none / EAGLE-3 / P-EAGLE at K = 1, 3, 7.

    python benchmarks/steps_per_token.py --pair peagle_core/assets/tiny      # the shipped trained pair
    python benchmarks/steps_per_token.py --random                             # a tiny random checkpoint

With one request in flight every step emits 1 + accepted tokens, so steps/token = 1 / acceptance length;
the table checks that identity and the losslessness of every run against plain greedy decoding.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from peagle_core import LLM, SamplingParams


def measure(pair: Path, prompts: list, max_tokens: int, chat: bool) -> list[dict]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows, plain = [], None
    for mode in ("none", "eagle3", "peagle"):
        for k in ((0,) if mode == "none" else (1, 3, 7)):
            spec = None if mode == "none" else {"method": "eagle3", "model": str(pair / mode),
                                                 "num_speculative_tokens": k, "parallel_drafting": mode == "peagle"}
            llm = LLM(str(pair / "target"), speculative_config=spec, max_num_seqs=1)
            ps = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts] if chat else prompts
            outs = llm.generate(ps, sp)
            ids = [o.outputs[0].token_ids for o in outs]
            plain = plain or ids
            tokens = sum(map(len, ids))
            rows.append({"mode": mode, "k": k, "steps_per_token": llm.engine.num_steps / tokens,
                         "acceptance_length": llm.engine.stats.acceptance_length, "lossless": ids == plain})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=Path("peagle_core/assets/tiny"))
    ap.add_argument("--random", action="store_true", help="build a tiny random pair instead")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    if args.random:
        from peagle_core.testing import build_drafter, build_target, tiny_target_config
        pair = Path(tempfile.mkdtemp())
        cfg = tiny_target_config()
        build_target(pair / "target", cfg, scale=4.0)
        build_drafter(pair / "peagle", cfg, parallel=True)
        build_drafter(pair / "eagle3", cfg, parallel=False)
        rows = measure(pair, [[1, 2, 3, 4], list(range(10, 40)), [7, 7, 7]], args.max_tokens, chat=False)
    else:
        rows = measure(args.pair, ["What is the capital of France?", "Write a short poem about rain.",
                                   "Explain what a hash table is."], args.max_tokens, chat=True)
    print("| mode | K | steps / token | acceptance length | identical to plain |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['k']} | {r['steps_per_token']:.3f} | {r['acceptance_length']:.2f} | {r['lossless']} |")


if __name__ == "__main__":
    main()
