"""Where the 120B MXFP4 MoE layer's decode time goes, and how fast its expert bytes can be read at all.

    python benchmarks/mxfp4_stream.py --out "$OUT"     # one GPU, about a minute

1. The layer (as `moe_tiles.py` builds it) at 1 and 8 tokens under torch.profiler: each kernel's device time
   (routing and sort, up, the split-K finish, down, ...), so the GEMVs are told apart from the small launches.
2. The same experts' packed bytes (w1 and w2 codes plus scales, the bytes the layer must read) read by Triton
   kernels that only add them up:
   - `flat`: each expert's slab streamed contiguously, one launch a tensor (what a tile-contiguous layout could give);
   - `rows`: tiled as the MoE kernels read them, two launches like the layer's: BLOCK_N rows of one expert, WORDS
     int32 words of each row a K-step (and its scale bytes), K split over SPLIT programs (the MMA kernels: 64 rows
     of w1 (32 gate/up pairs), 32 of w2, 16 words).
   A kernel that reads with a pattern cannot beat that pattern's time here.
Writes mxfp4_stream.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from profile_step import profile_calls  # noqa: E402  (beside this script: the step profile's kernel table)
from peagle_core.bench.models import build_random, target_config  # noqa: E402
from peagle_core.models.gpt_oss import MoE  # noqa: E402
from peagle_core.timing import time_graph  # noqa: E402


@triton.jit
def _flat_sum(w_ptr, experts_ptr, out_ptr, n_words, stride_e, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Program (i, j) adds up words [j*BLOCK*ITERS, (j+1)*BLOCK*ITERS) of expert experts[i]'s slab."""
    e = tl.load(experts_ptr + tl.program_id(0)).to(tl.int64)
    start = tl.program_id(1) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + e * stride_e + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(acc, 0))


