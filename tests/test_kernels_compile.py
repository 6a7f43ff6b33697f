"""Every Triton kernel the dispatchers launch compiles for Hopper (sm_90) to a cubin, with programmatic dependent
launch off and on: compile errors show on a CPU machine, before any GPU time is spent.

The dispatchers run under Triton's interpreter on small CPU inputs that give the engine's launch parameters (bf16
activations, int64 indices, the tiles chosen at GPT-OSS-20B/120B sizes; the interpreter's bf16 `tl.dot` values
are wrong, which does not matter here). Each launch is recorded with the signature and specialisations Triton's
launcher would compile, and child processes (compiled mode: one process cannot hold both, kernel_utils.py)
compile every distinct one for sm_90 and check that its shared memory fits an H100/H200.

Not covered: what only a GPU shows (results, faults, spills, speed), configurations not recorded here, and Triton
versions: the device machines run 3.6 and this was written against 3.9 (whose internal launch binder it uses), so
differences between them can still slip through. Skipped where CUDA is available (the GPU tests compile for real)
or Triton has no NVIDIA backend.
"""
from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from kernel_utils import _load_kernels, _triton_interpreted, is_triton_jit
from peagle_kernels.attention import paged_attention
from peagle_kernels.dispatch import set_triton_enabled, triton_enabled
from peagle_kernels.draft_inputs import fill_hidden, prepare_draft_inputs
from peagle_kernels.linear import linear
from peagle_kernels.moe import moe, moe_mxfp4, norm_and_route, route
from peagle_kernels.norm import add_rms_norm
from peagle_kernels.rope import apply_rope, qkv_rope_write_kv, rope_write_kv
from peagle_kernels.sampling import rejection_sample

ROOT = Path(__file__).resolve().parents[1]
SM90_SHARED_BYTES = 232448  # the most shared memory a block can opt into on sm_90 (H100/H200: 227 KB)
PDL_ON = {"launch_pdl": True, "USE_PDL": True}  # what `pdl_launch` adds to a launch on Hopper with PEAGLE_PDL=1
# Constexprs a launch on a GPU sets where the interpreter cannot follow: the MXFP4 GEMVs' inline PTX
# (`PEAGLE_MXFP4_PTX`). Such launches are recorded both ways.
ON_GPU = {"PTX": True}
BF16 = torch.bfloat16


def pdl_kernels() -> dict[str, str]:
    """{kernel: module} for every `@triton.jit` function with a USE_PDL parameter in kernels/triton_*.py: the
    kernels launched from the host (kernels/dispatch.py), found from the sources as tests/test_kernels_pdl.py does."""
    found = {}
    for path in sorted((ROOT / "kernels" / "peagle_kernels").glob("triton_*.py")):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.FunctionDef) and is_triton_jit(node)
                    and any(a.arg == "USE_PDL" for a in node.args.args)):
                found[node.name] = f"peagle_kernels.{path.stem}"
    return found


KERNELS = pdl_kernels()


# ---------------------------------------------------------------------------------------------
# Recording launches (this process, interpreter)
# ---------------------------------------------------------------------------------------------

class Recorder:
    """Stands in for a kernel in its module: `kernel[grid](*args, **kwargs)` records the launch as Triton's
    launcher specialises it for sm_90, with PDL off and on, then runs it in the interpreter as before."""

    def __init__(self, name: str, module: str, kernel, backend, log: list[dict]):
        from triton.runtime.jit import JITFunction, create_function_from_signature
        self.name, self.module, self.kernel, self.backend, self.log = name, module, kernel, backend, log
        jit = JITFunction(kernel.fn)  # the interpreted kernel's Python function: only its parameters are used
        self.params = [p.name for p in jit.params]
        self.binder = create_function_from_signature(jit.signature, jit.params, backend)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            on_gpu = {k: v for k, v in ON_GPU.items() if k in kwargs}
            for gpu in ({}, on_gpu) if on_gpu else ({},):
                for pdl in ({}, PDL_ON):
                    self.log.append(self.job(args, {**kwargs, **gpu, **pdl}))
            return self.kernel[grid](*args, **kwargs)
        return launch

    def job(self, args: tuple, kwargs: dict) -> dict:
        """The launch as a compile job: per parameter its type ("*bf16", "i32", "constexpr", ...) and, as a
        launch on a GPU computes them, the constexpr values (ints equal to 1 included) and the attributes
        (16-byte alignment of pointers, divisibility by 16 of ints); the rest of kwargs are compile options."""
        bound, spec, options = self.binder(*args, **kwargs)
        return dict(module=self.module, kernel=self.name, options=options,
                    signature={p: s[0] for p, s in zip(self.params, spec)},
                    constexprs={p: bound[p] for p, s in zip(self.params, spec) if s[0] == "constexpr"},
                    attrs={p: self.backend.parse_attr(s[1]) for p, s in zip(self.params, spec)
                           if s[0] != "constexpr" and s[1]})


