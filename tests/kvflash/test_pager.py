from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lucekv.errors import ConfigError, InvalidRequestError
from lucekv.kvflash.pager import STATE_VERSION, PageIn, PageOut, Pager, PagerUsage, min_pool_tokens
from lucekv.kvflash.policy import LruScorer, reselect
from tests.kvflash.fake_backend import FakeBackend, check_invariants


def test_pool_too_small_is_refused_with_the_minimum():
    assert min_pool_tokens() == 448
    with pytest.raises(ConfigError, match=r"448 tokens is too small|at least 448"):
        Pager(384)
    with pytest.raises(ConfigError, match="at least 448 tokens"):
        Pager(384)
    with pytest.raises(ConfigError, match="not a multiple"):
        Pager(500)
    Pager(448)  # the minimum works


def test_a_pager_back_without_a_residency_recalls_the_protected_and_the_most_recent_chunks_in_order():
    pager = Pager.parked(8 * 64, 20 * 64 + 10, tail_chunks=1)
    moves = pager.recall_recent()
    # sink 0, head 20 and its tail chunk 19, then the most recent others while blocks last
    assert pager.resident_chunks().tolist() == [0, 14, 15, 16, 17, 18, 19, 20]
    assert [m.chunk for m in moves] == [0, 14, 15, 16, 17, 18, 19, 20] and all(isinstance(m, PageIn) for m in moves)
    assert np.all(np.diff(pager.last_use[[0, 14, 15, 16, 17, 18, 19, 20]]) > 0)  # recency as the writes left it
    short = Pager.parked(8 * 64, 3 * 64)
    assert [m.chunk for m in short.recall_recent()] == [0, 1, 2]


def test_small_pools_protect_fewer_tail_chunks():
    from lucekv.kvflash.sequence import tail_chunks

    assert [tail_chunks(n) for n in (4, 8, 15, 16, 24, 32, 64, 2048)] == [1, 1, 1, 2, 3, 4, 4, 4]


def test_pager_that_never_fills_keeps_the_identity_layout():
    pager = Pager(1024)
    backend = FakeBackend(pager)
    alloc = backend.write(0, 300)
    assert np.array_equal(alloc.slots, np.arange(300))
    for pos in range(300, 400):
        assert backend.write(pos, 1).slots.tolist() == [pos]
    assert alloc.moves == [] and pager.stats.page_outs == 0
    check_invariants(pager, backend)


def test_prefill_of_a_prompt_four_times_the_pool_stays_inside_the_pool():
    pager = Pager(512, chunk_bytes=1000)
    backend = FakeBackend(pager)
    pos = 0
    while pos < 4 * 512:
        n = min(100, 4 * 512 - pos)  # unaligned batches: spans cross chunk boundaries
        backend.write(pos, n)
        pos += n
        assert len(pager.resident_chunks()) <= pager.n_blocks
        check_invariants(pager, backend)
    # LRU streaming: the sink and the newest chunks stay, everything between went to the host.
    assert pager.resident_chunks().tolist() == [0, *range(32 - 7, 32)]
    assert pager.paged_chunks().tolist() == list(range(1, 25))
    assert pager.stats.page_outs == 24 and pager.stats.page_ins == 0
    assert pager.usage() == PagerUsage(resident_chunks=8, paged_chunks=24, page_outs=24, page_ins=0,
                                       bytes_moved=24 * 1000)
    for p in range(pos, pos + 200):  # decode on, at constant residency
        backend.write(p, 1)
        check_invariants(pager, backend)
    assert len(pager.resident_chunks()) == pager.n_blocks


def test_decode_reuploads_slot_pos_only_when_residency_changes():
    pager = Pager(512)
    backend = FakeBackend(pager)
    backend.prefill(1000)
    uploads = backend.uploads
    for p in range(1000, 1000 + 64 * 3):
        backend.write(p, 1)
        check_invariants(pager, backend)
    assert backend.uploads - uploads == 3  # one per new chunk (each evicts one), none per token


