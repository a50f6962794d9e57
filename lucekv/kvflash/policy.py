"""Residency policies: which chunks deserve the pool's blocks (DESIGN §4, research/algorithms.md §5.11).

A scorer keeps small per-chunk key summaries, written when a chunk is sealed (its last position written,
while it is still tail-protected and resident) and stored in the pager's `summaries`, and a window of recent
post-RoPE queries. `scores` ranks every materialized chunk; higher keeps. Scoring never reads the host store.

Shapes: keys of a sealed chunk [n_layers, chunk, n_kv_head, head_dim]; a query [n_layers, n_head, head_dim],
for the same scored layers (a backend may score a subset of its pooled layers).

A reselect during decode is scored in the background: its inputs (the query window, the summary tables as they
are) are taken when it is due, the scoring runs on a thread while decoding goes on, and its moves are made a
fixed number of decoded tokens later (`reselect_lag`), whatever the thread's speed: the residency, and so the
tokens, are the same on any machine. (At 128K context quest scores an 8B model's ~2000 chunks in 150-200 ms on
an H200 machine's CPU: 1.2-1.6% of decode time when decoding waited for it.)
"""

from __future__ import annotations

import base64
import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np

from lucekv.errors import ConfigError
from lucekv.kvflash.draft import DRAFT_QUERIES, DraftReader, DraftScorer, WithoutAttention, first_scored_layer
from lucekv.kvflash.links import SequenceLinks
from lucekv.kvflash.pager import UNSCORED, Move, Pager, scores_from_text, scores_text

POLICIES = ("lru", "quest", "meankey", "draft")
MISSING = -np.inf  # a sealed chunk without a summary ranks last
SCORE_THREADS = min(8, os.cpu_count() or 1)  # threads scoring a reselect's chunks
SCORE_BLOCK = 32  # chunks per scoring matmul: small temporaries (4.5 MiB for quest at 8B's shape), reused
HISTORY_PER_TAU = 45  # tau_eff = max(tau, history/45) keeps rescoring near 15% of decode time (lucebox §1.7)
RESELECT_LAG = 64  # at most this many decoded tokens from a reselect's inputs to its moves (~250 ms on an H200)
_SCORING = ThreadPoolExecutor(1, thread_name_prefix="kv-score")  # reselects scored while decoding goes on


class Scorer(Protocol):
    name: str
    window: int  # how many recent queries `scores` ranks against

    def seal(self, pager: Pager, chunk: int, keys: np.ndarray) -> None: ...

    def observe(self, query: np.ndarray) -> None: ...

    def score_inputs(self, pager: Pager, queries: np.ndarray | None = None) -> Any | None:
        """What `score` reads, taken now, or None when there is nothing to score against yet; `queries` [rows,
        n_layers, n_head, head_dim] (a prompt's) instead of the window. The pager goes on changing while a
        background reselect is scored: summary rows of chunks sealed by then are written once."""

    def restart(self, queries: np.ndarray) -> None:
        """A new prompt: its last queries [rows, n_layers, n_head, head_dim] replace the window (a previous turn's
        decode queries would rank chunks for what was asked then)."""

    def truncate(self, n_tokens: int) -> None:
        """The sequence was cut to n_tokens (a session rewound)."""

    def score(self, inputs: Any) -> np.ndarray:
        """float64 [the pager's n_chunks at `score_inputs`]; thread-safe (reads only `inputs`)."""

    def scores(self, pager: Pager) -> np.ndarray | None:
        """`score(score_inputs(pager))`, now."""

    def state(self) -> dict:
        """JSON-safe state beyond the pager's summaries (for snapshots); `load_state` takes it back."""

    def load_state(self, state: dict) -> None: ...


class _ScoresNow:
    def scores(self, pager: Pager) -> np.ndarray | None:
        inputs = self.score_inputs(pager)
        return None if inputs is None else self.score(inputs)

    def truncate(self, n_tokens: int) -> None:
        pass


class LruScorer(_ScoresNow, WithoutAttention):
    """Least recently written or recalled goes first."""

    name = "lru"

    def score_inputs(self, pager: Pager, queries: np.ndarray | None = None) -> np.ndarray:
        return pager.last_use[: pager.n_chunks].astype(np.float64)

    def score(self, inputs: np.ndarray) -> np.ndarray:
        return inputs

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


