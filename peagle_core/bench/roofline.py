"""The roofline: the device's measured bandwidth and the bytes a decode or verify step must read."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from peagle_core.models.gpt_oss import GptOss
from peagle_core.timing import measure


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

