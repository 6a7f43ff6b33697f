"""Drop-in shapes: Ray Serve LLM's `llm_configs`, `peagle serve` with vLLM's flags, `LLM.chat`."""
from __future__ import annotations

import copy
import json
import socket
import time
from pathlib import Path

import pytest
import yaml

from peagle_cluster.ray_llm import from_llm_serving_args
from peagle_cluster.settings import parse_app_args

ROOT = Path(__file__).resolve().parents[1]
RAY_LLM_YAML = ROOT / "configs" / "tiny-ray-llm.yaml"
SPEC = {"method": "eagle3", "model": "tiny-peagle", "num_speculative_tokens": 3, "parallel_drafting": True}


def llm_args() -> dict:
    return copy.deepcopy(yaml.safe_load(RAY_LLM_YAML.read_text())["applications"][0]["args"])


# --------------------------------------------------------------------------------------------
# Ray Serve LLM's config shape
# --------------------------------------------------------------------------------------------

def test_the_ray_llm_yaml_is_tiny_yamls_application():
    tiny = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())["applications"][0]
    app = yaml.safe_load(RAY_LLM_YAML.read_text())["applications"][0]
    assert app["import_path"] == "peagle_cluster.app:build_openai_app"
    ours, theirs = parse_app_args(tiny["args"]), parse_app_args(from_llm_serving_args(app["args"]))
    assert theirs.engine == ours.engine and theirs.model_name == ours.model_name == "tiny"
    mine, other = theirs.engine_deployment_options(), ours.engine_deployment_options()
    for key in ("max_ongoing_requests", "max_queued_requests", "ray_actor_options"):
        assert mine[key] == other[key]
    assert mine["autoscaling_config"].items() <= other["autoscaling_config"].items()


def test_llm_config_keys_map_onto_serve_options():
    a = {"llm_configs": [{"model_loading_config": {"model_id": "gpt-oss", "model_source": "tiny",
                                                   "tokenizer_source": "tiny"},
                          "engine_kwargs": {"tensor_parallel_size": 2, "device": "cuda", "speculative_config": SPEC},
                          "accelerator_type": "H100", "runtime_env": {"env_vars": {"A": "1"}},
                          "placement_group_config": {"bundle_per_worker": {"GPU": 1, "CPU": 2}, "strategy": "PACK"},
                          "deployment_config": {"num_replicas": 2, "max_ongoing_requests": 8}}],
         "ingress_deployment_config": {"num_replicas": 3}}
    s = parse_app_args(from_llm_serving_args(a))
    assert s.model_name == "gpt-oss" and s.engine_args["model"] == "tiny" and s.engine_args["tokenizer"] == "tiny"
    opts = s.engine_deployment_options()
    assert opts["num_replicas"] == 2 and opts["max_ongoing_requests"] == 8
    assert opts["ray_actor_options"]["accelerator_type"] == "H100"
    assert opts["ray_actor_options"]["runtime_env"] == {"env_vars": {"A": "1"}}
    assert opts["placement_group_strategy"] == "PACK"
    assert opts["placement_group_bundles"] == [{"GPU": 1, "CPU": 2, "accelerator_type:H100": 0.001}] * 2
    assert s.router_deployment_options()["num_replicas"] == 3


M = {"model_id": "tiny"}


@pytest.mark.parametrize("args,named", [
    ({"llm_configs": [{"model_loading_config": M, "colour": 1}]}, "colour"),
    ({"llm_configs": [{"model_loading_config": {**M, "revision": "x"}}]}, "revision"),
    ({"llm_configs": [{"model_loading_config": M, "engine_kwargs": {"max_num_seq": 4}}]}, "engine_kwargs: unknown key 'max_num_seq'"),
    ({"llm_configs": [{"model_loading_config": M, "deployment_config": {"num_replica": 2}}]}, "deployment_config: unknown key 'num_replica'"),
    ({"llm_configs": [{"model_loading_config": M}], "ingress_deployment_config": {"replicas": 2}}, "ingress_deployment_config: unknown key 'replicas'"),
    ({"llm_configs": [{"model_loading_config": M}], "extra": 1}, "extra"),
    ({"llm_configs": [{"model_loading_config": M, "lora_config": {"max_num_adapters_per_replica": 4}}]}, "lora_config"),
    ({"llm_configs": [{"model_loading_config": M}, {"model_loading_config": {"model_id": "b"}}]}, "llm_configs"),
    ({"llm_configs": [{"model_loading_config": M, "engine_kwargs": {"model": "x"}}]}, "engine_kwargs.model"),
    ({"llm_configs": [{"model_loading_config": M, "placement_group_config": {"bundles": [{"CPU": 1}] * 2}}]},
     "placement_group_bundles"),
])
def test_unknown_or_unsupported_keys_are_refused_by_name(args, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace(".", r"\.")):
        parse_app_args(from_llm_serving_args(args))


