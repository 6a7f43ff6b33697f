"""GPT-OSS mixture of experts: top-k routing, interleaved gate/up, clamped SwiGLU, weighted sum.

Expert weights are out-major like `nn.Linear` (and like the MXFP4 blocks on disk):
`w1 [E, 2I, H]` (row 2c = gate channel c, row 2c+1 = up channel c), `b1 [E, 2I]`,
`w2 [E, H, I]`, `b2 [E, H]`. The down bias is added per expert before gate weighting.
"""
from __future__ import annotations

import torch

from kernels.dispatch import use_triton


def route(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, top_k: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over raw router logits, then softmax over the k selected: (gates [T,k], experts [T,k])."""
    logits = torch.nn.functional.linear(x, router_w, router_b)
    vals, idx = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(vals, dim=-1, dtype=vals.dtype), idx


def swiglu(z: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate = z[..., ::2].clamp(max=limit)
    up = z[..., 1::2].clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def moe(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor,
        w2: torch.Tensor, b2: torch.Tensor, top_k: int, alpha: float, limit: float) -> torch.Tensor:
    """x [T, H] -> [T, H]."""
    if use_triton(x):
        from kernels.triton_moe import moe_triton
        return moe_triton(x, router_w, router_b, w1, b1, w2, b2, top_k, alpha, limit)
    return moe_ref(x, router_w, router_b, w1, b1, w2, b2, top_k, alpha, limit)


def moe_ref(x, router_w, router_b, w1, b1, w2, b2, top_k, alpha, limit) -> torch.Tensor:
    gates, experts = route(x, router_w, router_b, top_k)
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        tok, slot = torch.where(experts == e)
        h = swiglu(torch.nn.functional.linear(x[tok], w1[e], b1[e]), alpha, limit)
        y = torch.nn.functional.linear(h, w2[e], b2[e])
        out.index_add_(0, tok, (y * gates[tok, slot, None]).to(x.dtype))
    return out
