"""Small random checkpoints for tests and the CPU demo (no downloads anywhere)."""
from __future__ import annotations

from pathlib import Path

import torch

from peagle_core.config import DrafterConfig, GptOssConfig
from peagle_core.loading.checkpoint import init_random_, save_drafter, save_target
from peagle_core.models.drafter import Drafter
from peagle_core.models.gpt_oss import GptOss


def tiny_target_config(**overrides) -> GptOssConfig:
    """Exercises sinks, a window shorter than test sequences, GQA, several experts and YaRN."""
    base = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=8,
                max_position_embeddings=4096, eos_token_id=[255], pad_token_id=254, swiglu_limit=7.0)
    return GptOssConfig(**(base | overrides))


def tiny_drafter_config(target: GptOssConfig, layers: int = 2, parallel: bool = True, **overrides) -> DrafterConfig:
    base = dict(hidden_size=target.hidden_size, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=128, vocab_size=target.vocab_size, draft_vocab_size=target.vocab_size,
                target_hidden_size=target.hidden_size, aux_layer_ids=[1, 2, 3],
                mask_token_id=target.vocab_size - 3 if parallel else None, parallel_drafting=parallel)
    return DrafterConfig(**(base | overrides))


def build_target(path: Path, cfg: GptOssConfig | None = None, seed: int = 0, mxfp4: bool = False,
                 scale: float = 1.0) -> GptOss:
    """Write a random GPT-OSS checkpoint; `scale` > 1 sharpens logits (peaked, more predictable text)."""
    torch.manual_seed(seed)
    model = init_random_(GptOss(cfg or tiny_target_config()), seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    save_target(model, Path(path), mxfp4_experts=mxfp4)
    return model


def build_drafter(path: Path, target_cfg: GptOssConfig, seed: int = 1, **kw) -> Drafter:
    cfg = tiny_drafter_config(target_cfg, **kw)
    model = init_random_(Drafter(cfg, len(cfg.aux_layer_ids)), seed)
    save_drafter(model, Path(path))
    return model
