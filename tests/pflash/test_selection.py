"""PFlash's span selection: the budget, the spans always kept (head, tail, anchors), the best-scored ones, order."""

from __future__ import annotations

import numpy as np
import pytest

from lucekv.pflash import PromptAlias
from lucekv.pflash.selection import (
    HEAD_SPANS,
    QUERY_TOKENS,
    SPAN_TOKENS,
    TAIL_SPANS,
    anchor_tier,
    check_keep_ratio,
    select_spans,
)

S = SPAN_TOKENS


def haystack(n: int, seed: int = 0) -> list[int]:
    """Distinct-looking filler: no 4-gram of the question recurs by chance (ids from a large range)."""
    return np.random.default_rng(seed).integers(1000, 10**6, n).tolist()


def kept_spans(selection) -> list[int]:
    return sorted({p // S for p in (selection.positions() - selection.start).tolist()})


def test_the_budget_is_filled_with_head_tail_and_the_best_scored_spans_in_their_order():
    n_spans = 100
    ids = haystack(n_spans * S - 5)  # the last span is short
    scores = np.zeros(len(ids))
    for span, value in [(40, 3.0), (60, 2.0), (50, 1.0)]:
        scores[span * S : (span + 1) * S] = value
    sel = select_spans(scores, ids, 0, keep=0.35)  # a budget of 35 spans: 8 head + 24 tail + the best 3
    assert kept_spans(sel) == [*range(HEAD_SPANS), 40, 50, 60, *range(n_spans - TAIL_SPANS, n_spans)]
    assert sel.kept_tokens == 35 * S - 5
    assert sel.spans == [(0, HEAD_SPANS * S), (40 * S, 41 * S), (50 * S, 51 * S), (60 * S, 61 * S),
                         ((n_spans - TAIL_SPANS) * S, len(ids))]  # neighbours joined, in order
    assert np.all(np.diff(sel.positions()) > 0)


def test_head_and_tail_shrink_to_leave_the_scores_a_span():
    ids = haystack(200 * S)
    scores = np.zeros(len(ids))
    scores[100 * S : 101 * S] = 1.0
    sel = select_spans(scores, ids, 0, keep=0.05)  # a budget of 10 < 8 + 24
    spans = kept_spans(sel)
    assert len(spans) == 10 and 100 in spans and spans[0] == 0 and spans[-1] == 199
    head = [s for s in spans if s < 100]
    tail = [s for s in spans if s > 100]
    assert head == list(range(len(head))) and tail == list(range(200 - len(tail), 200)) and len(head) == 2
    assert kept_spans(select_spans(scores, ids, 0, keep=0.001)) == [199]  # a budget of one: the question


def test_a_rare_four_gram_of_the_question_anchors_its_neighbourhood_and_a_common_one_does_not():
    n_spans = 300
    ids = haystack(n_spans * S)
    key = [7, 8, 9, 10]
    ids[150 * S + 3 : 150 * S + 7] = key  # once in the haystack
    common = [11, 12, 13, 14]
    for span in range(20, 280, 20):  # 13 times: more than the tier's 8 hits
        ids[span * S + 10 : span * S + 14] = common
    ids[-QUERY_TOKENS + 5 : -QUERY_TOKENS + 9] = key
    ids[-QUERY_TOKENS + 20 : -QUERY_TOKENS + 24] = common
    scores = np.zeros(len(ids))
    scores[200 * S : 240 * S] = 1.0  # where the rest of the budget goes
    radius, _ = anchor_tier(n_spans)
    sel = select_spans(scores, ids, 0, keep=0.2)
    spans = kept_spans(sel)
    assert set(range(150 - radius, 150 + radius + 1)) <= set(spans)
    assert not {20, 40, 60} & set(spans) and len(spans) == int(n_spans * 0.2)
    assert set(spans) - set(range(150 - radius, 150 + radius + 1)) == \
        {*range(HEAD_SPANS), *range(200, 223), *range(n_spans - TAIL_SPANS, n_spans)}


def test_a_region_after_a_reused_prefix_is_selected_alone_in_positions_of_the_prompt():
    ids = haystack(64) + haystack(60 * S, seed=1)
    scores = np.zeros(len(ids) - 64)
    scores[30 * S : 31 * S] = 1.0
    sel = select_spans(scores, ids, 64, keep=33 / 60)  # head 8 + tail 24 + the best
    assert (sel.start, sel.end) == (64, len(ids))
    assert sel.spans[0][0] == 64 and (64 + 30 * S, 64 + 31 * S) in sel.spans


def test_keep_one_keeps_everything_and_bad_ratios_are_refused():
    ids = haystack(50 * S + 7)
    sel = select_spans(np.random.default_rng(0).random(len(ids)), ids, 0, keep=1.0)
    assert sel.spans == [(0, len(ids))]
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="keep ratio"):
            check_keep_ratio(bad)
    with pytest.raises(ValueError, match="token scores"):
        select_spans(np.zeros(3), ids, 0, keep=0.5)


def test_an_alias_reads_a_prompt_that_begins_with_the_compressed_one_as_the_kept_tokens():
    alias = PromptAlias((1, 2, 3, 4, 5), (1, 4, 5))
    assert alias.rewrite([1, 2, 3, 4, 5, 9, 9]) == [1, 4, 5, 9, 9]
    assert alias.rewrite([1, 2, 3, 4, 5]) == [1, 4, 5]
    assert alias.rewrite([1, 2, 3, 4, 6, 9]) == [1, 2, 3, 4, 6, 9]  # diverged: read as it is
    assert alias.rewrite([1, 2]) == [1, 2]
