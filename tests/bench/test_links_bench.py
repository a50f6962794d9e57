"""`lucekv bench links`' protocol: the reselects it times follow the policy's schedule and each runs the round on
the tokens so far, with the pool's budget."""

from __future__ import annotations

import numpy as np

from lucekv.bench import links
from lucekv.kvflash.policy import tau_eff


def test_the_bench_times_one_round_per_reselect_of_the_schedule_on_the_tokens_so_far():
    ids = np.random.default_rng(0).integers(0, 500, 9000).tolist()
    calls = []

    def make_round(history):
        def round_(n_tokens, scores, candidates, budget):
            calls.append((n_tokens, len(history), len(scores), budget, int(candidates.min()), int(candidates.max())))
            return scores
        return round_

    row = links.measure(ids, 512, 3, make_round)
    ends = [9000]
    for _ in range(3):
        ends.insert(0, ends[0] - tau_eff(ends[0], 64))
    assert [c[0] for c in calls] == [c[1] for c in calls] == ends  # the history holds exactly the tokens so far
    n_chunks = -(-9000 // 64)
    # 8 blocks: the sink, the head and one tail chunk protected, 5 to recall among the chunks between
    assert calls[-1][2:] == (n_chunks, 5, 1, n_chunks - 3)
    assert row["first_ms"]["tokens"] == ends[0] and row["reselect_ms"]["reselects"] == 3
    assert row["recallable_blocks"] == 5 and row["reselect_tokens"] == tau_eff(9000, 64)


def test_the_draft_policys_round_runs_on_the_bench():
    ids = np.random.default_rng(1).integers(0, 500, 6000).tolist()
    breaks = np.arange(500) == 10
    row = links.measure(ids, 512, 2, lambda history: links.linked_round(history, breaks))
    assert row["reselect_ms"]["cpu"]["min"] > 0 and row["first_ms"]["tokens"] < 6000
