"""Reading a weight into L2 ahead of the kernel that needs it, on a side branch of a CUDA graph.

At a bs-1 decode step of GPT-OSS-20B, rope and paged attention take ~9 us a layer and read almost nothing
from HBM (a few MB of K/V), while the o projection right after them is a GEMV bound by reading its 23.6 MB
weight (~9.5 us, 2.5 TB/s: docs/benchmarks/profile.md, skinny_linear.md). An H200's L2 holds 50 MB. So
`prefetch_l2(weight)` forks a side stream that reads the weight (`l2_touch`) while the main stream runs the
latency-bound kernels, and the join it returns makes the GEMV wait for that read: the GEMV then finds its
weight in L2. It is the programmatic-dependent-launch idea of prefetching weights before the previous kernel
ends (kernels/dispatch.py, rule 3), made by the graph's topology instead of inside a kernel.

Only while a CUDA graph is being captured, and only at decode sizes (the skinny GEMM's rows): in eager mode
the fork and join would cost more host time than they save, and larger batches are not bound by the weight.
PEAGLE_L2_PREFETCH=0 turns it off (read at capture, as PEAGLE_PDL is).

`l2_touch(words, out)`: the maximum of each CHUNK_WORDS-word chunk of a flat int32 tensor into `out`, one
chunk a Triton program. Nobody reads `out`: the reduction is what makes the loads impossible to drop, and
its reference (`l2_touch_ref`) is what the interpreter test holds the kernel's coverage of the weight to.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch

from kernels.dispatch import use_triton
from kernels.linear import SKINNY_MAX_TOKENS

TOUCH_BLOCK = 1024  # int32 words a program loads per step (8 a thread at 4 warps: two 16-byte loads)
TOUCH_STEPS = 16  # steps a program, unrolled so that their loads are in flight together
CHUNK_WORDS = TOUCH_BLOCK * TOUCH_STEPS  # 64 KB a program: 360 programs for the 20B o weight
MIN_PREFETCH_BYTES = 1 << 20  # smaller weights are latency-bound anyway: the tiny target's (128 KB) are not worth a fork
INT32_MIN = -(2 ** 31)

_side_streams: dict[int, torch.cuda.Stream] = {}
# One scratch `out` per (device, weight words), never freed: a capture's side kernel writes it while the main
# stream's kernels run, so its memory must never be handed to one of theirs.
_scratch: dict[tuple[int, int], torch.Tensor] = {}


def l2_touch(words: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """words: flat int32 [n]; out: int32 [num_chunks(n)] <- each chunk's maximum. Returns out."""
    chunks = num_chunks(words.numel())
    if words.dtype != torch.int32 or words.dim() != 1 or out.dtype != torch.int32 or out.shape != (chunks,):
        raise ValueError(f"l2_touch: words must be flat int32 and out int32 [{chunks}], got "
                         f"{words.dtype} {tuple(words.shape)} and {out.dtype} {tuple(out.shape)}")
    if use_triton(words):
        from kernels.triton_prefetch import l2_touch_triton
        return l2_touch_triton(words, out)
    return l2_touch_ref(words, out)


def l2_touch_ref(words: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    chunks = num_chunks(words.numel())
    padded = torch.full((chunks * CHUNK_WORDS,), INT32_MIN, dtype=torch.int32, device=words.device)
    padded[:words.numel()] = words
    return out.copy_(padded.view(chunks, CHUNK_WORDS).amax(1))


def num_chunks(n: int) -> int:
    return -(-n // CHUNK_WORDS)


def prefetch_enabled() -> bool:
    return os.environ.get("PEAGLE_L2_PREFETCH", "1") != "0"


def _nothing() -> None:
    return None


def prefetch_l2(weight: torch.Tensor, tokens: int) -> Callable[[], None]:
    """Start reading `weight` into L2 on the device's side stream, where that pays (module docstring), and
    return the join to call right before the kernel that reads it (a no-op where nothing was started).

    Outside a capture nothing is started, but the first call for a weight size (the warm-up pass before a
    capture) compiles the kernel and allocates its scratch and the side stream, which a capture must not do."""
    if not (weight.is_cuda and tokens <= SKINNY_MAX_TOKENS and weight.nbytes >= MIN_PREFETCH_BYTES
            and weight.is_contiguous() and weight.nbytes % 4 == 0 and prefetch_enabled()):
        return _nothing
    words = weight.view(-1).view(torch.int32)
    key = (weight.device.index, words.numel())
    out = _scratch.get(key)
    if not torch.cuda.is_current_stream_capturing():
        if out is None:
            _scratch[key] = l2_touch(words, torch.empty(num_chunks(words.numel()), dtype=torch.int32,
                                                        device=weight.device))
            if key[0] not in _side_streams:
                _side_streams[key[0]] = torch.cuda.Stream(weight.device)
        return _nothing
    if out is None:  # a capture without a warm-up: leave it without the prefetch rather than compile in it
        return _nothing
    side = _side_streams[key[0]]
    main = torch.cuda.current_stream(weight.device)
    side.wait_stream(main)  # the fork: after what the main stream launched so far (the q/k/v GEMM)
    with torch.cuda.stream(side):
        l2_touch(words, out)
    return lambda: main.wait_stream(side)
