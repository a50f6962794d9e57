"""One turn's speculation: the round (propose → verify → accept → keep), the drafter fed with every token that
joins the sequence, the gate timed, the counts for Usage.

The target is the engine's sequence (`Target`): a verify forward writes the K/V of the last token and the drafts
to pool slots like any tokens (DESIGN §4); `keep` then cuts the sequence after the accepted ones, and the
rejected drafts' slots fall out of view by position until rewritten. The round never sees the pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from lucekv.engine.sampling import SamplingParams
from lucekv.spec.drafter import Draft, Drafter
from lucekv.spec.fill import Acceptance, fill
from lucekv.spec.gate import Gate, StepClock, context_bucket
from lucekv.spec.tree import DraftTree, accept_tree_greedy, accept_tree_sampled
from lucekv.spec.verify import TargetSampler, accept_greedy, accept_rejection, accept_sampled

HostSampling = Callable[[np.ndarray], TargetSampler]  # the request's sampler over a verify block's logits


class Target(Protocol):
    def verify_greedy(self, tokens: list[int], start: int, tree: DraftTree | None = None) -> np.ndarray:
        """The greedy token after each of `tokens` (written at positions start, start + 1, ...), int32 [n]; it may
        stop after the first that differs from the next draft (the rest would be rejected anyway). With `tree`,
        tokens are its verify block (lucekv.spec.tree), in one forward."""

    def verify_logits(self, tokens: list[int], start: int, tree: DraftTree | None = None) -> np.ndarray:
        """The logits after each of `tokens`, float32 [n, vocab], read by row index (`[i]`) in increasing order or
        by a leading slice (`[:k]`): a target may compute rows as they are first read. `tree`: as verify_greedy."""

    def tree_width(self, start: int) -> int:
        """The most tokens a tree's verify block from `start` may hold (it is one forward)."""

    def keep(self, start: int, path: list[int]) -> None:
        """The sequence from `start` on is the verify block's tokens at indices `path` (increasing, from 0), in that
        order; later positions are out of view. A chain keeps a prefix (path j = j); a tree moves its accepted
        nodes' K/V to their positions."""


@dataclass
class Block:
    """The tokens of one round (accepted drafts, then the target's own), and for host verification the logits
    each was sampled from (row i for token i)."""

    tokens: list[int]
    logits: np.ndarray | None = None


