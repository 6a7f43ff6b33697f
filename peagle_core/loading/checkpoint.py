"""Hugging Face safetensors checkpoints: read (with or without an index), validate, load once, write.

Loading validates every name and shape from the file headers before any tensor is read, so a bad
checkpoint fails with one line naming the file and tensor and nothing is half-loaded. The model is
built on the meta device and materialised once on the target device.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from peagle_core.config import DrafterConfig, GptOssConfig
from peagle_core.loading import mxfp4
from peagle_core.models.drafter import Drafter
from peagle_core.models.gpt_oss import GptOss

# (full name, full tensor, this rank's parameter shape) -> this rank's slice; identity without tensor parallelism
Shard = Callable[[str, torch.Tensor, torch.Size], torch.Tensor]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# What MXFP4 experts on disk become: "auto" keeps them packed on CUDA (the kernels expand them in
# registers) and dequantises elsewhere; "mxfp4" always keeps them packed; "none" always dequantises.
Quantization = Literal["auto", "mxfp4", "none"]

EXPERT_TENSORS = {"w1": "gate_up_proj", "b1": "gate_up_proj_bias", "w2": "down_proj", "b2": "down_proj_bias"}


class CheckpointError(ValueError):
    pass


class SafetensorsDir:
    """The tensors of a checkpoint directory: name -> (file, shape), read lazily."""

    def __init__(self, path: Path):
        self.path = path
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {path}")
        self.where: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            if not (path / f).exists():
                raise CheckpointError(f"{path / f} is named in the index but missing")
            with safe_open(path / f, framework="pt") as sf:
                for name in sf.keys():
                    self.where[name] = f
                    self.shapes[name] = tuple(sf.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self.path / self.where[name], framework="pt") as sf:
            return sf.get_tensor(name)

    def describe(self, name: str) -> str:
        return f"tensor {name!r} in {self.path / self.where[name]}"


def read_json(path: Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"missing {path.name} in {path.parent}")
    return json.loads(path.read_text())


# --------------------------------------------------------------------------------------------
# Target
# --------------------------------------------------------------------------------------------


def target_sources(name: str, ckpt: SafetensorsDir) -> tuple[list[str], Callable[..., torch.Tensor]]:
    """Which checkpoint tensors make our parameter `name`, and how (transpose, MXFP4 decode)."""
    if ".mlp.experts." in name:
        prefix, ours = name.rsplit(".", 1)
        if ours.endswith(("_blocks", "_scales")):  # packed experts: the bytes on disk as they are
            mat, part = ours.split("_")
            return [f"{prefix}.{EXPERT_TENSORS[mat]}_{part}"], _as_bytes
        hf = EXPERT_TENSORS[ours]
        if ours in ("w1", "w2") and f"{prefix}.{hf}_blocks" in ckpt.shapes:
            return [f"{prefix}.{hf}_blocks", f"{prefix}.{hf}_scales"], mxfp4.dequantize
        if ours in ("w1", "w2"):
            return [f"{prefix}.{hf}"], lambda t: t.transpose(-1, -2)  # transformers keeps [E, in, out]
        return [f"{prefix}.{hf}"], lambda t: t
    return [name], lambda t: t


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.element_size() != 1:
        raise CheckpointError(f"MXFP4 blocks and scales must be 1-byte tensors, got {t.dtype}")
    return t.view(torch.uint8)  # e.g. scales saved as float8_e8m0fnu: the same bits


def keep_mxfp4(ckpt: SafetensorsDir, device: torch.device | str, quantization: Quantization = "auto") -> bool:
    """Whether this load keeps the experts packed (see `Quantization`), at any tensor-parallel size: ranks split
    them on whole 32-weight blocks, padding the last rank's share (`models.gpt_oss.expert_shard_size`)."""
    if quantization not in ("auto", "mxfp4", "none"):
        raise ValueError(f"quantization must be 'auto', 'mxfp4' or 'none', got {quantization!r}")
    on_disk = any(n.endswith(".mlp.experts.gate_up_proj_blocks") for n in ckpt.shapes)
    if quantization == "mxfp4" and not on_disk:
        raise ValueError(f"quantization='mxfp4' needs a checkpoint with MXFP4 experts (*_blocks / *_scales); "
                         f"{ckpt.path} stores them dense")
    if quantization == "none" or not on_disk:
        return False
    return quantization == "mxfp4" or torch.device(device).type == "cuda"


def load_target(path: Path, dtype: torch.dtype, device: torch.device | str, tp_size: int = 1,
                shard: Shard | None = None, quantization: Quantization = "auto") -> GptOss:
    cfg = GptOssConfig.from_hf(read_json(path / "config.json"))
    ckpt = SafetensorsDir(path)
    packed = keep_mxfp4(ckpt, device, quantization)
    with torch.device("meta"):
        full = GptOss(cfg, mxfp4_experts=packed)
        model = GptOss(cfg, tp_size, mxfp4_experts=packed)
    _load(model, full, ckpt, lambda n: target_sources(n, ckpt), dtype, device, shard)
    return model


