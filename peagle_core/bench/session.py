"""One `peagle bench` run: its settings, the summary its sections fill in (written after each one), the timer they
share and the order they run in."""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from peagle_kernels import use_triton
from peagle_kernels.dispatch import use_pdl
from peagle_core.bench.bars import BARS
from peagle_core.bench.batches import BLOCK_SIZE
from peagle_core.bench.decode import own_shape
from peagle_core.bench.models import available_bytes, free_memory
from peagle_core.bench.mxfp4 import packed_shape, packed_shapes
from peagle_core.bench.roofline import measure_bandwidth
from peagle_core.bench.summary import render_brief, write_outputs
from peagle_core.engine.graphs import graphs_supported
from peagle_core.timing import Timing, measure


class Log:
    """Progress on stderr: seconds since the start and the section count."""

    def __init__(self, total: int):
        self.t0, self.total, self.done = time.perf_counter(), total, 0

    def __call__(self, msg: str) -> None:
        print(f"[bench {time.perf_counter() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    def section(self, name: str) -> None:
        self.done += 1
        self(f"({self.done}/{self.total}) {name}")


def command_line(args: argparse.Namespace) -> str:
    """The command as typed, or one equivalent to these arguments when called from Python."""
    argv = sys.argv
    if "bench" in argv:
        return "peagle " + shlex.join(argv[argv.index("bench"):])
    parts = ["peagle", "bench", "--shape", args.shape, "--out", str(args.out)]
    for flag in ("device", "context", "layers", "warmup", "iters", "hf_tokens"):
        v = getattr(args, flag)
        if v is not None:
            parts += [f"--{flag.replace('_', '-')}", str(v)]
    for flag in ("skip_hf", "skip_draft", "skip_120b", "no_triton", "eager"):
        if getattr(args, flag):
            parts.append(f"--{flag.replace('_', '-')}")
    return shlex.join(parts)


def machine(device: torch.device) -> dict[str, Any]:
    """Device, versions and the git commit the figures came from."""
    def version(mod: str) -> str | None:
        try:
            return __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional packages
            return None

    m = {"device_type": device.type, "torch": torch.__version__, "triton": version("triton"),
         "transformers": version("transformers"), "python": platform.python_version(),
         "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "host_os": platform.platform()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        m.update(gpu_name=props.name, gpu_memory_gb=round(props.total_memory / 2**30, 1),
                 gpu_count=torch.cuda.device_count(), sm_count=props.multi_processor_count,
                 capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    try:
        root = Path(__file__).resolve().parents[2]
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            m["git_commit"] = commit.stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
            m["git_dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return m


class Bench:
    """The sections of one run, sharing the summary they fill in and write after each step."""

    def __init__(self, args: argparse.Namespace, r: dict[str, Any], out: Path):
        self.args, self.r, self.out = args, r, out
        self.device, self.dtype = r["device"], r["dtype"]
        probe = torch.empty(0, device=self.device)
        triton_on = use_triton(probe)
        self.graphs = graphs_supported(self.device, args.eager)  # the engine's rule; --eager turns them off
        own = args.shape != "120b"  # the run's own shape in bf16 (decode, verify, drafter, transformers)
        sections = (1 + (3 if own else 0) + (0 if args.skip_draft or not own else 1)
                    + (0 if args.skip_hf or not own else 1) + len(packed_shapes(self)))
        self.log = Log(sections)
        self.summary: dict[str, Any] = {
            "status": "running", "command": command_line(args), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(
                timespec="seconds"), "machine": machine(self.device),
            "settings": {"shape": args.shape, "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                         "context": r["context"], "batch_sizes": r["batch_sizes"], "max_k": r["max_k"],
                         "warmup": r["warmup"], "iters": r["iters"], "hf_tokens": r["hf_tokens"], "seed": args.seed,
                         "block_size": BLOCK_SIZE,
                         "triton_kernels": triton_on,
                         # programmatic dependent launch of the Triton kernels (PEAGLE_PDL=1, kernels/dispatch.py)
                         "pdl": triton_on and use_pdl(probe),
                         "cuda_graphs": self.graphs,
                         "timing": "CUDA events around each call, median" if self.device.type == "cuda"
                         else "perf_counter around each call, median"},
        }
        for key, *_ in BARS:
            self.summary[key] = None
        self.summary["decode_tok_s"] = {}

    def run(self) -> None:
        a, s = self.args, self.summary
        self.bandwidth()
        if a.shape != "120b":
            own_shape(self)
        else:
            s["note"] = "--shape 120b: only the 120B bs-1 decode figures; the 20B keys are null"
        for shape, key in packed_shapes(self):
            self.log.section(f"{shape}-shaped model with packed MXFP4 experts")
            self.guarded(key, lambda: s.update({key: packed_shape(self, shape)}))
            self.write()
        if a.shape != "120b" and a.skip_120b:
            s["gpt_oss_120b"] = {"not_run": "skipped with --skip-120b"}
        s["spec_c1_speedup_120b_note"] = ("not measured by `peagle bench`: it needs the engine with replayed "
                                          "acceptance at the 120B shape (benchmarks/adaptive_sweep.py)")
        s["status"] = "complete"
        self.write()
        self.log(f"wrote {self.out / 'summary.json'} and {self.out / 'summary.md'}")
        print(render_brief(s))

    def write(self) -> None:
        write_outputs(self.summary, self.out)

    def guarded(self, key: str, fn: Callable[[], Any]) -> None:
        """Run an optional section; a failure is recorded under `key` and the run goes on to the next one."""
        failed = None
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one GPU run must keep the figures the other sections give
            failed = f"failed: {type(e).__name__}: {e}"
            traceback.print_exc()
        if failed:  # outside the except block: the traceback (and the tensors its frames hold) is gone
            self.summary[key] = {"not_run": failed}
            free_memory(self.device)
            self.log(f"{key}: {failed}")
            self.write()

    def time(self, fn: Callable[[], Any]) -> Timing:
        return measure(fn, self.device, self.r["warmup"], self.r["iters"])

    def bandwidth(self) -> None:
        self.log.section("device memory bandwidth")
        if self.device.type == "cuda":
            nbytes = min(4 * 2**30, available_bytes(self.device) // 8)
        else:
            nbytes = 64 * 2**20
        bw = measure_bandwidth(self.device, nbytes, max(self.r["warmup"], 2), max(self.r["iters"], 10))
        self.summary["bandwidth"] = bw
        free_memory(self.device)
        self.log(f"read {bw['read_tb_s']:.3f} TB/s (sum), copy {bw['copy_tb_s']:.3f} TB/s (read+write); "
                 f"roofline uses {bw['tb_s']:.3f} TB/s")
        self.write()
