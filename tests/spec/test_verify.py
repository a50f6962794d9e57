"""Acceptance rules of a verify forward."""

import numpy as np

from lucekv.spec.drafter import Draft
from lucekv.spec.verify import accept_greedy, accept_sampled


def test_greedy_accepts_the_matching_prefix_then_the_targets_token():
    draft = Draft([4, 5, 6])
    assert accept_greedy(draft, np.array([4, 5, 9, 1])) == [4, 5, 9]
    assert accept_greedy(draft, np.array([4, 5, 6, 1])) == [4, 5, 6, 1]  # all accepted: the bonus
    assert accept_greedy(draft, np.array([7, 5, 6, 1])) == [7]
    assert accept_greedy(Draft(), np.array([3])) == [3]


def test_sampled_emits_the_targets_draws_until_one_differs_from_the_draft():
    draws = iter([4, 5, 8, 1])
    calls = []

    def sample(row, i):
        calls.append(i)
        return next(draws)

    logits = np.zeros((4, 10), np.float32)
    assert accept_sampled(Draft([4, 5, 6]), logits, sample) == [4, 5, 8]
    assert calls == [0, 1, 2]  # no draw past the first mismatch
    assert accept_sampled(Draft([1]), logits[:2], lambda row, i: 1) == [1, 1]
