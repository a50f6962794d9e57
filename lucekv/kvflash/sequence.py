"""One sequence's KV residency: the pager's decisions carried out by a backend, and the policy fed.

Still bookkeeping (no numba, no GPU): the backend behind `PoolBackend` moves the bytes.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from lucekv.kvflash.host_store import HostStore, MemoryHostStore
from lucekv.kvflash.pager import CHUNK_TOKENS, Move, PageIn, Pager, PagerUsage
from lucekv.kvflash.policy import make_policy

MIN_TAIL_CHUNKS = 4


class PoolBackend(Protocol):
    """What a backend offers the pager: run moves on its pool, and show keys and queries to scorers."""

    def execute(self, moves: list[Move], host: HostStore) -> None: ...
    def chunk_keys(self, block: int) -> np.ndarray: ...  # [layers, chunk, n_kv_head, head_dim]
    def last_queries(self) -> np.ndarray: ...  # [layers, n_head, head_dim] of the latest token


class PagedSequence:
    """Slots for a sequence whose K/V may exceed the pool: cold chunks live in a host store."""

    def __init__(self, backend: PoolBackend, slot_pos: np.ndarray, *, n_layer: int, n_kv_head: int,
                 head_dim: int, dtype: np.dtype, policy: str, tau: int, window: int):
        chunk = CHUNK_TOKENS
        # Sliding-window layers share the slot space, so the protected tail must cover the window.
        tail = max(MIN_TAIL_CHUNKS, math.ceil(window / chunk) + 1)
        self.host = MemoryHostStore(n_layer, chunk, n_kv_head, head_dim, dtype)
        self.pager = Pager(len(slot_pos), chunk, tail_chunks=tail, chunk_bytes=self.host.chunk_bytes)
        self.pager.slot_pos = slot_pos  # the backend's own array: attention reads exactly what the pager says
        self.policy = make_policy(policy, n_kv_head, tau)
        self.backend = backend

    def alloc(self, start: int, n: int) -> np.ndarray:
        a = self.pager.alloc_span(start, n)
        self.backend.execute(a.moves, self.host)
        return a.slots

    def after_forward(self, decoded: int) -> None:
        """Summarize chunks that just filled up; after a decode step, feed the policy and maybe reselect."""
        for c in self.pager.take_sealed():
            self.policy.scorer.seal(self.pager, c, self.backend.chunk_keys(int(self.pager.block_of[c])))
        if decoded:
            self.policy.scorer.observe(self.backend.last_queries())
            self._run(self.policy.after_decode(self.pager, decoded))

    def recall_for_last_query(self) -> bool:
        """After a prompt: rank chunks against its last token's query and recall the best. True if anything moved
        (the caller then recomputes that token so its logits see the recalled chunks)."""
        self.policy.scorer.observe(self.backend.last_queries())
        moves = self.policy.reselect_now(self.pager)
        self._run(moves)
        return any(isinstance(m, PageIn) for m in moves)

    def truncate(self, n_tokens: int) -> None:
        cut = self.pager.truncate(n_tokens)
        for c in cut.dropped:
            self.host.discard(c)
        self._run(cut.moves)

    def usage(self) -> PagerUsage:
        return self.pager.usage()

    def _run(self, moves: list[Move]) -> None:
        if moves:
            self.backend.execute(moves, self.host)
