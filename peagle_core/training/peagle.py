"""P-EAGLE training objective: COD-sampled (anchor, depth) elements, the mask, partitioned and packed passes.

Slots. A sequence of n tokens has N = n - 1 drafter slots r = 0..N-1. Slot r holds embed(token[r+1])
and fc(aux[r]) at RoPE position r and learns the target's distribution at position r+1 (the EAGLE
shift, the engine's depth 0). An element (anchor a, depth d) is what the drafter computes when it
drafts from anchor a: d = 0 is the real slot a; d >= 1 is the d-th MASK slot after it (embed(MASK),
fc(mask_hidden)) at RoPE position a + d, learning the target's distribution at a + d + 1. Its
"reference slot" is r = a + d, which must be < N.

A sample is ordered depth-major with depth 0 first (the depth-0 block is the anchors 0..n0-1 in
order). A drafter forward ("pass") packs several samples, or partitions of one, into one flat batch
under one mask; the batch runs as few passes as fit a size cap, not one per sequence.

Planning (sampling, partitioning, packing) runs on the host in NumPy: it is a few small array operations
per sequence and depth, and as torch operators each would cost a dispatch (~300 operator events a
sequence at 8 depths: a third of a step's events at batch 64). The public functions take and return
torch tensors, and the passes reach the device in one copy a step (`passes_to`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from itertools import accumulate

import numpy as np
import torch

from peagle_core.models.drafter import Drafter
from peagle_core.models.layers import ForwardMeta
from peagle_core.training.features import Features
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
    valid = np.ones(n_valid, dtype=bool) if loss_mask is None else loss_mask.to("cpu", torch.bool).numpy()
    if valid.shape != (n_valid,):
        raise ValueError(f"loss_mask has shape {tuple(valid.shape)}, expected ({n_valid},)")
    counts = cod_counts(int(valid.sum()), num_depths, ratio, ratio_min)
    # slot r's chain may continue to slot r + 1 if that slot is inside the sequence and supervised
    extends = np.append(valid[1:], False)
    refs = [np.arange(n_valid, dtype=np.int64)]  # each depth's reference slots (anchor + depth)
    for d in range(1, num_depths):
        pool = refs[-1][extends[refs[-1]]] + 1
        k = min(counts[d], len(pool))
        if k <= 0:
            break
        # torch's randperm, so a seed keeps drawing the same elements as it always has
        refs.append(np.sort(pool[torch.randperm(len(pool), generator=generator).numpy()[:k]]))
    depth = np.repeat(np.arange(len(refs), dtype=np.int64), [len(r) for r in refs])
    return torch.from_numpy(np.concatenate(refs) - depth), torch.from_numpy(depth)


# --------------------------------------------------------------------------------------------
# The attention mask
# --------------------------------------------------------------------------------------------


def peagle_mask(key: torch.Tensor, depth: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """[T, T] bool, the P-EAGLE rule for every pair of a pass's elements (in any order, a few broadcast ops):
    element (a, d) sees the depth-0 context up to its anchor a, plus its own chain (a, d' <= d).

    `key` is the element's anchor plus its unit's offset in the pass and `start` that offset: a
    depth-0 key is visible from `start` up to the query's own key, so packed units never see each
    other, and a deeper key only from its own chain (equal key)."""
    q, k = key[:, None], key[None, :]
    context = (depth[None, :] == 0) & (k <= q) & (k >= start[:, None])
    return context | ((k == q) & (depth[None, :] <= depth[:, None]))


# --------------------------------------------------------------------------------------------
# Sequence partitioning (paper Algorithm 1; NeMo's assign_cod_segments)
# --------------------------------------------------------------------------------------------


def assign_segments(anchor: torch.Tensor, depth: torch.Tensor, n_slots: int, num_segments: int) -> torch.Tensor:
    """Owner segment of each element: contiguous buckets of the slot axis (torch tensors or NumPy arrays).

    A depth-0 slot sits in the bucket of its anchor; a deeper element in the bucket of anchor + 1,
    the first slot its MASK chain occupies. A whole chain (a, 1..d) therefore shares one segment,
    and everything it attends to outside the chain is depth-0 context with anchor <= a, i.e. in
    the same or an earlier bucket: the context prefix each segment carries.
    """
    if num_segments < 1:
        raise ValueError(f"sequence partitions must be at least 1, got {num_segments}")
    bucket = anchor + (depth > 0)
    return (bucket * num_segments // n_slots).clip(max=num_segments - 1)


def segment_elements(depth: torch.Tensor, seg: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(element indices of segment s's forward, which of them it owns).

    The forward holds the depth-0 slots of segments <= s (key/value context; a contiguous prefix
    0..hi-1, so the depth-major layout survives) and the elements segment s owns. Only owned
    elements are charged a loss.
    """
    idx, owned = _segment_elements(depth.numpy(), seg.numpy(), s)
    return torch.from_numpy(idx), torch.from_numpy(owned)


def _segment_elements(depth: np.ndarray, seg: np.ndarray, s: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.flatnonzero((seg == s) | ((depth == 0) & (seg <= s)))
    return idx, seg[idx] == s


# --------------------------------------------------------------------------------------------
# Passes: what one drafter forward holds
# --------------------------------------------------------------------------------------------


@dataclass
class Pass:
    """The elements of one drafter forward: whole units (a sequence, or one of its partitions) back
    to back, then ordered depth-major across the pass (every depth-0 element first, then depth 1, ...),
    so the forward over depths <= j is a prefix and a depth's keys come out sorted.

    Planned on the host, where the sampler's tensors are, and moved to the device once (`passes_to`):
    nothing in the pass loop waits for the device.
    """

    row: torch.Tensor     # [T] feature row of the element's anchor slot (sequence start + anchor)
    pos: torch.Tensor     # [T] RoPE position, anchor + depth
    depth: torch.Tensor   # [T]
    key: torch.Tensor     # [T] unit offset + anchor (unique per unit and anchor), and
    start: torch.Tensor   # [T] the unit offset: what `peagle_mask` needs
    parent: torch.Tensor  # [T - n0] element index of (anchor, depth - 1), for the elements past depth 0
    charged: torch.Tensor  # [C] elements that carry a loss (ascending, so depth-major too)
    target_rows: torch.Tensor     # [U] distinct feature rows whose target distribution the pass reads
    charged_target: torch.Tensor  # [C] index into target_rows of each charged element's row + depth + 1
    feed_target: torch.Tensor     # [T - n0] index into target_rows of row + depth: (anchor, depth - 1)'s target
    ends: list[int]          # elements up to and including each depth
    charged_ends: list[int]  # charged elements up to and including each depth

    def __len__(self) -> int:
        return self.row.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The index tensors by field name (what moves to the device)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if torch.is_tensor(getattr(self, f.name))}

    def charged_counts(self) -> list[int]:
        """Charged elements at each depth."""
        return [b - a for a, b in zip([0, *self.charged_ends], self.charged_ends)]


def passes_to(passes: list[Pass], device: torch.device | str) -> list[Pass]:
    """Every pass's index tensors in one host-to-device copy, from pinned memory on CUDA.

    A copy from pageable memory waits for the device, and a step has ten index tensors a pass: packed
    into one buffer they cost one transfer a step that the host does not wait for. (A CPU takes the same
    route, which costs it one concatenation.)"""
    device = torch.device(device)
    parts = [t for p in passes for t in p.tensors().values()]  # all int64
    if not parts:
        return passes
    flat = torch.cat(parts)
    if device.type == "cuda":
        flat = flat.pin_memory()
    pieces = iter(flat.to(device, non_blocking=True).split([t.numel() for t in parts]))
    return [replace(p, **{name: next(pieces) for name in p.tensors()}) for p in passes]


def plan_passes(samples: list[tuple[torch.Tensor, torch.Tensor]], valid: list[torch.Tensor], starts: list[int],
                num_segments: int = 1, max_elements: int = 1) -> list[Pass]:
    """Split each sequence's sample into its partitions, then pack them into passes of at most
    `max_elements` elements (a larger unit gets a pass of its own). Units that charge nothing are dropped.

    samples: (anchor, depth) per sequence from `cod_sample`; valid: its `slot_valid`; starts: its first
    feature row. A pass packs several units because on a GPU one forward over T elements costs about
    as much as one over T/4; dense attention still grows with T^2, hence the cap.
    """
    units = []
    for (anchor, depth), ok, row0 in zip(samples, valid, starts):
        anchor, depth, ok = anchor.numpy(), depth.numpy(), ok.numpy()
        sup = ok[anchor + depth]
        if num_segments == 1:  # the sequence is its only unit: no partition bookkeeping
            if sup.any():
                units.append((row0, anchor, depth, sup))
            continue
        seg = assign_segments(anchor, depth, len(ok), num_segments)
        for s in range(num_segments):
            idx, owned = _segment_elements(depth, seg, s)
            if (owned & sup[idx]).any():
                units.append((row0, anchor[idx], depth[idx], owned & sup[idx]))
    passes, group, size = [], [], 0
    for unit in units:
        if group and size + len(unit[1]) > max_elements:
            passes.append(build_pass(group))
            group, size = [], 0
        group.append(unit)
        size += len(unit[1])
    return passes + ([build_pass(group)] if group else [])


def build_pass(units: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]) -> Pass:
    """One pass from its units, each (first feature row of its sequence, anchor, depth, charged) as NumPy arrays."""
    row0, anchors, depths, charged = zip(*units)
    spans = [int(a.max()) + 1 for a in anchors]  # each unit's keys get a range of their own
    offsets = list(accumulate(spans[:-1], initial=0))
    # depth-major across the pass; a stable sort of small ints is NumPy's radix sort, linear in the pass size
    order = np.argsort(np.concatenate(depths).astype(np.int16), kind="stable")
    anchor, depth = np.concatenate(anchors)[order], np.concatenate(depths)[order]
    row = np.concatenate([r + a for r, a in zip(row0, anchors)])[order]
    start = np.repeat(np.array(offsets, dtype=np.int64), [len(a) for a in anchors])[order]
    charged = np.flatnonzero(np.concatenate(charged)[order])
    key, n0, total = start + anchor, int((depth == 0).sum()), sum(spans)
    code = depth * total + key  # ascending: depth-major, keys sorted within a depth
    parent = np.searchsorted(code, code[n0:] - total)
    rows, inverse = unique_rows(np.concatenate([(row + depth + 1)[charged], (row + depth)[n0:]]))
    ends = np.bincount(depth).cumsum()
    charged_ends = np.bincount(depth[charged], minlength=len(ends)).cumsum()
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    return Pass(t(row), t(anchor + depth), t(depth), t(key), t(start), t(parent), t(charged), t(rows),
                t(inverse[: len(charged)]), t(inverse[len(charged):]), ends.tolist(), charged_ends.tolist())


