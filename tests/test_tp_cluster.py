"""A tensor-parallel replica in Ray Serve: placement-group options, and a TP=2 replica on CPU serving requests.

The replica (rank 0) runs in bundle 0 of its own placement group and starts its worker (rank 1) as a
Ray actor in bundle 1; the served tokens must equal a plain TP=1 engine's on the same model.
"""
from __future__ import annotations

import copy
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import yaml

from peagle_cluster.settings import parse_app_args

ROOT = Path(__file__).resolve().parent.parent
PROMPT, MAX_TOKENS = "Once upon a time", 12


def _tiny_args(**engine) -> dict:
    args = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())["applications"][0]["args"])
    return {**args, **engine}


# --------------------------------------------------------------------------------------------
# Deployment options (no Ray needed)
# --------------------------------------------------------------------------------------------


def test_tp_replica_reserves_one_bundle_per_rank():
    s = parse_app_args({"model": "m", "device": "cuda", "tensor_parallel_size": 4})
    opts = s.engine_deployment_options()
    assert opts["ray_actor_options"] == {"num_gpus": 1, "num_cpus": 2}  # the replica is rank 0: bundle 0
    assert opts["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 1.0}] + [{"CPU": 1.0, "GPU": 1.0}] * 3
    assert opts["placement_group_strategy"] == "STRICT_PACK"

    spread = parse_app_args({"model": "m", "device": "cuda", "tensor_parallel_size": 2,
                             "deployment": {"placement_group_strategy": "PACK"}})
    assert spread.engine_deployment_options()["placement_group_strategy"] == "PACK"

    cpu = parse_app_args(_tiny_args(tensor_parallel_size=2))
    rank0 = float(_tiny_args()["deployment"]["ray_actor_options"]["num_cpus"])  # the replica actor's own CPUs
    assert cpu.engine_deployment_options()["placement_group_bundles"] == [{"CPU": rank0}, {"CPU": 1.0}]
    single = parse_app_args(_tiny_args()).engine_deployment_options()
    assert "placement_group_bundles" not in single and "placement_group_strategy" not in single


@pytest.mark.parametrize("args,needle", [
    ({"model": "m", "device": "cuda", "tensor_parallel_size": 2, "deployment": {"ray_actor_options": {"num_gpus": 2}}},
     "set deployment.ray_actor_options.num_gpus to 1"),
    ({"model": "m", "tensor_parallel_size": 2, "deployment": {"placement_group_strategy": "TIGHT"}},
     "placement_group_strategy"),
])
def test_bad_tp_placement_fails_the_build(args, needle):
    from peagle_cluster.app import build_app

    with pytest.raises(ValueError, match=needle):
        build_app(args)


# --------------------------------------------------------------------------------------------
# A TP=2 replica on CPU
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp_app():
    ray = pytest.importorskip("ray")
    from ray import serve

    from peagle_cluster.app import build_app

    args = _tiny_args(tensor_parallel_size=2)
    args["deployment"] = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}, "max_constructor_retry_count": 1,
                          "health_check_period_s": 2, "graceful_shutdown_timeout_s": 5}
    args["router"] = {"num_replicas": 1}
    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.time()
        serve.run(build_app(args), name="peagle-tp", route_prefix="/")
        print(f"TP=2 app up in {time.time() - t0:.1f}s")
        yield {"url": f"http://127.0.0.1:{port}", "ray": ray}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def test_tp2_replica_serves_the_same_tokens_as_tp1(tp_app):
    import httpx

    from peagle_core import LLM, SamplingParams

    r = httpx.post(tp_app["url"] + "/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == MAX_TOKENS

    want = LLM("tiny", device="cpu").generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                      ignore_eos=True))[0]
    assert body["choices"][0]["text"] == want.outputs[0].text

    # The replica's own placement group: bundle 0 for rank 0, bundle 1 for the worker actor.
    groups = [g for g in tp_app["ray"].util.placement_group_table().values() if g["state"] == "CREATED"]
    tp_groups = [g for g in groups if list(g["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]]
    assert len(tp_groups) == 1 and tp_groups[0]["strategy"] == "STRICT_PACK"
    assert httpx.get(tp_app["url"] + "/health", timeout=30).status_code == 200
    deadline = time.monotonic() + 20  # a replica posts to the stats board once a metrics interval
    while not (replicas := httpx.get(tp_app["url"] + "/v1/stats", timeout=30).json()["replicas"]):
        assert time.monotonic() < deadline, "no replica on /v1/stats"
        time.sleep(0.5)
    tp = replicas[0]["engine"]["tensor_parallel"]
    assert {k: tp[k] for k in ("size", "workers", "devices", "healthy")} == {
        "size": 2, "workers": "ray_actors", "devices": ["cpu", "cpu"], "healthy": True}


def test_a_dead_worker_gets_its_replica_replaced(tp_app):
    """Kill rank 1: the replica's health check fails, Serve starts a new replica (with a new worker) that serves."""
    import httpx

    def engine() -> dict:
        return httpx.get(tp_app["url"] + "/v1/stats", timeout=30).json()["replicas"][0]

    before = engine()
    (pid,) = before["engine"]["tensor_parallel"]["worker_pids"]
    os.kill(pid, signal.SIGKILL)
    deadline, after = time.time() + 90, None
    while time.time() < deadline:
        try:
            after = engine()
            if after["replica_id"] != before["replica_id"] and after["engine"]["tensor_parallel"]["healthy"]:
                break
        except Exception:  # the router may briefly have no healthy replica to ask
            pass
        time.sleep(0.5)
    assert after is not None and after["replica_id"] != before["replica_id"], "the replica was not replaced"
    r = httpx.post(tp_app["url"] + "/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
