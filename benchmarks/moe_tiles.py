"""Decode-size tiles of the MoE kernels: achieved bandwidth of one MoE layer per tile choice, on one GPU.

    python benchmarks/moe_tiles.py --out "$OUT"

One GPT-OSS MoE layer as the engine builds it (20B shape in bf16, 120B shape with packed MXFP4 experts), random
weights filled as `peagle bench` fills them, T tokens routed top-4. Each candidate `MoeTiles` replaces `peagle_kernels.triton_moe.moe_tiles` for small T; the layer is
captured in a CUDA graph of 20 calls (launch costs as in the engine) and timed with CUDA events. Bandwidth =
bytes of the experts the tokens select / time. Writes moe_tiles.json and moe_tiles.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import peagle_kernels.triton_moe as tm  # noqa: E402
from peagle_core.bench import build_random, target_config  # noqa: E402
from peagle_core.models.gpt_oss import MoE  # noqa: E402

# (block_m, up_n, down_n, block_k, num_warps, num_stages) per layer; each list starts with the shipped choice
# for T <= 32. Eight shared candidates left bf16 flat
# around the shipped tiles and MXFP4 best at 2 warps, so each list now varies what those runs did not isolate:
# bf16's down tile alone (its 180 programs on 132 SMs), MXFP4's warps and tiles around 2 warps.
CANDIDATES = {
    "20b-bf16": [(16, 32, 64, 128, 4, 4), (16, 32, 32, 128, 4, 4), (16, 32, 16, 128, 4, 4), (16, 32, 64, 256, 4, 3),
                 (16, 32, 32, 64, 4, 6), (16, 32, 64, 128, 4, 5), (16, 64, 64, 64, 4, 6), (16, 32, 16, 256, 4, 3)],
    "120b-mxfp4": [(16, 32, 64, 128, 4, 4), (16, 32, 32, 128, 2, 4), (16, 32, 64, 128, 2, 4), (16, 64, 64, 128, 2, 4),
                   (16, 32, 32, 256, 2, 3), (16, 32, 32, 128, 1, 4), (16, 16, 32, 128, 1, 4), (16, 32, 32, 128, 2, 6),
                   (16, 64, 128, 128, 4, 4)],
}


def time_graph(fn, reps: int = 20, trials: int = 5) -> float:
    """Microseconds per call: `reps` calls captured in one graph, best of `trials` replays."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    best = float("inf")
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / reps)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    shipped = tm.moe_tiles
    rows = []
    for name, shape, mx in (("20b-bf16", "20b", False), ("120b-mxfp4", "120b", True)):
        # one MoE layer as the engine builds it, random weights as `peagle bench` fills them
        layer = build_random(lambda: MoE(target_config(shape), mxfp4_experts=mx), torch.device("cuda"),
                             torch.bfloat16, 0)
        E = layer.router.weight.shape[0]
        expert_bytes = sum(p.numel() * p.element_size() for p in layer.experts.parameters()) / E
        for T in (int(t) for t in a.tokens.split(",")):
            x = torch.randn(T, 2880, device="cuda", generator=g).bfloat16()
            with torch.no_grad():
                experts = torch.topk(x.float() @ layer.router.weight.float().T, layer.top_k).indices.unique().numel()
            nbytes = experts * expert_bytes
            for c in CANDIDATES[name]:
                tm.moe_tiles = lambda n, k, mxfp4=False, c=c: tm.MoeTiles(*c) if n <= 32 else shipped(n, k, mxfp4)
                try:
                    us = time_graph(lambda: layer(x))
                    row = {"layer": name, "T": T, "tiles": c, "us": us, "experts": experts,
                           "tb_s": nbytes / us / 1e6}
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
    md = ["| layer | T | tiles (bm, up_n, down_n, bk, warps, stages) | us | TB/s |", "| --- | --- | --- | --- | --- |"]
    md += [f"| {r['layer']} | {r['T']} | {r['tiles']} | {r.get('us', float('nan')):.1f} | "
           f"{r.get('tb_s', float('nan')):.2f} |" for r in rows]
    (out / "moe_tiles.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
