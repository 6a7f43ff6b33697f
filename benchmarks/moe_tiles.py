"""MoE launch shapes at decode and verify sizes: time and effective bandwidth of one MoE layer, on one GPU.

    python benchmarks/moe_tiles.py --out "$OUT" [--tokens 1,2,4,8,16,64,256] [--layers 120b-mxfp4,20b-mxfp4]
        [--max-t 32] [--max-candidates N]

One GPT-OSS MoE layer as the engine builds it (MXFP4 experts packed, or bf16), random weights filled as
`peagle bench` fills them, T tokens routed top-4. Each candidate `MoeTiles` replaces
`peagle_kernels.triton_moe.moe_tiles` for T <= 32 (larger T keep the shipped tiles, timed once as a baseline);
the layer is captured in a CUDA graph of 20 calls (launch costs as in the engine) and timed with CUDA events,
best of 5 replays. Effective bandwidth = bytes of the experts the tokens actually select / time. Every
candidate's output is checked against the shipped tiles' on the same input (relative L2 error).
Writes moe_tiles.json and moe_tiles.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import peagle_kernels.triton_moe as tm  # noqa: E402
from peagle_core.bench.models import build_random, target_config  # noqa: E402
from peagle_core.models.gpt_oss import MoE  # noqa: E402
from peagle_core.timing import time_graph  # noqa: E402

# MoeTiles fields: (block_m, up_n, down_n, block_k, num_warps, num_stages, split_k). The first of each list is what
# `moe_tiles` ships for 2-64 tokens (at one token it splits K in two: the second). docs/benchmarks/moe_tiles.md's
# tables come from these (`--max-t 64`, and `--max-t 256` for the largest batches).
MXFP4 = [(16, 32, 32, 128, 2, 4, 1), (16, 32, 32, 128, 2, 4, 2), (16, 32, 32, 128, 2, 4, 4), (16, 32, 32, 128, 2, 4, 8),
         (16, 32, 32, 128, 4, 4, 4), (16, 64, 64, 128, 4, 4, 1), (16, 64, 64, 128, 4, 4, 4), (16, 64, 64, 128, 4, 4, 8),
         (16, 32, 32, 64, 2, 4, 4), (16, 32, 32, 64, 2, 6, 8), (16, 16, 16, 128, 1, 4, 4), (16, 32, 32, 256, 2, 3, 4),
         (32, 32, 32, 128, 2, 4, 1), (64, 64, 128, 64, 4, 3, 1)]
# Wider K-steps: more contiguous bytes of each row a step (64 B at block_k 128).
WIDE = [(16, 32, 32, 256, 2, 4, 2), (16, 16, 16, 256, 2, 4, 2), (16, 16, 16, 512, 2, 3, 2), (16, 32, 32, 512, 4, 3, 1),
        (16, 16, 16, 512, 2, 3, 1), (16, 8, 8, 512, 1, 3, 2)]
# The CUDA-core GEMV kernels (`gemv_rows` > 0): up_n / down_n are the weight rows a program covers, gemv_rows those a
# loop step loads (a K-chunk is 32 blocks; block_m 1, block_k and split_k unused). The first is `GEMV_TILES`.
GEMV = [(1, 64, 32, 1024, 2, 1, 1, 16), (1, 64, 32, 1024, 2, 2, 1, 16), (1, 128, 64, 1024, 2, 1, 1, 16),
        (1, 64, 32, 1024, 2, 1, 1, 8), (1, 32, 16, 1024, 2, 1, 1, 8), (1, 64, 32, 1024, 4, 1, 1, 16),
        (1, 128, 64, 1024, 2, 1, 1, 32), (1, 64, 64, 1024, 2, 1, 1, 8), (1, 64, 32, 1024, 2, 1, 1, 4),
        (1, 128, 64, 1024, 2, 1, 1, 8), (1, 32, 32, 1024, 1, 1, 1, 4)]
LAYERS = {"120b-mxfp4": ("120b", True, MXFP4), "120b-wide": ("120b", True, MXFP4[:2] + WIDE),
          "120b-gemv": ("120b", True, MXFP4[:2] + GEMV), "20b-gemv": ("20b", True, MXFP4[:2] + GEMV),
          "20b-mxfp4": ("20b", True, MXFP4), "20b-bf16": ("20b", False, [(16, 32, 64, 128, 4, 4)])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,2,4,8,16,64,256")
    ap.add_argument("--layers", default="120b-mxfp4,20b-mxfp4,20b-bf16")
    ap.add_argument("--max-t", type=int, default=32, help="candidates replace the tiles up to this many tokens")
    ap.add_argument("--max-candidates", type=int, default=None, help="only the first N of each layer's candidates")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    shipped = tm.moe_tiles
    rows = []
    for name in a.layers.split(","):
        shape, mx, candidates = LAYERS[name]
        candidates = candidates[:a.max_candidates]
        layer = build_random(lambda: MoE(target_config(shape), mxfp4_experts=mx), torch.device("cuda"),
                             torch.bfloat16, 0)
        E = layer.router.weight.shape[0]
        expert_bytes = sum(p.numel() * p.element_size() for p in layer.experts.parameters()) / E
        for T in (int(t) for t in a.tokens.split(",")):
            x = torch.randn(T, 2880, device="cuda", generator=g).bfloat16()
            with torch.no_grad():
                experts = torch.topk(x.float() @ layer.router.weight.float().T, layer.top_k).indices.unique().numel()
                want = layer(x).float()
            nbytes = experts * expert_bytes
            for c in (candidates if T <= a.max_t else candidates[:1]):
                tm.moe_tiles = lambda n, k, mxfp4=False, c=c, **kw: (tm.MoeTiles(*c) if n <= a.max_t
                                                                     else shipped(n, k, mxfp4, **kw))
                try:
                    with torch.no_grad():
                        err = ((layer(x).float() - want).norm() / want.norm()).item()
                        us = time_graph(lambda: layer(x), torch.device("cuda"))
                    row = {"layer": name, "T": T, "tiles": c, "us": us, "experts": experts,
                           "tb_s": nbytes / us / 1e6, "rel_err": err}
                except Exception as e:  # a tile the compiler refuses (shared memory, ...)
                    row = {"layer": name, "T": T, "tiles": c, "error": f"{type(e).__name__}: {str(e)[:200]}"}
                finally:
                    tm.moe_tiles = shipped
                rows.append(row)
                print(row, flush=True)
            del x
        del layer
        torch.cuda.empty_cache()
    (out / "moe_tiles.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    md = ["| layer | T | tiles (bm, up_n, down_n, bk, warps, stages, split_k) | us | TB/s | rel. err |",
          "| --- | --- | --- | --- | --- | --- |"]
    md += [f"| {r['layer']} | {r['T']} | {r['tiles']} | {r.get('us', float('nan')):.1f} | "
           f"{r.get('tb_s', float('nan')):.2f} | {r.get('rel_err', float('nan')):.1e} |" for r in rows]
    (out / "moe_tiles.md").write_text("\n".join(md) + "\n")
    best = {}
    for r in rows:
        key = (r["layer"], r["T"])
        if "us" in r and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    print("\nbest per layer and T:")
    for (layer, T), r in best.items():
        print(f"{layer:11s} T={T:<4d} {r['us']:8.1f} us {r['tb_s']:5.2f} TB/s {r['tiles']}")


if __name__ == "__main__":
    main()