class _QueryWindow:
    """The last `size` queries, grouped by KV head: [R, n_layers, n_kv_head, group, head_dim] float32."""

    def __init__(self, n_kv_head: int, size: int):
        self.n_kv_head = n_kv_head
        self._ring: deque[np.ndarray] = deque(maxlen=size)

    def restart(self, queries: np.ndarray) -> None:
        """The window becomes the last of `queries` [rows, n_layers, n_head, head_dim] that fit."""
        self._ring.clear()
        for q in queries[-self._ring.maxlen :]:
            self.push(q)

    def grouped(self, queries: np.ndarray) -> np.ndarray:
        """[rows, n_layers, n_head, head_dim] as `stacked` gives the window: [rows, n_layers, n_kv_head, group, d]."""
        r, n_layers, n_head, d = queries.shape
        return np.asarray(queries, np.float32).reshape(r, n_layers, self.n_kv_head, -1, d)

    def push(self, query: np.ndarray) -> None:
        n_layers, n_head, head_dim = query.shape
        # a copy: a backend may hand out the buffer its next forward overwrites
        self._ring.append(np.array(query, np.float32).reshape(n_layers, self.n_kv_head, -1, head_dim))

    def stacked(self) -> np.ndarray | None:
        return np.stack(self._ring) if self._ring else None

    def state(self) -> dict:
        shape = list(self._ring[0].shape) if self._ring else []
        return {"shape": shape, "queries": [base64.b64encode(q.tobytes()).decode() for q in self._ring]}

    def load_state(self, state: dict) -> None:
        """Raises ValueError if the queries do not have one shape of this window's KV heads."""
        shape, queries = tuple(state["shape"]), state["queries"]
        if queries and (len(shape) != 4 or shape[1] != self.n_kv_head or len(queries) > self._ring.maxlen):
            raise ValueError(f"query window of {len(queries)} x {shape} does not fit {self.n_kv_head} KV heads")
        self._ring.clear()
        for text in queries:
            self._ring.append(np.frombuffer(base64.b64decode(text, validate=True), np.float32).reshape(shape))


class _QueryScorer(_ScoresNow):
    """A scorer that ranks sealed chunks against a window of recent queries."""

    def __init__(self, n_kv_head: int, window: int = 8):
        self.window = window
        self._queries = _QueryWindow(n_kv_head, window)

    def observe(self, query: np.ndarray) -> None:
        self._queries.push(query)

    def restart(self, queries: np.ndarray) -> None:
        self._queries.restart(queries)

    def state(self) -> dict:
        return {"window": self._queries.state()}

    def load_state(self, state: dict) -> None:
        self._queries.load_state(state["window"])

    def _inputs(self, pager: Pager, queries: np.ndarray | None, *summaries: str) -> tuple | None:
        """(recent queries or `queries`, sealed chunk ids, scores preset to MISSING, the summary tables); None
        without queries."""
        q = self._queries.stacked() if queries is None else self._queries.grouped(queries)
        if q is None:
            return None
        n = pager.n_chunks
        tables = [pager.summaries.table(name, n) for name in summaries]
        return q, np.flatnonzero(tables[0][1]), np.full(n, MISSING), *(table for table, _ in tables)


