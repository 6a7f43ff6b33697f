"""Probe: an MXFP4 expert GEMV whose codes are re-encoded at load so that the FP4 -> fp16 expansion is bit masks.

    python benchmarks/mxfp4_fp16_probe.py --out "$OUT" [--base OLD_triton_moe_mxfp4.py]   # one GPU, about a minute
    python benchmarks/mxfp4_fp16_probe.py --check           # CPU: the encoding against the decode's bit operations

Today's MoE kernels expand FP4 through `tl.dot_scaled`, whose Hopper lowering spends ~7.7 instructions a weight in
the K-loop (triton 3.6, `sass_mix.py`), and run at 1.84x their own tiling's read time (`mxfp4_stream.py`). This probe
asks whether a cheaper expansion moves the GEMV, before the MoE kernels change:

- Layout: each 32-weight MXFP4 block of a row becomes four int32 words. Word q holds weights 4q..4q+3 and
  16+4q..16+4q+3, placed so that four outputs `((w << a) & 0x80008000) | ((w << 3a) & 0x0E000E00)`, a = 0..3, are
  fp16 pairs holding value * 2^-14 (sign to bit 15, exponent and mantissa bits to 11..9). 13 integer operations for
  8 weights; no table, no select.
- The block's first 16 weights feed one fp16 MMA (k16) and its last 16 another, with the weights on the MMA's M
  side and the tokens (16 slots) on N; the block's scale, times 2^14, multiplies the fp32 partial sum.
- Activations are fp16 (converted once, outside the loop).

It checks every launch shape's output against a dequantised fp32 product. Then it times the up (w1, 5760 x 2880)
and down (w2, 2880 x 2880) GEMVs at the 120B shape: four sets of four experts in turn, so the bytes overflow L2.
- Ablations (`MODE`) each remove one part of the K-loop's work, to see what holds it.
- Layout variants try block-major scales, k-major activations and scales loaded a step ahead.
- The layer's own kernels are profiled in the same rounds.
- With --base, the whole layer with an earlier kernel file is timed beside this tree's, with scale rows as loaded
  and padded to 16 bytes.
Writes mxfp4_fp16_probe.json. Findings: `docs/benchmarks/moe_tiles.md`.
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from peagle_core.loading.mxfp4 import dequantize  # noqa: E402  (the oracle)

# output register r of word q's decode holds (low half, high half) = the block's weights 4q + ORDER[r]
ORDER = ((0, 1), (2, 3), (16, 17), (18, 19))
MODES = ("full", "no scale loads", "no activation loads", "no FP4 expansion", "code loads only",
         "no scale or activation loads")


def encode(blocks: torch.Tensor) -> torch.Tensor:
    """HF MXFP4 blocks [..., nb, 16] uint8 (byte j: weight 2j low nibble, 2j+1 high) -> words [..., nb, 4] int32."""
    b = blocks.to(torch.int32)
    codes = torch.stack((b & 15, b >> 4), -1).flatten(-2)  # [..., nb, 32]: weight order
    words = torch.zeros(*blocks.shape[:-1], 4, dtype=torch.int64, device=blocks.device)
    for q in range(4):
        for r, (lo, hi) in enumerate(ORDER):
            for half, w in ((0, lo), (1, hi)):
                c = codes[..., 4 * q + w].to(torch.int64)
                words[..., q] |= ((c >> 3) << (15 + 16 * half - r)) | ((c & 7) << (9 + 16 * half - 3 * r))
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the same 32 bits as a signed int32


def decode_ref(words: torch.Tensor) -> torch.Tensor:
    """The kernel's bit operations in PyTorch: words [..., nb, 4] -> weights [..., nb * 32] fp32 (times 2^-14 undone)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros(*words.shape[:-1], 32, dtype=torch.float32, device=words.device)
    for q in range(4):
        for r, (lo, hi) in enumerate(ORDER):
            bits = (((w[..., q] << r) & 0x80008000) | ((w[..., q] << (3 * r)) & 0x0E000E00)) & 0xFFFFFFFF
            for half, idx in ((0, lo), (1, hi)):
                h = ((bits >> (16 * half)) & 0xFFFF).to(torch.int16)
                out[..., 4 * q + idx] = h.view(torch.float16).float() * 2.0 ** 14
    return out.flatten(-2)


