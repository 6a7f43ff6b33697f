"""Continuous batching with chunked prefill, speculative lookahead and recompute preemption.

Each step every running request gets its uncomputed tokens (a prefill chunk, or the last sampled
token) plus up to k drafts to verify, under a token budget. Blocks cover everything the step may
write: target K/V for the verified positions and drafter K/V for the K-1 MASK slots that follow.
When blocks run out the newest running request is preempted: its blocks are freed and it is
recomputed later from its tokens (never dropped). A request joining the batch first maps its longest
cached prefix (`BlockManager.map_prefix`) and computes only the rest.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from peagle_core.engine.block_manager import BlockManager
from peagle_core.engine.request import Request, Status


@dataclass(frozen=True)
class Scheduled:
    req: Request
    num_new: int      # tokens from req.token_ids[num_computed:] fed this step
    num_drafts: int   # drafts appended after them for verification

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's known tokens (and so samples)."""
        return self.req.num_computed + self.num_new == len(self.req.token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_new + self.num_drafts


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 draft_lookahead: int):
        self.blocks = blocks
        self.max_num_seqs, self.budget, self.max_model_len = max_num_seqs, max_num_batched_tokens, max_model_len
        self.lookahead = draft_lookahead  # K-1 drafter MASK slots written past the last verified position
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_queries = self.prefix_hits = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason, req.finished_time = Status.FINISHED, reason, time.monotonic()
        if reason != "error":  # a failed step may have left its K/V half written
            self.blocks.commit(req)
        self.blocks.release(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def prompt_backlog(self) -> int:
        """Prompt tokens waiting to be fed: the running requests' still in their prompts (a decoding request has
        one token uncomputed, its last sampled one; a prompt's last token is one too, before anything is sampled)
        and those of the waiting requests that may join now."""
        joining = itertools.islice(self.waiting, max(self.max_num_seqs - len(self.running), 0))
        return (sum(n for r in self.running if (n := r.num_uncomputed) > 1 or (n and not r.num_output))
                + sum(r.num_uncomputed for r in joining))

    def schedule(self, k: int) -> list[Scheduled]:
        budget, out = self.budget, []
        for req in list(self.running):
            if req.status is not Status.RUNNING or budget <= 0:
                continue  # preempted while making room for an older request, or out of budget this step
            item = self._plan(req, k, budget)
            while not self.blocks.grow(req.block_table, self._slots(item)):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    item = None
                    break
            if item is not None:
                out.append(item)
                budget -= item.num_tokens
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            cached = self.blocks.map_prefix(req)
            item = self._plan(req, k, budget)
            if not self.blocks.grow(req.block_table, self._slots(item)):
                self.blocks.release(req)  # its cached prefix goes back to the LRU list, still cached
                req.num_computed = 0
                break
            self.waiting.popleft()
            if self.blocks.enable_caching:  # vLLM's prefix-cache queries and hits, in tokens
                self.prefix_queries += len(req.token_ids)
                self.prefix_hits += cached
            if req.num_cached_tokens is None:
                req.num_cached_tokens = cached
            req.status = Status.RUNNING
            req.first_scheduled_time = req.first_scheduled_time or time.monotonic()
            self.running.append(req)
            out.append(item)
            budget -= item.num_tokens
        return out

    def _plan(self, req: Request, k: int, budget: int) -> Scheduled:
        num_new = min(req.num_uncomputed, budget)
        drafts = 0
        if num_new == req.num_uncomputed and req.drafts:
            room = self.max_model_len - len(req.token_ids)  # verified positions must stay inside the model
            # Not capped by the tokens the request has left: what it accepts past max_tokens is dropped on
            # append, and it finishes in the same step either way. Capped, a request's last step verified fewer
            # drafts than the rest, the step was no longer a uniform decode and ran eagerly: on the tiny pair's
            # H200 steps at 8 requests 15-18% of the steps, each ~1.9x a graphed one.
            drafts = max(0, min(k, len(req.drafts), room, budget - num_new))
        return Scheduled(req, num_new, drafts)

    def _slots(self, item: Scheduled) -> int:
        end = item.req.num_computed + item.num_tokens + self.lookahead
        return min(end, self.max_model_len)

    def _preempt(self, req: Request) -> None:
        self.blocks.commit(req)  # what it computed stays cached: its recompute may map it back
        self.blocks.release(req)
        req.num_computed, req.drafts, req.behind, req.status = 0, [], None, Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)
