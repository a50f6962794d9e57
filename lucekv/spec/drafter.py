"""What every drafter offers the speculator: a proposal from the sequence so far, and learning what was kept."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from lucekv.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    """Tokens proposed to follow the sequence, in order (a chain).

    `probs`: the drafter's distribution q [len(tokens), vocab] each token was drawn from, where it has one; None
    for deterministic proposals (a suffix match), which verification treats as one-hot. `more`: tokens that may
    follow at no cost of the drafter's but that it would not propose by itself (a suffix match's continuation past
    the length its match earns): the speculator takes as many as fill the verify block it pays for (spec.fill)."""

    tokens: list[int] = field(default_factory=list)
    probs: np.ndarray | None = None
    more: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def first(self, n: int) -> Draft:
        """The first n tokens of the draft and its continuation (n <= len(tokens) + len(more))."""
        return Draft((self.tokens + self.more)[:n], None if self.probs is None else self.probs[:n])


class Drafter(Protocol):
    name: str
    cheap: bool  # proposing costs next to nothing: the gate may score its proposals while speculation is off

    def begin(self, tokens: Sequence[int], params: SamplingParams) -> None:
        """A turn starts from `tokens` (the prompt, a session's history included), sampled with `params` (a
        drafter with distributions of its own draws from them where the temperature is above 0)."""

    def propose(self, max_len: int) -> Draft:
        """Up to `max_len` tokens to follow the sequence so far (possibly none)."""

    def accept(self, tokens: Sequence[int]) -> None:
        """`tokens` joined the sequence (a round's accepted drafts and bonus, or one plain step's token)."""

    def end(self) -> None:
        """The turn is over (its tokens are final)."""
