"""The KVFlash pager: which logical 64-token chunk lives in which pool block (DESIGN §4).

Pure bookkeeping. The blocks come from a `BlockPool` (kvflash.blocks), shared by every sequence of a server: a pager
borrows one for each resident chunk, up to its residency budget (`pool_tokens`), and evicts one of its own chunks
when a new one needs a block at that budget. The pager decides *where* (slot numbers) and *what moves* (PageOut /
PageIn); the backend copies the bytes, in the order the moves are returned, before it writes the slots of that
allocation.

Invariants (tests/kvflash check them after every operation):
- a resident chunk c occupies block `block_of[c]`, held from the pool by this pager, and by no other chunk; the
  pager holds no other blocks, and at most `n_blocks` (its budget);
- `slot_pos[b*C + i] == c*C + i` for the written prefix `i < filled[c]` of a resident chunk, -1 everywhere
  else, so attention's `0 <= slot_pos <= q` rule never sees a free slot or a paged-out chunk;
- a written (materialized) chunk that is not resident has a valid copy in the backend's host store;
- sink chunks, the head chunk and the `tail_chunks` before it, and pinned chunks are never evicted.

`epoch` counts residency changes (a block changing owner). Between two epochs slot_pos changes only at the
slots an allocation returned, to the positions asked for, which a backend mirrors as it writes their K/V;
so a device copy of slot_pos is re-uploaded whole only when the epoch moved.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import numpy as np

from lucekv.errors import ConfigError, InvalidRequestError
from lucekv.kvflash.blocks import BlockPool

STATE_VERSION = 1
CHUNK_TOKENS = 64  # logical positions per chunk, and slots per pool block
RECENT_QUERIES = 64  # rows of a forward's last queries a backend keeps for scorers (a prompt's tail)
NOT_RESIDENT = -1
UNSCORED = np.inf  # chunks the policy has not scored yet (newer than its last reselect) are evicted last


@dataclass(frozen=True)
class PageOut:
    """Copy `chunk`'s rows out of `block` to the host store (unless its copy is current); free the block."""

    chunk: int
    block: int
    write_back: bool = True  # False: the host already holds these exact bytes (recalled, not written since)


@dataclass(frozen=True)
class PageIn:
    """Copy `chunk`'s rows from the host store into `block`."""

    chunk: int
    block: int


Move = PageOut | PageIn


@dataclass(frozen=True)
class Allocation:
    """Slots for the positions asked for, and the moves the backend must run before writing them."""

    slots: np.ndarray  # int32 [n]
    moves: list[Move]


@dataclass(frozen=True)
class Truncation:
    dropped: list[int]  # chunks that no longer exist: the backend discards their host copies
    moves: list[Move]  # page-ins of the new tail


@dataclass
class PagerStats:
    page_outs: int = 0
    page_ins: int = 0
    bytes_out: int = 0
    bytes_in: int = 0

    @property
    def bytes_moved(self) -> int:
        return self.bytes_out + self.bytes_in


@dataclass(frozen=True)
class PagerUsage:
    """What a server reports: current residency and cumulative paging."""

    resident_chunks: int
    paged_chunks: int
    page_outs: int
    page_ins: int
    bytes_moved: int


class ChunkSummaries:
    """Named per-chunk numpy arrays (a scorer's key summaries), grown on demand, serialized with the pager."""

    def __init__(self) -> None:
        self.values: dict[str, np.ndarray] = {}  # name -> [capacity, *summary_shape]
        self.present: dict[str, np.ndarray] = {}  # name -> bool [capacity]

    def put(self, name: str, chunk: int, value: np.ndarray) -> None:
        if name not in self.values:
            self.values[name] = np.zeros((chunk + 1, *value.shape), value.dtype)
            self.present[name] = np.zeros(chunk + 1, bool)
        if chunk >= len(self.present[name]):
            cap = max(chunk + 1, 2 * len(self.present[name]))
            self.values[name] = _grow(self.values[name], cap, 0)
            self.present[name] = _grow(self.present[name], cap, False)
        self.values[name][chunk] = value
        self.present[name][chunk] = True

    def table(self, name: str, n_chunks: int) -> tuple[np.ndarray | None, np.ndarray]:
        """(values [n_chunks, ...] or None when nothing is stored, present bool [n_chunks])."""
        if name not in self.values:
            return None, np.zeros(n_chunks, bool)
        values = _grow(self.values[name], n_chunks, 0)[:n_chunks]
        return values, _grow(self.present[name], n_chunks, False)[:n_chunks]


