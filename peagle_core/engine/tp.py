"""Tensor parallelism: one engine across N devices, every decision made once, on rank 0.

Rank 0 is the engine's own process. It schedules, samples, verifies and drafts exactly as at TP=1.
Ranks 1..N-1 are workers that hold a shard of the target and nothing else. Every target forward on
rank 0 is first announced to the workers (a small header on a CPU gloo group, then the token ids and
ForwardMeta tensors on the compute group), so all ranks run the same forward and meet in its
all-reduces; only rank 0 reads the result. Workers keep no per-request state: rank 0's slot mapping
says where their K/V go, so ranks cannot disagree about accepted lengths.

CUDA graphs: every worker builds the target graphs' layout that rank 0 sends at start-up
(`graphs.target_graph_set`). Rank 0's target graphs call this group as their `graphs.Mirror`: before rank 0
captures a key the workers are told to capture it (the warm-up forwards and the captured all-reduces of
all ranks meet), and before rank 0 replays one they get the step's real inputs and the key, pad them into
their own static buffers and replay the same graph. Rank 0's forwards inside its graph code are muted
(no eager-step announcement), so a step is announced exactly once either way.

Sharding (`target_shard`, Megatron style; `DecoderLayer.all_reduce` sums the partial outputs):
  attention  q/k/v rows and sinks by head, o_proj columns (its bias on rank 0 only);
  experts    w1/b1 rows [2*start, 2*end) of the intermediate dimension (gate/up pairs are interleaved,
             so a contiguous range keeps them together), w2 columns [start, end), b2 on rank 0 only;
             packed MXFP4 experts alike on whole 32-channel blocks: ceil(I / 32 / N) blocks a rank, the last
             rank's padded with zero channels (`expert_shard_size`), so they stay packed at every N;
  lm_head    rows by vocabulary, ceil(V / N) a rank (`VocabParallelHead`): each rank computes its slice of the
             logits; greedy steps gather per-rank maxima, the others all-gather the logits;
  the rest   (embedding, norms, router) is replicated.
Rank 0 announces each LM-head call (`HEAD`: the rows and whether greedy) so the workers compute their slices and
meet it in the gather.
The drafter is small: rank 0 holds a full copy with its KV cache and is the only rank that runs it.

Each instance has its own TCPStore on a free port and its own process groups, built directly (never
torch.distributed's process-global default group), so several engines can live in one process.
`PEAGLE_TP_TIMEOUT_S` (default 300) bounds each compute collective, each header rank 0 sends, and worker start-up
(never below 60 s: spawning a process and importing torch on a loaded machine takes seconds, whatever the bound).
"""
from __future__ import annotations

import contextlib
import datetime as dt
import os
import signal
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from peagle_core.config import EngineConfig, GptOssConfig
from peagle_core.engine.allreduce import AllReduce, mode_from_env
from peagle_core.engine.graphs import target_graph_set
from peagle_core.engine.memory import bind_kv_cache, cache_bytes_per_block, freeze_heap, kv_budget_bytes, weight_bytes
from peagle_core.loading.checkpoint import Shard, load_target, read_json
from peagle_core.models.gpt_oss import GptOss
from peagle_core.models.layers import ForwardMeta

STEP, INIT, SHUTDOWN, CAPTURE, REPLAY, HEAD = 0, 1, 2, 3, 4, 5  # message kinds (header[0])
HEADER = 8  # kind, num_tokens, num_requests, block-table width, flags, graph key (requests, tokens), spare
HAS_SEQ_LENS, HAS_SLOTS, HAS_BLOCK_TABLES = 1, 2, 4
HAS_ROWS, GREEDY = 1, 2  # HEAD flags (header[2]; header[1] is the number of rows)
IDLE = dt.timedelta(days=3650)   # workers wait for rank 0 on the control group for as long as the engine idles


class TPError(RuntimeError):
    """A tensor-parallel worker died or a collective failed: this engine cannot continue."""


START_TIMEOUT_FLOOR_S = 60.0  # workers get at least this long to start, however short the collective bound


def tp_timeout_s() -> float:
    return float(os.environ.get("PEAGLE_TP_TIMEOUT_S", "300"))


# --------------------------------------------------------------------------------------------
# Checks and sharding
# --------------------------------------------------------------------------------------------


