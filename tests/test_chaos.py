"""Chaos under load: configs/tiny.yaml's application on 2 CPUs, an engine replica killed, then the router.

Serve starts with tiny.yaml's `controller_options` and nothing in the environment, as `serve run` would.

A steady load of streaming and non-streaming completions runs throughout. Each kill may fail only
the requests in flight at that moment (or sent in the instant before Serve learns of the death),
each with a clean answer: an OpenAI error envelope with `Retry-After`, or for a stream an SSE error
event followed by `data: [DONE]`. No request hangs; `/health` answers within 10 s of the router
kill; `/v1/stats` drops the killed replica at once and survives the router; KV blocks return to 0.
"""
from __future__ import annotations

import copy
import json
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
HANG_S = 30          # a request taking longer than this counts as hung
HEALTH_BOUND_S = 10  # /health answers within this after the router dies
GRACE_S = 2.0        # a request sent this soon after a kill may still reach the dead actor
USERS = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TINY = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())


def _args() -> dict:
    """tiny.yaml's args as shipped (resources, api_key_env), with two fixed engine replicas."""
    args = copy.deepcopy(TINY["applications"][0]["args"])
    dep = args["deployment"]
    dep.pop("autoscaling_config")
    dep.update(num_replicas=2, health_check_period_s=2, graceful_shutdown_timeout_s=5)
    args["metrics_interval_s"] = 0.5
    return args


@pytest.fixture(scope="module")
def cluster():
    from ray import serve

    from peagle_cluster import failover
    from peagle_cluster.app import build_app

    saved = {k: os.environ.get(k) for k in (failover.CALLBACK_ENV, "PEAGLE_API_KEY")}
    for k in saved:  # the middleware must come from tiny.yaml's controller_options alone, as with `serve run`
        os.environ.pop(k, None)
    port = _free_port()
    try:
        ray.init(num_cpus=2, include_dashboard=False, _metrics_export_port=_free_port(), logging_level="WARNING")
        serve.start(http_options={"host": "127.0.0.1", "port": port}, controller_options=TINY["controller_options"])
        serve.run(build_app(_args()), name="peagle", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


# --------------------------------------------------------------------------------------------
# Load: every request is recorded with its times and how it ended
# --------------------------------------------------------------------------------------------

class Load:
    def __init__(self, url: str):
        self.url, self.stop, self.results, self.lock = url, threading.Event(), [], threading.Lock()
        self.threads = [threading.Thread(target=self._user, args=(i,), daemon=True) for i in range(USERS)]

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(HANG_S + 5)
        assert not any(t.is_alive() for t in self.threads), "a load thread hung"

    def _user(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=HANG_S) as c:
            n = 0
            while not self.stop.is_set():
                stream = (i + n) % 2 == 0
                body = {"prompt": f"user {i} says {n}", "max_tokens": 12, "ignore_eos": True, "stream": stream}
                t0 = time.monotonic()
                try:
                    outcome = _one(c, body)
                except Exception as e:  # a body the client cannot parse: recorded, not a dead load thread
                    outcome = {"ok": False, "clean": False, "why": f"unparsable: {e!r}"}
                with self.lock:
                    self.results.append({"start": t0, "end": time.monotonic(), "stream": stream, **outcome})
                n += 1


def _one(c: httpx.Client, body: dict) -> dict:
    """One request -> {"ok": bool, "clean": bool, "why": str}: a failure is clean when it is an envelope
    with Retry-After (status 503) or, once a stream started, an SSE error event then [DONE]."""
    try:
        with c.stream("POST", "/v1/completions", json=body) as r:
            text = r.read().decode()
            if r.status_code != 200:
                try:
                    err = json.loads(text)["error"]
                except Exception:
                    return {"ok": False, "clean": False, "why": f"{r.status_code} not an envelope: {text[:120]!r}"}
                clean = set(err) == {"message", "type", "param", "code"} and r.status_code == 503 \
                    and "retry-after" in r.headers
                return {"ok": False, "clean": clean, "why": f"{r.status_code} {err.get('code')}"}
            if not body["stream"]:
                ok = json.loads(text)["usage"]["completion_tokens"] == body["max_tokens"]
                return {"ok": ok, "clean": ok, "why": "200" if ok else f"short body {text[:120]!r}"}
            events = [b[len("data: "):] for b in text.strip("\n").split("\n\n")]
            if events[-1] != "[DONE]":
                return {"ok": False, "clean": False, "why": f"stream cut: {text[-120:]!r}"}
            chunks = [json.loads(e) for e in events[:-1]]
            errors = [c["error"] for c in chunks if "error" in c]
            if errors:  # exactly one, right before [DONE]
                return {"ok": False, "clean": len(errors) == 1 and "error" in chunks[-1],
                        "why": f"sse {errors[0].get('code')}"}
            ok = chunks[-1]["choices"][0]["finish_reason"] == "length"
            return {"ok": ok, "clean": ok, "why": "200 sse" if ok else f"stream without an end {text[-120:]!r}"}
    except httpx.TimeoutException:
        return {"ok": False, "clean": False, "why": "hung"}
    except httpx.HTTPError as e:
        return {"ok": False, "clean": False, "why": f"connection: {e!r}"}


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

def _replica_actor(deployment: str):
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and f"#{deployment}#" in a["name"]]
    assert names, f"no {deployment} replica"
    return ray.get_actor(sorted(names)[0], namespace="serve"), sorted(names)[0]


