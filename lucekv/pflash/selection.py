"""Which spans of a long prompt the target prefills (PFlash, lucebox §5; written anew). Pure numpy bookkeeping.

The region to compress is cut into SPAN_TOKENS-token spans from its start. A budget of max(1, spans * keep rounded
half up) spans is filled in this order:
1. the head (HEAD_SPANS) and the tail (TAIL_SPANS: the question) always, but no more than an eighth and a quarter
   of the budget;
2. anchors: every 4-gram of the prompt's last QUERY_TOKENS tokens that occurs earlier in the region between 1 and
   `max_hits` times marks the spans within `radius` spans of each occurrence (a question naming its key finds the
   needle that names it; a 4-gram found everywhere names nothing). Rarer 4-grams first, and of equally rare ones the
   latest (the question ends the prompt), while half of the budget left lasts;
3. the spans of the highest drafter score (the sum of its tokens' scores), while the budget lasts.
The kept spans are emitted in their original order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SPAN_TOKENS = 32
HEAD_SPANS = 8
TAIL_SPANS = 24
QUERY_TOKENS = 96  # the prompt's last tokens whose 4-grams look for anchors
NGRAM = 4


@dataclass(frozen=True)
class Selection:
    """The kept spans of a region [start, end) of the prompt, as position ranges [a, b) in order, neighbours joined."""

    start: int
    end: int
    spans: list[tuple[int, int]]

    @property
    def kept_tokens(self) -> int:
        return sum(b - a for a, b in self.spans)

    def positions(self) -> np.ndarray:
        return np.concatenate([np.arange(a, b) for a, b in self.spans]) if self.spans else np.zeros(0, np.int64)


def anchor_tier(n_spans: int) -> tuple[int, int]:
    """(radius in spans, most hits of one 4-gram) for a region of n_spans spans: longer regions, wider and more."""
    if n_spans < 1024:
        return 2, 8
    if n_spans < 2048:
        return 4, 16
    return 8, 32


def check_keep_ratio(keep: float) -> float:
    """Raises ValueError unless 0 < keep <= 1."""
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"a keep ratio must be in (0, 1] (got {keep})")
    return float(keep)


def select_spans(scores: np.ndarray, ids: list[int], start: int, keep: float) -> Selection:
    """The spans of ids[start:] to prefill, given a score per token of that region (`scores`, len(ids) - start)."""
    check_keep_ratio(keep)
    n = len(ids) - start
    if len(scores) != n:
        raise ValueError(f"{len(scores)} token scores for a region of {n} tokens")
    n_spans = -(-n // SPAN_TOKENS)
    budget = max(1, int(n_spans * keep + 0.5))  # rounded half up
    kept = np.zeros(n_spans, bool)
    head, tail = _forced_ends(budget)
    kept[:head] = True
    kept[n_spans - tail :] = True
    anchor_budget = kept.sum() + (budget - kept.sum()) // 2
    for span in _anchor_spans(ids, start, n_spans):
        if kept.sum() >= anchor_budget:
            break
        kept[span] = True
    if kept.sum() < budget:
        # summed over the span: only the last span can be short, and the tail always holds it
        span_scores = np.add.reduceat(np.asarray(scores, np.float64), np.arange(0, n, SPAN_TOKENS))
        order = np.argsort(-span_scores, kind="stable")
        free = order[~kept[order]]
        kept[free[: budget - kept.sum()]] = True
    return Selection(start, len(ids), _runs(kept, start, len(ids)))


def _forced_ends(budget: int) -> tuple[int, int]:
    """Head and tail spans always kept: HEAD_SPANS and TAIL_SPANS, but no more than an eighth and a quarter of the
    budget (one each at least), so that at least half of it goes to anchors and scores whatever the prompt's length
    (lucebox's 8 + 24 are for budgets of hundreds of spans; a 4K prompt at keep 0.25 has 32)."""
    if budget == 1:
        return 0, 1  # the question
    return min(HEAD_SPANS, max(1, budget // 8)), min(TAIL_SPANS, max(1, budget // 4))


def _anchor_spans(ids: list[int], start: int, n_spans: int) -> list[int]:
    """Spans near earlier occurrences of the question's 4-grams, the rarest 4-grams' first (see the module)."""
    radius, max_hits = anchor_tier(n_spans)
    query_from = max(start, len(ids) - QUERY_TOKENS)
    arr = np.asarray(ids[start:], np.int64)
    if len(arr) < NGRAM:
        return []
    grams = np.lib.stride_tricks.sliding_window_view(arr, NGRAM)
    searched = grams[: max(0, query_from - start - NGRAM + 1)]  # 4-grams wholly before the question
    hits: dict[tuple[int, ...], np.ndarray] = {}
    for g in map(tuple, grams[query_from - start :][::-1]):  # the latest first: the question ends the prompt
        if g not in hits:
            hits[g] = np.flatnonzero((searched == g).all(axis=1))
    spans: list[int] = []
    for found in sorted((h for h in hits.values() if 1 <= len(h) <= max_hits), key=len):  # stable: latest first
        for at in found:
            first, last = at // SPAN_TOKENS, (at + NGRAM - 1) // SPAN_TOKENS
            spans.extend(range(max(0, first - radius), min(n_spans, last + radius + 1)))
    return list(dict.fromkeys(spans))


def _runs(kept: np.ndarray, start: int, end: int) -> list[tuple[int, int]]:
    """Kept spans as position ranges, neighbours joined."""
    out: list[tuple[int, int]] = []
    for s in np.flatnonzero(kept).tolist():
        a, b = start + s * SPAN_TOKENS, min(start + (s + 1) * SPAN_TOKENS, end)
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
