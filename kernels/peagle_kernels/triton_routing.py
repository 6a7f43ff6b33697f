"""Triton MoE routing: the router logits, top-k + softmax over them and the sort of the pairs by expert.

Same signature and semantics as `peagle_kernels.moe.route_ref`: logits = x @ router_w^T + router_b in x.dtype, then
the top k by value in descending order (ties: the lowest expert index first) and gates = softmax over those k
logits in fp32, stored in x.dtype.

Decode and verify sizes (up to 64 tokens, when one program can also hold the counting sort of the T*k
(token, expert) pairs: `one_launch`) take one launch, logits included: `_logits_route_kernel`. The path it
replaces took three at batch size 1 (cuBLAS's split-K GEMV and its reduce, then top-k and sort: ~9.7 us a
GPT-OSS-20B layer on an H200) to read a 184 KB weight. The logits must come from many programs: a first
version computed them inside the single routing program, which streamed the weight at ~13 GB/s (14.7 us a
layer). So the grid is (expert blocks, hidden slices): a program sums x[t, h] * w[e, h] over its slice for
every token and its BLOCK_E experts (fp32) and stores the partial sums to a scratch buffer. Then it counts
itself done on a per-device counter (`tl.atomic_add`, acq_rel, after a barrier so that every thread's
stores precede the release). The program that arrives last sees every partial sum: it resets the counter to 0
for the next launch (CUDA-graph replays included), adds the slices in a fixed order (deterministic) and the
bias, rounds once to x.dtype (as cuBLAS does: the logits have the reference's dtype, though the summation
order differs, so a logit can land one rounding step away from the reference's), and runs top-k, softmax and
sort over the whole batch. The first call on a device must run outside CUDA-graph capture (it allocates the
counter).

The MoE's norm rides in that launch too, up to NORM_ROUTE_MAX_TOKENS tokens (`norm_route_and_sort_pairs`, for
`peagle_kernels.moe.norm_and_route`): every program reads its tokens' rows of h and the residual, adds them and takes
their rms as `peagle_kernels.triton_norm` does, normalises its hidden slice and routes from that, and the first expert
block's programs store the normed rows and the new residual. A bs-1 decode step of the 20B shape lost its 24
norm launches; with one split for the sliding-window layers' attention (`peagle_kernels.triton_attention.kv_splits`)
it went from 3.21-3.24 to 2.92-2.96 ms on two of three H200s, alternating runs, and stayed within the third's
spread; the device's own work fell by ~25 us (docs/benchmarks/kernels.md).

Larger batches, or a sort too large for one program (E = 128 above 32 tokens at k = 4), take the router
linear from cuBLAS (`F.linear`, the reference's), then `_route_kernel` (BLOCK_T tokens a program, no sort).

Top-k and softmax (`_pick_and_store`, shared by both kernels): k rounds of row max + lowest-index argmax +
mask pick the experts, and a softmax over the k picked values gives the gates; the sort is `counting_sort`,
shared with `peagle_kernels.triton_moe`. No host sync anywhere: CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from peagle_kernels.dispatch import pdl_launch

# Largest counting-sort one-hot matrix (EXPERTS_PAD x PAIRS_PAD int32) kept in one program's registers.
SORT_MAX_ELEMS = 32768
# Decode and verify sizes: up to this many tokens one program holds the batch (and the one-launch path runs).
ONE_PROGRAM_TOKENS = 64
# One-launch path. Expert blocks: about LOGIT_PROGRAMS (one expert each for GPT-OSS-20B's 32, four each for
# 120B's 128), times `logit_splits` hidden slices. A program holds LOGIT_TILE fp32 products, 16 a thread at
# 16 warps. ptxas (sm_90, bf16, k = 4): 40-62 registers for E = 32 up to T = 17, 97-101 for E = 128 up to
# T = 8; at the 128-register cap (16 warps) an 8-byte spill outside the loop at E = 32, T = 64, and the sort's
# spills at E = 128, T = 32 (which the single routing program had at 8 warps too).
LOGIT_PROGRAMS = 32
LOGIT_TILE = 8192
LOGIT_WARPS = 16
LOGIT_SLICE_BYTES = 32 * 1024
LOGIT_PARTIAL_BYTES = 32 * 1024
# The norm before the router rides in the one-launch path up to this many tokens: each of its ~32-64 programs
# reads its tokens' whole rows of h and the residual for their rms (2 * T * H elements; 92 KB from L2 at T = 8,
# GPT-OSS-20B), against the norm launch and its gap it saves (2.6 + ~1.2 us a layer at bs 1 on an H200,
# docs/benchmarks/profile.md). Decode up to 8 requests and a bs-1 verify of 7 drafts are inside it.
NORM_ROUTE_MAX_TOKENS = 8


@triton.jit
def counting_sort(expert, pair, order_ptr, offsets_ptr, num_pairs, num_experts, EXPERTS_PAD: tl.constexpr):
    """A stable counting sort of pairs by expert, in one program.

    expert [P]: each entry's expert, EXPERTS_PAD (> num_experts) for padding entries, which sort nowhere;
    pair [P]: its pair id, entries in increasing pair order. Writes `order[offsets[e] + i]` = the i-th pair
    of expert e and `offsets [num_experts + 1]`. onehot[e, p] = (expert of entry p == e): its row sums are
    the counts, their exclusive cumsum the offsets, its running sum along p each entry's rank in its expert.
    """
    e = tl.arange(0, EXPERTS_PAD)
    onehot = (expert[None, :] == e[:, None]).to(tl.int32)  # [EXPERTS_PAD, P]
    counts = tl.sum(onehot, 1)
    starts = tl.cumsum(counts, 0) - counts
    rank = tl.sum(onehot * (tl.cumsum(onehot, 1) - 1), 0)
    start = tl.sum(onehot * starts[:, None], 0)
    tl.store(order_ptr + start + rank, pair, mask=expert < num_experts)
    tl.store(offsets_ptr + e, tl.where(e < num_experts, starts, num_pairs), mask=e <= num_experts)


@triton.jit
def _load_logits(logits_ptr, rows, num_tokens, num_experts, stride_lt, E_PAD: tl.constexpr,
                 CACHE: tl.constexpr):
    """fp32 logits [BLOCK_T, E_PAD] of `rows`, zeros in padding rows and columns."""
    cols = tl.arange(0, E_PAD)
    mask = (rows < num_tokens)[:, None] & (cols < num_experts)[None, :]
    return tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + cols[None, :], mask=mask, other=0.0,
                   cache_modifier=CACHE).to(tl.float32)


@triton.jit
def _pick_and_store(logits, rows, gates_ptr, experts_ptr, order_ptr, offsets_ptr, num_tokens, num_experts,
                    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                    SORT: tl.constexpr, SORT_E_PAD: tl.constexpr):
    """Top-k + softmax of fp32 logits [BLOCK_T, E_PAD] (tokens `rows`), stored as pairs t*k + j; with SORT
    (only when `rows` are every token) also the counting sort of the pairs by expert."""
    row_ok = rows < num_tokens
    cols = tl.arange(0, E_PAD)  # experts
    col_ok = cols < num_experts

    # Top-k: k rounds of (max, lowest expert holding it, take it). `free` rather than overwriting taken
    # logits with -inf, so a row whose logits are all -inf still picks k distinct experts. Padding rows
    # pick too (zeros; never stored), which keeps them free of -inf - -inf = NaN.
    slots = tl.arange(0, K_PAD)
    free = tl.broadcast_to(col_ok[None, :], (BLOCK_T, E_PAD))
    top = tl.full([BLOCK_T, K_PAD], float("-inf"), tl.float32)
    picks = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(free, logits, float("-inf")), 1)
        pick = tl.min(tl.where(free & (logits == best[:, None]), cols[None, :], E_PAD), 1)
        pick = tl.minimum(pick, num_experts - 1)  # NaN logits match nothing: keep the id in range anyway
        free = free & (cols[None, :] != pick[:, None])
        top = tl.where(slots[None, :] == j, best[:, None], top)
        picks = tl.where(slots[None, :] == j, pick[:, None], picks)

    p = tl.exp(top - tl.max(top, 1)[:, None])  # padding slots: exp(-inf) = 0
    gates = p / tl.sum(p, 1)[:, None]
    pair = rows[:, None] * TOP_K + slots[None, :]  # [BLOCK_T, K_PAD]: pair t*k + j
    pair_ok = row_ok[:, None] & (slots < TOP_K)[None, :]
    tl.store(gates_ptr + pair, gates.to(gates_ptr.dtype.element_ty), mask=pair_ok)
    tl.store(experts_ptr + pair, picks.to(experts_ptr.dtype.element_ty), mask=pair_ok)

    if SORT:
        expert = tl.where(pair_ok, picks, SORT_E_PAD)  # padding rows and slots sort nowhere
        counting_sort(tl.reshape(expert, [BLOCK_T * K_PAD]), tl.reshape(pair, [BLOCK_T * K_PAD]),
                      order_ptr, offsets_ptr, num_tokens * TOP_K, num_experts, SORT_E_PAD)


@triton.jit
def _route_kernel(logits_ptr, gates_ptr, experts_ptr, num_tokens, num_experts, stride_lt,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                  USE_PDL: tl.constexpr = False):
    """Routing of BLOCK_T tokens from precomputed logits [T, E] (batches too large for one launch; no sort)."""
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    logits = _load_logits(logits_ptr, rows, num_tokens, num_experts, stride_lt, E_PAD, "")
    _pick_and_store(logits, rows, gates_ptr, experts_ptr, gates_ptr, gates_ptr, num_tokens, num_experts,  # no sort:
                    TOP_K, K_PAD, E_PAD, BLOCK_T, False, 1)  # order/offsets unused
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


@triton.jit
def _row_rstd(h_rows, res_rows, pair_ok, hidden, eps, PAIRS: tl.constexpr, BLOCK_H: tl.constexpr):
    """1 / rms of each pair's token row of the new residual h + res (each element rounded to h's dtype first, as
    the stored `x + residual` that `peagle_kernels.norm.add_rms_norm` normalises): fp32, over the whole row."""
    hs = tl.arange(0, BLOCK_H)
    squares = tl.zeros([PAIRS], tl.float32)
    for h0 in tl.range(0, hidden, BLOCK_H):
        mask = pair_ok[:, None] & (h0 + hs < hidden)[None, :]
        s = tl.load(h_rows + (h0 + hs)[None, :], mask=mask, other=0.0).to(tl.float32)
        s += tl.load(res_rows + (h0 + hs)[None, :], mask=mask, other=0.0).to(tl.float32)
        s = s.to(h_rows.dtype.element_ty).to(tl.float32)
        squares += tl.sum(s * s, 1)
    return tl.math.rsqrt(squares / hidden + eps)


@triton.jit
def _partial_logits(x_ptr, w_ptr, partial_ptr, num_tokens, num_experts, hidden, slice_len, stride_xt, stride_we,
                    LOGIT_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr,
                    res_ptr, norm_w_ptr, normed_ptr, res_out_ptr, eps, stride_rt, stride_ot):
    """partial[s, t, e] = sum of x[t, h] * w[e, h] over the hidden slice s = program_id(1), in fp32, for every
    token t and the BLOCK_E experts e of program_id(0).

    Tile rows are the (token, expert) pairs, so x and w load as 2-D tiles in one layout (contiguous along h:
    vectorised, and no layout conversion in the loop, which a [T, E, H] broadcast product needed); a row of w
    repeats for every token and of x for every expert, reloads that hit L1. Products accumulate elementwise and
    are reduced across threads once, after the loop, so an iteration is only loads and FMAs; it is unrolled
    twice, so two chunks' loads are in flight at once.

    NORM: x_ptr holds h and res_ptr the residual of `add_rms_norm(h, residual, norm_w, eps)`, and the products
    are of its normed rows, computed here as the norm kernel computes them (every program reads its tokens'
    whole rows once for their rms: `NORM_ROUTE_MAX_TOKENS` bounds that); the programs of the first expert block
    store the normed rows and the new residual of their slice."""
    split = tl.program_id(1)
    pair = tl.arange(0, LOGIT_T * BLOCK_E)
    tok = pair // BLOCK_E
    exp = tl.program_id(0) * BLOCK_E + pair % BLOCK_E
    pair_ok = (tok < num_tokens) & (exp < num_experts)
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xt
    w_rows = w_ptr + exp.to(tl.int64)[:, None] * stride_we
    hs = tl.arange(0, BLOCK_H)
    h_start = split * slice_len
    h_end = tl.minimum(h_start + slice_len, hidden)
    if NORM:
        res_rows = res_ptr + tok.to(tl.int64)[:, None] * stride_rt
        r = _row_rstd(x_rows, res_rows, pair_ok, hidden, eps, LOGIT_T * BLOCK_E, BLOCK_H)[:, None]
        out_at = tok.to(tl.int64)[:, None] * stride_ot
        writes = (pair_ok & (exp == 0))[:, None]  # one pair a token: the first expert block's, expert 0
    acc = tl.zeros([LOGIT_T * BLOCK_E, BLOCK_H], tl.float32)
    for h0 in tl.range(h_start, h_end, BLOCK_H, loop_unroll_factor=2):
        mask = pair_ok[:, None] & (h0 + hs < h_end)[None, :]
        x = tl.load(x_rows + (h0 + hs)[None, :], mask=mask, other=0.0)
        if NORM:  # exactly the norm kernel's arithmetic (triton_norm.py)
            s = x.to(tl.float32) + tl.load(res_rows + (h0 + hs)[None, :], mask=mask, other=0.0).to(tl.float32)
            stored = s.to(res_out_ptr.dtype.element_ty)
            g = tl.load(norm_w_ptr + h0 + hs, mask=h0 + hs < h_end, other=0.0).to(tl.float32)[None, :]
            x = (g * (stored.to(tl.float32) * r)).to(normed_ptr.dtype.element_ty)
            tl.store(res_out_ptr + out_at + (h0 + hs)[None, :], stored, mask=mask & writes)
            tl.store(normed_ptr + out_at + (h0 + hs)[None, :], x, mask=mask & writes)
        w = tl.load(w_rows + (h0 + hs)[None, :], mask=mask, other=0.0)
        acc += x.to(tl.float32) * w.to(tl.float32)
    tl.store(partial_ptr + (split * num_tokens + tok) * num_experts + exp, tl.sum(acc, 1), mask=pair_ok)


@triton.jit
def _sum_partials(partial_ptr, b_ptr, rows, num_tokens, num_experts, LOGIT_DTYPE: tl.constexpr,
                  SPLITS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """fp32 logits [BLOCK_T, E_PAD] of `rows`: the SPLITS partial sums (in a fixed order: deterministic) plus
    the bias, rounded once to LOGIT_DTYPE (x.dtype, as cuBLAS rounds). Loaded .cg, from L2: other programs
    wrote them, and this SM's L1 may hold lines of the scratch buffer from an earlier launch."""
    cols = tl.arange(0, E_PAD)
    col_ok = cols < num_experts
    mask = (rows < num_tokens)[:, None] & col_ok[None, :]
    acc = tl.zeros([BLOCK_T, E_PAD], tl.float32)
    for split in tl.static_range(SPLITS):
        at = (split * num_tokens + rows)[:, None] * num_experts + cols[None, :]
        acc += tl.load(partial_ptr + at, mask=mask, other=0.0, cache_modifier=".cg")
    bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return (acc + bias[None, :]).to(LOGIT_DTYPE).to(tl.float32)


