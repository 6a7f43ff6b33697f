"""A small named actor where engine replicas post their statistics and routers read them.

A deployment handle reaches *one* replica per call, so "how busy is every replica, what is the
acceptance length overall" needs a meeting point. Each replica posts its engine stats every
metrics interval (fire and forget); `GET /v1/stats` on the router reads all of them. A replica
whose actor has died is dropped at the next read (the board asks each reporter's actor whether it
is alive); entries not refreshed for `ttl_s` (a replica wedged or scaled away) are dropped too.

The router creates the actor (`get_if_exists`) detached, so it outlives a router that crashes and
keeps its entries; if it is lost anyway, the next router creates it again and replicas refill it
within one interval.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

SPEC_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@ray.remote(num_cpus=0, max_restarts=-1)
class StatsBoard:
    def __init__(self, ttl_s: float = 30.0):
        self.ttl_s = ttl_s
        self.entries: dict[str, tuple[float, dict[str, Any]]] = {}
        self.actors: dict[str, Any] = {}  # replica id -> its actor handle, to tell a dead one at once

    def report(self, replica_id: str, stats: dict[str, Any] | None, actor: Any = None) -> None:
        if stats is None:
            self.entries.pop(replica_id, None)
            self.actors.pop(replica_id, None)
        else:
            self.entries[replica_id] = (time.monotonic(), stats)
            if actor is not None:
                self.actors[replica_id] = actor

    async def snapshot(self) -> dict[str, Any]:
        await self._drop_dead()
        now = time.monotonic()
        self.entries = {k: v for k, v in self.entries.items() if now - v[0] <= self.ttl_s}
        replicas = [dict(s, replica_id=k, age_s=round(now - t, 3)) for k, (t, s) in sorted(self.entries.items())]
        return aggregate(replicas)

    async def _drop_dead(self, timeout_s: float = 1.0) -> None:
        """Ray fails a call to a dead actor at once; a live but busy one may just be slow, and one Ray calls
        unavailable (restarting, or unreachable for now) may come back: both are kept, the TTL decides."""
        async def alive(actor) -> bool:
            try:
                await asyncio.wait_for(actor.__ray_ready__.remote(), timeout_s)
            except ray.exceptions.ActorDiedError:
                return False
            except Exception:  # slow, or unavailable for now
                pass
            return True

        ids = list(self.actors)
        for rid, ok in zip(ids, await asyncio.gather(*(alive(self.actors[r]) for r in ids))):
            if not ok:
                self.report(rid, None)


def aggregate(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """Cluster totals first (so a reader that takes the first counters it finds gets the totals)."""
    spec = {k: sum(int((r.get("engine") or {}).get("spec", {}).get(k, 0)) for r in replicas) for k in SPEC_KEYS}
    per_pos: list[int] = []
    for r in replicas:
        for i, v in enumerate((r.get("engine") or {}).get("spec", {}).get("num_accepted_tokens_per_pos") or []):
            per_pos += [0] * (i + 1 - len(per_pos))
            per_pos[i] += int(v)
    spec["num_accepted_tokens_per_pos"] = per_pos
    spec["acceptance_length"] = 1.0 + spec["num_accepted_tokens"] / spec["num_drafts"] if spec["num_drafts"] else 1.0
    spec["draft_acceptance_rate"] = (spec["num_accepted_tokens"] / spec["num_draft_tokens"]
                                     if spec["num_draft_tokens"] else 0.0)

    def total(key: str, where: str = "engine") -> int:
        return sum(int((r.get(where) or {}).get(key) or 0) if where else int(r.get(key) or 0) for r in replicas)

    return {"spec": spec,
            "num_replicas": len(replicas),
            "num_running": total("num_running"), "num_waiting": total("num_waiting"),
            "kv_blocks_used": total("kv_blocks_used"), "kv_blocks_total": total("kv_blocks_total"),
            "ongoing": sum(int(r.get("ongoing") or 0) for r in replicas),
            "replicas": replicas}


BOARD_NAME = "peagle-stats"


def board_name(app: str) -> str:
    return f"{BOARD_NAME}-{app}"


def get_or_create_board(app: str):
    return StatsBoard.options(name=board_name(app), namespace="serve", get_if_exists=True,
                              lifetime="detached").remote()


def lookup_board(app: str):
    """The board if it exists (replicas never create it: the router owns its lifetime)."""
    try:
        return ray.get_actor(board_name(app), namespace="serve")
    except ValueError:
        return None
