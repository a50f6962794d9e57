"""The scheduler against a model of sequences and a block pool: budgets, FIFO, preemption, and that every request
finishes with the pool never over-committed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lucekv.engine.scheduler import QueueFullError, Scheduler, SchedulerConfig, Step
from lucekv.errors import ConfigError

CHUNK = 64


def chunks(tokens: int) -> int:
    return -(-tokens // CHUNK)


class FakeSeq:
    """A request: a prompt computed in pieces of `piece`, then `gen` decode tokens; it holds one block per chunk, at
    most `budget` (a paged sequence holds its budget once its context outgrows it)."""

    def __init__(self, name: str, prompt: int, gen: int, piece: int = 256, budget: int = 10**6, held: int = 0):
        self.name, self.prompt, self.gen, self.piece, self.budget = name, prompt, gen, piece, budget
        self.computed = 0
        self.held = held  # blocks it holds (an idle session's, before it runs)
        self.pieces: list[int] = []

    def __repr__(self) -> str:
        return self.name

    def next_work(self) -> tuple[int, int, bool]:
        if self.computed < self.prompt:
            return self.computed, min(self.piece, self.prompt - self.computed), True
        return self.computed, 1, False

    def blocks_wanted(self, end: int) -> int:
        return max(0, min(self.budget, chunks(max(self.computed, end))) - self.held)

    @property
    def held_blocks(self) -> int:
        return self.held

    @property
    def done(self) -> bool:
        return self.computed >= self.prompt + self.gen


class FakePool:
    def __init__(self, n_blocks: int, seqs: list[FakeSeq], scheduler_running: list):
        self.n_blocks, self.seqs, self.running = n_blocks, seqs, scheduler_running

    @property
    def free_blocks(self) -> int:
        return self.n_blocks - sum(s.held for s in self.seqs)

    @property
    def reclaimable_blocks(self) -> int:
        return sum(s.held for s in self.seqs if s not in self.running)


class Harness:
    """Runs steps as an engine would: park the preempted, take blocks back from idle sequences, then run each work
    (its sequence borrows what it wanted), checking the pool never holds more than it has."""

    def __init__(self, n_blocks: int, config: SchedulerConfig, idle: list[FakeSeq] = ()):
        self.seqs: list[FakeSeq] = list(idle)
        self.scheduler = Scheduler(config, None)
        self.scheduler.ledger = FakePool(n_blocks, self.seqs, self.scheduler.running)
        self.n_blocks = n_blocks
        self.finished: list[FakeSeq] = []
        self.steps: list[Step] = []

    def add(self, seq: FakeSeq) -> None:
        self.scheduler.add(seq)
        self.seqs.append(seq)

    def step(self) -> Step:
        step = self.scheduler.schedule()
        self.steps.append(step)
        for seq in step.preempted:
            seq.held = 0
        take = step.reclaim
        for seq in self.seqs:  # idle holders give blocks back
            if seq not in self.scheduler.running and take:
                given = min(seq.held, take)
                seq.held -= given
                take -= given
        assert take == 0, "the scheduler counted on blocks idle sequences do not hold"
        for w in step.works:
            seq = w.seq
            assert (w.start, w.n, w.prefill) == seq.next_work()
            seq.held += seq.blocks_wanted(w.start + w.n)
            if w.prefill:
                seq.pieces.append(w.n)
            seq.computed += w.n
            assert sum(s.held for s in self.seqs) <= self.n_blocks, "the pool is over-committed"
        for w in step.works:
            if w.seq.done:
                self.scheduler.remove(w.seq)
                self.seqs.remove(w.seq)
                self.finished.append(w.seq)
        return step

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_work:
                return
            self.step()
        raise AssertionError("the requests did not finish")


def test_decode_rows_and_a_prompt_piece_share_a_step_under_the_token_budget():
    h = Harness(1000, SchedulerConfig(max_batch=8, step_tokens=300))
    a, b = FakeSeq("a", 10, 50, piece=256), FakeSeq("b", 1000, 5, piece=256)
    h.add(a)
    h.step()  # a's prompt
    h.add(b)
    step = h.step()
    assert [(w.seq, w.n, w.prefill) for w in step.works] == [(a, 1, False), (b, 256, True)]
    h.run()
    assert b.pieces == [256, 256, 256, 232]  # the sequence's own pieces, whatever the step held beside them
    # each step of b's prompt decoded a token of a too: a long prompt does not freeze the other stream
    assert all(any(w.seq is a and not w.prefill for w in s.works) for s in h.steps[1:5])


def test_the_budget_is_soft_by_one_piece_and_decode_rows_always_run():
    h = Harness(10_000, SchedulerConfig(max_batch=4, step_tokens=100))
    seqs = [FakeSeq(f"s{i}", 300, 3, piece=64) for i in range(4)]
    for s in seqs:
        h.add(s)
    while h.scheduler.has_work:
        step = h.step()
        prompt_tokens = [w.n for w in step.works if w.prefill]
        assert sum(w.n for w in step.works) - (prompt_tokens[-1] if prompt_tokens else 0) < 100
    assert len(h.finished) == 4


def test_admission_is_first_in_first_out_and_bounded_by_max_batch():
    h = Harness(10_000, SchedulerConfig(max_batch=2, step_tokens=1000))
    seqs = [FakeSeq(f"s{i}", 10, 4) for i in range(5)]
    for s in seqs:
        h.add(s)
    order = []
    while h.scheduler.has_work:
        step = h.step()
        assert len({id(w.seq) for w in step.works}) <= 2
        order += step.admitted
    assert order == seqs


def test_a_full_queue_is_refused_but_places_in_the_batch_are_not_queue_places():
    h = Harness(10_000, SchedulerConfig(max_batch=2, max_queue=1, step_tokens=1000))
    h.add(FakeSeq("a", 10, 5))
    h.add(FakeSeq("b", 10, 5))  # both go into the batch at the next step
    h.add(FakeSeq("c", 10, 5))  # the one queue place
    with pytest.raises(QueueFullError, match="1 places"):
        h.add(FakeSeq("d", 10, 5))


def test_when_blocks_run_short_the_youngest_is_parked_and_resumes_first():
    # 6 blocks: a and b each grow to 4 chunks, so b (the younger) is parked when a needs its third block
    h = Harness(6, SchedulerConfig(max_batch=4, step_tokens=1000))
    a, b = FakeSeq("a", 60, 200), FakeSeq("b", 60, 200)
    h.add(a)
    h.add(b)
    h.add(FakeSeq("c", 10, 1))
    preempted = []
    while h.scheduler.has_work:
        step = h.step()
        preempted += step.preempted
        if step.preempted:
            assert list(h.scheduler.waiting)[: len(step.preempted)] == step.preempted[::-1]
    assert preempted and all(p is not a for p in preempted)
    assert {s.name for s in h.finished} == {"a", "b", "c"}


def test_idle_sessions_give_their_blocks_back_before_a_running_sequence_is_parked():
    idle = FakeSeq("idle", 0, 0, held=5)
    h = Harness(8, SchedulerConfig(max_batch=4, step_tokens=1000), idle=[idle])
    h.add(a := FakeSeq("a", 300, 10, piece=512))  # 5 chunks: 3 free blocks, 2 taken back from the idle session
    step = h.step()
    assert step.reclaim == 2 and not step.preempted and idle.held == 3
    h.run()
    assert a in h.finished


def test_an_idle_session_that_runs_again_keeps_its_blocks():
    session = FakeSeq("s", 0, 0, held=4)
    h = Harness(6, SchedulerConfig(max_batch=4, step_tokens=1000), idle=[session])
    session.prompt, session.computed, session.gen = 300, 250, 5  # a new turn: 50 more prompt tokens
    h.scheduler.add(session)
    step = h.step()
    assert step.admitted == [session] and step.reclaim == 0 and session.held == 5


def test_a_bad_configuration_is_refused():
    with pytest.raises(ConfigError, match="must exceed --max-batch"):
        Scheduler(SchedulerConfig(max_batch=64, step_tokens=64), None)
    with pytest.raises(ConfigError, match="max-batch must be >= 1"):
        Scheduler(SchedulerConfig(max_batch=0), None)


@settings(max_examples=60, deadline=None)
@given(st.integers(8, 40), st.integers(1, 8), st.integers(16, 600),
       st.lists(st.tuples(st.integers(1, 700), st.integers(1, 150), st.integers(2, 64), st.integers(0, 3)),
                min_size=1, max_size=12))
def test_every_request_finishes_and_the_pool_is_never_over_committed(n_blocks, max_batch, step_tokens, requests):
    step_tokens = max(step_tokens, max_batch + 1)
    h = Harness(n_blocks, SchedulerConfig(max_batch=max_batch, max_queue=100, step_tokens=step_tokens))
    for i, (prompt, gen, budget, arrive) in enumerate(requests):
        # a sequence never needs more than the pool: its budget, or its whole context, fits
        h.add(FakeSeq(f"s{i}", prompt, gen, piece=128, budget=min(budget, n_blocks)))
        for _ in range(arrive):
            if h.scheduler.has_work:
                h.step()
    h.run()
    assert len(h.finished) == len(requests)
    assert all(s.held == 0 for s in h.seqs) and not h.seqs
