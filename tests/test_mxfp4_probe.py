"""The MXFP4 probe's re-encoding (`benchmarks/mxfp4_fp16_probe.py`): the kernel's bit masks give back every code."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import mxfp4_fp16_probe as P  # noqa: E402


def test_every_code_at_every_position_decodes_to_its_value():
    P.check()  # asserts decode_ref(encode(blocks)) == dequantize(blocks) for every code at every block position
