"""`peagle bench`: engine step timings against the memory-bandwidth roofline and against `transformers`.

    peagle bench --shape 20b --device cuda --out docs/benchmarks

One run, random weights at the real shapes (no checkpoint), medians after warm-up (CUDA events on a
GPU, perf_counter around a synchronised call on a CPU); on a GPU with the Triton kernels, decode-shaped
steps replay CUDA graphs (captured in the warm-up) unless `--eager`:

  bandwidth  device read bandwidth: a large `.sum()` (bytes read) and a large copy (bytes read + written)
  decode     ModelRunner.execute on synthetic decode batches (bs 1, 8, 32, 64; `--context` tokens already
             in the paged cache, random K/V), no speculation; the bs-1 step against the bytes it must read
  verify     bs 1, target over 1 + k tokens plus rejection sampling, k = 1..7
  draft      the runner's drafter step (`_draft`) for a random 4-layer P-EAGLE head (one forward over the
             K slots) and a 1-layer EAGLE-3 head (K sequential passes), K = 1..7, bs 1
  hf         `transformers` GptOssForCausalLM built from the same weights (eager attention), greedy
             generation at bs 1; doubles as a correctness check (same greedy tokens as our engine)
  mxfp4      what users serve: the 20B and 120B shapes with their MXFP4 experts kept packed. bs-1 decode
             (a depth-truncated model timed at two depths and extrapolated if the whole one does not fit,
             reported as such), verify k = 1..7 against its touched-bytes roofline, and the MoE layer alone
             at 1-256 routed tokens (us, and TB/s over the bytes of the experts those tokens select)

Writes `summary.json` (after every section, so a run cut short keeps what it measured) and `summary.md`.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from peagle_kernels import set_triton_enabled, triton_enabled, use_triton
from peagle_kernels.dispatch import use_pdl
from peagle_core.config import DrafterConfig, GptOssConfig
from peagle_core.engine.graphs import GraphRunner, graphs_supported
from peagle_core.engine.model_runner import ModelRunner
from peagle_core.engine.request import Request
from peagle_core.engine.scheduler import Scheduled
from peagle_core.engine.types import SamplingParams
from peagle_core.models.drafter import Drafter
from peagle_core.models.gpt_oss import GptOss

BLOCK_SIZE = 16
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MXFP4_BITS = 4.25  # 4-bit values plus one 8-bit power-of-two scale per 32 (what MXFP4 experts read)
MXFP4_BLOCK = 32
MXFP4_RMS = 2.9  # root mean square of the 16 FP4 (e2m1) values, for random scales of the right size

# The bar from issue 7 (20B shape, bf16, one H200, bs 1).
BARS = [
    # key, comparison, threshold, text
    ("decode_bs1_roofline_fraction", ">=", 0.60, ">= 0.60 of the roofline (aim past 0.70)"),
    ("draft_time_ratio_k7_over_k1", "<=", 1.15, "<= 1.15 (P-EAGLE draft at K=7 over K=1)"),
    ("verify_k7_over_decode_bs1", "<=", 1.30, "<= 1.3 (verify k=7 over a plain decode step)"),
    ("speedup_vs_hf_transformers_bs1", ">=", 10.0, ">= 10x transformers eager (there: 33 tok/s)"),
    ("draft_time_ratio_k7_over_k1_eagle3", None, None, "none (EAGLE-3 grows ~linearly in K)"),
    # MXFP4 experts, as users serve GPT-OSS (bars on any GPU, as fractions of its own roofline)
    ("decode_bs1_roofline_fraction_120b_mxfp4", ">=", 0.50, ">= 0.50 of the 120B MXFP4 roofline (aim 0.65)"),
    ("decode_bs1_roofline_fraction_20b_mxfp4", ">=", 0.50, ">= 0.50 of the 20B MXFP4 roofline"),
    ("moe_mxfp4_tb_s_1_tokens_120b", ">=", 2.5, ">= 2.5 TB/s effective, 120B MoE layer, 1 token"),
    ("moe_mxfp4_tb_s_8_tokens_120b", ">=", 2.5, ">= 2.5 TB/s effective, 120B MoE layer, 8 tokens"),
    ("verify_k7_roofline_fraction_120b", ">=", 0.50, ">= 0.50 of its touched-bytes roofline (120B, k = 7)"),
    ("spec_c1_speedup_120b", ">=", 1.3, ">= 1.3 (best speculative mode over none, 120B, concurrency 1)"),
]
MXFP4_KEYS = {key for key, *_ in BARS if key.endswith(("_mxfp4", "_120b"))}
PACKED = {"gpt_oss_20b_mxfp4": "20B", "gpt_oss_120b": "120B"}  # summary key -> name of the MXFP4 sections
MOE_TOKENS = (1, 2, 4, 8, 16, 64, 256)  # routed tokens for the MoE layer alone (CUDA; 1 and 8 on a CPU)


# ------------------------------------------------------------------------------------------------
# Shapes
# ------------------------------------------------------------------------------------------------


def target_config(shape: str) -> GptOssConfig:
    """GPT-OSS shapes: 20b is GptOssConfig's default; 120b has 36 layers and 128 experts."""
    if shape == "20b":
        return GptOssConfig()
    if shape == "120b":
        return GptOssConfig(num_hidden_layers=36, num_local_experts=128)
    if shape == "tiny":
        from peagle_core.tiny import target_config as tiny_target

        return tiny_target()
    if shape == "tiny-120b":  # the tiny model widened like 120b is over 20b (1.5x layers, 4x experts)
        from peagle_core.tiny import target_config as tiny_target

        t = tiny_target()
        return t.model_copy(update={"num_hidden_layers": t.num_hidden_layers * 3 // 2,
                                    "num_local_experts": t.num_local_experts * 4})
    raise ValueError(f"unknown shape {shape!r} (choose tiny, 20b or 120b)")


