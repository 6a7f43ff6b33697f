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

from peagle_kernels.dispatch import use_triton


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
        from peagle_kernels.triton_attention import paged_attention_triton
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


# Score elements one batched `attend` call may hold ([seqs, Hq, L, L] fp32, a few such tensors alive): the
# padded batch is attended in groups of sequences that fit, so memory stays bounded at any batch size.
VARLEN_SCORE_ELEMENTS = 1 << 27


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor,
                     positions: torch.Tensor, sinks: torch.Tensor | None, sliding_window: int | None,
                     scale: float, max_seqlen: int | None = None) -> torch.Tensor:
    """Cache-free causal attention within each sequence of a flat batch (training, features).

    Every token must belong to a sequence (query_start_loc[-1] == T). The sequences are padded to
    [num_seqs, max_seqlen] with index tensors built on the device and attended in a few batched calls:
    a loop per sequence would cost a dozen kernel launches per sequence and layer, and reading the
    lengths back a host sync per layer. `max_seqlen` (a host int, as flash-attn's varlen API takes it)
    avoids the one read-back otherwise needed to size the padding.
    """
    T, B = q.shape[0], query_start_loc.numel() - 1
    if T == 0:
        return torch.zeros_like(q)
    if max_seqlen is None:
        max_seqlen = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    L = max_seqlen
    if B * L == T:  # equal lengths (packed batches): the padded layout is a view
        pad = lambda t, fill: t.unflatten(0, (B, L))  # noqa: E731
        unpad = lambda t: t.flatten(0, 1)  # noqa: E731
    else:
        qsl = query_start_loc.to(q.device)
        tok = torch.arange(T, device=q.device, dtype=qsl.dtype)
        seq = (torch.searchsorted(qsl, tok, right=True) - 1).long()  # the last start <= t: skips empty ones
        at = (seq, (tok - qsl[seq]).long())  # (sequence, offset in it) of each token
        pad = lambda t, fill: t.new_full((B, L, *t.shape[1:]), fill).index_put(at, t)  # noqa: E731
        unpad = lambda t: t[at]  # noqa: E731
    # Padding keys sit at a position no real query reaches (causality masks them); padding queries see
    # the padding keys of their row (same position, inside any window), so no softmax row is empty.
    never = torch.iinfo(positions.dtype).max
    qp, kp, vp, pos = pad(q, 0), pad(k, 0), pad(v, 0), pad(positions, never)
    rows = max(1, VARLEN_SCORE_ELEMENTS // (q.shape[1] * L * (L + 1)))
    out = [attend(qp[i:i + rows], kp[i:i + rows], vp[i:i + rows], pos[i:i + rows], pos[i:i + rows], sinks,
                  sliding_window, scale) for i in range(0, B, rows)]
    return unpad(out[0] if len(out) == 1 else torch.cat(out))


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
