"""The instruction mix of the MXFP4 MoE kernels as compiled for this GPU, one variant at a time.

    python benchmarks/sass_mix.py --out "$OUT/sass" [--shape 120b] [--tokens 1]

Runs one GPT-OSS MoE layer (random packed experts) with each named `MoeTiles` variant, takes the cubins Triton
compiled for it from the JIT's in-memory cache, disassembles them (`triton.tools.disasm.get_sass`, the cuobjdump
Triton ships) and writes each kernel's SASS and an opcode histogram. Reading which instructions a K-step costs is
how we tell decode work from layout shuffles (`docs/benchmarks/moe_tiles.md`).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import peagle_kernels.triton_moe as tm  # noqa: E402
import peagle_kernels.triton_moe_mxfp4 as mx  # noqa: E402
from peagle_core.bench.models import build_random, target_config  # noqa: E402
from peagle_core.models.gpt_oss import MoE  # noqa: E402

VARIANTS = {  # MoeTiles fields as in benchmarks/moe_tiles.py; block_m 0 = T rounded up to a power of two
    "mma-shipped": None,
    "fma": (0, 8, 16, 128, 2, 1, 1, True),
}
KERNELS = ("_moe_mxfp4_up_kernel", "_moe_mxfp4_down_kernel", "moe_up_fma_kernel", "moe_down_fma_kernel")


def compiled_kernels(fn) -> list:
    """Every CompiledKernel in a JITFunction's in-memory cache (Triton 3.x keeps them per device)."""
    out = []
    for caches in getattr(fn, "device_caches", {}).values():
        cache = caches[0] if isinstance(caches, tuple) else caches
        out += list(cache.values())
    return out


def opcode_histogram(sass: str) -> dict[str, int]:
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    return dict(collections.Counter(op.split(".")[0] for op in ops).most_common())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="120b")
    ap.add_argument("--tokens", type=int, default=1)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from triton.tools.disasm import get_sass

    layer = build_random(lambda: MoE(target_config(a.shape), mxfp4_experts=True), torch.device("cuda"),
                         torch.bfloat16, 0)
    x = torch.randn(a.tokens, 2880, device="cuda").bfloat16()
    shipped, seen, summary = tm.moe_tiles, set(), {}
    for name, c in VARIANTS.items():
        if c is not None:
            tiles = tm.MoeTiles(c[0] or max(1, 1 << (a.tokens - 1).bit_length()), *c[1:])
            tm.moe_tiles = lambda n, k, mxfp4=False, t=tiles: t
        try:
            with torch.no_grad():
                layer(x)
            torch.cuda.synchronize()
            for kname in KERNELS:
                for ck in compiled_kernels(getattr(mx, kname)):
                    if id(ck) in seen:
                        continue
                    seen.add(id(ck))
                    sass = get_sass(ck.asm["cubin"])
                    (out / f"{name}.{kname}.sass").write_text(sass)
                    meta = getattr(ck, "metadata", None)
                    summary[f"{name}.{kname}"] = {"ops": opcode_histogram(sass),
                                                  "registers": getattr(ck, "n_regs", None),
                                                  "spills": getattr(ck, "n_spills", None),
                                                  "shared": getattr(meta, "shared", None)}
        except Exception as e:  # noqa: BLE001  (a variant that fails still leaves the others' mix)
            summary[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        finally:
            tm.moe_tiles = shipped
    (out / "sass_mix.json").write_text(json.dumps(summary, indent=1))
    for key, v in summary.items():
        ops = v.get("ops", {})
        top = ", ".join(f"{k} {n}" for k, n in list(ops.items())[:14])
        print(f"{key}: regs {v.get('registers')} spills {v.get('spills')} | {top or v.get('error')}")


if __name__ == "__main__":
    main()
