from __future__ import annotations

import json

import numpy as np
import pytest

from lucekv.errors import ConfigError
from lucekv.kvflash.pager import PageIn, PageOut, Pager
from lucekv.kvflash.policy import (
    RESELECT_LAG,
    BoundScorer,
    LruScorer,
    MeanKeyScorer,
    Policy,
    make_policy,
    reselect,
    reselect_lag,
)
from tests.kvflash.fake_backend import FakeBackend, check_invariants

LAYERS, KV_HEADS, GROUP, DIM = 2, 2, 2, 64


def synthetic(n_chunks: int, seed: int, layers: int = LAYERS):
    """Random keys [n_tokens, layers, kv heads, dim] and a query [layers, q heads, dim]."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n_chunks * 64, layers, KV_HEADS, DIM)).astype(np.float32)
    query = rng.standard_normal((layers, KV_HEADS * GROUP, DIM)).astype(np.float32)
    return keys, query


def plant_token(keys, query, pos, margin):
    """One key at `pos` whose logit beats the noise (sigma = |q|) by `margin` sigmas, in one head of the last layer
    (quest does not score the first third)."""
    q = query[-1, 1 * GROUP + 1]  # last layer, kv head 1, second q-head of its group
    keys[pos, -1, 1] = margin * q / np.linalg.norm(q)


def seal_all(scorer, pager, keys):
    for c in range(len(keys) // 64):
        scorer.seal(pager, c, keys[c * 64 : (c + 1) * 64].transpose(1, 0, 2, 3).astype(np.float16))


@pytest.mark.parametrize(("seed", "layers"), [(s, LAYERS) for s in range(4)] + [(0, 16), (1, 16)])
def test_bound_scorer_ranks_a_single_token_needle_first(seed, layers):
    """The needle shows in one head of one layer only: the union over heads must not average it away."""
    keys, query = synthetic(64, seed, layers)
    plant_token(keys, query, 37 * 64 + 21, margin=16)
    pager = Pager(64 * 64)
    FakeBackend(pager).prefill(64 * 64)
    scorer = BoundScorer(KV_HEADS)
    seal_all(scorer, pager, keys)
    assert scorer.scores(pager) is None  # no query yet: nothing to rank against
    scorer.observe(query)
    assert int(np.argmax(scorer.scores(pager))) == 37


@pytest.mark.parametrize("scorer_type", [BoundScorer, MeanKeyScorer])
def test_scorers_rank_a_chunk_of_aligned_keys_first(scorer_type):
    keys, query = synthetic(64, 7)
    q = query[0, 0]
    keys[12 * 64 : 13 * 64, 0, 0] += 3 * q / np.linalg.norm(q)  # the whole chunk leans toward the query
    pager = Pager(64 * 64)
    FakeBackend(pager).prefill(64 * 64)
    scorer = scorer_type(KV_HEADS)
    seal_all(scorer, pager, keys)
    scorer.observe(query)
    assert int(np.argmax(scorer.scores(pager))) == 12


def test_bound_scorer_matches_the_quest_formula_and_bounds_every_logit():
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((8 * 64, 1, 1, 16)).astype(np.float16).astype(np.float32)
    query = rng.standard_normal((1, 1, 16)).astype(np.float32)
    pager = Pager(8 * 64)
    FakeBackend(pager).prefill(8 * 64)
    scorer = BoundScorer(n_kv_head=1, window=1)
    seal_all(scorer, pager, keys)
    scorer.observe(query)
    q = query[0, 0]
    bound = np.empty(8)
    for c in range(8):
        subs = keys[c * 64 : (c + 1) * 64, 0, 0].reshape(4, 16, 16)
        bound[c] = max(sum(max(q[i] * s[:, i].min(), q[i] * s[:, i].max()) for i in range(16)) for s in subs)
        assert bound[c] >= (keys[c * 64 : (c + 1) * 64, 0, 0] @ q).max() - 1e-4
    bound /= 4.0  # sqrt(head_dim)
    want = bound - np.log(np.exp(bound - bound.max()).sum()) - bound.max()
    np.testing.assert_allclose(scorer.scores(pager), want, rtol=1e-5, atol=1e-5)


def test_sealed_chunks_without_summaries_rank_last():
    keys, query = synthetic(4, 0)
    pager = Pager(8 * 64)
    FakeBackend(pager).prefill(4 * 64)
    scorer = MeanKeyScorer(KV_HEADS)
    scorer.seal(pager, 1, keys[64:128].transpose(1, 0, 2, 3))
    scorer.observe(query)
    scores = scorer.scores(pager)
    assert np.isfinite(scores[1]) and np.isneginf(scores[[0, 2, 3]]).all()


def paged_prefill(policy: Policy, keys: np.ndarray, pool_tokens: int):
    """Prefill through the pager in 64-token batches, sealing each chunk from its keys as a backend would."""
    pager = Pager(pool_tokens)
    backend = FakeBackend(pager)
    for start in range(0, len(keys), 64):
        backend.write(start, 64)
        for c in pager.take_sealed():
            policy.scorer.seal(pager, c, keys[c * 64 : (c + 1) * 64].transpose(1, 0, 2, 3))
        assert len(pager.resident_chunks()) <= pager.n_blocks
    return pager, backend


@pytest.mark.parametrize("name", ["quest", "meankey", "lru"])
def test_reselect_recalls_a_paged_out_needle(name):
    keys, query = synthetic(64, 11)
    q = query[1, 3]
    keys[20 * 64 : 21 * 64, 1, 1] += 3 * q / np.linalg.norm(q)  # chunk 20 answers the query
    plant_token(keys, query, 20 * 64 + 5, margin=16)
    policy = make_policy(name, KV_HEADS)
    pager, backend = paged_prefill(policy, keys, pool_tokens=8 * 64)  # 12.5% residency
    assert pager.block_of[20] < 0
    policy.scorer.observe(np.zeros_like(query))  # a previous turn's query: the prompt's replace it
    moves = policy.reselect_for_prompt(pager, query[None])
    backend.run(moves)
    check_invariants(pager, backend)
    if name == "lru":  # recency cannot know: the needle stays on the host
        assert moves == [] and pager.block_of[20] < 0
        return
    assert PageIn(20, pager.block_of[20]) in moves
    kinds = [type(m) for m in moves]
    assert kinds == sorted(kinds, key=lambda k: k is PageIn)  # every page-out before any page-in
    assert len(pager.resident_chunks()) == pager.n_blocks


def test_reselect_keeps_protected_chunks_whatever_their_score():
    pager = Pager(8 * 64)
    backend = FakeBackend(pager)
    backend.prefill(20 * 64 + 10)
    scores = np.arange(pager.n_chunks, dtype=np.float64)[::-1].copy()  # the oldest look the best
    backend.run(reselect(pager, scores))
    check_invariants(pager, backend)
    assert pager.resident_chunks().tolist() == [0, 1, 2, 16, 17, 18, 19, 20]
    # Later writes evict by those scores: the lowest-scored unprotected chunk goes first.
    moves = pager.alloc_span(pager.n_tokens, 64).moves
    assert moves == [PageOut(16, int(np.flatnonzero(backend.pager._block_chunk == 21)[0]), write_back=True)]


def test_a_nan_score_ranks_last():
    pager = Pager(8 * 64)
    backend = FakeBackend(pager)
    backend.prefill(12 * 64)
    scores = np.zeros(pager.n_chunks)
    scores[[1, 2]] = [np.nan, 1.0]
    backend.run(reselect(pager, scores))
    assert pager.block_of[2] >= 0 and pager.block_of[1] < 0


class CountingScorer(LruScorer):
    """Least recently used kept first (so that every reselect moves chunks); counts the reselects started."""

    def __init__(self):
        self.calls = 0

    def score_inputs(self, pager):
        self.calls += 1
        return -super().score_inputs(pager)


@pytest.mark.parametrize(("history", "tau_eff"), [(1000, 64), (45 * 200, 200)])
def test_reselect_starts_every_tau_eff_decoded_tokens_and_moves_lag_tokens_later(history, tau_eff):
    pager = Pager(8 * 64)
    backend = FakeBackend(pager)
    backend.prefill(history, batch=64)
    scorer = CountingScorer()
    policy = Policy(scorer, tau=64)
    assert policy.tau_eff(pager.n_tokens) == tau_eff
    lag = reselect_lag(pager.n_tokens, 64)
    assert lag == min(RESELECT_LAG, tau_eff // 4)
    moved, loud, events = [], [], []
    for step in range(1, 2 * tau_eff + lag + 1):
        if not policy.quiet(pager.n_tokens):
            loud.append(step)
        if policy.quiet_for(pager.n_tokens) == 0:  # this step starts a reselect or makes its moves
            events.append(step)
        moves = policy.after_decode(pager)
        backend.run(moves)
        assert scorer.calls == step // tau_eff
        if moves:
            moved.append(step)
    assert moved == [tau_eff + lag, 2 * tau_eff + lag]
    # a start, moves, or the steps whose queries the next start ranks against (none for LRU) are never quiet
    assert set(loud) == set(events) == {tau_eff, tau_eff + lag, 2 * tau_eff, 2 * tau_eff + lag}
    assert Policy(scorer, tau=64).quiet_for(pager.n_tokens) == tau_eff - 1  # the steps before the first event


def test_a_reselect_under_way_survives_a_snapshot_of_the_policy():
    """State taken while a reselect is being scored brings it back: the restored policy makes the same moves at the
    same token as the original."""
    keys, query = synthetic(12, seed=5)
    runs = []
    for restore in (False, True):
        pager = Pager(8 * 64)
        FakeBackend(pager).prefill(12 * 64, batch=64)
        policy = Policy(BoundScorer(KV_HEADS, window=8), tau=64)
        seal_all(policy.scorer, pager, keys)
        for _ in range(8):
            policy.scorer.observe(query)
        moves = [policy.after_decode(pager) for _ in range(64 + 5)]  # started at 64, moves due at 64 + 16
        if restore:
            state = json.loads(json.dumps(policy.state()))
            assert state["pending"]["due_in"] == reselect_lag(pager.n_tokens, 64) - 5
            policy = Policy(BoundScorer(KV_HEADS, window=8), tau=64)
            policy.load_state(state)
        moves += [policy.after_decode(pager) for _ in range(20)]
        runs.append(moves)
    assert runs[0] == runs[1]
    assert [i for i, m in enumerate(runs[0]) if m] == [64 + 16 - 1]


@pytest.mark.parametrize("scorer", [BoundScorer(KV_HEADS, window=8), LruScorer()], ids=["quest", "lru"])
def test_only_the_queries_a_reselect_ranks_against_are_fetched(scorer):
    pager = Pager(8 * 64)
    FakeBackend(pager).prefill(1000, batch=64)
    policy = Policy(scorer, tau=64)
    _, query = synthetic(1, seed=0)
    wanted = []
    for _ in range(2 * 64):
        wanted.append(policy.wants_query(pager.n_tokens))
        if wanted[-1]:
            scorer.observe(query)
        policy.after_decode(pager)
    # the last `window` steps of each 64-step interval, reselect step included
    expected = [scorer.window > 0 and (step % 64 == 0 or step % 64 > 64 - scorer.window) for step in range(1, 129)]
    assert wanted == expected


@pytest.mark.parametrize("scorer_type", [BoundScorer, MeanKeyScorer])
def test_scores_do_not_follow_a_reused_query_buffer(scorer_type):
    """A backend may hand out the buffer its next forward overwrites (the CPU backend does)."""
    keys, query = synthetic(4, seed=3)
    pager = Pager(8 * 64)
    FakeBackend(pager).prefill(4 * 64, batch=64)
    scorer = scorer_type(KV_HEADS)
    seal_all(scorer, pager, keys)
    buffer = query.copy()
    scorer.observe(buffer)
    before = scorer.scores(pager)
    buffer[:] = np.random.default_rng(4).standard_normal(buffer.shape)
    np.testing.assert_array_equal(scorer.scores(pager), before)


def test_unknown_policy_and_bad_tau_are_config_errors():
    with pytest.raises(ConfigError, match="unknown kv policy 'h2o'"):
        make_policy("h2o", 2)
    with pytest.raises(ConfigError, match="tau"):
        Policy(LruScorer(), tau=0)
