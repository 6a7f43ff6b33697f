"""The serve config's `args`, split into engine arguments, deployment options and HTTP policy.

A config's `args` is one flat mapping, as in vLLM's CLI: engine arguments (`model`, `max_num_seqs`,
`speculative_config`, ...) sit next to our serving knobs (`deployment`, `api_key_env`, ...). The engine
arguments are checked by `peagle_core.config.parse_engine_config`, the rest by `AppSettings`, so a
typo anywhere in a YAML file fails `serve run` with a message naming the key, before Ray starts.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from peagle_core.config import EngineConfig, format_validation_error, parse_engine_config

log = logging.getLogger("peagle.cluster")

# Keys of `args` that belong to the cluster rather than the engine.
APP_KEYS = {"served_model_name", "deployment", "router", "api_key", "api_key_env", "max_request_body_bytes",
            "body_read_timeout_s", "max_chars_per_token", "tracing", "metrics_interval_s"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class DeploymentOptions(_Strict):
    """Ray Serve options of the engine-replica deployment (names as in `@serve.deployment`)."""

    num_replicas: int | None = Field(default=None, ge=1)
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int | None = Field(default=None, ge=1)  # default: the engine's max_num_seqs
    max_queued_requests: int = Field(default=-1, ge=-1)
    ray_actor_options: dict[str, Any] | None = None  # default: derived from device and tensor_parallel_size
    health_check_period_s: float = Field(default=10.0, gt=0)
    health_check_timeout_s: float = Field(default=30.0, gt=0)
    graceful_shutdown_wait_loop_s: float = Field(default=2.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(default=20.0, gt=0)
    request_router_config: dict[str, Any] | None = None
    max_constructor_retry_count: int | None = Field(default=None, ge=1)
    # tensor_parallel_size > 1: each replica reserves one placement-group bundle per rank (docs/tensor_parallel.md)
    placement_group_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    # Ray Serve LLM's (peagle_cluster.ray_llm): one bundle per rank, bundle 0 holding the replica actor
    placement_group_bundles: list[dict[str, float]] | None = None
    accelerator_type: str | None = None  # replicas and their GPU bundles land on nodes with this GPU
    runtime_env: dict[str, Any] | None = None  # the replica actor's

    @model_validator(mode="after")
    def _one_sizing(self) -> "DeploymentOptions":
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("deployment: set either num_replicas or autoscaling_config, not both")
        return self


class RouterOptions(_Strict):
    """Ray Serve options of the HTTP ingress deployment: light, CPU only, many requests each."""

    num_replicas: int | None = Field(default=1, ge=1)
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int = Field(default=1024, ge=1)
    max_queued_requests: int = Field(default=-1, ge=-1)
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.1})
    # Serve notices a dead replica at its next health check: often, so a crashed router is replaced in seconds.
    health_check_period_s: float = Field(default=1.0, gt=0)
    health_check_timeout_s: float = Field(default=10.0, gt=0)


class TracingOptions(_Strict):
    """OpenTelemetry: `otlp` exports over OTLP/HTTP (endpoint from OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT),
    `memory` keeps spans in the process (tests), `console` prints them, `none` records nothing.
    `auto` means `otlp` when an endpoint variable is set, else `none`."""

    exporter: Literal["auto", "otlp", "memory", "console", "none"] = "auto"
    service_name: str = "peagle"


class AppSettings(_Strict):
    engine_args: dict[str, Any]
    served_model_name: str | None = None
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions)
    router: RouterOptions = Field(default_factory=RouterOptions)
    api_key: str | None = None
    api_key_env: str | None = None
    max_request_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # A body not fully received by then is a 408 (a client that declares more than it sends holds nothing long).
    body_read_timeout_s: float = Field(default=10.0, gt=0)
    # Prompts longer than max_model_len * this many characters are refused before tokenising.
    max_chars_per_token: int | None = Field(default=None, ge=1)
    tracing: TracingOptions = Field(default_factory=TracingOptions)
    metrics_interval_s: float = Field(default=1.0, gt=0)

    @property
    def engine(self) -> EngineConfig:
        return parse_engine_config(**self.engine_args)

    @property
    def model_name(self) -> str:
        """The name clients put in `model` (vLLM's `served_model_name`; defaults to `model`)."""
        return self.served_model_name or self.engine_args.get("model", "tiny")

    def resolved_api_key(self) -> str | None:
        """The key requests must present, or None for an open endpoint.

        `api_key_env` names an environment variable read where the router runs (never written into
        the config, so keys stay out of YAML files and the dashboard).
        """
        if self.api_key:
            return self.api_key
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if key:
                return key
            log.warning("api_key_env=%s is not set: the OpenAI endpoint accepts requests without a key",
                        self.api_key_env)
        return None

    def engine_actor_options(self) -> dict[str, Any]:
        """Resources of the replica actor itself (tensor-parallel rank 0): one GPU, or one CPU on a laptop.
        With tensor_parallel_size > 1 the other ranks get theirs from `engine_placement_bundles`."""
        d = self.deployment
        if d.ray_actor_options is not None:
            opts = dict(d.ray_actor_options)
        else:
            on_gpu = (self.engine.device or "cpu").startswith("cuda")
            opts = {"num_gpus": 1, "num_cpus": 2} if on_gpu else {"num_cpus": 1}
        if d.accelerator_type:
            opts["accelerator_type"] = d.accelerator_type
        if d.runtime_env:
            opts["runtime_env"] = {**(opts.get("runtime_env") or {}), **d.runtime_env}
        return opts

    def engine_placement_bundles(self) -> list[dict[str, float]] | None:
        """tensor_parallel_size N > 1: one bundle per rank. Bundle 0 holds the replica actor (rank 0, sized by
        its ray_actor_options); bundles 1..N-1 hold one worker each (a GPU and a CPU, or a CPU on a laptop)."""
        cfg = self.engine
        n = cfg.tensor_parallel_size
        given = self.deployment.placement_group_bundles
        if given is not None:
            if len(given) != n:
                raise ValueError(f"invalid serve args: placement_group_bundles has {len(given)} bundles; "
                                 f"tensor_parallel_size={n} needs one per rank")
            return [self._with_accelerator(dict(b)) for b in given]
        if n == 1:
            return None
        actor = self.engine_actor_options()
        on_gpu = (cfg.device or "cpu").startswith("cuda")
        if on_gpu and actor.get("num_gpus", 0) != 1:
            raise ValueError(f"invalid serve args: with tensor_parallel_size={n} the replica actor is rank 0 and holds "
                             f"one GPU (its {n - 1} workers get one each from the placement group); set "
                             f"deployment.ray_actor_options.num_gpus to 1, not {actor.get('num_gpus', 0)}")
        first = {"CPU": float(actor.get("num_cpus", 1)), **{k: float(v) for k, v in (actor.get("resources") or {}).items()}}
        if actor.get("num_gpus"):
            first["GPU"] = float(actor["num_gpus"])
        if actor.get("memory"):
            first["memory"] = float(actor["memory"])
        worker = {"CPU": 1.0, "GPU": 1.0} if on_gpu else {"CPU": 1.0}
        bundles = [{k: v for k, v in first.items() if v > 0}] + [dict(worker) for _ in range(n - 1)]
        return [self._with_accelerator(b) for b in bundles]

    def _with_accelerator(self, bundle: dict[str, float]) -> dict[str, float]:
        """Ray's custom resource for the accelerator type, on every bundle (the actor's `accelerator_type` asks
        bundle 0 for it), as Ray Serve LLM places them."""
        t = self.deployment.accelerator_type
        if t:
            bundle.setdefault(f"accelerator_type:{t}", 0.001)
        return bundle

    def engine_deployment_options(self) -> dict[str, Any]:
        """Keyword arguments for `EngineReplica.options(...)`."""
        d = self.deployment
        opts: dict[str, Any] = {
            "max_ongoing_requests": d.max_ongoing_requests or self.engine.max_num_seqs,
            "max_queued_requests": d.max_queued_requests,
            "ray_actor_options": self.engine_actor_options(),
            "health_check_period_s": d.health_check_period_s,
            "health_check_timeout_s": d.health_check_timeout_s,
            "graceful_shutdown_wait_loop_s": d.graceful_shutdown_wait_loop_s,
            "graceful_shutdown_timeout_s": d.graceful_shutdown_timeout_s,
        }
        if d.autoscaling_config is not None:
            opts["autoscaling_config"] = dict(d.autoscaling_config)
        else:
            opts["num_replicas"] = d.num_replicas or 1
        if d.request_router_config is not None:
            opts["request_router_config"] = dict(d.request_router_config)
        if d.max_constructor_retry_count is not None:
            opts["max_constructor_retry_count"] = d.max_constructor_retry_count
        bundles = self.engine_placement_bundles()
        if bundles is not None:  # Serve creates the group per replica and starts the replica in bundle 0
            opts["placement_group_bundles"] = bundles
            opts["placement_group_strategy"] = d.placement_group_strategy
        return opts

    def router_deployment_options(self) -> dict[str, Any]:
        r = self.router
        opts: dict[str, Any] = {"max_ongoing_requests": r.max_ongoing_requests,
                                "max_queued_requests": r.max_queued_requests,
                                "ray_actor_options": dict(r.ray_actor_options),
                                "health_check_period_s": r.health_check_period_s,
                                "health_check_timeout_s": r.health_check_timeout_s}
        if r.autoscaling_config is not None:
            opts["autoscaling_config"] = dict(r.autoscaling_config)
        else:
            opts["num_replicas"] = r.num_replicas or 1
        return opts


KEY_ENV = "PEAGLE_API_KEY"  # the variable every shipped config names in api_key_env


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def startup_warnings(settings: AppSettings, http_host: str | None, environ: dict[str, str] | None = None,
                     node_ip: str | None = None) -> list[str]:
    """What the router says at start (its log reaches the `serve run` console) about an endpoint more open than
    its user may think, a key variable set but not read by this config or an endpoint beyond loopback without a
    key, Ray's own ports open beyond a loopback endpoint, and about a proxy without the router-failure middleware
    (`peagle_cluster.failover`)."""
    from peagle_cluster import failover

    env = os.environ if environ is None else environ
    node_ip = node_ip or ray_node_ip()
    out = []
    if http_host in LOOPBACK_HOSTS and node_ip and node_ip not in LOOPBACK_HOSTS:
        out.append(f"Serve listens on {http_host} but Ray's own ports do not: its Prometheus exporters (our metrics, the "
                   "node IP, the session name) and its gRPC servers listen on all interfaces. On one machine, "
                   "start Ray in its single-node mode, where all of them bind 127.0.0.1: "
                   "`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 serve run ...`; on several, firewall them "
                   "(docs/cluster.md, Security and failure)")
    if http_host is not None and env.get(failover.CALLBACK_ENV) != failover.CALLBACK:
        out.append(f"{failover.CALLBACK_ENV} is not {failover.CALLBACK} in Serve's processes: requests in flight when "
                   "a router dies get Serve's plain-text 500 and cut streams. Add the config's `controller_options` "
                   "(configs/tiny.yaml) and start Serve afresh: Serve applies them only when it creates its controller "
                   "(docs/cluster.md, Security and failure)")
    reads = {settings.api_key_env} if settings.api_key_env else set()
    if env.get(KEY_ENV) and KEY_ENV not in reads and not settings.api_key:
        out.append(f"{KEY_ENV} is set but this config does not read it, so the endpoint takes requests without a key: "
                   f"add `api_key_env: {KEY_ENV}` to the application's args")
    keyed = bool(settings.api_key or (settings.api_key_env and env.get(settings.api_key_env)))
    if http_host is not None and http_host not in LOOPBACK_HOSTS and not keyed:
        out.append(f"the OpenAI endpoint listens on {http_host} (beyond this machine) and takes requests without a "
                   f"key: export {settings.api_key_env or KEY_ENV} before `serve run`, or bind http_options.host to "
                   "127.0.0.1")
    return out


def ray_node_ip() -> str | None:
    """This process's Ray node IP (None outside Ray): unless it is loopback, Ray's gRPC servers and metrics
    exporters listen on all interfaces."""
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else None
    except Exception:  # no warning rather than a failed start
        return None


def serve_http_host() -> str | None:
    """The host Serve's proxies bind, from inside a running Serve application (None elsewhere)."""
    try:
        import ray
        from ray.serve.context import _get_global_client

        if not ray.is_initialized():
            return None
        client = _get_global_client(raise_if_no_controller_running=False)
        return client.http_config.host if client is not None else None
    except Exception:  # a private API: no warning rather than a failed start
        return None


def parse_app_args(args: dict[str, Any] | None) -> AppSettings:
    """Split and validate a serve config's `args`; one readable ValueError for every problem."""
    args = dict(args or {})
    engine_args = {k: v for k, v in args.items() if k not in APP_KEYS}
    app_args = {k: v for k, v in args.items() if k in APP_KEYS}
    parse_engine_config(**engine_args)  # raises ValueError naming unknown or bad engine keys
    try:
        settings = AppSettings(engine_args=engine_args, **app_args)
    except ValidationError as e:
        raise ValueError(format_validation_error(e).replace("invalid engine arguments", "invalid serve args")) from None
    _check_autoscaling(settings)
    settings.engine_placement_bundles()  # bundles that cannot hold the ranks fail here, not in the controller
    return settings


def _check_autoscaling(settings: AppSettings) -> None:
    """Let Ray's own model check autoscaling keys, so typos fail at build time, not in the controller."""
    from ray.serve.config import AutoscalingConfig

    for where, cfg in (("deployment", settings.deployment.autoscaling_config),
                       ("router", settings.router.autoscaling_config)):
        if cfg is None:
            continue
        unknown = set(cfg) - set(AutoscalingConfig.model_fields)
        if unknown:
            raise ValueError(f"invalid serve args: {where}.autoscaling_config has unknown keys {sorted(unknown)}")
        try:
            AutoscalingConfig(**cfg)
        except Exception as e:  # pydantic error text from Ray's model
            raise ValueError(f"invalid serve args: {where}.autoscaling_config: {e}") from None
