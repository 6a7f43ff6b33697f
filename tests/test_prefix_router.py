"""Prefix-affinity routing (peagle_cluster.prefix_router): the policy on stand-in replicas, without Ray."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from peagle_cluster.prefix_router import PrefixAffinityRouter, chunk_digests, prompt_text

SYSTEM = "You are a helpful assistant who answers questions about Python in one sentence. " * 3


def chat(*turns: str) -> dict:
    roles = ["system"] + ["user", "assistant"] * len(turns)
    return {"kind": "chat", "messages": [{"role": r, "content": c} for r, c in zip(roles, (SYSTEM,) + turns)]}


class Loads(dict):
    def get(self, key, default=None):  # the queue-length cache's interface
        return super().get(key, default)


def router(num_replicas: int = 3, threshold: int = 4):
    r = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # the policy only: Serve's plumbing is not needed here
    r.initialize_state(imbalanced_threshold=threshold, chunk_chars=32)
    r._replica_queue_len_cache = Loads()
    replicas = [SimpleNamespace(replica_id=f"r{i}") for i in range(num_replicas)]
    return r, replicas


def route(r, replicas, request: dict) -> str:
    """What Serve does: take the first rank (the less loaded of it), then tell the router."""
    pending = SimpleNamespace(args=[request])
    ranks = asyncio.run(r.choose_replicas(replicas, pending))
    chosen = min(ranks[0], key=lambda x: r._replica_queue_len_cache.get(x.replica_id) or 0)
    r.on_request_routed(pending, chosen.replica_id, None)
    return chosen.replica_id


def test_digests_name_prefixes():
    a, b = chunk_digests("x" * 100, 32), chunk_digests("x" * 64 + "y" * 36, 32)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert prompt_text(chat("hi")).startswith("<system>" + SYSTEM)
    assert prompt_text({"prompt": [1, 2, 3]}) == "1 2 3" and prompt_text(None) == ""


def test_a_conversation_returns_to_its_replica_while_it_is_not_overloaded():
    r, replicas = router()
    first = {i: route(r, replicas, chat(f"question {i} " * 10)) for i in range(6)}
    for i in range(6):  # every later turn carries the history: it goes where the history went
        assert route(r, replicas, chat(f"question {i} " * 10, "an answer", "and then?")) == first[i]
    # the preferred replica far busier than the least loaded one: load wins
    r._replica_queue_len_cache[first[0]] = 10
    assert route(r, replicas, chat("question 0 " * 10, "an answer", "more?")) != first[0]
    assert r.num_affine >= 6


def test_unmatched_prompts_spread_by_load_and_a_dead_replica_is_forgotten():
    r, replicas = router(num_replicas=2)
    r._replica_queue_len_cache.update(r0=3, r1=0)
    assert route(r, replicas, {"prompt": "something new entirely " * 4}) == "r1"
    assert route(r, replicas, {"prompt": "something else again " * 4}) == "r1"
    r.table.forget("r1")  # what `on_replica_actor_died` does besides Serve's own bookkeeping
    assert not r.table.owner  # both prompts went to r1


def test_bad_kwargs_are_refused():
    r = PrefixAffinityRouter.__new__(PrefixAffinityRouter)
    with pytest.raises(ValueError, match="imbalanced_threshold"):
        r.initialize_state(imbalanced_threshold=0)


def test_ray_serve_routes_each_conversation_back_to_one_replica():
    """The router on Serve's real `request_router_config` hook: two replicas that answer with their id after a pause,
    eight conversations in flight at once; every turn of a conversation (its history growing) reaches the replica
    its first turn reached. (Serve's default spreads each round of eight by load instead.)"""
    ray = pytest.importorskip("ray")
    from ray import serve

    @serve.deployment(num_replicas=2, max_ongoing_requests=16, ray_actor_options={"num_cpus": 0.1},
                      request_router_config={"request_router_class": PrefixAffinityRouter,
                                             "request_router_kwargs": {"imbalanced_threshold": 100}})
    class Echo:
        async def __call__(self, request: dict) -> str:
            await asyncio.sleep(0.2)  # so that the round's requests overlap
            return serve.get_replica_context().replica_id.unique_id

    def round_of(turn: int) -> list[str]:
        history = lambda i: (f"question {i} " * 10,) + ("an answer", "and then?") * turn
        responses = [handle.remote(chat(*history(i))) for i in range(8)]  # all sent before any is awaited
        return [r.result() for r in responses]

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        handle = serve.run(Echo.bind(), name="prefix-router-test", route_prefix=None)
        first = round_of(0)
        assert len(set(first)) == 2  # spread by load while nothing matches
        for turn in (1, 2, 3):
            assert round_of(turn) == first, turn
    finally:
        serve.shutdown()
        ray.shutdown()
