"""Where a step's time goes on the GPU (bs 1 unless --batch): kernel times from torch.profiler, 20B shape (or 120B),
random weights.

    python benchmarks/profile_step.py --out "$OUT"        # one H200, about a minute
    python benchmarks/profile_step.py --pdl --out "$OUT"  # and the decode graph again with PEAGLE_PDL=1
    python benchmarks/profile_step.py --shape 120b --mxfp4 --graphs-only --skip-draft --out "$OUT"  # as users serve 120B

For a plain decode step and a verify step of k = 7, each replayed from CUDA graphs and run eagerly, and the
P-EAGLE drafter's step (`peagle bench`'s random 4-layer head) after a verify of K = 1 and K = 7 drafts, from
graphs: the step's wall time (CUDA events, median), the sum of its kernels' times, and the kernels grouped by
name (calls and microseconds per step). Wall time minus kernel time is what launches and gaps between kernels
cost. Writes profile.json and profile.md.

--pdl adds the decode step from CUDA graphs with PEAGLE_PDL=1 (every Triton kernel launched with programmatic
dependent launch, `kernels/dispatch.py`), right after the one without: a fresh runner, since the kernels read
PEAGLE_PDL at launch, i.e. when the graphs are captured. Compare wall times: with PDL a kernel starts before its
predecessor ends and waits inside, so the profiler's kernel times include that wait and "gaps" shrink by
construction.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from unittest import mock
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peagle_kernels.dispatch import use_pdl  # noqa: E402
from peagle_core.bench import (Layout, build_random, capture_draft_call, decode_step_bytes,  # noqa: E402
                               drafter_config, make_runner, measure, release_caches, synthetic_batch, target_config)
from peagle_core.models.drafter import Drafter  # noqa: E402
from peagle_core.models.gpt_oss import GptOss  # noqa: E402


def kernel_table(prof, steps: int) -> list[dict]:
    """Kernels grouped by name: calls and device microseconds per step, largest first."""
    rows = []
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", 0.0)
        rows.append({"kernel": e.key[:120], "calls_per_step": e.count / steps, "us_per_step": us / steps})
    return sorted(rows, key=lambda r: -r["us_per_step"])


def profile_calls(fn, dev: torch.device, steps: int) -> tuple[float, list[dict]]:
    """(median wall ms of `fn`, its kernels per call) for a callable that runs one step."""
    with torch.inference_mode():
        wall = measure(fn, dev, warmup=5, iters=30).median_ms
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])) as prof:
            for _ in range(steps):
                fn()
            sync()
    return wall, kernel_table(prof, steps)


def profile_case(target, layout: Layout, k: int, graphs: bool, steps: int, seed: int, pdl: bool = False,
                 runner_seqs: int = 1, batch_size: int = 1) -> dict:
    dev, dt = next(target.parameters()).device, next(target.parameters()).dtype
    # PEAGLE_PDL=1 while a fresh runner is built, captured and run (the kernels read it at capture)
    with mock.patch.dict(os.environ, {"PEAGLE_PDL": "1"} if pdl else {}):
        pdl_used = use_pdl(torch.empty(0, device=dev))
        runner = make_runner(target, None, "none", k, max(runner_seqs, batch_size), layout, dev, dt, seed, graphs)
        batch = synthetic_batch(batch_size, k, layout, target.config.vocab_size, seed)
        wall, table = profile_calls(lambda: runner.execute(batch), dev, steps)
        replay_ms = graph_replay_ms(runner, batch, dev) if graphs else None
        host = host_phases(runner, batch) if graphs and dev.type == "cuda" else None
    del runner
    release_caches(target)
    nbytes = decode_step_bytes(target, layout.context, batch_size, tokens_per_req=1 + k).total
    step = "decode" if k == 0 else f"verify k={k}"
    step += ", PDL" if pdl_used else ", PDL asked, unavailable" if pdl else ""
    return {"step": step, "k": k, "graphs": graphs, "pdl": pdl_used, "wall_ms": wall, "graph_replay_ms": replay_ms,
            "host_us": host, "kernel_ms": sum(r["us_per_step"] for r in table) / 1e3, "bytes": nbytes, "kernels": table}


def host_phases(runner, batch, steps: int = 30) -> dict[str, float] | None:
    """Median host microseconds of a graphed step's phases, each step starting on an idle device (as the bench
    times them): `before_replay` (building and uploading the inputs, loading the graph's buffers: the device is
    idle all that time), `replay` (the graph launch itself), `after_replay` (the LM head's and sampling's
    launches, then waiting for the device and the copy back). Parts, wherever the tree has them: `inputs` (building
    the step's metadata: `ModelRunner._host_inputs`, or an older tree's `_inputs`, which uploaded it too), `upload`
    (the `Uploader`'s copy: before the launch in older trees, after it in staged ones), `load` (the graph's buffers
    filled from device tensors, older trees) and `write` (a staged graph's pinned buffer filled from the lists);
    whatever of these the runner lacks is left out."""
    import statistics
    import time
    target = getattr(runner.graphs, "target", None)
    if target is None or not target.graphs:
        return None
    marks: list[float] = []
    for graph in target.graphs.values():
        real = graph.replay
        graph.replay = lambda real=real: (marks.append(time.perf_counter()), real(), marks.append(time.perf_counter()))
    spans: dict[str, float] = {}
    wrapped = []
    for label, obj, name in (("inputs", runner, "_inputs"), ("inputs", runner, "_host_inputs"),
                             ("upload", getattr(runner, "uploads", None), "upload"), ("load", target, "_load"),
                             ("write", target, "_write")):
        if obj is None or not hasattr(obj, name):
            continue
        def timer(*a, real=getattr(obj, name), label=label, **kw):
            t = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                spans[label] = spans.get(label, 0.0) + time.perf_counter() - t
        setattr(obj, name, timer)
        wrapped.append((obj, name))
    phases: dict[str, list[float]] = {"before_replay": [], "replay": [], "after_replay": []}
    try:
        with torch.inference_mode():
            for _ in range(steps):
                torch.cuda.synchronize()
                marks.clear()
                spans.clear()
                t0 = time.perf_counter()
                runner.execute(batch)
                t3 = time.perf_counter()
                if len(marks) != 2:
                    return None  # the step did not replay exactly one target graph
                phases["before_replay"].append(marks[0] - t0)
                phases["replay"].append(marks[1] - marks[0])
                phases["after_replay"].append(t3 - marks[1])
                for label, v in spans.items():
                    phases.setdefault(label, []).append(v)
    finally:
        for graph in target.graphs.values():
            del graph.replay
        for obj, name in wrapped:
            delattr(obj, name)  # back to the class's method
    return {k: statistics.median(v) * 1e6 for k, v in phases.items()}


def graph_replay_ms(runner, batch, dev: torch.device) -> float | None:
    """Median ms of the step's target graph replayed alone, back to back (CUDA events): the layers and the final
    norm, launch gaps inside the graph included. The step's wall time less this is what runs outside the graph:
    the LM head and sampling on the device, and on the host building and uploading the inputs, the launches and
    the copy back."""
    from peagle_core.engine.graphs import is_uniform_decode
    target = getattr(runner.graphs, "target", None)
    if target is None or dev.type != "cuda":
        return None
    with torch.inference_mode():
        tokens = sum(s.num_tokens for s in batch)
        key = target.key(len(batch), tokens, is_uniform_decode(batch), max(len(s.req.block_table) for s in batch))
        graph = target.graphs.get(key)
        return None if graph is None else measure(graph.replay, dev, warmup=5, iters=30).median_ms


def profile_draft(target, drafter, layout: Layout, K: int, graphs: bool, steps: int, seed: int) -> dict:
    """The P-EAGLE drafter's part of a step after a verify of K drafts (one forward over 2K slots)."""
    dev, dt = next(target.parameters()).device, next(target.parameters()).dtype
    runner = make_runner(target, drafter, "peagle", K, 1, layout, dev, dt, seed, graphs)
    batch = synthetic_batch(1, K, layout, target.config.vocab_size, seed)
    with torch.inference_mode():
        call = capture_draft_call(runner, batch)
    wall, table = profile_calls(call, dev, steps)
    del runner, call
    release_caches(target)
    release_caches(drafter)
    return {"step": f"P-EAGLE draft K={K}", "k": K, "graphs": graphs, "wall_ms": wall,
            "kernel_ms": sum(r["us_per_step"] for r in table) / 1e3, "bytes": None, "kernels": table}


def render(res: dict) -> str:
    out = [f"# Step profile ({res['shape']} shape, bs {res.get('batch', 1)}, context {res['context']})", "",
           f"Machine: {res['gpu']}; torch {res['torch']}; {res['date']}.", "", f"Command: `{res['command']}`", "",
           "Host us: a graphed step's host time before the graph's launch (the device idle), the launch, and after it "
           "(launching the LM head and sampling, then waiting for the device and the copy back), then parts: building "
           "the inputs, uploading them, loading the graph's buffers from the device, writing its pinned buffer "
           "(`host_phases` says which precede the launch in which tree).", "",
           "| step | graphs | wall ms | kernel ms | gaps ms | bandwidth-bound ms | host us before / replay / after; inputs, upload, load, write |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in res["cases"]:
        bound = f"{c['bytes'] / res['bandwidth_tb_s'] / 1e9:.3f}" if c.get("bytes") else "-"
        h = c.get("host_us") or {}
        host = " / ".join(f"{h[p]:.0f}" for p in ("before_replay", "replay", "after_replay") if p in h) or "-"
        if "inputs" in h:
            host += f"; {h['inputs']:.0f}, {h.get('upload', 0):.0f}, {h.get('load', 0):.0f}, {h.get('write', 0):.0f}"
        out.append(f"| {c['step']} | {'yes' if c['graphs'] else 'no'} | "
                   f"{c['wall_ms']:.3f} | {c['kernel_ms']:.3f} | {c['wall_ms'] - c['kernel_ms']:.3f} | {bound} | {host} |")
    for c in res["cases"]:
        out += ["", f"## {c['step']}, {'CUDA graphs' if c['graphs'] else 'eager'}: kernels", "",
                "| kernel | calls / step | us / step | share |", "| --- | --- | --- | --- |"]
        for r in c["kernels"][:15]:
            out.append(f"| `{r['kernel'][:80]}` | {r['calls_per_step']:.0f} | {r['us_per_step']:.1f} | "
                       f"{100 * r['us_per_step'] / 1e3 / c['kernel_ms']:.1f}% |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="20b", choices=["tiny", "20b", "120b"])
    ap.add_argument("--mxfp4", action="store_true", help="experts packed in MXFP4, as the checkpoints load on a GPU")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10, help="profiled steps per case")
    ap.add_argument("--bandwidth-tb-s", type=float, default=4.31, help="for the bandwidth-bound column")
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a smoke run, no kernel table)")
    ap.add_argument("--skip-draft", action="store_true", help="no drafter cases")
    ap.add_argument("--graphs-only", action="store_true", help="no eager cases (A/B runs of the captured steps)")
    ap.add_argument("--max-kv-splits", type=int, default=None,
                    help="cap the paged attention's KV splits (what a different split rule would give)")
    ap.add_argument("--pdl", action="store_true",
                    help="also the decode step from graphs with PEAGLE_PDL=1 (programmatic dependent launch)")
    ap.add_argument("--runner-seqs", type=int, default=1,
                    help="the step runner's max_num_seqs (its graph buckets; `peagle bench` decodes with 64)")
    ap.add_argument("--batch", type=int, default=1, help="requests in the profiled target steps (drafter cases: 1)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("profile_step.py: no CUDA device (--device cpu for a smoke run)")
    import datetime
    if a.max_kv_splits:
        import peagle_kernels.triton_attention as attention
        rule = attention.kv_splits
        attention.kv_splits = lambda *args: min(rule(*args), a.max_kv_splits)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = build_random(lambda: GptOss(target_config(a.shape), mxfp4_experts=a.mxfp4), dev, dtype, 0)
    layout = Layout.for_run(a.context, 7, 1)
    res = {"shape": a.shape + (" MXFP4" if a.mxfp4 else ""), "batch": a.batch, "context": a.context,
           "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "date": datetime.date.today().isoformat(), "command": "python benchmarks/profile_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "bandwidth_tb_s": a.bandwidth_tb_s, "cases": []}
    graph_modes = ((True,) if a.graphs_only else (True, False)) if dev.type == "cuda" else (False,)
    cases = [(lambda k=k, g=g: profile_case(target, layout, k, g, a.steps, seed=1 + k, runner_seqs=a.runner_seqs,
                                            batch_size=a.batch),
              f"k={k} graphs={g}")
             for k in (0, 7) for g in graph_modes]
    if a.pdl:  # right after the decode step without it, so both are measured before anything can time out
        cases.insert(1, (lambda: profile_case(target, layout, 0, graph_modes[0], a.steps, seed=1, pdl=True,
                                              batch_size=a.batch),
                         f"k=0 graphs={graph_modes[0]} pdl"))
    if not a.skip_draft:
        drafter = build_random(lambda: Drafter(drafter_config(target.config, parallel=True, layers=4)), dev, dtype, 7)
        cases += [(lambda K=K: profile_draft(target, drafter, layout, K, graph_modes[0], a.steps, seed=3), f"draft K={K}")
                  for K in (1, 7)]
    for run, name in cases:
        try:
            c = run()
        except Exception as e:  # keep what the other cases measured
            res.setdefault("errors", []).append(f"{name}: {type(e).__name__}: {e}")
        else:
            res["cases"].append(c)
            replay = f", graph alone {c['graph_replay_ms']:.3f} ms" if c.get("graph_replay_ms") else ""
            if c.get("host_us"):
                replay += ", host us " + " ".join(f"{p} {v:.0f}" for p, v in c["host_us"].items())
            print(f"{c['step']} graphs={c['graphs']}: wall {c['wall_ms']:.3f} ms{replay}, kernels {c['kernel_ms']:.3f} ms; "
                  f"top: " + ", ".join(f"{r['kernel'][:40]} {r['us_per_step']:.0f}us" for r in c["kernels"][:4]),
                  flush=True)
        (out / "profile.json").write_text(json.dumps(res, indent=1))
    (out / "profile.md").write_text(render(res))


if __name__ == "__main__":
    main()
