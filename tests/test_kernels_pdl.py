"""Programmatic dependent launch (PDL, `kernels/dispatch.py`): off on CPU and under the interpreter whatever
PEAGLE_PDL says, and every Triton kernel follows the rule that makes it safe on a GPU (checked from the source,
so on any machine). The compiled kernels run with PDL in the GPU tests (the `pdl` fixture of kernel_utils, the
"cuda-pdl" spec cases and tests/test_graphs.py)."""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import torch

from kernel_utils import is_triton_jit, triton_interpret  # noqa: F401  (fixture)
from peagle_kernels.dispatch import pdl_launch, use_pdl
from peagle_kernels.norm import add_rms_norm
from peagle_kernels.rope import apply_rope

KERNEL_FILES = sorted((Path(__file__).resolve().parents[1] / "kernels" / "peagle_kernels").glob("triton_*.py"))
WAIT_FIRST = "if USE_PDL:\n    tl.extra.cuda.gdc_wait()"
TRIGGER_LAST = "if USE_PDL:\n    tl.extra.cuda.gdc_launch_dependents()"


def test_pdl_is_off_on_cpu_and_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("PEAGLE_PDL", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.zeros(1)
    assert not use_pdl(cpu) and pdl_launch(cpu) == {}
    # A CUDA tensor under TRITON_INTERPRET=1 (a stand-in: only is_cuda and device are read before the answer)
    fake_cuda = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not use_pdl(fake_cuda) and pdl_launch(fake_cuda) == {}
    # Default off: without PEAGLE_PDL=1 nothing else is even asked (no CUDA call here)
    monkeypatch.delenv("TRITON_INTERPRET")
    for value in (None, "0", "", "true"):
        if value is None:
            monkeypatch.delenv("PEAGLE_PDL")
        else:
            monkeypatch.setenv("PEAGLE_PDL", value)
        assert not use_pdl(fake_cuda) and pdl_launch(fake_cuda) == {}


def test_interpreted_kernels_are_unchanged_with_pdl_requested(triton_interpret, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x, res, w = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g), torch.randn(40, generator=g)
    q, k = torch.randn(3, 4, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    cos, sin = torch.randn(3, 1, 8, generator=g), torch.randn(3, 1, 8, generator=g)
    outs = {}
    for value in ("0", "1"):
        monkeypatch.setenv("PEAGLE_PDL", value)
        outs[value] = (*add_rms_norm(x, res, w, 1e-5), *apply_rope(q, k, cos, sin))
    assert all(torch.equal(a, b) for a, b in zip(outs["0"], outs["1"]))


def _launches(tree: ast.Module) -> list[ast.Call]:
    """Every `kernel[grid](...)` call."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
            and isinstance(n.func.value, ast.Name)]


def _is_pdl_launch(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "pdl_launch"


def test_every_kernel_waits_first_triggers_last_and_every_launch_passes_pdl_launch():
    """The rules of kernels/dispatch.py, for every kernel launched in kernels/triton_*.py: a trailing
    `USE_PDL: tl.constexpr = False`; as its first statement (after the docstring), before any early return,
    `gdc_wait()` under `if USE_PDL:`, and `gdc_launch_dependents()` under `if USE_PDL:` as its last statement
    and nowhere else; each launch passes `**pdl_launch(t)` (directly or in a dict of launch options), so the
    launch attribute never comes without the wait."""
    checked = []
    for path in KERNEL_FILES:
        tree = ast.parse(path.read_text())
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        # names bound to dict(..., **pdl_launch(t)): launch options shared by several launches
        option_dicts = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                        and isinstance(n.value.func, ast.Name) and n.value.func.id == "dict"
                        and any(kw.arg is None and _is_pdl_launch(kw.value) for kw in n.value.keywords)
                        for t in n.targets if isinstance(t, ast.Name)}
        launches = _launches(tree)
        assert launches, f"{path.name}: no kernel launch found"
        for call in launches:
            name = call.func.value.id
            passes = [kw.value for kw in call.keywords if kw.arg is None]
            assert any(_is_pdl_launch(v) or (isinstance(v, ast.Name) and v.id in option_dicts) for v in passes), \
                f"{path.name}: the launch of {name} does not pass **pdl_launch(...)"
            fn = functions[name]
            assert is_triton_jit(fn), name
            last = fn.args.args[-1]
            assert last.arg == "USE_PDL" and ast.unparse(last.annotation) == "tl.constexpr", name
            assert isinstance(fn.args.defaults[-1], ast.Constant) and fn.args.defaults[-1].value is False, name
            body = fn.body
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            assert ast.unparse(body[0]) == WAIT_FIRST, f"{path.name}: {name} must wait first, in every program"
            assert ast.unparse(body[-1]) == TRIGGER_LAST, f"{path.name}: {name} must let its dependents launch last"
            assert ast.unparse(fn).count("gdc_launch_dependents") == 1, f"{path.name}: {name} triggers twice"
            checked.append(name)
    assert len(set(checked)) >= 14, sorted(set(checked))
