"""Start-up profile of step times for the adaptive depth policy.

Times a target forward at token counts 1, 2, 4, ... up to max_num_seqs * (K+1) and one drafter
pass, on dummy decode-shaped batches (one token per request, no K/V writes: slot -1). The
policy refines these from live step times, so the profile only needs the right shape.
"""
from __future__ import annotations

import statistics
import time

import torch

from peagle_core.engine.model_runner import ModelRunner
from peagle_core.models.layers import ForwardMeta


def _dummy_meta(n: int, device: torch.device) -> ForwardMeta:
    return ForwardMeta(positions=torch.zeros(n, dtype=torch.long, device=device),
                       query_start_loc=torch.arange(n + 1, device=device),
                       seq_lens=torch.ones(n, dtype=torch.long, device=device),
                       slot_mapping=torch.full((n,), -1, dtype=torch.long, device=device),
                       block_tables=torch.zeros(n, 1, dtype=torch.long, device=device))


def _time(fn, reps: int = 3) -> float:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


@torch.inference_mode()
def profile(runner: ModelRunner, max_tokens: int) -> tuple[dict[int, float], float]:
    """Returns ({target tokens: seconds}, seconds of one drafter pass at max_num_seqs-ish batch)."""
    dev = runner.device
    sizes, n = [], 1
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    sizes.append(max_tokens)
    points = {}
    for n in sizes:
        ids, meta = torch.zeros(n, dtype=torch.long, device=dev), _dummy_meta(n, dev)
        points[n] = _time(lambda: runner.target.compute_logits(runner.target(ids, meta)[0]))
    draft = 0.0
    if runner.drafter is not None:
        b = max(1, max_tokens // (runner.K + 1))
        ids, meta = torch.zeros(b, dtype=torch.long, device=dev), _dummy_meta(b, dev)
        h = torch.zeros(b, runner.drafter.config.hidden_size, device=dev, dtype=runner.drafter.fc.weight.dtype)
        draft = _time(lambda: runner.drafter.compute_logits(runner.drafter(ids, h, meta)[0]))
    return points, draft
