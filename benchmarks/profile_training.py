"""Where a drafter-training step's time goes: torch.profiler over a few steps of `peagle train`.

    python benchmarks/profile_training.py --out "$OUT" -- --target peagle_core/assets/tiny/target \
        --data data/regen.jsonl --method peagle --num-depths 8 --layers 2 --mask-token-id 9 \
        --batch-size 32 --max-len 896 --share-target-embeddings --intermediate-size 768 --out /tmp/head

Everything after `--` is `peagle train`'s own arguments (`--steps` is set here). The first `--skip` steps
(compilation, allocator warm-up) are not recorded; the next `--record` are. Writes profile_training.json and
profile_training.md: step wall time, host-side operators by self CPU time, device kernels by time, the
number of operator events a step, and host syncs a step; a step whose wall time is far above its kernel
time is host-bound.

Syncs: on CUDA, every call that waits for the device (torch.cuda.set_sync_debug_mode counts them). On
a CPU, the events of operators that would wait for a GPU were their inputs there (value reads,
data-dependent sizes); these also count the host's own planning on CPU tensors, which never waits.

Operator events are also given per drafter pass and per element (what the pass size trades against), and
with `--sites` grouped by where they come from: the backward node that ran them, else the innermost
frame of this repository (or of torch.optim) that called them.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peagle_core.training import cli  # noqa: E402
from peagle_core.training.trainer import Trainer  # noqa: E402


# Operators that read a value back (.item(), .tolist(), int(t)) or size their output by the data.
SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_dim",
            "aten::unique_consecutive", "aten::masked_select"}


@contextlib.contextmanager
def cuda_syncs(enabled: bool) -> Iterator[list[int]]:
    """Counts the calls inside that wait for the GPU into the yielded [count] (the sync debug mode warns at each)."""
    count = [0]
    if not enabled:
        yield count
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield count
        finally:
            torch.cuda.set_sync_debug_mode("default")
    count[0] = sum("synchronizing" in str(w.message) for w in caught)


def table(prof, steps: int, device: bool, top: int = 20) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        is_device = e.device_type == torch.autograd.DeviceType.CUDA
        if is_device != device or PYTHON_FRAME.search(e.key):  # Python frames (with --sites) are no operators
            continue
        us = getattr(e, "self_device_time_total", 0.0) if device else e.self_cpu_time_total
        rows.append({"name": e.key[:100], "calls_per_step": e.count / steps, "us_per_step": us / steps})
    return sorted(rows, key=lambda r: -r["us_per_step"])[:top]


SITE_FRAME = re.compile(r"^(peagle_core|kernels|benchmarks)/|^torch/optim/")
PYTHON_FRAME = re.compile(r"\.py\(\d+\): |^<built-in ")
BACKWARD_NODE = "autograd::engine::evaluate_function: "


def is_python_frame(e) -> bool:
    """A Python frame recorded by `with_stack`, not an operator (torch 2.11's events lack `is_python_function`)."""
    return bool(getattr(e, "is_python_function", False) or PYTHON_FRAME.search(e.name))


def call_site(e) -> str:
    """The backward node that ran operator event `e`, else the innermost repository (or torch.optim) frame above it."""
    while e is not None:
        if e.name.startswith(BACKWARD_NODE):
            return "backward: " + e.name[len(BACKWARD_NODE):]
        if is_python_frame(e) and SITE_FRAME.search(e.name):
            return e.name
        e = e.cpu_parent
    return "(no repository frame)"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    own, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--record", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sites", action="store_true", help="also group operator events by call site (records "
                                                         "Python stacks: slower steps)")
    a = ap.parse_args(own)
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(train_args + ["--steps", str(a.skip + a.record), "--no-progress"])
    cuda = torch.cuda.is_available() and args.device != "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls: list[float] = []
    syncs: list[int] = []
    records: list[dict] = []
    step = Trainer.step
    with profile(activities=activities, schedule=schedule(wait=a.skip, warmup=0, active=a.record),
                 with_stack=a.sites) as prof:
        def timed_step(self):
            t0 = time.perf_counter()
            with cuda_syncs(cuda) as count:
                out = step(self)
            if cuda:
                torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
            syncs.append(count[0])
            records.append(out)
            prof.step()
            return out
        Trainer.step = timed_step  # benchmark only: time and record each step of the real training loop
        try:
            cli.train_from_args(args)
        finally:
            Trainer.step = step
    recorded = walls[a.skip:]
    events = prof.key_averages()
    ops = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU and not is_python_frame(e)]
    passes = sum(r["passes"] for r in records[a.skip:])
    elements = sum(r["elements"] for r in records[a.skip:])
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "command": "python benchmarks/profile_training.py " + " ".join(argv), "method": args.method, "batch_size": args.batch_size,
           "step_s": recorded, "op_calls_per_step": len(ops) / a.record,
           "passes_per_step": passes / a.record, "elements_per_step": elements / a.record,
           "op_calls_per_pass": len(ops) / max(passes, 1), "op_calls_per_element": len(ops) / max(elements, 1),
           "sync_op_calls_per_step": sum(e.count for e in events if e.key in SYNC_OPS) / a.record,
           "cuda_syncs_per_step": sum(syncs[a.skip:]) / a.record if cuda else None,
           "kernel_ms_per_step": sum(getattr(e, "self_device_time_total", 0.0) for e in events
                                     if e.device_type == torch.autograd.DeviceType.CUDA) / a.record / 1e3,
           "host_ops": table(prof, a.record, device=False), "kernels": table(prof, a.record, device=True)}
    if a.sites:
        sites = collections.Counter(call_site(e) for e in ops)
        res["call_sites"] = [{"site": k[:100], "events_per_step": v / a.record} for k, v in sites.most_common(30)]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_training.json").write_text(json.dumps(res, indent=1))
    md = [f"# Drafter training step profile ({res['method']}, batch {res['batch_size']}, {res['device']})", "",
          f"Command: `{res['command']}`; torch {res['torch']}.", "",
          f"Step wall time (s): {', '.join(f'{s:.3f}' for s in recorded)}; kernels {res['kernel_ms_per_step']:.1f} "
          f"ms a step; {res['op_calls_per_step']:.0f} host operator events a step (nested calls included); "
          f"{res['sync_op_calls_per_step']:.0f} of syncing operators"
          + (f", {res['cuda_syncs_per_step']:.0f} CUDA syncs a step." if cuda else "."),
          f"{res['passes_per_step']:.1f} drafter passes and {res['elements_per_step']:.0f} elements a step: "
          f"{res['op_calls_per_pass']:.0f} operator events a pass, {res['op_calls_per_element']:.2f} an element.", ""]
    for name, key in (("Host operators (self CPU time)", "host_ops"), ("Device kernels", "kernels")):
        md += [f"## {name}", "", "| name | calls / step | us / step |", "| --- | --- | --- |"]
        md += [f"| `{r['name'][:80]}` | {r['calls_per_step']:.0f} | {r['us_per_step']:.0f} |" for r in res[key]] + [""]
    if a.sites:
        md += ["## Operator events by call site", "", "| site | events / step |", "| --- | --- |"]
        md += [f"| `{r['site'][:90]}` | {r['events_per_step']:.0f} |" for r in res["call_sites"]] + [""]
    (out / "profile_training.md").write_text("\n".join(md))
    print("\n".join(md[:6]))


if __name__ == "__main__":
    main()
