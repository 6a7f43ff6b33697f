"""The one step timer: `peagle bench`, the engine's start-up profile and the benchmarks all time calls here.

Two clocks:
  events  CUDA events around each call, the calls queued back to back and one synchronisation at the end: the
          device's time per call (when the stream is idle the start event fires at once, so host work inside
          the call counts too). On a CPU it is the wall clock.
  wall    perf_counter around each call, the device synchronised before the clock stops: the host's time for
          a call and its work, as the engine's loop sees a step.

`time_graph` times a short op without its launch cost: `reps` calls captured in one CUDA graph, replayed.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Literal, Mapping

import torch

Clock = Literal["events", "wall"]


@dataclass(frozen=True)
class Timing:
    """Milliseconds of each timed call, in order."""

    samples_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)

    @property
    def n(self) -> int:
        return len(self.samples_ms)


def sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_cells(cells: Mapping[Hashable, Callable[[], Any]], device: torch.device, warmup: int, iters: int,
                  clock: Clock = "events", interleave: bool = True) -> dict[Hashable, Timing]:
    """`iters` timed calls of every cell after `warmup` untimed ones each (compilation, autotuning, graph capture,
    the allocator). `interleave`: round-robin over the cells, so a slow spell of a shared machine hits all of them
    alike; otherwise cell by cell, each warmed up right before it is timed."""
    use_events = clock == "events" and device.type == "cuda"
    samples: dict[Hashable, list[float]] = {c: [] for c in cells}
    pending: list[tuple[Hashable, torch.cuda.Event, torch.cuda.Event]] = []

    def timed(c: Hashable) -> None:
        if use_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            cells[c]()
            end.record()
            pending.append((c, start, end))
        else:
            t0 = time.perf_counter()
            cells[c]()
            sync(device)
            samples[c].append((time.perf_counter() - t0) * 1e3)

    groups = [list(cells)] if interleave else [[c] for c in cells]
    for group in groups:
        for c in group:
            for _ in range(warmup):
                cells[c]()
        sync(device)
        for _ in range(iters):
            for c in group:
                timed(c)
    if pending:
        sync(device)
        for c, start, end in pending:
            samples[c].append(start.elapsed_time(end))
    return {c: Timing(tuple(v)) for c, v in samples.items()}


def measure(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int, clock: Clock = "events") -> Timing:
    """One call site's `measure_cells`."""
    return measure_cells({0: fn}, device, warmup, iters, clock)[0]


def graphed(fn: Callable[[], Any], device: torch.device, reps: int = 1, warmup: int = 3) -> Callable[[], Any]:
    """`reps` calls of `fn` as one call: on CUDA captured in a CUDA graph (launch costs as in the engine's graphs),
    returning its replay; elsewhere the calls in a row. `warmup` plain calls come first (compilation)."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        def repeat() -> None:
            for _ in range(reps):
                fn()
        return repeat
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph.replay


def time_graph(fn: Callable[[], Any], device: torch.device, reps: int = 20, trials: int = 5) -> float:
    """Microseconds per call of a short op: `graphed(fn, reps)`, best of `trials` calls, each timed alone on an
    idle device (events on CUDA)."""
    call = graphed(fn, device, reps)
    best = min(measure(call, device, warmup=0, iters=1).min_ms for _ in range(trials))
    return best * 1e3 / reps
