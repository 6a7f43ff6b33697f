"""EAGLE-3 objective for the autoregressive baseline drafter: the "training-time test".

At inference EAGLE-3 drafts step by step: step 0 is the real slot (embed(token[a+1]), fc(aux[a])) at
position a; step j >= 1 sits at position a + j with embed(previous draft) and the drafter's own
PRE-NORM output of step j - 1 as its hidden state, attending to the depth-0 context up to a and to
its earlier steps. That is exactly the (anchor, depth) element grid and mask of P-EAGLE, with the
MASK inputs replaced by fed-back ones; so the same COD sampler and `PeagleMask` serve both heads.

Training unrolls the steps: forward j runs over all elements of depth <= j (earlier depths are
recomputed; their outputs do not depend on deeper elements, so they come out the same), builds
depth j's inputs from forward j-1's outputs (gradients flow through the fed-back hidden state),
and charges depth j's loss. The fed-back token is, by default, the target's greedy token at that
place: a draft only matters while every earlier draft was accepted, i.e. equal to it.
`feed="draft"` feeds the drafter's own argmax instead.
"""
from __future__ import annotations

from typing import Iterator, Literal

import torch

from peagle_core.models.drafter import Drafter
from peagle_core.training.features import SequenceFeatures
from peagle_core.training.losses import DepthStats, LossKind, charge
from peagle_core.training.peagle import PeagleMask, forward_elements

Feed = Literal["target", "draft"]


def eagle3_unroll(drafter: Drafter, feats: SequenceFeatures, anchor: torch.Tensor, depth: torch.Tensor,
                  masks: PeagleMask, feed: Feed = "target") -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield (depth j, element slice of depth j, draft logits of depth j's elements) step by step."""
    if feed not in ("target", "draft"):
        raise ValueError(f"unknown EAGLE-3 feed {feed!r} (expected 'target' or 'draft')")
    n_depths = int(depth.max()) + 1
    ends = torch.bincount(depth, minlength=n_depths).cumsum(0).tolist()
    n0 = ends[0]
    ids = feats.input_ids[anchor[:n0] + 1]
    hidden = drafter.combine(feats.aux[anchor[:n0]].to(drafter.fc.weight.dtype))
    for j in range(n_depths):
        E, lo = ends[j], (ends[j - 1] if j else 0)
        a, d = anchor[:E], depth[:E]
        normed, prenorm = forward_elements(drafter, ids, hidden, a + d, masks(a, d))
        new = slice(lo, E)
        draft_logits = drafter.compute_logits(normed[new])
        yield j, new, draft_logits
        if j + 1 == n_depths:
            break
        # inputs of depth j+1: element (a, j+1) continues (a, j), found by anchor in depth j's sorted block
        nxt = slice(E, ends[j + 1])
        parent = lo + torch.searchsorted(anchor[new], anchor[nxt])
        if feed == "target":
            tok = feats.target_logits(anchor[nxt] + j + 1).argmax(-1)  # the token (a, j) should have drafted
        else:
            tok = draft_logits.argmax(-1)[parent - lo]
        ids = torch.cat([ids, tok])
        hidden = torch.cat([hidden, prenorm[parent].to(hidden.dtype)])


def eagle3_sequence_backward(drafter: Drafter, feats: SequenceFeatures, anchor: torch.Tensor, depth: torch.Tensor,
                             masks: PeagleMask, num_depths: int, denom: int, kind: LossKind = "kl",
                             feed: Feed = "target") -> tuple[float, DepthStats]:
    """Unrolled forward over the depths of one sequence, one backward; returns (loss share, stats)."""
    device = feats.input_ids.device
    anchor, depth = anchor.to(device), depth.to(device)
    sup = feats.slot_valid()[anchor + depth]
    stats = DepthStats(num_depths)
    total: torch.Tensor | float = 0.0
    for j, new, draft_logits in eagle3_unroll(drafter, feats, anchor, depth, masks, feed):
        stats.max_attn_tokens = max(stats.max_attn_tokens, new.stop)
        charged = sup[new]
        if bool(charged.any()):
            target_logits = feats.target_logits((anchor + depth)[new][charged] + 1)
            total = total + charge(stats, depth[new][charged], draft_logits[charged], target_logits, kind, denom)
    if isinstance(total, torch.Tensor):
        total.backward()
        return total.item(), stats
    return 0.0, stats