class BoundScorer(_QueryScorer):
    """Quest-style upper bound: per chunk, layer, KV head and 16-token sub-page, the per-dimension min and
    max of the keys; a query's best possible logit in the sub-page is sum_i max(q_i*min_i, q_i*max_i).
    Per (layer, head) the bound becomes a log attention share over chunks; a chunk scores the log of its
    shares summed over heads and layers: the attention mass it could draw in all. (Its best single share
    ranked early chunks first: a few position-bound heads give them a large share whatever the query. NIAH
    on smollm2 at 4K, 12.5% residency, 11 depths: 9/11 with the best share, 11/11 with the mass.)

    The first third of the layers is not scored (as Quest leaves its first layers dense): their attention is
    positional and local, and summed in it pushed retrieved chunks down. Issue 29's diagnosis, qwen2.5-coder-0.5b
    at 4K, the prompt's last 16 queries: a multivalue case's four needle chunks ranked 9, 24, 2, 14 among 59 with
    every layer, 4, 11, 1, 8 without the first 8 of 24; a multikey case's two 14, 7 and 7, 5."""

    name = "quest"

    def __init__(self, n_kv_head: int, subpage: int = 16, window: int = 8, block: int = SCORE_BLOCK):
        super().__init__(n_kv_head, window)
        self.subpage = subpage
        self.block = block  # chunks scored per matmul

    def seal(self, pager: Pager, chunk: int, keys: np.ndarray) -> None:
        keys = keys[first_scored_layer(len(keys)) :]
        n_layers, t, n_kv, d = keys.shape
        # reduce over the tokens of a sub-page in the keys' own layout (rows of n_kv*d contiguous values) and
        # dtype (min and max are exact), then reorder the small results to [layers, kv heads, sub-pages, d]
        sub = keys.reshape(n_layers, t // self.subpage, self.subpage, n_kv, d)
        # float32, as the scores' matmuls take them: no conversion per reselect (twice the bytes of float16)
        pager.summaries.put("quest.kmin", chunk, sub.min(axis=2).transpose(0, 2, 1, 3).astype(np.float32))
        pager.summaries.put("quest.kmax", chunk, sub.max(axis=2).transpose(0, 2, 1, 3).astype(np.float32))

    def score_inputs(self, pager: Pager, queries: np.ndarray | None = None) -> tuple | None:
        return self._inputs(pager, queries, "quest.kmin", "quest.kmax")

    def score(self, inputs: tuple) -> np.ndarray:
        q, sealed, out, kmin, kmax = inputs
        if len(sealed) == 0:
            return out
        q = q[:, first_scored_layer(q.shape[1]) :]
        r, n_layers, n_kv, g, d = q.shape
        # [layers, kv heads, 1, d, R*group], against each (layer, head, sub-page)'s [chunks, d] rows of the tables
        # as they are stored: one matmul each, on strided views (no gather, transpose or conversion of the tables;
        # rows of unsealed chunks are scored too and dropped)
        q = q.transpose(1, 2, 4, 0, 3).reshape(n_layers, n_kv, 1, d, r * g)
        qp, qn = np.maximum(q, 0), np.minimum(q, 0)
        n = len(kmax)
        bound = np.empty((n, n_layers, n_kv), np.float32)
        _in_threads(partial(_quest_bound, kmin, kmax, qp, qn, bound, self.block), n, self.block)
        bound = bound[sealed] / np.sqrt(d)
        share = bound - _logsumexp(bound, axis=0)
        out[sealed] = _logsumexp(share.reshape(len(sealed), -1), axis=1)[:, 0]
        return out


class MeanKeyScorer(_QueryScorer):
    """Cosine between recent queries and each chunk's L2-normalized mean key: per layer the best q-head and
    query, then the mean over layers (lucebox's target-QK scorer)."""

    name = "meankey"

    def seal(self, pager: Pager, chunk: int, keys: np.ndarray) -> None:
        keys = np.asarray(keys, np.float32)  # no copy of keys that are float32 already
        pager.summaries.put("meankey.kmean", chunk, _unit(keys.mean(axis=1)))  # float32, as quest

    def score_inputs(self, pager: Pager, queries: np.ndarray | None = None) -> tuple | None:
        return self._inputs(pager, queries, "meankey.kmean")

    def score(self, inputs: tuple) -> np.ndarray:
        q, sealed, out, kmean = inputs
        if len(sealed):
            r, n_layers, n_kv, g, d = q.shape
            q = _unit(q).transpose(1, 2, 4, 0, 3).reshape(n_layers, n_kv, d, r * g)
            best = np.empty((n_layers, len(kmean)), np.float32)  # per layer the best q-head and query
            _in_threads(partial(_meankey_best, kmean, q, best, SCORE_BLOCK), len(kmean), SCORE_BLOCK)
            out[sealed] = best.mean(axis=0)[sealed]
        return out


def reselect(pager: Pager, scores: np.ndarray) -> list[Move]:
    """Keep the protected chunks and the highest-scoring others that fit; page-outs come before page-ins.
    Ties prefer the chunk already resident (no thrash), then the more recent. The scores stay with the pager
    to pick victims when later writes need a block."""
    n = pager.n_chunks
    scores = np.where(np.isnan(scores), MISSING, scores)  # a NaN (from inf keys) must not sort as the best
    scores = np.concatenate([scores, np.full(n - len(scores), UNSCORED)])  # chunks newer than a background scoring
    protected = pager.protected_mask()
    cand = np.flatnonzero(~protected)
    budget = pager.n_blocks - int(protected.sum())
    resident = pager.block_of[:n] >= 0
    order = np.lexsort((pager.last_use[cand], resident[cand], scores[cand]))[::-1]
    keep = protected.copy()
    keep[cand[order[:budget]]] = True
    pager.set_scores(scores)
    return pager.apply_residency(keep)


@dataclass
class _PendingReselect:
    scores: Future  # of the scorer's float64 scores
    due_in: int  # decoded tokens until its moves are made


class Policy:
    """A scorer and its reselect schedule: every tau_eff = max(tau, history/45) decoded tokens a reselect starts,
    scored in the background; its moves are made `reselect_lag` decoded tokens later.

    With `links` (the sequence's n-gram index, kvflash.links) every reselect has a second round: first the chunks
    the latest DRAFT_QUERIES tokens (the question) name and the chains linked to their lines, then the scorer's best
    chunk, then the chunks sharing the rarest text with the question, then the scorer's order. The draft policy has
    it. The index is no part of `state`: a restored policy indexes the sequence's tokens again, to the same index."""

    def __init__(self, scorer: Scorer, tau: int = 64, links: SequenceLinks | None = None):
        if tau <= 0:
            raise ConfigError(f"kv reselect interval tau must be positive, not {tau}")
        self.scorer = scorer
        self.tau = tau
        self.links = links
        self._decoded_since = 0
        self._pending: _PendingReselect | None = None

    def state(self) -> dict:
        """JSON-safe: the scorer's name and state, the reselect schedule's count and a reselect under way (its
        scores, waited for: a restored sequence makes the same moves at the same token)."""
        pending = self._pending and {"scores": scores_text(self._pending.scores.result()),
                                     "due_in": self._pending.due_in}
        return {"policy": self.scorer.name, "decoded_since": self._decoded_since, "scorer": self.scorer.state(),
                "pending": pending}

    def load_state(self, state: dict) -> None:
        """Raises ValueError (or KeyError, TypeError) when `state` is not one of this policy's."""
        if state["policy"] != self.scorer.name:
            raise ValueError(f"policy {state['policy']!r} is not this pool's {self.scorer.name!r}")
        self.scorer.load_state(state["scorer"])
        self._decoded_since = int(state["decoded_since"])
        self._pending = None
        if pending := state.get("pending"):
            done: Future = Future()
            done.set_result(scores_from_text(pending["scores"]))
            self._pending = _PendingReselect(done, int(pending["due_in"]))

    def tau_eff(self, history: int) -> int:
        return tau_eff(history, self.tau)

    def wants_query(self, history: int, n_tokens: int = 1) -> bool:
        """Whether the query of the step decoding `n_tokens` more is among the last `window` before a reselect
        starts: only those reach the scorer's window by then, so the others need not leave the GPU."""
        return self._pending is None and self._decoded_since + n_tokens > self.tau_eff(history) - self.scorer.window

    def quiet(self, history: int) -> bool:
        """Whether `after_decode` of the next token only counts it: no query wanted, no reselect to start (and still
        so after more history, as tau_eff only grows) and none whose moves are due."""
        if self._pending is not None:
            return self._pending.due_in > 1
        return not self.wants_query(history) and self._decoded_since + 1 < self.tau_eff(history)

    def quiet_for(self, history: int) -> int:
        """How many of the next decoded tokens after `history` neither start a reselect nor make its moves in
        `after_decode` (their queries may be wanted): a speculative round's block ends at the token after them at
        the latest, where plain decoding meets the event after that token's forward (a lower bound: tau_eff only
        grows)."""
        if self._pending is not None:
            return self._pending.due_in - 1
        return max(0, self.tau_eff(history) - 1 - self._decoded_since)

    def after_decode(self, pager: Pager, n_tokens: int = 1) -> list[Move]:
        """Count `n_tokens` newly decoded tokens; start a reselect when due, or make the moves of the one under way
        when they are due. Returns the moves to run now."""
        self._decoded_since += n_tokens
        if self._pending is not None:
            self._pending.due_in -= n_tokens
            if self._pending.due_in > 0:
                return []
            scores, self._pending = self._pending.scores.result(), None
            return reselect(pager, scores)
        if self._decoded_since < self.tau_eff(pager.n_tokens):
            return []
        inputs = self.scorer.score_inputs(pager)
        if inputs is None:
            return []
        self._decoded_since = 0
        self._pending = _PendingReselect(_SCORING.submit(self._scoring(pager, inputs)),
                                         reselect_lag(pager.n_tokens, self.tau))
        return []

    def reselect_for_prompt(self, pager: Pager, queries: np.ndarray) -> list[Move]:
        """Reselect at once against a new prompt's last queries [rows, n_layers, n_head, head_dim], which also
        restart the scorer's window; a reselect under way is dropped."""
        self.drop_pending()
        self.scorer.restart(queries)
        inputs = self.scorer.score_inputs(pager, queries)
        if inputs is None:
            return []
        self._decoded_since = 0
        return reselect(pager, self._scoring(pager, inputs)())

    def _scoring(self, pager: Pager, inputs: Any) -> Callable[[], np.ndarray]:
        """The reselect's scoring as a call on what it reads, taken now: the scorer's, then the second round's (the
        sequence's tokens and the evictable chunks as they are now, as the scorer's inputs are)."""
        if self.links is None:
            return partial(self.scorer.score, inputs)
        ticket = self.links.take(pager.n_tokens)
        protected = pager.protected_mask()
        candidates, budget = np.flatnonzero(~protected), pager.n_blocks - int(protected.sum())
        return lambda: self.links.round(ticket, self.scorer.score(inputs), candidates, DRAFT_QUERIES, budget)

    def drop_pending(self) -> None:
        """Forget a reselect under way (its chunks changed: the sequence was cut)."""
        self._pending = None

    def truncate(self, n_tokens: int) -> None:
        """The sequence was cut to n_tokens: a reselect under way is dropped, the scorer and the links cut too."""
        self.drop_pending()
        self.scorer.truncate(n_tokens)
        if self.links is not None:
            self.links.cut(n_tokens)


def reselect_lag(history: int, tau: int) -> int:
    """Decoded tokens from a reselect's start to its moves: RESELECT_LAG, or a quarter of tau_eff when that is
    less (so the moves come well before the next reselect starts)."""
    return min(RESELECT_LAG, tau_eff(history, tau) // 4)


def tau_eff(history: int, tau: int) -> int:
    """Decoded tokens between reselects after `history` tokens."""
    return max(tau, history // HISTORY_PER_TAU)


def make_policy(name: str, n_kv_head: int, tau: int = 64, drafter: DraftReader | None = None,
                history: Callable[[], Sequence[int]] | None = None) -> Policy:
    """`drafter` and `history` (the sequence's tokens so far) serve the draft policy."""
    if name == "draft":
        if drafter is None or history is None:
            raise ConfigError("kv policy draft needs a drafter model (--kv-drafter)")
        return Policy(DraftScorer(drafter, history), tau, links=SequenceLinks(history, drafter.line_breaks))
    scorers = {"lru": LruScorer, "quest": lambda: BoundScorer(n_kv_head),
               "meankey": lambda: MeanKeyScorer(n_kv_head)}
    if name not in scorers:
        raise ConfigError(f"unknown kv policy {name!r} (choose {', '.join(POLICIES)})")
    return Policy(scorers[name](), tau)


def _in_threads(fill, n: int, block: int) -> None:
    """fill(lo, hi) over [0, n) in spans of whole `block`s, one per thread: scorers' matmuls are small enough
    that BLAS runs each on one thread, and numpy drops the GIL in them."""
    blocks = -(-n // block)
    span = -(-blocks // min(SCORE_THREADS, blocks)) * block
    spans = [(lo, min(n, lo + span)) for lo in range(0, n, span)]
    if len(spans) == 1:
        fill(*spans[0])
        return
    with ThreadPoolExecutor(len(spans)) as pool:
        for done in [pool.submit(fill, lo, hi) for lo, hi in spans]:
            done.result()


def _quest_bound(kmin: np.ndarray, kmax: np.ndarray, qp: np.ndarray, qn: np.ndarray, bound: np.ndarray, block: int,
                 lo: int, hi: int) -> None:
    """bound[lo:hi] = each chunk's best bound over sub-pages and queries, per layer and KV head, `block` chunks
    per matmul into buffers reused across blocks."""
    n_layers, n_kv, n_sub, _ = kmax.shape[1:]
    a = np.empty((n_layers, n_kv, n_sub, block, qp.shape[-1]), np.float32)
    b = np.empty_like(a)
    for i in range(lo, hi, block):
        j = min(hi, i + block)
        ub = np.matmul(_rows_by_head(kmax[i:j]), qp, out=a[:, :, :, : j - i])
        ub += np.matmul(_rows_by_head(kmin[i:j]), qn, out=b[:, :, :, : j - i])
        bound[i:j] = ub.max(axis=(2, 4)).transpose(2, 0, 1)  # best sub-page and query


def _meankey_best(kmean: np.ndarray, q: np.ndarray, best: np.ndarray, block: int, lo: int, hi: int) -> None:
    """best[:, lo:hi] = per layer each chunk's best cosine over q-heads and queries, `block` chunks per matmul."""
    for i in range(lo, hi, block):
        j = min(hi, i + block)
        cos = kmean[i:j].transpose(1, 2, 0, 3) @ q  # [layers, kv heads, chunks, R*group]: the table in place
        best[:, i:j] = cos.max(axis=(1, 3))


def _rows_by_head(summary: np.ndarray) -> np.ndarray:
    """[chunks, layers, kv heads, sub, d] -> a view [layers, kv heads, sub, chunks, d] (rows d-contiguous)."""
    return summary.transpose(1, 2, 3, 0, 4)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / (np.linalg.norm(x, axis=-1, keepdims=True) + 1e-6)


def _logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    m = x.max(axis=axis, keepdims=True)
    return m + np.log(np.exp(x - m).sum(axis=axis, keepdims=True))