def drafter_config(target: GptOssConfig, parallel: bool, layers: int) -> DrafterConfig:
    """A head at the target's hidden size. For GPT-OSS: 64 heads of 64, 8 KV heads, MLP 14336 and the full
    vocabulary, which gives the 4-layer head ~1.8B parameters like amazon/GPT-OSS-20B-P-EAGLE."""
    if target.hidden_size == 2880:
        heads, kv, hd, inter = 64, 8, 64, 14336
    else:
        heads, kv = target.num_attention_heads, target.num_key_value_heads
        hd, inter = target.head_dim, 3 * target.hidden_size
    return DrafterConfig(hidden_size=target.hidden_size, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=hd, intermediate_size=inter, vocab_size=target.vocab_size,
                         draft_vocab_size=target.vocab_size, target_hidden_size=target.hidden_size,
                         max_position_embeddings=target.max_position_embeddings,
                         mask_token_id=target.vocab_size - 68 if parallel else None, parallel_drafting=parallel)


# ------------------------------------------------------------------------------------------------
# Random models built directly on the device
# ------------------------------------------------------------------------------------------------


def fill_random_(model: nn.Module, seed: int = 0) -> nn.Module:
    """On-device random weights with the scales of `init_random_`: norms ~1, sinks O(1), matrices 1/sqrt(fan_in).

    Never zeros: zeros can run faster than real data and hide wrong indexing. Buffers (d2t) are zeroed,
    which is the identity vocabulary map.
    """
    p0 = next(model.parameters())
    g = torch.Generator(device=p0.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_blocks"):  # MXFP4 values: any byte is two valid 4-bit codes
                p.copy_(torch.randint(0, 256, p.shape, generator=g, device=p.device, dtype=torch.int32))
            elif name.endswith("_scales"):  # E8M0 exponents giving weights of about 1/sqrt(fan_in)
                fan_in = p.shape[-1] * MXFP4_BLOCK
                e = 127 + round(math.log2(fan_in ** -0.5 / MXFP4_RMS))
                p.copy_(torch.randint(e - 1, e + 2, p.shape, generator=g, device=p.device, dtype=torch.int32))
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.1, generator=g)
            elif name.endswith(("sinks", "mask_hidden")):
                p.normal_(0.0, 1.0, generator=g)
            elif p.dim() == 1:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
        for b in model.buffers():
            b.zero_()
    return model.eval().requires_grad_(False)


def build_random(make: Callable[[], nn.Module], device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    """Build on the meta device, allocate once on `device`, fill there (no CPU copy of a 40 GB model)."""
    with torch.device("meta"):
        model = make()
    model.to(dtype=dtype).to_empty(device=device)
    return fill_random_(model, seed)


def meta_model(cfg: GptOssConfig, dtype: torch.dtype, mxfp4_experts: bool = False) -> GptOss:
    """Shapes and dtypes only: what the byte accounting of a model too large to build needs."""
    with torch.device("meta"):
        return GptOss(cfg, mxfp4_experts=mxfp4_experts).to(dtype)


def release_caches(model: nn.Module | None) -> None:
    """Drop the K/V views a ModelRunner bound into the model's attention layers (they keep the cache alive)."""
    if model is not None:
        for a in model.attention_layers():
            a.kv_cache = None


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    n: int


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> Timing:
    """Median of `iters` timed calls after `warmup` untimed ones (JIT compilation, autotuning, allocator).

    On CUDA each call sits between two events on the stream: with an idle stream the start event fires
    at once, so host-side work inside the call (engine bookkeeping, launches) is part of the time.
    """
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    if device.type == "cuda":
        pairs = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in pairs]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return Timing(statistics.median(times), min(times), max(times), len(times))


# ------------------------------------------------------------------------------------------------
# Bandwidth and the bytes a decode step must read
# ------------------------------------------------------------------------------------------------


def time_graph(fn: Callable[[], Any], reps: int = 20, trials: int = 5) -> float:
    """Microseconds per call of a short CUDA op: `reps` calls captured in one CUDA graph (launch costs as in the
    engine's graphs), best of `trials` replays timed with CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    best = float("inf")
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def measure_bandwidth(device: torch.device, nbytes: int, warmup: int, iters: int) -> dict[str, float]:
    """Read bandwidth from a large sum (bytes read) and copy bandwidth (bytes read + written), in TB/s.

    The buffer is far larger than the L2 cache, so repeated passes stream from HBM.
    """
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(1234)
    x = torch.randn(nbytes // dtype.itemsize, device=device, dtype=dtype, generator=g)
    y = torch.empty_like(x)
    read = measure(lambda: x.sum(dtype=torch.float32), device, warmup, iters)
    copy = measure(lambda: y.copy_(x), device, warmup, iters)
    size = x.numel() * x.element_size()
    out = {"buffer_bytes": size,
           "read_tb_s": size / (read.median_ms * 1e-3) / 1e12,
           "copy_tb_s": 2 * size / (copy.median_ms * 1e-3) / 1e12}
    # The roofline uses the best measured figure: a higher bandwidth gives a smaller (stricter) roofline time.
    out["tb_s"] = max(out["read_tb_s"], out["copy_tb_s"])
    del x, y
    return out


@dataclass
class StepBytes:
    """Bytes one decode step must read from device memory (each weight and K/V entry once)."""

    parts: dict[str, float] = field(default_factory=dict)

    @property
    def weights(self) -> int:
        return round(sum(v for k, v in self.parts.items() if k != "kv"))

    @property
    def kv(self) -> int:
        return round(self.parts.get("kv", 0))

    @property
    def total(self) -> int:
        return self.weights + self.kv

    def as_dict(self) -> dict[str, Any]:
        return {"total": self.total, "weights": self.weights, "kv": self.kv,
                "parts": {k: round(v) for k, v in self.parts.items()}}


def experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a layer reads: exactly top_k at bs 1; the expectation under uniform routing above."""
    if batch == 1:
        return float(top_k)
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def decode_step_bytes(model: GptOss, context: int, batch: int = 1, expert_weight_bits: float | None = None,
                      tokens_per_req: int = 1) -> StepBytes:
    """Weights actually touched by a decode step of `batch` requests plus their K/V reads.

    `tokens_per_req` > 1 prices a verify step (1 + k tokens per request): more tokens route to more experts.

    Per layer: attention (q/k/v/o, biases, sinks), both norms, the router and the selected experts; then
    the final norm, the whole LM head and one embedding row per token. K/V: each request attends over
    `context + 1` positions (its new token included), sliding layers over at most their window.
    `expert_weight_bits` prices the expert matrices at that many bits per value (MXFP4: 4.25).
    """
    cfg = model.config
    E, k = cfg.num_local_experts, cfg.num_experts_per_tok
    tokens = batch * tokens_per_req
    touched = experts_touched(E, k, tokens)
    parts: dict[str, float] = {}

    def add(key: str, v: float) -> None:
        parts[key] = parts.get(key, 0.0) + v

    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name == "model.embed_tokens.weight":
            add("embedding", tokens * p.shape[1] * p.element_size())
        elif ".mlp.experts." in name:
            if expert_weight_bits is not None and name.endswith((".w1", ".w2")):
                size = p.numel() * expert_weight_bits / 8
            add("experts", size / E * touched)
        elif ".self_attn." in name:
            add("attention", size)
        elif ".mlp.router." in name:
            add("router", size)
        elif name == "lm_head.weight":
            add("lm_head", size)
        elif name.endswith("norm.weight"):
            add("norms", size)
        else:
            raise ValueError(f"decode_step_bytes: parameter {name!r} is not accounted for")
    seq = context + tokens_per_req
    itemsize = model.lm_head.weight.element_size()  # the engine's cache dtype is the model dtype
    for a in model.attention_layers():
        n = min(seq, a.sliding_window) if a.sliding_window else seq
        add("kv", batch * 2 * a.num_kv_heads * a.head_dim * itemsize * n)
    return StepBytes(parts)


