"""The run's own shape with bf16 experts: decode steps at each batch size, then verify steps at bs 1 over the
same target, before the drafter and `transformers` sections that reuse it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from peagle_core.bench.batches import Layout, make_runner, synthetic_batch
from peagle_core.bench.drafter import draft_steps
from peagle_core.bench.hf import hf_baseline
from peagle_core.bench.models import MXFP4_BITS, build_random, free_memory, release_caches, target_config
from peagle_core.bench.roofline import decode_step_bytes
from peagle_core.models.gpt_oss import GptOss

if TYPE_CHECKING:
    from peagle_core.bench.session import Bench


def own_shape(b: Bench) -> None:
    """The run's own shape (bf16 experts): build the target, time decode steps at each batch size and verify
    steps at bs 1, then the drafter and `transformers` sections over the same weights."""
    a, r, s, dev, dt = b.args, b.r, b.summary, b.device, b.dtype
    cfg = target_config(a.shape)
    layout = Layout.for_run(r["context"], r["max_k"], r["hf_tokens"])
    b.log.section(f"build a random {a.shape}-shaped target ({cfg.num_hidden_layers} layers, "
                  f"{cfg.num_local_experts} experts) on {dev}")
    target = build_random(lambda: GptOss(cfg), dev, dt, a.seed)
    s["model"] = {"shape": a.shape, "parameters": sum(p.numel() for p in target.parameters()),
                  "weight_bytes": sum(p.numel() * p.element_size() for p in target.parameters()),
                  "config": {k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                          "num_key_value_heads", "head_dim", "num_local_experts",
                                                          "num_experts_per_tok", "intermediate_size", "vocab_size",
                                                          "sliding_window")}}
    bw = s["bandwidth"]["tb_s"] * 1e12

    b.log.section(f"decode steps, no speculation, bs {r['batch_sizes']}, context {r['context']}")
    decode: dict[str, Any] = {}
    runner = make_runner(target, None, "none", 0, max(r["batch_sizes"]), layout, dev, dt, a.seed + 1, b.graphs)
    with torch.inference_mode():
        for bs in r["batch_sizes"]:
            batch = synthetic_batch(bs, 0, layout, cfg.vocab_size, a.seed + bs)
            t = b.time(lambda: runner.execute(batch))
            nbytes = decode_step_bytes(target, r["context"], bs)
            decode[str(bs)] = {"step_ms": t.median_ms, "min_ms": t.min_ms, "max_ms": t.max_ms, "n": t.n,
                               "tok_s": bs / (t.median_ms * 1e-3), "bytes": nbytes.total,
                               "roofline_ms": nbytes.total / bw * 1e3,
                               "roofline_fraction": nbytes.total / bw / (t.median_ms * 1e-3)}
            s["decode_tok_s"][str(bs)] = decode[str(bs)]["tok_s"]
            b.log(f"decode bs={bs}: {t.median_ms:.3f} ms/step ({decode[str(bs)]['tok_s']:.1f} tok/s), "
                  f"roofline fraction {decode[str(bs)]['roofline_fraction']:.3f}")
        # the same figure timed again: the spread between the two is the noise floor of every comparison
        batch1 = synthetic_batch(1, 0, layout, cfg.vocab_size, a.seed + 1)
        again = b.time(lambda: runner.execute(batch1))
    one = decode["1"]
    one["repeat_ms"] = again.median_ms
    one["repeat_spread"] = abs(again.median_ms - one["step_ms"]) / min(again.median_ms, one["step_ms"])
    step_bytes = decode_step_bytes(target, r["context"], 1)
    s["decode"] = decode
    s["bytes_per_step_bs1"] = step_bytes.as_dict()
    s["bytes_per_step_bs1_mxfp4_experts"] = decode_step_bytes(target, r["context"], 1, MXFP4_BITS).total
    s["roofline_ms_bs1"] = step_bytes.total / bw * 1e3
    s["decode_bs1_roofline_fraction"] = one["roofline_fraction"]
    b.write()

    b.log.section(f"verify steps at bs 1, k = 1..{r['max_k']}")
    del runner
    release_caches(target)
    verify = verify_steps(b, target, layout, one["step_ms"], one["bytes"])
    s["verify"] = verify
    if "7" in verify:
        s["verify_k7_over_decode_bs1"] = verify["7"]["over_decode_bs1"]
        # what the bytes alone force: 8 tokens read ~21 of 32 experts a layer under uniform routing, not 4
        s["verify_k7_bytes_over_decode_bs1"] = verify["7"]["bytes_over_decode_bs1"]
    b.write()

    if not a.skip_draft:
        b.guarded("draft", lambda: draft_steps(b, target, cfg, layout))
        target.set_aux_layers([])
    else:
        s["draft"] = {"not_run": "skipped with --skip-draft"}

    if a.skip_hf:
        s["hf"] = {"not_run": "skipped with --skip-hf"}
    else:
        release_caches(target)
        b.guarded("hf", lambda: hf_baseline(b, target, cfg, layout))
    del target
    free_memory(dev)


def verify_steps(b: Bench, target: GptOss, layout: Layout, decode_ms: float, decode_bytes: float) -> dict[str, Any]:
    """Verify steps at bs 1 (target over 1 + k tokens, rejection sampling), k = 1..max_k, against the bs-1
    decode step and the bytes their tokens must read (more tokens route to more experts)."""
    a, r, dev, dt = b.args, b.r, b.device, b.dtype
    bw = b.summary["bandwidth"]["tb_s"] * 1e12
    runner = make_runner(target, None, "none", r["max_k"], 1, layout, dev, dt, a.seed + 2, b.graphs)
    out = {}
    with torch.inference_mode():
        for k in range(1, r["max_k"] + 1):
            batch = synthetic_batch(1, k, layout, target.config.vocab_size, a.seed + 100 + k)
            t = b.time(lambda: runner.execute(batch))
            nbytes = decode_step_bytes(target, r["context"], 1, tokens_per_req=1 + k).total
            out[str(k)] = {"step_ms": t.median_ms, "min_ms": t.min_ms, "max_ms": t.max_ms,
                           "over_decode_bs1": t.median_ms / decode_ms, "bytes": nbytes,
                           "roofline_ms": nbytes / bw * 1e3, "roofline_fraction": nbytes / bw / (t.median_ms * 1e-3),
                           "bytes_over_decode_bs1": nbytes / decode_bytes}
            b.log(f"verify k={k}: {t.median_ms:.3f} ms ({out[str(k)]['over_decode_bs1']:.3f} x decode), "
                  f"roofline fraction {out[str(k)]['roofline_fraction']:.3f}")
    del runner
    release_caches(target)
    return out
