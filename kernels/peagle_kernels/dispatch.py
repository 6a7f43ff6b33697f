"""Choosing between a Triton kernel and its PyTorch reference, and how our Triton kernels are launched.

Programmatic dependent launch (PDL), opt-in with PEAGLE_PDL=1 (default off)
--------------------------------------------------------------------------
A bs-1 decode step replays ~292 kernels from one CUDA graph, and each costs ~1-1.5 us of launch and drain
between the previous kernel's end and its own start (docs/benchmarks/README.md). On Hopper (compute
capability 9) a kernel launched with the programmatic-stream-serialization attribute may start while the
previous kernel in its stream is still running; it must then wait, in the kernel, before touching what that
kernel writes. Triton: `launch_pdl=True` at launch, `tl.extra.cuda.gdc_wait()` (PTX `griddepcontrol.wait`:
returns once the previous grid has completed and its memory is visible) and
`tl.extra.cuda.gdc_launch_dependents()` (`griddepcontrol.launch_dependents`: once every program of this
grid has issued it or exited, the next grid's programs may be scheduled; no memory ordering at all).

`use_pdl(t)` is the one switch and `pdl_launch(t)` the one way our launch sites apply it: every
`peagle_kernels/triton_*.py` launch passes `**pdl_launch(x)`, which is `{}` when PDL is off and otherwise sets both
the launch attribute (`launch_pdl=True`) and the kernel's `USE_PDL` constexpr, so the two never disagree.
With `USE_PDL` False (its default) the `if USE_PDL:` blocks are removed at compile time: the kernels compile
exactly as without PDL.

Rules every kernel with `USE_PDL` follows (and any new one must):
1. Every program executes `gdc_wait()` unconditionally, before its first load of anything an earlier kernel
   may write and before its first store (the earlier kernel may still be reading that buffer). We put it at
   the very top of the kernel, before any early `return`. Why every program: `gdc_wait` only waits for the
   immediately preceding grid, so "kernel N completed" implies "kernel N-1 completed" only because N's
   programs waited for it; a program (or a whole grid) that exits without waiting lets a later kernel's wait
   return while an earlier kernel is still writing, and the chain breaks. Kernels with the "last program
   finishes" atomic counter (`triton_routing.py`) wait before touching the counter too (it is at the top).
2. `gdc_launch_dependents()` is the kernel's last statement (programs that return early trigger by exiting).
   It lets the next grid's programs become resident; they then sit in their own `gdc_wait` until this grid
   has completed and flushed. Right after the wait (the first version) it cost time: measured on an H200
   (`benchmarks/profile_step.py --pdl`, 20B shape, bs 1, graphs) the decode step took 3.347 ms against 3.179
   ms without PDL, and the kernel that follows the MoE up-projection was resident for most of it (MoE down
   1095 us a step instead of 537; our reading: waiting programs held registers and shared memory the running
   grid could use). Triggered last, PDL cost nothing and bought nothing (3.335 vs 3.351 ms, a later run):
   with every kernel waiting at its top, all it can hide is the launch itself. Where the trigger sits changes
   only scheduling, never what a kernel reads (rule 1): the bit-exact PDL GPU tests passed with both
   placements (this one at 282ce0d: the graph tests' PDL-on step equal to PDL-off, the attention kernel's).
3. Weights are never written by an earlier kernel, so a kernel could prefetch weight tiles before its wait.
   None does: which expert tiles the MoE kernels read comes from the routing kernel before them, and the
   other large reads (K/V, activations) are written by the kernel before, so little is left to prefetch.
Kernels we do not launch (cuBLAS, PyTorch's) are unchanged: launched without the attribute they start after
the previous kernel has completed, as before; a library kernel launched with it must wait in itself, as ours do.

CUDA graphs: a PDL launch inside `torch.cuda.graph` capture becomes a programmatic edge between the two
kernel nodes (CUDA >= 12.3). `use_pdl` reads the environment at each launch, i.e. at capture: flipping
PEAGLE_PDL changes nothing in graphs already captured (build a fresh runner). The Triton interpreter
(TRITON_INTERPRET=1, CPU tests) never uses PDL, nor a Triton without the launch option or the two
instructions (`triton_has_pdl`; Triton 3.9 has them, as does 3.6 by its PDL tutorial and API).
"""
from __future__ import annotations

