"""Per-all-reduce latency by message size: the process group (NCCL on GPUs) against `engine.allreduce.AllReduce` with
symmetric memory, for [tokens, 2880] bf16 (a decode step's hidden states), and a check that both give the same sums.

    python benchmarks/allreduce.py --tp 2 --device cuda --out docs/benchmarks/tp   # two GPUs of one host
    python benchmarks/allreduce.py --tp 2 --device cpu --dtype float32             # anywhere: gloo, the fallback

Each timing is `--count` all-reduces back to back in one CUDA graph (as the engine's target graphs hold them),
replayed `--iters` times, median, divided by the count; on CPU plain calls. Before timing, every rank sums
rank-valued inputs both ways and checks the results against the exact sum. Writes allreduce_by_size.json with the
path each size took ("one_shot", "two_shot" or "group"). Untested on GPUs so far: run it there first.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from allreduce_bench import HOST, free_port, time_calls  # noqa: E402
from peagle_core.engine.allreduce import AllReduce, path_for  # noqa: E402
from peagle_core.engine.tp import _gloo, _nccl  # noqa: E402
from peagle_core.loading.checkpoint import DTYPES  # noqa: E402


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype, timeout = DTYPES[args.dtype], datetime.timedelta(seconds=args.timeout_s)
    store = dist.TCPStore(HOST, port, world, rank == 0, timeout=timeout)
    group = _nccl(store, rank, world, timeout) if cuda else _gloo(store, rank, world, HOST, timeout)
    ours = AllReduce(group, dist.PrefixStore("allreduce", store), rank, world, device, dtype, "symm")

    def plain(t: torch.Tensor) -> torch.Tensor:  # the process group alone: NCCL on GPUs, gloo on CPU
        group.allreduce([t]).wait()
        return t

    rows = []
    for tokens in args.tokens:
        x = torch.full((tokens, args.hidden), float(rank + 1), dtype=dtype, device=device)
        want = float(world * (world + 1) // 2)  # exact in bf16 for small worlds
        same = all(bool((f(x.clone()) == want).all()) for f in (plain, ours))
        z = torch.zeros_like(x)  # timed on zeros: repeated in-place sums stay finite
        times = {}
        for name, f in (("group", plain), ("ours", ours)):
            ms = statistics.median(time_calls(lambda: [f(z) for _ in range(args.count)], device, args.warmup,
                                              args.iters))
            times[name] = 1e3 * ms / args.count
        nbytes = x.numel() * x.element_size()
        rows.append({"tokens": tokens, "bytes": nbytes, "path": path_for(nbytes, ours.buffer is not None),
                     "group_us": times["group"], "ours_us": times["ours"], "ours_over_group": times["ours"] / times["group"],
                     "sums_exact": same})
    if rank == 0:
        queue.put({"rows": rows, "ours": ours.describe()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--count", type=int, default=48, help="all-reduces per timed call (a 20b step has 48)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(args.tp, free_port(), args, queue), nprocs=args.tp, join=True,
                       start_method="spawn")
    result = queue.get()
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (gloo)"
    report = {"command": "python benchmarks/allreduce.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": device, "tp": args.tp, "dtype": args.dtype, "hidden": args.hidden,
              "torch": torch.__version__, **result}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "allreduce_by_size.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(r["sums_exact"] for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
