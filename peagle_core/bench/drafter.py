"""Drafter steps at bs 1, K = 1..max_k: a random 4-layer P-EAGLE head (one forward over the K slots) and a
1-layer EAGLE-3 head (K sequential passes), each the runner's own drafter step (`_draft`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from peagle_core.bench.batches import Layout, capture_draft_call, make_runner, synthetic_batch
from peagle_core.bench.models import build_random, drafter_config, free_memory, release_caches
from peagle_core.config import GptOssConfig
from peagle_core.models.drafter import Drafter
from peagle_core.models.gpt_oss import GptOss

if TYPE_CHECKING:
    from peagle_core.bench.session import Bench


def draft_steps(b: Bench, target: GptOss, cfg: GptOssConfig, layout: Layout) -> None:
    """The drafter's part of a step after a verify of K drafts, K = 1..max_k, for both heads; the K7/K1 ratios."""
    a, r, s, dev, dt = b.args, b.r, b.summary, b.device, b.dtype
    b.log.section(f"drafter steps at bs 1, K = 1..{r['max_k']}: P-EAGLE (4 layers) and EAGLE-3 (1 layer)")
    draft: dict[str, Any] = {}
    for mode, layers in (("peagle", 4), ("eagle3", 1)):
        dcfg = drafter_config(cfg, parallel=mode == "peagle", layers=layers)
        drafter = build_random(lambda: Drafter(dcfg), dev, dt, a.seed + 7)
        times = {}
        for K in range(1, r["max_k"] + 1):
            runner = make_runner(target, drafter, mode, K, 1, layout, dev, dt, a.seed + 3, b.graphs)
            batch = synthetic_batch(1, K, layout, cfg.vocab_size, a.seed + 200 + K)
            with torch.inference_mode():
                t = b.time(capture_draft_call(runner, batch))
            times[str(K)] = {"draft_ms": t.median_ms, "min_ms": t.min_ms, "max_ms": t.max_ms,
                             "draft_tokens": (1 + K) + (K - 1) if mode == "peagle" else 1 + K,
                             "drafter_passes": 1 if mode == "peagle" else K}
            b.log(f"{mode} K={K}: {t.median_ms:.3f} ms")
            del runner
            release_caches(target)
            release_caches(drafter)
        draft[mode] = {"layers": layers, "parameters": sum(p.numel() for p in drafter.parameters()),
                       "config": {k: getattr(dcfg, k) for k in ("hidden_size", "num_attention_heads",
                                                                 "num_key_value_heads", "head_dim",
                                                                 "intermediate_size", "draft_vocab_size")},
                       "by_k": times}
        del drafter
        free_memory(dev)
    draft["batch"] = ("bs 1 after a verify of K drafts: P-EAGLE runs one forward over 2K slots "
                      "(1 + K verified, K - 1 MASK); EAGLE-3 one forward over 1 + K then K - 1 single-token passes")
    s["draft"] = draft
    key = str(7)
    if key in draft["peagle"]["by_k"]:
        s["draft_time_ratio_k7_over_k1"] = draft["peagle"]["by_k"][key]["draft_ms"] / draft["peagle"]["by_k"]["1"]["draft_ms"]
        s["draft_time_ratio_k7_over_k1_eagle3"] = (draft["eagle3"]["by_k"][key]["draft_ms"]
                                                   / draft["eagle3"]["by_k"]["1"]["draft_ms"])
    b.write()