def record_launches(backend) -> Iterator[tuple[str, dict]]:
    """(scenario, job) for every kernel launch, scenario by scenario, run under the interpreter."""
    log = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.delenv("PEAGLE_PDL", raising=False)
        if not _triton_interpreted():
            pytest.fail("triton was imported before TRITON_INTERPRET=1 was set; set it in the environment")
        _load_kernels(interpret=True)
        # kernel_utils loads only its own modules; these are reloaded (interpreted, and the MXFP4 module bound to
        # the triton_moe just loaded), as their tests' fixtures do.
        for name in ("peagle_kernels.triton_moe_mxfp4", "peagle_kernels.triton_draft_inputs", "peagle_kernels.triton_sampling"):
            importlib.reload(importlib.import_module(name))
        for kernel, module in KERNELS.items():
            mp.setattr(sys.modules[module], kernel, Recorder(kernel, module, getattr(sys.modules[module], kernel),
                                                              backend, log))
        previous = triton_enabled()
        set_triton_enabled(True)
        try:
            for name, scenario in SCENARIOS.items():
                scenario()
                yield from ((name, job) for job in log)
                log.clear()
        finally:
            set_triton_enabled(previous)


# ---------------------------------------------------------------------------------------------
# Scenarios: the dispatchers with the engine's dtypes and the shapes that set the launch parameters
# ---------------------------------------------------------------------------------------------

_GEN = torch.Generator().manual_seed(0)


