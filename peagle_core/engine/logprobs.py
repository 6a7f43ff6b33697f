"""Log-probabilities of emitted tokens under the target's processed distribution.

vLLM's `processed_logprobs`: the distribution the token was drawn from, softmax(logits / T) after top-k and
top-p (`target_probs`, the verify's own), so filtered-out tokens have -inf. Greedy rows (T = 0) have no
scaled distribution and use softmax(logits). Every emitted token has a target row, whether it was an
accepted draft or the step's bonus token: row `cu[j] + i` judged request j's i-th emitted token, so
speculation changes nothing here. Computed only in steps where some request asked for them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from peagle_kernels.sampling import target_probs



@dataclass
class Logprob:
    """vLLM's shape: one token's log-probability and its rank (1 = the most likely)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def emitted_logprobs(logits: torch.Tensor, sampled: torch.Tensor, cu: torch.Tensor, temperature: torch.Tensor,
                     top_k: torch.Tensor | None, top_p: torch.Tensor | None, n: int):
    """Per verified row: the emitted token's log-probability and rank, and the `n` most likely (ids, values).

    `sampled` [S, K+1] are the step's emitted tokens (padded with -1), `cu` [S+1] each request's rows."""
    N, S = logits.shape[0], sampled.shape[0]
    counts = cu[1:] - cu[:-1]
    row_req = torch.repeat_interleave(torch.arange(S, device=logits.device), counts, output_size=N)
    lp = torch.log(target_probs(logits, temperature[row_req], None if top_k is None else top_k[row_req],
                                None if top_p is None else top_p[row_req]))
    col = (torch.arange(N, device=logits.device) - cu[:-1][row_req]).clamp(max=sampled.shape[1] - 1)
    token = sampled[row_req, col].clamp(min=0)
    token_lp = lp.gather(1, token[:, None])[:, 0]
    rank = (lp > token_lp[:, None]).sum(-1) + 1
    top = lp.topk(n, dim=-1) if n else None
    return token_lp, rank, top


def host_logprobs(rows: tuple, cu: list[int], accepted: list[int], tokens: list[list[int]],
                  wants: list[int | None]) -> list[list[dict[int, Logprob]] | None]:
    """Device results -> per sampling request, one {token_id: Logprob} a emitted token (vLLM's shape: the
    emitted token, then the top ones)."""
    token_lp, rank, top = rows
    token_lp, rank = token_lp.tolist(), rank.tolist()
    top_ids, top_lp = (top.indices.tolist(), top.values.tolist()) if top is not None else ([], [])
    out: list[list[dict[int, Logprob]] | None] = []
    for j, n in enumerate(wants):
        if n is None:
            out.append(None)
            continue
        entries = []
        for i in range(accepted[j] + 1):
            r = cu[j] + i
            d = {tokens[j][i]: Logprob(token_lp[r], rank[r])}
            for k in range(n):
                d.setdefault(top_ids[r][k], Logprob(top_lp[r][k], k + 1))
            entries.append(d)
        out.append(entries)
    return out
