"""Greedy decode steps enqueued ahead of reading their tokens (the engine's run-ahead decode).

While the host turns token i into text, checks stops and feeds the pager, the device can already run the step
that consumes token i: a step enqueued with `token=None` takes the argmax of the step before it, without the
host in between. `RunAhead` is the plain form, for backends whose forward is synchronous: each step runs
when it is enqueued. The CUDA backend only enqueues a graph replay, so its host work overlaps the GPU's.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class RunAhead:
    """decode_ahead / next_token on top of `forward` (a backend mixin; call `__init__`)."""

    def __init__(self) -> None:
        self._ahead: deque[int] = deque()  # tokens of the steps enqueued and not yet taken, oldest first
        self._ahead_last: int | None = None  # the latest enqueued step's token

    def decode_ahead(self, position: int, slot: int, token: int | None = None, table: np.ndarray | None = None
                     ) -> None:
        """Enqueue the one-token step of `token` at `position` (K/V into `slot`, attending over the blocks of `table`,
        see `forward`), greedy; token=None: the token of the step enqueued before it (which must exist)."""
        if token is None:
            token = self._ahead_last
        one = np.array([token], np.int32), np.array([position], np.int32), np.array([slot], np.int32)
        logits = self.forward(*one, all_logits=True, tables=None if table is None else [table])  # a decode step
        self._ahead_last = int(np.argmax(logits[-1][: self.spec.vocab_size]))
        self._ahead.append(self._ahead_last)

    def next_token(self) -> int:
        """The greedy token of the oldest enqueued step not taken yet (waits for it)."""
        return self._ahead.popleft()

    def discard_ahead(self) -> None:
        """Forget the steps enqueued and not taken (a step failed: what they computed is not used)."""
        self._ahead.clear()
