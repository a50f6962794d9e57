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
    n_spans = 200
    ids = haystack(n_spans * S - 5)  # the last span is short
    scores = np.zeros(len(ids))
    scores[100 * S : 125 * S] = 1.0
    scores[110 * S : 111 * S] = 2.0
    sel = select_spans(scores, ids, 0, keep=0.2)  # 40 spans: head 40 // 8, tail 40 // 4, the best 25
    assert kept_spans(sel) == [*range(5), *range(100, 125), *range(190, 200)]
    assert sel.kept_tokens == 40 * S - 5
    assert sel.spans == [(0, 5 * S), (100 * S, 125 * S), (190 * S, len(ids))]  # neighbours joined, in order
    assert np.all(np.diff(sel.positions()) > 0)
    sel = select_spans(scores, ids, 0, keep=1.0)  # head and tail at most HEAD_SPANS and TAIL_SPANS
    assert sel.spans == [(0, len(ids))]
    scores = np.zeros(2000 * S)
    scores[1000 * S : 1168 * S] = 1.0
    long = kept_spans(select_spans(scores, haystack(2000 * S), 0, keep=0.1))  # 200: 8 + 24 + the best 168
    assert long == [*range(HEAD_SPANS), *range(1000, 1168), *range(2000 - TAIL_SPANS, 2000)]


def test_head_and_tail_take_an_eighth_and_a_quarter_of_a_small_budget():
    ids = haystack(200 * S)
    scores = np.zeros(len(ids))
    scores[100 * S : 101 * S] = 1.0
    spans = kept_spans(select_spans(scores, ids, 0, keep=0.05))  # a budget of 10
    assert spans == [0, *range(1, 7), 100, 198, 199]  # head 1, tail 2, the best 7 (ties: the first)
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
    assert not {20, 40, 60} & set(spans) and len(spans) == 60  # head 7, tail 15, the anchors, the best 33
    assert set(spans) - set(range(150 - radius, 150 + radius + 1)) == {*range(7), *range(200, 233), *range(285, 300)}


def test_anchors_take_half_of_the_budget_left_at_most_the_rarest_and_latest_first():
    n_spans = 400
    ids = haystack(n_spans * S)
    grams = [[7 + 4 * g + j for j in range(4)] for g in range(20)]  # 20 rare 4-grams of the question...
    for g, gram in enumerate(grams):
        ids[(20 + 15 * g) * S : (20 + 15 * g) * S + 4] = gram  # ...each once in the haystack
        ids[-QUERY_TOKENS + 4 * g : -QUERY_TOKENS + 4 * g + 4] = gram
    ids[-QUERY_TOKENS + 80 : -QUERY_TOKENS + 84] = grams[0]  # the first also latest of all, and twice
    ids[(20 + 15 * 19) * S + 8 : (20 + 15 * 19) * S + 12] = grams[0]
    scores = np.zeros(len(ids))
    scores[330 * S : 376 * S] = 1.0  # where the rest goes
    spans = set(kept_spans(select_spans(scores, ids, 0, keep=0.25)))  # 100: head 8, tail 24, 68 left
    assert len(spans & set(range(8, 330))) == 34 and len(spans & set(range(330, 376))) == 34  # anchors: half
    assert [g for g in range(20) if 20 + 15 * g in spans] == list(range(13, 20))  # the latest rare ones


def test_a_region_after_a_reused_prefix_is_selected_alone_in_positions_of_the_prompt():
    ids = haystack(64) + haystack(60 * S, seed=1)
    scores = np.zeros(len(ids) - 64)
    scores[30 * S : 31 * S] = 1.0
    sel = select_spans(scores, ids, 64, keep=33 / 60)  # head 8 + tail 24 + the best
    assert (sel.start, sel.end) == (64, len(ids))
    assert sel.spans[0][0] == 64 and (64 + 30 * S, 64 + 31 * S) in sel.spans and sel.kept_tokens == 33 * S


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
