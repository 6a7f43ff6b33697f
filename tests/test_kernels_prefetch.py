"""The L2 prefetch (kernels/prefetch.py): the touch kernel reads every word of its chunks (its per-chunk maximum
equals the reference's, with each chunk's maximum planted at a random word), and a projection whose weight was
prefetched on the side branch of a CUDA graph gives what it gives without."""
from __future__ import annotations

import pytest
import torch

from kernel_utils import triton_cuda, triton_interpret  # noqa: F401  (fixtures)
from kernels import prefetch
from kernels.dispatch import use_triton
from kernels.linear import linear
from kernels.prefetch import CHUNK_WORDS, TOUCH_BLOCK, TOUCH_STEPS, l2_touch, l2_touch_ref, num_chunks, prefetch_l2


def _planted(n: int, step: int, seed: int) -> torch.Tensor:
    """Random words below 1000, each chunk's maximum (a distinct value above them) at a random word of the
    chunk's `step`-th block of TOUCH_BLOCK words (or its last word, where the chunk is shorter)."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2 ** 31), 1000, (n,), generator=g, dtype=torch.int32)
    for c in range(num_chunks(n)):
        at = c * CHUNK_WORDS + step * TOUCH_BLOCK + int(torch.randint(TOUCH_BLOCK, (1,), generator=g))
        words[min(at, min(n, (c + 1) * CHUNK_WORDS) - 1)] = 2000 + c
    return words


@pytest.mark.parametrize("n", [1, 1000, CHUNK_WORDS, CHUNK_WORDS + 1, 3 * CHUNK_WORDS - 7])
def test_the_touch_kernel_reads_every_block_of_every_chunk(triton_interpret, n):
    for step in range(TOUCH_STEPS):
        words = _planted(n, step, seed=step)
        assert use_triton(words)
        got = l2_touch(words, torch.empty(num_chunks(n), dtype=torch.int32))
        want = l2_touch_ref(words, torch.empty(num_chunks(n), dtype=torch.int32))
        assert torch.equal(want, 2000 + torch.arange(num_chunks(n), dtype=torch.int32))  # the oracle's own check
        assert torch.equal(got, want), f"step {step}"


def test_the_touch_rejects_what_is_no_flat_int32():
    with pytest.raises(ValueError, match="flat int32"):
        l2_touch(torch.zeros(8, dtype=torch.bfloat16), torch.empty(1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"int32 \[2\]"):
        l2_touch(torch.zeros(CHUNK_WORDS + 1, dtype=torch.int32), torch.empty(1, dtype=torch.int32))


def test_nothing_is_prefetched_outside_a_cuda_graph_capture():
    join = prefetch_l2(torch.zeros(1 << 20, dtype=torch.bfloat16), 1)
    assert join is prefetch._nothing


@pytest.mark.gpu
@pytest.mark.parametrize("enabled", ["1", "0"])
def test_a_graph_with_the_prefetch_gives_the_projection_bit_for_bit(triton_cuda, monkeypatch, tmp_path, enabled):
    """A captured step shaped as the attention layer's (a GEMM, the fork, other kernels, the join, the GEMV)
    replays to exactly what the eager GEMV gives, with the touch kernel in the graph and without (the graph's
    debug dump says which)."""
    monkeypatch.setenv("PEAGLE_L2_PREFETCH", enabled)
    monkeypatch.setattr(prefetch, "_scratch", {})
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 2880, device="cuda", dtype=torch.bfloat16, generator=g)
    w_in = torch.randn(4096, 2880, device="cuda", dtype=torch.bfloat16, generator=g) * 2880 ** -0.5
    w_out = torch.randn(2880, 4096, device="cuda", dtype=torch.bfloat16, generator=g) * 4096 ** -0.5

    def step() -> torch.Tensor:
        h = torch.nn.functional.linear(x, w_in)
        join = prefetch_l2(w_out, h.shape[0])
        h = torch.tanh(h) * 2  # the main stream's work beside the prefetch
        join()
        return linear(h, w_out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the warm-up: compiles the touch kernel, outside the capture
        step()
    torch.cuda.current_stream().wait_stream(stream)
    assert len(prefetch._scratch) == (enabled == "1")
    graph = torch.cuda.CUDAGraph()
    graph.enable_debug_mode()
    with torch.cuda.graph(graph):
        out = step()
    graph.debug_dump(str(tmp_path / "graph.dot"))
    assert ("_l2_touch_kernel" in (tmp_path / "graph.dot").read_text()) == (enabled == "1")
    for _ in range(3):
        x.normal_()
        graph.replay()
        torch.testing.assert_close(out, step(), atol=0, rtol=0)
