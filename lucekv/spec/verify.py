"""Which drafts a verify forward accepts (algorithms.md §3). Pure functions of the target's output.

Row i of the target's output follows input i of the block [last, d_1 .. d_k]: it decides whether d_(i+1) stands.
Every round emits the accepted drafts and one token of the target's own (the first correction, or the bonus
after the whole draft), so a round never emits fewer tokens than a plain step.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from lucekv.spec.drafter import Draft


class TargetSampler(Protocol):
    """The request's sampler over one verify block's logits (position i: the row after input i). Every token it
    returns or is told to keep joins what later positions' penalties see."""

    def sample(self, i: int) -> int:
        """Position i's token, drawn as plain decoding draws it."""

    def probs(self, i: int) -> np.ndarray:
        """The distribution `sample(i)` draws from, float64 [vocab]."""

    def draw(self, probs: np.ndarray) -> int:
        """A token from `probs` with the request's RNG."""

    def uniform(self) -> float:
        """A uniform [0, 1) number from the request's RNG."""

    def keep(self, token: int) -> None:
        """A draft token was accepted."""


def accept_greedy(draft: Draft, targets: np.ndarray) -> list[int]:
    """The longest prefix of the draft that equals the target's greedy tokens, then the target's next token."""
    a = 0
    while a < len(draft) and draft.tokens[a] == targets[a]:
        a += 1
    return [*draft.tokens[:a], int(targets[a])]


def accept_sampled(draft: Draft, target: TargetSampler) -> list[int]:
    """Sample the target at each position in turn and keep going while its token equals the draft's: the emitted
    tokens are the target's own draws, so their distribution is exactly the target's; for a deterministic draft
    this is the standard rejection rule with a one-hot q (algorithms.md §3.2)."""
    out: list[int] = []
    for i in range(len(draft) + 1):
        token = target.sample(i)
        out.append(token)
        if i == len(draft) or token != draft.tokens[i]:
            break
    return out


def accept_rejection(draft: Draft, target: TargetSampler) -> list[int]:
    """The standard rule for drafts drawn from known distributions q (Leviathan et al. 2023; algorithms.md §3.1):
    d_i stands with probability min(1, p_i(d_i) / q_i(d_i)); the first that does not is replaced by a draw from
    the residual max(p_i - q_i, 0), normalized; after the whole draft, a bonus from p_(k+1). Each emitted token is
    distributed exactly as the target's."""
    out: list[int] = []
    for i, (x, q) in enumerate(zip(draft.tokens, draft.probs, strict=True)):
        p = target.probs(i)
        if q[x] > 0 and target.uniform() * q[x] < p[x]:
            target.keep(x)
            out.append(x)
            continue
        residual = np.maximum(p - q, 0.0)
        out.append(target.draw(residual if residual.sum() > 0 else p))
        return out
    out.append(target.draw(target.probs(len(draft))))
    return out