def test_a_span_wider_than_the_unprotected_pool_is_refused_before_any_change():
    pager = Pager(448)
    with pytest.raises(ConfigError, match="smaller batches"):
        pager.alloc_span(0, 7 * 64 + 1)
    assert pager.n_tokens == 0 and pager.epoch == 0


def test_alloc_span_rejects_a_gap():
    pager = Pager(448)
    with pytest.raises(ValueError, match="start_pos"):
        pager.alloc_span(5, 1)


def test_pins_survive_pressure_and_recall_paged_chunks():
    pager = Pager(640)  # 10 blocks: 1 sink + 4 tail + 1 head + 1 evictable leaves 3 to pin
    backend = FakeBackend(pager)
    backend.prefill(64 * 12)  # chunks 1 and 2 are paged out by now
    assert {1, 2} <= set(pager.paged_chunks().tolist())
    moves = pager.pin(64, 3 * 64)  # chunks 1 and 2
    assert [type(m) for m in moves].count(PageIn) == 2
    assert {m.chunk for m in moves if isinstance(m, PageIn)} == {1, 2}
    backend.run(moves)
    check_invariants(pager, backend)
    for p in range(64 * 12, 64 * 30):
        backend.write(p, 1)
        assert pager.block_of[1] >= 0 and pager.block_of[2] >= 0
    check_invariants(pager, backend)
    with pytest.raises(InvalidRequestError, match="can pin at most 3"):
        pager.pin(10 * 64, 12 * 64)  # 2 more chunks: 4 > 3
    assert pager.pins == [(64, 192)]  # a refused pin changes nothing
    pager.unpin(64, 3 * 64)
    backend.prefill(64 * 4)
    assert pager.block_of[1] < 0 and pager.block_of[2] < 0  # unpinned: oldest, evicted first
    with pytest.raises(InvalidRequestError, match="not pinned"):
        pager.unpin(64, 3 * 64)


def test_pinning_the_sinks_costs_nothing():
    pager = Pager(448)  # 0 chunks pinnable beyond the sinks
    pager.pin(0, 64)
    with pytest.raises(InvalidRequestError, match="can pin at most 0"):
        pager.pin(64, 65)


def test_a_recalled_chunk_that_was_not_rewritten_is_not_copied_out_again():
    pager = Pager(512, chunk_bytes=10)
    backend = FakeBackend(pager)
    backend.prefill(64 * 10)
    assert pager.block_of[1] < 0
    scores = np.arange(pager.n_chunks, dtype=np.float64)
    scores[1] = 100.0  # chunk 1 is now the most relevant
    moves = reselect(pager, scores)
    backend.run(moves)
    assert isinstance(moves[0], PageOut) and moves[-1] == PageIn(1, moves[0].block)
    check_invariants(pager, backend)
    scores[1] = -100.0
    moves = reselect(pager, scores)
    backend.run(moves)
    assert moves[0] == PageOut(1, moves[0].block, write_back=False)
    check_invariants(pager, backend)


def test_state_round_trip_then_identical_behaviour():
    pager = Pager(768, chunk_bytes=7)
    backend = FakeBackend(pager)
    backend.prefill(1500)
    backend.run(pager.pin(200, 300))
    from lucekv.kvflash.policy import BoundScorer

    scorer = BoundScorer(n_kv_head=1)
    rng = np.random.default_rng(0)
    for c in range(pager.n_chunks - 1):
        scorer.seal(pager, c, rng.standard_normal((1, 64, 1, 4)).astype(np.float16))
    backend.run(reselect(pager, rng.standard_normal(pager.n_chunks)))
    copy = Pager.from_state(pager.state())
    for name in ("slot_pos", "block_of", "filled", "host_valid", "last_use", "scores"):
        assert np.array_equal(getattr(copy, name)[: pager.n_chunks], getattr(pager, name)[: pager.n_chunks])
    assert copy.pins == pager.pins and copy.stats == pager.stats and copy.n_tokens == pager.n_tokens
    for name in ("quest.kmin", "quest.kmax"):
        a, b = pager.summaries.table(name, pager.n_chunks), copy.summaries.table(name, pager.n_chunks)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    for p in range(1500, 1800, 7):
        a, b = pager.alloc_span(p, 7), copy.alloc_span(p, 7)
        assert np.array_equal(a.slots, b.slots) and a.moves == b.moves


