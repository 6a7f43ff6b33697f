"""EAGLE-3 / P-EAGLE drafter head in the published layout (vLLM's `LlamaForCausalLMEagle3`).

Layer 0 (`midlayer`) attends over `[input_layernorm(embed(token)), hidden_norm(h)]` (2H wide);
layers 1.. are plain Llama layers. `h` is `fc(aux target hidden states)` on real slots, the
drafter's own pre-norm output when EAGLE-3 feeds itself back, and `fc(mask_hidden)` (the learned
shared hidden state, projected once) on P-EAGLE's MASK slots.
"""
from __future__ import annotations

import torch
from torch import nn

from peagle_core.config import DrafterConfig
from peagle_core.models.layers import Attention, ForwardMeta, RMSNorm, Rotary, llama_inv_freq


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, first: bool, rotary: Rotary):
        super().__init__()
        h = cfg.hidden_size
        self.first, self.norm_before_residual = first, cfg.norm_before_residual
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(2 * h if first else h, h, cfg.num_attention_heads, cfg.num_key_value_heads,
                                   cfg.head_dim, bias=False, sinks=False, sliding_window=None, rotary=rotary)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, meta: ForwardMeta, embeds: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.first:
            normed = self.hidden_norm(x)
            residual = normed if self.norm_before_residual else x
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        else:
            x, residual = self.input_layernorm.add_norm(x, residual)
        x, residual = self.post_attention_layernorm.add_norm(self.self_attn(x, meta), residual)
        return self.mlp(x), residual


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, num_aux: int = 3):
        super().__init__()
        self.config = cfg
        rotary = self.rotary = Rotary(llama_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DrafterLayer(cfg, True, rotary)
        self.layers = nn.ModuleDict({str(i): DrafterLayer(cfg, False, rotary) for i in range(1, cfg.num_hidden_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, num_aux * cfg.target_hidden_size)) \
            if cfg.mask_token_id is not None else None

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """Fuse the target's auxiliary hidden states [T, n_aux * H_t] into the drafter width."""
        return self.fc(aux)

    def shared_hidden(self) -> torch.Tensor:
        """P-EAGLE's learned shared hidden state, projected like a real slot: fc(mask_hidden) [H]."""
        if self.mask_hidden is None:
            raise ValueError("this drafter has no mask_hidden / mask token id: it was not trained for parallel drafting")
        return self.fc(self.mask_hidden.view(-1))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: ForwardMeta
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed hidden for the LM head, pre-norm hidden that EAGLE-3 feeds back)."""
        embeds = self.embed_tokens(input_ids)
        with self.rotary.once_for(meta.positions, embeds.dtype):
            x, residual = self.midlayer(hidden, hidden, meta, embeds)
            for layer in self.layers.values():
                x, residual = layer(x, residual, meta, None)
        return self.norm.add_norm(x, residual)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn, *(layer.self_attn for layer in self.layers.values())]
