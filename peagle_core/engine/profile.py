"""Start-up profiles of step times for the adaptive depth policy.

`profile_step_grid`: whole engine steps per batch size and k (the policy's `StepGrid`). `profile`, the fallback
when the KV cache is too small for the grid's requests: a target forward at token counts 1, 2, 4, ... up to
max_num_seqs * (K+1) and one drafter pass, on dummy decode-shaped batches (one token per request, no K/V writes:
slot -1). The policy refines either from live step times, so a profile only needs the right shape.
"""
from __future__ import annotations

import torch

from peagle_core.depth.adaptive import StepGrid
from peagle_core.engine.model_runner import ModelRunner
from peagle_core.engine.request import Request
from peagle_core.engine.scheduler import Scheduled
from peagle_core.engine.types import SamplingParams
from peagle_core.models.layers import ForwardMeta
from peagle_core.timing import measure, measure_cells


def _dummy_meta(n: int, device: torch.device) -> ForwardMeta:
    return ForwardMeta(positions=torch.zeros(n, dtype=torch.long, device=device),
                       query_start_loc=torch.arange(n + 1, device=device),
                       seq_lens=torch.ones(n, dtype=torch.long, device=device),
                       slot_mapping=torch.full((n,), -1, dtype=torch.long, device=device),
                       block_tables=torch.zeros(n, 1, dtype=torch.long, device=device))


@torch.inference_mode()
def profile(runner: ModelRunner, max_tokens: int) -> tuple[dict[int, float], float]:
    """Returns ({target tokens: seconds}, seconds of one drafter pass at max_num_seqs-ish batch)."""
    dev = runner.device
    sizes, n = [], 1
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    sizes.append(max_tokens)

    def seconds(fn) -> float:
        return measure(fn, dev, warmup=1, iters=3, clock="wall").median_ms * 1e-3

    points = {}
    for n in sizes:
        ids, meta = torch.zeros(n, dtype=torch.long, device=dev), _dummy_meta(n, dev)
        points[n] = seconds(lambda: runner.target.compute_logits(runner.target(ids, meta)[0]))
    draft = 0.0
    if runner.drafter is not None:
        b = max(1, max_tokens // (runner.K + 1))
        ids, meta = torch.zeros(b, dtype=torch.long, device=dev), _dummy_meta(b, dev)
        h = torch.zeros(b, runner.drafter.config.hidden_size, device=dev, dtype=runner.drafter.fc.weight.dtype)
        draft = seconds(lambda: runner.drafter.compute_logits(runner.drafter(ids, h, meta)[0]))
    return points, draft


def profile_step_grid(runner: ModelRunner, max_batch: int, K: int, context: int = 256, passes: int = 3
                      ) -> StepGrid:
    """Time `runner.execute` on synthetic decode batches: B = 1, 2, 4, ... max_batch requests with
    `context` tokens already cached (fewer when the KV cache is small), each verifying k = 0..K drafts.
    The engine calls this at start-up, before any request: the K/V it writes land in free blocks that a
    request overwrites before reading (every forward writes a position before attending to it). The drafts
    verified are the drafter's own proposals for those contexts (random tokens without a drafter).

    One untimed pass over the whole grid first (CUDA-graph capture, compilation, clocks coming up), then
    `passes` timed passes, each cell keeping its fastest: timing noise only ever adds, and one slow cell
    would become its row's floor through the monotone-in-k rule and make every k look equally dear."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch)
    bs, num_blocks = runner.block_size, runner.target_cache.shape[2]
    # At most the blocks of one max_model_len sequence a request: a wider block table than any request can
    # have is not a shape the CUDA graphs cover, and every profiled step would run eagerly.
    per_req = min(num_blocks // max_batch, -(-runner.max_model_len // bs))
    ctx = min(context, per_req * bs - 2 * K - 2, runner.max_model_len - 2 * K - 2)
    if ctx < 1:
        raise ValueError(f"the KV cache ({num_blocks} blocks of {bs}) is too small to profile {max_batch} requests")
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    vocab = runner.vocab_size
    gen = torch.Generator().manual_seed(0)

    def requests(B: int) -> list[Request]:
        out = []
        for i in range(B):
            ids = torch.randint(0, vocab, (ctx + 1,), generator=gen).tolist()
            req = Request(f"profile-{i}", ids, params)
            req.num_computed = ctx
            req.drafts = torch.randint(0, vocab, (K,), generator=gen).tolist()
            req.block_table = list(range(i * per_req, (i + 1) * per_req))
            out.append(req)
        return out

    reqs = {B: requests(B) for B in sizes}
    if getattr(runner, "drafter", None) is not None:
        # Verify what the drafter proposes, not random tokens: the experts a verify step reads depend on its
        # tokens, and random ones spread over more experts, which makes deep verifies look dearer than they are.
        for B in sizes:
            proposed = runner.execute([Scheduled(r, 1, 0) for r in reqs[B]], draft_len=K).drafts
            for r, d in zip(reqs[B], proposed):
                r.drafts = d[:K] + r.drafts[len(d):]
    def step(batch: list[Scheduled], k: int):
        def call() -> None:
            for s in batch:  # k = 0 drafted nothing and kept the drafter's inputs: this cell must not catch up
                s.req.behind = None
            runner.execute(batch, draft_len=k)  # ends in the step's device-to-host copy
        return call

    cells = {(B, k): step([Scheduled(r, 1, k) for r in reqs[B]], k) for B in sizes for k in range(K + 1)}
    times = measure_cells(cells, runner.device, warmup=1, iters=passes, clock="wall")
    return StepGrid({B: [times[B, k].min_ms * 1e-3 for k in range(K + 1)] for B in sizes})
