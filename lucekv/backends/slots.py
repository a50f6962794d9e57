"""The slot map every backend's KV pool keeps: which logical position each pool slot holds, and its blocks."""

from __future__ import annotations

import numpy as np

from lucekv.kvflash.blocks import BlockPool
from lucekv.kvflash.pager import CHUNK_TOKENS


class SlotMap:
    """slot_pos[s] is the logical position slot s holds (-1: free). A forward without block tables (a sequence
    alone in the pool) reads the slots below high_water. `blocks` lends the pool's blocks to sequences; the last
    `reserved` blocks are kept out of it (the backend's own scratch)."""

    def __init__(self, size: int, reserved: int = 0):
        self.slot_pos = np.full(size, -1, np.int32)
        self.high_water = 0  # slots at or above this index have never been written
        self.blocks = BlockPool(size // CHUNK_TOKENS - reserved, CHUNK_TOKENS, self.slot_pos)

    @property
    def size(self) -> int:
        return len(self.slot_pos)

    def clear(self) -> None:
        self.truncate(0)

    def truncate(self, n: int) -> None:
        """Forget every position >= n (their slots become free)."""
        self.slot_pos[self.slot_pos >= n] = -1
        if n == 0:
            self.high_water = 0

    def cover(self, stop: int) -> None:
        """Slots below `stop` hold K/V now (a page-in filled them): attention must read up to there."""
        self.high_water = max(self.high_water, stop)

    def assign(self, slots: np.ndarray, positions: np.ndarray) -> None:
        self.slot_pos[slots] = positions
        self.high_water = max(self.high_water, int(slots.max(initial=-1)) + 1)
