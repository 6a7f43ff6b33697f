"""Prefix-affinity routing: a request goes to the replica that served its longest prefix, while that one is not
overloaded, so its prefix cache (peagle_core/engine/block_manager.py) holds the prompt's start.

Named in a serve config as Ray Serve's request router (docs/cluster.md, "Routing"):

    deployment:
      request_router_config:
        request_router_class: peagle_cluster.prefix_router:PrefixAffinityRouter
        request_router_kwargs: {imbalanced_threshold: 4}

Ray's own `PrefixCacheAffinityRouter` (ray.serve.llm) reads prompts from Ray Serve LLM's request objects; our
replicas receive plain dicts (`router.engine_request`), so this router reads those. The prompt's text is cut into
`chunk_chars`-character chunks, each named by a digest chained over the chunks before it (as the engine names
its KV blocks); the router remembers which replica last got each chunk. A request prefers the replica that got
its longest run of leading chunks. It falls back to Serve's default, the less loaded of two random replicas, when
nothing matches, when the preferred replica's queue is `imbalanced_threshold` requests longer than the shortest,
and whenever the preferred replica is full (Serve then tries the next rank).
"""
from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica


def prompt_text(request: Any) -> str:
    """The text a replica will tokenize, in order: chat messages or the completion prompt."""
    if not isinstance(request, dict):
        return ""
    if "messages" in request:
        return "".join(f"<{m.get('role', '')}>{m.get('content', '')}" for m in request["messages"])
    prompt = request.get("prompt", "")
    return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))


def chunk_digests(text: str, chunk_chars: int) -> list[bytes]:
    """Chained digests of the text's whole chunks: equal digests mean equal text up to the chunk's end."""
    out, parent = [], b""
    for i in range(0, len(text) - chunk_chars + 1, chunk_chars):
        parent = hashlib.blake2b(parent + text[i:i + chunk_chars].encode(), digest_size=16).digest()
        out.append(parent)
    return out


class PrefixTable:
    """Which replica last received each prefix chunk; least recently used chunks forgotten past `capacity`."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.owner: OrderedDict[bytes, ReplicaID] = OrderedDict()

    def longest(self, digests: list[bytes], allowed: set[ReplicaID]) -> ReplicaID | None:
        """The replica holding the longest run of leading chunks, among `allowed`."""
        best = None
        for d in digests:
            owner = self.owner.get(d)
            if owner is None:
                break
            if owner in allowed:
                best = owner
        return best

    def record(self, digests: list[bytes], replica: ReplicaID) -> None:
        for d in digests:
            self.owner[d] = replica
            self.owner.move_to_end(d)
        while len(self.owner) > self.capacity:
            self.owner.popitem(last=False)

    def forget(self, replica: ReplicaID) -> None:
        for d in [d for d, r in self.owner.items() if r == replica]:
            del self.owner[d]


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router with prefix affinity (module docstring). No FIFO mixin: Serve hands the chosen
    replica to the request it was chosen for, not to the oldest one waiting."""

    def initialize_state(self, imbalanced_threshold: int = 4, chunk_chars: int = 64,
                         max_chunks: int = 200_000) -> None:
        if imbalanced_threshold < 1 or chunk_chars < 1 or max_chunks < 1:
            raise ValueError("PrefixAffinityRouter: imbalanced_threshold, chunk_chars and max_chunks must be >= 1")
        self.imbalanced_threshold, self.chunk_chars = imbalanced_threshold, chunk_chars
        self.table = PrefixTable(max_chunks)
        self.num_affine = self.num_fallback = 0  # requests routed by prefix / by load (tests, debugging)

    def _digests(self, pending: PendingRequest | None) -> list[bytes]:
        if pending is None or not pending.args:
            return []
        cached = getattr(pending, "_peagle_digests", None)
        if cached is None:  # routing may retry with backoff: cut the prompt once
            cached = chunk_digests(prompt_text(pending.args[0]), self.chunk_chars)
            pending._peagle_digests = cached
        return cached

    def _load(self, replica: RunningReplica) -> int:
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        preferred = self.table.longest(self._digests(pending_request), set(by_id))
        others = [r for r in candidate_replicas if r.replica_id != preferred]
        fallback = random.sample(others, min(2, len(others)))  # Serve's default: the less loaded of two
        if preferred is not None:
            least = min(self._load(r) for r in candidate_replicas)
            if self._load(by_id[preferred]) - least < self.imbalanced_threshold:
                self.num_affine += 1
                return [[by_id[preferred]]] + ([fallback] if fallback else [])
        self.num_fallback += 1
        return [fallback]  # not empty: without a preferred replica every candidate is in it, with one a less loaded

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        self.table.record(self._digests(pending_request), replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id)
