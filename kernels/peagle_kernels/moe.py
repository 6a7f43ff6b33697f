"""GPT-OSS mixture of experts: top-k routing, interleaved gate/up, clamped SwiGLU, weighted sum.

Expert weights are out-major like `nn.Linear` (and like the MXFP4 blocks on disk):
`w1 [E, 2I, H]` (row 2c = gate channel c, row 2c+1 = up channel c), `b1 [E, 2I]`,
`w2 [E, H, I]`, `b2 [E, H]`. The down bias is added per expert before gate weighting.

`moe_mxfp4` is the same op with the expert matrices kept packed as MXFP4 (OCP microscaling, as on
disk): `w1_blocks [E, 2I, H/32, 16]` + `w1_scales [E, 2I, H/32]`, `w2_blocks [E, H, I/32, 16]` +
`w2_scales [E, H, I/32]`, all uint8 (two FP4 E2M1 codes a byte, low nibble first; one E8M0 scale
per 32 weights along the input dimension). Biases stay in the activation dtype.

`reduce=False` (both ops) returns summands `[T, S, H]` instead of `[T, H]`: S rows per token whose sum over
S (fp32 accumulation, one rounding: `summands.sum(1)`) is the output, for `peagle_kernels.norm.add_rms_norm` to add
inside the norm that follows the MoE (one launch fewer a layer). The Triton kernels give their k weighted
expert outputs unsummed (S = top_k; `summands.sum(1)` is bit-identical to reduce=True); the references,
which round after each expert's add, give their finished output as S = 1.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from peagle_kernels.dispatch import needs_grad, use_triton


class Routing(NamedTuple):
    """A batch's routing, as `norm_and_route` hands it to `moe(..., routing=)`: gates [T, k] in x.dtype and
    experts [T, k] int64 by descending logit (`route`), and the pairs sorted by expert (order, offsets) when the
    Triton routing launch sorted them too, else None."""

    gates: torch.Tensor
    experts: torch.Tensor
    sorted_pairs: tuple[torch.Tensor, torch.Tensor] | None = None


def norm_and_route(h: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                   router_w: torch.Tensor, router_b: torch.Tensor, top_k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, Routing]:
    """(x, new_residual, routing of x): `peagle_kernels.norm.add_rms_norm(h, residual, norm_w, eps)` and then `route`,
    the MoE's norm and router together. On the GPU at decode sizes one launch does both (the norm's launch and
    its gap saved in every MoE layer: `peagle_kernels.triton_routing.norm_route_and_sort_pairs`)."""
    if use_triton(h) and not needs_grad(h, residual, norm_w, router_w, router_b):
        from peagle_kernels.triton_routing import norm_route_and_sort_pairs
        x, new_residual, *routing = norm_route_and_sort_pairs(h, residual, norm_w, eps, router_w, router_b, top_k)
        return x, new_residual, Routing(*routing)
    from peagle_kernels.norm import add_rms_norm_ref
    x, new_residual = add_rms_norm_ref(h, residual, norm_w, eps)
    return x, new_residual, Routing(*route_ref(x, router_w, router_b, top_k))


def route(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, top_k: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over raw router logits, then softmax over the k selected: (gates [T,k], experts [T,k])."""
    if use_triton(x) and not needs_grad(x, router_w, router_b):
        from peagle_kernels.triton_routing import route_triton
        return route_triton(x, router_w, router_b, top_k)
    return route_ref(x, router_w, router_b, top_k)


