"""The MXFP4 probe's re-encoding (`benchmarks/mxfp4_fp16_probe.py`): the kernel's bit masks give back every code."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import mxfp4_fp16_probe as P  # noqa: E402


def test_every_code_at_every_position_decodes_to_its_value():
    # 16 blocks: block c holds code c (both nibbles) at every byte, and random bytes elsewhere in the batch
    same = torch.arange(16, dtype=torch.uint8)[:, None].repeat(1, 16) * 17
    rand = torch.randint(0, 256, (64, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    blocks = torch.cat((same, rand))[None]  # [1, 80, 16]
    scales = torch.full((1, 80), 127, dtype=torch.uint8)
    assert torch.equal(P.decode_ref(P.encode(blocks)), P.dequant(blocks, scales))


def test_dequant_matches_the_fp4_table_and_scales():
    blocks = torch.tensor([[[0x21] + [0] * 15]], dtype=torch.uint8)  # weights 0 and 1: codes 1 (0.5) and 2 (1.0)
    out = P.dequant(blocks, torch.tensor([[129]], dtype=torch.uint8))  # scale 2^2
    assert out[0, :2].tolist() == [2.0, 4.0] and not out[0, 2:].any()