# --------------------------------------------------------------------------------------------
# peagle serve
# --------------------------------------------------------------------------------------------

def _parse(argv: list[str]):
    import argparse

    from peagle_core.serve_cli import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_flags_are_vllms_and_build_the_same_settings():
    from peagle_core.serve_cli import serve_args

    ns = _parse(["tiny", "-tp", "1", "--max-model-len", "1024", "--max-num-seqs", "4", "--dtype", "float32",
                 "--device", "cpu", "--speculative-config", json.dumps(SPEC), "--enforce-eager",
                 "--served-model-name", "tiny", "--num-replicas", "2", "--port", "8123"])
    args = serve_args(ns)
    assert args == {"model": "tiny", "tensor_parallel_size": 1, "max_model_len": 1024, "max_num_seqs": 4,
                    "dtype": "float32", "device": "cpu", "speculative_config": SPEC, "enforce_eager": True,
                    "served_model_name": "tiny", "deployment": {"num_replicas": 2}, "api_key_env": "PEAGLE_API_KEY"}
    assert serve_args(_parse(["tiny", "--api-key", "k"]))["api_key"] == "k"  # vLLM's flag, instead of the variable
    tiny = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())["applications"][0]["args"]
    assert parse_app_args(args).engine == parse_app_args(tiny).engine.model_copy(update={"enforce_eager": True})
    assert ns.port == 8123 and ns.host == "127.0.0.1"


def test_serve_refuses_bad_flags_before_starting_ray(capsys):
    from peagle_core.cli import main

    with pytest.raises(SystemExit):
        _parse(["tiny", "--max-num-seq", "4"])  # argparse names the unknown flag
    assert main(["serve", "tiny", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# LLM.chat
# --------------------------------------------------------------------------------------------

def test_llm_chat_renders_as_the_server_and_splits_the_reply():
    from peagle_core import LLM, SamplingParams
    from peagle_core.loading.harmony import HarmonyParser
    from peagle_core.loading.tokenizer import today

    llm = LLM("tiny", device="cpu", dtype="float32", max_model_len=256, speculative_config=SPEC)
    tok = llm.tokenizer
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "d"}}]
    sp = SamplingParams(temperature=0, max_tokens=24)
    (out,) = llm.chat(conv, sp)
    prompt = tok.encode(tok.apply_chat_template(conv, current_date=today()))
    assert out.prompt_token_ids == prompt
    plain = llm.generate([prompt], sp)[0].outputs[0]
    assert out.outputs[0].token_ids == plain.token_ids
    d = HarmonyParser().feed("<|start|>assistant" + tok.decode(plain.token_ids, False), final=True)  # the whole reply
    assert (out.outputs[0].text, out.outputs[0].reasoning or "") == (d.content, d.reasoning) and out.outputs[0].text
    two = llm.chat([conv, conv + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And?"}]],
                   sp, tools=tools, reasoning_effort="low")
    assert len(two) == 2 and all("namespace functions" in tok.decode(o.prompt_token_ids, False) for o in two)
    assert "Reasoning: low" in tok.decode(two[1].prompt_token_ids, False)


# --------------------------------------------------------------------------------------------
# The Ray Serve LLM YAML serves (a real Ray Serve instance)
# --------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_ray_llm_yaml_serves():
    ray = pytest.importorskip("ray")
    openai = pytest.importorskip("openai")
    import httpx
    from ray import serve

    from peagle_cluster.app import build_openai_app

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.time()
        serve.run(build_openai_app(llm_args()), name="peagle-ray-llm", route_prefix="/")
        print(f"up in {time.time() - t0:.1f}s")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        assert 'vllm:generation_tokens_total{model_name="tiny"}' in metrics
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.mark.slow
def test_peagle_serve_serves_and_stops_on_ctrl_c():
    import os
    import signal
    import subprocess
    import sys

    import httpx
    openai = pytest.importorskip("openai")

    port = _free_port()
    cmd = [sys.executable, "-m", "peagle_core.cli", "serve", "tiny", "--device", "cpu", "--dtype", "float32",
           "--max-model-len", "512", "--max-num-seqs", "2", "--speculative-config", json.dumps(SPEC),
           "--served-model-name", "tiny-cli", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny-cli", prompt="Once upon a time", max_tokens=6)
        assert r.usage.completion_tokens == 6 or r.choices[0].finish_reason == "stop"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
