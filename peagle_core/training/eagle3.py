"""EAGLE-3 objective for the autoregressive baseline drafter: the "training-time test".

At inference EAGLE-3 drafts step by step: step 0 is the real slot (embed(token[a+1]), fc(aux[a])) at
position a; step j >= 1 sits at position a + j with embed(previous draft) and the drafter's own
PRE-NORM output of step j - 1 as its hidden state, attending to the depth-0 context up to a and to
its earlier steps. That is exactly the (anchor, depth) element grid and mask of P-EAGLE, with the
MASK inputs replaced by fed-back ones; so the same COD sampler, passes and mask serve both heads.

Training unrolls the steps: forward j runs over depth j's elements only, attending to the keys and
values that forwards 0..j-1 computed for the shallower elements (kept with their autograd graph; an
element's outputs never depend on deeper elements, so recomputing them would give the same values
at about three times the work). Depth j's inputs come from forward j-1's outputs (gradients flow
through the fed-back hidden state), and forward j charges depth j's loss. The fed-back token is, by
default, the target's greedy token at that place: a draft only matters while every earlier draft was
accepted, i.e. equal to it.
`feed="draft"` feeds the drafter's own argmax instead.
"""
from __future__ import annotations

from typing import Iterator, Literal

import torch

from peagle_core.models.drafter import Drafter
from peagle_core.models.layers import ForwardMeta
from peagle_core.training.features import Features
from peagle_core.training.losses import DepthStats, LossKind, charge
from peagle_core.training.peagle import Pass, peagle_mask, real_inputs

Feed = Literal["target", "draft"]


def eagle3_unroll(drafter: Drafter, feats: Features, p: Pass, feed: Feed = "target",
                  target_top: torch.Tensor | None = None) -> Iterator[tuple[int, slice, torch.Tensor]]:
    """Yield (depth j, element slice of depth j, normed drafter outputs of depth j's elements) step by step.

    `target_top`: the target's argmax at `p.target_rows` (the fed-back tokens with feed="target").
    The caller applies the LM head only where it charges a loss (not on unsupervised slots)."""
    if feed not in ("target", "draft"):
        raise ValueError(f"unknown EAGLE-3 feed {feed!r} (expected 'target' or 'draft')")
    if feed == "target" and target_top is None:
        target_top = feats.target_dist(p.target_rows)[1]
    ends, n0 = p.ends, p.ends[0]
    ids, hidden = real_inputs(drafter, feats, p)
    kv_prefix: dict = {}  # each attention layer's keys/values of the depths done so far
    mask = peagle_mask(p.key, p.depth, p.start)  # once; step j reads depth j's rows over the prefix
    for j in range(len(ends)):
        E, lo = ends[j], (ends[j - 1] if j else 0)
        # query_start_loc stays on the host: the masked path never reads it, and a device copy would sync
        meta = ForwardMeta(positions=p.pos[lo:E], query_start_loc=torch.tensor([0, E - lo]),
                           attn_mask=mask[lo:E, :E], kv_prefix=kv_prefix)
        normed, prenorm = drafter(ids, hidden, meta)  # depth j's elements
        yield j, slice(lo, E), normed
        if j + 1 == len(ends):
            break
        # inputs of depth j+1: element (a, j+1) continues its parent (a, j), which depth j just computed
        nxt = slice(E - n0, ends[j + 1] - n0)  # depth j+1 among the elements past depth 0
        parent = p.parent[nxt] - lo  # among depth j's elements
        if feed == "target":
            tok = target_top[p.feed_target[nxt]]  # the token (a, j) should have drafted
        else:
            with torch.no_grad():
                tok = drafter.compute_logits(normed[parent]).argmax(-1)
        ids, hidden = tok, prenorm[parent].to(hidden.dtype)


def eagle3_pass_loss(drafter: Drafter, feats: Features, p: Pass, stats: DepthStats, denom: int,
                     kind: LossKind = "kl", feed: Feed = "target") -> torch.Tensor:
    """The pass's share of the batch loss (over `denom`, the batch's count of charged elements),
    summed over its unrolled steps so that one backward covers the whole unroll. The LM head and the
    loss run once over every step's charged outputs (one set of ops a pass, not one a step)."""
    stats.max_attn_tokens = max(stats.max_attn_tokens, len(p))
    logp, top = feats.target_dist(p.target_rows)
    charged = []  # normed outputs of each depth's charged elements: depth-major, like p.charged
    for j, new, normed in eagle3_unroll(drafter, feats, p, feed, top):
        cs = slice(p.charged_ends[j - 1] if j else 0, p.charged_ends[j])  # depth j's charged elements
        charged.append(normed[p.charged[cs] - new.start])
    c, t = p.charged, p.charged_target
    return charge(stats, p.depth[c], p.charged_counts(), drafter.compute_logits(torch.cat(charged)), logp[t], top[t],
                  kind, denom)
