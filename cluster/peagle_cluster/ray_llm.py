"""Ray Serve LLM's config shape (`ray.serve.llm:build_openai_app` args) -> this application's `args`.

A Ray Serve LLM YAML runs here with one line changed, `import_path: peagle_cluster.app:build_openai_app`:

    args:
      llm_configs:
        - model_loading_config: {model_id: NAME, model_source: CHECKPOINT, tokenizer_source: ...}
          engine_kwargs: {...}              # vLLM engine arguments (ours: peagle_core.config)
          deployment_config: {...}          # the engine replicas' Serve options
          placement_group_config: {bundles | bundle_per_worker, strategy}
          accelerator_type: H100
          runtime_env: {...}
      ingress_deployment_config: {...}      # the HTTP ingress's Serve options

Every key is mapped or refused by name (a typo, or a Ray Serve LLM feature this server lacks, such as
LoRA, fails the build with its path); one model per application.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from peagle_cluster.settings import KEY_ENV
from peagle_core.config import format_validation_error, parse_engine_config


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ModelLoadingConfig(_Strict):
    model_id: str                       # the name clients send (served_model_name)
    model_source: str | None = None     # the checkpoint (model); default: model_id
    tokenizer_source: str | None = None


class PlacementGroupConfig(_Strict):
    bundles: list[dict[str, float]] | None = None
    bundle_per_worker: dict[str, float] | None = None
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"


class LLMConfig(_Strict):
    model_loading_config: ModelLoadingConfig
    llm_engine: Literal["vLLM", "peagle"] = "vLLM"  # this engine stands in for vLLM
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    deployment_config: dict[str, Any] = Field(default_factory=dict)
    placement_group_config: PlacementGroupConfig | None = None
    accelerator_type: str | None = None
    runtime_env: dict[str, Any] | None = None
    log_engine_metrics: bool | None = None  # engine metrics are always exported
    # Ray Serve LLM features this server does not have: refused unless empty
    lora_config: Any = None
    experimental_configs: Any = None
    server_cls: Any = None
    accelerator_config: Any = None

    @model_validator(mode="after")
    def _unsupported(self) -> "LLMConfig":
        for key, what in (("lora_config", "LoRA adapters"), ("experimental_configs", "experimental configs"),
                          ("server_cls", "a custom server class"), ("accelerator_config", "accelerator_config "
                                                                    "(use accelerator_type)")):
            if getattr(self, key):
                raise ValueError(f"{key}: {what} are not supported by this server")
        return self


class LLMServingArgs(_Strict):
    llm_configs: list[LLMConfig] = Field(min_length=1, max_length=1)  # one model per application
    ingress_deployment_config: dict[str, Any] = Field(default_factory=dict)
    ingress_cls_config: Any = None

    @model_validator(mode="after")
    def _unsupported(self) -> "LLMServingArgs":
        if self.ingress_cls_config:
            raise ValueError("ingress_cls_config: the ingress is this server's own OpenAIRouter")
        return self


def from_llm_serving_args(args: dict[str, Any]) -> dict[str, Any]:
    """Ray Serve LLM's args -> this app's flat args (then checked as any config's are)."""
    try:
        s = LLMServingArgs.model_validate(args)
    except ValidationError as e:
        msg = format_validation_error(e).replace("invalid engine arguments", "invalid llm_configs args")
        raise ValueError(msg.replace("Value error, ", "")) from None
    c = s.llm_configs[0]
    out = dict(c.engine_kwargs)
    for key in ("model", "tokenizer", "served_model_name"):
        if key in out:
            raise ValueError(f"invalid llm_configs args: engine_kwargs.{key}: set it in model_loading_config")
    m = c.model_loading_config
    out["model"] = m.model_source or m.model_id
    out["served_model_name"] = m.model_id
    if m.tokenizer_source:
        out["tokenizer"] = m.tokenizer_source
    deployment = dict(c.deployment_config)
    if c.accelerator_type:
        deployment["accelerator_type"] = c.accelerator_type
    if c.runtime_env:
        deployment["runtime_env"] = c.runtime_env
    pg = c.placement_group_config
    if pg is not None:
        deployment["placement_group_strategy"] = pg.strategy
        if pg.bundles is not None or pg.bundle_per_worker is not None:
            tp = int(out.get("tensor_parallel_size") or 1)  # Ray Serve LLM repeats bundle_per_worker per worker
            deployment["placement_group_bundles"] = pg.bundles if pg.bundles is not None else \
                [dict(pg.bundle_per_worker) for _ in range(tp)]
    if deployment:
        out["deployment"] = deployment
    if s.ingress_deployment_config:
        out["router"] = dict(s.ingress_deployment_config)
    _check_paths(out, deployment, s.ingress_deployment_config)
    out["api_key_env"] = KEY_ENV  # the key works as in every config (Ray Serve LLM's YAML has no field for it)
    return out


def _check_paths(engine_and_app: dict[str, Any], deployment: dict[str, Any], ingress: dict[str, Any]) -> None:
    """Check each part where the user wrote it, so an error names the YAML's path, not ours."""
    from peagle_cluster.settings import APP_KEYS, DeploymentOptions, RouterOptions

    engine = {k: v for k, v in engine_and_app.items() if k not in APP_KEYS}
    for where, check in (("llm_configs[0].engine_kwargs", lambda: parse_engine_config(**engine)),
                         ("llm_configs[0].deployment_config", lambda: DeploymentOptions(**deployment)),
                         ("ingress_deployment_config", lambda: RouterOptions(**ingress))):
        try:
            check()
        except ValidationError as e:
            raise ValueError(f"invalid llm_configs args: {where}: "
                             + format_validation_error(e).removeprefix("invalid engine arguments: ").replace("Value error, ", "")) from None
        except ValueError as e:
            raise ValueError(f"invalid llm_configs args: {where}: "
                             + str(e).removeprefix("invalid engine arguments: ")) from None
