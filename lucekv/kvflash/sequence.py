"""One sequence's KV residency: the pager's decisions carried out by a backend, and the policy fed.

Still bookkeeping (no numba, no GPU): the backend behind `PoolBackend` moves the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from lucekv.kvflash.draft import DraftReader
from lucekv.kvflash.host_store import HostStore, MemoryHostStore
from lucekv.kvflash.pager import CHUNK_TOKENS, UNSCORED, Move, PageIn, Pager, PagerUsage, scores_text
from lucekv.kvflash.policy import make_policy

TAIL_CHUNKS = 4  # the recent chunks before the head that are never evicted...
BLOCKS_PER_TAIL_CHUNK = 8  # ...but one per 8 pool blocks at most (at least 1): a small pool keeps blocks to recall
PROMPT_QUERIES = 16  # a prompt's last tokens whose queries rank the chunks after it


def tail_chunks(n_blocks: int) -> int:
    """Protected recent chunks of a pool of n_blocks (without a sliding window). At 12.5% of a 4K context (8 blocks)
    four of them and the sink and head chunks left 2 blocks for the scorer to fill, fewer than the chunks a
    multi-needle question needs (issue 29); with one, 5."""
    return min(TAIL_CHUNKS, max(1, n_blocks // BLOCKS_PER_TAIL_CHUNK))


class PoolBackend(Protocol):
    """What a backend offers the pager: run moves on its pool, and show keys and queries to scorers."""

    def execute(self, moves: list[Move], host: HostStore) -> None: ...
    def chunk_keys(self, block: int) -> np.ndarray: ...  # [layers, chunk, n_kv_head, head_dim]
    def last_queries(self) -> np.ndarray: ...  # [layers, n_head, head_dim] of the latest token
    def recent_queries(self) -> np.ndarray: ...  # [rows, layers, n_head, head_dim]: the latest forward's last rows


class PagedSequence:
    """Slots for a sequence whose K/V may exceed the pool: cold chunks live in a host store."""

    def __init__(self, backend: PoolBackend, slot_pos: np.ndarray, *, n_layer: int, n_kv_head: int,
                 head_dim: int, dtype: np.dtype, policy: str, tau: int, window: int, drafter: DraftReader | None = None,
                 history: Callable[[], Sequence[int]] | None = None):
        """drafter, history: the draft policy's reader and the sequence's tokens so far (see make_policy)."""
        chunk = CHUNK_TOKENS
        # Sliding-window layers share the slot space, so the protected tail must cover the window.
        tail = max(tail_chunks(len(slot_pos) // chunk), math.ceil(window / chunk) + 1)
        self.host = MemoryHostStore(n_layer, chunk, n_kv_head, head_dim, dtype)
        self.pager = Pager(len(slot_pos), chunk, tail_chunks=tail, chunk_bytes=self.host.chunk_bytes)
        self.pager.slot_pos = slot_pos  # the backend's own array: attention reads exactly what the pager says
        self.policy = make_policy(policy, n_kv_head, tau, drafter, history)
        self.backend = backend
        self._parked: dict | None = None  # the residency to return to, while parked

    def alloc(self, start: int, n: int) -> np.ndarray:
        a = self.pager.alloc_span(start, n)
        self.backend.execute(a.moves, self.host)
        return a.slots

    def after_forward(self, decoded: int) -> None:
        """Summarize chunks that just filled up; after a decode step, feed the policy and maybe reselect."""
        for c in self.pager.take_sealed():
            self.policy.scorer.seal(self.pager, c, self.backend.chunk_keys(int(self.pager.block_of[c])))
        if decoded:
            if self.policy.wants_query(self.pager.n_tokens, decoded):
                self.policy.scorer.observe(self.backend.last_queries())
            self._run(self.policy.after_decode(self.pager, decoded))

    def quiet_step(self, position: int) -> bool:
        """Whether `after_forward` of the decode step at `position` (allocated) will only count it, and allocating
        position + 1 neither seals a chunk nor needs a block: then the step at position + 1 may be allocated and
        run before that `after_forward` with the same result (the engine's run-ahead decode)."""
        return position % self.pager.chunk < self.pager.chunk - 2 and self.policy.quiet(self.pager.n_tokens)

    def recall_for_prompt(self, tail: int) -> bool:
        """After a prompt whose latest forward computed its last `tail` tokens: rank chunks against the queries of
        the last PROMPT_QUERIES of them and recall the best. True if anything came back (the caller then computes
        the tail again, so that it sees the recalled chunks)."""
        queries = self.backend.recent_queries() if tail > 1 else self.backend.last_queries()[None]
        moves = self.policy.reselect_for_prompt(self.pager, queries[-PROMPT_QUERIES:])
        self._run(moves)
        return any(isinstance(m, PageIn) for m in moves)

    def truncate(self, n_tokens: int) -> None:
        self.policy.drop_pending()  # scored against chunks that are cut now
        self.policy.scorer.truncate(n_tokens)
        cut = self.pager.truncate(n_tokens)
        for c in cut.dropped:
            self.host.discard(c)
        self._run(cut.moves)

    def pin_prefix(self, n_tokens: int) -> None:
        self._run(self.pager.pin_prefix(n_tokens))

    def usage(self) -> PagerUsage:
        return self.pager.usage()

    # ---- sessions: the pool is shared by turns; a parked sequence lives in its host store -------

    def sync_to_host(self) -> None:
        """Bring the host store up to date with the resident chunks, which stay resident (for snapshots)."""
        self._run(self.pager.write_back())

    def park(self) -> None:
        """Page everything out (the pool is free for another sequence), remembering the residency."""
        self._parked = self.pager.residency()
        self._run(self.pager.park())

    def resume(self) -> None:
        """Back in the pool: each chunk that was resident returns to its block, so the sequence continues exactly
        as if it had never left; without a residency to return to (another pool, a partial snapshot), the
        protected chunks and the most recent others that fit."""
        parked, self._parked = self._parked, None
        self._run(self.pager.restore_residency(parked) if parked else self.pager.recall_recent())

    def state(self) -> dict:
        """JSON-safe residency and policy state, for snapshots (see `restore`)."""
        return {"residency": self._parked or self.pager.residency(), **self.policy.state()}

    def restore(self, n_tokens: int, chunks: list[np.ndarray], state: dict | None) -> None:
        """Take over a restored sequence, parked: chunk c's K/V [n_layer, 2, rows, n_kv_head, head_dim] into the
        host store, key summaries of its full chunks for the scorer, and `state` when it is of this pool: its
        residency, and its policy's state when the policy is this one (else the policy starts afresh, its scores
        unknown). Raises ValueError when `state` is malformed."""
        p = self.pager
        self.policy.drop_pending()
        self.pager = Pager.parked(p.pool_tokens, n_tokens, p.chunk, p.sink_chunks, p.tail_chunks, p.chunk_bytes)
        self.pager.slot_pos = p.slot_pos
        for c, kv in enumerate(chunks):
            self.host.put_chunk(c, kv)
            if kv.shape[2] == p.chunk:
                self.policy.scorer.seal(self.pager, c, kv[:, 0].astype(np.float32))
        if state and state["residency"]["pool_tokens"] == p.pool_tokens:
            self.pager.check_residency(state["residency"])
            self._parked = state["residency"]
            if state["policy"] == self.policy.scorer.name:
                self.policy.load_state(state)
            else:  # another policy's scores rank nothing here
                self._parked = {**self._parked, "scores": scores_text(np.full(self.pager.n_chunks, UNSCORED))}

    def _run(self, moves: list[Move]) -> None:
        if moves:
            self.backend.execute(moves, self.host)
