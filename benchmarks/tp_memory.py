"""Weights and KV cache per tensor-parallel rank, from the model shapes (no device, no checkpoint).

    python benchmarks/tp_memory.py --out docs/benchmarks/tp

Each rank's target is built as the engine builds it (`GptOss(cfg, N)` on the meta device, bf16, MXFP4 experts
packed as "auto" keeps them on CUDA at every N) and its parameters are counted by part. Rank 0 also holds the
drafter and its KV cache (not counted here: `docs/tensor_parallel.md`). The engine logs the real figures at
start-up ("memory per rank: ...").
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from peagle_core.config import GptOssConfig
from peagle_core.models.gpt_oss import GptOss

SHAPES = {"20b": GptOssConfig(), "120b": GptOssConfig(num_hidden_layers=36, num_local_experts=128)}
PARTS = (("experts", ".experts."), ("lm_head", "lm_head."), ("embedding", "embed_tokens."), ("attention", ".self_attn."))


def rank_bytes(cfg: GptOssConfig, tp: int, mxfp4: bool = True) -> dict[str, int]:
    """Bytes of one rank's target by part (every rank holds the same shapes; padding included)."""
    with torch.device("meta"):
        model = GptOss(cfg, tp, mxfp4_experts=mxfp4).to(torch.bfloat16)
    out = {name: 0 for name, _ in PARTS} | {"other": 0}
    for n, p in model.named_parameters():
        part = next((name for name, key in PARTS if key in n), "other")
        out[part] += p.numel() * p.element_size()
    out["total"] = sum(out.values())
    return out


def kv_bytes_per_token(cfg: GptOssConfig, tp: int) -> int:
    """K and V of one token in every layer, bf16, on one rank (its KV heads)."""
    return 2 * cfg.num_hidden_layers * (cfg.num_key_value_heads // tp) * cfg.head_dim * 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", default="1,2,4,8")
    p.add_argument("--out", type=Path, default=None, help="write memory.json here")
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.tp.split(",")]
    rows = [{"shape": s, "tp": n, "bytes": rank_bytes(cfg, n), "kv_bytes_per_token": kv_bytes_per_token(cfg, n)}
            for s, cfg in SHAPES.items() for n in sizes]
    print("| model | TP | weights per rank | experts | LM head | embedding | attention | KV per token |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    for r in rows:
        b = r["bytes"]
        print(f"| gpt-oss-{r['shape']} | {r['tp']} | {gb(b['total'])} | {gb(b['experts'])} | {gb(b['lm_head'])} | "
              f"{gb(b['embedding'])} | {gb(b['attention'])} | {r['kv_bytes_per_token'] / 1024:.0f} KiB |")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "memory.json").write_text(json.dumps({"command": "python benchmarks/tp_memory.py --out " + str(a.out),
                                                       "dtype": "bfloat16, MXFP4 experts packed", "rows": rows},
                                                      indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
