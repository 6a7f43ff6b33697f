"""Shared fixtures for the Triton kernel tests.

Triton reads TRITON_INTERPRET when a function is decorated with `triton.jit`: for its own
standard library (tl.max, tl.sum, ...) that is when `triton` is first imported, for our kernels when
their module is imported. So on a machine without CUDA this module sets TRITON_INTERPRET=1 as soon
as a kernel test is collected (before anything imports triton in the run phase), and the fixtures
re-import our kernel modules when they were imported in the other mode. One process cannot hold
both modes: with CUDA present, triton is compiled and the interpreter tests are skipped (the
compiled GPU tests cover the kernels there).

Tests reach kernels through the dispatchers or through the modules a fixture returns, never through
names imported at collection time (a reload would leave those stale).
"""
from __future__ import annotations

import ast
import importlib
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from peagle_kernels.dispatch import set_triton_enabled, triton_enabled

TRITON_MODULES = ("peagle_kernels.triton_attention", "peagle_kernels.triton_routing", "peagle_kernels.triton_moe", "peagle_kernels.triton_norm",
                  "peagle_kernels.triton_rope", "peagle_kernels.triton_linear", "peagle_kernels.triton_qkv_rope")  # dependency order

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def is_triton_jit(fn: ast.FunctionDef) -> bool:
    """Whether a function's source decorates it with `triton.jit` (bare, or with options such as
    `do_not_specialize`)."""
    return any(ast.unparse(d.func if isinstance(d, ast.Call) else d) == "triton.jit" for d in fn.decorator_list)


def _triton_interpreted() -> bool:
    """Whether the imported triton's own jit functions run in the interpreter."""
    import triton.language as tl
    return type(tl.standard.max).__name__ == "InterpretedFunction"


def _load_kernels(interpret: bool) -> SimpleNamespace:
    from triton.runtime.jit import JITFunction
    modules = []
    for name in TRITON_MODULES:
        module = sys.modules.get(name) or importlib.import_module(name)
        compiled = any(isinstance(v, JITFunction) for v in vars(module).values())
        if compiled == interpret:
            module = importlib.reload(module)
        modules.append(module)
    return SimpleNamespace(**{name.removeprefix("peagle_kernels.triton_"): m for name, m in zip(TRITON_MODULES, modules)})


@pytest.fixture
def triton_interpret(monkeypatch):
    """Dispatch to Triton on CPU tensors, run by Triton's interpreter (TRITON_INTERPRET=1)."""
    if torch.cuda.is_available():  # reloading the kernels interpreted would leave them so for the GPU tests
        pytest.skip("interpreter tests run on machines without CUDA; here the compiled kernels are tested")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    if not _triton_interpreted():
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set; set it in the environment")
    kernels = _load_kernels(interpret=True)
    previous = triton_enabled()
    set_triton_enabled(True)
    yield kernels
    set_triton_enabled(previous)


@pytest.fixture
def triton_cuda(monkeypatch):
    """Compiled Triton kernels on a CUDA device (automatic dispatch); skipped without CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pytest.importorskip("triton")
    if _triton_interpreted():
        pytest.skip("triton was imported in interpreter mode (TRITON_INTERPRET=1)")
    kernels = _load_kernels(interpret=False)
    previous = triton_enabled()
    set_triton_enabled(None)
    yield kernels
    set_triton_enabled(previous)


def enable_pdl(monkeypatch) -> None:
    """PEAGLE_PDL=1 for this test (programmatic dependent launch, `kernels/dispatch.py`). On a device that supports
    PDL it must then really be used: a Triton without it would otherwise pass the PDL tests without testing PDL."""
    from peagle_kernels.dispatch import use_pdl
    monkeypatch.setenv("PEAGLE_PDL", "1")
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        assert use_pdl(torch.empty(0, device="cuda")), "PEAGLE_PDL=1 on sm_90+, but this Triton cannot launch with PDL"


@pytest.fixture(params=[False, True], ids=["pdl-off", "pdl-on"])
def pdl(request, monkeypatch) -> bool:
    """Runs a (GPU) test as it is and again with PEAGLE_PDL=1: every Triton kernel then launches with
    programmatic dependent launch, so back-to-back kernels overlap and only their `gdc_wait` orders them."""
    if request.param:
        enable_pdl(monkeypatch)
    else:
        monkeypatch.delenv("PEAGLE_PDL", raising=False)
    return request.param


def assert_graph_replays_exactly(fn, x: torch.Tensor) -> None:
    """`fn()` (reading `x`) captures into a CUDA graph with no host sync, and a replay after new values are
    written into `x` equals running `fn()` again, bit for bit."""
    eager = fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture (compilation, lazy allocations)
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    x.normal_()  # new inputs, same buffers
    graph.replay()
    torch.testing.assert_close(out, fn(), atol=0, rtol=0)
    assert not torch.equal(out, eager)
