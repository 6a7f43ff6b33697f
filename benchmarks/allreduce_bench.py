"""The all-reduces of a tensor-parallel decode step, timed alone: two a layer (after attention and after the
MoE), each over the step's [tokens, hidden] activations, through the same process groups `engine.tp` uses.

    python benchmarks/allreduce_bench.py --shape 20b --tp 2 --device cuda --batch-sizes 1,8,32 \
        --step-times docs/benchmarks/tp/graphs_20b.json --out docs/benchmarks/tp
    python benchmarks/allreduce_bench.py --shape tiny --tp 2 --device cpu     # anywhere (gloo)

On GPUs one step's all-reduces are captured in one CUDA graph (the engine's target graphs hold them the same
way) and the graph is replayed: median over replays, timed with CUDA events on rank 0. With `--step-times` (a
`parallel_bench` summary.json) the report gives each batch size's all-reduce share of the TP=N decode step with
CUDA graphs. An estimate, not a profile of the step: here the all-reduces run back to back, with no compute
between them and the ranks always in step.

`--symm-mem` (GPUs) times PyTorch's symmetric-memory one-shot all-reduce beside NCCL in the same graph shape:
each all-reduce copies [batch, hidden] into a symmetric buffer, then every rank reads its peers' buffers over
NVLink and sums (no multicast: the lent machines keep it off). A probe of the faster path for small
messages, not what the engine uses; its failure is recorded, not raised.
"""
from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peagle_core.bench.models import target_config  # noqa: E402
from peagle_core.engine.tp import _gloo, _nccl  # noqa: E402
from peagle_core.loading.checkpoint import DTYPES  # noqa: E402
from peagle_core import timing  # noqa: E402

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def time_step(pg, x: torch.Tensor, count: int, warmup: int, iters: int) -> list[float]:
    """ms per step of `count` all-reduces of x, `iters` times (a CUDA graph of them on GPUs)."""
    def step() -> None:
        for _ in range(count):
            pg.allreduce([x]).wait()

    return time_calls(step, x.device, warmup, iters)


def time_calls(step, device: torch.device, warmup: int, iters: int) -> list[float]:
    """ms per call of `step`, `iters` times (captured in a CUDA graph and replayed on GPUs, CUDA events)."""
    return list(timing.measure(timing.graphed(step, device, warmup=warmup), device, warmup, iters).samples_ms)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=args.timeout_s)
    store = dist.TCPStore(HOST, port, world, rank == 0, timeout=timeout)
    pg = _nccl(store, rank, world, timeout) if cuda else _gloo(store, rank, world, HOST, timeout)
    cfg = target_config(args.shape)
    count = 2 * cfg.num_hidden_layers
    rows = []
    p2p = cuda and world > 1 and torch.cuda.can_device_access_peer(0, 1)
    for batch in args.batch_sizes:
        x = torch.zeros(batch, cfg.hidden_size, dtype=DTYPES[args.dtype], device=device)  # zeros: sums stay finite
        times = time_step(pg, x, count, args.warmup, args.iters)
        ms = statistics.median(times)
        rows.append({"batch": batch, "all_reduces": count, "bytes_each": x.numel() * x.element_size(),
                     "ms_per_step": ms, "us_per_all_reduce": 1e3 * ms / count, "peer_access": p2p})
    if cuda and args.symm_mem:
        symm_mem_rows(rows, store, rank, world, device, args)
    if rank == 0:
        queue.put(rows)


def symm_mem_rows(rows: list[dict], store, rank: int, world: int, device: torch.device, args) -> None:
    """Add each row's time with PyTorch's symmetric-memory one-shot all-reduce (copy in, one-shot out)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        dist.init_process_group("nccl", store=dist.PrefixStore("symm", store), rank=rank, world_size=world,
                                device_id=device)
        name = dist.group.WORLD.group_name
        count = rows[0]["all_reduces"]
        for r in rows:
            x = torch.zeros(r["bytes_each"] // DTYPES[args.dtype].itemsize, dtype=DTYPES[args.dtype], device=device)
            buf = symm_mem.empty(x.numel(), dtype=x.dtype, device=device)
            symm_mem.rendezvous(buf, name)

            def step() -> None:
                for _ in range(count):
                    buf.copy_(x)
                    x.copy_(torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name))

            ms = statistics.median(time_calls(step, device, args.warmup, args.iters))
            r.update(symm_mem_ms_per_step=ms, symm_mem_us_per_all_reduce=1e3 * ms / count)
    except Exception as e:  # a probe: the reason goes in the report
        for r in rows:
            r["symm_mem_error"] = f"{type(e).__name__}: {e}"[:300]


def measure(args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(args.tp, free_port(), args, queue), nprocs=args.tp, join=True,
                       start_method="spawn")
    return queue.get()


def add_shares(rows: list[dict], summary: dict, tp: int) -> str | None:
    """Each row's share of the summary's TP=tp decode step (`tp<N>`: with CUDA graphs on GPUs; the eager run
    is `tp<N>_eager`); returns that run's name, None if the summary has none."""
    name = f"tp{tp}"
    run = summary.get("runs", {}).get(name)
    if run is None:
        return None
    step = {d["batch"]: d["median_ms"] for d in run["decode"]}
    for r in rows:
        if r["batch"] in step:
            r["step_ms"] = step[r["batch"]]
            r["share_of_step"] = r["ms_per_step"] / step[r["batch"]]
    return name