@triton.jit
def _logits_route_kernel(x_ptr, w_ptr, b_ptr, partial_ptr, counter_ptr, gates_ptr, experts_ptr, order_ptr,
                         offsets_ptr, num_tokens, num_experts, hidden, slice_len, stride_xt, stride_we,
                         TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                         SORT: tl.constexpr, SORT_E_PAD: tl.constexpr, LOGIT_T: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, SPLITS: tl.constexpr,
                         res_ptr, norm_w_ptr, normed_ptr, res_out_ptr, eps, stride_rt, stride_ot,
                         NORM: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """The one-launch path (every token fits BLOCK_T): each program sums its experts' logits over its hidden
    slice; the last one to finish completes the logits and routes (and sorts) the whole batch. With NORM the
    residual add and RMSNorm before the router ride along (`_partial_logits`)."""
    # PDL: every program waits for the previous kernel first, so also before the arrival counter's atomic
    if USE_PDL:  # (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    _partial_logits(x_ptr, w_ptr, partial_ptr, num_tokens, num_experts, hidden, slice_len, stride_xt, stride_we,
                    LOGIT_T, BLOCK_E, BLOCK_H, NORM, res_ptr, norm_w_ptr, normed_ptr, res_out_ptr, eps,
                    stride_rt, stride_ot)
    # Every thread's stores precede the barrier, the barrier precedes the release (one thread's atomic): the
    # program that acquires the final count sees every program's partial sums.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
        tl.store(counter_ptr, 0)  # the next launch counts from 0 (the kernel boundary orders it)
        rows = tl.arange(0, BLOCK_T)
        logits = _sum_partials(partial_ptr, b_ptr, rows, num_tokens, num_experts, x_ptr.dtype.element_ty,
                               SPLITS, E_PAD, BLOCK_T)
        _pick_and_store(logits, rows, gates_ptr, experts_ptr, order_ptr, offsets_ptr, num_tokens, num_experts,
                        TOP_K, K_PAD, E_PAD, BLOCK_T, SORT, SORT_E_PAD)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


