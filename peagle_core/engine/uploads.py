"""A step's metadata from host lists to the device: one copy through reused pinned buffers.

Before an eager step's first launch the device is idle, so every microsecond the host spends here is step time,
and on a virtual machine each CUDA call costs the host 10-20 us. So the integers and the float sampling parameters
share one buffer, written with one memmove into pinned memory kept from step to step, and reach the device in one
asynchronous copy. A graphed step uploads only its verification inputs here, after the graph's launch: the graph
copies its own inputs in (`graphs.GraphSet`, staged).

Two buffers alternate. The host refills one only once the copy that last read it has run: the runner says
when the device is idle (`device_idle`, after each step's device-to-host copy), and an upload into a buffer
whose copy may still be pending waits for the device first (a caller uploading thrice without a step's end;
never the engine). No CUDA event guards the buffers: recording and checking one would be two more CUDA calls
per step. Device-side reuse needs no care: the copy into a device buffer is queued on the stream behind every
kernel that read the buffer's earlier views.

Every view starts 16 bytes aligned: Triton specialises a kernel on whether each pointer is, and views at
offsets set by the step's sizes made the eager kernels compile new variants in live steps.
"""
from __future__ import annotations

import array
import ctypes
from itertools import chain, repeat

import torch

_ALIGN = 16  # bytes


def _packed(parts: list[list], code: str) -> tuple[array.array, list[int]]:
    """The parts back to back, each padded to a multiple of 16 bytes; the split sizes (part, pad, part, ...)."""
    per = _ALIGN // array.array(code).itemsize
    pads = [-len(part) % per for part in parts]
    values = array.array(code, chain.from_iterable(chain(part, repeat(0, pad)) for part, pad in zip(parts, pads)))
    return values, [n for part, pad in zip(parts, pads) for n in (len(part), pad)]


def _tensor(values: array.array, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over the array's memory (frombuffer refuses an empty one)."""
    return torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)


def _views(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(flat.split(sizes)[::2]) if sizes else []


class Uploader:
    """`upload(ints, floats)`: int64 and float32 device views of host lists, in one copy."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16):
        self.device = device
        self.capacity = capacity  # bytes per buffer; doubled when a step needs more
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending = [False, False]  # buffer i's last copy may not have run yet
        self._turn = 0

    def device_idle(self) -> None:
        """Every copy queued so far has run (the caller waited for the device)."""
        self._pending = [False, False]

    def upload(self, ints: list[list[int]], floats: list[list[float]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        longs, long_sizes = _packed(ints, "q")
        singles, single_sizes = _packed(floats, "f")
        if self.device.type != "cuda":  # no copy to wait for: the arrays' memory itself, moved if need be
            return (_views(_tensor(longs, torch.long).to(self.device), long_sizes),
                    _views(_tensor(singles, torch.float32).to(self.device), single_sizes))
        n_long, n_single = len(longs) * 8, len(singles) * 4
        host, dev = self._buffer(n_long + n_single)
        ctypes.memmove(host.data_ptr(), longs.buffer_info()[0], n_long)
        ctypes.memmove(host.data_ptr() + n_long, singles.buffer_info()[0], n_single)
        dev[:n_long + n_single].copy_(host[:n_long + n_single], non_blocking=True)
        return (_views(dev[:n_long].view(torch.long), long_sizes),
                _views(dev[n_long:n_long + n_single].view(torch.float32), single_sizes))

    def _buffer(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (pinned host buffer, device buffer) in turn, free to refill, (re)allocated while smaller
        than `nbytes`."""
        while self.capacity < nbytes:
            self.capacity *= 2
        if not self._buffers or self._buffers[0][0].numel() < self.capacity:
            # (the caching host allocator keeps a dropped pinned buffer until its last copy has run)
            self._buffers = [(torch.empty(self.capacity, dtype=torch.uint8, pin_memory=True),
                              torch.empty(self.capacity, dtype=torch.uint8, device=self.device)) for _ in range(2)]
        self._turn ^= 1
        if self._pending[self._turn]:
            torch.cuda.synchronize(self.device)
            self.device_idle()
        self._pending[self._turn] = True
        return self._buffers[self._turn]
