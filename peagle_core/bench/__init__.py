"""`peagle bench`: engine step timings against the memory-bandwidth roofline and against `transformers`.

    peagle bench --shape 20b --device cuda --out docs/benchmarks

One run, random weights at the real shapes (no checkpoint), medians after warm-up (`peagle_core.timing`: CUDA
events on a GPU, perf_counter on a CPU); on a GPU with the Triton kernels, decode-shaped steps replay CUDA graphs
(captured in the warm-up) unless `--eager`. One module a section:

  roofline.py  device read bandwidth (a large `.sum()` and a large copy) and the bytes a step must read
  decode.py    ModelRunner.execute on synthetic decode batches (bs 1, 8, 32, 64; `--context` tokens already
               in the paged cache, random K/V), no speculation; then verify at bs 1, target over 1 + k
               tokens plus rejection sampling, k = 1..7
  drafter.py   the runner's drafter step for a random 4-layer P-EAGLE head and a 1-layer EAGLE-3 head, K = 1..7
  hf.py        `transformers` GptOssForCausalLM over the same weights (eager attention), greedy at bs 1;
               doubles as a correctness check (same greedy tokens as our engine)
  mxfp4.py     what users serve: the 20B and 120B shapes with their MXFP4 experts kept packed (bs-1 decode,
               truncated and extrapolated if the whole model does not fit; verify; the MoE layer alone)

and the parts they share: `models.py` (shapes, random weights on the device), `batches.py` (runners and
synthetic batches), `session.py` (one run), `bars.py` and `summary.py` (the bars, summary.json and
summary.md, written after every section so a run cut short keeps what it measured), `cli.py` (the flags).

The names below are what `benchmarks/` builds on.
"""
from peagle_core.bench.batches import (BLOCK_SIZE, Layout, capture_draft_call, engine_greedy, make_runner,
                                       synthetic_batch)
from peagle_core.bench.cli import add_arguments, run
from peagle_core.bench.models import (build_random, drafter_config, free_memory, meta_model, release_caches,
                                      target_config)
from peagle_core.bench.roofline import decode_step_bytes
from peagle_core.timing import measure

__all__ = ["BLOCK_SIZE", "Layout", "add_arguments", "build_random", "capture_draft_call", "decode_step_bytes",
           "drafter_config", "engine_greedy", "free_memory", "make_runner", "measure", "meta_model",
           "release_caches", "run", "synthetic_batch", "target_config"]