def check_divisible(cfg: GptOssConfig, n: int) -> None:
    sizes = {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
             "intermediate_size": cfg.intermediate_size}
    bad = [f"{k}={v}" for k, v in sizes.items() if v % n]
    if bad:
        raise ValueError(f"tensor_parallel_size={n} must divide the model's {', '.join(bad)}")


def rank_devices(device: torch.device, n: int, in_ray: bool) -> list[str]:
    """The device of each rank. Local workers take the next GPUs; a Ray worker sees only its bundle's GPU."""
    if device.type == "cpu":
        return ["cpu"] * n
    if device.type != "cuda":
        raise ValueError(f"tensor parallelism runs on cpu (gloo) or cuda (NCCL) devices, not {device.type!r}")
    if in_ray:
        return [str(device)] + ["cuda:0"] * (n - 1)
    base, count = device.index or 0, torch.cuda.device_count()
    if base + n > count:
        raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs (cuda:{base}..cuda:{base + n - 1}) "
                         f"but only {count} are visible")
    return [f"cuda:{base + r}" for r in range(n)]


def check_bundles(bundles: list[dict], n: int, cuda: bool) -> None:
    if len(bundles) < n:
        raise ValueError(f"tensor_parallel_size={n} needs a placement group of {n} bundles (bundle 0 for the "
                         f"engine, one per worker); the current one has {len(bundles)}")
    if cuda and any(b.get("GPU", 0) < 1 for b in bundles[1:n]):
        raise ValueError(f"tensor_parallel_size={n} on cuda: placement-group bundles 1..{n - 1} must each hold a GPU, "
                         f"got {bundles[1:n]}")


# Split dimension of each sharded parameter (by name suffix); the rest is replicated, `ONCE` on rank 0 only.
SPLIT_DIM = {"q_proj.weight": 0, "q_proj.bias": 0, "k_proj.weight": 0, "k_proj.bias": 0, "v_proj.weight": 0,
             "v_proj.bias": 0, "self_attn.sinks": 0, "o_proj.weight": 1,
             "experts.w1": 1, "experts.b1": 1, "experts.w1_blocks": 1, "experts.w1_scales": 1,  # [E, 2I, ...]
             "experts.w2": 2, "experts.w2_blocks": 2, "experts.w2_scales": 2,                   # [E, H, I(/32), ...]
             "lm_head.weight": 0}
ONCE = ("o_proj.bias", "experts.b2")  # biases after a row-parallel matmul: summed once


def target_shard(rank: int) -> Shard:
    """`(name, full tensor, this rank's shape) -> this rank's slice` for `load_target`'s shard hook.

    The rank's model (`GptOss(cfg, N)`) fixes each slice's size n along the split dimension; rank r takes
    [r*n, (r+1)*n), cut at the full size and padded with zeros to n. Heads divide evenly; the padding is for
    packed experts (whole 32-channel blocks a rank: `expert_shard_size`) and the vocabulary (ceil(V / N) rows)."""

    def shard(name: str, t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if name.endswith(ONCE):
            return t if rank == 0 else torch.zeros_like(t)
        dim = next((d for suffix, d in SPLIT_DIM.items() if name.endswith(suffix)), None)
        return t if dim is None else _slice_padded(t, dim, rank * shape[dim], shape[dim])

    return shard


def _slice_padded(t: torch.Tensor, dim: int, start: int, n: int) -> torch.Tensor:
    start = min(start, t.shape[dim])
    part = t.narrow(dim, start, min(n, t.shape[dim] - start))
    if part.shape[dim] == n:
        return part
    pad = list(t.shape)
    pad[dim] = n - part.shape[dim]
    return torch.cat([part, t.new_zeros(pad)], dim)  # zero weights, biases and scale bytes: exactly no contribution


# --------------------------------------------------------------------------------------------
# Process groups and messages
# --------------------------------------------------------------------------------------------


def _gloo(store: dist.Store, rank: int, world: int, host: str, timeout: dt.timedelta) -> dist.ProcessGroupGloo:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, world, opts)


def _nccl(store: dist.Store, rank: int, world: int, timeout: dt.timedelta):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, opts)


