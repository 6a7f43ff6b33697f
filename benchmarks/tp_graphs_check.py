"""TP=2 with CUDA graphs on the shipped tiny pair (two GPUs): greedy tokens against TP=1 eager, with timestamps of
the engine build and its graph captures, and rank 0's stacks dumped if it is still running after DUMP_S seconds.

    python benchmarks/tp_graphs_check.py [DUMP_S]
"""
from __future__ import annotations

import faulthandler
import sys
import time

from peagle_core import LLM, SamplingParams
from peagle_core.engine import graphs

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a short poem about the sea."]


def main() -> None:
    faulthandler.dump_traceback_later(float(sys.argv[1]) if len(sys.argv) > 1 else 150, exit=True)
    t0 = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)  # noqa: E731
    capture_one, count = graphs.GraphSet.capture_one, [0]

    def logged(self, key):
        if count[0] % 8 == 0:
            log(f"capturing {self.name} {key} (graph {count[0] + 1})")
        capture_one(self, key)
        count[0] += 1

    graphs.GraphSet.capture_one = logged
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    spec = {"method": "eagle3", "model": "tiny-peagle", "num_speculative_tokens": 7, "parallel_drafting": True}
    outs = {}
    for tp, eager in ((2, False), (1, True)):
        log(f"building TP={tp} {'eager' if eager else 'with CUDA graphs'}")
        llm = LLM("tiny", speculative_config=spec, device="cuda", dtype="float32", tensor_parallel_size=tp,
                  enforce_eager=eager, max_num_seqs=4, max_model_len=256)
        g = llm.engine.runner.graphs
        log(f"built ({g.num_graphs if g else 0} graphs)")
        outs[tp] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
        log(f"generated ({g.target.num_replays if g else 0} target replays)")
        llm.engine.shutdown()
    print("TP=2 graphs == TP=1 eager:", outs[1] == outs[2], flush=True)


if __name__ == "__main__":
    main()
