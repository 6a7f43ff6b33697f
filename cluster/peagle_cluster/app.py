"""The application builder: `import_path: peagle_cluster.app:build_app` in a Ray Serve config file.

    serve run configs/tiny.yaml            # or: serve run peagle_cluster.app:build_app model=tiny
    serve run configs/tiny-ray-llm.yaml    # Ray Serve LLM's `llm_configs` shape (build_openai_app)

Two deployments: `OpenAIRouter` (HTTP ingress, light) and `EngineReplica` (one AsyncLLM each,
GPUs as `ray_actor_options` say). Requests reach replicas through Serve's default request router,
power of two choices on ongoing requests: of two random replicas, the one with fewer requests in
flight gets the request, and a replica at `max_ongoing_requests` gets none (the caller queues, up to
`max_queued_requests`, then answers 503). Replicas publish concurrency, KV usage, speculation depth
and acceptance length through `record_routing_stats`, for a custom router named in
`deployment.request_router_config`.
"""
from __future__ import annotations

from typing import Any

from ray import serve

from peagle_cluster.ray_llm import from_llm_serving_args
from peagle_cluster.replica import EngineReplica
from peagle_cluster.router import OpenAIRouter
from peagle_cluster.settings import AppSettings, parse_app_args


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Validate `args` (engine args + serving knobs, see `peagle_cluster.settings`) and bind the two deployments.

    Nothing is loaded here: a bad key fails fast with a ValueError, before any replica starts.
    Ray Serve LLM's shape (`llm_configs: [...]`) is accepted too (`peagle_cluster.ray_llm`).
    """
    if args and "llm_configs" in args:
        args = from_llm_serving_args(args)
    settings = parse_app_args(args)
    return bind(settings)


build_openai_app = build_app  # Ray Serve LLM's builder name: its YAML changes only the module in import_path


def bind(settings: AppSettings) -> serve.Application:
    payload = settings.model_dump()  # plain dicts cross into the replicas' processes
    engine = EngineReplica.options(**settings.engine_deployment_options()).bind(payload)
    return OpenAIRouter.options(**settings.router_deployment_options()).bind(payload, engine)
