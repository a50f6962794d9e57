"""The block pool: the KV blocks of the device pool and who holds each (DESIGN §4, §10).

One pool serves the whole server. Every sequence's pager borrows the blocks its resident chunks occupy, at most
its own residency budget, and gives a block back when its chunk leaves (paged out or cut). A pager made without a
pool gets a private one of its budget's size: a sequence alone in the pool, as before sequences shared it.

Pure bookkeeping: the pool hands out block numbers; the pool's slot map (`slot_pos`, the logical position each
slot holds) is written by the holder of a block for that block's slots only.
"""

from __future__ import annotations

import numpy as np


class PoolExhaustedError(RuntimeError):
    """A block was asked of an empty pool: whoever runs the step should have made room first (a bug, not a
    request problem)."""


class BlockPool:
    def __init__(self, n_blocks: int, chunk: int, slot_pos: np.ndarray | None = None):
        """slot_pos: the pool's slot map, int32 [n_blocks * chunk] at least (a backend's own array), or None for
        a new one."""
        if slot_pos is None:
            slot_pos = np.full(n_blocks * chunk, -1, np.int32)
        if len(slot_pos) < n_blocks * chunk:
            raise ValueError(f"a slot map of {len(slot_pos)} slots is too small for {n_blocks} blocks of {chunk}")
        self.n_blocks = n_blocks
        self.chunk = chunk
        self.slot_pos = slot_pos
        # popped from the end: a fresh pool hands out blocks 0, 1, 2... (a lone pager's identity layout)
        self._free = list(range(n_blocks - 1, -1, -1))
        self._holder: dict[int, object] = {}  # block -> the pager holding it
        self._held: dict[int, int] = {}  # id(holder) -> blocks it holds
        # blocks whose slots in slot_pos changed other than by writes of allocated slots (a block changing hands, a
        # cut): what a device copy of the map must take again; its keeper clears the set
        self.dirty: set[int] = set()

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.n_blocks - len(self._free)

    def held(self, holder: object) -> int:
        return self._held.get(id(holder), 0)

    def holder(self, block: int) -> object | None:
        return self._holder.get(block)

    def take(self, holder: object, prefer: int | None = None) -> int:
        """A free block for `holder`: `prefer` if it is free, else the most recently freed one."""
        if not self._free:
            raise PoolExhaustedError(f"all {self.n_blocks} blocks of the KV pool are held")
        if prefer is not None and prefer in self._holder:
            prefer = None
        if prefer is not None and prefer != self._free[-1]:
            self._free.remove(prefer)
            block = prefer
        else:
            block = self._free.pop()
        self._holder[block] = holder
        self._held[id(holder)] = self._held.get(id(holder), 0) + 1
        self.dirty.add(block)
        return block

    def give(self, block: int) -> None:
        """`block` is free again (its holder's chunk left it)."""
        holder = self._holder.pop(block)
        left = self._held.pop(id(holder)) - 1
        if left:
            self._held[id(holder)] = left
        self._free.append(block)
        self.dirty.add(block)

    def free_order(self) -> list[int]:
        """The free blocks, the next one handed out last (a pager's snapshot of a private pool)."""
        return list(self._free)

    def set_free_order(self, order: list[int]) -> None:
        """Hand out the free blocks in this order from now on (last first); it must name exactly the free ones."""
        if sorted(order) != sorted(self._free):
            raise ValueError("pager state free list does not match its chunk map")
        self._free = [int(b) for b in order]