@triton.jit
def _rows_sum(w_ptr, s_ptr, experts_ptr, out_ptr, n_rows, k_chunk, stride_we, stride_se, row_words: tl.constexpr,
              BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """Program (i, j, s): rows [j*BLOCK_N, (j+1)*BLOCK_N) of expert experts[i], K-chunk s, WORDS words of codes
    and WORDS/4 scale bytes (one per 16 code bytes) a row a step, as the MoE kernels walk them. row_words is a
    constexpr so the K mask does not split the loads below the row length's alignment."""
    e = tl.load(experts_ptr + tl.program_id(0)).to(tl.int64)
    rows = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < n_rows
    w_rows = w_ptr + e * stride_we + rows[:, None] * row_words
    s_rows = s_ptr + e * stride_se + rows[:, None] * (row_words // 4)
    k_begin = tl.program_id(2) * k_chunk
    acc = tl.zeros([BLOCK_N, WORDS], tl.int32)
    for k in range(k_begin, tl.minimum(k_begin + k_chunk, row_words), WORDS):
        kk = k + tl.arange(0, WORDS)
        acc += tl.load(w_rows + kk[None, :], mask=row_ok[:, None] & (kk < row_words)[None, :], other=0)
        sk = k // 4 + tl.arange(0, WORDS // 4)
        sc = tl.load(s_rows + sk[None, :], mask=row_ok[:, None] & (sk < row_words // 4)[None, :], other=0)
        acc += tl.sum(sc.to(tl.int32), 1)[:, None]
    flat = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
    tl.store(out_ptr + flat, tl.sum(tl.sum(acc, 1), 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="120b")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    layer = build_random(lambda: MoE(target_config(a.shape), mxfp4_experts=True), dev, torch.bfloat16, 0)
    ex = layer.experts
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "shape": a.shape, "layer": {}, "stream": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for T in (1, 8):
            x = torch.randn(T, ex.w2_blocks.shape[1], device=dev, generator=g).bfloat16()
            res["layer"][T] = {"us_graph": time_graph(lambda: layer(x), dev),
                               "kernels": profile_calls(lambda: layer(x), dev, steps=20)[1]}
            print(f"layer T={T}: {res['layer'][T]['us_graph']:.1f} us (graph); kernels: " + ", ".join(
                f"{r['kernel'][:28]} {r['us_per_step']:.1f}" for r in res["layer"][T]["kernels"]), flush=True)

    experts = torch.randperm(ex.w1_blocks.shape[0], device=dev)[:4].to(torch.int32)
    mats = [(ex.w1_blocks, ex.w1_scales), (ex.w2_blocks, ex.w2_scales)]
    nbytes = 4 * sum(b[0].numel() + s[0].numel() for b, s in mats)
    words = [b.view(torch.int32) for b, _ in mats]  # [E, N, K/32, 4]
    sink = torch.empty(1 << 20, device=dev, dtype=torch.int32)

    def record(name: str, cfg: dict, fn) -> None:
        try:
            us = time_graph(fn, dev)
            row = {"pattern": name, **cfg, "us": us, "tb_s": nbytes / us / 1e6}
        except Exception as e:  # a shape the compiler refuses
            row = {"pattern": name, **cfg, "error": f"{type(e).__name__}: {str(e)[:160]}"}
        res["stream"].append(row)
        print(row, flush=True)

    for block, iters, warps, stages in [(1024, 4, 4, 3), (2048, 4, 8, 3), (4096, 2, 8, 2), (1024, 8, 4, 1)]:
        def flat(block=block, iters=iters, warps=warps, stages=stages):
            for (b, s), w in zip(mats, words):
                for t in (w, s):
                    n = t[0].numel()
                    _flat_sum[(4, triton.cdiv(n, block * iters))](t, experts, sink, n, t.stride(0), BLOCK=block,
                                                                  ITERS=iters, num_warps=warps, num_stages=stages)
        record("flat", {"block": block, "iters": iters, "warps": warps, "stages": stages}, flat)
    # (w1 rows, w2 rows, words a step, warps, stages, split); the first is what the MMA kernels read at one token
    for r1, r2, wd, warps, stages, split in [(64, 32, 16, 2, 4, 2), (64, 32, 16, 2, 4, 1), (64, 32, 16, 4, 4, 2),
                                             (64, 32, 32, 2, 4, 2), (64, 32, 64, 4, 3, 2), (64, 32, 128, 4, 2, 2),
                                             (32, 16, 32, 2, 4, 2), (16, 16, 64, 2, 3, 2), (16, 8, 128, 2, 3, 1),
                                             (128, 64, 16, 4, 4, 2), (64, 32, 16, 2, 2, 4), (64, 32, 16, 2, 6, 2)]:
        def rows(r1=r1, r2=r2, wd=wd, warps=warps, stages=stages, split=split):
            for (b, s), w, rn in zip(mats, words, (r1, r2)):
                n_rows, row_words = w.shape[1], w.shape[2] * w.shape[3]
                k_chunk = triton.cdiv(triton.cdiv(row_words, wd), split) * wd
                _rows_sum[(4, triton.cdiv(n_rows, rn), split)](
                    w, s, experts, sink, n_rows, k_chunk, w.stride(0), s.stride(0), row_words=row_words, BLOCK_N=rn,
                    WORDS=wd, num_warps=warps, num_stages=stages)
        record("rows", {"w1_rows": r1, "w2_rows": r2, "words": wd, "warps": warps, "stages": stages, "split": split},
               rows)
    res["bytes"] = nbytes
    (out / "mxfp4_stream.json").write_text(json.dumps(res, indent=1))
    best = {}
    for r in res["stream"]:
        if "us" in r and (r["pattern"] not in best or r["us"] < best[r["pattern"]]["us"]):
            best[r["pattern"]] = r
    for p, r in best.items():
        print(f"best {p}: {r['us']:.1f} us, {r['tb_s']:.2f} TB/s {r}")


if __name__ == "__main__":
    main()
