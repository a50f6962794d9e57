"""One block pool shared by several pagers: budgets hold, no block has two holders, what a pager borrows stays
within what it said it wanted, and a suspended sequence whose blocks were not taken comes back without copies."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from lucekv.kvflash.blocks import BlockPool, PoolExhaustedError
from lucekv.kvflash.pager import CHUNK_TOKENS, Move, PageIn, Pager
from lucekv.kvflash.policy import reselect
from lucekv.kvflash.sequence import PagedSequence
from tests.kvflash.fake_backend import POISON, FakeBackend, check_invariants


def shared(n_blocks: int, *budgets: int) -> tuple[BlockPool, list[Pager], list[FakeBackend]]:
    pool = BlockPool(n_blocks, CHUNK_TOKENS)
    rows = np.full(n_blocks * CHUNK_TOKENS, POISON, np.int64)
    pagers = [Pager(b * CHUNK_TOKENS, blocks=pool) for b in budgets]
    return pool, pagers, [FakeBackend(p, rows) for p in pagers]


def check_pool(pool: BlockPool, pagers: list[Pager]) -> None:
    assert pool.used_blocks == sum(p.held_blocks for p in pagers)
    for p in pagers:
        for b in p.block_of[: p.n_chunks][p.block_of[: p.n_chunks] >= 0].tolist():
            assert pool.holder(b) is p
    free_slots = np.ones(len(pool.slot_pos), bool)
    for b in range(pool.n_blocks):
        if pool.holder(b) is not None:
            free_slots[b * CHUNK_TOKENS : (b + 1) * CHUNK_TOKENS] = False
    assert np.all(pool.slot_pos[free_slots] == -1), "a free block's slots are still mapped"


def test_pagers_in_one_pool_borrow_up_to_their_budgets_and_page_within_them():
    pool, (paged, whole), (bp, bw) = shared(20, 8, 20)
    bp.prefill(1000)  # 16 chunks through a budget of 8: pages within it
    bw.prefill(600)  # 10 chunks, all resident
    for p, b in ((paged, bp), (whole, bw)):
        check_invariants(p, b)
    check_pool(pool, [paged, whole])
    assert paged.held_blocks == 8 and whole.held_blocks == 10 and pool.free_blocks == 2
    assert paged.stats.page_outs > 0 and whole.stats.page_outs == 0
    bw.write(600, 168)  # two more chunks: the last two free blocks
    assert pool.free_blocks == 0
    with pytest.raises(PoolExhaustedError, match="all 20 blocks"):
        whole.alloc_span(768, 64)  # a 13th chunk: the pool is dry, and it must not evict its own chunks
    bp.write(1000, 100)  # the paged one still pages within its budget
    check_invariants(paged, bp)


def test_the_private_pool_of_a_lone_pager_is_the_old_identity_layout():
    pager = Pager(512)
    assert pager.blocks.n_blocks == 8 and len(pager.slot_pos) == 512
    FakeBackend(pager).prefill(300)
    assert pager.block_of[:5].tolist() == [0, 1, 2, 3, 4]


class RecordingBackend:
    """A PoolBackend that keeps the moves it was asked to run."""

    def __init__(self):
        self.moves: list[Move] = []

    def execute(self, moves: list[Move], host) -> None:
        self.moves += moves

    def chunk_keys(self, block: int) -> np.ndarray:
        return np.zeros((1, CHUNK_TOKENS, 1, 4), np.float32)

    def last_queries(self, row: int = -1) -> np.ndarray:
        return np.ones((1, 1, 4), np.float32)


def sequence(pool: BlockPool, budget: int | None) -> tuple[PagedSequence, RecordingBackend]:
    backend = RecordingBackend()
    seq = PagedSequence(backend, pool, budget, n_layer=1, n_kv_head=1, head_dim=4, dtype=np.float32, policy="lru",
                        tau=64, window=0)
    return seq, backend


@pytest.mark.parametrize("budget", [None, 512], ids=["whole context", "paged"])
def test_a_suspended_sequence_comes_back_without_copies_unless_its_blocks_were_taken(budget):
    pool = BlockPool(32, CHUNK_TOKENS)
    seq, backend = sequence(pool, budget)
    for start in range(0, 1200, 100):
        seq.alloc(start, 100)
        seq.after_forward(0)
    before = seq.pager.residency()
    seq.suspend()
    backend.moves.clear()
    seq.resume()
    assert backend.moves == []  # nothing left the pool: nothing to copy
    seq.suspend()
    assert seq.give_back(3) == 3 and pool.free_blocks == 32 - seq.held_blocks
    taken = [m.chunk for m in backend.moves]
    backend.moves.clear()
    seq.resume()
    assert sorted(m.chunk for m in backend.moves) == sorted(taken) and all(isinstance(m, PageIn)
                                                                            for m in backend.moves)
    after = seq.pager.residency()
    assert after["resident"] == before["resident"] and after["last_use"] == before["last_use"]
    assert after["scores"] == before["scores"]


def test_a_whole_context_sequence_returns_whole_after_giving_everything_back():
    pool = BlockPool(16, CHUNK_TOKENS)
    seq, _ = sequence(pool, None)
    seq.alloc(0, 500)
    seq.park()
    assert seq.held_blocks == 0 and pool.free_blocks == 16
    seq.resume()
    assert seq.pager.resident_chunks().tolist() == list(range(8))
    assert seq.table().tolist() == seq.pager.block_of[:8].tolist()


class SharedPoolMachine(RuleBasedStateMachine):
    """Three pagers in one pool (sized to their budgets together): appends, decode steps, truncations, reselects and
    suspensions in any order. Every operation borrows at most what `blocks_wanted` promised before it."""

    @initialize(budgets=st.lists(st.integers(7, 12), min_size=3, max_size=3))
    def setup(self, budgets):
        self.pool, self.pagers, self.backends = shared(sum(budgets), *budgets)
        self.resume: list[dict | None] = [None] * 3

    def _within_wanted(self, i: int, end: int, op) -> None:
        p = self.pagers[i]
        wanted, held = p.blocks_wanted(end), p.held_blocks
        op()
        assert p.held_blocks - held <= wanted

    def _running(self, i: int) -> None:
        """Operations below act on a running pager: one that was suspended comes back first."""
        if self.resume[i] is not None:
            r, self.resume[i] = self.resume[i], None
            self._within_wanted(i, 0, lambda: self.backends[i].run(self.pagers[i].restore_residency(r)))

    @rule(i=st.integers(0, 2), n=st.integers(1, 300))
    def append(self, i, n):
        self._running(i)
        b = self.backends[i]
        n = min(n, 3 * CHUNK_TOKENS)  # fits beside the protected tail of the smallest budget
        self._within_wanted(i, b.n_tokens + n, lambda: b.write(b.n_tokens, n))

    @rule(i=st.integers(0, 2), k=st.integers(1, 80))
    def decode(self, i, k):
        self._running(i)
        b = self.backends[i]
        for _ in range(k):
            self._within_wanted(i, b.n_tokens + 1, lambda: b.write(b.n_tokens, 1))

    @rule(i=st.integers(0, 2), frac=st.floats(0, 1))
    def truncate(self, i, frac):
        self._running(i)
        b = self.backends[i]
        n = int(b.n_tokens * frac)
        self._within_wanted(i, n, lambda: b.truncate(n))

    @rule(i=st.integers(0, 2), seed=st.integers(0, 1000))
    def reselect(self, i, seed):
        self._running(i)
        p = self.pagers[i]
        if p.n_chunks:
            scores = np.random.default_rng(seed).standard_normal(p.n_chunks)
            self._within_wanted(i, 0, lambda: self.backends[i].run(reselect(p, scores)))

    @rule(i=st.integers(0, 2), n=st.integers(0, 12))
    def suspend_and_give_back(self, i, n):
        p = self.pagers[i]
        if self.resume[i] is None:
            self.resume[i] = p.residency()
        self.backends[i].run(p.give_back(n))

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        for i, (p, b) in enumerate(zip(self.pagers, self.backends, strict=True)):
            if self.resume[i] is None:  # a suspended pager may have given its protected chunks back
                check_invariants(p, b)
            assert p.held_blocks <= p.n_blocks
        check_pool(self.pool, self.pagers)


TestSharedPool = SharedPoolMachine.TestCase
TestSharedPool.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)

