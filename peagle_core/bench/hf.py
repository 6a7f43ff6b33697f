"""The `transformers` baseline: GptOssForCausalLM over our weights, greedy at bs 1; also a correctness check
(the same greedy tokens as our engine)."""
from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from peagle_core.bench.batches import Layout, engine_greedy, make_runner
from peagle_core.bench.models import DTYPES, free_memory, release_caches
from peagle_core.config import GptOssConfig
from peagle_core.models.gpt_oss import GptOss
from peagle_core.timing import sync

if TYPE_CHECKING:
    from peagle_core.bench.session import Bench

HF_EXPERTS = {"gate_up_proj": ("w1", True), "gate_up_proj_bias": ("b1", False),
              "down_proj": ("w2", True), "down_proj_bias": ("b2", False)}


def hf_from_ours(model: GptOss, consume: bool = False, experts_implementation: str | None = None):
    """transformers' GptOssForCausalLM over our weights, eager attention.

    Names match except the experts: ours are out-major (w1 [E, 2I, H], w2 [E, H, I]), transformers keeps
    [E, in, out] (gate_up_proj [E, H, 2I], down_proj [E, I, H]), so those are transposed copies and
    everything else shares our storage. With `consume`, each of our expert matrices is released right
    after its copy, so the peak is one layer above the model (our model is unusable afterwards).
    """
    import transformers

    p0 = model.lm_head.weight
    dtype_name = {v: k for k, v in DTYPES.items()}[p0.dtype]
    kw = {"attn_implementation": "eager", "dtype": dtype_name}
    if experts_implementation:
        kw["experts_implementation"] = experts_implementation
    hc = transformers.GptOssConfig(**model.config.to_hf(), **kw)
    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(hc)
    ours = dict(model.named_parameters())
    for name, _ in list(hf.named_parameters()):
        mod_name, _, leaf = name.rpartition(".")
        if ".mlp.experts." in name:
            src_leaf, transpose = HF_EXPERTS[leaf]
            src_name = f"{mod_name}.{src_leaf}"
            src = ours[src_name].detach()
            t = src.transpose(-1, -2).contiguous() if transpose else src
            if consume and transpose:
                owner = model.get_submodule(mod_name)
                owner._parameters[src_leaf] = nn.Parameter(torch.empty(0, dtype=src.dtype, device=src.device),
                                                           requires_grad=False)
                del src
                ours.pop(src_name)
        else:
            t = ours[name].detach()
        hf.get_submodule(mod_name)._parameters[leaf] = nn.Parameter(t, requires_grad=False)
    # Buffers computed in __init__ (RoPE frequencies) are meta tensors: rebuild them on the device.
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hc).to(p0.device)
    leftover = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if leftover:
        raise RuntimeError(f"transformers model has unfilled tensors: {leftover[:3]}")
    return hf.eval()


def hf_generate(hf, prompt: list[int], n: int, device: torch.device, reps: int) -> dict[str, Any]:
    """Greedy generation at bs 1. Decode tok/s = (n - 1) / (t(n) - t(1)): prefill and set-up cancel out."""
    ids = torch.tensor([prompt], device=device)

    def gen(m: int) -> torch.Tensor:
        return hf.generate(ids, max_new_tokens=m, min_new_tokens=m, do_sample=False, eos_token_id=None,
                           pad_token_id=0, use_cache=True)

    def timed(m: int) -> tuple[float, torch.Tensor]:
        sync(device)
        t0 = time.perf_counter()
        out = gen(m)
        sync(device)
        return time.perf_counter() - t0, out

    with torch.inference_mode():
        timed(min(n, 2))  # warm-up
        t1 = statistics.median(timed(1)[0] for _ in range(reps))
        runs = [timed(n) for _ in range(reps)]
    tn = statistics.median(t for t, _ in runs)
    tokens = runs[0][1][0, len(prompt):].tolist()
    decode = (n - 1) / (tn - t1) if n > 1 and tn > t1 else float("nan")
    return {"tokens": n, "seconds_n": tn, "seconds_1": t1, "decode_tok_s": decode, "end_to_end_tok_s": n / tn,
            "output_ids": tokens, "experts_implementation": hf.config._experts_implementation,
            "attn_implementation": hf.config._attn_implementation}



def hf_baseline(b: Bench, target: GptOss, cfg: GptOssConfig, layout: Layout) -> None:
    """Our greedy loop and transformers' on the same prompt: decode tok/s, the speedup, and how many tokens agree.
    Consumes the target's expert matrices (transformers keeps them transposed), so it runs last."""
    a, r, s, dev, dt = b.args, b.r, b.summary, b.device, b.dtype
    n = r["hf_tokens"]
    b.log.section(f"transformers eager generation at bs 1 ({n} tokens after a {r['context']}-token prompt)")
    prompt = torch.randint(0, cfg.vocab_size, (r["context"],), generator=torch.Generator().manual_seed(a.seed + 9)).tolist()
    runner = make_runner(target, None, "none", 0, 1, layout, dev, dt, a.seed + 4, b.graphs)
    ours, loop_tok_s = engine_greedy(runner, prompt, n, dev)
    del runner
    release_caches(target)
    free_memory(dev)
    try:
        hf = hf_from_ours(target, consume=True, experts_implementation=a.hf_experts)
    except ImportError as e:
        s["hf"] = {"not_run": f"transformers is not importable: {e}"}
        return
    reps = 3 if dev.type == "cuda" else 1
    failed = None
    try:
        res = hf_generate(hf, prompt, n, dev, reps)
    except Exception as e:  # noqa: BLE001 - retried below with the plain expert loop
        if a.hf_experts:
            raise
        failed = f"{type(e).__name__}: {e}"
    if failed:  # transformers' default experts kernel failed here: its plain per-expert loop instead
        b.log(f"transformers with experts {hf.config._experts_implementation!r} failed ({failed}); "
                 "retrying with 'eager'")
        hf.config._experts_implementation = "eager"
        res = hf_generate(hf, prompt, n, dev, reps)
        res["fallback"] = f"the default experts implementation failed: {failed}"
    del hf
    free_memory(dev)
    theirs = res.pop("output_ids")
    match = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
    res.update(same_greedy_prefix=match, same_greedy_tokens=ours == theirs, ours_loop_decode_tok_s=loop_tok_s)
    s["hf"] = res
    ours_bs1 = s["decode_tok_s"]["1"]
    if math.isfinite(res["decode_tok_s"]) and res["decode_tok_s"] > 0:
        s["speedup_vs_hf_transformers_bs1"] = ours_bs1 / res["decode_tok_s"]
    b.log(f"transformers: {res['decode_tok_s']:.2f} tok/s decode ({res['experts_implementation']} experts); "
             f"ours {ours_bs1:.1f} tok/s -> {s['speedup_vs_hf_transformers_bs1'] or float('nan'):.1f}x; "
             f"greedy tokens agree for {match}/{n}")
    b.write()

