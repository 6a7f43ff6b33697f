"""GPT-OSS target model in plain PyTorch (kernels dispatched through `kernels/`).

Parameter names follow the Hugging Face checkpoint, except the experts, which are kept out-major
(`w1 [E, 2I, H]`, `w2 [E, H, I]`) like the MXFP4 blocks on disk; `loading` maps between them.
With `mxfp4_experts` the expert matrices stay packed as on disk (`w1_blocks`/`w1_scales`, ...).
Under tensor parallelism (`tp_size` N) each rank's layers hold its shard (`engine/tp.py`) and the LM head
its slice of the vocabulary (`VocabParallelHead`).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from peagle_kernels.moe import Routing, moe, moe_mxfp4, norm_and_route
from peagle_core.config import GptOssConfig, yarn_inv_freq
from peagle_core.models.layers import Attention, ForwardMeta, RMSNorm, Rotary


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(num_experts))


def expert_shard_size(inter: int, tp_size: int, mxfp4: bool) -> int:
    """Each rank's share of the intermediate size. Packed MXFP4 experts split on whole 32-weight blocks (their scales
    cover 32 channels): ceil(blocks / N) blocks a rank, the last rank's padded with zero channels (2880 at TP=4:
    23 blocks = 736, the last rank 672 + 64 zeros). A zero channel adds exactly nothing: its gate and up are 0, so
    its SwiGLU is 0 * sigmoid(0) * (0 + 1) = 0, and its down-projection column is 0 too."""
    if not mxfp4:
        return inter // tp_size
    if inter % 32:
        raise ValueError(f"MXFP4 experts need hidden and intermediate sizes that are multiples of 32 (whole blocks), "
                         f"got intermediate_size={inter}")
    return -(-inter // (32 * tp_size)) * 32


class Experts(nn.Module):
    """The experts of one layer, in one of two storages (`mxfp4` says which):

    dense   `w1 [E, 2I, H]`, `w2 [E, H, I]` in the model dtype;
    mxfp4   packed as on disk, 4.25 bits a weight: `w1_blocks [E, 2I, H/32, 16]`, `w1_scales [E, 2I, H/32]`,
            `w2_blocks [E, H, I/32, 16]`, `w2_scales [E, H, I/32]` (uint8, frozen), expanded only in the kernel.
    Biases `b1 [E, 2I]`, `b2 [E, H]` are in the model dtype either way.
    """

    def __init__(self, num_experts: int, hidden: int, inter: int, mxfp4: bool = False):
        super().__init__()
        self.mxfp4 = mxfp4
        if mxfp4:
            if hidden % 32 or inter % 32:
                raise ValueError(f"MXFP4 experts need hidden ({hidden}) and intermediate ({inter}) sizes that are "
                                 "multiples of 32 (whole blocks)")
            self.w1_blocks = _frozen(num_experts, 2 * inter, hidden // 32, 16)
            self.w1_scales = _frozen(num_experts, 2 * inter, hidden // 32)
            self.w2_blocks = _frozen(num_experts, hidden, inter // 32, 16)
            self.w2_scales = _frozen(num_experts, hidden, inter // 32)
        else:
            self.w1 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
            self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.b1 = nn.Parameter(torch.zeros(num_experts, 2 * inter))
        self.b2 = nn.Parameter(torch.zeros(num_experts, hidden))

    def forward(self, x: torch.Tensor, router: Router, top_k: int, alpha: float, limit: float, *,
                reduce: bool = True, routing: Routing | None = None) -> torch.Tensor:
        if self.mxfp4:
            return moe_mxfp4(x, router.weight, router.bias, self.w1_blocks, self.w1_scales, self.b1,
                             self.w2_blocks, self.w2_scales, self.b2, top_k, alpha, limit, reduce=reduce,
                             routing=routing)
        return moe(x, router.weight, router.bias, self.w1, self.b1, self.w2, self.b2, top_k, alpha, limit,
                   reduce=reduce, routing=routing)


def _frozen(*shape: int) -> nn.Parameter:
    """Packed bytes: a parameter (so it loads, shards and counts like the others) that is never trained."""
    return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)


class MoE(nn.Module):
    def __init__(self, cfg: GptOssConfig, inter: int | None = None, mxfp4_experts: bool = False):
        super().__init__()
        self.router = Router(cfg.hidden_size, cfg.num_local_experts)
        self.experts = Experts(cfg.num_local_experts, cfg.hidden_size, inter or cfg.intermediate_size, mxfp4_experts)
        self.top_k, self.alpha, self.limit = cfg.num_experts_per_tok, cfg.swiglu_alpha, cfg.swiglu_limit

    def forward(self, x: torch.Tensor, *, reduce: bool = True, routing: Routing | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H], or with reduce=False summands [T, S, H] whose sum over S is that (`peagle_kernels.moe`).
        `routing`: x's, from `norm_and_route` (else routed here)."""
        return self.experts(x, self.router, self.top_k, self.alpha, self.limit, reduce=reduce, routing=routing)

    def norm_and_route(self, h: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                       ) -> tuple[torch.Tensor, torch.Tensor, Routing]:
        """`norm.add_norm(h, residual)` and the routing of its output, for `forward(x, routing=)`: at decode sizes
        on the GPU one launch does both (`peagle_kernels.moe.norm_and_route`)."""
        return norm_and_route(h, residual, norm.weight, norm.eps, self.router.weight, self.router.bias, self.top_k)


