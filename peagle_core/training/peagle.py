"""P-EAGLE training objective: COD-sampled (anchor, depth) elements, the amortized mask, partitioned passes.

Slots. A sequence of n tokens has N = n - 1 drafter slots r = 0..N-1. Slot r holds embed(token[r+1])
and fc(aux[r]) at RoPE position r and learns the target's distribution at position r+1 (the EAGLE
shift, the engine's depth 0). An element (anchor a, depth d) is what the drafter computes when it
drafts from anchor a: d = 0 is the real slot a; d >= 1 is the d-th MASK slot after it (embed(MASK),
fc(mask_hidden)) at RoPE position a + d, learning the target's distribution at a + d + 1. Its
"reference slot" is r = a + d, which must be < N.

Elements are ordered depth-major with depth 0 first, so the depth-0 block is always the anchors
0..n0-1 in order. Every function here relies on that layout.
"""
from __future__ import annotations

import torch

from peagle_core.models.drafter import Drafter
from peagle_core.models.layers import ForwardMeta
from peagle_core.training.features import SequenceFeatures
from peagle_core.training.losses import DepthStats, LossKind, charge


# --------------------------------------------------------------------------------------------
# COD sampling
# --------------------------------------------------------------------------------------------


def cod_counts(n_valid: int, num_depths: int, ratio: float, ratio_min: float) -> list[int]:
    """Documented COD sizes before the pool cap: n_valid at depth 0, int((n_valid - d) * max(r^d, r_min)) after."""
    return [n_valid] + [max(int((n_valid - d) * max(ratio ** d, ratio_min)), 0) for d in range(1, num_depths)]


