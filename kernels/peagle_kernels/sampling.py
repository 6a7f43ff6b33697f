"""Verification: greedy acceptance and speculative rejection sampling, in one op.

Rows of request b are `cu_rows[b] .. cu_rows[b+1]-1`: one target distribution per verified
position, the last one for the bonus token. `draft_ids[row]` is the draft that row must judge
(-1 on each request's last row). Drafts are proposed greedily, so q is one-hot: draft d at row i
is accepted with probability p_i(d); on rejection the token comes from the residual
max(0, p_i - onehot(d)) (p_i with d removed), which keeps the output distribution exactly p.
Randomness is passed in (`uniforms` [N], `exp_noise` [N, V]) so that seeded requests repeat and
the Triton kernel and this reference agree: sampling from weights w is argmax(w / E), E ~ Exp(1).
"""
from __future__ import annotations

import torch

from peagle_kernels.dispatch import use_triton


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None) -> torch.Tensor:
    """softmax(logits / T) restricted to top-k then top-p (per row); rows with T == 0 are left as softmax(logits).

    top_k = top_p = None means no row filters (the caller knows it on the host): the same result as
    top_k = 0, top_p = 1 without the [N, V] sort.
    """
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    x = logits.float() / t[:, None]
    if top_k is None and top_p is None:
        return torch.softmax(x, dim=-1)
    top_k = torch.zeros_like(t, dtype=torch.long) if top_k is None else top_k
    top_p = torch.ones_like(t) if top_p is None else top_p
    V = x.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    sorted_x, order = x.sort(dim=-1, descending=True)
    kth = sorted_x.gather(1, (k - 1)[:, None])
    x = x.masked_fill(x < kth, float("-inf"))
    probs_sorted = torch.softmax(sorted_x.masked_fill(sorted_x < kth, float("-inf")), dim=-1)
    before = probs_sorted.cumsum(-1) - probs_sorted      # mass strictly before each sorted token
    # top_p >= 1 keeps everything: fp32 cumsums over a large vocabulary reach 1.0 before the tail.
    drop_sorted = (before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop_sorted[:, 0] = False                             # always keep the most likely token
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return torch.softmax(x.masked_fill(drop, float("-inf")), dim=-1)


def rejection_sample(logits: torch.Tensor, draft_ids: torch.Tensor, cu_rows: torch.Tensor, temperature: torch.Tensor,
                     top_k: torch.Tensor | None, top_p: torch.Tensor | None, uniforms: torch.Tensor | None,
                     exp_noise: torch.Tensor | None, *, max_rows: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [B, max_rows] padded with -1, num_accepted [B]); request b emits tokens[b, :num_accepted+1].

    `max_rows` (>= the most rows of any request; the engine knows it: verify depth + 1) fixes the output
    width without a device-to-host sync; left as None it is read from `cu_rows` (one sync).
    `top_k = top_p = None`: no request filters (skips the top-k/top-p sort, see `target_probs`).
    """
    if use_triton(logits):
        from peagle_kernels.triton_sampling import rejection_sample_triton
        return rejection_sample_triton(logits, draft_ids, cu_rows, temperature, top_k, top_p, uniforms, exp_noise,
                                       max_rows=max_rows)
    return rejection_sample_ref(logits, draft_ids, cu_rows, temperature, top_k, top_p, uniforms, exp_noise,
                                max_rows=max_rows)


def rejection_sample_ref(logits, draft_ids, cu_rows, temperature, top_k, top_p, uniforms, exp_noise, *,
                         max_rows: int | None = None):
    B, N = cu_rows.shape[0] - 1, logits.shape[0]
    row_req = torch.repeat_interleave(torch.arange(B, device=logits.device), cu_rows[1:] - cu_rows[:-1], output_size=N)
    greedy = temperature[row_req] == 0
    argmax = logits.argmax(-1)
    has_draft = draft_ids >= 0
    d = draft_ids.clamp(min=0)
    if bool(greedy.all()):
        accept = has_draft & (argmax == d)
        recovered = argmax
    else:
        p = target_probs(logits, temperature[row_req], None if top_k is None else top_k[row_req],
                         None if top_p is None else top_p[row_req])
        accept_s = has_draft & (uniforms < p.gather(1, d[:, None])[:, 0])
        residual = p.scatter(1, d[:, None], torch.where(has_draft, 0.0, p.gather(1, d[:, None])[:, 0])[:, None])
        sampled = (residual / exp_noise).argmax(-1)
        accept = torch.where(greedy, has_draft & (argmax == d), accept_s)
        recovered = torch.where(greedy, argmax, sampled)
    return _accepted_prefix(accept, recovered, d, cu_rows, max_rows)


def greedy_verify(argmax: torch.Tensor, draft_ids: torch.Tensor, cu_rows: torch.Tensor, *,
                  max_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample` for an all-greedy batch from each row's argmax token [N] alone (no logits: a
    vocab-parallel LM head gathers only per-rank maxima). Same outputs as `rejection_sample` on logits whose
    argmax is `argmax`."""
    d = draft_ids.clamp(min=0)
    return _accepted_prefix((draft_ids >= 0) & (argmax == d), argmax, d, cu_rows, max_rows)


def _accepted_prefix(accept: torch.Tensor, recovered: torch.Tensor, d: torch.Tensor, cu_rows: torch.Tensor,
                     max_rows: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row verdicts -> (tokens [B, max_rows] padded with -1, num_accepted [B]): request b accepts the longest
    prefix of its drafts that passed, then emits the recovered token of the row that stopped it."""
    B, N, dev = cu_rows.shape[0] - 1, accept.shape[0], accept.device
    n_rows = cu_rows[1:] - cu_rows[:-1]
    if max_rows is None:
        max_rows = int(n_rows.max()) if B else 0
    col = torch.arange(max_rows, device=dev)
    row = (cu_rows[:-1, None] + col[None, :]).clamp(max=max(N - 1, 0))
    inside = col[None, :] < n_rows[:, None] - 1            # rows that judge a draft
    passed = inside & accept[row]
    num_accepted = passed.long().cumprod(dim=1).sum(dim=1)
    tokens = torch.where(col[None, :] < num_accepted[:, None], d[row], torch.full_like(row, -1))
    at = row.gather(1, num_accepted.clamp(max=max(max_rows - 1, 0))[:, None])
    tokens.scatter_(1, num_accepted[:, None].clamp(max=max(max_rows - 1, 0)), recovered[at])
    return tokens, num_accepted
