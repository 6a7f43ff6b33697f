"""The shared step timer (`peagle_core.timing`) on a CPU: what it counts, in which order it calls, and that its
figures follow the work timed."""
import time

import pytest
import torch

from peagle_core.timing import graphed, measure, measure_cells, time_graph

CPU = torch.device("cpu")


@pytest.mark.parametrize("clock", ["events", "wall"])
def test_measure_takes_the_median_after_warmup(clock):
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.02 if len(calls) <= 2 else 0.002)  # slow warm-up calls must not count

    t = measure(fn, CPU, warmup=2, iters=5, clock=clock)
    assert len(calls) == 7 and t.n == 5 == len(t.samples_ms)
    assert 2.0 <= t.min_ms <= t.median_ms <= t.max_ms < 20.0  # no sample is a 20 ms warm-up call


def test_longer_work_takes_longer():
    """Sleeps of 1, 4 and 16 ms: each cell's fastest call is at least its sleep, and the cells keep their order
    (a slow spell of a loaded machine only ever adds; it cannot make 16 ms look shorter than 4)."""
    t = measure_cells({ms: (lambda ms=ms: time.sleep(ms / 1e3)) for ms in (1, 4, 16)}, CPU, warmup=1, iters=3)
    assert all(t[ms].min_ms >= ms for ms in t)
    assert t[1].min_ms < t[4].min_ms < t[16].min_ms


def test_interleaved_cells_run_round_robin_after_each_cells_warmup():
    order = []
    cells = {c: (lambda c=c: order.append(c)) for c in "ab"}
    measure_cells(cells, CPU, warmup=2, iters=3)
    assert order == ["a", "a", "b", "b"] + ["a", "b"] * 3
    order.clear()
    measure_cells(cells, CPU, warmup=1, iters=2, interleave=False)
    assert order == ["a", "a", "a", "b", "b", "b"]  # each cell warmed up right before it is timed


def test_wall_clock_reads_perf_counter_around_each_call(monkeypatch):
    """The engine's start-up profile relies on it: a call's time is the perf_counter advance across it."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    costs = iter([5.0, 3.0, 7.0, 4.0])  # seconds: one warm-up, then three timed calls

    def step():
        clock[0] += next(costs)

    t = measure(step, CPU, warmup=1, iters=3, clock="wall")
    assert t.samples_ms == (3e3, 7e3, 4e3)


def test_time_graph_gives_the_time_of_one_call():
    """On a CPU a 'graph' of `reps` calls is the calls in a row; the figure is per call, so a 2 ms op reads about
    2 ms whatever the repetition count."""
    calls = []
    one = graphed(lambda: calls.append(1), CPU, reps=4, warmup=2)
    assert calls == [1, 1]
    one()
    assert len(calls) == 6
    for reps in (1, 5):
        us = time_graph(lambda: time.sleep(2e-3), CPU, reps=reps, trials=2)
        assert 2e3 <= us < 2e4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_events_and_graph_replays_follow_the_work():
    """More bytes copied take longer, with events around queued calls and with graph replays alike."""
    dev = torch.device("cuda")
    small, big = (torch.empty(n, device=dev) for n in (1 << 20, 1 << 26))
    outs = {n: torch.empty_like(x) for n, x in (("small", small), ("big", big))}
    t = measure_cells({"small": lambda: outs["small"].copy_(small), "big": lambda: outs["big"].copy_(big)}, dev,
                      warmup=2, iters=5)
    assert 0 < t["small"].median_ms < t["big"].median_ms
    assert 0 < time_graph(lambda: outs["small"].copy_(small), dev) < time_graph(lambda: outs["big"].copy_(big), dev)


@pytest.mark.parametrize("script", ["moe_tiles", "skinny_linear", "allreduce_bench"])
def test_gpu_only_scripts_import_and_time_with_the_shared_timer(script):
    """These run only on the lent GPUs (benchmarks/gpu_run.sh); on a CPU they must at least import (one imported a
    module that had been deleted) and time through `peagle_core.timing`."""
    import importlib.util
    from pathlib import Path

    from peagle_core import timing

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{script}.py"
    spec = importlib.util.spec_from_file_location(f"gpu_script_{script}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert getattr(mod, "time_graph", None) is timing.time_graph or getattr(mod, "timing", None) is timing
