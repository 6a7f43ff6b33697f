"""The bars `peagle bench` figures are held to, and whether a run met them."""
from __future__ import annotations

from typing import Any

# The bar from issue 7 (20B shape, bf16, one H200, bs 1).
BARS = [
    # key, comparison, threshold, text
    ("decode_bs1_roofline_fraction", ">=", 0.60, ">= 0.60 of the roofline (aim past 0.70)"),
    ("draft_time_ratio_k7_over_k1", "<=", 1.15, "<= 1.15 (P-EAGLE draft at K=7 over K=1)"),
    ("verify_k7_over_decode_bs1", "<=", 1.30, "<= 1.3 (verify k=7 over a plain decode step)"),
    ("speedup_vs_hf_transformers_bs1", ">=", 10.0, ">= 10x transformers eager (there: 33 tok/s)"),
    ("draft_time_ratio_k7_over_k1_eagle3", None, None, "none (EAGLE-3 grows ~linearly in K)"),
    # MXFP4 experts, as users serve GPT-OSS (bars on any GPU, as fractions of its own roofline)
    ("decode_bs1_roofline_fraction_120b_mxfp4", ">=", 0.50, ">= 0.50 of the 120B MXFP4 roofline (aim 0.65)"),
    ("decode_bs1_roofline_fraction_20b_mxfp4", ">=", 0.50, ">= 0.50 of the 20B MXFP4 roofline"),
    ("moe_mxfp4_tb_s_1_tokens_120b", ">=", 2.5, ">= 2.5 TB/s effective, 120B MoE layer, 1 token"),
    ("moe_mxfp4_tb_s_8_tokens_120b", ">=", 2.5, ">= 2.5 TB/s effective, 120B MoE layer, 8 tokens"),
    ("verify_k7_roofline_fraction_120b", ">=", 0.50, ">= 0.50 of its touched-bytes roofline (120B, k = 7)"),
    ("spec_c1_speedup_120b", ">=", 1.3, ">= 1.3 (best speculative mode over none, 120B, concurrency 1)"),
]
MXFP4_KEYS = {key for key, *_ in BARS if key.endswith(("_mxfp4", "_120b"))}


def bar_rows(s: dict[str, Any]) -> list[dict[str, Any]]:
    """Each figure with its bar and whether it is met: the bf16 bars apply to the 20B shape on a GPU, the MXFP4
    ones on any GPU (fractions of its own roofline)."""
    cuda = s.get("machine", {}).get("device_type") == "cuda"
    bf16_applies = cuda and s.get("settings", {}).get("shape") == "20b"
    rows = []
    for key, op, thr, text in BARS:
        v = s.get(key)
        met = None
        if v is not None and op is not None:
            met = v >= thr if op == ">=" else v <= thr
        rows.append({"key": key, "figure": v, "bar": text, "met": met,
                     "bar_applies": cuda if key in MXFP4_KEYS else bf16_applies})
    return rows
