"""`peagle serve MODEL [flags]`: vLLM's `vllm serve` flags, building the same Ray Serve app as the configs.

The engine flags are EngineConfig's fields with dashes (`--tensor-parallel-size`, `--max-model-len`,
`--speculative-config JSON`, ...), so a new engine argument gets its flag with no edit here; the serving
flags are vLLM's names for what `peagle_cluster.settings` calls the same (`--served-model-name`,
`--api-key`, `--host`, `--port`) plus Ray Serve's `--num-replicas`.

Without RAY_ADDRESS it starts a Ray of its own in Ray's single-node mode, where every port Ray opens (gRPC,
dashboard, the Prometheus exporters) listens on 127.0.0.1 only; with RAY_ADDRESS it joins that cluster.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types
import typing
from typing import Any

SERVING_FLAGS = ("served_model_name", "api_key", "num_replicas")
# Ray's switch for clusters of several nodes, off by default only on macOS and Windows. Off, the node's IP is
# 127.0.0.1, and Ray binds its gRPC servers and metrics exporters to the node IP (or 0.0.0.0 when it is not
# loopback). Read once, when `ray` is imported.
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _kind(annotation: Any) -> tuple[Any, list | None]:
    """(argparse type, choices) for a pydantic field's annotation; JSON for anything structured."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] \
        if typing.get_origin(annotation) in (typing.Union, types.UnionType) else [annotation]
    a = args[0] if len(args) == 1 else None
    if typing.get_origin(a) is typing.Literal:
        return str, list(typing.get_args(a))
    if a in (bool, int, float, str):
        return a, None
    return json.loads, None


def add_serve_parser(sub) -> None:
    from peagle_core.config import EngineConfig

    p = sub.add_parser("serve", allow_abbrev=False, help="serve MODEL over OpenAI's HTTP API on Ray Serve (vLLM's `vllm serve` flags)")
    p.add_argument("model", nargs="?", default="tiny", help="checkpoint directory, Hub repo id, or 'tiny'")
    engine = p.add_argument_group("engine (vLLM's engine arguments)")
    for name, field in EngineConfig.model_fields.items():
        if name == "model":
            continue
        flags = ["--" + name.replace("_", "-")] + (["-tp"] if name == "tensor_parallel_size" else [])
        kind, choices = _kind(field.annotation)
        if kind is bool:
            engine.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=None)
        else:
            engine.add_argument(*flags, dest=name, type=kind, choices=choices, default=None,
                                metavar="JSON" if kind is json.loads else None)
    serving = p.add_argument_group("serving")
    serving.add_argument("--served-model-name", help="the name clients send (default: MODEL)")
    serving.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    serving.add_argument("--num-replicas", type=int, help="engine replicas (default 1)")
    serving.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    serving.add_argument("--port", type=int, default=8000)
    p.set_defaults(func=run_serve)


def serve_args(ns: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags as a serve config's `args` (what configs/*.yaml hold)."""
    from peagle_core.config import EngineConfig

    args: dict[str, Any] = {"model": ns.model}
    for name in EngineConfig.model_fields:
        if name != "model" and getattr(ns, name) is not None:
            args[name] = getattr(ns, name)
    if ns.served_model_name:
        args["served_model_name"] = ns.served_model_name
    if ns.api_key:
        args["api_key"] = ns.api_key
    else:  # as every shipped config: the key, if any, comes from PEAGLE_API_KEY
        args["api_key_env"] = "PEAGLE_API_KEY"
    if ns.num_replicas:
        args["deployment"] = {"num_replicas": ns.num_replicas}
    return args


def run_serve(ns: argparse.Namespace) -> int:
    own_ray = not os.environ.get("RAY_ADDRESS")
    if own_ray and "ray" not in sys.modules:
        os.environ.setdefault(SINGLE_NODE_ENV, "0")  # nothing of Ray's listens beyond 127.0.0.1
    import ray
    from ray import serve

    from peagle_cluster import failover
    from peagle_cluster.app import build_app

    app = build_app(serve_args(ns))  # a bad flag value fails here, before Ray starts
    try:  # controller_options: the proxy answers for a dead router as in every config (peagle_cluster/failover.py)
        if own_ray:  # a new local Ray, not one `ray start` left running (its node IP is not loopback)
            ray.init(address="local")
        serve.start(http_options={"host": ns.host, "port": ns.port}, controller_options=failover.CONTROLLER_OPTIONS)
        serve.run(app, name="peagle", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