# ------------------------------------------------------------------------------------------------
# Synthetic engine batches
# ------------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------------
# transformers baseline
# ------------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------


class Log:
    def __init__(self, total: int):
        self.t0, self.total, self.done = time.perf_counter(), total, 0

    def __call__(self, msg: str) -> None:
        print(f"[bench {time.perf_counter() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    def section(self, name: str) -> None:
        self.done += 1
        self(f"({self.done}/{self.total}) {name}")


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=["tiny", "20b", "120b"], default="20b",
                   help="20b: every measurement, then the 120B bs-1 decode figures; 120b: only those; "
                        "tiny: the shipped tiny architecture (CPU smoke run)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--out", default="docs/benchmarks", help="directory for summary.json and summary.md")
    p.add_argument("--context", type=int, help="tokens already in each request's cache (default 1024; tiny 64)")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 32, 64], help="decode batch sizes (must include 1)")
    p.add_argument("--max-k", type=int, default=7, help="verify depths k and drafter K run 1..max-k")
    p.add_argument("--warmup", type=int, help="untimed calls before each measurement (default: 5 on CUDA, 1 on CPU)")
    p.add_argument("--iters", type=int, help="timed calls per measurement, median reported (default: 30 CUDA, 3 CPU)")
    p.add_argument("--hf-tokens", type=int, help="tokens transformers generates (default: 64 CUDA, 8 CPU)")
    p.add_argument("--hf-experts", help="transformers experts_implementation (default: transformers' own choice)")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers comparison")
    p.add_argument("--skip-draft", action="store_true", help="skip the drafter timings")
    p.add_argument("--skip-120b", action="store_true", help="with --shape 20b/tiny: skip the 120B section")
    p.add_argument("--layers", type=int,
                   help="120B section depth: run a model truncated to N layers and extrapolate (default: the "
                        "full depth if it fits, else the deepest that fits; 0: record as not run)")
    p.add_argument("--no-triton", action="store_true", help="force the PyTorch reference kernels")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (by default decode-shaped steps replay "
                                                       "graphs on CUDA with the Triton kernels)")
    p.add_argument("--seed", type=int, default=0)


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Validate the arguments and fill defaults that depend on the device."""
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r} (use cuda or cpu)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"unsupported device {name!r} (use cuda or cpu)")
    gpu = device.type == "cuda"
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if gpu else torch.float32)
    context = args.context if args.context is not None else (64 if args.shape == "tiny" else 1024)
    r = {"device": device, "dtype": dtype, "context": context, "batch_sizes": sorted(set(args.batch_sizes)),
         "max_k": args.max_k, "warmup": args.warmup if args.warmup is not None else (5 if gpu else 1),
         "iters": args.iters if args.iters is not None else (30 if gpu else 3),
         "hf_tokens": args.hf_tokens if args.hf_tokens is not None else (64 if gpu else 8)}
    if context < 1:
        raise ValueError(f"--context must be at least 1, got {context}")
    if 1 not in r["batch_sizes"]:
        raise ValueError(f"--batch-sizes must include 1 (the bs-1 figures need it), got {args.batch_sizes}")
    if not 1 <= r["max_k"] <= 16:
        raise ValueError(f"--max-k must be in 1..16, got {r['max_k']}")
    if r["warmup"] < 0 or r["iters"] < 1 or r["hf_tokens"] < 2:
        raise ValueError("--warmup must be >= 0, --iters >= 1 and --hf-tokens >= 2")
    if args.layers is not None and args.layers < 0:
        raise ValueError(f"--layers must be >= 0, got {args.layers}")
    limit = target_config(args.shape).max_position_embeddings
    if Layout.for_run(context, r["max_k"], r["hf_tokens"]).max_model_len > limit:
        raise ValueError(f"--context {context} leaves no room for generation under max_position_embeddings={limit}")
    return r


def _command(args: argparse.Namespace) -> str:
    argv = sys.argv
    if "bench" in argv:
        return "peagle " + shlex.join(argv[argv.index("bench"):])
    parts = ["peagle", "bench", "--shape", args.shape, "--out", str(args.out)]
    for flag in ("device", "context", "layers", "warmup", "iters", "hf_tokens"):
        v = getattr(args, flag)
        if v is not None:
            parts += [f"--{flag.replace('_', '-')}", str(v)]
    for flag in ("skip_hf", "skip_draft", "skip_120b", "no_triton", "eager"):
        if getattr(args, flag):
            parts.append(f"--{flag.replace('_', '-')}")
    return shlex.join(parts)


def _machine(device: torch.device) -> dict[str, Any]:
    def version(mod: str) -> str | None:
        try:
            return __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional packages
            return None

    m = {"device_type": device.type, "torch": torch.__version__, "triton": version("triton"),
         "transformers": version("transformers"), "python": platform.python_version(),
         "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "host_os": platform.platform()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        m.update(gpu_name=props.name, gpu_memory_gb=round(props.total_memory / 2**30, 1),
                 gpu_count=torch.cuda.device_count(), sm_count=props.multi_processor_count,
                 capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    try:
        root = Path(__file__).resolve().parent.parent
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            m["git_commit"] = commit.stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
            m["git_dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return m


def run(args: argparse.Namespace) -> int:
    """`peagle bench`: every section in one run; writes summary.json and summary.md into --out."""
    r = _resolve(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    previous_triton = triton_enabled()
    if args.no_triton:
        set_triton_enabled(False)
    try:
        Bench(args, r, out).run()
    finally:
        set_triton_enabled(previous_triton)
    return 0


class Bench:
    """The sections of one run, sharing the summary they fill in and write after each step."""

    def __init__(self, args: argparse.Namespace, r: dict[str, Any], out: Path):
        self.args, self.r, self.out = args, r, out
        self.device, self.dtype = r["device"], r["dtype"]
        probe = torch.empty(0, device=self.device)
        triton_on = use_triton(probe)
        self.graphs = graphs_supported(self.device, args.eager)  # the engine's rule; --eager turns them off
        primary = args.shape != "120b"
        sections = (1 + (3 if primary else 0) + (0 if args.skip_draft or not primary else 1)
                    + (0 if args.skip_hf or not primary else 1) + len(self.packed_shapes()))
        self.log = Log(sections)
        self.summary: dict[str, Any] = {
            "status": "running", "command": _command(args), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(
                timespec="seconds"), "machine": _machine(self.device),
            "settings": {"shape": args.shape, "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                         "context": r["context"], "batch_sizes": r["batch_sizes"], "max_k": r["max_k"],
                         "warmup": r["warmup"], "iters": r["iters"], "hf_tokens": r["hf_tokens"], "seed": args.seed,
                         "block_size": BLOCK_SIZE,
                         "triton_kernels": triton_on,
                         # programmatic dependent launch of the Triton kernels (PEAGLE_PDL=1, kernels/dispatch.py)
                         "pdl": triton_on and use_pdl(probe),
                         "cuda_graphs": self.graphs,
                         "timing": "CUDA events around each call, median" if self.device.type == "cuda"
                         else "perf_counter around each call, median"},
        }
        for key, *_ in BARS:
            self.summary[key] = None
        self.summary["decode_tok_s"] = {}

    # --------------------------------------------------------------------------------------------

    def run(self) -> None:
        a, s = self.args, self.summary
        self.bandwidth()
        if a.shape != "120b":
            self.primary()
        else:
            s["note"] = "--shape 120b: only the 120B bs-1 decode figures; the 20B keys are null"
        for shape, key in self.packed_shapes():
            self.log.section(f"{shape}-shaped model with packed MXFP4 experts")
            self.guarded(key, lambda: s.update({key: self.packed_shape(shape)}))
            self.write()
        if a.shape != "120b" and a.skip_120b:
            s["gpt_oss_120b"] = {"not_run": "skipped with --skip-120b"}
        s["spec_c1_speedup_120b_note"] = ("not measured by `peagle bench`: it needs the engine with replayed "
                                          "acceptance at the 120B shape (benchmarks/adaptive_sweep.py)")
        s["status"] = "complete"
        self.write()
        self.log(f"wrote {self.out / 'summary.json'} and {self.out / 'summary.md'}")
        print(render_brief(s))

    def write(self) -> None:
        write_outputs(self.summary, self.out)

    def guarded(self, key: str, fn: Callable[[], Any]) -> None:
        """Run an optional section; a failure is recorded under `key` and the run goes on to the next one."""
        failed = None
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one GPU run must keep the figures the other sections give
            failed = f"failed: {type(e).__name__}: {e}"
            traceback.print_exc()
        if failed:  # outside the except block: the traceback (and the tensors its frames hold) is gone
            self.summary[key] = {"not_run": failed}
            free_memory(self.device)
            self.log(f"{key}: {failed}")
            self.write()

    def time(self, fn: Callable[[], Any]) -> Timing:
        return measure(fn, self.device, self.r["warmup"], self.r["iters"])

    def bandwidth(self) -> None:
        self.log.section("device memory bandwidth")
        if self.device.type == "cuda":
            nbytes = min(4 * 2**30, available_bytes(self.device) // 8)
        else:
            nbytes = 64 * 2**20
        bw = measure_bandwidth(self.device, nbytes, max(self.r["warmup"], 2), max(self.r["iters"], 10))
        self.summary["bandwidth"] = bw
        free_memory(self.device)
        self.log(f"read {bw['read_tb_s']:.3f} TB/s (sum), copy {bw['copy_tb_s']:.3f} TB/s (read+write); "
                 f"roofline uses {bw['tb_s']:.3f} TB/s")
        self.write()

    # --------------------------------------------------------------------------------------------

    def primary(self) -> None:
        a, r, s, dev, dt = self.args, self.r, self.summary, self.device, self.dtype
        cfg = target_config(a.shape)
        layout = Layout.for_run(r["context"], r["max_k"], r["hf_tokens"])
        self.log.section(f"build a random {a.shape}-shaped target ({cfg.num_hidden_layers} layers, "
                         f"{cfg.num_local_experts} experts) on {dev}")
        target = build_random(lambda: GptOss(cfg), dev, dt, a.seed)
        s["model"] = {"shape": a.shape, "parameters": sum(p.numel() for p in target.parameters()),
                      "weight_bytes": sum(p.numel() * p.element_size() for p in target.parameters()),
                      "config": {k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                              "num_key_value_heads", "head_dim", "num_local_experts",
                                                              "num_experts_per_tok", "intermediate_size", "vocab_size",
                                                              "sliding_window")}}
        bw = s["bandwidth"]["tb_s"] * 1e12

        self.log.section(f"decode steps, no speculation, bs {r['batch_sizes']}, context {r['context']}")
        decode: dict[str, Any] = {}
        runner = make_runner(target, None, "none", 0, max(r["batch_sizes"]), layout, dev, dt, a.seed + 1, self.graphs)
        with torch.inference_mode():
            for bs in r["batch_sizes"]:
                batch = synthetic_batch(bs, 0, layout, cfg.vocab_size, a.seed + bs)
                t = self.time(lambda: runner.execute(batch))
                nbytes = decode_step_bytes(target, r["context"], bs)
                decode[str(bs)] = {"step_ms": t.median_ms, "min_ms": t.min_ms, "max_ms": t.max_ms, "n": t.n,
                                   "tok_s": bs / (t.median_ms * 1e-3), "bytes": nbytes.total,
                                   "roofline_ms": nbytes.total / bw * 1e3,
                                   "roofline_fraction": nbytes.total / bw / (t.median_ms * 1e-3)}
                s["decode_tok_s"][str(bs)] = decode[str(bs)]["tok_s"]
                self.log(f"decode bs={bs}: {t.median_ms:.3f} ms/step ({decode[str(bs)]['tok_s']:.1f} tok/s), "
                         f"roofline fraction {decode[str(bs)]['roofline_fraction']:.3f}")
            # the same figure timed again: the spread between the two is the noise floor of every comparison
            batch1 = synthetic_batch(1, 0, layout, cfg.vocab_size, a.seed + 1)
            again = self.time(lambda: runner.execute(batch1))
        one = decode["1"]
        one["repeat_ms"] = again.median_ms
        one["repeat_spread"] = abs(again.median_ms - one["step_ms"]) / min(again.median_ms, one["step_ms"])
        step_bytes = decode_step_bytes(target, r["context"], 1)
        s["decode"] = decode
        s["bytes_per_step_bs1"] = step_bytes.as_dict()
        s["bytes_per_step_bs1_mxfp4_experts"] = decode_step_bytes(target, r["context"], 1, MXFP4_BITS).total
        s["roofline_ms_bs1"] = step_bytes.total / bw * 1e3
        s["decode_bs1_roofline_fraction"] = one["roofline_fraction"]
        self.write()

        self.log.section(f"verify steps at bs 1, k = 1..{r['max_k']}")
        del runner
        release_caches(target)
        verify = self._verify(target, layout, one["step_ms"], one["bytes"])
        s["verify"] = verify
        if "7" in verify:
            s["verify_k7_over_decode_bs1"] = verify["7"]["over_decode_bs1"]
            # what the bytes alone force: 8 tokens read ~21 of 32 experts a layer under uniform routing, not 4
            s["verify_k7_bytes_over_decode_bs1"] = verify["7"]["bytes_over_decode_bs1"]
        self.write()

        if not a.skip_draft:
            self.guarded("draft", lambda: self.drafters(target, cfg, layout))
            target.set_aux_layers([])
        else:
            s["draft"] = {"not_run": "skipped with --skip-draft"}

        if a.skip_hf:
            s["hf"] = {"not_run": "skipped with --skip-hf"}
        else:
            release_caches(target)
            self.guarded("hf", lambda: self.hf(target, cfg, layout))
        del target
        free_memory(dev)

    # --------------------------------------------------------------------------------------------

    def drafters(self, target: GptOss, cfg: GptOssConfig, layout: Layout) -> None:
        a, r, s, dev, dt = self.args, self.r, self.summary, self.device, self.dtype
        self.log.section(f"drafter steps at bs 1, K = 1..{r['max_k']}: P-EAGLE (4 layers) and EAGLE-3 (1 layer)")
        draft: dict[str, Any] = {}
        for mode, layers in (("peagle", 4), ("eagle3", 1)):
            dcfg = drafter_config(cfg, parallel=mode == "peagle", layers=layers)
            drafter = build_random(lambda: Drafter(dcfg), dev, dt, a.seed + 7)
            times = {}
            for K in range(1, r["max_k"] + 1):
                runner = make_runner(target, drafter, mode, K, 1, layout, dev, dt, a.seed + 3, self.graphs)
                batch = synthetic_batch(1, K, layout, cfg.vocab_size, a.seed + 200 + K)
                with torch.inference_mode():
                    t = self.time(capture_draft_call(runner, batch))
                times[str(K)] = {"draft_ms": t.median_ms, "min_ms": t.min_ms, "max_ms": t.max_ms,
                                 "draft_tokens": (1 + K) + (K - 1) if mode == "peagle" else 1 + K,
                                 "drafter_passes": 1 if mode == "peagle" else K}
                self.log(f"{mode} K={K}: {t.median_ms:.3f} ms")
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
        self.write()

    # --------------------------------------------------------------------------------------------

    def hf(self, target: GptOss, cfg: GptOssConfig, layout: Layout) -> None:
        a, r, s, dev, dt = self.args, self.r, self.summary, self.device, self.dtype
        n = r["hf_tokens"]
        self.log.section(f"transformers eager generation at bs 1 ({n} tokens after a {r['context']}-token prompt)")
        prompt = torch.randint(0, cfg.vocab_size, (r["context"],), generator=torch.Generator().manual_seed(a.seed + 9)).tolist()
        runner = make_runner(target, None, "none", 0, 1, layout, dev, dt, a.seed + 4, self.graphs)
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
            self.log(f"transformers with experts {hf.config._experts_implementation!r} failed ({failed}); "
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
        self.log(f"transformers: {res['decode_tok_s']:.2f} tok/s decode ({res['experts_implementation']} experts); "
                 f"ours {ours_bs1:.1f} tok/s -> {s['speedup_vs_hf_transformers_bs1'] or float('nan'):.1f}x; "
                 f"greedy tokens agree for {match}/{n}")
        self.write()

    # --------------------------------------------------------------------------------------------

    def packed_shapes(self) -> list[tuple[str, str]]:
        """(shape, summary key) of the MXFP4 sections this run has: 20B and 120B (tiny: its 120B-like shape)."""
        a = self.args
        if a.shape == "tiny":
            return [] if a.skip_120b else [("tiny-120b", "gpt_oss_120b")]
        shapes = [("20b", "gpt_oss_20b_mxfp4")] if a.shape == "20b" else []
        return shapes + ([] if a.shape != "120b" and a.skip_120b else [("120b", "gpt_oss_120b")])

    def packed_shape(self, shape: str) -> dict[str, Any]:
        """The model as users serve it, MXFP4 experts kept packed (as the engine loads the published checkpoint on
        CUDA): bs-1 decode (the whole model if it fits, else truncated depth + extrapolation), verify k = 1..max_k
        when the whole model fits, and the MoE layer alone."""
        s = self.summary
        res = self._packed_decode(shape)
        suffix = {"120b": "120b", "tiny-120b": "120b", "20b": "20b"}[shape]
        s[f"decode_bs1_roofline_fraction_{suffix}_mxfp4"] = res.get("roofline_fraction")
        res["moe_layer"] = self._moe_layer(shape)
        if suffix == "120b":
            for n in (1, 8):
                s[f"moe_mxfp4_tb_s_{n}_tokens_120b"] = (res["moe_layer"].get(str(n)) or {}).get("tb_s")
            s["verify_k7_roofline_fraction_120b"] = (res.get("verify", {}).get("7") or {}).get("roofline_fraction")
        return res

    def _moe_layer(self, shape: str) -> dict[str, Any]:
        """One MoE layer with packed experts, random weights, T random tokens routed top-k: us per call (CUDA: 20
        calls in a CUDA graph, as the engine launches them) and TB/s over the bytes of the experts selected."""
        from peagle_core.models.gpt_oss import MoE

        dev, dt = self.device, self.dtype
        cfg = target_config(shape)
        layer = build_random(lambda: MoE(cfg, mxfp4_experts=True), dev, dt, self.args.seed + 21)
        E = layer.router.weight.shape[0]
        expert_bytes = sum(p.numel() * p.element_size() for p in layer.experts.parameters()) / E
        g = torch.Generator(device=dev).manual_seed(self.args.seed + 22)
        out: dict[str, Any] = {}
        with torch.inference_mode():
            for T in (MOE_TOKENS if dev.type == "cuda" else (1, 8)):
                x = torch.randn(T, cfg.hidden_size, device=dev, generator=g).to(dt)
                experts = torch.topk(x.float() @ layer.router.weight.float().T, layer.top_k).indices.unique().numel()
                us = (time_graph(lambda: layer(x)) if dev.type == "cuda" else self.time(lambda: layer(x)).median_ms * 1e3)
                out[str(T)] = {"us": us, "experts": experts, "bytes": experts * expert_bytes,
                               "tb_s": experts * expert_bytes / us / 1e6}
                self.log(f"{shape} MoE layer, {T} tokens: {us:.1f} us, {experts} experts, {out[str(T)]['tb_s']:.2f} TB/s")
        del layer
        free_memory(dev)
        return out

    def _packed_decode(self, shape: str) -> dict[str, Any]:
        a, r, dev, dt = self.args, self.r, self.device, self.dtype
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
            self.log(f"{shape}: building {depth} of {L} layers "
                     f"({(fixed + depth * per_layer) / 1e9:.1f} GB; {fits} estimated to fit)")
            oom = False
            try:
                measured, truncated_bytes, verify = self._time_depths(full_cfg, depth, layout)
            except torch.OutOfMemoryError:
                oom = True  # handled outside the except block, once the traceback's frames are gone
            if not oom:
                break
            free_memory(dev)
            self.log(f"{shape}: out of memory at {depth} layers, retrying shallower")
            depth = depth * 3 // 4
        bw = self.summary["bandwidth"]["tb_s"] * 1e12
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
        self.log(f"{shape}: {step_ms:.3f} ms/step ({res['tok_s']:.1f} tok/s) "
                 f"{'extrapolated' if res['truncated'] else 'measured'}; roofline fraction {res['roofline_fraction']:.3f}")
        return res

    def _time_depths(self, full_cfg: GptOssConfig, depth: int,
                     layout: Layout) -> tuple[dict[str, float], int, dict[str, Any]]:
        """bs-1 decode step (ms) of a `depth`-layer model and, when truncated, of its first depth // 2 layers; when
        whole, its verify steps k = 1..max_k against their touched-bytes roofline.

        Returns ({layers: step ms}, bytes per step of the model as built, {k: verify figures} or {}).
        """
        a, r, dev, dt = self.args, self.r, self.device, self.dtype
        cfg = full_cfg.model_copy(update={"num_hidden_layers": depth, "layer_types": None})
        target = build_random(lambda: GptOss(cfg, mxfp4_experts=True), dev, dt, a.seed + 11)
        runner = make_runner(target, None, "none", 0, 1, layout, dev, dt, a.seed + 12, self.graphs)
        batch = synthetic_batch(1, 0, layout, cfg.vocab_size, a.seed + 13)
        with torch.inference_mode():
            measured = {str(depth): self.time(lambda: runner.execute(batch)).median_ms}
            if depth < full_cfg.num_hidden_layers:
                shallow = max(1, depth // 2)
                layers = target.model.layers
                target.model.layers = nn.ModuleList(list(layers)[:shallow])  # same weights, same runner
                if runner.graphs is not None:
                    runner.graphs.reset()  # the captured graphs replay the deeper model
                try:
                    measured[str(shallow)] = self.time(lambda: runner.execute(batch)).median_ms
                finally:
                    target.model.layers = layers
        nbytes = decode_step_bytes(target, r["context"], 1).total
        del runner
        release_caches(target)
        whole = depth == full_cfg.num_hidden_layers
        verify = self._verify(target, layout, measured[str(depth)], nbytes) if whole else {}
        del target
        free_memory(dev)
        return measured, nbytes, verify

    def _verify(self, target: GptOss, layout: Layout, decode_ms: float, decode_bytes: float) -> dict[str, Any]:
        """Verify steps at bs 1 (target over 1 + k tokens, rejection sampling), k = 1..max_k, against the bs-1
        decode step and the bytes their tokens must read (more tokens route to more experts)."""
        a, r, dev, dt = self.args, self.r, self.device, self.dtype
        bw = self.summary["bandwidth"]["tb_s"] * 1e12
        runner = make_runner(target, None, "none", r["max_k"], 1, layout, dev, dt, a.seed + 2, self.graphs)
        out = {}
        with torch.inference_mode():
            for k in range(1, r["max_k"] + 1):
                batch = synthetic_batch(1, k, layout, target.config.vocab_size, a.seed + 100 + k)
                t = self.time(lambda: runner.execute(batch))
                nbytes = decode_step_bytes(target, r["context"], 1, tokens_per_req=1 + k).total
                out[str(k)] = {"step_ms": t.median_ms, "min_ms": t.min_ms, "max_ms": t.max_ms,
                               "over_decode_bs1": t.median_ms / decode_ms, "bytes": nbytes,
                               "roofline_ms": nbytes / bw * 1e3, "roofline_fraction": nbytes / bw / (t.median_ms * 1e-3),
                               "bytes_over_decode_bs1": nbytes / decode_bytes}
                self.log(f"verify k={k}: {t.median_ms:.3f} ms ({out[str(k)]['over_decode_bs1']:.3f} x decode), "
                         f"roofline fraction {out[str(k)]['roofline_fraction']:.3f}")
        del runner
        release_caches(target)
        return out


# ------------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------------


def bar_rows(s: dict[str, Any]) -> list[dict[str, Any]]:
    """Each figure with its bar and whether it is met: the bf16 bars apply to the 20B shape on a GPU, the MXFP4
    ones on any GPU (fractions of its own roofline)."""
    cuda = s.get("machine", {}).get("device_type") == "cuda"
    bf16_applies = cuda and s.get("settings", {}).get("shape") == "20b"
    rows = []
    for key, op, thr, text in BARS:
        v = s.get(key)
        met = None
        if v is not None and op is not None:
            met = v >= thr if op == ">=" else v <= thr
        rows.append({"key": key, "figure": v, "bar": text, "met": met,
                     "bar_applies": cuda if key in MXFP4_KEYS else bf16_applies})
    return rows


def write_outputs(summary: dict[str, Any], out: Path) -> None:
    summary["bars"] = bar_rows(summary)
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(_clean(summary), indent=2, default=str) + "\n")
    tmp.replace(out / "summary.json")
    (out / "summary.md").write_text(render_markdown(summary))


def _clean(o: Any) -> Any:
    """Strict JSON: non-finite floats become null."""
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:.{digits}f}"
    return str(v)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(_f(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(s: dict[str, Any]) -> str:
    m, st = s.get("machine", {}), s.get("settings", {})
    device = m.get("gpu_name") or f"CPU ({m.get('cpu')}, {m.get('cpu_count')} cores)"
    out = [f"# peagle bench: {st.get('shape')} shape on {device}", "",
           f"- command: `{s.get('command')}`",
           f"- date: {s.get('date')} ({s.get('status')})",
           f"- versions: torch {m.get('torch')}, triton {m.get('triton')}, transformers {m.get('transformers')}, "
           f"CUDA {m.get('cuda', '-')}, Python {m.get('python')}",
           f"- commit: {m.get('git_commit', '-')}{' (uncommitted changes)' if m.get('git_dirty') else ''}",
           f"- settings: {st.get('dtype')}, context {st.get('context')} tokens, {st.get('warmup')} warm-up + "
           f"{st.get('iters')} timed calls per figure ({st.get('timing')}), Triton kernels "
           f"{'on' if st.get('triton_kernels') else 'off'}; random weights, no checkpoint", ""]
    if s.get("note"):
        out += [f"> {s['note']}", ""]

    out += _bar_section(s)

    bw = s.get("bandwidth")
    if bw:
        b = s.get("bytes_per_step_bs1") or {}
        out += ["## Bandwidth and the bs-1 roofline", "",
                _table(["quantity", "value"], [
                    ["read bandwidth, `x.sum()` (TB/s)", bw["read_tb_s"]],
                    ["copy bandwidth, read + write (TB/s)", bw["copy_tb_s"]],
                    ["bandwidth used for the roofline (TB/s)", bw["tb_s"]],
                    ["bytes per decode step at bs 1 (GB)", b.get("total", 0) / 1e9 if b else None],
                    ["  of which weights (GB)", b.get("weights", 0) / 1e9 if b else None],
                    ["  of which K/V (GB)", b.get("kv", 0) / 1e9 if b else None],
                    ["same with MXFP4 experts (GB)", (s.get("bytes_per_step_bs1_mxfp4_experts") or 0) / 1e9 or None],
                    ["roofline time at bs 1 (ms)", s.get("roofline_ms_bs1")],
                ]), ""]
        if b:
            out += ["Bytes by part at bs 1 (MB): " + ", ".join(f"{k} {v / 1e6:.2f}" for k, v in b["parts"].items()),
                    "(attention, norms, router and the top-k experts of every layer, the whole LM head, one embedding "
                    "row; K/V over the context, sliding layers capped at their window).", ""]

    dec = s.get("decode")
    if dec:
        out += ["## Decode steps (no speculation)", "",
                "`ModelRunner.execute` on synthetic decode batches; bytes above bs 1 assume uniform routing "
                "(expected distinct experts).", "",
                _table(["batch", "step ms (median)", "min", "max", "tok/s", "bytes (GB)", "roofline ms", "roofline fraction"],
                       [[bs, d["step_ms"], d["min_ms"], d["max_ms"], _f(d["tok_s"], 1), d["bytes"] / 1e9, d["roofline_ms"],
                         d["roofline_fraction"]] for bs, d in dec.items()]), ""]
        if "repeat_ms" in dec.get("1", {}):
            out += [f"bs 1 timed twice: {dec['1']['step_ms']:.3f} and {dec['1']['repeat_ms']:.3f} ms "
                    f"(spread {100 * dec['1']['repeat_spread']:.1f}%: differences below this are noise).", ""]

    ver = s.get("verify")
    if ver:
        out += ["## Verify steps at bs 1", "", "Target over 1 + k tokens plus rejection sampling (bar: k = 7 within "
                "1.3x of a plain decode step).", "",
                "Bytes: the weights the step must read, with the experts that 1 + k tokens select under uniform "
                "routing (a MoE verify reads more experts than a decode step; the last column is that ratio "
                "alone, the floor a bandwidth-bound verify step cannot beat).", "",
                _table(["k", "step ms", "min", "max", "over decode bs 1", "roofline fraction", "bytes over decode bs 1"],
                       [[k, v["step_ms"], v["min_ms"], v["max_ms"], v["over_decode_bs1"], v.get("roofline_fraction"),
                         v.get("bytes_over_decode_bs1")] for k, v in ver.items()]), ""]

    dr = s.get("draft")
    if dr and "not_run" not in dr:
        pe, e3 = dr["peagle"], dr["eagle3"]
        out += ["## Drafter steps at bs 1", "", dr["batch"] + ".",
                f"P-EAGLE head: {pe['layers']} layers, {pe['parameters'] / 1e9:.2f} B parameters; "
                f"EAGLE-3 head: {e3['layers']} layer, {e3['parameters'] / 1e9:.2f} B parameters.", "",
                _table(["K", "P-EAGLE ms", "P-EAGLE / K=1", "EAGLE-3 ms", "EAGLE-3 / K=1"],
                       [[K, pe["by_k"][K]["draft_ms"], pe["by_k"][K]["draft_ms"] / pe["by_k"]["1"]["draft_ms"],
                         e3["by_k"][K]["draft_ms"], e3["by_k"][K]["draft_ms"] / e3["by_k"]["1"]["draft_ms"]]
                        for K in pe["by_k"]]), ""]
    elif dr:
        out += ["## Drafter steps", "", f"Not run: {dr['not_run']}.", ""]

    hf = s.get("hf")
    if hf and "not_run" not in hf:
        out += ["## transformers baseline at bs 1", "",
                f"`GptOssForCausalLM` over the same weights, attention `{hf['attn_implementation']}`, experts "
                f"`{hf['experts_implementation']}`; greedy, {hf['tokens']} tokens after the same prompt. Decode tok/s "
                "= (n - 1) / (t(n) - t(1))." + (f" Note: {hf['fallback']}." if hf.get("fallback") else ""), "",
                _table(["quantity", "value"], [
                    ["transformers decode tok/s", _f(hf["decode_tok_s"], 2)],
                    ["transformers end-to-end tok/s (prefill included)", _f(hf["end_to_end_tok_s"], 2)],
                    ["ours, engine decode step at bs 1 (tok/s)", _f(s.get("decode_tok_s", {}).get("1"), 1)],
                    ["ours, greedy loop through ModelRunner.execute (tok/s)", _f(hf["ours_loop_decode_tok_s"], 1)],
                    ["speedup (ours / transformers)", _f(s.get("speedup_vs_hf_transformers_bs1"), 2)],
                    ["greedy tokens equal (leading tokens that agree)",
                     f"{_f(hf['same_greedy_tokens'])} ({hf['same_greedy_prefix']}/{hf['tokens']})"],
                ]), ""]
    elif hf:
        out += ["## transformers baseline", "", f"Not run: {hf['not_run']}.", ""]

    for key, name in PACKED.items():
        out += _packed_section(s.get(key), name)
    return "\n".join(out)


def _packed_section(big: dict[str, Any] | None, name: str) -> list[str]:
    """A packed-MXFP4 shape's decode, verify and MoE-layer figures."""
    if not big:
        return []
    out = [f"## {name} shape with MXFP4 experts: decode at bs 1", ""]
    if "not_run" in big:
        out += [f"Not run: {big['not_run']}.", ""]
    if big.get("note"):
        out += [big["note"] + ".", ""]
    if "step_ms" in big:
        if big.get("truncated"):
            out += [f"**Truncated**: {big['layers_run']} of {big['layers_full']} layers built; {big['method']}.", ""]
        out += [_table(["quantity", "value"], [
            ["step ms (bs 1)" + (" extrapolated" if big.get("truncated") else ""), big["step_ms"]],
            ["tok/s", _f(big["tok_s"], 1)],
            ["measured step ms by depth", ", ".join(f"{d} layers: {t:.3f}" for d, t in big["measured_step_ms"].items())],
            ["bytes per step (GB)", big["bytes_per_step_bs1"]["total"] / 1e9],
            ["roofline ms", big["roofline_ms"]],
            ["roofline fraction", big["roofline_fraction"]],
            ["roofline fraction of the truncated model as run", big.get("truncated_roofline_fraction")],
            ["experts", big.get("experts_dtype")],
            ["bytes per step with bf16 experts instead (GB)", (big.get("bytes_per_step_bs1_bf16_experts") or 0) / 1e9],
        ]), ""]
    if big.get("verify"):
        out += [f"### {name}: verify at bs 1 (target over 1 + k tokens)", "",
                _table(["k", "step ms", "x decode", "bytes (GB)", "roofline fraction"],
                       [[k, v["step_ms"], v["over_decode_bs1"], v["bytes"] / 1e9, v["roofline_fraction"]]
                        for k, v in big["verify"].items()]), ""]
    if big.get("moe_layer"):
        out += [f"### {name}: the MoE layer alone", "",
                _table(["routed tokens", "us", "experts read", "TB/s effective"],
                       [[t, v["us"], v["experts"], v["tb_s"]] for t, v in big["moe_layer"].items()]), ""]
    return out