def to_markdown(result: dict) -> str:
    rows = result["rows"]
    shares = any("share_of_step" in r for r in rows)
    lines = [f"# All-reduces of a TP={result['tp']} decode step ({result['shape']} shape, {result['dtype']})", "",
             f"- machine: {result['device_name']}; torch {result['torch']}; date {result['date']}",
             f"- command: `{result['command']}`",
             f"- {rows[0]['all_reduces']} all-reduces a step (two a layer) of [batch, hidden], back to back"
             + (" in one CUDA graph" if result["device"] == "cuda" else "") + "; median of "
             f"{result['iters']} steps" + (f"; step times from `{result['step_times']}` ({result['step_run']})"
                                           if shares else ""), "",
             "| batch | bytes each | all-reduces (ms a step) | us each |" + (" TP step (ms) | share |" if shares else ""),
             "|---|---|---|---|" + ("---|---|" if shares else "")]
    for r in rows:
        line = f"| {r['batch']} | {r['bytes_each']} | {r['ms_per_step']:.3f} | {r['us_per_all_reduce']:.1f} |"
        if shares:
            line += (f" {r['step_ms']:.2f} | {r['share_of_step']:.0%} |" if "share_of_step" in r else " - | - |")
        lines.append(line)
    if rows[0].get("peer_access") is not None and result["device"] == "cuda":
        lines += ["", f"GPU 0 can access GPU 1's memory directly (CUDA peer access): {rows[0]['peer_access']}."]
    if any("symm_mem_us_per_all_reduce" in r for r in rows):
        lines += ["", "PyTorch symmetric-memory one-shot all-reduce (copy into the symmetric buffer, then one-shot), "
                      "the same shape:", "", "| batch | ms a step | us each | against NCCL |", "|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['symm_mem_ms_per_step']:.3f} | {r['symm_mem_us_per_all_reduce']:.1f} | "
                  f"{r['symm_mem_ms_per_step'] / r['ms_per_step']:.2f}x |" for r in rows]
    elif any("symm_mem_error" in r for r in rows):
        lines += ["", f"Symmetric-memory one-shot all-reduce: not run ({rows[0]['symm_mem_error']})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=["tiny", "20b", "120b"], default="20b")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", choices=["cuda", "cpu"])
    p.add_argument("--dtype", choices=list(DTYPES))
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--step-times", help="a parallel_bench summary.json: report the share of its TP=N step")
    p.add_argument("--symm-mem", action="store_true", help="GPUs: also time the symmetric-memory one-shot path")
    p.add_argument("--out", default="docs/benchmarks/tp")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        print(f"--tp {args.tp} needs {args.tp} GPUs; this machine has {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    result = {"shape": args.shape, "tp": args.tp, "device": args.device, "dtype": args.dtype, "iters": args.iters,
              "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "date": datetime.date.today().isoformat(),
              "command": "python benchmarks/allreduce_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rows": measure(args), "step_times": args.step_times}
    if args.step_times and Path(args.step_times).is_file():
        result["step_run"] = add_shares(result["rows"], json.loads(Path(args.step_times).read_text()), args.tp)
    elif args.step_times:  # e.g. the step-time run before it was cut short: the all-reduce times still count
        print(f"no step times at {args.step_times}: reporting the all-reduces alone", file=sys.stderr)
        result["step_times"] = None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "allreduce.json").write_text(json.dumps(result, indent=2))
    (out / "allreduce.md").write_text(to_markdown(result))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
