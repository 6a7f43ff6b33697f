"""Paged attention with learned sinks and a sliding window, and the paged KV write.

Layout: `k_cache`/`v_cache` are `[num_blocks, block_size, num_kv_heads, head_dim]`. A request's
token at absolute position p lives in block `block_tables[b, p // block_size]`, row `p % block_size`.
Query token t (of request b, at absolute position `positions[t]`) attends to the cached keys at
positions j with `j <= positions[t]`, `j < seq_lens[b]` and, with a window W, `j > positions[t] - W`.
Each query head h has one sink logit `sinks[h]` (already in the scaled-logit domain) that joins
the softmax with a zero value vector. Query head h reads kv head `h // (Hq // Hkv)`.
"""
from __future__ import annotations

import torch

from kernels.dispatch import use_triton


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k/v [T, Hkv, D] at flat cache slots; slot -1 writes nothing (padding, rejected)."""
    if use_triton(k):
        from kernels.triton_attention import write_kv_triton
        return write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return write_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    positions: torch.Tensor, sinks: torch.Tensor | None, sliding_window: int | None,
                    scale: float) -> torch.Tensor:
    """Attention of q [T, Hq, D] over the paged cache; returns [T, Hq, D] in q's dtype."""
    if use_triton(q):
        from kernels.triton_attention import paged_attention_triton
        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                      positions, sinks, sliding_window, scale)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                               positions, sinks, sliding_window, scale)


def paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions,
                        sinks, sliding_window, scale) -> torch.Tensor:
    out = torch.zeros_like(q)
    block_size = k_cache.shape[1]
    qsl = query_start_loc.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        s, e = qsl[b], qsl[b + 1]
        if e == s or length == 0:
            continue
        blocks = block_tables[b, : (length + block_size - 1) // block_size].long()
        k = k_cache[blocks].flatten(0, 1)[:length]
        v = v_cache[blocks].flatten(0, 1)[:length]
        kv_pos = torch.arange(length, device=q.device)
        out[s:e] = attend(q[s:e], k, v, positions[s:e], kv_pos, sinks, sliding_window, scale)
    return out


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor,
                     positions: torch.Tensor, sinks: torch.Tensor | None, sliding_window: int | None,
                     scale: float) -> torch.Tensor:
    """Cache-free causal attention within each sequence of a flat batch (training, features)."""
    qsl = query_start_loc.tolist()
    lengths = {e - s for s, e in zip(qsl[:-1], qsl[1:])}
    if len(lengths) == 1 and len(qsl) > 2:  # equal lengths (packed training batches): one batched call
        n = lengths.pop()
        fold = lambda t: t.unflatten(0, (-1, n))
        return attend(fold(q), fold(k), fold(v), fold(positions), fold(positions), sinks, sliding_window,
                      scale).flatten(0, 1)
    out = torch.zeros_like(q)
    for s, e in zip(qsl[:-1], qsl[1:]):
        if e > s:
            out[s:e] = attend(q[s:e], k[s:e], v[s:e], positions[s:e], positions[s:e], sinks, sliding_window, scale)
    return out


def attend(q, k, v, q_pos, kv_pos, sinks, sliding_window, scale) -> torch.Tensor:
    """Exact softmax attention with sinks: q [..., n, Hq, D], k/v [..., L, Hkv, D] (leading dims batch)."""
    group = q.shape[-2] // k.shape[-2]
    kf = k.float().repeat_interleave(group, dim=-2)
    vf = v.float().repeat_interleave(group, dim=-2)
    scores = torch.einsum("...nhd,...lhd->...hnl", q.float(), kf) * scale
    allowed = kv_pos[..., None, :] <= q_pos[..., :, None]
    if sliding_window:
        allowed &= kv_pos[..., None, :] > q_pos[..., :, None] - sliding_window
    scores = scores.masked_fill(~allowed.unsqueeze(-3), float("-inf"))
    if sinks is not None:
        sink = sinks.float()[:, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("...hnl,...lhd->...nhd", probs, vf).to(q.dtype)
