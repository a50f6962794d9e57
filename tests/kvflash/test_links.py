"""The lexical second round (kvflash.links): which chunks it links, and a linked policy's reselects replayed exactly,
through a snapshot of its state too. Token ids only: no model."""

from __future__ import annotations

import json

import numpy as np

from lucekv.kvflash.links import link_round, link_strength
from lucekv.kvflash.pager import PageIn, Pager
from lucekv.kvflash.policy import LruScorer, Policy
from tests.kvflash.fake_backend import FakeBackend, check_invariants

RARE = [9001, 9002, 9003, 9004]  # a name no other chunk holds
COMMON = [7, 8, 9]  # text every chunk holds


def context(n_chunks: int, seed: int = 0) -> list[int]:
    """Random tokens (no n-gram repeats by chance), COMMON in every chunk."""
    ids = np.random.default_rng(seed).integers(100, 5000, n_chunks * 64).tolist()
    for c in range(n_chunks):
        ids[c * 64 + 50 : c * 64 + 53] = COMMON
    return ids


def plant(ids: list[int], pos: int, text: list[int]) -> None:
    ids[pos : pos + len(text)] = text


def test_chunks_sharing_rare_text_with_a_source_are_linked_and_text_everyone_holds_weighs_nothing():
    ids = context(16)
    plant(ids, 3 * 64 + 10, RARE)
    plant(ids, 11 * 64 + 30, RARE)
    plant(ids, 6 * 64 + 20, RARE[:3])  # a shorter share: fewer n-grams
    strength = link_strength(ids, 16, [(3 * 64, 4 * 64)])
    assert int(np.argmax(strength)) == 11 and strength[3] == 0  # the source's own chunk gains nothing
    assert 0 < strength[6] < strength[11]
    assert np.all(strength[[c for c in range(16) if c not in (6, 11)]] == 0)  # COMMON is in every chunk: log(1) = 0
    # n-grams across a chunk boundary count for neither chunk
    ids = context(16)
    plant(ids, 3 * 64 + 10, RARE)
    plant(ids, 12 * 64 - 2, RARE)
    assert link_strength(ids, 16, [(3 * 64, 4 * 64)]).max() == 0


def test_the_second_round_keeps_the_first_rounds_best_then_the_chunks_linked_to_the_question():
    ids = context(20)
    question = [6001, 6002, 6003, 6004]
    plant(ids, 5 * 64 + 10, RARE)  # the first round's best holds RARE...
    plant(ids, 14 * 64 + 30, RARE)  # ...and so does a chunk the first round ranked low: not linked (a distractor)
    plant(ids, 8 * 64 + 2, question)  # a chunk holding the question's text
    plant(ids, 20 * 64 - 10, question)  # the question, in the last tokens
    scores = np.linspace(1, 0, 20)  # chunk 1 best ... chunk 19 worst
    scores[5] = 2.0
    scores[19] = np.inf  # newer than the scoring: stays as it is
    candidates = np.arange(1, 17)  # 0 and 17..19 protected
    out = link_round(scores, candidates, ids, 16)
    order = candidates[np.argsort(-out[candidates], kind="stable")].tolist()
    assert order[:2] == [5, 8]
    assert order[2:] == [c for c in range(1, 17) if c not in (5, 8)]  # the rest in the first round's order
    assert out[19] == np.inf and out[0] == scores[0] and out[17] == scores[17]


class FixedScorer(LruScorer):
    """The same scores at every reselect (the first round's ranking under test is not the scorer's)."""

    name = "fixed"

    def __init__(self, scores: np.ndarray):
        self.fixed = scores

    def score_inputs(self, pager, queries=None):
        return self.fixed[: pager.n_chunks].copy()


def linked_run(ids: list[int], scores: np.ndarray, snapshot_at: int | None = None) -> tuple[list, Pager]:
    """A 12-block pool over len(ids) tokens decoding 200 more under a linked policy (tau 64); with `snapshot_at`, the
    policy is rebuilt from its JSON state after that many decoded tokens."""
    history = list(ids[: 40 * 64])
    pager = Pager(12 * 64)
    backend = FakeBackend(pager)
    backend.prefill(len(history), batch=64)
    policy = Policy(FixedScorer(scores), tau=64, links=lambda: history)
    moves = [policy.reselect_for_prompt(pager, np.zeros((1, 1, 1, 1), np.float32))]
    backend.run(moves[0])
    for step in range(200):
        if step == snapshot_at:
            state = json.loads(json.dumps(policy.state()))
            policy = Policy(FixedScorer(scores), tau=64, links=lambda: history)
            policy.load_state(state)
        pos = len(history)
        history.append(ids[pos])
        backend.write(pos, 1)
        pager.take_sealed()
        moves.append(policy.after_decode(pager))
        backend.run(moves[-1])
        check_invariants(pager, backend)
    return moves, pager


def test_a_linked_policy_replays_its_residency_exactly_and_through_a_snapshot_of_its_state():
    ids = context(45, seed=2)
    plant(ids, 22 * 64 + 5, RARE)
    plant(ids, 40 * 64 - 8, RARE)  # the question (the last 16 tokens at the prompt's end) names it
    scores = np.random.default_rng(3).random(64)
    scores[7], scores[22] = 5.0, 0.0  # chunk 22 ranks last by itself
    moves, pager = linked_run(ids, scores)
    recalled = {m.chunk for m in moves[0] if isinstance(m, PageIn)}
    assert {7, 22} <= recalled  # the best, and the chunk linked to the question whatever its own score
    assert sum(map(len, moves[1:])) > 0  # decode reselects moved chunks too
    again, replayed = linked_run(ids, scores)
    assert again == moves and replayed.residency() == pager.residency()
    for at in (30, 70):  # between reselects; with one scored and its moves due (tau 64, lag 16)
        restored, after = linked_run(ids, scores, snapshot_at=at)
        assert restored == moves and after.residency() == pager.residency()
