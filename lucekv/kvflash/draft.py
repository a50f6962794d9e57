"""The draft-model scorer: a small model with the target's tokenizer reads the sequence and ranks chunks by where
its last tokens attend (lucebox's drafter scorer, research/lucebox_reference.md §1.6; written anew).

The drafter keeps a whole-context cache of its own (it is small: qwen2.5-coder-0.5b takes 12 KB per token in f16)
and reads the tokens added since its last reading at each reselect, in batched forwards: its hidden states have
seen the whole context, where the target's prompt tail was computed beside the few chunks resident as it went.
Its keys are kept on the host per sealed chunk (read once through the backend's `chunk_keys`), so a reselect's
scoring runs on the host like the other scorers, in the background during decode.

Score of a position: the attention probability the drafter's heads give it, summed over every head of the last two
thirds of its layers and averaged over its last DRAFT_QUERIES queries; smoothed over 13 positions (a needle cut by a
chunk boundary lends its neighbour some); a chunk scores the sum over its positions: the attention mass it draws.
(Lucebox takes the largest probability over heads instead; on qwen2.5-coder-0.5b at 4K, issue 29's diagnosis, the
sum ranked the needles' chunks higher: a multivalue case's four at 0, 11, 2, 1 by the sum of the last query's mass,
1, 20, 2, 3 by the largest.) The first third of the layers is left out as quest leaves it out: its attention is local,
and summed in it spent the budget on the chunks just before the protected tail (a multikey case's best five at a
4K prompt: 19, 61, 33, 59, 60 with it, 19, 33, 1, 39 (needles) and 3 without); 16 queries reach back into the
question, where it names its key (another case's asked needle, two chunks, ranked 8 and 3 by 8 queries of every
layer, 4 and 1 by 16 of the last two thirds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lucekv.kvflash.links import line_breaks
from lucekv.kvflash.pager import CHUNK_TOKENS, Pager

SMOOTH = 13  # positions averaged around each one (lucebox's AvgPool kernel)
DRAFT_QUERIES = 16  # the drafter's last tokens whose attention scores


def first_scored_layer(n_layers: int) -> int:
    """The first layer the attention scorers (quest, draft) read: the first third is positional and local."""
    return n_layers // 3


class DraftReader:
    """A drafter engine's backend reading one sequence at a time, for one owner (a scorer) at a time.

    A sequence is read in steps (the history's lengths at the owner's reselects), each step one batched forward
    of what is new (several where it exceeds the backend's batch). The same steps give bit-identical keys and
    queries, so an owner that finds the drafter holding another sequence, or its own read otherwise, reads its
    steps again from the start: a restored session makes the same reselects as one never interrupted."""

    def __init__(self, engine: Any):
        self.engine = engine  # a lucekv Engine over the whole context (no pool): slot = position
        self.backend = engine.backend
        self.line_breaks = line_breaks(engine.tokenizer.pieces)  # for the second round's lines (kvflash.links)
        spec = engine.spec
        self.owner: object | None = None
        self.steps: list[int] = []  # the lengths read so far, in order
        self.tokens: list[int] = []
        # keys of the sealed chunks, float16 [n_layer, capacity, n_kv_head, head_dim]; grown by doubling, so a
        # background scoring keeps reading the array it was given
        self._keys = np.zeros((spec.n_layer, 0, spec.n_kv_head, spec.head_dim), np.float16)
        self._sealed = 0  # positions whose keys are in _keys (whole chunks)
        self._queries: np.ndarray | None = None  # [rows, n_layer, n_head, head_dim] of the latest step's end

    def read(self, owner: object, history: Sequence[int], steps: list[int]) -> None:
        """Make the drafter hold `history` (its length is steps[-1]) as read in `steps`."""
        if (owner is not self.owner or self.steps != steps[: len(self.steps)]
                or self.tokens != list(history[: len(self.tokens)])):
            self.owner, self.steps, self.tokens, self._sealed = owner, [], [], 0
            self._keys = self._keys[:, :0].copy()  # a scoring under way keeps reading the old array
        for n in steps[len(self.steps) :]:
            self._step(history, n)
            self.steps.append(n)

    def _step(self, history: Sequence[int], n: int) -> None:
        """Read history[:n] on from what is held, the last DRAFT_QUERIES tokens in the last forward (re-read when
        fewer are new): their queries are the scorer's."""
        if n > self.engine.n_ctx:
            raise ValueError(f"the drafter's context of {self.engine.n_ctx} tokens cannot hold {n}")
        start = min(len(self.tokens), max(0, n - DRAFT_QUERIES))
        self.backend.pool.truncate(start)
        del self.tokens[start:]
        self._sealed = min(self._sealed, start // CHUNK_TOKENS * CHUNK_TOKENS)
        batch = self.backend.prefill_chunk
        while start < n:
            end = n if n - start <= batch else min(start + batch, n - DRAFT_QUERIES)
            pos = np.arange(start, end, dtype=np.int32)
            self.backend.forward(np.asarray(history[start:end], np.int32), pos, pos)
            self.tokens.extend(int(t) for t in history[start:end])
            start = end
        self._queries = np.array(self.backend.recent_queries()[-DRAFT_QUERIES:], np.float32)
        sealed = n // CHUNK_TOKENS * CHUNK_TOKENS
        if sealed > self._keys.shape[1]:
            grown = np.zeros((self._keys.shape[0], max(sealed, 2 * self._keys.shape[1]), *self._keys.shape[2:]),
                             np.float16)
            grown[:, : self._sealed] = self._keys[:, : self._sealed]
            self._keys = grown
        for c in range(self._sealed // CHUNK_TOKENS, sealed // CHUNK_TOKENS):
            self._keys[:, c * CHUNK_TOKENS : (c + 1) * CHUNK_TOKENS] = self.backend.chunk_keys(c)
        self._sealed = sealed

    def inputs(self) -> tuple:
        """(queries [rows, n_layer, n_head, d], the sealed chunks' keys [n_layer, sealed, n_kv_head, d], the
        partial chunk's keys [n_layer, rest, n_kv_head, d]) of the latest reading: copies or arrays no later
        reading writes."""
        n = len(self.tokens)
        rest = self.backend.chunk_keys(n // CHUNK_TOKENS)[:, : n % CHUNK_TOKENS].astype(np.float16)
        return self._queries, self._keys[:, : self._sealed], rest


class WithoutAttention:
    """A scorer's part for the target's attention when it reads none of it: sealed keys, decode queries and a new
    prompt's queries change nothing (the lru and draft scorers)."""

    window = 0  # recent queries it ranks against: none

    def seal(self, pager: Pager, chunk: int, keys: np.ndarray) -> None:
        pass

    def observe(self, query: np.ndarray) -> None:
        pass

    def restart(self, queries: np.ndarray) -> None:
        pass


class DraftScorer(WithoutAttention):
    """A Scorer (lucekv.kvflash.policy) that reads the sequence's tokens through a drafter. Its state is the steps
    its reader took (a restored session reads them again)."""

    name = "draft"

    def __init__(self, reader: DraftReader, history: Callable[[], Sequence[int]]):
        self.reader = reader
        self.history = history  # the sequence's tokens so far
        self.steps: list[int] = []
        self._last: tuple[int, np.ndarray] | None = None  # (steps taken, their scores): a prompt's second round

    def truncate(self, n_tokens: int) -> None:
        """The sequence was cut to n_tokens: steps past it read tokens that are gone."""
        self.steps = [n for n in self.steps if n <= n_tokens]
        self._last = None

    def score_inputs(self, pager: Pager, queries: np.ndarray | None = None) -> tuple | None:
        n = pager.n_tokens
        if n == 0:
            return None
        if not self.steps or self.steps[-1] != n:
            self.steps.append(n)
        if self._last is not None and self._last[0] == len(self.steps):
            return self._last  # nothing read since: the same scores
        self.reader.read(self, self.history(), self.steps)
        return (len(self.steps), *self.reader.inputs())

    def score(self, inputs: tuple) -> np.ndarray:
        if len(inputs) == 2:
            return inputs[1]
        steps, queries, sealed, rest = inputs
        token = token_scores(queries, sealed, rest)
        scores = np.add.reduceat(token, np.arange(0, len(token), CHUNK_TOKENS))
        self._last = (steps, scores)
        return scores

    def scores(self, pager: Pager) -> np.ndarray | None:
        inputs = self.score_inputs(pager)
        return None if inputs is None else self.score(inputs)

    def state(self) -> dict:
        return {"steps": list(self.steps)}

    def load_state(self, state: dict) -> None:
        """Raises ValueError unless the steps are increasing positive lengths."""
        steps = [int(n) for n in state["steps"]]
        if any(n <= 0 for n in steps) or any(a >= b for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError(f"draft scorer steps {steps[:8]} are not increasing positive lengths")
        self.steps, self._last = steps, None


def token_scores(queries: np.ndarray, sealed: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """Per position of the read sequence (DraftReader.inputs): the attention probability the drafter's heads give it,
    summed over the heads of the scored layers, averaged over the queries, smoothed over SMOOTH positions (float64)."""
    rows, n_layer, n_head, d = queries.shape
    n = sealed.shape[1] + rest.shape[1]
    n_kv = sealed.shape[2]
    mass = np.zeros((rows, n), np.float32)  # per query and position: the probability summed over heads
    for layer in range(first_scored_layer(n_layer), n_layer):
        k = np.concatenate([sealed[layer], rest[layer]]).astype(np.float32).transpose(1, 2, 0)  # [n_kv, d, n]
        q = queries[:, layer].reshape(rows, n_kv, n_head // n_kv, d).transpose(1, 2, 0, 3)  # [n_kv, g, rows, d]
        p = (q.reshape(n_kv, -1, d) @ k).reshape(n_head, rows, n)  # logits, BLAS; softmax in place
        for r in range(rows - 1):  # query r sits at position n - rows + r: what follows is not visible
            p[:, r, n - rows + r + 1 :] = -np.inf
        p -= p.max(axis=-1, keepdims=True)
        p *= np.float32(1 / np.sqrt(d))
        np.exp(p, out=p)
        p /= p.sum(axis=-1, keepdims=True)
        mass += p.sum(axis=0)
    return np.convolve(mass.mean(axis=0, dtype=np.float64), np.ones(SMOOTH) / SMOOTH, mode="same")