@dataclass
class SpecUsage:
    mode: str  # the request's mode: "suffix", "auto", ...
    drafter: str
    rounds: int = 0
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, accepted (each round also emits one token of the target's own)
    plain_steps: int = 0  # steps decoded without a round
    round_seconds: float = 0.0  # wall time of the rounds, each from the end of the step before (the gate's measure)
    verify_seconds: float = 0.0  # of it, in the target's verify forwards (the device's work and the backend's)
    gate_decisions: list[tuple[int, bool]] = field(default_factory=list)  # (output tokens so far, speculating)


class Speculator:
    """`gate` None: speculate every step (a forced mode). `max_draft`: the longest draft a round verifies. `clock`: the
    engine's measured times (the gates' clock: the rounds of auto turns), which the draft length reads; `verify_width`:
    the backend's width of a verify block of n tokens (its padding), by which rounds are timed and drafts filled
    (spec.fill). `timer`: seconds now (a simulation passes its own).

    Only gated rounds are timed into the clock: a forced turn's rounds run whatever they cost, and timed beside other
    sequences' work in a shared step (a round's time runs from the end of the request's step before) they would
    misjudge auto turns' rounds."""

    def __init__(self, mode: str, drafter: Drafter, gate: Gate | None, max_draft: int, clock: StepClock,
                 verify_width: Callable[[int], int], timer: Callable[[], float] = time.perf_counter):
        self.drafter = drafter
        self.gate = gate
        self.max_draft = max_draft
        self.clock = clock
        self.verify_width = verify_width
        self.acceptance = Acceptance()
        self.usage = SpecUsage(mode, drafter.name)
        self._timer = timer
        self._mark = timer()
        self._shadow: tuple[list[int], int] | None = None  # a plain-decoding stretch scored as a round: (draft, hits)

    @property
    def speculating(self) -> bool:
        return self.gate is None or self.gate.speculating

    def begin(self, prompt: list[int], first: int, params: SamplingParams) -> None:
        """The turn's prompt and its first token (sampled from the prefill's logits)."""
        self.drafter.begin(prompt, params)
        self.drafter.accept([first])
        self._mark = self._timer()

    def round(self, target: Target, last: int, position: int, budget: int, at: int,
              host: HostSampling | None = None) -> Block:
        """Propose after `last` (at `position`, not yet forwarded), verify in one target forward, keep the accepted.
        At most `budget` tokens come out; `at`: output tokens so far. Greedy on the device when `host` is None,
        else on the host with the request's sampler: the rejection rule where the drafter gave its distributions,
        sample-and-match where its drafts are deterministic."""
        draft = self._propose(self.max_draft_for(budget), position)
        tree = None
        if isinstance(draft, DraftTree):  # its first nodes are a tree too (parents come first), and the best ones
            tree = draft.prefix(target.tree_width(position) - 1)
            draft, tree = (Draft(tree.tokens), None) if tree.is_chain else (tree, tree)  # a chain verifies as one
        inputs = [last, *draft.tokens]
        u = self.usage
        t_verify = self._timer()
        verify = target.verify_greedy if host is None else target.verify_logits
        verified = verify(inputs, position, tree)
        u.verify_seconds += self._timer() - t_verify
        if tree is not None:
            path, tokens = (accept_tree_greedy(tree, verified) if host is None
                            else accept_tree_sampled(tree, verified, host))
        else:
            if host is None:
                tokens = accept_greedy(draft, verified)
            else:
                tokens = (accept_sampled if draft.probs is None else accept_rejection)(draft, host(verified))
            path = list(range(len(tokens)))  # the block indices of `last` and the accepted drafts
            self.acceptance.add(len(draft), len(tokens) - 1)
        logits = None if host is None else np.stack([verified[j] for j in path])
        target.keep(position, path)
        self.drafter.accept(tokens)
        u.rounds += 1
        u.drafted += len(draft)
        u.accepted += len(tokens) - 1
        seconds = self._lap()
        u.round_seconds += seconds
        if self.gate is not None:  # (it times the round into the clock, by the width it ran as)
            self.gate.real_round(seconds, self.verify_width(len(inputs)), len(tokens), position, at)
        return Block(tokens, logits)

    def _propose(self, max_len: int, position: int) -> Draft | DraftTree:
        """The drafter's proposal for a round at `position`, a chain filled to the length that pays (spec.fill)."""
        draft = self.drafter.propose(max_len)
        if isinstance(draft, DraftTree):
            return draft
        bucket = context_bucket(position)
        return fill(draft, self.verify_width, lambda width: self.clock.round(bucket, width), self.acceptance)

    def max_draft_for(self, budget: int) -> int:
        """The longest draft a round may propose when `budget` more tokens may come out (a round emits one more)."""
        return min(self.max_draft, budget - 1)

    def plain(self, token: int, position: int, at: int) -> None:
        """A plain decode step's token joined the sequence at `position`: time the step, score the shadow round."""
        self.drafter.accept([token])
        self.usage.plain_steps += 1
        seconds = self._lap()
        if self.gate is None:
            return
        self.gate.plain_step(seconds, position)
        if not self.drafter.cheap:
            return
        if self._shadow is not None:
            draft, hits = self._shadow
            if hits < len(draft) and draft[hits] == token:
                self._shadow = (draft, hits + 1)
                return
            self.acceptance.add(len(draft), hits)
            self.gate.shadow_round(self.verify_width(len(draft) + 1), hits + 1, position, at)
        self._shadow = (self._propose(self.max_draft, position).tokens, 0) if not self.gate.speculating else None

    def end(self) -> SpecUsage:
        self.drafter.end()
        if self.gate is not None:
            self.usage.gate_decisions = list(self.gate.decisions)
        return self.usage

    def _lap(self) -> float:
        now = self._timer()
        seconds, self._mark = now - self._mark, now
        return seconds