def _load(model: nn.Module, full: nn.Module, ckpt: SafetensorsDir,
          sources: Callable[[str], tuple[list[str], Callable[..., torch.Tensor]]],
          dtype: torch.dtype, device, shard: Shard | None, optional: dict[str, torch.Tensor] | None = None,
          ignore: tuple[str, ...] = ()) -> None:
    """Validate the whole plan from headers, then materialise each parameter once."""
    full_params = dict(full.state_dict())
    plan, used = {}, set()
    for name, p in full_params.items():
        srcs, fn = sources(name)
        missing = [s for s in srcs if s not in ckpt.shapes]
        if missing:
            if optional and name in optional:
                continue
            raise CheckpointError(f"missing tensor {missing[0]!r} in {ckpt.path} (needed for {name})")
        shapes = [ckpt.shapes[s] for s in srcs]
        expect = _source_shape(name, p.shape, srcs)
        if shapes[0] != expect:
            raise CheckpointError(f"{ckpt.describe(srcs[0])} has shape {list(shapes[0])}, expected {list(expect)}")
        plan[name] = (srcs, fn)
        used.update(srcs)
    ignored = {n for n in ckpt.shapes if ignore and n.endswith(ignore)}
    unknown = sorted(set(ckpt.shapes) - used - ignored)
    if unknown:
        raise CheckpointError(f"unknown {ckpt.describe(unknown[0])}" + (f" (+{len(unknown) - 1} more)" if len(unknown) > 1 else ""))

    model.to(dtype=dtype).to_empty(device=device)  # still on meta until here: one allocation
    local = dict(model.state_dict())
    with torch.no_grad():
        for name, t in local.items():
            if name in plan:
                srcs, fn = plan[name]
                value = fn(*(ckpt.get(s) for s in srcs))
            else:
                value = optional[name]
            if shard is not None:
                value = shard(name, value, t.shape)
            if value.shape != t.shape:
                raise CheckpointError(f"{name}: shard shape {list(value.shape)} != parameter {list(t.shape)}")
            t.copy_(value)
    model.eval().requires_grad_(False)