def single_rank(t: torch.Tensor) -> torch.Tensor:
    """`DecoderLayer.all_reduce` without tensor parallelism: nothing to add up. Tensor parallelism replaces it
    (`engine.tp.install_collectives`); a layer that still holds this very function may hand on MoE summands."""
    return t


def residual_stream(h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The residual-stream value a (h, residual) pair carried between layers stands for: h + residual, with
    MoE summands h [T, S, H] summed first, as the norm they go to sums them (`peagle_kernels.norm`)."""
    if residual is not None and h.dim() == residual.dim() + 1:
        h = h.sum(-2)
    return h if residual is None else h + residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: GptOssConfig, idx: int, rotary: Rotary, heads: int, kv_heads: int, inter: int,
                 mxfp4_experts: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.hidden_size, heads, kv_heads, cfg.head_dim,
                                   bias=True, sinks=True, sliding_window=cfg.layer_window(idx), rotary=rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg, inter=inter, mxfp4_experts=mxfp4_experts)
        self.all_reduce = single_rank  # replaced by tensor parallelism

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, meta: ForwardMeta
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream enters as `residual_stream(h, residual)` and leaves as that of the returned pair:
        each residual add is left to the norm after it, which fuses it (vLLM style). Without tensor parallelism
        the returned h is the MoE's summands [T, S, H] (`moe(..., reduce=False)`), and the next norm adds their
        sum too (one launch fewer a layer); with it, the MoE sums first: all-reducing k times the bytes would
        cost more than the fold saves. The norm before the MoE comes with the routing (`MoE.norm_and_route`:
        one launch at decode sizes on the GPU)."""
        x, residual = self.input_layernorm.add_norm(h, residual)
        h = self.all_reduce(self.self_attn(x, meta))
        x, residual, routing = self.mlp.norm_and_route(h, residual, self.post_attention_layernorm)
        if self.all_reduce is single_rank:
            return self.mlp(x, reduce=False, routing=routing), residual
        return self.all_reduce(self.mlp(x, routing=routing)), residual


class Body(nn.Module):
    def __init__(self, cfg: GptOssConfig, tp_size: int = 1, mxfp4_experts: bool = False):
        super().__init__()
        inv_freq, factor = yarn_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        rotary = self.rotary = Rotary(inv_freq, factor)  # one, shared by every layer (no parameters)
        heads, kv_heads = cfg.num_attention_heads // tp_size, cfg.num_key_value_heads // tp_size
        inter = expert_shard_size(cfg.intermediate_size, tp_size, mxfp4_experts)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, heads, kv_heads, inter, mxfp4_experts)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class VocabParallelHead(nn.Module):
    """The LM head with its vocabulary split evenly over N tensor-parallel ranks: rank r holds rows [r*S, (r+1)*S)
    of the head padded to N*S rows (S = ceil(V / N); padding rows are zero and their logits -inf), so each rank
    reads and computes only its slice. `place` (tensor parallelism) gives it its rank and the all-gather
    (`t [R, ...] -> [N, R, ...]`, every rank's t).

    forward(hidden, rows, greedy) of hidden[rows] (rows None: every row):
      greedy   the argmax token [R]: each rank's (maximum, first index of it) is gathered and the first rank holding
               the largest maximum wins, so ties go to the lowest token id, as torch.argmax over the whole row;
      else     the full logits [R, V], all-gathered (sampling, penalties and log-probabilities need every token's).
    """

    def __init__(self, hidden: int, vocab: int, tp_size: int = 1):
        super().__init__()
        if vocab >= 1 << 24:
            raise ValueError(f"vocab_size {vocab} too large: token ids are gathered as float32")
        self.vocab, self.world, self.shard = vocab, tp_size, -(-vocab // tp_size)
        self.weight = nn.Parameter(torch.empty(self.shard, hidden))
        self.rank = 0
        self.all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    def place(self, rank: int, all_gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.rank, self.all_gather = rank, all_gather

    def forward(self, hidden: torch.Tensor, rows: torch.Tensor | None = None, greedy: bool = False) -> torch.Tensor:
        x = F.linear(hidden if rows is None else hidden[rows], self.weight)
        start = min(self.rank * self.shard, self.vocab)
        end = min(start + self.shard, self.vocab)  # this slice's real ids: [start, end)
        if end - start < self.shard:
            x[:, end - start:] = float("-inf")
        if self.world == 1:
            return x.argmax(-1) if greedy else x
        if greedy:
            best, idx = x.float().max(-1)
            pairs = self.all_gather(torch.stack([best, (idx + start).float()], -1))  # [N, R, 2]
            winner = pairs[..., 0].argmax(0)  # the first rank with the largest maximum
            return pairs[..., 1].gather(0, winner[None])[0].long()
        return self.all_gather(x).permute(1, 0, 2).reshape(x.shape[0], -1)[:, :self.vocab]


class GptOss(nn.Module):
    """forward(input_ids [T], meta) -> (final normed hidden [T, H], aux hidden [T, n_aux * H] | None).

    `mxfp4_experts`: keep the expert matrices packed (see `Experts`); the loader decides."""

    def __init__(self, cfg: GptOssConfig, tp_size: int = 1, mxfp4_experts: bool = False):
        super().__init__()
        self.config = cfg
        self.mxfp4_experts = mxfp4_experts
        self.model = Body(cfg, tp_size, mxfp4_experts)
        self.lm_head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, tp_size)
        self.aux_layer_ids: list[int] = []  # residual streams entering these layers go to the drafter

    def set_aux_layers(self, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i <= self.config.num_hidden_layers]
        if bad:
            raise ValueError(f"aux hidden-state layer ids {bad} are outside 0..{self.config.num_hidden_layers}")
        self.aux_layer_ids = list(ids)

    def forward(self, input_ids: torch.Tensor, meta: ForwardMeta) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, residual = self.model.embed_tokens(input_ids), None
        aux: dict[int, torch.Tensor] = {}
        with self.model.rotary.once_for(meta.positions, h.dtype):
            for i, layer in enumerate(self.model.layers):
                if i in self.aux_layer_ids:  # the stream entering layer i (an add for the few aux layers only)
                    aux[i] = residual_stream(h, residual)
                h, residual = layer(h, residual, meta)
        normed, h = self.model.norm.add_norm(h, residual)  # adds the last layer's MoE summands, if any
        if len(self.model.layers) in self.aux_layer_ids:
            aux[len(self.model.layers)] = h
        aux_cat = torch.cat([aux[i] for i in self.aux_layer_ids], dim=-1) if self.aux_layer_ids else None
        return normed, aux_cat

    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The logits [R, V] of hidden[rows] (rows None: all)."""
        return self.lm_head(hidden, rows, False)

    def greedy_tokens(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """argmax(compute_logits(hidden, rows)) [R], without gathering the logits under tensor parallelism."""
        return self.lm_head(hidden, rows, True)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]