import functools
import os

import torch

# None: automatic (Triton on CUDA); PEAGLE_TRITON=0 forces the PyTorch references (training needs autograd).
_ENABLED: bool | None = {"0": False, "1": True}.get(os.environ.get("PEAGLE_TRITON", ""))


def set_triton_enabled(enabled: bool | None) -> None:
    """Force Triton on (True) or off (False), or restore the automatic choice (None)."""
    global _ENABLED
    _ENABLED = enabled


def triton_enabled() -> bool | None:
    return _ENABLED


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Triton for CUDA tensors (or CPU tensors under TRITON_INTERPRET=1 when forced on)."""
    if _ENABLED is False:
        return False
    if t.is_cuda:
        return True
    return bool(_ENABLED) and interpret_mode()


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record this call: the Triton kernels have no backward, so such calls take the
    reference (drafter training on a GPU). Inference runs under no_grad/inference_mode and never does."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def use_pdl(t: torch.Tensor) -> bool:
    """Whether a Triton kernel on `t`'s device launches with programmatic dependent launch (module docstring):
    PEAGLE_PDL=1, a CUDA tensor on a device of compute capability >= 9, not the interpreter, and a Triton that
    supports it. Read at every launch (so at capture for CUDA graphs)."""
    if os.environ.get("PEAGLE_PDL") != "1" or not t.is_cuda or interpret_mode():
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _hopper_or_newer(index) and triton_has_pdl()


def pdl_launch(t: torch.Tensor) -> dict:
    """Keyword arguments for a Triton launch on `t`'s device: `{}` without PDL; with it, the launch attribute
    and the kernel's `USE_PDL` constexpr together (every kernel in peagle_kernels/triton_*.py declares
    `USE_PDL: tl.constexpr = False`)."""
    return {"launch_pdl": True, "USE_PDL": True} if use_pdl(t) else {}


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.lru_cache(maxsize=1)
def triton_has_pdl() -> bool:
    """Whether the installed Triton has the `launch_pdl` launch option and `tl.extra.cuda.gdc_wait` /
    `gdc_launch_dependents`. Without the option Triton would silently drop `launch_pdl` (no PDL, harmless);
    without the instructions our kernels would not compile with USE_PDL: either way, PDL stays off."""
    try:
        import triton.language as tl
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # no Triton, or no CUDA backend in it
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return (hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")
            and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}))


def triton_kernels() -> dict[str, object]:
    """The Triton JIT functions of the loaded `peagle_kernels.triton_*` modules, by name (module.function)."""
    import sys

    return {f"{name.removeprefix('peagle_kernels.')}.{attr}": fn for name, module in list(sys.modules.items()) if name.startswith("peagle_kernels.triton_")
            for attr, fn in vars(module).items() if getattr(fn, "device_caches", None) is not None}


def compiled_variants(kernels: dict[str, object] | None = None) -> dict[str, int]:
    """How many variants each Triton kernel (`triton_kernels()`, or those given) has compiled so far. Triton
    compiles one per new combination of constexprs and of what it specialises arguments on (integers equal
    to 1 or divisible by 16, 16-byte aligned pointers); in a live step a compile is a 0.1-0.4 s stall, so
    the kernels the engine launches outside its CUDA graphs must not meet new ones (tests/test_graphs.py).
    Empty under the interpreter."""
    kernels = triton_kernels() if kernels is None else kernels
    # a JITFunction keeps, per device, a tuple whose first item is its compiled kernels
    return {name: sum(len(cache[0]) for cache in fn.device_caches.values()) for name, fn in kernels.items()}
