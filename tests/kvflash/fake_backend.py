"""A byte-moving stand-in for a backend, and the invariant checks the pager tests share.

Each pool slot holds one int64 "KV row": a value that names the position and the write that produced it,
so a wrong page-in, a skipped write-back or a stale slot shows up as a wrong value.
"""

from __future__ import annotations

import numpy as np

from lucekv.kvflash.host_store import MemoryHostStore
from lucekv.kvflash.pager import Allocation, Move, PageIn, PageOut, Pager

POISON = -7  # what a freed block holds after a page-out, so reading it is caught


class FakeBackend:
    def __init__(self, pager: Pager, rows: np.ndarray | None = None):
        """rows: the pool's KV rows when several pagers share one block pool (each with its own FakeBackend)."""
        self.pager = pager
        self.rows = np.full(len(pager.slot_pos), POISON, np.int64) if rows is None else rows
        self.host = MemoryHostStore(1, pager.chunk, 1, 1, np.int64)
        self.truth: dict[int, int] = {}  # position -> value of its latest write (the reference model)
        self.n_tokens = 0  # reference length: one past the highest position written
        self.writes = 0
        self.mirror = np.full(len(pager.slot_pos), -1, np.int32)  # a device's copy of slot_pos
        self.mirror_epoch = pager.epoch
        self.uploads = 0

    def run(self, moves: list[Move]) -> None:
        for m in moves:
            block = self.rows[self.pager.block_slots(m.block)].reshape(-1, 1, 1)
            if isinstance(m, PageOut):
                if m.write_back:
                    self.host.store(m.chunk, 0, block, block)
                else:  # the pager claims the host copy is current: it must be
                    assert np.array_equal(self.host.load(m.chunk, 0)[0], block), f"stale copy of {m.chunk}"
                block[:] = POISON
            else:
                assert isinstance(m, PageIn)
                block[:] = self.host.load(m.chunk, 0)[0]
        self._upload_if_epoch_moved()

    def write(self, start: int, n: int) -> Allocation:
        """alloc_span + moves + the K/V write, like a forward over positions [start, start+n)."""
        alloc = self.pager.alloc_span(start, n)
        self.run(alloc.moves)
        positions = np.arange(start, start + n)
        values = positions * 1000 + self.writes
        self.writes += 1
        self.rows[alloc.slots] = values
        self.truth.update(zip(positions.tolist(), values.tolist(), strict=True))
        self.n_tokens = max(self.n_tokens, start + n)
        self.mirror[alloc.slots] = positions  # the device-side scatter that goes with the K/V write
        return alloc

    def prefill(self, n: int, batch: int = 100) -> None:
        """Append n positions in batches (a batch must fit the protected tail window)."""
        end = self.n_tokens + n
        while self.n_tokens < end:
            self.write(self.n_tokens, min(batch, end - self.n_tokens))

    def truncate(self, n: int) -> None:
        cut = self.pager.truncate(n)
        for c in cut.dropped:
            self.host.discard(c)
        self.truth = {p: v for p, v in self.truth.items() if p < n}
        self.n_tokens = n
        self.run(cut.moves)

    def _upload_if_epoch_moved(self) -> None:
        if self.pager.epoch != self.mirror_epoch:
            self.mirror[:] = self.pager.slot_pos
            self.mirror_epoch = self.pager.epoch
            self.uploads += 1


def check_invariants(pager: Pager, backend: FakeBackend | None = None) -> None:
    n_blocks, chunk = pager.n_blocks, pager.chunk
    n_tokens = backend.n_tokens if backend else pager.n_tokens
    assert pager.n_tokens == n_tokens
    n = pager.n_chunks
    resident = np.flatnonzero(pager.block_of[:n] >= 0)
    blocks = pager.block_of[resident]
    assert len(set(blocks.tolist())) == len(blocks), "two chunks share a block"
    assert len(resident) <= n_blocks
    assert pager.held_blocks == len(resident)
    assert all(pager.blocks.holder(b) is pager for b in blocks.tolist())
    alone = pager.blocks.n_blocks == n_blocks and pager.blocks.used_blocks == len(resident)  # the only holder
    if alone:  # every block not holding a chunk is free
        assert sorted(pager.blocks.free_order()) == sorted(set(range(n_blocks)) - set(blocks.tolist()))
    # slot_pos from the reference model: every written position of a resident chunk, nothing else (in a shared
    # pool: on the slots of this pager's blocks; the others are other pagers')
    expected = np.full(len(pager.slot_pos), -1, np.int32)
    mine = np.full(len(pager.slot_pos), alone)
    for c, b in zip(resident.tolist(), blocks.tolist(), strict=True):
        pos = np.arange(c * chunk, min((c + 1) * chunk, n_tokens))
        expected[b * chunk + pos - c * chunk] = pos
        mine[b * chunk : (b + 1) * chunk] = True
    assert np.array_equal(pager.slot_pos[mine], expected[mine]), "slot_pos differs from the reference model"
    protected = np.flatnonzero(pager.protected_mask())
    assert np.all(pager.block_of[protected] >= 0), "a protected chunk is not resident"
    if backend is None:
        return
    valid = np.flatnonzero((pager.slot_pos >= 0) & mine)
    want = np.array([backend.truth[p] for p in pager.slot_pos[valid].tolist()], np.int64)
    assert np.array_equal(backend.rows[valid], want), "a visible slot holds the wrong bytes"
    assert np.array_equal(backend.mirror[mine], pager.slot_pos[mine]), "the epoch-driven mirror of slot_pos drifted"
    assert set(backend.host._chunks) >= set(pager.paged_chunks().tolist())
    for c in pager.paged_chunks().tolist():
        stored = backend.host.load(c, 0)[0].reshape(-1)
        pos = np.arange(c * chunk, min((c + 1) * chunk, n_tokens))
        assert np.array_equal(stored[: len(pos)], [backend.truth[p] for p in pos.tolist()])
