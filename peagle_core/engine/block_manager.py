"""Paged KV memory: fixed-size blocks handed to requests through per-request block tables, with prefix caching.

Target and drafter have their own cache tensors but share one block table per request (the same
block id indexes both), so one allocation covers both models' K/V at a position.

Prefix caching (vLLM's automatic prefix caching): a full block whose K/V is final in BOTH caches is
registered under a digest of (its parent block's digest, its tokens, the first token of the next block).
Blocks are reference-counted; one nobody uses stays cached on an LRU list and is evicted only when a
request needs memory. A new request maps the longest run of cached blocks its tokens name.

Why the next block's first token is in the digest, and when a block may be registered (`commit`):
EAGLE-style drafters are shifted, the drafter's entry at position p is computed from the target's hidden
state at p (tokens 0..p) and the token at p + 1 (`prepare_draft_inputs`). So the drafter K/V of a block
covering positions [a, a + B) is determined by tokens 0..a + B, one past the block. The target's entry at
p is determined by tokens 0..p. A request's K/V is final for positions below
    valid = min(num_computed, behind[0] if behind else num_computed, len(token_ids) - 1):
  * target: every step writes positions >= num_computed only. Its rejected drafts wrote positions at or
    past the new num_computed (it advances by the accepted drafts only) and are overwritten later.
  * drafter: a step writes the accepted tokens' entries (positions < new num_computed, each with its real
    next token: an accepted draft equals it, the last one gets the bonus token) and then P-EAGLE's MASK
    slots / EAGLE-3's extra passes at positions >= the new num_computed, never below. A step that skipped
    the drafter (k = 0) leaves [behind[0], num_computed) unwritten until `_catch_up`, hence `behind[0]`.
  * len(token_ids) - 1: the token after the last valid position must be known (and tokens accepted past
    max_tokens are dropped, so num_computed may exceed what `token_ids` holds at the end).
Blocks entirely below `valid` are never written again by their request, and blocks mapped from the cache
lie below the mapping request's num_computed, so it never writes them either. So a registered block holds
accepted-token K/V for both models, and MASK slots, rejected drafts and a failed step's writes (the engine
never commits after an error) never become cacheable. Preemption commits what was valid, then drops the
request's blocks and its digests; it starts over from a lookup.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from peagle_core.engine.request import Request


def block_digest(parent: bytes, tokens: list[int]) -> bytes:
    """A block's identity: its parent's digest and its tokens (plus the next one). A cryptographic hash, so no
    client can craft a prompt that maps another's K/V."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        self.num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # uncached and unused; pop() hands out low ids first
        self.refs = [0] * num_blocks
        self.cached: dict[bytes, int] = {}            # digest -> block holding that prefix's K/V
        self.digest_of: dict[int, bytes] = {}         # the reverse, for eviction
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody uses, least recently freed first
        self.num_evictions = 0  # cached blocks reused for other content

    @property
    def num_free(self) -> int:
        """Blocks a request can get: never used, or cached but unused (evicted on demand)."""
        return len(self.free) + len(self.lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def blocks_needed(self, table: list[int], num_slots: int) -> int:
        return max(0, -(-num_slots // self.block_size) - len(table))

    def grow(self, table: list[int], num_slots: int) -> bool:
        """Extend `table` in place to cover `num_slots` positions; False (and no change) if memory is short."""
        need = self.blocks_needed(table, num_slots)
        if need > self.num_free:
            return False
        for _ in range(need):
            block = self.free.pop() if self.free else self._evict()
            self.refs[block] = 1
            table.append(block)
        return True

    def _evict(self) -> int:
        block, _ = self.lru.popitem(last=False)
        del self.cached[self.digest_of.pop(block)]
        self.num_evictions += 1
        return block

    def release(self, req: Request) -> None:
        """Drop the request's hold on its blocks; cached ones stay cached. Tail blocks first, so the LRU evicts
        a prefix's end before its start."""
        for block in reversed(req.block_table):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.digest_of:
                    self.lru[block] = None
                else:
                    self.free.append(block)
        req.block_table.clear()
        req.block_digests.clear()

    def map_prefix(self, req: Request) -> int:
        """Give a request with no blocks the longest cached prefix of its tokens, leaving at least one token to
        compute (the step needs its logits). Returns the tokens mapped; sets `num_computed` to it."""
        assert not req.block_table and req.num_computed == 0
        if not self.enable_caching:
            return 0
        toks, B = req.token_ids, self.block_size
        parent = b""
        for b in range((len(toks) - 1) // B):  # a block needs the token after it: (b + 1) * B < len(toks)
            digest = block_digest(parent, toks[b * B:(b + 1) * B + 1])
            block = self.cached.get(digest)
            if block is None:
                break
            if self.refs[block] == 0:
                del self.lru[block]
            self.refs[block] += 1
            req.block_table.append(block)
            req.block_digests.append(digest)
            parent = digest
        req.num_computed = len(req.block_table) * B
        return req.num_computed

    def commit(self, req: Request) -> None:
        """Register the request's full blocks whose K/V is final in both caches (see the module docstring)."""
        if not self.enable_caching:
            return
        B, toks = self.block_size, req.token_ids
        valid = min(req.num_computed, len(toks) - 1)
        if req.behind is not None:
            valid = min(valid, req.behind[0])
        for b in range(len(req.block_digests), valid // B):
            parent = req.block_digests[-1] if req.block_digests else b""
            digest = block_digest(parent, toks[b * B:(b + 1) * B + 1])
            req.block_digests.append(digest)
            block = req.block_table[b]
            if digest not in self.cached:  # else another request computed the same prefix first: keep theirs
                self.cached[digest] = block
                self.digest_of[block] = digest