def unique_rows(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(values, return_inverse=True)` for feature rows (non-negative, below the batch's token count)
    by a presence table instead of a sort: linear in the pass size plus the batch's token count."""
    seen = np.zeros(int(values.max()) + 1 if len(values) else 0, dtype=bool)
    seen[values] = True
    return np.flatnonzero(seen), (np.cumsum(seen) - 1)[values]


# --------------------------------------------------------------------------------------------
# The objective
# --------------------------------------------------------------------------------------------


def forward_elements(drafter: Drafter, ids: torch.Tensor, hidden: torch.Tensor, p: Pass
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter outputs (normed, pre-norm) of the pass's first len(ids) elements (a depth-major prefix)."""
    E = ids.shape[0]
    # query_start_loc stays on the host: the masked path never reads it, and a device copy would sync
    meta = ForwardMeta(positions=p.pos[:E], query_start_loc=torch.tensor([0, E]),
                       attn_mask=peagle_mask(p.key[:E], p.depth[:E], p.start[:E]))
    return drafter(ids, hidden, meta)


def real_inputs(drafter: Drafter, feats: Features, p: Pass) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, hidden) of the depth-0 elements: embed(token at anchor + 1), fc(aux at anchor)."""
    rows = p.row[: p.ends[0]]
    return feats.input_ids[rows + 1], drafter.combine(feats.aux[rows].to(drafter.fc.weight.dtype))


def peagle_forward(drafter: Drafter, feats: Features, p: Pass, mask_token_id: int) -> torch.Tensor:
    """Normed drafter outputs [T, H] of the pass in one masked forward, inputs as the engine builds them."""
    ids, real = real_inputs(drafter, feats, p)
    n_deep = len(p) - p.ends[0]
    ids = torch.cat([ids, ids.new_full((n_deep,), mask_token_id)])
    shared = drafter.shared_hidden().to(real.dtype).expand(n_deep, -1)
    return forward_elements(drafter, ids, torch.cat([real, shared]), p)[0]


def peagle_pass_loss(drafter: Drafter, feats: Features, p: Pass, mask_token_id: int, stats: DepthStats,
                     denom: int, kind: LossKind = "kl") -> torch.Tensor:
    """The pass's share of the batch loss: its charged elements' losses over `denom`, the batch's count
    of charged elements. Pass losses therefore sum to the batch loss, and so do their gradients."""
    stats.max_attn_tokens = max(stats.max_attn_tokens, len(p))
    normed = peagle_forward(drafter, feats, p, mask_token_id)
    logp, top = feats.target_dist(p.target_rows)
    c, t = p.charged, p.charged_target
    return charge(stats, p.depth[c], p.charged_counts(), drafter.compute_logits(normed[c]), logp[t], top[t], kind,
                  denom)
