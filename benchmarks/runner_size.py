"""The bs-1 decode graph's time against the runner it lives in (a diagnostic of `peagle bench`'s decode figure).

    python benchmarks/runner_size.py --out "$OUT"

`peagle bench` times its bs-1 decode step in a runner built for 64 requests (it measures bs 1, 8, 32 and 64 with
one runner), `profile_step.py` in one built for one request. On an H200 the same bs-1 graph replayed ~80 us slower
in the first (2.33 against 2.25 ms, in the base tree and in the staged one: docs/benchmarks/ab_staged.md). This
separates what differs between the two runners: the KV cache's size (64 requests' blocks, ~3.5 GB at the 20B shape,
against one request's) and the graphs captured into the shared pool before the bs-1 one (11 buckets, largest
first, against one). Each case: the bs-1 graph replayed alone (CUDA events, back to back) and the whole step
(`ModelRunner.execute`), medians; the first case again at the end, as the noise floor. Writes runner_size.json.
Its first run (ab_staged.md, call 4): neither. The first runner of the process replayed in 2.27 ms, every later one
in 2.33-2.35, the first one's own configuration included.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peagle_core.bench import (BLOCK_SIZE, Layout, build_random, free_memory, measure, release_caches,  # noqa: E402
                               synthetic_batch, target_config)
from peagle_core.engine.graphs import GraphRunner  # noqa: E402
from peagle_core.engine.model_runner import ModelRunner  # noqa: E402
from peagle_core.models.gpt_oss import GptOss  # noqa: E402

# (name, requests the KV cache holds, the graph runner's max_num_seqs, capture every bucket or only bs 1)
CASES = [("cache 1, buckets 1", 1, 1, True), ("cache 64, buckets 64", 64, 64, True),
         ("cache 64, buckets 64, bs-1 graph only", 64, 64, False), ("cache 1, buckets 64", 1, 64, True),
         ("cache 64, buckets 1", 64, 1, True), ("cache 1, buckets 1 (again)", 1, 1, True)]


def run_case(target: GptOss, layout: Layout, cache_seqs: int, max_seqs: int, capture_all: bool) -> dict:
    dev, dt = next(target.parameters()).device, next(target.parameters()).dtype
    runner = ModelRunner(target, None, "none", 0, BLOCK_SIZE, cache_seqs * layout.blocks_per_req + 1,
                         layout.max_model_len, dev, dt, target.config.vocab_size)
    runner.target_cache.normal_(generator=torch.Generator(device=dev).manual_seed(1))
    runner.graphs = GraphRunner(runner, max_seqs)
    if capture_all:
        runner.graphs.capture_all()
    else:
        runner.graphs.target.capture_one((1, 1))
    batch = synthetic_batch(1, 0, layout, target.config.vocab_size, seed=2)
    with torch.inference_mode():
        step = measure(lambda: runner.execute(batch), dev, warmup=5, iters=40)  # (also loads the graph's inputs)
        graph = measure(runner.graphs.target.graphs[(1, 1)].replay, dev, warmup=5, iters=40)
    out = {"graphs": runner.graphs.num_graphs, "graph_ms": graph.median_ms, "step_ms": step.median_ms,
           "step_min_ms": step.min_ms}
    del runner
    release_caches(target)
    free_memory(dev)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    target = build_random(lambda: GptOss(target_config("20b")), dev, torch.bfloat16, 0)
    target.set_aux_layers([])
    layout = Layout.for_run(a.context, 7, 1)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "context": a.context, "cases": []}
    for name, cache_seqs, max_seqs, capture_all in CASES:
        r = {"case": name, **run_case(target, layout, cache_seqs, max_seqs, capture_all)}
        res["cases"].append(r)
        print(f"{name}: {r['graphs']} graphs, bs-1 graph {r['graph_ms']:.3f} ms, step {r['step_ms']:.3f} ms "
              f"(min {r['step_min_ms']:.3f})", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "runner_size.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
