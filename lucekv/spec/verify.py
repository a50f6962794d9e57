"""Which drafts a verify forward accepts (algorithms.md §3). Pure functions of the target's output.

Row i of the target's output follows input i of the block [last, d_1 .. d_k]: it decides whether d_(i+1) stands.
Every round emits the accepted drafts and one token of the target's own (the first correction, or the bonus
after the whole draft), so a round never emits fewer tokens than a plain step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lucekv.spec.drafter import Draft


def accept_greedy(draft: Draft, targets: np.ndarray) -> list[int]:
    """The longest prefix of the draft that equals the target's greedy tokens, then the target's next token."""
    a = 0
    while a < len(draft) and draft.tokens[a] == targets[a]:
        a += 1
    return [*draft.tokens[:a], int(targets[a])]


def accept_sampled(draft: Draft, logits: np.ndarray, sample: Callable[[np.ndarray, int], int]) -> list[int]:
    """Sample the target at each position in turn and keep going while its token equals the draft's: the emitted
    tokens are the target's own draws, so their distribution is exactly the target's; for a deterministic draft
    this is the standard rejection rule with a one-hot q (algorithms.md §3.2)."""
    out: list[int] = []
    for i, row in enumerate(logits):
        token = sample(row, i)
        out.append(token)
        if i == len(draft) or token != draft.tokens[i]:
            break
    return out
