"""The instruction mix of the MXFP4 MoE kernels' inner loops, compiled for sm_90 on any machine (no GPU needed).

    python benchmarks/sass_mix.py [--out DIR]

Compiles `_moe_mxfp4_up_kernel` (MMA tiles, `tl.dot_scaled`) and `_mxfp4_gemv_kernel` (CUDA cores) as the launcher
would at the 120B up projection and one token (Triton's own ptxas and cuobjdump, `GPUTarget("cuda", 90)`), finds each
kernel's innermost loop in the SASS and counts its instructions by opcode, per weight a thread handles in one step.
In the MMA kernel the FP4 expansion is most of them, but `mxfp4_fp16_probe.py` measured that its instruction count is
not what holds it. The GEMVs are timed three ways: fp32 products (fp32 activations), and the fp16 pairs of bf16
activations in Triton and in the inline PTX that ships (`docs/benchmarks/moe_tiles.md`). Writes sass_mix.json (and
the SASS) to --out.
Run it with the GPU machines' Triton (3.6) for their figure: the wheel installed to a side directory and put first
on PYTHONPATH (`pip install --no-deps --target /tmp/t36 triton==3.6.0`, then `PYTHONPATH=/tmp/t36 python ...`).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

H = I = 2880  # GPT-OSS's hidden and intermediate sizes; 120B's E = 128 experts, k = 4
MMA_SIG = dict(x_ptr="*bf16", wb_ptr="*u8", ws_ptr="*u8", b1_ptr="*bf16", h_ptr="*bf16", part_ptr="*fp32",
               order_ptr="*i32", offsets_ptr="*i32", num_experts="i32", hidden="i32", inter="i32", alpha="fp32",
               limit="fp32", k_chunk="i32", stride_xt="i32", stride_wbe="i32", stride_wbn="i32", stride_wse="i32",
               stride_wsn="i32", stride_be="i32", stride_ht="i32", stride_ps="i32", stride_pr="i32")
# What the launcher sees at this shape: every pointer 16-byte aligned; integers divisible by 16 where they are.
MMA_VALUES = dict(hidden=H, inter=I, k_chunk=H // 2, stride_xt=H, stride_wbe=2 * I * H // 2, stride_wbn=H // 2,
                  stride_wse=2 * I * H // 32, stride_wsn=H // 32, stride_be=2 * I, stride_ht=I, stride_ps=4 * 2 * I,
                  stride_pr=2 * I)
GEMV_SIG = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", b_ptr="*bf16", part_ptr="*fp32", order_ptr="*i32",
                offsets_ptr="*i32", num_experts="i32", N="i32", K="i32", n_chunk="i32", stride_xt="i32",
                stride_we="i32", stride_wn="i32", stride_se="i32", stride_sn="i32", stride_be="i32", stride_ps="i32",
                stride_pr="i32")
GEMV_VALUES = dict(N=2 * I, K=H, n_chunk=64, stride_xt=H, stride_we=2 * I * H // 32, stride_wn=H // 32,
                   stride_se=2 * I * H // 32, stride_sn=H // 32, stride_be=2 * I, stride_ps=4 * 2 * I, stride_pr=2 * I)
MMA_CONST = dict(SPLIT=1, TOP_K=4, ONE_TILE=True, E_PAD=128, USE_PDL=False)
VARIANTS = {  # name: (kernel, signature, values, constexprs, weights a thread handles a loop step, num_warps, stages)
    "mma (tl.dot_scaled, 16x32x128 tiles, 2 warps)": (
        "_moe_mxfp4_up_kernel", MMA_SIG, MMA_VALUES,
        dict(MMA_CONST, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, DOT_SCALED=True, LHS_FMT="bf16", DOT_PREC="tf32"),
        2 * 32 * 128 // 64, 2, 4),
    "gemv, fp32 products (fp32 activations; 16 rows x 32 blocks a step, 2 warps)": (
        "_mxfp4_gemv_kernel", GEMV_SIG, GEMV_VALUES,
        dict(GATHER=True, TOP_K=4, ROWS=16, E_PAD=128, F16=False, PTX=False, USE_PDL=False),
        16 * 32 * 32 // 64, 2, 1),
    "gemv, fp16 pairs in Triton (PEAGLE_MXFP4_PTX=0)": (
        "_mxfp4_gemv_kernel", GEMV_SIG, GEMV_VALUES,
        dict(GATHER=True, TOP_K=4, ROWS=16, E_PAD=128, F16=True, PTX=False, USE_PDL=False),
        16 * 32 * 32 // 64, 2, 1),
    "gemv, fp16 pairs in inline PTX (GEMV_TILES: what ships)": (
        "_mxfp4_gemv_kernel", GEMV_SIG, GEMV_VALUES,
        dict(GATHER=True, TOP_K=4, ROWS=16, E_PAD=128, F16=True, PTX=True, USE_PDL=False),
        16 * 32 * 32 // 64, 2, 1),
}


def compile_variant(kernel: str, sig: dict, values: dict, const: dict, warps: int, stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import peagle_kernels.triton_moe_mxfp4 as mx

    sig = dict(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig)
             if sig[k].startswith("*") or values.get(k, 1) % 16 == 0}
    sig.update({k: "constexpr" for k in const})
    src = ASTSource(getattr(mx, kernel), sig, const, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def innermost_loop(sass: str) -> collections.Counter:
    """Opcodes of the shortest block ending in a backward branch (the K-loop's body; not the one-line trap loop)."""
    lines = sass.splitlines()
    labels = {line.strip().rstrip(":"): i for i, line in enumerate(lines) if re.match(r"^\s*\.?L\w+:$", line)}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?(\.?L\w+)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i - 8:
            loops.append(lines[labels[m.group(1)]:i + 1])
    body = min(loops, key=len) if loops else lines
    ops = collections.Counter()
    for line in body:
        toks = line.split("\t", 1)[1].split() if "\t" in line else []
        toks = toks[1:] if toks and toks[0].startswith("@") else toks
        if toks:
            ops[toks[0].rstrip(";")] += 1
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/sass_mix")
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    import triton
    from triton.tools.disasm import get_sass

    result = {"triton": triton.__version__}  # the SASS differs by Triton version: the GPU machines run 3.6
    for name, (kernel, sig, values, const, weights, warps, stages) in VARIANTS.items():
        ck = compile_variant(kernel, sig, values, const, warps, stages)
        sass = get_sass(ck.asm["cubin"])
        (out / f"{kernel}.sass").write_text(sass)
        ops = innermost_loop(sass)
        total = sum(ops.values())
        result[name] = {"kernel": kernel, "loop_instructions": total, "weights_per_thread": weights,
                        "per_weight": round(total / weights, 2), "ops": dict(ops.most_common())}
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(10))
        print(f"{name}: {total} instructions a K-step, {total / weights:.2f} a weight | {top}")
    (out / "sass_mix.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