def cod_sample(n_valid: int, num_depths: int, ratio: float, ratio_min: float, generator: torch.Generator,
               loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Conditional-drop (COD) sampling of the n_valid x K element grid -> (anchor [E], depth [E]), depth-major.

    Depth 0 keeps all n_valid slots (they are also every deeper element's context). Depth d >= 1
    keeps int((m - d) * max(ratio^d, ratio_min)) elements, m = number of supervised slots, drawn
    without replacement from the previous depth's reference slots shifted by +1 (so every kept
    element's whole chain (a, 0..d-1) is kept), restricted to supervised slots inside the sequence.
    When that pool is smaller than the count (possible once r_min holds the ratio flat) the whole
    pool is kept. Anchors are sorted within each depth.
    """
    if n_valid < 1:
        raise ValueError(f"COD sampling needs at least one slot, got n_valid={n_valid}")
    if not 0 < ratio <= 1 or not 0 <= ratio_min <= 1:
        raise ValueError(f"COD ratios must lie in (0, 1] and [0, 1]; got ratio={ratio}, ratio_min={ratio_min}")
    valid = torch.ones(n_valid, dtype=torch.bool) if loss_mask is None else loss_mask.to("cpu", torch.bool)
    if valid.shape != (n_valid,):
        raise ValueError(f"loss_mask has shape {tuple(valid.shape)}, expected ({n_valid},)")
    m = int(valid.sum())
    ref = torch.arange(n_valid)
    anchors, depths = [ref], [torch.zeros(n_valid, dtype=torch.long)]
    counts = cod_counts(m, num_depths, ratio, ratio_min)
    for d in range(1, num_depths):
        pool = ref + 1
        pool = pool[pool < n_valid]
        pool = pool[valid[pool]]
        k = min(counts[d], pool.numel())
        if k <= 0:
            break
        ref = pool[torch.randperm(pool.numel(), generator=generator)[:k]].sort().values
        anchors.append(ref - d)
        depths.append(torch.full((k,), d, dtype=torch.long))
    return torch.cat(anchors), torch.cat(depths)


# --------------------------------------------------------------------------------------------
# The attention mask
# --------------------------------------------------------------------------------------------


def allowed(q_anchor: int, q_depth: int, kv_anchor: int, kv_depth: int) -> bool:
    """The P-EAGLE rule: depth-0 context up to the anchor, plus the element's own chain."""
    return (kv_depth == 0 and q_anchor >= kv_anchor) or (q_anchor == kv_anchor and q_depth >= kv_depth)


class PeagleMask:
    """The amortized mask: one causal table over slots, built once at the maximum length.

    The rule splits by the key's depth. Keys at depth 0 are allowed iff q_anchor >= kv_anchor: that
    is row q_anchor of a causal (lower-triangular) table over slots, whatever the query's depth. Keys
    at depth >= 1 are allowed only inside the query's own chain (same anchor, smaller or equal depth).
    So with the depth-major layout (depth-0 slots 0..n0-1 first):
      [:n0, :n0]  = tri[:n0, :n0]             a top-left view of the precomputed table
      [n0:, :n0]  = tri[anchor[n0:], :n0]     a row gather of the same table (COD picks the rows)
      [:n0, n0:]  = False                     depth 0 never sees deeper elements
      [n0:, n0:]  = chain equality            block-structured, O(E_deep^2) compares
    Nothing is built per element pair in Python, and nothing bigger than one [L, L] bool table is
    kept (the full (L*K)^2 grid would be 64x larger at K=8); the per-example cost is the [T, T]
    copy that dense attention needs anyway. A longer sequence than planned grows the table once.
    """

    def __init__(self, max_slots: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.tri = torch.ones(max_slots, max_slots, dtype=torch.bool, device=self.device).tril_()

    def __call__(self, anchor: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        T = anchor.shape[0]
        n0 = int((depth == 0).sum())
        if not (torch.equal(depth[:n0], torch.zeros_like(depth[:n0]))
                and torch.equal(anchor[:n0], torch.arange(n0, device=anchor.device))):
            raise ValueError("elements must be depth-major with the depth-0 slots 0..n0-1 first")
        if n0 > self.tri.shape[0]:
            self.tri = torch.ones(2 * n0, 2 * n0, dtype=torch.bool, device=self.device).tril_()
        mask = torch.zeros(T, T, dtype=torch.bool, device=self.device)
        mask[:n0, :n0] = self.tri[:n0, :n0]
        if T > n0:
            qa, qd = anchor[n0:].to(self.device), depth[n0:].to(self.device)
            mask[n0:, :n0] = self.tri[qa, :n0]
            mask[n0:, n0:] = (qa[:, None] == qa[None, :]) & (qd[:, None] >= qd[None, :])
        return mask


# --------------------------------------------------------------------------------------------
# Sequence partitioning (paper Algorithm 1; NeMo's assign_cod_segments)
# --------------------------------------------------------------------------------------------


def assign_segments(anchor: torch.Tensor, depth: torch.Tensor, n_slots: int, num_segments: int) -> torch.Tensor:
    """Owner segment of each element: contiguous buckets of the slot axis.

    A depth-0 slot sits in the bucket of its anchor; a deeper element in the bucket of anchor + 1,
    the first slot its MASK chain occupies. A whole chain (a, 1..d) therefore shares one segment,
    and everything it attends to outside the chain is depth-0 context with anchor <= a, i.e. in
    the same or an earlier bucket: the context prefix each segment carries.
    """
    if num_segments < 1:
        raise ValueError(f"sequence partitions must be at least 1, got {num_segments}")
    bucket = anchor + (depth > 0).long()
    return (bucket * num_segments // n_slots).clamp_(max=num_segments - 1)


def segment_elements(depth: torch.Tensor, seg: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(element indices of segment s's forward, which of them it owns).

    The forward holds the depth-0 slots of segments <= s (key/value context; a contiguous prefix
    0..hi-1, so the depth-major layout survives) and the elements segment s owns. Only owned
    elements are charged a loss.
    """
    idx = torch.nonzero((seg == s) | ((depth == 0) & (seg <= s))).squeeze(-1)
    return idx, seg[idx] == s


# --------------------------------------------------------------------------------------------
# The objective
# --------------------------------------------------------------------------------------------


def peagle_inputs(drafter: Drafter, feats: SequenceFeatures, anchor: torch.Tensor, depth: torch.Tensor,
                  mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, hidden [T, H], RoPE positions) of depth-major elements, as the engine builds them."""
    n0 = int((depth == 0).sum())
    ids = torch.full_like(anchor, mask_token_id)
    ids[:n0] = feats.input_ids[anchor[:n0] + 1]
    real = drafter.combine(feats.aux[anchor[:n0]].to(drafter.fc.weight.dtype))
    shared = drafter.shared_hidden().to(real.dtype).expand(anchor.shape[0] - n0, -1)
    return ids, torch.cat([real, shared]), anchor + depth


def forward_elements(drafter: Drafter, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                     mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    meta = ForwardMeta(positions=positions, query_start_loc=torch.tensor([0, ids.shape[0]], device=ids.device),
                       attn_mask=mask)
    return drafter(ids, hidden, meta)


def peagle_forward(drafter: Drafter, feats: SequenceFeatures, anchor: torch.Tensor, depth: torch.Tensor,
                   masks: PeagleMask, mask_token_id: int) -> torch.Tensor:
    """Normed drafter outputs [T, H] of depth-major elements in one masked pass."""
    ids, hidden, pos = peagle_inputs(drafter, feats, anchor, depth, mask_token_id)
    normed, _ = forward_elements(drafter, ids, hidden, pos, masks(anchor, depth))
    return normed


def peagle_sequence_backward(drafter: Drafter, feats: SequenceFeatures, anchor: torch.Tensor, depth: torch.Tensor,
                             masks: PeagleMask, mask_token_id: int, num_depths: int, denom: int,
                             num_segments: int = 1, kind: LossKind = "kl") -> tuple[float, DepthStats]:
    """Forward + backward of one sequence's elements in `num_segments` dependency-preserving passes.

    Each pass charges only the elements it owns and divides by `denom` (the batch's total count of
    charged elements), so the pass losses sum to the single-pass loss and the accumulated gradients
    equal the single-pass gradient. Peak attention memory follows the largest pass.
    Returns (this sequence's share of the loss, per-depth stats).
    """
    device = feats.input_ids.device
    anchor, depth = anchor.to(device), depth.to(device)
    n_slots = feats.n - 1
    sup = feats.slot_valid()[anchor + depth]
    seg = assign_segments(anchor, depth, n_slots, num_segments)
    stats, total = DepthStats(num_depths), 0.0
    for s in range(num_segments):
        idx, owned = segment_elements(depth, seg, s)
        charged = owned & sup[idx]
        if not bool(charged.any()):
            continue
        a, d = anchor[idx], depth[idx]
        normed = peagle_forward(drafter, feats, a, d, masks, mask_token_id)
        stats.max_attn_tokens = max(stats.max_attn_tokens, idx.numel())
        draft_logits = drafter.compute_logits(normed[charged])
        target_logits = feats.target_logits((a + d)[charged] + 1)
        loss = charge(stats, d[charged], draft_logits, target_logits, kind, denom)
        loss.backward()
        total += loss.item()
    return total, stats


def supervised_count(feats: SequenceFeatures, anchor: torch.Tensor, depth: torch.Tensor) -> int:
    """How many elements of a sample carry a loss (the normaliser's share of this sequence)."""
    return int(feats.slot_valid()[(anchor + depth).to(feats.input_ids.device)].sum())
