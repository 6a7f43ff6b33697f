"""What users serve: the 20B and 120B shapes with their MXFP4 experts kept packed. bs-1 decode (a depth-truncated
model timed at two depths and extrapolated when the whole one does not fit, reported as such), verify k = 1..max_k
against its touched-bytes roofline, and the MoE layer alone at 1-256 routed tokens."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from peagle_core.bench.batches import Layout, make_runner, synthetic_batch
from peagle_core.bench.decode import verify_steps
from peagle_core.bench.models import (available_bytes, build_random, free_memory, meta_model, release_caches,
                                      target_config)
from peagle_core.bench.roofline import decode_step_bytes
from peagle_core.config import GptOssConfig
from peagle_core.models.gpt_oss import GptOss, MoE
from peagle_core.timing import time_graph

if TYPE_CHECKING:
    from peagle_core.bench.session import Bench

MOE_TOKENS = (1, 2, 4, 8, 16, 64, 256)  # routed tokens for the MoE layer alone (CUDA; 1 and 8 on a CPU)


def packed_shapes(b: Bench) -> list[tuple[str, str]]:
    """(shape, summary key) of the MXFP4 sections this run has: 20B and 120B (tiny: its 120B-like shape)."""
    a = b.args
    if a.shape == "tiny":
        return [] if a.skip_120b else [("tiny-120b", "gpt_oss_120b")]
    shapes = [("20b", "gpt_oss_20b_mxfp4")] if a.shape == "20b" else []
    return shapes + ([] if a.shape != "120b" and a.skip_120b else [("120b", "gpt_oss_120b")])


def packed_shape(b: Bench, shape: str) -> dict[str, Any]:
    """The model as users serve it, MXFP4 experts kept packed (as the engine loads the published checkpoint on
    CUDA): bs-1 decode (the whole model if it fits, else truncated depth + extrapolation), verify k = 1..max_k
    when the whole model fits, and the MoE layer alone."""
    s = b.summary
    res = packed_decode(b, shape)
    suffix = {"120b": "120b", "tiny-120b": "120b", "20b": "20b"}[shape]
    s[f"decode_bs1_roofline_fraction_{suffix}_mxfp4"] = res.get("roofline_fraction")
    res["moe_layer"] = moe_layer(b, shape)
    if suffix == "120b":
        for n in (1, 8):
            s[f"moe_mxfp4_tb_s_{n}_tokens_120b"] = (res["moe_layer"].get(str(n)) or {}).get("tb_s")
        s["verify_k7_roofline_fraction_120b"] = (res.get("verify", {}).get("7") or {}).get("roofline_fraction")
    return res


def moe_layer(b: Bench, shape: str) -> dict[str, Any]:
    """One MoE layer with packed experts, random weights, T random tokens routed top-k: us per call (`time_graph`: 20
    calls in a CUDA graph on CUDA, as the engine launches them) and TB/s over the bytes of the experts selected."""
    dev, dt = b.device, b.dtype
    cfg = target_config(shape)
    layer = build_random(lambda: MoE(cfg, mxfp4_experts=True), dev, dt, b.args.seed + 21)
    E = layer.router.weight.shape[0]
    expert_bytes = sum(p.numel() * p.element_size() for p in layer.experts.parameters()) / E
    g = torch.Generator(device=dev).manual_seed(b.args.seed + 22)
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for T in (MOE_TOKENS if dev.type == "cuda" else (1, 8)):
            x = torch.randn(T, cfg.hidden_size, device=dev, generator=g).to(dt)
            experts = torch.topk(x.float() @ layer.router.weight.float().T, layer.top_k).indices.unique().numel()
            us = time_graph(lambda: layer(x), dev)
            out[str(T)] = {"us": us, "experts": experts, "bytes": experts * expert_bytes,
                           "tb_s": experts * expert_bytes / us / 1e6}
            b.log(f"{shape} MoE layer, {T} tokens: {us:.1f} us, {experts} experts, {out[str(T)]['tb_s']:.2f} TB/s")
    del layer
    free_memory(dev)
    return out


def packed_decode(b: Bench, shape: str) -> dict[str, Any]:
    """bs-1 decode of the packed model: the whole depth if it fits (with its verify steps), else the deepest
    even depth that does, timed at two depths and extrapolated; shallower again after running out of memory."""
    a, r, dev, dt = b.args, b.r, b.device, b.dtype
    full_cfg = target_config(shape)
    L = full_cfg.num_hidden_layers
    full = meta_model(full_cfg, dt, mxfp4_experts=True)
    full_bytes = decode_step_bytes(full, r["context"], 1)
    per_layer = sum(p.numel() * p.element_size() for p in full.model.layers[0].parameters())
    fixed = sum(p.numel() * p.element_size() for n, p in full.named_parameters() if ".layers." not in n)
    del full
    res: dict[str, Any] = {"shape": shape, "layers_full": L, "experts_dtype": "mxfp4 (packed, 4.25 bits)",
                           "weight_bytes_full": fixed + L * per_layer,
                           "bytes_per_step_bs1": full_bytes.as_dict(),
                           "bytes_per_step_bs1_bf16_experts": decode_step_bytes(
                               meta_model(full_cfg, dt), r["context"], 1).total}
    layout = Layout.for_run(r["context"], r["max_k"], 1)
    kv_per_layer = 2 * full_cfg.num_key_value_heads * full_cfg.head_dim * dt.itemsize * layout.max_model_len
    budget = available_bytes(dev) * 0.85 - fixed - (2 * 2**30 if dev.type == "cuda" else 0)
    fits = int(budget // (per_layer + kv_per_layer)) if budget > 0 else 0
    if a.layers == 0:
        res["not_run"] = "skipped with --layers 0"
        return res
    depth = min(L, a.layers if a.layers is not None else fits)
    if depth > fits:
        res["not_run"] = (f"{depth} layers need {(fixed + depth * per_layer) / 1e9:.0f} GB, about "
                          f"{(fixed + fits * per_layer) / 1e9:.0f} GB fit ({fits} layers)")
        return res
    while True:
        if depth < 2 and depth < L:
            res["not_run"] = (f"the {L}-layer model needs {(fixed + L * per_layer) / 1e9:.0f} GB in "
                              f"{res['experts_dtype']}; a truncated run needs at least 2 layers to extrapolate "
                              f"({depth} asked for or fitting)")
            return res
        if depth < L and depth % 2 and depth > 2:
            depth -= 1  # keep the sliding/full alternation balanced between the two depths timed
        b.log(f"{shape}: building {depth} of {L} layers "
              f"({(fixed + depth * per_layer) / 1e9:.1f} GB; {fits} estimated to fit)")
        oom = False
        try:
            measured, truncated_bytes, verify = time_depths(b, full_cfg, depth, layout)
        except torch.OutOfMemoryError:
            oom = True  # handled outside the except block, once the traceback's frames are gone
        if not oom:
            break
        free_memory(dev)
        b.log(f"{shape}: out of memory at {depth} layers, retrying shallower")
        depth = depth * 3 // 4
    bw = b.summary["bandwidth"]["tb_s"] * 1e12
    t_deep = measured[str(depth)]
    if depth < L:
        shallow = max(1, depth // 2)
        t_shallow = measured[str(shallow)]
        per_layer_ms = (t_deep - t_shallow) / (depth - shallow)
        step_ms = t_deep + (L - depth) * per_layer_ms
        res.update(truncated=True, per_layer_ms=per_layer_ms,
                   method=f"timed at {depth} and {shallow} layers, extrapolated linearly to {L}: "
                          f"t({L}) = t({depth}) + {L - depth} x per-layer time",
                   truncated_roofline_fraction=truncated_bytes / bw / (t_deep * 1e-3))
    else:
        step_ms = t_deep
        res["truncated"] = False
    res.update(layers_run=depth, measured_step_ms=measured, step_ms=step_ms, tok_s=1e3 / step_ms,
               roofline_ms=full_bytes.total / bw * 1e3,
               roofline_fraction=full_bytes.total / bw / (step_ms * 1e-3))
    if verify:
        res["verify"] = verify
    b.log(f"{shape}: {step_ms:.3f} ms/step ({res['tok_s']:.1f} tok/s) "
          f"{'extrapolated' if res['truncated'] else 'measured'}; roofline fraction {res['roofline_fraction']:.3f}")
    return res


def time_depths(b: Bench, full_cfg: GptOssConfig, depth: int,
                 layout: Layout) -> tuple[dict[str, float], int, dict[str, Any]]:
    """bs-1 decode step (ms) of a `depth`-layer model and, when truncated, of its first depth // 2 layers; when
    whole, its verify steps k = 1..max_k against their touched-bytes roofline.

    Returns ({layers: step ms}, bytes per step of the model as built, {k: verify figures} or {}).
    """
    a, r, dev, dt = b.args, b.r, b.device, b.dtype
    cfg = full_cfg.model_copy(update={"num_hidden_layers": depth, "layer_types": None})
    target = build_random(lambda: GptOss(cfg, mxfp4_experts=True), dev, dt, a.seed + 11)
    runner = make_runner(target, None, "none", 0, 1, layout, dev, dt, a.seed + 12, b.graphs)
    batch = synthetic_batch(1, 0, layout, cfg.vocab_size, a.seed + 13)
    with torch.inference_mode():
        measured = {str(depth): b.time(lambda: runner.execute(batch)).median_ms}
        if depth < full_cfg.num_hidden_layers:
            shallow = max(1, depth // 2)
            layers = target.model.layers
            target.model.layers = nn.ModuleList(list(layers)[:shallow])  # same weights, same runner
            if runner.graphs is not None:
                runner.graphs.reset()  # the captured graphs replay the deeper model
            try:
                measured[str(shallow)] = b.time(lambda: runner.execute(batch)).median_ms
            finally:
                target.model.layers = layers
    nbytes = decode_step_bytes(target, r["context"], 1).total
    del runner
    release_caches(target)
    whole = depth == full_cfg.num_hidden_layers
    verify = verify_steps(b, target, layout, measured[str(depth)], nbytes) if whole else {}
    del target
    free_memory(dev)
    return measured, nbytes, verify
