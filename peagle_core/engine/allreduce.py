"""The tensor-parallel all-reduce: PyTorch symmetric memory for a decode step's small messages, NCCL/gloo else.

NCCL's ring/tree kernels took ~23 us per [batch, 2880] bf16 all-reduce on two H200s, whatever the batch: latency,
not bandwidth (docs/tensor_parallel.md). With symmetric memory every rank maps its peers' buffers, so
  one-shot   each rank copies its input into its buffer and reads all N buffers, summing them in rank order;
  two-shot   each rank sums its 1/N chunk of all N buffers in rank order, then gathers the others' chunks
(PyTorch's `symm_mem` ops, CUDA-graph capturable). Every rank adds the same values in the same order, so every rank
gets the same bits, as with NCCL. One-shot up to `ONE_SHOT_MAX_BYTES`, two-shot up to the buffer, the process
group beyond (prefill chunks, which are bandwidth-bound) and wherever symmetric memory is missing (CPU: gloo).

The engine's groups are built directly, never registered with torch.distributed (several engines may share a
process), so the buffer's rendezvous goes through this instance's own store under a name of its own.

`PEAGLE_TP_ALLREDUCE=symm` turns it on (default `nccl`: the process group only). Not yet run on a GPU: only the
fallback has been exercised (CPU); `benchmarks/allreduce.py` times both and checks their sums on two GPUs.
"""
from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist

ONE_SHOT_MAX_BYTES = 512 << 10   # one-shot below (a bs-64 decode step's [64, 2880] bf16 is 360 KiB)
BUFFER_BYTES = 8 << 20           # two-shot up to this (1456 tokens of 2880 bf16); the process group beyond
_names = itertools.count()


def mode_from_env() -> str:
    mode = os.environ.get("PEAGLE_TP_ALLREDUCE", "nccl")
    if mode not in ("nccl", "symm"):
        raise ValueError(f"PEAGLE_TP_ALLREDUCE must be 'nccl' or 'symm', got {mode!r}")
    return mode


def path_for(nbytes: int, symm: bool, buffer_bytes: int = BUFFER_BYTES) -> str:
    """Which path an all-reduce of `nbytes` takes: "one_shot", "two_shot" or "group"."""
    if not symm or nbytes > buffer_bytes or nbytes % 16:  # the symm_mem kernels move 16-byte vectors
        return "group"
    return "one_shot" if nbytes <= ONE_SHOT_MAX_BYTES else "two_shot"


class AllReduce:
    """Sum `t` over the ranks of `group` (call it). `mode` "symm" sets up a symmetric buffer where it can (CUDA, the
    ops present); `why_not` says why it could not."""

    def __init__(self, group, store: dist.Store, rank: int, world: int, device: torch.device, dtype: torch.dtype,
                 mode: str = "nccl", buffer_bytes: int = BUFFER_BYTES):
        self.group, self.buffer_bytes = group, buffer_bytes
        self.buffer: torch.Tensor | None = None
        self.name = ""
        self.why_not = "PEAGLE_TP_ALLREDUCE=nccl" if mode == "nccl" else None
        if mode == "symm":
            try:
                self._setup(store, rank, world, device, dtype)
            except Exception as e:  # no CUDA, no symm_mem ops, an old driver: the group does it all
                self.why_not = f"{type(e).__name__}: {e}"[:300]

    def _setup(self, store: dist.Store, rank: int, world: int, device: torch.device, dtype: torch.dtype) -> None:
        if device.type != "cuda":
            raise RuntimeError("symmetric memory needs CUDA devices")
        if rank == 0:  # a name no other engine in any of these processes uses; every rank reads rank 0's
            store.set("symm_name", f"peagle-tp-{os.getpid()}-{next(_names)}")
        self.name = store.get("symm_name").decode()
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _SymmetricMemory

        _SymmetricMemory.set_group_info(self.name, rank, world, dist.PrefixStore(self.name, store))
        self.buffer = symm_mem.empty(self.buffer_bytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.name)
        ops = torch.ops.symm_mem
        self._copy_in_one_shot = hasattr(ops, "one_shot_all_reduce_copy")  # one launch instead of a copy and one

    def disable(self, why: str) -> None:
        self.buffer, self.why_not = None, self.why_not or why

    def describe(self) -> str:
        return "symmetric memory (one-/two-shot), process group beyond" if self.buffer is not None \
            else f"process group ({self.why_not})"

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks: t itself (summed in place), or a new tensor (one-shot)."""
        nbytes = t.numel() * t.element_size()
        path = path_for(nbytes, self.buffer is not None and t.dtype == self.buffer.dtype and t.is_contiguous(),
                        self.buffer_bytes)
        if path == "group":
            self.group.allreduce([t]).wait()
            return t
        ops, buf = torch.ops.symm_mem, self.buffer[:t.numel()]
        if path == "one_shot":
            if self._copy_in_one_shot:
                return ops.one_shot_all_reduce_copy(buf, t.view(-1), "sum", self.name).view(t.shape)
            buf.copy_(t.view(-1))
            return ops.one_shot_all_reduce(buf, "sum", self.name).view(t.shape)
        buf.copy_(t.view(-1))
        ops.two_shot_all_reduce_(buf, "sum", self.name)
        return t.copy_(buf.view(t.shape))  # out of the buffer: the next all-reduce overwrites it
