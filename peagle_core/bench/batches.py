"""Synthetic engine batches: runners whose paged caches hold random K/V, and requests already `context` tokens in."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from peagle_core.engine.graphs import GraphRunner
from peagle_core.engine.model_runner import ModelRunner
from peagle_core.engine.request import Request
from peagle_core.engine.scheduler import Scheduled
from peagle_core.engine.types import SamplingParams
from peagle_core.models.drafter import Drafter
from peagle_core.models.gpt_oss import GptOss
from peagle_core.timing import sync

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


@dataclass
class Layout:
    """Cache geometry shared by every runner of a run: `blocks_per_req` blocks per request."""

    context: int
    max_model_len: int
    blocks_per_req: int

    @classmethod
    def for_run(cls, context: int, max_k: int, extra_tokens: int) -> "Layout":
        # verified positions (1 + k), the drafter's K-1 lookahead slots and a greedy continuation must fit
        need = context + max(2 * max_k + 1, extra_tokens + 1)
        blocks = -(-need // BLOCK_SIZE)
        return cls(context, blocks * BLOCK_SIZE, blocks)


def make_runner(target: GptOss, drafter: Drafter | None, mode: str, k: int, batch: int, layout: Layout,
                device: torch.device, dtype: torch.dtype, seed: int, graphs: bool = False) -> ModelRunner:
    """A ModelRunner with room for `batch` requests, its paged caches filled with random K/V.

    With `graphs`, decode-shaped steps replay CUDA graphs, captured here as the engine does (`capture_all`).
    """
    if drafter is None:
        target.set_aux_layers([])  # a runner with a drafter sets them; a plain decode step computes none
    runner = ModelRunner(target, drafter, mode, k, BLOCK_SIZE, batch * layout.blocks_per_req + 1,
                         layout.max_model_len, device, dtype, target.config.vocab_size)
    g = torch.Generator(device=device).manual_seed(seed)
    for cache in (runner.target_cache, runner.drafter_cache):
        if cache is not None:
            cache.normal_(generator=g)
    if graphs:
        runner.graphs = GraphRunner(runner, batch)
        runner.graphs.capture_all()
    return runner


def synthetic_batch(batch: int, num_drafts: int, layout: Layout, vocab: int, seed: int) -> list[Scheduled]:
    """`batch` requests whose `context` tokens are in the cache, each feeding its last token (+ drafts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(batch):
        ids = torch.randint(0, vocab, (layout.context + 1,), generator=g).tolist()
        req = Request(f"bench-{b}", ids, GREEDY)
        req.num_computed = layout.context
        req.drafts = torch.randint(0, vocab, (num_drafts,), generator=g).tolist()
        req.block_table = list(range(b * layout.blocks_per_req, (b + 1) * layout.blocks_per_req))
        out.append(Scheduled(req, 1, num_drafts))
    return out


def capture_draft_call(runner: ModelRunner, batch: list[Scheduled]) -> Callable[[], Any]:
    """Run one engine step and keep the arguments it passed to the drafter: a realistic draft batch.

    Returns a callable that repeats exactly that drafter step (same shapes, same K/V writes) and waits for
    it: in the engine the step's one device-to-host copy follows the drafter, so its launches are on the
    critical path just like its kernels.
    """
    captured: dict[str, Any] = {}
    real = runner._draft

    def spy(*a, **kw):
        captured["args"], captured["kwargs"] = a, kw
        return real(*a, **kw)

    runner._draft = spy
    try:
        runner.execute(batch)
    finally:
        del runner._draft  # back to the class method
    if "args" not in captured:
        raise RuntimeError("the engine step did not call the drafter")
    a, kw = captured["args"], captured["kwargs"]

    def call():
        with torch.inference_mode():
            drafts = runner._draft(*a, **kw)
        sync(runner.device)
        return drafts
    return call


def engine_greedy(runner: ModelRunner, prompt: list[int], n: int, device: torch.device) -> tuple[list[int], float]:
    """Greedy continuation of `prompt` through ModelRunner.execute (prefill, then n-1 decode steps).

    Returns (tokens, decode tok/s of the loop). Uses the first request's blocks of the runner.
    """
    req = Request("greedy", list(prompt), GREEDY)
    req.block_table = list(range(-(-(len(prompt) + n) // BLOCK_SIZE)))
    res = runner.execute([Scheduled(req, len(prompt), 0)])
    req.token_ids += res.tokens[0]
    req.num_computed = len(prompt)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n - 1):
        res = runner.execute([Scheduled(req, 1, 0)])
        req.token_ids += res.tokens[0]
        req.num_computed += 1
    sync(device)
    seconds = time.perf_counter() - t0
    return req.output_ids[:n], (n - 1) / seconds if n > 1 and seconds > 0 else float("nan")