def _source_shape(name: str, shape: torch.Size, srcs: list[str]) -> tuple[int, ...]:
    """The on-disk shape expected for a parameter of `shape` given its source kind."""
    if name.endswith(("_blocks", "_scales")):  # packed parameter: stored as on disk
        return tuple(shape)
    if srcs[0].endswith("_blocks"):
        return (*shape[:-1], shape[-1] // mxfp4.BLOCK, mxfp4.BLOCK // 2)
    if srcs[0].endswith(("gate_up_proj", "down_proj")):
        return (*shape[:-2], shape[-1], shape[-2])
    return tuple(shape)


def save_target(model: GptOss, path: Path, mxfp4_experts: bool = False, max_shard_bytes: int | None = None,
                generation_config: dict | None = None) -> None:
    """Write `model` as a Hugging Face GPT-OSS checkpoint (bf16-layout or MXFP4 experts)."""
    cfg = model.config.model_copy(update={"quant_method": "mxfp4" if mxfp4_experts else None})
    tensors: dict[str, torch.Tensor] = {}
    state = model.state_dict()
    for name, t in state.items():
        t = t.detach().cpu()
        if ".mlp.experts." not in name:
            tensors[name] = t
            continue
        prefix, ours = name.rsplit(".", 1)
        mat = ours.split("_")[0]
        hf = EXPERT_TENSORS[mat]
        if ours in ("b1", "b2"):
            tensors[f"{prefix}.{hf}"] = t
        elif ours.endswith("_scales"):
            continue  # written with its blocks
        elif ours.endswith("_blocks"):  # a model holding packed experts
            scales = state[f"{prefix}.{mat}_scales"].detach().cpu()
            if mxfp4_experts:
                tensors[f"{prefix}.{hf}_blocks"], tensors[f"{prefix}.{hf}_scales"] = t, scales
            else:
                dense = mxfp4.dequantize(t, scales, model.lm_head.weight.dtype)
                tensors[f"{prefix}.{hf}"] = dense.transpose(-1, -2).contiguous()
        elif mxfp4_experts:
            tensors[f"{prefix}.{hf}_blocks"], tensors[f"{prefix}.{hf}_scales"] = mxfp4.quantize(t)
        else:
            tensors[f"{prefix}.{hf}"] = t.transpose(-1, -2).contiguous()
    _write(tensors, path, cfg.to_hf(), max_shard_bytes)
    gen = generation_config or {"eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))


def _write(tensors: dict[str, torch.Tensor], path: Path, config: dict, max_shard_bytes: int | None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if not max_shard_bytes:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return
    shards, current, size = [], {}, 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[k], size = v, size + nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


# --------------------------------------------------------------------------------------------
# Drafter
# --------------------------------------------------------------------------------------------


def load_drafter(path: Path, target: GptOss, dtype: torch.dtype, device: torch.device | str,
                 shard: Shard | None = None, target_path: Path | None = None) -> Drafter:
    """Load an EAGLE-3 / P-EAGLE head and check that it fits `target`. A head without its own LM head takes the
    target's: from `target_path`'s checkpoint when the target holds only its tensor-parallel slice of it."""
    cfg = DrafterConfig.from_hf(read_json(path / "config.json"))
    tcfg = target.config
    if cfg.target_hidden_size != tcfg.hidden_size:
        raise ValueError(f"drafter {path} expects target hidden size {cfg.target_hidden_size}, the target has {tcfg.hidden_size}")
    if cfg.vocab_size != tcfg.vocab_size or cfg.draft_vocab_size > tcfg.vocab_size:
        raise ValueError(f"drafter {path} vocabulary ({cfg.vocab_size}, draft {cfg.draft_vocab_size}) "
                         f"does not fit the target's {tcfg.vocab_size}")
    aux = cfg.resolved_aux_layer_ids(tcfg.num_hidden_layers)
    if any(not 0 <= i <= tcfg.num_hidden_layers for i in aux):
        raise ValueError(f"drafter {path} reads target layers {aux}; the target has {tcfg.num_hidden_layers}")
    ckpt = SafetensorsDir(path)
    fc_in = ckpt.shapes.get("fc.weight", (0, 3 * tcfg.hidden_size))[1]
    if fc_in != len(aux) * tcfg.hidden_size:
        raise ValueError(f"drafter {path}: fc takes {fc_in} inputs, expected {len(aux)} x {tcfg.hidden_size}")
    with torch.device("meta"):
        full, model = Drafter(cfg, len(aux)), Drafter(cfg, len(aux))
    # Published heads may omit the embedding or LM head and share the target's (as vLLM does).
    optional = {"d2t": torch.zeros(cfg.draft_vocab_size, dtype=torch.long)}
    if cfg.hidden_size == tcfg.hidden_size:
        optional["embed_tokens.weight"] = target.model.embed_tokens.weight
        if cfg.draft_vocab_size == tcfg.vocab_size and "lm_head.weight" not in ckpt.shapes:
            optional["lm_head.weight"] = target.lm_head.weight if target.lm_head.world == 1 \
                else _target_tensor(target_path, "lm_head.weight")
    _load(model, full, ckpt, lambda n: ([n], lambda t: t), dtype, device, shard, optional, ignore=("t2d",))
    return model


def _target_tensor(path: Path | None, name: str) -> torch.Tensor:
    if path is None:
        raise ValueError(f"the target holds a slice of {name}; pass target_path to read the whole tensor")
    return SafetensorsDir(path).get(name)


def save_drafter(model: Drafter, path: Path, exclude: tuple[str, ...] = ()) -> None:
    """Write the head; `exclude` drops tensors shared with the target (loaders take the target's)."""
    tensors = {k: v.detach().cpu() for k, v in model.state_dict().items() if k not in exclude}
    _write(tensors, path, model.config.to_hf() | {"eagle_config": {
        "use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": model.config.aux_layer_ids}}, None)


# --------------------------------------------------------------------------------------------
# Random weights (tests, benchmarks at real shapes)
# --------------------------------------------------------------------------------------------


def init_random_(model: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Deterministic random weights; norms near 1 and sinks of order 1 so every path is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dtype == torch.uint8:  # packed MXFP4 experts (no dense copy: 120B-shaped models fit)
                p.copy_(_random_mxfp4(name, p.shape, g))
                continue
            if name.endswith("norm.weight"):
                vals = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif name.endswith("sinks"):
                vals = torch.randn(p.shape, generator=g)
            elif name.endswith("mask_hidden"):
                vals = torch.randn(p.shape, generator=g)
            elif p.dim() == 1:
                vals = std * torch.randn(p.shape, generator=g)
            else:
                fan_in = p.shape[-1]
                vals = torch.randn(p.shape, generator=g) / fan_in ** 0.5
            p.copy_(vals.to(p.dtype))
    return model


def _random_mxfp4(name: str, shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    """Uniform FP4 codes; one scale for all blocks, chosen so the weights' RMS is about fan_in^-1/2 like
    the dense init (uniform codes have RMS sqrt(mean(LUT^2)) = 2.93)."""
    if name.endswith("_blocks"):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    fan_in = shape[-1] * mxfp4.BLOCK
    return torch.full(shape, 127 + round(math.log2(fan_in ** -0.5 / 2.93)), dtype=torch.uint8)
