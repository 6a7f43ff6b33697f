"""Triton `l2_touch`: same signature and result as `kernels.prefetch.l2_touch_ref`.

Each program reads its CHUNK_WORDS-word chunk in TOUCH_STEPS unrolled steps of TOUCH_BLOCK words, keeps the
running maximum in registers and stores one word. The steps' loads do not depend on one another, so they are
in flight together (~64 KB a program); the program holds no shared memory and few registers, so it shares
its SM with the attention kernels that run beside it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import pdl_launch
from kernels.prefetch import INT32_MIN, TOUCH_BLOCK, TOUCH_STEPS, num_chunks


@triton.jit
def _l2_touch_kernel(words_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr, LOWEST: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    start = tl.program_id(0).to(tl.int64) * (BLOCK * STEPS)
    offs = tl.arange(0, BLOCK)
    acc = tl.full([BLOCK], LOWEST, tl.int32)
    for s in tl.static_range(STEPS):
        idx = start + s * BLOCK + offs
        acc = tl.maximum(acc, tl.load(words_ptr + idx, mask=idx < n, other=LOWEST))
    tl.store(out_ptr + tl.program_id(0), tl.max(acc, 0))
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now (kernels/dispatch.py, rule 2)
        tl.extra.cuda.gdc_launch_dependents()


def l2_touch_triton(words: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = words.numel()
    if n:
        _l2_touch_kernel[(num_chunks(n),)](words, out, n, BLOCK=TOUCH_BLOCK, STEPS=TOUCH_STEPS, LOWEST=INT32_MIN,
                                           num_warps=4, **pdl_launch(words))
    return out


__all__ = ["l2_touch_triton"]