def randn(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.randn(*shape, generator=_GEN).to(dtype)


def norm() -> None:
    H = 2880
    x, residual, w = randn(3, H), randn(3, H), randn(H)
    add_rms_norm(x, None, w, 1e-5)                   # the first layer's norm: no residual
    add_rms_norm(x, residual, w, 1e-5)
    add_rms_norm(randn(3, 4, H), residual, w, 1e-5)  # the MoE's top-4 summands


def projections() -> None:
    """The attention projections at decode sizes (`peagle_kernels.linear`): GPT-OSS's q/k/v (K = 2880, not a multiple of
    BLOCK_K) and o (K = 4096) with biases, the drafter's without. N does not set the launch parameters beyond
    its divisibility (kept small here: the interpreter loops over the programs)."""
    for M, K, bias in ((1, 2880, True), (16, 2880, True), (1, 4096, True), (8, 4096, False)):
        linear(randn(M, K), randn(64, K), randn(64) if bias else None)


def rope() -> None:
    T, Hq, Hkv, D, page = 3, 64, 8, 64, 16
    q, k, v = randn(T, (Hq + 2 * Hkv) * D).split([Hq * D, Hkv * D, Hkv * D], -1)  # views of the packed qkv GEMM
    q, k, v = q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
    cos, sin = randn(T, 1, D // 2), randn(T, 1, D // 2)
    apply_rope(q, k, cos, sin)
    cache = torch.zeros(2, 4, page, Hkv, D, dtype=BF16)
    rope_write_kv(q, k, v, cos, sin, cache[0], cache[1], torch.tensor([5, 6, -1]))
    # the decode-sized projection, rotation and write in one launch: 16 q heads stand for 64 (the same
    # divisibility; the heads only set the grid), bs 1 and 16 tokens, with the target's bias and without
    for M, bias in ((1, True), (16, True), (1, False)):
        n = (16 + 2 * Hkv) * D
        qkv_rope_write_kv(randn(M, 2880), randn(n, 2880), randn(n) if bias else None, 16, Hkv,
                          randn(M, 1, D // 2), randn(M, 1, D // 2), cache[0], cache[1], torch.arange(M))


def attention() -> None:
    """Decode (one token a request), verify (K + 1 = 6) and prefill tiles; GPT-OSS layers have sinks and, every
    other layer, a 128-token window; the drafter has neither. A GPU splits the KV range when the grid is small:
    split counts are forced here (the CPU picks none)."""
    Hq, Hkv, D, page = 64, 8, 64, 16
    triton_attention = sys.modules["peagle_kernels.triton_attention"]
    sinks = randn(Hq)

    def run(q_lens: list[int], seq_lens: list[int], sinks: torch.Tensor | None, window: int | None,
            splits: int | None = None) -> None:
        width = -(-max(seq_lens) // page)
        positions = torch.cat([torch.arange(L - n, L) for n, L in zip(q_lens, seq_lens)])
        args = (randn(sum(q_lens), Hq, D), randn(len(q_lens) * width, page, Hkv, D),
                randn(len(q_lens) * width, page, Hkv, D), torch.arange(len(q_lens) * width).view(-1, width),
                torch.tensor(seq_lens), torch.tensor([0, *q_lens]).cumsum(0), positions, sinks, window, D ** -0.5)
        if splits is None:
            paged_attention(*args)  # through the dispatcher
        else:
            triton_attention.paged_attention_triton(*args, num_kv_splits=splits)

    run([1, 1], [40, 70], sinks, 128)
    run([1, 1], [40, 70], sinks, None, splits=4)
    run([1, 1], [40, 70], None, None)  # the drafter
    run([6, 6], [40, 70], sinks, 128, splits=3)  # a split count that is not a power of two (KV capacity caps it)
    run([6, 6], [40, 70], None, None, splits=2)
    run([40], [40], sinks, 128)


def moe_weights(H: int, I: int, E: int) -> dict[str, torch.Tensor]:
    return dict(router_w=randn(E, H), router_b=randn(E), w1=randn(E, 2 * I, H), b1=randn(E, 2 * I),
                w2=randn(E, H, I), b2=randn(E, H))


def moe_bf16() -> None:
    """Tiles by batch size (`moe_tiles`): one M-tile per expert (ONE_TILE) up to 64 tokens, the grouped GEMM
    beyond, whose pairs T = 100 sorts in `_sort_pairs_kernel` and T = 150 in torch. H does not set the MoE
    kernels' launch parameters: it is small here (the interpreter loops over it), see `routing` for 2880."""
    for T, E in ((1, 32), (1, 128), (20, 32), (48, 32), (100, 32), (150, 32), (1100, 32)):
        moe(randn(T, 64), **moe_weights(64, 64, E), top_k=4, alpha=1.702, limit=7.0, reduce=False)


def moe_packed() -> None:
    """MXFP4 experts: the CUDA-core GEMVs (the default at decode sizes; bf16 activations as fp16 pairs, in inline
    PTX on a GPU, and fp32 ones), and the MMA kernels at every size:
    `tl.dot_scaled` (the default for bf16), the explicit decode (PEAGLE_MXFP4_DOT=unpack), K split over programs (with
    its finishing kernels)."""
    triton_moe_mxfp4 = sys.modules["peagle_kernels.triton_moe_mxfp4"]
    H, I, E = 64, 64, 32
    w = moe_weights(H, I, E)
    packed = dict(router_w=w["router_w"], router_b=w["router_b"], b1=w["b1"], b2=w["b2"],
                  w1_blocks=torch.randint(0, 256, (E, 2 * I, H // 32, 16), dtype=torch.uint8),
                  w1_scales=torch.randint(120, 124, (E, 2 * I, H // 32), dtype=torch.uint8),
                  w2_blocks=torch.randint(0, 256, (E, H, I // 32, 16), dtype=torch.uint8),
                  w2_scales=torch.randint(120, 124, (E, H, I // 32), dtype=torch.uint8))
    for T in (1, 8, 24):  # GEMV_TILES, and GEMV_TILES_WIDE past 16 tokens
        moe_mxfp4(randn(T, H), **packed, top_k=4, alpha=1.702, limit=7.0)
    moe_mxfp4(randn(1, H, dtype=torch.float32), **{k: v.float() if v.is_floating_point() else v
                                                   for k, v in packed.items()}, top_k=4, alpha=1.702, limit=7.0)
    for T in (1, 150):
        x = randn(T, H)
        for dot_scaled in (None, False):
            triton_moe_mxfp4.moe_mxfp4_triton(x, **packed, top_k=4, alpha=1.702, limit=7.0, reduce=False,
                                              dot_scaled=dot_scaled, gemv=False)
    triton_moe_mxfp4.moe_mxfp4_triton(randn(4, H), **packed, top_k=4, alpha=1.702, limit=7.0, split_k=4, gemv=False)


def routing() -> None:
    """Routing at GPT-OSS's H = 2880, which sets the one-launch tiling (hidden slices): with the sort, as the MoE
    routes, for bs-1 decode and the largest one-launch batches (64 tokens, 32 at E = 128); without it through
    the `route` dispatcher; and the larger path (router GEMM, then `_route_kernel`)."""
    route_and_sort_pairs = sys.modules["peagle_kernels.triton_routing"].route_and_sort_pairs
    for T, E in ((1, 32), (64, 32), (32, 128)):
        route_and_sort_pairs(randn(T, 2880), randn(E, 2880), randn(E), 4)
    for T, E in ((1, 32), (150, 32), (40, 128)):
        route(randn(T, 2880), randn(E, 2880), randn(E), 4)
    for T, E in ((1, 32), (8, 32), (8, 128)):  # the MoE's norm riding in the routing launch (decode, bs-1 verify)
        norm_and_route(randn(T, 2880), randn(T, 2880), randn(2880), 1e-5, randn(E, 2880), randn(E), 4)


def sampling() -> None:
    """Verification of B = 2 requests of K + 1 = 6 rows; a vocabulary above BLOCK_V_MAX (GPT-OSS: 201088) gives the
    engine's tile. The engine passes fp32 logits, and no uniforms/noise when every request is greedy."""
    V, rows = 20000, 6
    logits = randn(2 * rows, V, dtype=torch.float32)
    drafts = logits.argmax(-1)
    drafts[rows - 1::rows] = -1
    cu = torch.tensor([0, rows, 2 * rows])
    rejection_sample(logits, drafts, cu, torch.zeros(2), None, None, None, None, max_rows=rows)
    uniforms, noise = torch.rand(2 * rows, generator=_GEN), torch.empty(2 * rows, V).exponential_(generator=_GEN)
    rejection_sample(logits, drafts, cu, torch.tensor([0.0, 0.8]), torch.tensor([0, 50]), torch.tensor([1.0, 0.9]),
                     uniforms, noise, max_rows=rows)


def draft_inputs() -> None:
    def prepare(q_lens: list[int]) -> tuple[torch.Tensor, ...]:
        T, B = sum(q_lens), len(q_lens)
        return prepare_draft_inputs(torch.randint(0, 1000, (T,)), torch.arange(T), torch.tensor([7] * B),
                                    torch.tensor([0, *q_lens]).cumsum(0), torch.tensor([1] * B), 999, 5)

    prepare([300])  # after a prefill: the prepare kernel's widest block
    *_, is_masked, _, hidden_map = prepare([6, 6])  # after a verify step: 2 requests of K + 1 rows, K = 5 slots
    fill_hidden(randn(12, 2880), hidden_map, is_masked, randn(2880))


SCENARIOS = {f.__name__: f for f in (norm, projections, rope, attention, moe_bf16, moe_packed, routing, sampling, draft_inputs)}


# ---------------------------------------------------------------------------------------------
# Compiling (child processes, compiled mode)
# ---------------------------------------------------------------------------------------------

def compile_for_sm90(job: dict) -> str | None:
    """None if the job compiles for sm_90 to a cubin whose shared memory fits, else why not. Runs in a child
    process started with TRITON_INTERPRET=0, where the kernels are `JITFunction`s."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = importlib.import_module(job["module"])
    assert Path(module.__file__).resolve().parent == ROOT / "kernels" / "peagle_kernels", f"{module.__file__} is not this tree's"
    index = {p: (i,) for i, p in enumerate(job["signature"])}
    src = ASTSource(getattr(module, job["kernel"]), job["signature"],
                    constexprs={index[p]: v for p, v in job["constexprs"].items()},
                    attrs={index[p]: a for p, a in job["attrs"].items()})
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=job["options"])
    except Exception as e:  # the compiler's message names the source line
        return f"{type(e).__name__}: {e}"
    if not kernel.asm.get("cubin"):
        return "no cubin"
    if kernel.metadata.shared > SM90_SHARED_BYTES:  # would fail only at launch (OutOfResources)
        return f"needs {kernel.metadata.shared} bytes of shared memory, sm_90 allows {SM90_SHARED_BYTES}"
    pdl = bool(job["constexprs"].get("USE_PDL"))
    if ("griddepcontrol.wait" in kernel.asm["ptx"]) != pdl:  # the PDL-on compile really is one
        return f"USE_PDL={pdl}, but the PTX {'lacks' if pdl else 'has'} griddepcontrol.wait"
    return None


class Compilers:
    """One child process per core (at most 4) running `compile_for_sm90` on the jobs sent to it, one JSON line
    each: they compile while the recording goes on."""

    def __init__(self, workdir: Path):
        self.workdir, self.sent = workdir, 0
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # this tree's kernels
        env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": path}
        self.children = []
        for i in range(max(1, min(4, os.cpu_count() or 1))):
            # Output to a file, not a pipe: a child blocked on a full pipe would stop reading its jobs.
            with open(workdir / f"log{i}.txt", "w") as log:
                self.children.append(subprocess.Popen([sys.executable, __file__, workdir / f"errors{i}.json"],
                                                      env=env, stdin=subprocess.PIPE, stdout=log,
                                                      stderr=subprocess.STDOUT, text=True))

    def submit(self, job: dict) -> None:
        child = self.children[self.sent % len(self.children)]
        child.stdin.write(json.dumps(job) + "\n")
        child.stdin.flush()
        self.sent += 1

    def errors(self) -> list[str | None]:
        """Per job sent, in order: None or its compile error."""
        per_child = []
        for i, child in enumerate(self.children):
            child.stdin.close()
            child.wait(timeout=900)
            log = (self.workdir / f"log{i}.txt").read_text()
            assert child.returncode == 0, f"compile worker {i} failed:\n{log[-3000:]}"
            per_child.append(json.loads((self.workdir / f"errors{i}.json").read_text()))
        return [per_child[j % len(per_child)][j // len(per_child)] for j in range(self.sent)]

    def kill(self) -> None:
        for child in self.children:
            child.kill()  # a no-op for those that have exited
            child.wait()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> list[tuple[list[str], dict, str | None]]:
    """(scenarios, job, error) for every distinct recorded launch."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the GPU tests compile the kernels for real")
    pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature  # noqa: F401  (internal: the launch binder)
        backend = make_backend(GPUTarget("cuda", 90, 32))
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"this Triton cannot compile for sm_90, or its launch binder moved: {e}")
    compilers = Compilers(tmp_path_factory.mktemp("compile"))
    try:
        launches: dict[str, tuple[list[str], dict]] = {}  # distinct jobs, in the order sent
        for scenario, job in record_launches(backend):
            key = json.dumps(job, sort_keys=True)
            if key not in launches:
                launches[key] = ([], job)
                compilers.submit(job)
            if scenario not in launches[key][0]:
                launches[key][0].append(scenario)
        errors = compilers.errors()
    finally:
        compilers.kill()
    return [(scenarios, job, error) for (scenarios, job), error in zip(launches.values(), errors)]


def describe(job: dict) -> str:
    constexprs = ", ".join(f"{p}={v}" for p, v in job["constexprs"].items())
    return f"{job['kernel']}[{constexprs}; {job['options']}]"


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernel_compiles_for_sm90(compiled, kernel):
    """Every recorded launch of the kernel compiles for sm_90, with PDL off and on."""
    mine = [(scenarios, job, error) for scenarios, job, error in compiled if job["kernel"] == kernel]
    assert mine, f"no scenario launches {kernel}: add one to SCENARIOS"
    assert {job["constexprs"].get("USE_PDL", False) for _, job, _ in mine} == {False, True}, "PDL off and on"
    for name, value in ON_GPU.items():  # and the GPU's constexprs as well as the interpreter's
        if any(name in job["constexprs"] for _, job, _ in mine):
            assert {job["constexprs"][name] for _, job, _ in mine} == {value, not value}, f"{name} both ways"
    failures = [f"{describe(job)} (scenario {', '.join(scenarios)}):\n{error}" for scenarios, job, error in mine
                if error]
    if failures:
        pytest.fail(f"{len(failures)} of {len(mine)} launches of {kernel} do not compile for sm_90:\n\n"
                    + "\n\n".join(failures), pytrace=False)


def test_every_pdl_kernel_is_launched(compiled):
    """Not vacuous: the kernels launched are exactly those with a USE_PDL parameter (each one's test above then
    requires all its launches to compile)."""
    assert len(KERNELS) >= 14, sorted(KERNELS)
    assert {job["kernel"] for _, job, _ in compiled} == set(KERNELS)


if __name__ == "__main__":  # a compile worker: jobs as JSON lines on stdin, their errors written to argv[1]
    Path(sys.argv[1]).write_text(json.dumps([compile_for_sm90(json.loads(line)) for line in sys.stdin]))