@triton.jit
def _fp16_pairs(words):
    """int8 x4 (one encoded word per 4 bytes) -> two fp16 tensors of the same shape: the block's first-half and
    second-half weights, value * 2^-14 (module docstring)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 s, m;
        and.b32 $0, $4, 0x8E008E00;
        shl.b32 s, $4, 1; shl.b32 m, $4, 3; and.b32 s, s, 0x80008000; and.b32 m, m, 0x0E000E00; or.b32 $1, s, m;
        shl.b32 s, $4, 2; shl.b32 m, $4, 6; and.b32 s, s, 0x80008000; and.b32 m, m, 0x0E000E00; or.b32 $2, s, m;
        shl.b32 s, $4, 3; shl.b32 m, $4, 9; and.b32 s, s, 0x80008000; and.b32 m, m, 0x0E000E00; or.b32 $3, s, m;
        }""",
        constraints="=r,=r,=r,=r,r", args=[words], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _moved(words):
    """MODE 3: the words as fp16 bits, no expansion (same data flow as `_fp16_pairs`, wrong values)."""
    return tl.inline_asm_elementwise(asm="mov.b32 $0, $4; mov.b32 $1, $4; mov.b32 $2, $4; mov.b32 $3, $4;",
                                     constraints="=r,=r,=r,=r,r", args=[words], dtype=(tl.float16, tl.float16),
                                     is_pure=True, pack=4)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, experts_ptr, part_ptr, T, N, K, k_chunk, stride_xt, stride_we, stride_wn,
                 stride_se, stride_sn, stride_ps, stride_pe, stride_pt,
                 BT: tl.constexpr, BN: tl.constexpr, NSUB: tl.constexpr, MODE: tl.constexpr = 0,
                 S_T: tl.constexpr = False, X_T: tl.constexpr = False, S_PF: tl.constexpr = False):
    """part[s, i, t, n] = sum over K-chunk s of x[t, k] * W_e[n, k], e = experts[i] (fp32). MODE != 0 removes one
    part of the work to see what holds the loop (the output is then wrong): 1 no scale loads, 2 no activation
    loads, 3 no FP4 expansion (the words moved as they are), 4 only the code loads (summed as integers), 5 no scale
    and no activation loads. S_T: scales stored block-major ([E, K/32, N]: a block's BN scales are one contiguous
    load; stride_sn is then the block stride). X_T: activations stored k-major and padded to BT slots ([K, BT]: a
    sub-block's [16, BT] tile is one contiguous, unmasked load; stride_xt is then the k stride). S_PF (NSUB = 1):
    each block's scales are loaded one K-step ahead, by hand (Triton does not pipeline these byte loads)."""
    e = tl.load(experts_ptr + tl.program_id(0)).to(tl.int64)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    toks = tl.arange(0, BT)
    j = tl.arange(0, 16)
    w_rows = w_ptr + e * stride_we + rows.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + e * stride_se + (rows.to(tl.int64) if S_T else rows.to(tl.int64) * stride_sn)
    x_cols = x_ptr + (toks[None, :] if X_T else toks[None, :] * stride_xt)
    t_ok = (toks < T)[None, :]
    acc = tl.zeros([BN, BT], tl.float32)
    raw = tl.zeros([BN, 16], tl.int32)
    k_begin = tl.program_id(2) * k_chunk
    s_stride = stride_sn if S_T else 1
    if S_PF:
        sc_next = tl.load(s_rows + (k_begin // 32) * s_stride).to(tl.int32)
    else:
        sc_next = tl.zeros([BN], tl.int32)
    for k0 in range(k_begin, k_begin + k_chunk, 32 * NSUB):
        for sub in tl.static_range(NSUB):
            kb = k0 + 32 * sub
            words = tl.load(w_rows + (kb // 2 + j)[None, :])  # [BN, 16] bytes: the block's four words
            if MODE == 4:
                raw += words.to(tl.int32)
            else:
                if MODE == 3:
                    first, second = _moved(words)
                else:
                    first, second = _fp16_pairs(words)
                if MODE == 2 or MODE == 5:
                    xa = tl.full([16, BT], 1.0, tl.float16)
                    xb = xa
                elif X_T:
                    xa = tl.load(x_cols + (kb + j)[:, None] * stride_xt)
                    xb = tl.load(x_cols + (kb + 16 + j)[:, None] * stride_xt)
                else:
                    xa = tl.load(x_cols + (kb + j)[:, None], mask=t_ok, other=0.0)
                    xb = tl.load(x_cols + (kb + 16 + j)[:, None], mask=t_ok, other=0.0)
                p = tl.dot(first, xa)
                p = tl.dot(second, xb, p)
                if MODE == 1 or MODE == 5:
                    acc += p
                else:
                    if S_PF:
                        sc = sc_next
                        nxt = tl.minimum(kb + 32, k_begin + k_chunk - 32) // 32
                        sc_next = tl.load(s_rows + nxt * s_stride).to(tl.int32)
                    else:
                        sc = tl.load(s_rows + (kb // 32) * s_stride).to(tl.int32)
                    acc += p * ((sc + 14) << 23).to(tl.float32, bitcast=True)[:, None]  # 2^(s - 127) * 2^14
    if MODE == 4:
        acc += tl.sum(raw, 1).to(tl.float32)[:, None]
    out = part_ptr + tl.program_id(2) * stride_ps + tl.program_id(0) * stride_pe
    tl.store(out + toks[None, :] * stride_pt + rows[:, None], acc, mask=t_ok)


def gemv(x16: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor, part: torch.Tensor,
         bn: int, warps: int, stages: int, nsub: int, split: int, mode: int = 0, s_t: bool = False,
         x_t: bool = False, s_pf: bool = False) -> torch.Tensor:
    """x16 [T, K] fp16 ([K, 16] with x_t), words [E, N, K/32, 4] int32, scales [E, N, K/32] uint8 ([E, K/32, N]
    with s_t) -> part [split, len(experts), T, N]."""
    E, N, nb, _ = words.shape
    T = part.shape[2]
    K = nb * 32
    assert nb % (split * nsub) == 0, (nb, split, nsub)
    wb = words.view(torch.int8)
    _gemv_kernel[(experts.numel(), triton.cdiv(N, bn), split)](
        x16, wb, scales, experts, part, T, N, K, K // split, x16.stride(0), wb.stride(0), wb.stride(1),
        scales.stride(0), scales.stride(1), part.stride(0), part.stride(1), part.stride(2),
        BT=16, BN=bn, NSUB=nsub, MODE=mode, S_T=s_t, X_T=x_t, S_PF=s_pf, num_warps=warps, num_stages=stages)
    return part


def check() -> None:
    """The kernel's bit operations on `encode`'s words give back every code at every position of a block."""
    same = torch.arange(16, dtype=torch.uint8)[:, None].repeat(1, 16) * 17  # block c: code c in every nibble
    rand = torch.randint(0, 256, (64, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    blocks = torch.cat((same, rand))[None]  # [1, 80, 16]
    got, want = decode_ref(encode(blocks)), dequantize(blocks, torch.full((1, 80), 127, dtype=torch.uint8))
    assert torch.equal(got, want), (got - want).abs().max()
    print("encode/decode: every code at every position round-trips exactly")


def layer_ab(layer, base_file: str, res: dict, dev: torch.device) -> None:
    """The whole MoE layer at 1 and 8 tokens: `base_file`'s kernels against this tree's, with the scales as loaded
    (rows of K/32 bytes) and with their rows padded to a multiple of 16 bytes. Three interleaved rounds."""
    import importlib.util

    import peagle_kernels.triton_moe_mxfp4 as cur
    from peagle_core.timing import time_graph

    spec = importlib.util.spec_from_file_location("mxfp4_base", base_file)
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    ex = layer.experts

    def padded(s: torch.Tensor) -> torch.Tensor:
        wide = torch.full((*s.shape[:-1], (s.shape[-1] + 15) // 16 * 16), 127, dtype=s.dtype, device=s.device)
        wide[..., :s.shape[-1]] = s
        return wide[..., :s.shape[-1]]

    scales = {"rows": (ex.w1_scales, ex.w2_scales), "padded": (padded(ex.w1_scales), padded(ex.w2_scales))}
    g = torch.Generator(device="cuda").manual_seed(1)
    res["layer_ab"] = []
    for T in (1, 8):
        x = torch.randn(T, ex.w2_blocks.shape[1], device=dev, generator=g).bfloat16()
        want = None
        for rnd in range(3):
            for impl, fn in (("base", base.moe_mxfp4_triton), ("tree", cur.moe_mxfp4_triton)):
                for lay, (s1, s2) in scales.items():
                    def call(fn=fn, s1=s1, s2=s2):
                        return fn(x, layer.router.weight, layer.router.bias, ex.w1_blocks, s1, ex.b1, ex.w2_blocks,
                                  s2, ex.b2, layer.top_k, layer.alpha, layer.limit)
                    y = call().float()
                    want = y if want is None else want
                    row = {"T": T, "round": rnd, "kernels": impl, "scales": lay, "us": time_graph(call, dev),
                           "rel_diff_vs_first": ((y - want).norm() / want.norm()).item()}
                    res["layer_ab"].append(row)
                    print(row, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--base", help="an earlier triton_moe_mxfp4.py: its layer kernels timed beside this tree's")
    a = ap.parse_args()
    check()
    if a.check:
        return
    from profile_step import profile_calls
    from peagle_core.bench.models import build_random, target_config
    from peagle_core.models.gpt_oss import MoE
    from peagle_core.timing import time_graph

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    layer = build_random(lambda: MoE(target_config("120b"), mxfp4_experts=True), dev, torch.bfloat16, 0)
    ex = layer.experts
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "baseline": [], "correct": [], "ablation": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    # 16 experts, timed as four sets of four launched in turn, so one call's bytes (4 x 33 MB for w1) overflow L2
    chosen = torch.randperm(ex.w1_blocks.shape[0], device=dev, generator=g)[:16]
    sets = torch.arange(16, device=dev, dtype=torch.int32).view(4, 4)
    mats = {"up": (ex.w1_blocks[chosen], ex.w1_scales[chosen]), "down": (ex.w2_blocks[chosen], ex.w2_scales[chosen])}
    enc = {k: (encode(b).contiguous(), s.contiguous()) for k, (b, s) in mats.items()}
    scales_t = {k: s.transpose(1, 2).contiguous() for k, (_, s) in mats.items()}  # [E, K/32, N]: block-major
    configs = [(32, 2, 4, 3, 2), (32, 2, 3, 5, 1), (32, 2, 6, 1, 2)]
    # (MODE, block-major scales, k-major padded activations, scales one step ahead (one block a step only))
    variants = [(0, False, False, False), (0, True, False, False), (0, False, True, False), (0, True, True, False),
                (0, False, False, True), (0, False, True, True), (5, False, False, False)]

    def k_major(x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [K, 16] fp16, zeros past T
        xt = torch.zeros(x.shape[1], 16, device=x.device, dtype=torch.float16)
        xt[:, :x.shape[0]] = x.t()
        return xt
    with torch.no_grad():
        for T in (1, 8):  # correctness of the full kernel (MODE 0) against the dequantised product, first set
            x = torch.randn(T, ex.w2_blocks.shape[1], device=dev, generator=g).bfloat16()
            for bn, warps, stages, nsub, split in configs:
                row = {"T": T, "bn": bn, "warps": warps, "stages": stages, "nsub": nsub, "split": split}
                for name, (w, s) in enc.items():
                    b, sc = mats[name]
                    want = torch.einsum("tk,enk->etn", x.float(), dequantize(b[:4], sc[:4]))
                    part = torch.empty(split, 4, T, w.shape[1], device=dev, dtype=torch.float32)
                    got = gemv(x.half(), w, s, sets[0], part, bn, warps, stages, nsub, split).sum(0)
                    row[f"{name}_rel_err"] = ((got - want).norm() / want.norm()).item()
                    got = gemv(k_major(x), w, scales_t[name], sets[0], part, bn, warps, stages, nsub, split,
                               s_t=True, x_t=True).sum(0)
                    row[f"{name}_rel_err_major"] = ((got - want).norm() / want.norm()).item()
                    if nsub == 1:
                        got = gemv(k_major(x), w, s, sets[0], part, bn, warps, stages, nsub, split, x_t=True,
                                   s_pf=True).sum(0)
                        row[f"{name}_rel_err_prefetch"] = ((got - want).norm() / want.norm()).item()
                res["correct"].append(row)
                print(row, flush=True)
        if a.base:
            layer_ab(layer, a.base, res, dev)
            (out / "mxfp4_fp16_probe.json").write_text(json.dumps(res, indent=1))  # in case the call runs out
        x = torch.randn(1, ex.w2_blocks.shape[1], device=dev, generator=g).bfloat16()
        x16, x16t = x.half(), k_major(x)
        for rnd in range(2):  # interleaved rounds: the baseline layer, then every config and ablation
            kern = profile_calls(lambda: layer(x), dev, steps=20)[1]
            res["baseline"].append({"round": rnd, "layer_us": time_graph(lambda: layer(x), dev), "kernels": kern})
            print(f"baseline round {rnd}: layer {res['baseline'][-1]['layer_us']:.1f} us; " + ", ".join(
                f"{r['kernel'][:30]} {r['us_per_step']:.1f}" for r in kern), flush=True)
            for bn, warps, stages, nsub, split in configs:
                for mode, s_t, x_t, s_pf in variants:
                    if s_pf and nsub != 1:
                        continue
                    row = {"round": rnd, "bn": bn, "warps": warps, "stages": stages, "nsub": nsub, "split": split,
                           "mode": MODES[mode] + (", block-major scales" if s_t else "")
                           + (", k-major activations" if x_t else "") + (", scales a step ahead" if s_pf else "")}
                    for name, (w, s) in enc.items():
                        part = torch.empty(split, 4, 1, w.shape[1], device=dev, dtype=torch.float32)

                        def call(w=w, s=scales_t[name] if s_t else s, xx=x16t if x_t else x16, part=part, mode=mode,
                                 s_t=s_t, x_t=x_t, s_pf=s_pf):
                            for e in sets:
                                gemv(xx, w, s, e, part, bn, warps, stages, nsub, split, mode, s_t, x_t, s_pf)
                        row[f"{name}_us"] = time_graph(call, dev) / len(sets)
                    res["ablation"].append(row)
                    print(row, flush=True)
            (out / "mxfp4_fp16_probe.json").write_text(json.dumps(res, indent=1))
    (out / "mxfp4_fp16_probe.json").write_text(json.dumps(res, indent=1))
    base = sorted(r["layer_us"] for r in res["baseline"])
    print(f"layer, median of rounds: {base[len(base) // 2]:.1f} us")
    for key in sorted({(r["T"], r["kernels"], r["scales"]) for r in res.get("layer_ab", [])}):
        us = sorted(r["us"] for r in res["layer_ab"] if (r["T"], r["kernels"], r["scales"]) == key)
        print(f"layer A/B {key}: {us[len(us) // 2]:.1f} us (median of {len(us)}; {us[0]:.1f}-{us[-1]:.1f})")
    for key in sorted({(r["bn"], r["warps"], r["stages"], r["nsub"], r["split"], r["mode"]) for r in res["ablation"]},
                      key=lambda k: (k[:5], k[5])):
        rows = [r for r in res["ablation"] if (r["bn"], r["warps"], r["stages"], r["nsub"], r["split"], r["mode"]) == key]
        med = {n: sorted(r[f"{n}_us"] for r in rows)[len(rows) // 2] for n in ("up", "down")}
        print(f"{key}: up {med['up']:.1f} us, down {med['down']:.1f} us (median of {len(rows)})")


if __name__ == "__main__":
    main()
