"""Paged KV memory: fixed-size blocks handed to requests through per-request block tables.

Target and drafter have their own cache tensors but share one block table per request (the same
block id indexes both), so one allocation covers both models' K/V at a position.
"""
from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, table: list[int], num_slots: int) -> int:
        return max(0, -(-num_slots // self.block_size) - len(table))

    def grow(self, table: list[int], num_slots: int) -> bool:
        """Extend `table` in place to cover `num_slots` positions; False (and no change) if memory is short."""
        need = self.blocks_needed(table, num_slots)
        if need > len(self.free):
            return False
        table.extend(self.free.pop() for _ in range(need))
        return True

    def release(self, table: list[int]) -> None:
        self.free.extend(reversed(table))
        table.clear()