def _bar_section(s: dict[str, Any]) -> list[str]:
    out = ["## The bar", ""]
    rows = s.get("bars") or bar_rows(s)
    if rows and not rows[0]["bar_applies"]:
        out += ["The bar is set for the 20B shape on one H200; this run is a different shape or device, so "
                "the verdicts below are informational.", ""]
    out += [_table(["figure", "measured", "bar", "met"],
                   [[f"`{r['key']}`", r["figure"], r["bar"], "-" if r["met"] is None else ("yes" if r["met"] else "NO")]
                    for r in rows]), ""]
    return out


def render_brief(s: dict[str, Any]) -> str:
    """The few lines printed last (a remote run's output tail): the bar, tok/s by batch, the 120B figure."""
    out = _bar_section(s)
    if s.get("decode_tok_s"):
        out.append("decode tok/s by batch: " + ", ".join(f"bs {b}: {v:.1f}" for b, v in s["decode_tok_s"].items()))
    for key, name in PACKED.items():
        big = s.get(key) or {}
        if "step_ms" in big:
            out.append(f"{name} MXFP4 bs 1: {big['tok_s']:.1f} tok/s, roofline fraction {big['roofline_fraction']:.3f}"
                       + (f" (truncated to {big['layers_run']} layers, extrapolated)" if big.get("truncated") else ""))
        elif big:
            out.append(f"{name} MXFP4: not run ({big.get('not_run')})")
    return "\n".join(out)
