"""The suffix index against a brute-force search, and the drafter's bookkeeping."""

import numpy as np
import pytest

from lucekv.spec.suffix import MAX_MATCH, NGRAMS, RecentOutputs, SuffixDrafter, SuffixIndex


def brute_force(tokens):
    """(continuation start, n) of the latest earlier occurrence of the longest suffix n-gram, or None."""
    for n in sorted(NGRAMS, reverse=True):
        if len(tokens) < n:
            continue
        for start in range(len(tokens) - 1, n - 1, -1):
            if tokens[start - n : start] == tokens[len(tokens) - n :]:
                return start, n
    return None


def match_length(a, a_end, b):
    m = 0
    while m < MAX_MATCH and m < a_end and m < len(b) and a[a_end - 1 - m] == b[len(b) - 1 - m]:
        m += 1
    return m


@pytest.mark.parametrize("alphabet", [3, 8])
def test_find_returns_the_latest_earlier_occurrence_of_the_longest_suffix(alphabet):
    rng = np.random.default_rng(alphabet)
    for _ in range(200):
        tokens = rng.integers(0, alphabet, rng.integers(1, 300)).tolist()
        bulk, one_by_one = SuffixIndex(), SuffixIndex()
        bulk.extend(tokens)
        for t in tokens:
            one_by_one.extend([t])
        expected = brute_force(tokens)
        for index in (bulk, one_by_one):
            m = index.find(index)
            assert (m is None) == (expected is None)
            if m is not None:
                assert m.start == expected[0]
                assert m.length == match_length(tokens, m.start, tokens) >= expected[1]


def test_the_numpy_bulk_hash_equals_the_token_by_token_one():
    tokens = np.random.default_rng(1).integers(0, 150_000, 5000).tolist()
    bulk, one_by_one = SuffixIndex(), SuffixIndex()
    bulk.extend(tokens[:1000])
    bulk.extend(tokens[1000:])  # a second bulk append continues the hash
    for t in tokens:
        one_by_one.extend([t])
    assert [bulk.suffix_hash(n) for n in NGRAMS] == [one_by_one.suffix_hash(n) for n in NGRAMS]
    for n in NGRAMS:
        assert bulk._window_hash(100, 100 + n) == one_by_one._window_hash(100, 100 + n)


def test_a_match_in_the_sequence_itself_continues_with_its_period():
    index = SuffixIndex()
    index.extend([5, 1, 2, 3, 1, 2, 3, 1, 2])
    m = index.find(index)
    assert (m.start, m.length) == (6, 5)
    assert index.continuation(m.start, 7, index) == [3, 1, 2, 3, 1, 2, 3]


def test_the_drafter_proposes_what_followed_the_match_with_length_growing_with_it():
    text = list(range(100, 140))
    d = SuffixDrafter()
    d.begin([1, 2, *text, 7, 8, *text[:3]])  # the last 3 tokens occurred before: a match of 3
    assert d.propose(16).tokens == text[3:6]
    d.accept(text[3:9])  # 9 tokens of the match now
    assert d.propose(16).tokens == text[9:18]
    assert d.propose(4).tokens == text[9:13]
    assert d.propose(0).tokens == []
    d.accept([999])
    assert d.propose(16).tokens == []


def test_begin_keeps_the_index_of_a_continued_sequence_and_rebuilds_for_another():
    d = SuffixDrafter()
    d.begin([1, 2, 3, 4])
    kept = d.index
    d.accept([5])
    d.begin([1, 2, 3, 4, 5, 6])
    assert d.index is kept and kept.tokens == [1, 2, 3, 4, 5, 6]
    d.begin([9, 9, 3])
    assert d.index is not kept and d.index.tokens == [9, 9, 3]


def test_recent_outputs_serve_other_sequences_and_stay_bounded():
    shared = RecentOutputs(capacity=1000)
    first = SuffixDrafter(shared)
    first.begin([1, 2, 3])
    first.accept(list(range(500, 540)))
    first.end()
    second = SuffixDrafter(shared)
    second.begin([7, 7, 500, 501, 502])  # its own history has no match; the other turn's output has
    assert second.propose(5).tokens == [503, 504, 505]
    for i in range(30):
        shared.add(list(range(10_000 + 100 * i, 10_000 + 100 * i + 100)))
    assert len(shared.index) <= 1000
    assert second.propose(5).tokens == []  # the old output was dropped


def test_index_memory_and_time_stay_small_at_100k_tokens():
    tokens = np.random.default_rng(2).integers(0, 150_000, 100_000).tolist()
    d = SuffixDrafter()
    d.begin(tokens)
    assert d.index.nbytes < 16 << 20
    for t in tokens[:200]:  # appends past the bulk, and lookups that match
        d.propose(16)
        d.accept([t])
    assert d.propose(8).tokens == tokens[200:208]
