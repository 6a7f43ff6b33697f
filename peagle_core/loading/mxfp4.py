"""MXFP4 (OCP microscaling) as GPT-OSS stores its experts.

FP4 E2M1 codes, two per byte (element 2j in the low nibble), 32 elements per block along the
last (input) dimension, one E8M0 scale byte per block: value = LUT[code] * 2^(scale - 127).
"""
from __future__ import annotations

import torch

FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
BLOCK = 32


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., K/32, 16] uint8 and scales [..., K/32] uint8 -> [..., K]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., K/32, 32]
    values = torch.ldexp(lut[codes], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round w [..., K] (K a multiple of 32) to MXFP4: the smallest power-of-two scale that fits each block."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the last dimension to be a multiple of 32, got {w.shape[-1]}")
    x = w.float().unflatten(-1, (-1, BLOCK))
    amax = x.abs().amax(-1).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = x / torch.exp2(exp)[..., None]
    grid = torch.tensor(FP4_VALUES[:8], dtype=torch.float32, device=w.device)
    mag = (scaled.abs()[..., None] - grid).abs().argmin(-1)  # nearest magnitude code 0..7
    codes = (mag | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)