def route_ref(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, top_k: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits in x.dtype; experts by descending logit (torch.topk, sorted); gates in x.dtype."""
    logits = torch.nn.functional.linear(x, router_w, router_b)
    vals, idx = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(vals, dim=-1, dtype=vals.dtype), idx


def swiglu(z: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate = z[..., ::2].clamp(max=limit)
    up = z[..., 1::2].clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def moe(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor,
        w2: torch.Tensor, b2: torch.Tensor, top_k: int, alpha: float, limit: float, *,
        reduce: bool = True, routing: Routing | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H], or summands [T, S, H] with reduce=False (see the module docstring). `routing`: x's
    routing, already worked out (`norm_and_route`), else routed here."""
    if use_triton(x):
        from peagle_kernels.triton_moe import moe_triton
        return moe_triton(x, router_w, router_b, w1, b1, w2, b2, top_k, alpha, limit, reduce=reduce, routing=routing)
    return moe_ref(x, router_w, router_b, w1, b1, w2, b2, top_k, alpha, limit, reduce=reduce, routing=routing)


def moe_ref(x, router_w, router_b, w1, b1, w2, b2, top_k, alpha, limit, *, reduce: bool = True,
            routing: Routing | None = None) -> torch.Tensor:
    """Two exact formulations; both add a token's expert outputs in ascending expert order. With reduce=False
    the output comes as one summand, [T, 1, H] (a view): its per-expert adds are already rounded.

    Dense: every expert on every token, then each token keeps its top-k outputs. It wastes (E - k) / E of
    its multiply-adds, but is a fixed handful of ops with no host sync, where the loop over the selected
    experts pays ~15 ops and a sync (torch.where) per expert and layer. One loop iteration costs about as
    much as 2e10 multiply-adds on a GPU (launch-bound, and each sync drains the queue: training's target
    forward) and 2e6 on a CPU (measured, tiny models), so the tiny target always runs dense on a GPU, while
    a CPU runs dense only at decode sizes. Packed MXFP4 experts (`_UnpackedExperts`) always loop, so only
    the experts a batch selects are ever unpacked.
    """
    gates, experts = routing[:2] if routing is not None else route_ref(x, router_w, router_b, top_k)
    out = torch.zeros_like(x)
    if torch.is_tensor(w1):
        (E, two_i, H), T = w1.shape, x.shape[0]
        wasted = (E - top_k) * T * 3 * H * two_i // 2
        per_expert = 2e6 if x.device.type == "cpu" else 2e10
        if wasted <= E * per_expert and E * T * two_i <= 1 << 28:  # and [E, T, 2I] activations fit easily
            h = swiglu(torch.baddbmm(b1[:, None], x.expand(E, T, H), w1.mT), alpha, limit)
            y = torch.baddbmm(b2[:, None], h, w2.mT)  # [E, T, H]
            experts, order = experts.sort(dim=-1)
            gates, tok = gates.gather(-1, order), torch.arange(T, device=x.device)
            for s in range(top_k):
                out = out + (y[experts[:, s], tok] * gates[:, s, None]).to(x.dtype)
            return out if reduce else out[:, None]
    for e in torch.unique(experts).tolist():
        tok, slot = torch.where(experts == e)
        h = swiglu(torch.nn.functional.linear(x[tok], w1[e], b1[e]), alpha, limit)
        y = torch.nn.functional.linear(h, w2[e], b2[e])
        out.index_add_(0, tok, (y * gates[tok, slot, None]).to(x.dtype))
    return out if reduce else out[:, None]


def moe_mxfp4(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, w1_blocks: torch.Tensor,
              w1_scales: torch.Tensor, b1: torch.Tensor, w2_blocks: torch.Tensor, w2_scales: torch.Tensor,
              b2: torch.Tensor, top_k: int, alpha: float, limit: float, *, reduce: bool = True,
              routing: Routing | None = None) -> torch.Tensor:
    """`moe` over packed MXFP4 experts: x [T, H] -> [T, H], or summands [T, S, H] with reduce=False."""
    if use_triton(x):
        from peagle_kernels.triton_moe_mxfp4 import moe_mxfp4_triton
        return moe_mxfp4_triton(x, router_w, router_b, w1_blocks, w1_scales, b1, w2_blocks, w2_scales, b2,
                                top_k, alpha, limit, reduce=reduce, routing=routing)
    return moe_mxfp4_ref(x, router_w, router_b, w1_blocks, w1_scales, b1, w2_blocks, w2_scales, b2, top_k, alpha, limit,
                         reduce=reduce, routing=routing)


def moe_mxfp4_ref(x, router_w, router_b, w1_blocks, w1_scales, b1, w2_blocks, w2_scales, b2, top_k, alpha, limit, *,
                  reduce: bool = True, routing: Routing | None = None) -> torch.Tensor:
    """Dequantize, then `moe_ref`. Experts are unpacked one at a time as `moe_ref` reads them, so only
    the experts a batch selects are ever expanded (never the layer's whole bf16 weights)."""
    check_moe_shapes(x, router_w, router_b, mxfp4_shape(w1_blocks, w1_scales, "w1"), b1,
                     mxfp4_shape(w2_blocks, w2_scales, "w2"), b2, top_k, "w1_blocks", "w2_blocks")
    w1 = _UnpackedExperts(w1_blocks, w1_scales, x.dtype)
    w2 = _UnpackedExperts(w2_blocks, w2_scales, x.dtype)
    return moe_ref(x, router_w, router_b, w1, b1, w2, b2, top_k, alpha, limit, reduce=reduce, routing=routing)


class _UnpackedExperts:
    """`w[e]`: expert e's matrix dequantised from its MXFP4 blocks and scales (all `moe_ref` asks of w1/w2)."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        self.blocks, self.scales, self.dtype = blocks, scales, dtype

    def __getitem__(self, e: int) -> torch.Tensor:
        # The format lives with the checkpoint loader; imported here because peagle_core imports kernels.
        from peagle_core.loading.mxfp4 import dequantize
        return dequantize(self.blocks[e], self.scales[e], self.dtype)


def mxfp4_shape(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> tuple[int, ...]:
    """The dense shape [E, N, K] that packed `blocks [E, N, K/32, 16]` and `scales [E, N, K/32]` hold."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"moe: {name}_blocks and {name}_scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"moe: {name}_blocks must be [E, N, K/32, 16] with {name}_scales [E, N, K/32], got "
                         f"{list(blocks.shape)} and {list(scales.shape)}")
    return (*blocks.shape[:2], blocks.shape[2] * 32)


def check_moe_shapes(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, w1_shape: tuple[int, ...],
                     b1: torch.Tensor, w2_shape: tuple[int, ...], b2: torch.Tensor, top_k: int,
                     w1_name: str = "w1", w2_name: str = "w2") -> None:
    """ValueError naming the first tensor whose shape does not fit x [T, H] and the dense expert
    shapes w1 [E, 2I, H], w2 [E, H, I] (for packed weights: the shapes they unpack to)."""
    if x.dim() != 2:
        raise ValueError(f"moe: x must be [T, H], got {tuple(x.shape)}")
    H = x.shape[1]
    if len(w1_shape) != 3 or w1_shape[2] != H or w1_shape[1] % 2:
        raise ValueError(f"moe: {w1_name} must be [E, 2I, {H}], got {tuple(w1_shape)}")
    E, two_i, _ = w1_shape
    checks = {"router_w": (router_w.shape, (E, H)), "router_b": (router_b.shape, (E,)), "b1": (b1.shape, (E, two_i)),
              w2_name: (w2_shape, (E, H, two_i // 2)), "b2": (b2.shape, (E, H))}
    for name, (got, shape) in checks.items():
        if tuple(got) != shape:
            raise ValueError(f"moe: {name} must be {list(shape)}, got {list(got)}")
    if not 1 <= top_k <= E:
        raise ValueError(f"moe: top_k={top_k} must be in [1, {E}]")
