"""The tiny GPT-OSS model pair's architecture.

The trained target, tokenizer and drafters ship under `peagle_core/assets/tiny/` (see its model card);
`model: tiny` resolves there and fails loudly when they are missing (`loading/hub.py`).
"""
from __future__ import annotations

from pathlib import Path

from peagle_core.config import DrafterConfig, GptOssConfig

ASSETS = Path(__file__).resolve().parent / "assets" / "tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
MASK_TOKEN_ID = 9  # <|reserved_mask|> in the tiny tokenizer


def target_config() -> GptOssConfig:
    """Small but complete GPT-OSS: sinks, alternating sliding/full attention, 8 experts top-2, YaRN."""
    return GptOssConfig(vocab_size=8192, hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=2,
                        intermediate_size=256, sliding_window=128, max_position_embeddings=4096,
                        eos_token_id=[2, 1, 8], pad_token_id=1)


def drafter_config(parallel: bool, layers: int | None = None) -> DrafterConfig:
    t = target_config()
    return DrafterConfig(hidden_size=t.hidden_size, num_hidden_layers=layers or (2 if parallel else 1),
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=768,
                         vocab_size=t.vocab_size, draft_vocab_size=t.vocab_size, target_hidden_size=t.hidden_size,
                         max_position_embeddings=t.max_position_embeddings, aux_layer_ids=[1, 3, 5],
                         mask_token_id=MASK_TOKEN_ID if parallel else None, parallel_drafting=parallel)
