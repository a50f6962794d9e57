"""The scheduler: which sequences share the next step (DESIGN §10). Pure bookkeeping, no model code.

A step is formed, as vLLM v1 forms one, from
1. the running sequences, oldest first: one decode token each (a verify block of several when speculating), or
   the next piece of a prompt that is being prefilled, while the step's token budget lasts;
2. then waiting requests, first in first out, while the batch has room (`max_batch`), the budget lasts and the
   block pool has what they need; the first that does not fit ends admission (nobody overtakes it).
Each scheduled sequence reserves the pool blocks its work may borrow (`blocks_wanted`) out of the free blocks and
those idle sequences hold, which are taken back before the step (`Step.reclaim`, least recently used first: the
engine's part). When a running sequence's blocks do not fit, the youngest running sequence is parked to host
(`Step.preempted`): it waits again at the head of the queue and resumes later with all it had.

The token budget is soft: a prompt piece starts while fewer than `step_tokens` tokens are scheduled, so a step holds
at most one piece more. Pieces are the sequence's own (`next_work`): the scheduler decides when a piece runs, never
its length, so a prompt is computed in the same pieces alone as in a batch, and gives the same numbers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from lucekv.errors import ConfigError, ResourceLimitError


class QueueFullError(ResourceLimitError):
    """Every place in the request queue is taken."""


class Schedulable(Protocol):
    """A request's sequence, as the scheduler sees it."""

    def next_work(self) -> tuple[int, int, bool]:
        """(first position, tokens, whether it is a prompt piece) of its next forward."""

    def blocks_wanted(self, end: int) -> int:
        """Pool blocks it may borrow until it holds positions below `end` (recalls of a return included)."""

    @property
    def held_blocks(self) -> int: ...


class BlockLedger(Protocol):
    """The block pool as the scheduler sees it."""

    @property
    def free_blocks(self) -> int: ...

    @property
    def reclaimable_blocks(self) -> int:
        """Blocks held by sequences that are not running (idle sessions, queued requests): taken back on demand."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 64  # sequences in one step
    max_queue: int = 64  # requests waiting for a place in the batch
    step_tokens: int = 512  # tokens per step (soft: one prompt piece may go past it)

    def check(self) -> None:
        if self.max_batch < 1 or self.max_queue < 0:
            raise ConfigError(f"--max-batch must be >= 1 and --max-queue >= 0 (got {self.max_batch}, "
                              f"{self.max_queue})")
        if self.step_tokens <= self.max_batch:
            raise ConfigError(f"a step's token budget ({self.step_tokens}) must exceed --max-batch "
                              f"({self.max_batch}): decode rows alone would leave prompts no room")


@dataclass(frozen=True, eq=False)
class Work:
    seq: Schedulable
    start: int  # first position
    n: int  # tokens
    prefill: bool  # a prompt piece; else a decode token (or a verify block)


@dataclass
class Step:
    works: list[Work] = field(default_factory=list)  # the running sequences' first, oldest first, then the admitted
    admitted: list[Schedulable] = field(default_factory=list)  # (re)entered the batch: resume them first
    preempted: list[Schedulable] = field(default_factory=list)  # park these to host first
    reclaim: int = 0  # then take this many blocks back from idle sequences

    @property
    def tokens(self) -> int:
        return sum(w.n for w in self.works)


class Scheduler:
    def __init__(self, config: SchedulerConfig, ledger: BlockLedger):
        config.check()
        self.config = config
        self.ledger = ledger
        self.waiting: deque[Schedulable] = deque()
        self.running: list[Schedulable] = []  # oldest admission first

    def check_room(self, extra: int = 1) -> None:
        """Raise QueueFullError unless `extra` more requests fit the queue (places in the batch do not count)."""
        room = max(0, self.config.max_batch - len(self.running))
        if len(self.waiting) + extra > self.config.max_queue + room:
            raise QueueFullError(f"all {self.config.max_queue} places in the request queue are taken; retry later")

    def add(self, seq: Schedulable) -> None:
        """Queue a new request; QueueFullError when the queue is full."""
        self.check_room()
        self.waiting.append(seq)

    def requeue(self, seq: Schedulable) -> None:
        """Queue a request that was counted against the queue already (it waited elsewhere), at the head."""
        self.waiting.appendleft(seq)

    def remove(self, seq: Schedulable) -> None:
        """The request ended (finished or cancelled), running or waiting."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> Step:
        step = Step()
        free = self.ledger.free_blocks
        avail = free + self.ledger.reclaimable_blocks  # what this step may reserve
        reserved = 0
        tokens = 0
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            start, n, prefill = seq.next_work()
            if prefill and tokens >= self.config.step_tokens:
                i += 1  # its piece waits for a step with room
                continue
            need = seq.blocks_wanted(start + n)
            while need > avail - reserved:  # park the youngest running sequence, which may be this one
                victim = self.running.pop()
                step.preempted.append(victim)
                self.requeue(victim)
                avail += victim.held_blocks
                free += victim.held_blocks
                if victim is seq:
                    break
            if seq in step.preempted:
                break
            step.works.append(Work(seq, start, n, prefill))
            reserved += need
            tokens += n
            i += 1
        while self.waiting and len(self.running) < self.config.max_batch and self.waiting[0] not in step.preempted:
            seq = self.waiting[0]
            start, n, prefill = seq.next_work()
            if prefill and tokens >= self.config.step_tokens:
                break
            # its own blocks stop being reclaimable: the pool cannot take them back from a running sequence
            need = seq.blocks_wanted(start + n)
            if need > avail - seq.held_blocks - reserved:
                break
            self.waiting.popleft()
            self.running.append(seq)
            step.admitted.append(seq)
            step.works.append(Work(seq, start, n, prefill))
            avail -= seq.held_blocks
            reserved += need
            tokens += n
        step.reclaim = max(0, reserved - free)
        return step