# Per device, the arrival counter of `_logits_route_kernel`: 0 between launches, since the program that
# finishes a launch resets it. One per device suffices because launches on a stream run one after another
# (two streams routing at once on one device would share it; the engine runs its forwards on one stream).
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _arrival_counter(device: torch.device) -> torch.Tensor:
    counter = _COUNTERS.get(device)
    if counter is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Zeroed inside a capture, it would hold garbage for eager calls (the graph's memset runs only
            # on replay). The engine warms every graph up eagerly before capturing it.
            raise RuntimeError("route: the first Triton routing call on a device must run outside CUDA-graph "
                               "capture (warm up first)")
        counter = _COUNTERS[device] = torch.zeros(1, device=device, dtype=torch.int32)
    return counter


def route_triton(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, top_k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(gates [..., k] in x.dtype, experts [..., k] int64, by descending logit) for x [..., H]."""
    H = x.shape[-1]
    gates, experts, _ = _route(x.reshape(-1, H), router_w, router_b, top_k, sort=False)
    return gates.view(*x.shape[:-1], top_k), experts.view(*x.shape[:-1], top_k)


def route_and_sort_pairs(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, top_k: int
                         ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """`route_triton` for x [T, H], plus (order, offsets) of the pairs sorted by expert (as
    `peagle_kernels.triton_moe.sort_pairs_by_expert` returns them) when the same launch could sort them, else None."""
    return _route(x, router_w, router_b, top_k, sort=True)


def _tiles(T: int, E: int, top_k: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, E_PAD, K_PAD, SORT_E_PAD) of the routing programs."""
    # No padding rows: the one-launch path's last program runs top-k and the sort over BLOCK_T rows (at T = 1 a 16-row
    # tile made its sort's one-hot 256 x 64 at E = 128 for 4 real pairs)
    block_t = triton.next_power_of_2(T) if T <= ONE_PROGRAM_TOKENS else ONE_PROGRAM_TOKENS
    sort_e_pad = triton.next_power_of_2(E + 1)  # room for the padding sentinel
    return block_t, max(16, triton.next_power_of_2(E)), triton.next_power_of_2(top_k), sort_e_pad


def one_launch(T: int, E: int, top_k: int) -> bool:
    """Whether T tokens route in one launch, logits included (and `route_and_sort_pairs` sorts the pairs in it):
    one program holds every token and the sort's one-hot. GPT-OSS (k = 4): E = 32 up to 64 tokens, E = 128 up
    to 32."""
    block_t, _, k_pad, sort_e_pad = _tiles(T, E, top_k)
    return 0 < T <= block_t and block_t * k_pad * sort_e_pad <= SORT_MAX_ELEMS


def _route(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, top_k: int, sort: bool,
           norm: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    T, H = x.shape
    E = router_w.shape[0]
    if tuple(router_w.shape) != (E, H) or tuple(router_b.shape) != (E,):
        raise ValueError(f"route: router_w must be [E, {H}] and router_b [E], got {list(router_w.shape)} "
                         f"and {list(router_b.shape)}")
    if not 1 <= top_k <= E:
        raise ValueError(f"route: top_k={top_k} must be in [1, {E}]")
    gates = torch.empty(T, top_k, device=x.device, dtype=x.dtype)
    experts = torch.empty(T, top_k, device=x.device, dtype=torch.int64)  # torch.topk's index dtype
    if T == 0:
        return gates, experts, None

    block_t, e_pad, k_pad, sort_e_pad = _tiles(T, E, top_k)
    if not one_launch(T, E, top_k):
        logits = torch.nn.functional.linear(x, router_w, router_b)  # [T, E] in x.dtype, as in route_ref
        # 8 warps for large tiles: the rule from when this kernel also sorted at decode sizes, kept as it was
        num_warps = 8 if block_t * max(e_pad, k_pad * sort_e_pad) > 4096 else 4
        _route_kernel[(triton.cdiv(T, block_t),)](logits, gates, experts, T, E, logits.stride(0), TOP_K=top_k,
                                                  K_PAD=k_pad, E_PAD=e_pad, BLOCK_T=block_t, num_warps=num_warps,
                                                  **pdl_launch(x))
        return gates, experts, None

    sorted_pairs = None
    order = offsets = experts  # unread unless sorting
    if sort:
        order = torch.empty(T * top_k, device=x.device, dtype=torch.int32)
        offsets = torch.empty(E + 1, device=x.device, dtype=torch.int32)
        sorted_pairs = (order, offsets)
    _launch_one(x, router_w, router_b, gates, experts, order, offsets,
                dict(TOP_K=top_k, K_PAD=k_pad, E_PAD=e_pad, BLOCK_T=block_t, SORT=sort, SORT_E_PAD=sort_e_pad), norm)
    return gates, experts, sorted_pairs


def fuses_norm(h: torch.Tensor, residual: torch.Tensor | None, num_experts: int, top_k: int) -> bool:
    """Whether `add_rms_norm(h, residual)` before routing rides in the routing launch: a residual of h's shape
    and dtype (not MoE summands), and few enough tokens (`NORM_ROUTE_MAX_TOKENS`) in one launch."""
    return (residual is not None and h.dim() == 2 and residual.shape == h.shape and residual.dtype == h.dtype
            and 0 < h.shape[0] <= NORM_ROUTE_MAX_TOKENS and one_launch(h.shape[0], num_experts, top_k))


def norm_route_and_sort_pairs(h: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                              router_w: torch.Tensor, router_b: torch.Tensor, top_k: int):
    """`peagle_kernels.norm.add_rms_norm(h, residual, norm_w, eps)` -> (x, new_residual), then `route_and_sort_pairs(x,
    ...)`: returns (x, new_residual, gates, experts, sorted pairs or None). One launch where `fuses_norm` (the
    norm's own launch and its gap saved: every MoE layer of a decode or small verify step), else two."""
    E = router_w.shape[0]
    if not fuses_norm(h, residual, E, top_k):
        from peagle_kernels.norm import add_rms_norm
        x, new_residual = add_rms_norm(h, residual, norm_w, eps)
        return x, new_residual, *route_and_sort_pairs(x, router_w, router_b, top_k)
    H = h.shape[-1]
    if norm_w.shape != (H,):
        raise ValueError(f"weight must be [{H}], got {tuple(norm_w.shape)}")
    h = h if h.stride(-1) == 1 else h.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    x, new_residual = torch.empty_like(h), torch.empty_like(h)
    norm = (residual, norm_w.contiguous(), x, new_residual, float(eps))
    return x, new_residual, *_route(h, router_w, router_b, top_k, sort=True, norm=norm)


def _launch_one(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, gates: torch.Tensor,
                experts: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, meta: dict,
                norm: tuple | None = None) -> None:
    """`_logits_route_kernel` over (expert blocks, hidden slices). The products tile is LOGIT_T * BLOCK_E by
    BLOCK_H (LOGIT_T: T rounded up to a power of 2, as BLOCK_T here). `norm` = (residual, norm weight, normed out, new
    residual out, eps): x is the norm's input h and the norm rides along (`norm_route_and_sort_pairs`)."""
    T, H = x.shape
    E = router_w.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    router_w = router_w if router_w.stride(-1) == 1 else router_w.contiguous()
    router_b = router_b.contiguous()
    logit_t = triton.next_power_of_2(T)
    block_e = triton.next_power_of_2(triton.cdiv(E, LOGIT_PROGRAMS))
    splits = logit_splits(T, E, H, x.element_size())
    slice_len = triton.cdiv(triton.cdiv(H, splits), 16) * 16  # 16-aligned slices keep the loads vectorised
    splits = triton.cdiv(H, slice_len)
    block_h = min(triton.next_power_of_2(slice_len), max(16, LOGIT_TILE // (logit_t * block_e)))
    partial = torch.empty(splits, T, E, device=x.device, dtype=torch.float32)  # scratch
    res, norm_w, normed, res_out, eps = norm if norm is not None else (x, x, x, x, 0.0)  # unread without a norm
    _logits_route_kernel[(triton.cdiv(E, block_e), splits)](
        x, router_w, router_b, partial, _arrival_counter(x.device), gates, experts, order, offsets,
        T, E, H, slice_len, x.stride(0), router_w.stride(0),
        **meta, LOGIT_T=logit_t, BLOCK_E=block_e, BLOCK_H=block_h, SPLITS=splits,
        res_ptr=res, norm_w_ptr=norm_w, normed_ptr=normed, res_out_ptr=res_out, eps=eps, stride_rt=res.stride(0),
        stride_ot=normed.stride(0), NORM=norm is not None, num_warps=LOGIT_WARPS, **pdl_launch(x))


def logit_splits(T: int, E: int, H: int, elem_bytes: int) -> int:
    """Hidden slices of the one-launch path. Every expert block reads all of x, so unsplit a program would
    stream T*H elements of x (368 KB at T = 64, twice the 20B router weight): slices keep that near
    LOGIT_SLICE_BYTES, as long as the finishing program's read of the fp32 partial sums (slices*T*E*4 bytes)
    stays within LOGIT_PARTIAL_BYTES. One slice at T = 1."""
    want = triton.cdiv(T * H * elem_bytes, LOGIT_SLICE_BYTES)
    return max(1, min(want, LOGIT_PARTIAL_BYTES // (T * E * 4), triton.cdiv(H, 16)))


__all__ = ["route_triton", "route_and_sort_pairs", "norm_route_and_sort_pairs", "fuses_norm", "one_launch", "logit_splits", "counting_sort",
           "SORT_MAX_ELEMS"]
