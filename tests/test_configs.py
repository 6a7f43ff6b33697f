"""Every serve config, the compose file and the Grafana dashboard, checked without starting Ray."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from peagle_cluster.app import build_app
from peagle_cluster.ray_llm import from_llm_serving_args
from peagle_cluster.settings import parse_app_args
from peagle_core.config import parse_engine_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def _app(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["applications"][0]


def _args(path: Path) -> dict:
    """A config's app args in this app's flat shape (a Ray Serve LLM YAML's `llm_configs` converted)."""
    from peagle_cluster.ray_llm import from_llm_serving_args

    args = _app(path)["args"]
    return from_llm_serving_args(args) if "llm_configs" in args else args


def _engine_deployment(app):
    """The EngineReplica deployment bound into the router's arguments."""
    return app._bound_deployment.init_args[1]._bound_deployment


def test_the_three_configs_exist():
    assert {p.name for p in CONFIGS} >= {"tiny.yaml", "gpt-oss-120b.yaml", "gpt-oss-20b.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_a_valid_serve_config_that_builds(path, monkeypatch):
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(raw)  # what `serve run` / `serve deploy` parse first
    assert len(schema.applications) == 1
    app_schema = schema.applications[0]
    assert app_schema.import_path in ("peagle_cluster.app:build_app", "peagle_cluster.app:build_openai_app")
    raw_args = app_schema.args
    args = from_llm_serving_args(raw_args) if "llm_configs" in raw_args else raw_args  # Ray Serve LLM's shape
    # Engine arguments alone are accepted by the engine's own parser (vLLM names, no typos).
    settings = parse_app_args(args)
    cfg = parse_engine_config(**settings.engine_args)
    assert cfg.model == args["model"]
    # The import path resolves and builds exactly as `serve run` does, without starting Ray.
    monkeypatch.setenv("PEAGLE_API_KEY", "test-key")
    app = call_user_app_builder_with_args_if_necessary(import_attr(app_schema.import_path), raw_args)
    router = app._bound_deployment
    engine = _engine_deployment(app)
    assert router.name == "OpenAIRouter" and engine.name == "EngineReplica"
    dep = args.get("deployment", {})
    assert engine.max_ongoing_requests == dep.get("max_ongoing_requests", cfg.max_num_seqs)
    assert engine.max_queued_requests == dep.get("max_queued_requests", -1)
    if "autoscaling_config" in dep:
        ac = engine._deployment_config.autoscaling_config
        for k, v in dep["autoscaling_config"].items():
            assert getattr(ac, k) == v, k
    # Security default: nothing listens beyond loopback unless the operator edits the file.
    assert raw["http_options"]["host"] == "127.0.0.1"


def test_tiny_config_runs_on_a_cpu_with_p_eagle():
    args = _app(ROOT / "configs" / "tiny.yaml")["args"]
    cfg = parse_engine_config(**parse_app_args(args).engine_args)
    assert cfg.model == "tiny" and cfg.device == "cpu"
    assert cfg.spec_mode == "peagle" and cfg.speculative_config.model == "tiny-peagle"
    assert cfg.num_spec_tokens == 3
    assert cfg.max_num_seqs <= 8
    actor = parse_app_args(args).engine_actor_options()
    assert actor.get("num_gpus", 0) == 0 and actor["num_cpus"] <= 2


@pytest.mark.parametrize("name,target,head,k", [
    ("gpt-oss-120b.yaml", "openai/gpt-oss-120b", "amazon/gpt-oss-120b-p-eagle", (5, 7)),
    ("gpt-oss-20b.yaml", "openai/gpt-oss-20b", "amazon/GPT-OSS-20B-P-EAGLE", (3, 5, 7)),
])
def test_gpu_configs_use_the_published_models(name, target, head, k):
    args = _app(ROOT / "configs" / name)["args"]
    s = parse_app_args(args)
    cfg = s.engine
    assert cfg.model == target and cfg.speculative_config.model == head
    assert cfg.spec_mode == "peagle" and cfg.num_spec_tokens in k
    assert cfg.device == "cuda"
    # One replica owns exactly its tensor-parallel GPUs (rank 0's in ray_actor_options, the others' in bundles).
    bundles = s.engine_placement_bundles() or [{"GPU": s.engine_actor_options()["num_gpus"]}]
    assert sum(b.get("GPU", 0) for b in bundles) == cfg.tensor_parallel_size
    ac = s.deployment.autoscaling_config
    assert ac["max_replicas"] > ac["min_replicas"] >= 1
    assert ac["target_ongoing_requests"] <= s.engine_deployment_options()["max_ongoing_requests"]
    assert s.api_key_env == "PEAGLE_API_KEY" and s.api_key is None  # no secrets in YAML


@pytest.mark.parametrize("args,needle", [
    ({"model": "tiny", "max_num_seq": 4}, "max_num_seq"),
    ({"model": "tiny", "speculative_config": {"method": "eagle3", "model": "x", "num_spec_tokens": 3}}, "num_spec_tokens"),
    ({"model": "tiny", "deployment": {"max_ongoing": 3}}, "max_ongoing"),
    ({"model": "tiny", "deployment": {"autoscaling_config": {"max_replica": 3}}}, "max_replica"),
    ({"model": "tiny", "deployment": {"autoscaling_config": {"min_replicas": 3, "max_replicas": 1}}}, "max_replicas"),
    ({"model": "tiny", "deployment": {"num_replicas": 2, "autoscaling_config": {"max_replicas": 2}}}, "num_replicas"),
    ({"model": "tiny", "max_request_body_bytes": 10}, "max_request_body_bytes"),
])
def test_bad_args_fail_the_build_with_the_key_named(args, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        build_app(args)


def test_deployment_defaults_follow_the_engine_args():
    s = parse_app_args({"model": "m", "device": "cuda", "tensor_parallel_size": 4, "max_num_seqs": 48})
    opts = s.engine_deployment_options()
    assert opts["max_ongoing_requests"] == 48  # the batch a replica sees is bounded by the engine's
    assert opts["ray_actor_options"]["num_gpus"] == 1  # rank 0; ranks 1..3 in the replica's placement group
    assert sum(b["GPU"] for b in opts["placement_group_bundles"]) == 4
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["num_replicas"] == 1
    assert parse_app_args({"model": "tiny"}).engine_actor_options() == {"num_cpus": 1}


def test_api_key_comes_from_the_environment(monkeypatch):
    s = parse_app_args({"model": "tiny", "api_key_env": "PEAGLE_TEST_KEY"})
    monkeypatch.delenv("PEAGLE_TEST_KEY", raising=False)
    assert s.resolved_api_key() is None
    monkeypatch.setenv("PEAGLE_TEST_KEY", "k1")
    assert s.resolved_api_key() == "k1"
    assert "k1" not in json.dumps(s.model_dump())  # the key never lands in what Ray ships around


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_reads_the_api_key_and_listens_on_loopback(path):
    raw = yaml.safe_load(path.read_text())
    assert raw["http_options"]["host"] == "127.0.0.1"
    assert parse_app_args(_args(path)).api_key_env == "PEAGLE_API_KEY"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_gives_the_proxy_the_router_failure_middleware(path):
    """Serve's proxy inherits the controller's runtime_env, which the config's `controller_options` sets: `serve run`
    alone installs the middleware (tests/test_chaos.py kills a router under it)."""
    from ray.serve.schema import ServeDeploySchema

    from peagle_cluster import failover

    schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    assert schema.controller_options.runtime_env == failover.CONTROLLER_OPTIONS["runtime_env"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_router_always_has_room_to_restart(path):
    """The router's CPUs are reserved in every config: with the engine at its most replicas, a router that dies
    can be placed again (tiny.yaml: on the 2 cores it is written for)."""
    s = parse_app_args(_args(path))
    eng, router = s.engine_deployment_options(), s.router_deployment_options()
    engine_replicas = eng.get("num_replicas") or eng["autoscaling_config"]["max_replicas"]
    router_replicas = router.get("num_replicas") or router["autoscaling_config"]["max_replicas"]
    router_cpus = router["ray_actor_options"].get("num_cpus", 0)
    assert router_cpus > 0
    if path.name.startswith("tiny"):
        bundles = eng.get("placement_group_bundles")
        per_replica = sum(b.get("CPU", 0) for b in bundles) if bundles else eng["ray_actor_options"]["num_cpus"]
        assert engine_replicas * per_replica + router_replicas * router_cpus <= 2


def test_serve_run_warns_of_an_unread_key_and_of_an_open_endpoint_without_one():
    from peagle_cluster import failover
    from peagle_cluster.settings import startup_warnings

    def exposure_warnings(settings, host, env):
        return startup_warnings(settings, host, env | {failover.CALLBACK_ENV: failover.CALLBACK}, node_ip="127.0.0.1")

    bare, reads = parse_app_args({"model": "tiny"}), parse_app_args({"model": "tiny", "api_key_env": "PEAGLE_API_KEY"})
    key = {"PEAGLE_API_KEY": "k"}
    assert "does not read it" in " ".join(exposure_warnings(bare, "127.0.0.1", key))
    assert exposure_warnings(reads, "127.0.0.1", key) == [] and exposure_warnings(reads, "0.0.0.0", key) == []
    assert exposure_warnings(reads, "127.0.0.1", {}) == []  # an open endpoint on loopback: the default, no warning
    assert "without a key" in " ".join(exposure_warnings(reads, "0.0.0.0", {}))
    assert len(exposure_warnings(bare, "10.0.0.5", key)) == 2
    assert "plain-text 500" in " ".join(startup_warnings(reads, "127.0.0.1", {}, node_ip="127.0.0.1"))  # no middleware
    # Ray's ports beyond a loopback endpoint (a node IP that is not loopback): the single-node remedy is named.
    ok = {failover.CALLBACK_ENV: failover.CALLBACK}
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in " ".join(startup_warnings(reads, "127.0.0.1", ok, node_ip="10.0.0.5"))
    assert startup_warnings(reads, "127.0.0.1", ok, node_ip="127.0.0.1") == []


# --------------------------------------------------------------------------------------------
# docker-compose.yml
# --------------------------------------------------------------------------------------------

def test_compose_file_names_the_services_and_keeps_the_dashboard_local():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"ray-head", "ray-worker", "locust-master", "locust-worker"} <= set(services)
    head, worker = services["ray-head"], services["ray-worker"]
    # The serve config directory is mounted and the head serves one of its files.
    assert any(str(v).startswith("./configs:/configs") for v in head["volumes"])
    assert "serve run" in head["command"] and "/configs/" in head["command"]
    # Dashboard host defaults to loopback (opt in with RAY_DASHBOARD_HOST).
    assert "--dashboard-host=$${RAY_DASHBOARD_HOST}" in head["command"]
    assert head["environment"]["RAY_DASHBOARD_HOST"] == "${RAY_DASHBOARD_HOST:-127.0.0.1}"
    # Workers get GPUs and join the head.
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert "ray start --address=" in worker["command"]
    assert "--master" in services["locust-master"]["command"] and "--web-host 127.0.0.1" in services["locust-master"]["command"]
    assert "--worker" in services["locust-worker"]["command"]
    for f in ("cluster/monitoring/prometheus.yml", "cluster/monitoring/grafana-datasource.yml",
              "cluster/monitoring/grafana-dashboards.yml", "loadtest/locustfile.py"):
        assert (ROOT / f).exists(), f


# --------------------------------------------------------------------------------------------
# Grafana dashboard
# --------------------------------------------------------------------------------------------

def _exported_metric_names() -> set[str]:
    """Names Prometheus sees for our metrics: `ray_` + name (+ `_bucket/_sum/_count` for histograms)."""
    from ray.util.metrics import Histogram

    from peagle_cluster.telemetry import ReplicaMetrics, RouterMetrics

    names = set()
    for obj in (ReplicaMetrics("m", "r"), RouterMetrics("m")):
        for v in vars(obj).values():
            if hasattr(v, "_name"):
                base = "ray_" + v._name
                names.add(base)
                if isinstance(v, Histogram):
                    names |= {base + "_bucket", base + "_sum", base + "_count"}
    return names


def test_grafana_dashboard_queries_only_metrics_we_export():
    dash = json.loads((ROOT / "cluster" / "grafana_dashboard.json").read_text())
    exported = _exported_metric_names()
    used = set()
    for panel in dash["panels"]:
        for t in panel["targets"]:
            used |= set(re.findall(r"\b(ray_peagle_[a-z0-9_]+)", t["expr"]))
    assert used, "the dashboard queries no peagle metrics"
    assert used <= exported, f"dashboard uses metrics nobody exports: {sorted(used - exported)}"
    # Every required signal has a panel.
    for needle in ("requests_running", "requests_waiting", "time_to_first_token", "time_per_output_token",
                   "e2e_request_latency", "generation_tokens", "num_drafts", "num_accepted_tokens_total",
                   "acceptance_length", "accepted_tokens_per_pos", "speculation_depth", "kv_blocks_used"):
        assert any(needle in u for u in used), needle