def test_from_state_rejects_bad_states():
    pager = Pager(512)
    FakeBackend(pager).prefill(900)
    s = pager.state()
    s.version = STATE_VERSION + 1
    with pytest.raises(ValueError, match="version"):
        Pager.from_state(s)
    s = pager.state()
    a, b = pager.resident_chunks()[-2:]
    s.block_of[a] = s.block_of[b]  # two chunks in one block
    with pytest.raises(ValueError, match="invalid or taken"):
        Pager.from_state(s)
    s = pager.state()
    s.slot_pos[5] = 77
    with pytest.raises(ValueError, match="slot_pos"):
        Pager.from_state(s)


class PagerMachine(RuleBasedStateMachine):
    """Random appends, rewrites, truncations, pins and reselects against the reference model."""

    @initialize(blocks=st.integers(7, 12))
    def setup(self, blocks):
        self.pager = Pager(blocks * 64, chunk_bytes=1)
        self.backend = FakeBackend(self.pager)

    @rule(n=st.integers(1, 256))  # <= 5 chunks: always inside the protected tail window
    def append(self, n):
        self.backend.write(self.pager.n_tokens, n)

    @precondition(lambda self: self.pager.n_tokens > 0)
    @rule(back=st.integers(1, 700), extra=st.integers(0, 60))
    def rewrite(self, back, extra):
        """Rewrite from an earlier position: rejected drafts, or a session rewound far back."""
        start = self.pager.n_tokens - min(back, self.pager.n_tokens)
        end = self.pager.n_tokens + extra
        if len(self._protected_after(start, end)) > self.pager.n_blocks:
            with pytest.raises(ConfigError, match="smaller batches"):
                self.pager.alloc_span(start, end - start)
        else:
            self.backend.write(start, end - start)

    def _protected_after(self, start, end):
        chunk, n_tokens = self.pager.chunk, max(self.pager.n_tokens, end)
        head = (n_tokens - 1) // chunk
        held = {0, *range(max(0, head - 4), head + 1), *range(start // chunk, (end - 1) // chunk + 1)}
        held |= {c for s, e in self.pager.pins for c in range(s // chunk, (e - 1) // chunk + 1) if c <= head}
        return held

    @precondition(lambda self: self.pager.n_tokens > 0)
    @rule(back=st.integers(0, 700))
    def truncate(self, back):
        self.backend.truncate(self.pager.n_tokens - min(back, self.pager.n_tokens))

    @rule(a=st.integers(0, 1500), length=st.integers(1, 200))
    def pin(self, a, length):
        chunk = self.pager.chunk
        spans = self.pager.pins + [(a, a + length)]
        pinned = {c for s, e in spans for c in range(max(s // chunk, 1), (e - 1) // chunk + 1)}
        before = list(self.pager.pins)
        if len(pinned) > self.pager.n_blocks - 7:
            with pytest.raises(InvalidRequestError):
                self.pager.pin(a, a + length)
            assert self.pager.pins == before
        else:
            self.backend.run(self.pager.pin(a, a + length))

    @precondition(lambda self: self.pager.pins)
    @rule(i=st.integers(0, 100))
    def unpin(self, i):
        self.pager.unpin(*self.pager.pins[i % len(self.pager.pins)])

    @precondition(lambda self: self.pager.n_tokens > 0)
    @rule(seed=st.integers(0, 2**32 - 1))
    def reselect_random(self, seed):
        scores = np.random.default_rng(seed).standard_normal(self.pager.n_chunks)
        self.backend.run(reselect(self.pager, scores))

    @precondition(lambda self: self.pager.n_tokens > 0)
    @rule()
    def reselect_lru(self):
        self.backend.run(reselect(self.pager, LruScorer().scores(self.pager)))

    @invariant()
    def consistent(self):
        check_invariants(self.pager, self.backend)


TestPagerMachine = PagerMachine.TestCase
TestPagerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