class Communicator:
    """Two groups: `ctrl` (gloo, CPU) carries rank 0's headers and may wait as long as the engine idles;
    `compute` (NCCL on GPUs, gloo on CPU, with the collective timeout) carries tensors and all-reduces, the latter
    through `allreduce.AllReduce` (symmetric memory for small messages with `allreduce` "symm")."""

    def __init__(self, store: dist.Store, rank: int, world: int, device: torch.device, host: str, timeout_s: float,
                 dtype: torch.dtype = torch.float32, allreduce: str = "nccl"):
        self.rank, self.world, self.device = rank, world, device
        self.timeout = timeout = dt.timedelta(seconds=timeout_s)
        self.ctrl = _gloo(dist.PrefixStore("ctrl", store), rank, world, host, timeout)  # bounded rendezvous
        self.ctrl._set_default_timeout(IDLE)  # workers wait for headers as long as the engine idles
        if device.type == "cuda":
            self.compute = _nccl(dist.PrefixStore("compute", store), rank, world, timeout)
        else:
            self.compute = _gloo(dist.PrefixStore("compute", store), rank, world, host, timeout)
        self.reducer = AllReduce(self.compute, dist.PrefixStore("allreduce", store), rank, world, device, dtype,
                                 allreduce)
        if allreduce == "symm":  # every rank takes the same path, or their all-reduces would never meet
            work, everyone = self.start_min(int(self.reducer.buffer is not None))
            work.wait()
            if not everyone.item():
                self.reducer.disable("a peer has no symmetric memory")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self.reducer(t)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        self.compute.broadcast(t, 0).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[N, *t.shape]: every rank's t, in rank order."""
        t = t.contiguous()
        out = torch.empty(self.world * t.shape[0], *t.shape[1:], dtype=t.dtype, device=t.device)
        self.compute._allgather_base(out, t).wait()  # into one buffer: no per-rank copies
        return out.view(self.world, *t.shape)

    def send_header(self, *fields: int, timeout: dt.timedelta | None = None) -> None:
        """Rank 0's side, bounded: a gloo send completes only once the peer has posted its receive, so a worker that
        stopped listening would otherwise hang rank 0 for good."""
        h = torch.zeros(HEADER, dtype=torch.long)
        h[:len(fields)] = torch.tensor(fields, dtype=torch.long)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.timeout = 0, timeout or self.timeout
        self.ctrl.broadcast([h], opts).wait()

    def recv_header(self) -> list[int]:
        h = torch.zeros(HEADER, dtype=torch.long)
        self.ctrl.broadcast(h, 0).wait()
        return h.tolist()

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values`, in rank order (control group: start-up only)."""
        t = torch.tensor(values, dtype=torch.long)
        out = [torch.empty_like(t) for _ in range(self.world)]
        self.ctrl.allgather([out], [t]).wait()
        return [o.tolist() for o in out]

    def start_min(self, value: int) -> tuple[dist.Work, torch.Tensor]:
        t = torch.tensor([value], dtype=torch.long)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        return self.ctrl.allreduce([t], opts), t


def pack_forward(input_ids: torch.Tensor, meta: ForwardMeta, kind: int = STEP, key: tuple[int, int] = (0, 0)
                 ) -> tuple[list[int], torch.Tensor]:
    """One target forward (eager STEP, or REPLAY of graph `key`) as a header and one int64 tensor (on rank 0's
    device: no host sync)."""
    if meta.attn_mask is not None:
        raise ValueError("tensor parallelism does not support forwards with an explicit attn_mask")
    T, B = input_ids.numel(), meta.query_start_loc.numel() - 1
    parts, flags, width = [input_ids, meta.positions, meta.query_start_loc], 0, 0
    if meta.seq_lens is not None:
        parts.append(meta.seq_lens)
        flags |= HAS_SEQ_LENS
    if meta.slot_mapping is not None:
        parts.append(meta.slot_mapping)
        flags |= HAS_SLOTS
    if meta.block_tables is not None:
        parts.append(meta.block_tables.reshape(-1))
        width, flags = meta.block_tables.shape[1], flags | HAS_BLOCK_TABLES
    return [kind, T, B, width, flags, *key], torch.cat([p.reshape(-1).long() for p in parts])


def payload_size(T: int, B: int, width: int, flags: int) -> int:
    return (2 * T + B + 1 + (B if flags & HAS_SEQ_LENS else 0) + (T if flags & HAS_SLOTS else 0)
            + (B * width if flags & HAS_BLOCK_TABLES else 0))


def unpack_forward(header: list[int], payload: torch.Tensor) -> tuple[torch.Tensor, ForwardMeta]:
    T, B, width, flags = header[1:5]
    sizes = [T, T, B + 1, B if flags & HAS_SEQ_LENS else 0, T if flags & HAS_SLOTS else 0,
             B * width if flags & HAS_BLOCK_TABLES else 0]
    ids, pos, qsl, seq, slots, bt = payload.split(sizes)
    return ids, ForwardMeta(positions=pos, query_start_loc=qsl, seq_lens=seq if flags & HAS_SEQ_LENS else None,
                            slot_mapping=slots if flags & HAS_SLOTS else None,
                            block_tables=bt.view(B, width) if flags & HAS_BLOCK_TABLES else None)


def install_collectives(target: GptOss, rank: int, all_reduce: Callable[[torch.Tensor], torch.Tensor],
                        all_gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
    for layer in target.model.layers:
        layer.all_reduce = all_reduce
    target.lm_head.place(rank, all_gather)


def pack_head(hidden: torch.Tensor, rows: torch.Tensor | None, greedy: bool) -> tuple[list[int], torch.Tensor | None]:
    """One LM-head call as a header (and its rows, where it takes a subset of the forward's hidden rows)."""
    n = hidden.shape[0] if rows is None else rows.numel()
    return [HEAD, n, (HAS_ROWS if rows is not None else 0) | (GREEDY if greedy else 0)], rows


# --------------------------------------------------------------------------------------------
# Workers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its shard (picklable: it crosses a process boundary)."""

    config: EngineConfig
    dtype: torch.dtype
    devices: list[str]          # per rank
    master_addr: str
    master_port: int
    gloo_host: str | None       # interface for gloo pairs; None: this node's IP (Ray, possibly several nodes)
    timeout_s: float
    num_threads: int
    triton: bool | None         # rank 0's peagle_kernels.dispatch choice
    allreduce: str              # rank 0's PEAGLE_TP_ALLREDUCE ("nccl" or "symm")


def run_worker(spec: WorkerSpec, rank: int) -> None:
    """A worker's whole life: connect, load its shard, agree on the KV cache, then follow rank 0's forwards."""
    from peagle_kernels.dispatch import set_triton_enabled
    from peagle_core.loading.hub import resolve

    torch.set_num_threads(spec.num_threads)
    set_triton_enabled(spec.triton)
    world, cfg, device = len(spec.devices), spec.config, torch.device(spec.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(spec.master_addr, spec.master_port, world, False,
                          timeout=dt.timedelta(seconds=spec.timeout_s))
    store.set(f"hello/{rank}", str(os.getpid()))
    comm = Communicator(store, rank, world, device, spec.gloo_host or _node_ip(), spec.timeout_s, spec.dtype,
                        spec.allreduce)

    path = resolve(cfg.model, cfg.revision, cfg.download_dir)  # rank 0 fetched it: a cache hit here
    tcfg = GptOssConfig.from_hf(read_json(path / "config.json"))
    target = load_target(path, spec.dtype, device, world, target_shard(rank), cfg.quantization)
    install_collectives(target, rank, comm.all_reduce, comm.all_gather)
    per_block = cache_bytes_per_block(target, cfg.block_size, spec.dtype)
    work, _ = comm.start_min(cfg.num_gpu_blocks or int(kv_budget_bytes(cfg, device) // per_block))
    work.wait()
    comm.gather_ints([weight_bytes(target), per_block])  # for rank 0's start-up log
    kind, num_blocks, max_model_len, max_num_seqs, K, budget, capture, _ = comm.recv_header()
    if kind != INIT:
        return
    bind_kv_cache(target, num_blocks, cfg.block_size, spec.dtype, device)  # rank 0's layout, this rank's heads
    graphs = target_graph_set(target, max_num_seqs, K, max_model_len, cfg.block_size, budget or None, device,
                              bool(capture), torch.cuda.graph_pool_handle() if capture else None)
    freeze_heap()  # a full collection in one rank stalls every rank's step
    hidden = None  # the last forward's output, which the LM head reads
    with torch.inference_mode():
        while True:
            header = comm.recv_header()
            kind, key = header[0], (header[5], header[6])
            if kind == SHUTDOWN:
                return
            if kind == CAPTURE:
                graphs.capture_one(key)
                continue
            if kind == HEAD:
                n, flags = header[1], header[2]
                rows = comm.broadcast(torch.empty(n, dtype=torch.long, device=device)) if flags & HAS_ROWS else None
                target.lm_head(hidden, rows, bool(flags & GREEDY))
                continue
            payload = torch.empty(payload_size(*header[1:5]), dtype=torch.long, device=device)
            input_ids, meta = unpack_forward(header, comm.broadcast(payload))
            if kind == REPLAY:
                hidden = graphs.run(input_ids, None, meta, key)[0]
            else:
                hidden = target(input_ids, meta)[0]


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _process_main(spec: WorkerSpec, rank: int, errors) -> None:
    """Entry point of a local (torch.multiprocessing spawn) worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; we exit with it
    parent = os.getppid()

    def exit_with_parent() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    try:
        run_worker(spec, rank)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1)


class ProcessWorkers:
    """Ranks 1..N-1 as local processes (LLM outside Ray, or a replica without a placement group)."""

    def __init__(self, spec: WorkerSpec):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.errors = ctx.Queue()
        self.reported: dict[int, str] = {}
        self.procs = {r: ctx.Process(target=_process_main, args=(spec, r, self.errors), name=f"peagle-tp{r}",
                                     daemon=True) for r in range(1, len(spec.devices))}
        for p in self.procs.values():
            p.start()

    def dead(self) -> list[str]:
        out = []
        for r, p in self.procs.items():
            if not p.is_alive():
                why = self._error(r) or (": it failed before running any of our code; a script that builds a "
                                         "tensor-parallel engine must do so under `if __name__ == '__main__':` "
                                         "(multiprocessing's spawn re-imports it)" if p.exitcode == 1 else "")
                out.append(f"rank {r} (pid {p.pid}) exited with code {p.exitcode}{why}")
        return out

    def _error(self, rank: int) -> str:
        while True:
            try:
                r, tb = self.errors.get_nowait()
            except Exception:  # queue.Empty, or a queue already closed
                break
            self.reported[r] = tb.strip().splitlines()[-1]
        return f": {self.reported[rank]}" if rank in self.reported else ""

    def join(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        for p in self.procs.values():
            p.join(max(0.0, end - time.monotonic()))

    def kill(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join(2.0)


class _RayWorker:
    def run(self, spec: WorkerSpec, rank: int, num_threads: int) -> None:
        run_worker(WorkerSpec(**{**spec.__dict__, "num_threads": num_threads}), rank)


class RayWorkers:
    """Ranks 1..N-1 as Ray actors in bundles 1..N-1 of the current placement group (bundle 0 holds rank 0).

    The actors are owned by rank 0's process, so Ray kills them when it dies."""

    def __init__(self, spec: WorkerSpec, pg):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_cls = ray.remote(_RayWorker)
        self.actors, self.refs = {}, {}
        for r in range(1, len(spec.devices)):
            b = pg.bundle_specs[r]
            self.actors[r] = actor_cls.options(
                num_cpus=b.get("CPU", 0), num_gpus=b.get("GPU", 0), max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)).remote()
            self.refs[r] = self.actors[r].run.remote(spec, r, max(1, int(b.get("CPU", 1))))

    def dead(self) -> list[str]:
        import ray

        ready, _ = ray.wait(list(self.refs.values()), num_returns=len(self.refs), timeout=0)
        out = []
        for r, ref in self.refs.items():
            if ref in ready:
                try:
                    ray.get(ref)
                    why = "exited"
                except Exception as e:
                    why = f"failed: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__}"
                out.append(f"rank {r} (Ray actor) {why}")
        return out

    def join(self, timeout_s: float) -> None:
        import ray

        ray.wait(list(self.refs.values()), num_returns=len(self.refs), timeout=timeout_s)

    def kill(self) -> None:
        try:
            import ray

            for a in self.actors.values():
                ray.kill(a)
        except Exception:  # Ray already shut down: its actors went with it
            pass


def current_placement_group():
    """The placement group this process runs in (a Ray Serve replica with placement_group_bundles), or None."""
    import sys

    if "ray" not in sys.modules:
        return None
    import ray

    if not ray.is_initialized():
        return None
    from ray.util import get_current_placement_group

    return get_current_placement_group()


# --------------------------------------------------------------------------------------------
# Rank 0
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GraphLayout:
    """Rank 0's target graphs, as the workers must build theirs (`graphs.target_graph_set`)."""

    max_num_seqs: int
    K: int
    budget: int | None  # the mixed steps' token budget (None: decode steps only)
    capture: bool       # False: eager, or the padded forwards without capture (CPU tests)


class SingleDevice:
    """TP=1: the same interface as `TPWorkerGroup`, doing nothing."""

    world_size = 1
    shard: Shard | None = None
    mirror = None  # no workers to mirror the target's graphs

    def apply(self, target: GptOss) -> None:
        pass

    def agree_num_blocks(self, num_blocks: int, max_model_len: int, graphs: GraphLayout, weights: int,
                         per_block: int) -> tuple[int, list[tuple[int, int]]]:
        return num_blocks, [(weights, num_blocks * per_block)]

    def check_alive(self) -> None:
        pass

    def describe(self) -> dict:
        return {"size": 1}

    def shutdown(self) -> None:
        pass


class TPWorkerGroup:
    """Rank 0's handle on ranks 1..N-1: start them, announce forwards, watch them, stop them."""

    def __init__(self, cfg: EngineConfig, model_path: Path, device: torch.device, dtype: torch.dtype):
        from peagle_kernels.dispatch import triton_enabled

        n = self.world_size = cfg.tensor_parallel_size
        allreduce = mode_from_env()
        tcfg = GptOssConfig.from_hf(read_json(model_path / "config.json"))
        check_divisible(tcfg, n)
        pg = current_placement_group()
        if pg is not None:
            check_bundles(pg.bundle_specs, n, device.type == "cuda")
        devices = rank_devices(device, n, pg is not None)
        self.shard = target_shard(0)
        self.timeout_s = tp_timeout_s()
        host = _node_ip() if pg is not None else "127.0.0.1"
        self.broken: str | None = None
        self.started = self.closed = self.quiet = False
        self.mirror = self  # rank 0's target graphs tell the workers what to capture and replay
        self.store = dist.TCPStore(host, 0, n, True, timeout=dt.timedelta(seconds=self.timeout_s),
                                   wait_for_workers=False)
        spec = WorkerSpec(cfg, dtype, devices, host, self.store.port, None if pg is not None else host,
                          self.timeout_s, torch.get_num_threads(), triton_enabled(), allreduce)
        self.workers = RayWorkers(spec, pg) if pg is not None else ProcessWorkers(spec)
        self.devices, self.launcher = devices, "ray_actors" if pg is not None else "processes"
        self._finalizer = weakref.finalize(self, self.workers.kill)  # never leave workers behind
        try:
            hello = [f"hello/{r}" for r in range(1, n)]
            self._wait(lambda: self.store.check(hello), "start", max(self.timeout_s, START_TIMEOUT_FLOOR_S))
            self.worker_pids = [int(self.store.get(k)) for k in hello]  # for operators (and tests) on one node
            self.comm = Communicator(self.store, 0, n, torch.device(devices[0]), host, self.timeout_s, dtype, allreduce)
        except BaseException:
            self.shutdown()
            raise

    def apply(self, target: GptOss) -> None:
        """All-reduce after attention and MoE, all-gather in the LM head; every target forward and LM-head call on
        rank 0 is announced to the workers first."""
        install_collectives(target, 0, self.all_reduce, self.all_gather)
        target.register_forward_pre_hook(self._announce, with_kwargs=True)
        target.lm_head.register_forward_pre_hook(self._announce_head)

    def agree_num_blocks(self, num_blocks: int, max_model_len: int, graphs: GraphLayout, weights: int,
                         per_block: int) -> tuple[int, list[tuple[int, int]]]:
        """Every rank sizes its KV cache; all take the smallest, then the workers bind theirs, build the target
        graphs' buffers of rank 0's layout and start. Also returns each rank's (weight bytes, KV-cache bytes), from
        rank 0's `weights` and `per_block` (KV bytes a block) and the workers' own."""
        work, t = self.comm.start_min(num_blocks)
        self._wait(work.is_completed, "load their shards")  # as long as loading takes, while they live
        work.wait()
        n = int(t.item())
        sizes = self.comm.gather_ints([weights, per_block])
        if n < 1:
            raise ValueError("a tensor-parallel worker has no memory for a single KV-cache block")
        self.comm.send_header(INIT, n, max_model_len, graphs.max_num_seqs, graphs.K, graphs.budget or 0,
                              int(graphs.capture))
        self.started = True
        return n, [(w, n * b) for w, b in sizes]

    def check_alive(self) -> None:
        if self.broken is None and not self.closed:
            dead = self.workers.dead()
            if dead:
                self.broken = "tensor-parallel worker " + "; ".join(dead)
        if self.broken is not None:
            raise TPError(f"{self.broken}; the engine cannot continue (tensor_parallel_size={self.world_size})")

    def describe(self) -> dict:
        return {"size": self.world_size, "workers": self.launcher, "devices": self.devices,
                "worker_pids": self.worker_pids, "all_reduce": self.comm.reducer.describe(),
                "healthy": self.broken is None and not self.closed}

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        try:
            return self.comm.all_reduce(t)
        except Exception as e:
            self._fail("all-reduce", e)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        try:
            return self.comm.all_gather(t)
        except Exception as e:
            self._fail("LM-head all-gather", e)

    def _announce_head(self, module, args) -> None:
        hidden, rows, greedy = args  # `GptOss.compute_logits` / `greedy_tokens` pass all three
        self._send("LM-head broadcast", *pack_head(hidden, rows, greedy))

    def _announce(self, module, args, kwargs) -> None:
        if self.quiet:
            return  # a forward of rank 0's graph code: `replay` / `capture` announced it
        input_ids = args[0] if args else kwargs["input_ids"]
        meta = args[1] if len(args) > 1 else kwargs["meta"]
        self._send("step broadcast", *pack_forward(input_ids, meta))

    # `graphs.Mirror`: rank 0's target graphs drive the workers' copies.
    def capture(self, key: tuple[int, int]) -> None:
        self._send("graph capture", [CAPTURE, 0, 0, 0, 0, *key])

    def replay(self, key: tuple[int, int], input_ids: torch.Tensor, meta: ForwardMeta) -> None:
        self._send("step broadcast", *pack_forward(input_ids, meta, REPLAY, key))

    @contextlib.contextmanager
    def muted(self):
        quiet, self.quiet = self.quiet, True
        try:
            yield
        finally:
            self.quiet = quiet

    def _send(self, what: str, header: list[int], payload: torch.Tensor | None = None) -> None:
        if not self.started:
            raise TPError("the tensor-parallel workers have not started yet")
        self.check_alive()
        try:
            self.comm.send_header(*header)
            if payload is not None:
                self.comm.broadcast(payload)
        except Exception as e:
            self._fail(what, e)

    def _fail(self, what: str, e: Exception):
        """A collective failed: the ranks are out of step for good. Name the dead worker if there is one."""
        end = time.monotonic() + 2.0
        dead = self.workers.dead()
        while not dead and time.monotonic() < end:  # a crashed peer closes its sockets just before it exits
            time.sleep(0.05)
            dead = self.workers.dead()
        reason = "; ".join(dead) if dead else f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        self.broken = self.broken or f"tensor-parallel {what} failed ({reason})"
        raise TPError(f"{self.broken}; the engine cannot continue (tensor_parallel_size={self.world_size})") from e

    def _wait(self, done: Callable[[], bool], what: str, timeout_s: float | None = None) -> None:
        end = time.monotonic() + timeout_s if timeout_s else None
        while not done():
            self.check_alive()
            if end is not None and time.monotonic() > end:
                raise TPError(f"tensor-parallel workers did not {what} within {timeout_s:.0f} s")
            time.sleep(0.01)

    def shutdown(self) -> None:
        """Stop the workers: politely when they are idle and healthy, by force otherwise."""
        if self.closed:
            return
        self.closed = True
        if self.started and self.broken is None:
            try:
                self.comm.send_header(SHUTDOWN, timeout=dt.timedelta(seconds=5))  # idle workers listen at once
                self.workers.join(5.0)
            except Exception:
                pass
        self.workers.kill()
        self._finalizer.detach()


def start_tensor_parallel(cfg: EngineConfig, model_path: Path, device: torch.device,
                          dtype: torch.dtype) -> SingleDevice | TPWorkerGroup:
    """TP=1: a no-op stand-in. TP=N: spawn ranks 1..N-1 (Ray actors inside a placement group, else local
    processes) and connect to them; they start loading their shards at once, in parallel with rank 0."""
    if cfg.tensor_parallel_size == 1:
        return SingleDevice()
    return TPWorkerGroup(cfg, model_path, device, dtype)