@dataclass
class PagerState:
    """Plain-data image of a pager (numpy arrays and python scalars) for snapshots."""

    version: int
    pool_tokens: int
    chunk: int
    sink_chunks: int
    tail_chunks: int
    chunk_bytes: int
    n_tokens: int
    clock: int
    epoch: int
    block_of: np.ndarray
    filled: np.ndarray
    host_valid: np.ndarray
    last_use: np.ndarray
    scores: np.ndarray
    free: np.ndarray
    slot_pos: np.ndarray
    pins: list[tuple[int, int]]
    stats: PagerStats
    summaries: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


class Pager:
    def __init__(self, pool_tokens: int, chunk: int = CHUNK_TOKENS, sink_chunks: int = 1, tail_chunks: int = 4,
                 chunk_bytes: int = 0, blocks: BlockPool | None = None):
        """pool_tokens: the residency budget (whole blocks). blocks: the pool to borrow from; None makes a private
        one of the budget's size, which hands out blocks 0, 1, 2... (identity layout until it is full)."""
        _check_config(pool_tokens, chunk, sink_chunks, tail_chunks)
        self.pool_tokens = pool_tokens
        self.chunk = chunk
        self.sink_chunks = sink_chunks
        self.tail_chunks = tail_chunks
        self.chunk_bytes = chunk_bytes  # K+V bytes of one chunk over all pooled layers, for statistics
        self.n_blocks = pool_tokens // chunk
        if blocks is not None and blocks.chunk != chunk:
            raise ConfigError(f"a pager of {chunk}-token chunks cannot borrow {blocks.chunk}-slot blocks")
        self.blocks = BlockPool(self.n_blocks, chunk) if blocks is None else blocks
        self.epoch = 0
        self.n_tokens = 0  # one past the highest position ever written
        self.clock = 0
        self.stats = PagerStats()
        self.summaries = ChunkSummaries()
        self.pins: list[tuple[int, int]] = []
        self._block_chunk = np.full(self.blocks.n_blocks, -1, np.int32)  # pool block -> this pager's chunk in it
        self._sealed: set[int] = set()
        self.block_of = np.full(0, NOT_RESIDENT, np.int32)
        self.filled = np.zeros(0, np.int32)  # written prefix of each chunk, in positions
        self.host_valid = np.zeros(0, bool)  # the host store holds this chunk's current bytes
        self.last_use = np.zeros(0, np.int64)
        self.scores = np.zeros(0, np.float64)

    # ---- queries --------------------------------------------------------------------------------

    @property
    def slot_pos(self) -> np.ndarray:
        """The pool's slot map (int32, -1 = free): this pager writes the slots of the blocks it holds."""
        return self.blocks.slot_pos

    @property
    def held_blocks(self) -> int:
        """Pool blocks this pager holds: one per resident chunk."""
        return self.blocks.held(self)

    @property
    def n_chunks(self) -> int:
        """Chunks that have ever been written (materialized)."""
        return -(-self.n_tokens // self.chunk)

    def resident_chunks(self) -> np.ndarray:
        return np.flatnonzero(self.block_of[: self.n_chunks] >= 0)

    def paged_chunks(self) -> np.ndarray:
        n = self.n_chunks
        return np.flatnonzero((self.block_of[:n] < 0) & (self.filled[:n] > 0))

    def usage(self) -> PagerUsage:
        return PagerUsage(len(self.resident_chunks()), len(self.paged_chunks()), self.stats.page_outs,
                          self.stats.page_ins, self.stats.bytes_moved)

    def block_slots(self, block: int) -> slice:
        return slice(block * self.chunk, (block + 1) * self.chunk)

    def slot_of(self, pos: int) -> int:
        """The slot holding logical position `pos`; -1 if never written or its chunk is not resident."""
        c, off = divmod(pos, self.chunk)
        if c >= self.n_chunks or self.block_of[c] < 0 or off >= self.filled[c]:
            return -1
        return int(self.block_of[c]) * self.chunk + off

    def protected_mask(self) -> np.ndarray:
        """bool [n_chunks]: sinks, the head chunk and the tail before it, and pinned chunks."""
        return self._protected(self.n_tokens)

    def _protected(self, n_tokens: int, pins: list[tuple[int, int]] | None = None) -> np.ndarray:
        mask = np.zeros(-(-n_tokens // self.chunk), bool)
        mask[: self.sink_chunks] = True
        head = (n_tokens - 1) // self.chunk
        mask[max(0, head - self.tail_chunks) : head + 1] = True
        for c0, c1 in self._pinned_ranges(pins):
            mask[c0 : c1 + 1] = True
        return mask

    # ---- allocation -----------------------------------------------------------------------------

    def alloc_span(self, start_pos: int, n: int) -> Allocation:
        """Slots for the `n` consecutive logical positions from `start_pos` (appending, or rewriting positions
        already written, e.g. rejected drafts), evicting by score then LRU when the pool is full."""
        if n <= 0 or not 0 <= start_pos <= self.n_tokens:
            raise ValueError(f"alloc_span({start_pos}, {n}): need n > 0 and 0 <= start_pos <= "
                             f"{self.n_tokens}")
        end = start_pos + n
        self._check_span_fits(start_pos, end)
        self.n_tokens = max(self.n_tokens, end)  # advance the head first so the new tail is protected
        self._resize(self.n_chunks)
        span = slice(start_pos // self.chunk, (end - 1) // self.chunk + 1)
        moves: list[Move] = []
        for c in range(span.start, span.stop):  # python ints: this runs once or twice per decoded token
            if self.block_of[c] < 0:
                self._place(c, moves, keep=span)
            base = c * self.chunk
            self._write(c, max(start_pos, base) - base, min(end, base + self.chunk) - base)
        pos = np.arange(start_pos, end)
        slots = (self.block_of[pos // self.chunk] * self.chunk + pos % self.chunk).astype(np.int32)
        return Allocation(slots, moves)

    def truncate(self, n_tokens: int) -> Truncation:
        """Forget positions >= n_tokens (a session rewound to a shorter prefix). Dropped chunks' blocks are
        freed without a copy; the new tail, which may have been paged out, is recalled."""
        if not 0 <= n_tokens <= self.n_tokens:
            raise ValueError(f"truncate({n_tokens}): need 0 <= n_tokens <= {self.n_tokens}")
        keep_chunks = -(-n_tokens // self.chunk)
        gone = list(range(keep_chunks, self.n_chunks))
        for c in gone:
            if self.block_of[c] >= 0:
                self._free_block(c)
        self.filled[keep_chunks : self.n_chunks] = 0
        self.host_valid[keep_chunks : self.n_chunks] = False
        self.scores[keep_chunks : self.n_chunks] = UNSCORED
        self._sealed -= set(gone)
        if n_tokens % self.chunk:
            c, off = divmod(n_tokens, self.chunk)
            self.filled[c] = min(self.filled[c], off)
            self._sealed.discard(c)
            if self.block_of[c] >= 0:
                self.slot_pos[self.block_slots(int(self.block_of[c]))][off:] = -1
                self.blocks.dirty.add(int(self.block_of[c]))
        self.n_tokens = n_tokens
        self.epoch += 1
        return Truncation(gone, self.recall_protected())

    def recall_protected(self) -> list[Move]:
        """Make every protected chunk (sinks, tail, pins) resident again; the page-ins that takes."""
        moves: list[Move] = []
        for c in np.flatnonzero(self.protected_mask() & (self.block_of[: self.n_chunks] < 0)):
            self._place(int(c), moves)
        return moves

    def recall_recent(self) -> list[Move]:
        """The protected chunks and the most recent others that fit its budget and the pool's free blocks (a sequence
        back in the pool with no residency to return to), placed in order: recency then ranks them as their writes
        did."""
        n = self.n_chunks
        want = self.protected_mask() & (self.block_of[:n] < 0)
        room = min(self.n_blocks - self.held_blocks, self.blocks.free_blocks) - int(want.sum())
        others = np.flatnonzero(~want & (self.block_of[:n] < 0) & (self.filled[:n] > 0))
        want[others[len(others) - max(room, 0) :] if room > 0 else []] = True
        moves: list[Move] = []
        for c in np.flatnonzero(want):
            self._place(int(c), moves)
        return moves

    # ---- sessions: a pager whose sequence leaves the pool and comes back ------------------------

    def write_back(self) -> list[PageOut]:
        """Copies that bring the host store up to date with every resident chunk written since its last copy,
        without evicting anything (a snapshot of a live sequence reads the host store afterwards)."""
        moves = []
        for c in np.flatnonzero((self.block_of[: self.n_chunks] >= 0) & ~self.host_valid[: self.n_chunks]):
            if self.filled[c] > 0:
                moves.append(PageOut(int(c), int(self.block_of[c])))
                self.host_valid[c] = True
                self.stats.bytes_out += self.chunk_bytes
        return moves

    def residency(self) -> dict:
        """Which chunk sits in which block, and what decides the next evictions (recency, scores): JSON-safe, to
        put a parked or restored sequence back exactly as it was (`restore_residency`)."""
        n = self.n_chunks
        resident = self.resident_chunks()
        return {"pool_tokens": self.pool_tokens, "resident": resident.tolist(),
                "blocks": self.block_of[resident].tolist(), "last_use": self.last_use[:n].tolist(),
                "scores": scores_text(self.scores[:n]), "clock": int(self.clock),
                "pins": [list(span) for span in self.pins]}

    def check_residency(self, r: dict) -> None:
        """Raise ValueError unless `r` (from `residency()`) fits this pager, parked or with some of r's chunks still
        resident: pool, chunks, protections."""
        n = self.n_chunks
        try:
            resident, blocks = np.asarray(r["resident"], np.int64), np.asarray(r["blocks"], np.int64)
            last_use = np.asarray(r["last_use"], np.int64)
            scores = scores_from_text(r["scores"])
            int(r["clock"])
            pins = [(int(a), int(b)) for a, b in r["pins"]]
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"malformed residency: {e}") from None
        if (r["pool_tokens"] != self.pool_tokens or resident.shape != blocks.shape or resident.ndim != 1
                or last_use.shape != (n,) or scores.shape != (n,)
                or not np.all(np.isin(self.resident_chunks(), resident))
                or len(resident) > self.n_blocks
                or np.any((resident < 0) | (resident >= n)) or np.any((blocks < 0) | (blocks >= self.blocks.n_blocks))
                or len(np.unique(resident)) != len(resident) or len(np.unique(blocks)) != len(blocks)
                or any(not 0 <= a < b for a, b in pins)
                or np.any(self._protected(n_tokens=self.n_tokens, pins=pins) & ~np.isin(np.arange(n), resident))):
            raise ValueError("the residency does not fit this pager (pool size, chunks, blocks or protections)")

    def restore_residency(self, r: dict) -> list[Move]:
        """Page the chunks of `residency()` that left back, each into its block where that is free, and restore
        recency and scores (attention reads a sequence's chunks in logical order: the blocks they land in do not
        change it)."""
        self.check_residency(r)
        n = self.n_chunks
        moves: list[Move] = []
        for c, block in zip(r["resident"], r["blocks"], strict=True):
            if self.block_of[c] < 0:
                self._place(c, moves, prefer=block)
        self.last_use[:n] = r["last_use"]
        self.scores[:n] = scores_from_text(r["scores"])
        self.clock = int(r["clock"])
        self.pins = [(int(a), int(b)) for a, b in r["pins"]]
        return moves

    def park(self) -> list[Move]:
        """Page every resident chunk out (the pool is handed to another sequence); `recall_protected` brings the
        protected ones back when this sequence returns."""
        return [self._evict(int(c)) for c in self.resident_chunks()]

    def give_back(self, n: int) -> list[PageOut]:
        """Page out up to n resident chunks of this sequence, which is not running, for the pool: the chunks it would
        evict first (lowest score, least recent), protected ones last."""
        resident = self.resident_chunks()
        order = np.lexsort((self.last_use[resident], self.scores[resident], self.protected_mask()[resident]))
        return [self._evict(int(c)) for c in resident[order[:n]]]

    def recall_all(self) -> list[Move]:
        """Make every written chunk resident (a sequence that holds its whole context)."""
        moves: list[Move] = []
        for c in np.flatnonzero((self.block_of[: self.n_chunks] < 0) & (self.filled[: self.n_chunks] > 0)):
            self._place(int(c), moves)
        return moves

    def blocks_wanted(self, end: int) -> int:
        """Blocks this pager may take from the pool until it holds positions up to `end`: what writing them, recalling
        chunks it gave back or a reselect can borrow at most (its budget or its chunks, whichever is less, less what
        it holds). The scheduler reserves them before a step."""
        chunks = -(-max(self.n_tokens, end) // self.chunk)
        return max(0, min(self.n_blocks, chunks) - self.held_blocks)

    @classmethod
    def parked(cls, pool_tokens: int, n_tokens: int, chunk: int = CHUNK_TOKENS, sink_chunks: int = 1,
               tail_chunks: int = 4, chunk_bytes: int = 0, blocks: BlockPool | None = None) -> Pager:
        """A pager for `n_tokens` positions whose chunks are all in the host store (a restored session)."""
        p = cls(pool_tokens, chunk, sink_chunks, tail_chunks, chunk_bytes, blocks)
        p.n_tokens = n_tokens
        n = p.n_chunks
        p._resize(n)
        p.filled[:n] = chunk
        if n_tokens % chunk:
            p.filled[n - 1] = n_tokens % chunk
        p.host_valid[:n] = True
        p.scores[:n] = UNSCORED
        return p

    def take_sealed(self) -> list[int]:
        """Chunks whose last position was written since the last call, still resident: the caller summarizes
        their keys (the scorer's `seal`) after the forward that wrote them."""
        sealed = sorted(c for c in self._sealed if self.block_of[c] >= 0)
        self._sealed.clear()
        return sealed

    def apply_residency(self, keep: np.ndarray) -> list[Move]:
        """Make exactly the chunks in bool mask `keep` [n_chunks] resident: page-outs first, then page-ins.
        Protected chunks must be in `keep`, and `keep` must fit the pool."""
        n = self.n_chunks
        if keep.shape != (n,) or np.any(self.protected_mask() & ~keep) or int(keep.sum()) > self.n_blocks:
            raise ValueError("a residency set must hold every protected chunk and fit the pool")
        resident = self.block_of[:n] >= 0
        moves: list[Move] = [self._evict(int(c)) for c in np.flatnonzero(resident & ~keep)]
        for c in np.flatnonzero(keep & ~resident & (self.filled[:n] > 0)):
            self._place(int(c), moves)
        return moves

    def set_scores(self, scores: np.ndarray) -> None:
        """Relevance of each materialized chunk from the policy's last reselect; lower is evicted first.
        Chunks written later stay UNSCORED (evicted after every scored chunk, LRU among themselves)."""
        self.scores[:] = UNSCORED
        self.scores[: len(scores)] = scores

    # ---- pins -----------------------------------------------------------------------------------

    def pin(self, start_tok: int, end_tok: int) -> list[Move]:
        """Never evict the chunks of tokens [start_tok, end_tok); returns the moves that bring back those
        already paged out. Refused, changing nothing, when the pins could leave no block to evict."""
        if not 0 <= start_tok < end_tok:
            raise InvalidRequestError("pin", f"span [{start_tok}, {end_tok}) is empty or negative")
        pinned = self._pinned_chunks(self.pins + [(start_tok, end_tok)])
        # Worst case the tail sits beside, not over, the pins; one block must stay evictable after it.
        budget = self.n_blocks - self.sink_chunks - self.tail_chunks - 2
        if len(pinned) > budget:
            raise InvalidRequestError(
                "pin", f"pinning tokens [{start_tok}, {end_tok}) would pin {len(pinned)} chunks of "
                f"{self.chunk} tokens; a pool of {self.n_blocks} blocks with {self.sink_chunks} sink, "
                f"{self.tail_chunks} tail and 1 head chunk can pin at most {budget} and still evict")
        self.pins.append((start_tok, end_tok))
        moves: list[Move] = []
        for c in sorted(pinned):
            if c < self.n_chunks and self.block_of[c] < 0:
                self._place(c, moves)
        return moves

    def pin_prefix(self, n_tokens: int) -> list[Move]:
        """The pins become the one span [0, n_tokens) (0: no pins), e.g. a system prompt; refused like `pin`,
        changing nothing."""
        old, self.pins = self.pins, []
        try:
            return self.pin(0, n_tokens) if n_tokens else []
        except InvalidRequestError as e:
            self.pins = old
            raise InvalidRequestError("pin_prefix_tokens", str(e).removeprefix("pin: ")) from None

    def unpin(self, start_tok: int, end_tok: int) -> None:
        if (start_tok, end_tok) not in self.pins:
            raise InvalidRequestError("pin", f"tokens [{start_tok}, {end_tok}) are not pinned")
        self.pins.remove((start_tok, end_tok))

    # ---- serialization --------------------------------------------------------------------------

    def state(self) -> PagerState:
        n = self.n_chunks
        return PagerState(
            STATE_VERSION, self.pool_tokens, self.chunk, self.sink_chunks, self.tail_chunks, self.chunk_bytes,
            self.n_tokens, self.clock, self.epoch, self.block_of[:n].copy(), self.filled[:n].copy(),
            self.host_valid[:n].copy(), self.last_use[:n].copy(), self.scores[:n].copy(),
            np.asarray(self.blocks.free_order(), np.int32), self.slot_pos.copy(), list(self.pins),
            PagerStats(**vars(self.stats)),
            {name: tuple(a.copy() for a in self.summaries.table(name, n)) for name in self.summaries.values})

    @classmethod
    def from_state(cls, s: PagerState) -> Pager:
        if s.version != STATE_VERSION:
            raise ValueError(f"pager state version {s.version} is not supported (expected {STATE_VERSION})")
        p = cls(s.pool_tokens, s.chunk, s.sink_chunks, s.tail_chunks, s.chunk_bytes)
        p.n_tokens, p.clock, p.epoch = s.n_tokens, s.clock, s.epoch + 1
        p._resize(p.n_chunks)
        n = p.n_chunks
        if not len(s.block_of) == len(s.filled) == len(s.host_valid) == len(s.last_use) == len(s.scores) == n:
            raise ValueError(f"pager state arrays do not match its {n} chunks")
        p.block_of[:n], p.filled[:n], p.host_valid[:n] = s.block_of, s.filled, s.host_valid
        p.last_use[:n], p.scores[:n] = s.last_use, s.scores
        p.pins = [(int(a), int(b)) for a, b in s.pins]
        p.stats = PagerStats(**vars(s.stats))
        for name, (values, present) in s.summaries.items():
            for c in np.flatnonzero(present):
                p.summaries.put(name, int(c), values[c])
        p._rebuild_blocks(s.free)
        if not np.array_equal(p.slot_pos, s.slot_pos):
            raise ValueError("pager state slot_pos does not match its chunk map")
        return p

    # ---- internals ------------------------------------------------------------------------------

    def _resize(self, n: int) -> None:
        if n <= len(self.block_of):
            return
        cap = max(n, 2 * len(self.block_of), 64)
        self.block_of = _grow(self.block_of, cap, NOT_RESIDENT)
        self.filled = _grow(self.filled, cap, 0)
        self.host_valid = _grow(self.host_valid, cap, False)
        self.last_use = _grow(self.last_use, cap, 0)
        self.scores = _grow(self.scores, cap, UNSCORED)

    def span_fits(self, start: int, end: int) -> bool:
        """Whether positions [start, end) can be written in one allocation: the span and every protected chunk
        resident at once."""
        return self._blocks_needed(start, end) <= self.n_blocks

    def _blocks_needed(self, start: int, end: int) -> int:
        # protected_mask() plus the span, counted as a union of chunk ranges: no per-chunk array on every token
        head = (max(self.n_tokens, end) - 1) // self.chunk
        ranges = [(0, self.sink_chunks - 1), (head - self.tail_chunks, head),
                  (start // self.chunk, (end - 1) // self.chunk), *self._pinned_ranges()]
        need, reach = 0, -1
        for c0, c1 in sorted(ranges):
            c0, c1 = max(c0, reach + 1, 0), min(c1, head)
            if c1 >= c0:
                need, reach = need + c1 - c0 + 1, c1
        return need

    def _check_span_fits(self, start: int, end: int) -> None:
        need = self._blocks_needed(start, end)
        if need > self.n_blocks:
            raise ConfigError(
                f"a write of positions {start}..{end - 1} needs {need} "
                f"protected chunks resident at once, more than the pool's {self.n_blocks} blocks; write in "
                f"smaller batches or use a larger --kv-pool")

    def _place(self, c: int, moves: list[Move], keep: slice = slice(0), prefer: int | None = None) -> None:
        """Give non-resident chunk c a block (at the budget, evicting one of its own chunks, but not one in `keep`);
        recall its bytes if it was written. Raises PoolExhaustedError when the shared pool has no block left."""
        if self.held_blocks >= self.n_blocks:
            moves.append(self._evict(self._victim(keep)))
        block = self.blocks.take(self, prefer)
        self.block_of[c] = block
        self._block_chunk[block] = c
        self.epoch += 1
        self.clock += 1
        self.last_use[c] = self.clock
        if self.filled[c] > 0:
            moves.append(PageIn(c, block))
            self.stats.page_ins += 1
            self.stats.bytes_in += self.chunk_bytes
            self._mark(c, block, 0, int(self.filled[c]))

    def _victim(self, keep: slice) -> int:
        n = self.n_chunks
        mask = (self.block_of[:n] >= 0) & ~self.protected_mask()
        mask[keep] = False
        cand = np.flatnonzero(mask)
        if len(cand) == 0:  # unreachable while _check_span_fits and the pin guard hold
            raise ConfigError(f"every one of the {self.n_blocks} pool blocks is protected; nothing to evict")
        order = np.lexsort((self.last_use[cand], self.scores[cand]))  # lowest score, then least recent
        return int(cand[order[0]])

    def _evict(self, c: int) -> PageOut:
        block = int(self.block_of[c])
        move = PageOut(c, block, write_back=not self.host_valid[c])
        self.stats.page_outs += 1
        self.stats.bytes_out += self.chunk_bytes if move.write_back else 0
        self.host_valid[c] = True
        self._free_block(c)
        return move

    def _free_block(self, c: int) -> None:
        block = int(self.block_of[c])
        self.block_of[c] = NOT_RESIDENT
        self._block_chunk[block] = -1
        self.slot_pos[self.block_slots(block)] = -1
        self.blocks.give(block)
        self.epoch += 1

    def _write(self, c: int, off0: int, off1: int) -> None:
        self._mark(c, int(self.block_of[c]), off0, off1)
        self.filled[c] = max(self.filled[c], off1)
        self.host_valid[c] = False
        self.clock += 1
        self.last_use[c] = self.clock
        if off1 == self.chunk:
            self._sealed.add(c)

    def _mark(self, c: int, block: int, off0: int, off1: int) -> None:
        """slot_pos of chunk c's offsets [off0, off1) in `block`."""
        base = block * self.chunk
        self.slot_pos[base + off0 : base + off1] = c * self.chunk + np.arange(off0, off1)

    def _pinned_ranges(self, pins: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
        return [(a // self.chunk, (b - 1) // self.chunk) for a, b in (self.pins if pins is None else pins)]

    def _pinned_chunks(self, pins: list[tuple[int, int]]) -> set[int]:
        """Distinct pinned chunks that sinks do not already protect."""
        return {c for c0, c1 in self._pinned_ranges(pins) for c in range(max(c0, self.sink_chunks), c1 + 1)}

    def _rebuild_blocks(self, free: np.ndarray) -> None:
        """Block ownership (taken from this pager's private pool) and slot_pos from block_of/filled, checking no
        block has two owners; then the pool hands out its free blocks in the order `free` gives."""
        n = self.n_chunks
        for c in np.flatnonzero(self.block_of[:n] >= 0):
            block = int(self.block_of[c])
            if not 0 <= block < self.n_blocks or self._block_chunk[block] >= 0:
                raise ValueError(f"pager state maps chunk {c} to block {block}, which is invalid or taken")
            self.blocks.take(self, prefer=block)
            self._block_chunk[block] = c
            self._mark(int(c), block, 0, int(self.filled[c]))
        self.blocks.set_free_order([int(b) for b in free])


def min_pool_tokens(chunk: int = 64, sink_chunks: int = 1, tail_chunks: int = 4) -> int:
    """Sinks + tail + the head chunk + one evictable block."""
    return (sink_chunks + tail_chunks + 2) * chunk


def _check_config(pool_tokens: int, chunk: int, sink_chunks: int, tail_chunks: int) -> None:
    if chunk <= 0 or sink_chunks < 0 or tail_chunks < 0:
        raise ConfigError(f"kv pool chunk ({chunk}), sink ({sink_chunks}) and tail ({tail_chunks}) chunks "
                          "must be positive / non-negative")
    if pool_tokens % chunk:
        raise ConfigError(f"kv pool of {pool_tokens} tokens is not a multiple of the {chunk}-token chunk")
    need = min_pool_tokens(chunk, sink_chunks, tail_chunks)
    if pool_tokens < need:
        raise ConfigError(
            f"kv pool of {pool_tokens} tokens is too small: {sink_chunks} sink + {tail_chunks} tail + 1 head "
            f"chunk are never evicted and one more block must stay evictable, so it needs at least {need} "
            f"tokens ({need // chunk} blocks of {chunk})")


def scores_text(scores: np.ndarray) -> str:
    """Chunk scores as JSON-safe text (`scores_from_text` reads it back): base64 float64, exact, infinities too."""
    return base64.b64encode(np.asarray(scores, "<f8").tobytes()).decode()


def scores_from_text(text: str) -> np.ndarray:
    if not isinstance(text, str):
        raise TypeError(f"scores must be a base64 string, not {type(text).__name__}")
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 8:
        raise ValueError(f"scores hold {len(raw)} bytes, not a whole number of float64")
    return np.frombuffer(raw, "<f8").astype(np.float64)


def _grow(a: np.ndarray, n: int, fill) -> np.ndarray:
    if len(a) >= n:
        return a
    # zeros come from calloc: pages of a large table are not touched until written (summaries grow by doubling)
    out = np.zeros((n, *a.shape[1:]), a.dtype) if fill == 0 else np.full((n, *a.shape[1:]), fill, a.dtype)
    out[: len(a)] = a
    return out
