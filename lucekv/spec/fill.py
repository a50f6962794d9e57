"""How long a round's chain draft is: it fills the verify forward it pays for.

A backend pads a verify block to the width of a forward it keeps (`verify_width` of the backends: CUDA replays the
graphs of widths 4, 8, 12, ...; the CPU runs any width as it is), so a block of k + 1 tokens costs what one of
verify_width(k + 1) costs. A drafter that can continue its draft at no cost of its own (`Draft.more`: the suffix
match's continuation) fills that block. The drafter's own length stays the anchor (a longer match is likelier to
go on); the only alternatives are the block one width wider, where the continuation reaches it, and where the drafts
cannot fill their block (the longest draft spilling into a wider forward, a continuation that ends) the block one
width narrower (never below one draft: turning speculation off is the gate's call). Of these, the one that pays most
expected tokens per second:

    E(L) / t(verify_width(L + 1)),  E(L) = 1 + a + a^2 + ... + a^L,

the tokens a round of L drafts emits when each draft stands with chance `a` once the one before it did (`Acceptance`:
the turn's own rate) and t the round's measured time at that width (the engine's StepClock; an unmeasured width
takes StepClock.round's stand-in, so an untried wider one is tried once and then judged by its own time). Without
a measured time for the anchor's width the block is only filled: that costs nothing more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lucekv.spec.drafter import Draft


@dataclass
class Acceptance:
    """The chance that a draft token stands once the one before it did: accepted / (accepted + rejections), from the
    turn's rounds (a round's draft stops at its first rejection), with one of each as the prior."""

    accepted: int = 1
    rejected: int = 1

    def add(self, drafted: int, accepted: int) -> None:
        self.accepted += accepted
        self.rejected += accepted < drafted

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def expected_tokens(self, drafts: int) -> float:
        """What a round of `drafts` emits on average (its own token included)."""
        a = self.rate
        return sum(a**i for i in range(drafts + 1))


def fill(draft: Draft, verify_width: Callable[[int], int], seconds: Callable[[int], float | None],
         acceptance: Acceptance) -> Draft:
    """The draft at the length that pays most (module doc): `verify_width(n)`, the width a block of n tokens runs as;
    `seconds(w)`, a round's measured time at width w (None: not measured)."""
    if not draft.tokens:
        return draft
    available = len(draft) + len(draft.more)
    width = verify_width(len(draft) + 1)
    anchor = min(available, width - 1)  # the drafter's block, filled
    if seconds(width) is None:
        return draft.first(anchor)
    lengths = [anchor]
    if anchor < width - 1:  # drafts that cannot fill their block: the narrower one's may pay more
        narrowest = anchor + 1  # the least block of this width
        while narrowest > 2 and verify_width(narrowest - 1) == width:
            narrowest -= 1
        if narrowest > 2:
            lengths.append(verify_width(narrowest - 1) - 1)
    if available > anchor:
        lengths.append(min(available, verify_width(width + 1) - 1))

    def pays(n: int) -> float:
        t = seconds(verify_width(n + 1))
        return acceptance.expected_tokens(n) / t if t else 0.0

    return draft.first(max(lengths, key=pays))  # the first best: the anchor on a tie
