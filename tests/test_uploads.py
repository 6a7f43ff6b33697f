"""engine/uploads.py: host lists to device views in one copy, 16-byte aligned, through reused pinned buffers."""
from __future__ import annotations

import random

import pytest
import torch

from peagle_core.engine.uploads import Uploader

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def random_parts(rng: random.Random, n: int, floats: bool) -> list[list]:
    """Parts of ragged lengths, empty ones included."""
    sizes = [rng.choice([0, 1, 2, 3, 5, 8, 17, 64]) for _ in range(n)]
    if floats:
        return [[rng.random() for _ in range(s)] for s in sizes]
    return [[rng.randrange(-2**40, 2**40) for _ in range(s)] for s in sizes]


def check(up: Uploader, ints: list[list[int]], floats: list[list[float]]) -> tuple[list, list]:
    got_i, got_f = up.upload(ints, floats)
    assert len(got_i) == len(ints) and len(got_f) == len(floats)
    for t, want, dtype in [(t, w, torch.long) for t, w in zip(got_i, ints)] + \
                          [(t, w, torch.float32) for t, w in zip(got_f, floats)]:
        assert t.dtype == dtype and t.device.type == up.device.type
        assert t.tolist() == torch.tensor(want, dtype=dtype).tolist()
    # every view starts 16-byte aligned (Triton specialises on it): on a CPU the ints and floats are two arrays,
    # whose own alignment is malloc's, so there only offsets within each are checked
    for group in (got_i, got_f):
        base = 0 if up.device.type == "cuda" else group[0].data_ptr() if group else 0
        assert all((t.data_ptr() - base) % 16 == 0 for t in group if t.numel())
    return got_i, got_f


@pytest.mark.parametrize("seed", range(4))
def test_upload_gives_the_lists_cpu(seed):
    rng = random.Random(seed)
    check(Uploader(torch.device("cpu")), random_parts(rng, 13, False), random_parts(rng, 2, True))


def test_upload_of_nothing_cpu():
    ints, floats = Uploader(torch.device("cpu")).upload([[], []], [])
    assert [t.numel() for t in ints] == [0, 0] and floats == []


@pytest.mark.gpu
@cuda
def test_upload_reuses_pinned_buffers_safely_gpu():
    """Uploads back to back while the stream is busy (no wait between them, no `device_idle`), then ones that
    outgrow the buffers: each gives its own lists, 16-byte aligned on the device. The third upload refills the
    first's host buffer, which it may only once the first's copy has run: had it not waited, that copy, queued
    behind the stream's sleep, would have carried the third's values to the kernels reading the first's views."""
    rng = random.Random(0)
    up = Uploader(torch.device("cuda"), capacity=4096)  # fits the first uploads: no growth (a wait) among them
    torch.cuda._sleep(50_000_000)  # keep the stream busy: the copies queue behind it
    first = random_parts(rng, 6, False), random_parts(rng, 2, True)
    a = up.upload(*first)
    second = random_parts(rng, 6, False), random_parts(rng, 2, True)
    b = up.upload(*second)
    assert [t.tolist() for t in a[0]] == first[0] and [t.tolist() for t in b[0]] == second[0]
    up.device_idle()  # (tolist waited), as the runner says after each step
    torch.cuda._sleep(50_000_000)
    a = up.upload(*first)
    read_a = [t.clone() for t in a[0]]  # queued behind a's copy, as a step's kernels are
    b = up.upload(*second)
    sevens = [[7] * len(p) for p in first[0]]
    c = up.upload(sevens, first[1])  # a's buffers again: waits for a's copy (and the clones)
    assert [t.tolist() for t in read_a] == first[0]
    assert [t.tolist() for t in b[0]] == second[0] and [t.tolist() for t in c[0]] == sevens
    up.device_idle()
    for _ in range(3):
        ints = [[rng.randrange(2**40) for _ in range(rng.randrange(200, 1000))] for _ in range(5)]
        check(up, ints, random_parts(rng, 2, True))
    assert up.capacity > 4096
    assert all(t.data_ptr() % 16 == 0 for t in up.upload([[1], [2, 3]], [[0.5]])[0])
