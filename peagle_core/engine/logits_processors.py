"""allowed_token_ids, bad_words, penalties, min_tokens, logit_bias and min_p on the verify step's logits, exact
under speculation.

Row i of a request that verifies k drafts judges its output position n + i (n tokens emitted so far); the
row is reached only if drafts d1..di were accepted, so its history is the output so far plus d1..di. Each
row is processed with that history, as decoding one token at a time would process that position, and
rows never reached are discarded with their tokens. Applied before rejection sampling, so acceptance, the
residual distribution and log-probabilities all use the processed distribution: the output is distributed
exactly as non-speculative decoding with the same settings (greedy: the same tokens).

The order is vLLM's: allowed_token_ids and bad_words, logit_bias and min_tokens, then the penalties
(repetition on prompt and output, presence and frequency on the output), then min_p on the temperature-scaled
distribution (top-k and top-p follow inside the sampler). Steps where no request uses any of them skip all this.
"""
from __future__ import annotations

import math

import torch

from peagle_core.engine.types import SamplingParams


def needs_processing(p: SamplingParams) -> bool:
    return bool(p.logit_bias or p.min_tokens or p.presence_penalty or p.frequency_penalty
                or p.repetition_penalty != 1.0 or p.min_p or p.allowed_token_ids is not None or p.bad_words)


def bad_words_ids(tokenizer, words: list[str] | None) -> list[list[int]]:
    """vLLM's: each word's token ids as written (leading spaces dropped) and with one leading space, the latter
    where it is a different word of as many tokens (a byte-level vocabulary folds the space into the first)."""
    out = []
    for word in words or []:
        bare = tokenizer.encode(word.lstrip(), allow_special=False)
        spaced = tokenizer.encode(" " + word.lstrip(), allow_special=False)
        out.append(bare)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return out


def process_logits(logits: torch.Tensor, requests: list, cu: list[int], stop_ids: set[int]) -> torch.Tensor:
    """`requests[j]` (a Request) owns rows cu[j]..cu[j+1]-1 of `logits` [N, V]; its verified drafts are
    `drafts[:rows - 1]`. Returns processed logits (a new tensor where anything changed)."""
    logits = logits.clone()
    V, dev = logits.shape[1], logits.device
    for j, req in enumerate(requests):
        p = req.params
        if not needs_processing(p):
            continue
        r0, r1 = cu[j], cu[j + 1]
        rows = logits[r0:r1]  # a view: processed in place
        k, n = r1 - r0 - 1, req.num_output
        drafts = req.drafts[:k]
        if p.allowed_token_ids is not None:
            banned = torch.ones(V, dtype=torch.bool, device=dev)
            banned[torch.tensor(p.allowed_token_ids, device=dev)] = False
            rows.masked_fill_(banned, float("-inf"))
        if req.bad_words_ids:
            _ban_bad_words(rows, req, drafts)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=dev)
            rows[:, ids] += torch.tensor(list(p.logit_bias.values()), device=dev, dtype=rows.dtype)
        if p.min_tokens and n < p.min_tokens:
            stops = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else stop_ids))
            early = min(k + 1, p.min_tokens - n)  # rows judging output positions below min_tokens
            if stops:
                rows[:early, torch.tensor(stops, device=dev)] = float("-inf")
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            counts = _history_counts(req.output_ids, drafts, V, dev)  # [k + 1, V]
            if p.repetition_penalty != 1.0:
                seen = (counts > 0) | (torch.bincount(torch.tensor(req.prompt_token_ids, device=dev), minlength=V)
                                       > 0)[None, :]
                r = p.repetition_penalty
                rows.copy_(torch.where(seen, torch.where(rows > 0, rows / r, rows * r), rows))
            rows -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(rows.dtype)
        if p.min_p and p.temperature > 0:
            # p_i >= min_p * p_max  <=>  logit_i >= max logit + T * ln(min_p)
            floor = rows.max(dim=-1, keepdim=True).values + p.temperature * math.log(p.min_p)
            rows.masked_fill_(rows < floor, float("-inf"))
    return logits


def _ban_bad_words(rows: torch.Tensor, req, drafts: list[int]) -> None:
    """Row i (output so far plus drafts[:i]) bans a bad word's last token where the output ends in its others."""
    longest = max(len(w) for w in req.bad_words_ids) - 1
    tail = req.token_ids[max(req.num_prompt, len(req.token_ids) - longest):] + drafts  # the output's end, drafted on
    base = len(tail) - len(drafts)  # row 0's history ends here
    for word in req.bad_words_ids:
        *head, last = word
        for i in range(rows.shape[0]):
            end = base + i
            if end >= len(head) and tail[end - len(head):end] == head:
                rows[i, last] = float("-inf")


def _history_counts(output: list[int], drafts: list[int], V: int, dev) -> torch.Tensor:
    """Row i: how often each token occurs in output + drafts[:i]."""
    base = torch.bincount(torch.tensor(output, dtype=torch.long, device=dev), minlength=V).float() \
        if output else torch.zeros(V, device=dev)
    counts = base.repeat(len(drafts) + 1, 1)
    for i, d in enumerate(drafts):
        counts[i + 1:, d] += 1
    return counts
