"""Building blocks shared by the target and the drafter: forward metadata, RMSNorm, RoPE, attention."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import nn

from peagle_kernels.attention import paged_attention, varlen_attention
from peagle_kernels.linear import linear
from peagle_kernels.norm import add_rms_norm
from peagle_kernels.rope import apply_rope, qkv_rope_write_kv


@dataclass
class ForwardMeta:
    """Where each token of a flat batch sits, and where its K/V go.

    Tokens of request b are `[query_start_loc[b], query_start_loc[b+1])`; `positions` are absolute.
    With `block_tables` set, K/V are written at `slot_mapping` (-1: skip) and attention reads the
    paged cache up to `seq_lens[b]`; without it, attention is cache-free within each request
    (feature extraction, training) unless `attn_mask` [T, T] (True = may attend) is given.
    With `kv_prefix` as well (EAGLE-3 training's unrolled steps), each attention layer attends to the
    keys/values it was given in earlier forwards before its own (`attn_mask` is then [T, prefix + T])
    and adds its own to them: a step computes only its new elements, not every earlier one again.
    """

    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    max_seqlen: int | None = None  # longest request, on the host: cache-free attention pads to it without a sync
    kv_prefix: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] | None = None  # per attention layer, grown in place

    @classmethod
    def for_sequences(cls, lengths: list[int], device: torch.device | str = "cpu") -> "ForwardMeta":
        """Cache-free metadata for whole sequences starting at position 0."""
        positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
        qsl = torch.tensor([0, *accumulate(lengths)], device=device)
        return cls(positions=positions, query_start_loc=qsl, max_seqlen=max(lengths, default=0))


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back (one kernel on a GPU)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(x, None, self.weight, self.eps)[0]

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one kernel; a None residual adds nothing. Decoders carry
        (x, residual) between blocks so that each residual add rides along with the next norm."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class Rotary(nn.Module):
    """NeoX half-split rotary embedding; cos and sin carry the attention factor (YaRN's mscale).

    Frequencies are kept as numbers and turned into a tensor once per device, so a model built on
    the meta device needs no re-initialisation after its weights are loaded.
    """

    def __init__(self, inv_freq: list[float], attention_factor: float = 1.0):
        super().__init__()
        self.inv_freq_values = list(inv_freq)
        self.attention_factor = attention_factor
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self._shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (positions, cos, sin)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = torch.tensor(self.inv_freq_values, dtype=torch.float64).float().to(device)
        return self._inv_freq[device]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D/2], computed in fp32 and cast to `dtype`."""
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        cos = (freqs.cos() * self.attention_factor)[:, None, :]
        sin = (freqs.sin() * self.attention_factor)[:, None, :]
        return cos.to(dtype), sin.to(dtype)

    @contextlib.contextmanager
    def once_for(self, positions: torch.Tensor, dtype: torch.dtype) -> Iterator[None]:
        """Every layer of one forward rotates at the same positions: compute cos/sin once for all of them
        (the same values each layer would compute, with up to 10 fewer small kernels a layer)."""
        self._shared = (positions, *self.cos_sin(positions, dtype))
        try:
            yield
        finally:
            self._shared = None

    def cos_sin_for(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin`, taken from `once_for` when it shares them for these positions: callers that rotate with a
        fused kernel of their own (the paged attention path) use the same values `forward` would."""
        shared = self._shared
        if shared is not None and shared[0] is positions and shared[1].dtype == dtype:
            return shared[1], shared[2]
        return self.cos_sin(positions, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, k, *self.cos_sin_for(positions, q.dtype))


def llama_inv_freq(head_dim: int, base: float, scaling: dict | None) -> list[float]:
    """Llama RoPE frequencies, with the `llama3` scaling drafter heads use."""
    inv = [1.0 / base ** (2 * j / head_dim) for j in range(head_dim // 2)]
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default"):
        return inv
    if kind != "llama3":
        raise ValueError(f"unsupported drafter rope_scaling {scaling!r} (supported: default, llama3)")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wl, high_wl = old_len / low, old_len / high
    out = []
    for f in inv:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(f)
        elif wl > low_wl:
            out.append(f / factor)
        else:
            smooth = (old_len / wl - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


class Attention(nn.Module):
    """GQA attention over a paged KV cache (or cache-free), with optional sinks and sliding window."""

    def __init__(self, in_dim: int, out_dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool, sinks: bool, sliding_window: int | None, rotary: Rotary):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, out_dim, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        self.sliding_window = sliding_window
        self.rotary = rotary
        self.scale = head_dim ** -0.5
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # bound by the engine
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # packed by `pack_qkv`
        self.qkv_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]

    def pack_qkv(self) -> None:
        """For inference: q, k and v from one GEMM (at decode sizes each projection is a short, latency-bound
        GEMV; one launch instead of three). The three weights become views of the packed one, so nothing is
        duplicated and `q_proj`/`k_proj`/`v_proj` (state dict, sharding, in-place updates) stay valid."""
        projs, sizes = (self.q_proj, self.k_proj, self.v_proj), self.qkv_sizes
        weight = torch.cat([p.weight.data for p in projs])
        bias = torch.cat([p.bias.data for p in projs]) if self.q_proj.bias is not None else None
        for p, w, b in zip(projs, weight.split(sizes), bias.split(sizes) if bias is not None else (None,) * 3):
            p.weight.data = w
            if b is not None:
                p.bias.data = b
        self.qkv = (weight, bias)

    def forward(self, x: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        T = x.shape[0]
        if meta.block_tables is not None:
            return self._paged(x, meta)
        if self.qkv is not None:
            q, k, v = linear(x, *self.qkv).split(self.qkv_sizes, -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(q, k, meta.positions)
        if meta.attn_mask is not None:
            if meta.kv_prefix is not None:
                if self in meta.kv_prefix:
                    k_past, v_past = meta.kv_prefix[self]
                    k, v = torch.cat([k_past, k]), torch.cat([v_past, v])
                meta.kv_prefix[self] = (k, v)
            o = masked_attention(q, k, v, meta.attn_mask, self.scale)
        else:
            o = varlen_attention(q, k, v, meta.query_start_loc, meta.positions, self.sinks,
                                 self.sliding_window, self.scale, meta.max_seqlen)
        return self.o_proj(o.reshape(T, -1))

    def _paged(self, x: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        """The engine's path: q/k/v, their rotation and the K/V store (at decode sizes on the GPU one kernel,
        `peagle_kernels.rope.qkv_rope_write_kv`), attention over the paged cache, then o."""
        T = x.shape[0]
        k_cache, v_cache = self.kv_cache
        cos, sin = self.rotary.cos_sin_for(meta.positions, x.dtype)
        if self.qkv is None:  # the engine packs every layer up front; a layer used here alone packs now
            self.pack_qkv()
        q, _ = qkv_rope_write_kv(x, *self.qkv, self.num_heads, self.num_kv_heads, cos, sin, k_cache, v_cache,
                                 meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                            meta.positions, self.sinks, self.sliding_window, self.scale)
        return linear(o.reshape(T, -1), self.o_proj.weight, self.o_proj.bias)


def pack_qkv(model: nn.Module) -> None:
    """`Attention.pack_qkv` on every attention layer of `model` (idempotent)."""
    for m in model.modules():
        if isinstance(m, Attention) and m.qkv is None:
            m.pack_qkv()


# On CUDA, SDPA with an explicit mask runs cuDNN's attention, which builds an execution graph per input shape
# (~30 ms of host time each, measured on an H200: 480 of a 617 ms drafter-training step, whose packed passes
# all differ in length). Padding both lengths up to a multiple of this bucket keeps the shapes few and cached.
MASKED_ATTENTION_BUCKET = 1024


def masked_attention(q, k, v, mask: torch.Tensor, scale: float, bucket: int | None = None) -> torch.Tensor:
    """Dense attention of q [T, Hq, D] over k/v [S, Hkv, D] under an explicit [T, S] boolean mask (drafter
    training); no sinks.

    T and S are padded up to a multiple of `bucket` (default: MASKED_ATTENTION_BUCKET on CUDA, 1 elsewhere).
    Padded keys are hidden from every real query; padded queries see every key, so their rows stay finite,
    and as their outputs are dropped they pass no gradient back."""
    T, S = q.shape[0], k.shape[0]
    bucket = bucket or (MASKED_ATTENTION_BUCKET if q.is_cuda else 1)
    Tp, Sp = -(-T // bucket) * bucket, -(-S // bucket) * bucket
    if (Tp, Sp) != (T, S):
        pad = lambda t, n: torch.nn.functional.pad(t, (0, 0, 0, 0, 0, n - t.shape[0]))  # noqa: E731
        q, k, v = pad(q, Tp), pad(k, Sp), pad(v, Sp)
        padded = mask.new_zeros(Tp, Sp)
        padded[:T, :S] = mask
        padded[T:] = True
        mask = padded
    group = q.shape[1] // k.shape[1]
    # 4-D [1, H, T, D] inputs: with 3-D ones SDPA takes its unfused math path ([H, T, T] fp32 scores in memory).
    heads_first = lambda t: t.transpose(0, 1)[None]  # noqa: E731
    k = heads_first(k.repeat_interleave(group, dim=1))
    v = heads_first(v.repeat_interleave(group, dim=1))
    o = torch.nn.functional.scaled_dot_product_attention(heads_first(q), k, v, attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)[:T]