def _stats(url: str) -> dict | None:
    try:
        r = httpx.get(url + "/v1/stats", timeout=5)
        return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _health(url: str) -> int | str:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError as e:
        return type(e).__name__


def _two_replicas_reporting(url: str):
    s = _stats(url)
    return s if s and s["num_replicas"] == 2 and all(r["age_s"] < 2 for r in s["replicas"]) else None


# --------------------------------------------------------------------------------------------
# The test
# --------------------------------------------------------------------------------------------

def test_kill_an_engine_replica_then_the_router_under_load(cluster):
    url = cluster
    _wait(lambda: _two_replicas_reporting(url), 60, "both replicas on the stats board")
    from peagle_cluster.stats_board import board_name

    board = ray.get_actor(board_name("peagle"), namespace="serve")
    with Load(url) as load:
        time.sleep(4)
        # 1. An engine replica dies: its in-flight requests fail cleanly; the board drops it at once.
        engine, engine_name = _replica_actor("EngineReplica")
        dead_id = engine_name.rsplit("#", 1)[-1]
        t_engine = time.monotonic()
        ray.kill(engine, no_restart=True)
        s = _wait(lambda: (st := _stats(url)) and dead_id not in {r["replica_id"] for r in st["replicas"]} and st,
                  3, "the stats board to drop the dead replica")
        stats_drop_s = time.monotonic() - t_engine
        assert s["num_replicas"] <= 2
        _wait(lambda: _two_replicas_reporting(url), 60, "the engine replica's replacement")
        time.sleep(2)
        # 2. The router dies: in-flight requests get 503 envelopes / SSE errors; /health is back in seconds.
        router, _ = _replica_actor("OpenAIRouter")
        t_router = time.monotonic()
        ray.kill(router, no_restart=True)
        probes = []
        _wait(lambda: probes.append(_health(url)) or probes[-1] == 200, HEALTH_BOUND_S,
              "/health after the router kill")
        recovery_s = time.monotonic() - t_router
        time.sleep(3)
    results = load.results
    print(f"{len(results)} requests, {sum(not r['ok'] for r in results)} failed; the stats board dropped the "
          f"dead replica in {stats_drop_s:.1f}s; /health back {recovery_s:.1f}s after the router kill ({probes})")

    hung = [r for r in results if r["why"] == "hung" or r["end"] - r["start"] >= HANG_S]
    assert not hung, hung
    unclean = [r for r in results if not r["clean"]]
    assert not unclean, unclean
    failed = [r for r in results if not r["ok"]]
    for r in failed:  # in flight at a kill (or sent just before Serve learned of it)
        assert any(r["start"] <= t + GRACE_S and r["end"] >= t for t in (t_engine, t_router)), (r, t_engine, t_router)
    assert len(failed) < len(results) / 2 and sum(r["ok"] for r in results if r["start"] > t_router + GRACE_S) > 0
    # The stats board outlived the router, and every KV block is free at idle.
    ray.get(board.__ray_ready__.remote(), timeout=5)  # raises if the board died with the router
    assert ray.get_actor(board_name("peagle"), namespace="serve")._actor_id == board._actor_id
    idle = _wait(lambda: (st := _stats(url)) and st["num_replicas"] == 2 and st["kv_blocks_used"] == 0
                 and st["num_running"] == 0 and st, 30, "idle with no KV blocks in use")
    assert idle["kv_blocks_used"] == 0
