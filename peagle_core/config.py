"""Typed configuration: the target and drafter architectures, and the engine's knobs.

Foreign configs (Hugging Face `config.json`) are turned into these models once, in `from_hf`;
everything downstream reads typed fields. Engine arguments follow vLLM's names.
"""
from __future__ import annotations

import math
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class Strict(BaseModel):
    """Unknown keys are an error, so a typo in a YAML file never passes silently."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


# --------------------------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------------------------


class YarnScaling(Strict):
    rope_type: Literal["yarn"] = "yarn"
    factor: float = 32.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 4096
    truncate: bool = False


class GptOssConfig(Strict):
    """The GPT-OSS target architecture (defaults: gpt-oss-20b)."""

    vocab_size: int = 201088
    hidden_size: int = 2880
    num_hidden_layers: int = 24
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 32
    num_experts_per_tok: int = 4
    intermediate_size: int = 2880
    sliding_window: int | None = 128
    layer_types: list[Literal["sliding_attention", "full_attention"]] | None = None
    rope_theta: float = 150000.0
    rope_scaling: YarnScaling | None = Field(default_factory=YarnScaling)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    eos_token_id: list[int] = Field(default_factory=lambda: [200002])
    pad_token_id: int | None = 199999
    quant_method: Literal["mxfp4"] | None = None

    @model_validator(mode="after")
    def _check(self) -> "GptOssConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        return self

    def layer_window(self, i: int) -> int | None:
        """Sliding window of layer i (None = full attention). Even layers slide by default."""
        kinds = self.layer_types or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers)]
        return self.sliding_window if kinds[i] == "sliding_attention" else None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "GptOssConfig":
        if hf.get("model_type", "gpt_oss") != "gpt_oss":
            raise ValueError(f"model_type {hf.get('model_type')!r} is not gpt_oss")
        rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        theta = hf.get("rope_theta", rope.pop("rope_theta", 150000.0))
        rope.pop("rope_theta", None)
        scaling = None
        if rope and rope.get("rope_type", rope.get("type")) == "yarn":
            rope.pop("type", None)
            rope["rope_type"] = "yarn"
            scaling = YarnScaling(**{k: v for k, v in rope.items() if k in YarnScaling.model_fields})
        elif rope and rope.get("rope_type", rope.get("type")) not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling {rope!r}: GPT-OSS uses yarn")
        quant = hf.get("quantization_config") or {}
        qm = quant.get("quant_method")
        if qm not in (None, "mxfp4"):
            raise ValueError(f"unsupported quant_method {qm!r} in config.json (supported: mxfp4 or none)")
        eos = hf.get("eos_token_id", [200002])
        fields = {k: hf[k] for k in cls.model_fields if k in hf and k not in ("rope_scaling", "rope_theta", "eos_token_id", "quant_method")}
        if "num_local_experts" not in hf and "num_experts" in hf:
            fields["num_local_experts"] = hf["num_experts"]
        if "num_experts_per_tok" not in hf and "experts_per_token" in hf:
            fields["num_experts_per_tok"] = hf["experts_per_token"]
        return cls(**fields, rope_theta=theta, rope_scaling=scaling, quant_method=qm,
                   eos_token_id=eos if isinstance(eos, list) else [eos])

    def to_hf(self) -> dict[str, Any]:
        """config.json as transformers writes it (so `GptOssForCausalLM` can load our checkpoints)."""
        d = self.model_dump(exclude={"quant_method", "swiglu_alpha"})
        d["layer_types"] = [("sliding_attention" if self.layer_window(i) else "full_attention")
                            for i in range(self.num_hidden_layers)]
        d.update(model_type="gpt_oss", architectures=["GptOssForCausalLM"], attention_bias=True,
                 tie_word_embeddings=False, hidden_act="silu", experts_per_token=self.num_experts_per_tok)
        if self.quant_method:
            d["quantization_config"] = {"quant_method": self.quant_method, "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        return d


class DrafterConfig(Strict):
    """An EAGLE-3 / P-EAGLE drafter head in the published (vLLM `LlamaForCausalLMEagle3`) layout."""

    hidden_size: int
    num_hidden_layers: int = 1
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 131072
    norm_before_residual: bool = False
    aux_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    parallel_drafting: bool = False  # how the head was trained; the engine mode comes from SpeculativeConfig

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "DrafterConfig":
        eagle = hf.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids", hf.get("eagle_aux_hidden_state_layer_ids"))
        mask = next((hf[k] for k in ("ptd_token_id", "mask_token_id", "pard_token") if hf.get(k) is not None), None)
        heads = hf["num_attention_heads"]
        return cls(
            hidden_size=hf["hidden_size"], num_hidden_layers=hf.get("num_hidden_layers", 1),
            num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, intermediate_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"], draft_vocab_size=hf.get("draft_vocab_size") or hf["vocab_size"],
            target_hidden_size=hf.get("target_hidden_size") or hf["hidden_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5), rope_theta=hf.get("rope_theta", 10000.0),
            rope_scaling=hf.get("rope_scaling"), max_position_embeddings=hf.get("max_position_embeddings", 131072),
            norm_before_residual=hf.get("norm_before_residual", False), aux_layer_ids=aux,
            mask_token_id=mask, parallel_drafting=bool(hf.get("parallel_drafting", mask is not None)),
        )

    def to_hf(self) -> dict[str, Any]:
        d = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "hidden_act": "silu",
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": False,
            "norm_before_residual": self.norm_before_residual, "parallel_drafting": self.parallel_drafting,
            "eagle_config": {"use_aux_hidden_state": True,
                             "eagle_aux_hidden_state_layer_ids": self.aux_layer_ids},
        }
        if self.mask_token_id is not None:
            d["ptd_token_id"] = self.mask_token_id
        return d

    def resolved_aux_layer_ids(self, num_target_layers: int) -> list[int]:
        """vLLM's default when the checkpoint names none: the residual entering layers (2, L/2, L-3)."""
        return list(self.aux_layer_ids) if self.aux_layer_ids else [2, num_target_layers // 2, num_target_layers - 3]


# --------------------------------------------------------------------------------------------
# Engine arguments (vLLM names)
# --------------------------------------------------------------------------------------------


class EmaTiersConfig(Strict):
    """SGLang-like adaptive tiers (`--speculative-adaptive-config`): an EMA of the accepted drafts per
    verify picks k among `candidate_steps`. Defaults are SGLang's."""

    candidate_steps: list[int] = Field(default_factory=lambda: [1, 3, 7], min_length=1)
    ema_alpha: float = Field(default=0.2, gt=0, le=1)
    update_interval: int = Field(default=5, ge=1)
    warmup_steps: int = Field(default=10, ge=0)
    up_hysteresis: float = 0.0
    down_hysteresis: float = -0.25

    @field_validator("candidate_steps")
    @classmethod
    def _tiers(cls, v: list[int]) -> list[int]:
        if any(k < 1 for k in v):  # a tier of 0 would verify nothing and never learn to leave it
            raise ValueError("candidate_steps must be >= 1")
        return sorted(set(v))


DepthPolicyName = Literal["fixed", "adaptive", "batch_table", "ema_tiers"]
DEPTH_POLICIES: tuple[str, ...] = get_args(DepthPolicyName)


class SpeculativeConfig(Strict):
    """vLLM's `speculative_config` keys, plus how the depth k <= K is chosen each step (ours).

    P-EAGLE is `{"method": "eagle3", "model": HEAD, "num_speculative_tokens": K, "parallel_drafting": true}`;
    `"method": "peagle"` is an alias that implies `parallel_drafting`.

    `depth_policy`: `fixed` (always K), `adaptive` (goodput-optimal k per step; `adaptive: true` is the
    same), `batch_table` (vLLM's `num_speculative_tokens_per_batch_size`: `[[start_bs, end_bs, k], ...]`,
    which alone selects it, as in vLLM) or `ema_tiers` (SGLang-like; parameters in `ema_tiers`).
    """

    method: Literal["eagle3", "peagle", "none"] = "eagle3"
    model: str | None = None
    revision: str | None = None
    num_speculative_tokens: int = Field(default=5, ge=1, le=32)
    parallel_drafting: bool = False
    adaptive: bool = False
    min_num_speculative_tokens: int = Field(default=0, ge=0)
    depth_policy: DepthPolicyName | None = None
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = None
    ema_tiers: EmaTiersConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _resolve_policy(cls, data: Any) -> Any:
        """Fill `depth_policy` from the aliases (`adaptive: true`, a batch table, EMA parameters)."""
        if not isinstance(data, dict):
            return data
        given = {"adaptive": data.get("adaptive") is True,
                 "batch_table": data.get("num_speculative_tokens_per_batch_size") is not None,
                 "ema_tiers": data.get("ema_tiers") is not None}
        implied = [name for name, yes in given.items() if yes]
        chosen = data.get("depth_policy")
        names = set(implied) | ({chosen} if chosen is not None else set())
        if len(names) > 1:
            raise ValueError(f"speculative_config: conflicting depth policies {sorted(names)} (set one of "
                             "depth_policy, adaptive: true, num_speculative_tokens_per_batch_size, ema_tiers)")
        if chosen is None and implied:
            data = {**data, "depth_policy": implied[0]}
        if data.get("depth_policy") == "adaptive":
            data = {**data, "adaptive": True}
        return data

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.method != "none" and not self.model:
            raise ValueError(f"speculative_config: method {self.method!r} needs 'model' (the drafter checkpoint)")
        if self.min_num_speculative_tokens > self.num_speculative_tokens:
            raise ValueError("speculative_config: min_num_speculative_tokens > num_speculative_tokens")
        K = self.num_speculative_tokens
        if self.depth_policy == "batch_table":
            if not self.num_speculative_tokens_per_batch_size:
                raise ValueError("speculative_config: depth_policy 'batch_table' needs "
                                 "num_speculative_tokens_per_batch_size: [[start_bs, end_bs, k], ...]")
            check_batch_table(self.num_speculative_tokens_per_batch_size, K)
        tiers = self.ema_tiers
        if tiers is not None and "candidate_steps" in tiers.model_fields_set and max(tiers.candidate_steps) > K:
            # Only tiers the user wrote: SGLang's default tiers (1, 3, 7) are clipped to K.
            raise ValueError(f"speculative_config: ema_tiers.candidate_steps must be <= num_speculative_tokens ({K})")
        return self

    @property
    def policy(self) -> DepthPolicyName:
        """The depth policy in force (`fixed` unless one was chosen)."""
        return self.depth_policy or "fixed"

    @property
    def mode(self) -> Literal["peagle", "eagle3", "none"]:
        if self.method == "none":
            return "none"
        return "peagle" if self.parallel_drafting or self.method == "peagle" else "eagle3"


def check_batch_table(table: list[tuple[int, int, int]], K: int) -> None:
    """vLLM's rule set: ranges of batch sizes, contiguous from 1, each with a k in 0..K."""
    prev_end = 0
    for start, end, k in table:
        if start != prev_end + 1 or end < start:
            raise ValueError(f"speculative_config: num_speculative_tokens_per_batch_size entries must be "
                             f"[start_bs, end_bs, k] ranges contiguous from batch size 1; [{start}, {end}, {k}] "
                             f"does not follow {prev_end}")
        if not 0 <= k <= K:
            raise ValueError(f"speculative_config: num_speculative_tokens_per_batch_size k={k} for batch sizes "
                             f"{start}..{end} is outside 0..num_speculative_tokens ({K})")
        prev_end = end


class EngineConfig(Strict):
    """Everything `LLM(...)` and a serve config's `args` accept."""

    model: str = "tiny"
    tokenizer: str | None = None
    revision: str | None = None            # Hub branch, tag or commit of `model`
    tokenizer_revision: str | None = None
    download_dir: str | None = None        # Hub cache directory (default: huggingface_hub's)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    device: str | None = None
    seed: int = 0
    tensor_parallel_size: int = Field(default=1, ge=1)
    max_num_seqs: int = Field(default=32, ge=1)
    max_model_len: int | None = Field(default=None, ge=2)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    block_size: int = Field(default=16, ge=1)
    num_gpu_blocks: int | None = Field(default=None, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    kv_cache_memory_gb: float | None = Field(default=None, gt=0)
    enforce_eager: bool = False
    enable_prefix_caching: bool = True  # vLLM's automatic prefix caching (engine/block_manager.py)
    use_triton: bool | None = None
    # MXFP4 experts: "auto" keeps them packed on CUDA and dequantises elsewhere; "mxfp4" always packed; "none" dequantised
    quantization: Literal["auto", "mxfp4", "none"] = "auto"
    speculative_config: SpeculativeConfig | None = None

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _spec(cls, v: Any) -> Any:
        return None if v in (None, {}, "none") else v

    @property
    def spec_mode(self) -> Literal["peagle", "eagle3", "none"]:
        return self.speculative_config.mode if self.speculative_config else "none"

    @property
    def num_spec_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.spec_mode != "none" else 0


def parse_engine_config(**kwargs: Any) -> EngineConfig:
    """Build an EngineConfig, turning pydantic's report into one readable ValueError."""
    try:
        return EngineConfig(**kwargs)
    except ValidationError as e:
        raise ValueError(format_validation_error(e)) from None


def format_validation_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "config"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown key {loc!r}")
        else:
            parts.append(f"{loc}: {err['msg']}")
    return "invalid engine arguments: " + "; ".join(parts)


def yarn_inv_freq(head_dim: int, base: float, s: YarnScaling | None) -> tuple[list[float], float]:
    """YaRN ("NTK by parts") inverse frequencies and attention factor, computed exactly (no rounding)."""
    half = head_dim // 2
    pos_freq = [base ** (2 * j / head_dim) for j in range(half)]
    if s is None:
        return [1.0 / f for f in pos_freq], 1.0

    def corr(r: float) -> float:
        return head_dim * math.log(s.original_max_position_embeddings / (r * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(s.beta_fast), corr(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    inv = []
    for j in range(half):
        ramp = min(max((j - low) / (high - low), 0.0), 1.0)
        w_extrap = 1.0 - ramp
        inv.append((1.0 / (s.factor * pos_freq[j])) * (1 - w_extrap) + (1.0 / pos_freq[j]) * w_extrap)
    return inv, 0.1 * math.log(s.factor) + 1.0
