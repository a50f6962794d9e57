"""One sequence's KV residency: the pager's decisions carried out by a backend, and the policy fed.

Still bookkeeping (no numba, no GPU): the backend behind `PoolBackend` moves the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from lucekv.kvflash.blocks import BlockPool
from lucekv.kvflash.draft import DraftReader
from lucekv.kvflash.host_store import HostStore, MemoryHostStore
from lucekv.kvflash.pager import (
    CHUNK_TOKENS,
    UNSCORED,
    Move,
    PageIn,
    PageOut,
    Pager,
    PagerUsage,
    min_pool_tokens,
    scores_text,
)
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
    def last_queries(self, row: int = -1) -> np.ndarray: ...  # [layers, n_head, head_dim] of a row of the last forward
    def recent_queries(self) -> np.ndarray: ...  # [rows, layers, n_head, head_dim]: the latest forward's last rows


class PagedSequence:
    """One sequence's chunks in the server's block pool; with a budget, cold chunks live in a host store.

    Without a budget (None) the sequence holds its whole context while it runs: no policy, nothing is paged out but
    what the pool takes back while the sequence is idle, and all of that comes back when it runs again."""

    def __init__(self, backend: PoolBackend, blocks: BlockPool, budget: int | None, *, n_layer: int, n_kv_head: int,
                 head_dim: int, dtype: np.dtype, policy: str, tau: int, window: int, drafter: DraftReader | None = None,
                 history: Callable[[], Sequence[int]] | None = None):
        """drafter, history: the draft policy's reader and the sequence's tokens so far (see make_policy)."""
        chunk = CHUNK_TOKENS
        # Sliding-window layers share the slot space, so the protected tail must cover the window.
        tail = max(tail_chunks((budget or blocks.n_blocks * chunk) // chunk), math.ceil(window / chunk) + 1)
        self.holds_all = budget is None
        if budget is None:  # the pool bounds it: no block is ever evicted to make room for another of its own
            budget = max(blocks.n_blocks * chunk, min_pool_tokens(chunk, tail_chunks=tail))
        self.host = MemoryHostStore(n_layer, chunk, n_kv_head, head_dim, dtype)
        self.pager = Pager(budget, chunk, tail_chunks=tail, chunk_bytes=self.host.chunk_bytes, blocks=blocks)
        self.policy = None if self.holds_all else make_policy(policy, n_kv_head, tau, drafter, history)
        self.backend = backend
        self._resume: dict | None = None  # the residency to return to, while suspended
        self._round_queries: dict[int, np.ndarray] = {}  # a speculative round's queries by block row (after_verify)

    def alloc(self, start: int, n: int) -> np.ndarray:
        a = self.pager.alloc_span(start, n)
        self.backend.execute(a.moves, self.host)
        return a.slots

    def after_forward(self, decoded: int, row: int = -1) -> None:
        """Summarize chunks that just filled up; after a decode step, feed the policy and maybe reselect. `row`: the
        sequence's row in the forward (its query is the scorers')."""
        self._seal()
        if decoded and self.policy is not None:
            if self.policy.wants_query(self.pager.n_tokens, decoded):
                self.policy.scorer.observe(self.backend.last_queries(row))
            self._run(self.policy.after_decode(self.pager, decoded))

    def round_limit(self, position: int) -> int | None:
        """The most tokens a speculative round's verify block from `position` may hold: the policy's next event (a
        reselect starting, its moves) falls on its last token at the latest, where plain decoding meets it too, after
        that token's forward (issue 22). None: no limit (no policy)."""
        return None if self.policy is None else self.policy.quiet_for(position) + 1

    def after_verify(self, start: int, depths: Sequence[int], first_row: int = 0) -> None:
        """After a forward of a speculative round's verify block from `start`: the whole block, or the piece of a
        chain's from block row `first_row` on; its row i at depth depths[i]. Nothing is counted before the round has
        kept its tokens (`after_round`), but the queries the scorer's window would want of its rows, were they kept,
        are put aside: a later forward overwrites them."""
        if first_row == 0:
            self._round_queries = {}
        if self.policy is None or not self._wanted(start, max(depths)):  # wanted at a depth: at every deeper one
            return
        queries = self.backend.recent_queries()[-len(depths) :]
        for i, depth in enumerate(depths):
            if self._wanted(start, depth):
                self._round_queries[first_row + i] = queries[i]

    def after_round(self, start: int, path: Sequence[int]) -> None:
        """A speculative round kept its block's rows `path`, one per position from `start` on: the rejected drafts past
        them are forgotten, and the kept tokens counted as plain decoding counts them, each after its forward: the
        chunks they filled summarized, the queries the scorer's window wants observed in order, then the count (an
        event of it can fall on the last token only: `round_limit`)."""
        end = start + len(path)
        if self.policy is not None and self.pager.n_tokens > end:
            self._cut(end)  # (a chunk the drafts filled is not sealed)
        self._seal()
        if self.policy is None:
            return
        for row in path:
            if (query := self._round_queries.get(row)) is not None:
                self.policy.scorer.observe(query)
        self._round_queries = {}
        self._run(self.policy.after_decode(self.pager, len(path)))

    def _wanted(self, start: int, depth: int) -> bool:
        """Whether the query of a round's token at `depth` (position start + depth) is the scorer's, once kept."""
        return self.policy.wants_query(start + depth + 1, depth + 1)

    def _seal(self) -> None:
        """Summarize the chunks that filled up since the last call, for the scorer."""
        sealed = self.pager.take_sealed()
        if self.policy is not None:
            for c in sealed:
                self.policy.scorer.seal(self.pager, c, self.backend.chunk_keys(int(self.pager.block_of[c])))

    def quiet_step(self, position: int) -> bool:
        """Whether `after_forward` of the decode step at `position` (allocated) will only count it, and allocating
        position + 1 neither seals a chunk nor needs a block: then the step at position + 1 may be allocated and
        run before that `after_forward` with the same result (the engine's run-ahead decode)."""
        quiet = self.policy is None or self.policy.quiet(self.pager.n_tokens)
        return position % self.pager.chunk < self.pager.chunk - 2 and quiet

    def recall_for_prompt(self, tail: int) -> bool:
        """After a prompt whose latest forward computed its last `tail` tokens: rank chunks against the queries of
        the last PROMPT_QUERIES of them and recall the best. True if anything came back (the caller then computes
        the tail again, so that it sees the recalled chunks)."""
        if self.policy is None:
            return False
        queries = self.backend.recent_queries() if tail > 1 else self.backend.last_queries()[None]
        moves = self.policy.reselect_for_prompt(self.pager, queries[-PROMPT_QUERIES:])
        self._run(moves)
        return any(isinstance(m, PageIn) for m in moves)

    def resident_spans(self, end: int) -> list[tuple[int, int]]:
        """Position spans [start, stop) of the resident chunks past the sinks, below `end`, neighbours joined: what a
        prompt computes again after its recall (Engine._prefill)."""
        p, spans = self.pager, []
        for c in p.resident_chunks().tolist():
            start, stop = c * p.chunk, min((c + 1) * p.chunk, end)
            if c < p.sink_chunks or start >= stop:
                continue
            if spans and spans[-1][1] == start:
                spans[-1] = (spans[-1][0], stop)
            else:
                spans.append((start, stop))
        return spans

    def truncate(self, n_tokens: int) -> None:
        if self.policy is not None:
            self.policy.truncate(n_tokens)
        self._resume = None
        self._cut(n_tokens)

    def _cut(self, n_tokens: int) -> None:
        cut = self.pager.truncate(n_tokens)
        for c in cut.dropped:
            self.host.discard(c)
        self._run(cut.moves)

    def pin_prefix(self, n_tokens: int) -> None:
        self._run(self.pager.pin_prefix(n_tokens))

    def usage(self) -> PagerUsage:
        return self.pager.usage()

    def table(self) -> np.ndarray:
        """int32: the blocks of the resident chunks in logical order (what attention reads, in that order)."""
        block_of = self.pager.block_of[: self.pager.n_chunks]
        return block_of[block_of >= 0].astype(np.int32)

    @property
    def held_blocks(self) -> int:
        return self.pager.held_blocks

    def blocks_wanted(self, end: int) -> int:
        return self.pager.blocks_wanted(end)

    # ---- sessions: the pool is shared; an idle sequence keeps its blocks until the pool needs them ------

    def read_chunks(self, n_chunks: int) -> list[np.ndarray]:
        """K/V [n_layer, 2, chunk, n_kv_head, head_dim] of the first n_chunks chunks (for snapshots): the host store's
        where its copy is current, else read out of the pool into a store of their own (the sequence's host store,
        which counts as the session's host memory, stays as it is). Views: copy what you keep."""
        p = self.pager
        n_layer, _, chunk, n_kv_head, head_dim = self.host.shape
        read = MemoryHostStore(n_layer, chunk, n_kv_head, head_dim, self.host.dtype)
        self.backend.execute([PageOut(c, int(p.block_of[c])) for c in range(n_chunks)
                              if p.block_of[c] >= 0 and not p.host_valid[c]], read)
        return [(read if c in read else self.host).chunk(c) for c in range(n_chunks)]

    def suspend(self) -> None:
        """The sequence stops running: its chunks stay in their blocks until the pool takes them (`give_back`)."""
        if self._resume is None:
            self._resume = self.pager.residency()

    def give_back(self, n: int) -> int:
        """Page out up to n chunks of the suspended sequence for another one; the blocks freed."""
        moves = self.pager.give_back(n)
        self._run(moves)
        return len(moves)

    def park(self) -> None:
        """Page everything out (the pool is free for another sequence), remembering the residency."""
        self.suspend()
        self._run(self.pager.park())

    def resume(self) -> None:
        """Running again: each chunk that was resident and was given back meanwhile returns (where its block is free:
        the place does not matter), so the sequence continues exactly as if it had never left; without a residency
        to return to (a snapshot of another pool, a partial snapshot), the whole context, or the protected chunks and
        the most recent others that fit."""
        resume, self._resume = self._resume, None
        if resume:
            self._run(self.pager.restore_residency(resume))
        else:
            self._run(self.pager.recall_all() if self.holds_all else self.pager.recall_recent())

    def state(self) -> dict | None:
        """JSON-safe residency and policy state, for snapshots (see `restore`); None for a sequence that holds its
        whole context (every chunk comes back: there is no residency to keep)."""
        if self.policy is None:
            return None
        return {"residency": self._resume or self.pager.residency(), **self.policy.state()}

    def restore(self, n_tokens: int, chunks: list[np.ndarray], state: dict | None) -> None:
        """Take over a restored sequence, parked: chunk c's K/V [n_layer, 2, rows, n_kv_head, head_dim] into the
        host store, key summaries of its full chunks for the scorer, and `state` when it is of this pool: its
        residency, and its policy's state when the policy is this one (else the policy starts afresh, its scores
        unknown). Raises ValueError when `state` is malformed."""
        p = self.pager
        if self.policy is not None:
            self.policy.truncate(0)  # another sequence's tokens
        self.pager = Pager.parked(p.pool_tokens, n_tokens, p.chunk, p.sink_chunks, p.tail_chunks, p.chunk_bytes,
                                  p.blocks)
        self._resume = None
        for c, kv in enumerate(chunks):
            self.host.put_chunk(c, kv)
            if kv.shape[2] == p.chunk and self.policy is not None:
                self.policy.scorer.seal(self.pager, c, kv[:, 0].astype(np.float32))
        if state and self.policy is not None and state["residency"]["pool_tokens"] == p.pool_tokens:
            self.pager.check_residency(state["residency"])
            self._resume = state["residency"]
            if state["policy"] == self.policy.scorer.name:
                self.policy.load_state(state)
            else:  # another policy's scores rank nothing here
                self._resume = {**self._resume, "scores": scores_text(np.full(self.pager.n_chunks, UNSCORED))}

    def _run(self, moves: list[Move]) -> None:
        if moves:
            self.backend.execute(moves, self.host)
