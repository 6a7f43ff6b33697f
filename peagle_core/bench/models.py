"""The models a bench run times: GPT-OSS shapes and drafter heads, random weights built on the device."""
from __future__ import annotations

import gc
import math
import os
from typing import Callable

import torch
from torch import nn

from peagle_core.config import DrafterConfig, GptOssConfig
from peagle_core.models.gpt_oss import GptOss

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MXFP4_BITS = 4.25  # 4-bit values plus one 8-bit power-of-two scale per 32 (what MXFP4 experts read)
MXFP4_BLOCK = 32
MXFP4_RMS = 2.9  # root mean square of the 16 FP4 (e2m1) values, for random scales of the right size


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

