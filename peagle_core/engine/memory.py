"""Device memory and the heap: the KV cache's budget and layout, and the collector around engine start-up.

Shared by rank 0 (`LLMEngine`) and the tensor-parallel workers (`tp.run_worker`), which size and bind their caches
the same way.
"""
from __future__ import annotations

import gc

import torch

from peagle_core.config import EngineConfig


def kv_budget_bytes(cfg: EngineConfig, device: torch.device) -> float:
    """Bytes this device may give the KV cache (every tensor-parallel rank asks for its own)."""
    if cfg.kv_cache_memory_gb:
        return cfg.kv_cache_memory_gb * 2**30
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free - (1 - cfg.gpu_memory_utilization) * total
    return 2 * 2**30


def cache_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block in every attention layer of `model`."""
    layers = model.attention_layers()
    return 2 * len(layers) * block_size * layers[0].num_kv_heads * layers[0].head_dim * dtype.itemsize


def weight_bytes(*models) -> int:
    """Bytes of the models' parameters as held (packed experts at their packed size; None models count 0)."""
    return sum(p.numel() * p.element_size() for m in models if m is not None for p in m.parameters())


def memory_line(per_rank: list[tuple[int, int]]) -> str:
    """The start-up log line: (weight bytes, KV-cache bytes) of each tensor-parallel rank."""
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    return "memory per rank: " + "; ".join(f"rank {r} weights {gb(w)}, KV cache {gb(kv)}"
                                           for r, (w, kv) in enumerate(per_rank))


def bind_kv_cache(model, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One tensor [2, layers, blocks, block_size, kv heads, head dim] for `model`'s K/V; each attention layer gets
    its views."""
    layers = model.attention_layers()
    a = layers[0]
    cache = torch.zeros(2, len(layers), num_blocks, block_size, a.num_kv_heads, a.head_dim, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.kv_cache = (cache[0, i], cache[1, i])
    return cache


def reclaim_dropped_engines() -> None:
    """Collect what engines dropped since the last start-up left, before a CUDA engine loads weights and sizes its KV
    cache from the free memory. Their start-up froze them (`freeze_heap`), so a reference cycle among their objects
    would never be collected, and the device memory behind it would stay taken (none is known: the graphs keep no
    reference to their runner for this reason; this is the safety net for a process that builds engine after
    engine, like the benchmarks' rounds). Not on a CPU: reference counting frees a dropped CPU engine, frozen or
    not, and unfreezing at every start-up would make each start-up's collection walk the whole heap again."""
    if not gc.get_freeze_count():
        return
    gc.unfreeze()
    gc.collect()
    torch.cuda.empty_cache()  # the allocator's cached blocks count as used in the free memory the budget reads


def freeze_heap() -> None:
    """Move every object alive after start-up (weights' modules, tokenizer tables, graphs' bookkeeping: ~300 k on
    the tiny pair) into the collector's permanent generation, after one last collection. A full collection walks
    every tracked object, ~0.1-0.2 s that stalls whichever step it lands in (vLLM freezes after start-up for the
    same reason). After the freeze it walks only what serving made since."""
    gc.collect()
    gc.freeze()
