"""The lexical second round (kvflash.links): which chunks it links, the chains it follows from line to line, and a
linked policy's reselects replayed exactly, through a snapshot of its state too. Token ids only: no model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lucekv.kvflash.links import HOPS, NGRAMS, RARE_TOKEN_CHUNKS, GramIndex, SequenceLinks, follow, link_round
from lucekv.kvflash.pager import PageIn, Pager
from lucekv.kvflash.policy import LruScorer, Policy
from tests.kvflash.fake_backend import FakeBackend, check_invariants

RARE = [9001, 9002, 9003, 9004]  # a name no other chunk holds
COMMON = [7, 8, 9]  # text every chunk holds
NL = 10  # the line break
BREAKS = np.arange(10_000) == NL


def context(n_chunks: int, seed: int = 0) -> list[int]:
    """Random tokens (no n-gram repeats by chance), COMMON in every chunk."""
    ids = np.random.default_rng(seed).integers(100, 5000, n_chunks * 64).tolist()
    for c in range(n_chunks):
        ids[c * 64 + 50 : c * 64 + 53] = COMMON
    return ids


def plant(ids: list[int], pos: int, text: list[int]) -> None:
    ids[pos : pos + len(text)] = text


def indexed(ids: list[int], breaks: np.ndarray | None = None) -> GramIndex:
    index = GramIndex(breaks)
    index.extend(ids)
    return index


def test_chunks_sharing_rare_text_with_a_source_are_linked_and_text_everyone_holds_weighs_nothing():
    ids = context(16)
    plant(ids, 3 * 64 + 10, RARE)
    plant(ids, 11 * 64 + 30, RARE)
    plant(ids, 6 * 64 + 20, RARE[:3])  # a shorter share: fewer n-grams
    strength = indexed(ids).strength(3 * 64, 4 * 64)
    assert int(np.argmax(strength)) == 11 and strength[3] == 0  # the source's own chunk gains nothing
    assert 0 < strength[6] < strength[11]
    assert np.all(strength[[c for c in range(16) if c not in (6, 11)]] == 0)  # COMMON is in every chunk: log(1) = 0
    # n-grams across a chunk boundary count for neither chunk: each holds one 2-gram of RARE
    ids = context(16)
    plant(ids, 3 * 64 + 10, RARE)
    plant(ids, 12 * 64 - 2, RARE)
    strength = indexed(ids).strength(3 * 64, 4 * 64)
    assert strength[11] == strength[12] == np.log(16 / 2) and np.count_nonzero(strength) == 2


def test_the_second_round_takes_the_chunk_the_question_names_then_the_first_rounds_best_then_its_order():
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
    out = link_round(scores, candidates, indexed(ids), 16)
    order = candidates[np.argsort(-out[candidates], kind="stable")].tolist()
    assert order[:2] == [8, 5]
    assert order[2:] == [c for c in range(1, 17) if c not in (5, 8)]  # the rest in the first round's order
    assert out[19] == np.inf and out[0] == scores[0] and out[17] == scores[17]


def chain_context() -> tuple[list[int], dict[str, int]]:
    """40 chunks of random lines (a line break every 16 tokens) holding a chain of assignments, one a line:
    `value` in chunk 30 (the last 16 tokens, the question, name it), then A = value in chunk 4, B = A in chunk 9
    (across the boundary with chunk 10), C = B in chunk 17; chunk 25 shares text with chunk 4 off its line, chunk 33 a
    2-gram of common tokens on it (a coincidence: no link)."""
    ids = context(40, seed=5)
    for p in range(15, len(ids), 16):
        ids[p] = NL
    a, b, c, value, eq = [9101, 9102], [9201, 9202], [9301, 9302], [9401, 9402, 9403], 9500
    plant(ids, 4 * 64 + 16, [*a, eq, *value, *COMMON[1::-1], NL])
    plant(ids, 10 * 64 - 3, [*b, eq, *a, NL])  # "B =" on chunk 9, A on chunk 10
    plant(ids, 17 * 64 + 32, [*c, eq, *b, NL])
    plant(ids, 4 * 64 + 40, [9601, 9602, 9603])  # beside A's line in chunk 4...
    plant(ids, 25 * 64 + 40, [9601, 9602, 9603])  # ...and in chunk 25: a neighbour's link, not the line's
    plant(ids, 33 * 64 + 5, COMMON[1::-1])  # A's line and chunk 33 alone hold this 2-gram, of tokens every chunk holds
    plant(ids, 40 * 64 - 8, value)
    return ids, {"A": 4, "B": 9, "B's end": 10, "C": 17}


def test_links_follow_the_chain_from_line_to_line_and_a_line_brings_its_neighbour_chunk():
    ids, at = chain_context()
    grams = indexed(ids, BREAKS)
    candidates = np.arange(1, 38)
    taken, cut = follow(grams, 2, (40 * 64 - 16, 40 * 64), candidates, budget=8)
    # the chunk the question names (A's), the next hop's two chunks (B's: linked from A's line by A's name, B's line
    # ends in chunk 10), the hop after (C's, linked from B's line by B's name), then the first round's best (2);
    # nothing else is linked from a line, so the budget is left to the question's other links
    assert taken == [at["A"], at["B's end"], at["B"], at["C"], 2] and cut == []
    # without line breaks a line is its match alone: the chain stops at A (A's name on A's line is linked from B's
    # line, not from A's value)
    assert follow(indexed(ids), 2, (40 * 64 - 16, 40 * 64), candidates, budget=8) == ([at["A"], 2], [])
    # the budget bounds what follow takes...
    assert follow(grams, 2, (40 * 64 - 16, 40 * 64), candidates, budget=3) == ([at["A"], at["B's end"], at["B"]], [])
    # ...and a line it cannot hold whole is not taken in part (nor followed): B's two chunks are cut, the best fits
    assert follow(grams, 2, (40 * 64 - 16, 40 * 64), candidates, budget=2) == ([at["A"], 2], [at["B's end"], at["B"]])


def test_a_chain_is_followed_at_most_hops_lines_from_the_question():
    ids = context(40, seed=6)
    for p in range(15, len(ids), 16):
        ids[p] = NL
    names = [[9000 + 10 * k, 9001 + 10 * k] for k in range(HOPS + 3)]
    plant(ids, 1 * 64 + 16, [*names[0], 9500, 9501, 9502, NL])  # named by the question
    for k in range(1, HOPS + 3):  # hop k on chunk 1 + 3k: "name k = name k-1"
        plant(ids, (1 + 3 * k) * 64 + 16, [*names[k], 9500, *names[k - 1], NL])
    plant(ids, 40 * 64 - 8, [9500, 9501, 9502])
    taken, _ = follow(indexed(ids, BREAKS), 2, (40 * 64 - 16, 40 * 64), np.arange(1, 38), budget=30)
    assert taken == [*[1 + 3 * k for k in range(HOPS + 1)], 2]


def test_the_second_round_puts_the_chain_above_the_question_links_and_the_first_round():
    ids, at = chain_context()
    scores = np.linspace(1, 0, 40)
    scores[2] = 2.0
    candidates = np.arange(1, 38)
    out = link_round(scores, candidates, indexed(ids, BREAKS), 16, budget=6)
    order = candidates[np.argsort(-out[candidates], kind="stable")].tolist()
    assert order[:5] == [at["A"], at["B's end"], at["B"], at["C"], 2]
    assert order[5:] == [c for c in candidates if c not in order[:5]]  # the first round's order: no other link
    # with 2 blocks B's line (two chunks) cannot come whole: its chunks go last, below every unlinked one
    out = link_round(scores, candidates, indexed(ids, BREAKS), 16, budget=2)
    order = candidates[np.argsort(-out[candidates], kind="stable")].tolist()
    assert order[:2] == [at["A"], 2] and order[-2:] == [at["B"], at["B's end"]]


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
    policy = Policy(FixedScorer(scores), tau=64, links=SequenceLinks(lambda: history, BREAKS))
    moves = [policy.reselect_for_prompt(pager, np.zeros((1, 1, 1, 1), np.float32))]
    backend.run(moves[0])
    for step in range(200):
        if step == snapshot_at:
            state = json.loads(json.dumps(policy.state()))
            policy = Policy(FixedScorer(scores), tau=64, links=SequenceLinks(lambda: history, BREAKS))
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
    for p in range(15, len(ids), 16):
        ids[p] = NL
    plant(ids, 22 * 64 + 5, [*RARE, 9700, 9701])
    plant(ids, 12 * 64 + 20, [9800, 9801, 9700, 9701])  # linked from chunk 22's line
    plant(ids, 40 * 64 - 8, RARE)  # the question (the last 16 tokens at the prompt's end) names it
    scores = np.random.default_rng(3).random(64)
    scores[7], scores[22] = 5.0, 0.0  # chunk 22 ranks last by itself
    moves, pager = linked_run(ids, scores)
    recalled = {m.chunk for m in moves[0] if isinstance(m, PageIn)}
    assert {7, 22, 12} <= recalled  # the best, the chunk the question names whatever its own score, and the next hop
    assert sum(map(len, moves[1:])) > 0  # decode reselects moved chunks too
    again, replayed = linked_run(ids, scores)
    assert again == moves and replayed.residency() == pager.residency()
    for at in (30, 70):  # between reselects; with one scored and its moves due (tau 64, lag 16)
        restored, after = linked_run(ids, scores, snapshot_at=at)
        assert restored == moves and after.residency() == pager.residency()


def oracle_strength(ids: list[int], start: int, end: int, pairs_only: bool) -> np.ndarray:
    """GramIndex.strength by its definition, in plain Python: sets of the chunks holding each n-gram whole."""
    n_chunks = -(-len(ids) // 64)
    holders: dict[tuple, set[int]] = {}
    token_chunks: dict[int, set[int]] = {}
    for p, t in enumerate(ids):
        token_chunks.setdefault(t, set()).add(p // 64)
    for n in NGRAMS:
        for p in range(len(ids) - n + 1):
            if p // 64 == (p + n - 1) // 64:
                holders.setdefault(tuple(ids[p : p + n]), set()).add(p // 64)
    out = np.zeros(n_chunks)
    for gram in {tuple(ids[p : p + n]) for n in NGRAMS for p in range(start, end - n + 1)}:
        held = holders.get(gram, set())
        rare = min(len(token_chunks[t]) for t in gram) <= RARE_TOKEN_CHUNKS
        if len(held) > 1 and (not pairs_only or (len(held) == 2 and rare)):
            out[sorted(held)] += np.log(n_chunks / len(held))
    out[start // 64 : -(-end // 64)] = 0
    return out


def test_an_index_grown_in_steps_and_cut_reads_as_one_built_at_once_and_as_its_definition():
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 60, 24 * 64).tolist()  # a small vocabulary: n-grams repeat across chunks
    ids[::13] = [NL] * len(ids[::13])
    grown = GramIndex(BREAKS)
    for end in (200, 700, 701, 1100, 24 * 64):
        if rng.random() < 0.5:  # a rewind, then the same tokens again
            grown.cut(int(rng.integers(0, grown.n_tokens + 1)))
        while grown.n_tokens < end:
            grown.extend(ids[grown.n_tokens : min(end, grown.n_tokens + int(rng.integers(1, 150)))])
        whole = indexed(ids[:end], BREAKS)
        for _ in range(6):
            start = int(rng.integers(0, end - 2))
            stop = min(end, start + int(rng.integers(2, 70)))
            for pairs_only in (False, True):
                strength = grown.strength(start, stop, pairs_only)
                assert np.array_equal(strength, whole.strength(start, stop, pairs_only))
                assert np.allclose(strength, oracle_strength(ids[:end], start, stop, pairs_only), rtol=1e-12)
            chunks = np.arange(grown.n_chunks)
            assert np.array_equal(grown.lines(chunks, start, stop), whole.lines(chunks, start, stop))


def test_sequence_links_read_the_history_as_each_round_took_it():
    ids, _ = chain_context()
    history = list(ids[: 30 * 64])
    links = SequenceLinks(lambda: history, BREAKS)
    scores = np.random.default_rng(1).random(40)
    candidates = np.arange(1, 36)

    def fresh(n_tokens: int) -> np.ndarray:
        return link_round(scores[: -(-n_tokens // 64)], candidates, indexed(history[:n_tokens], BREAKS), 16, 6)

    with pytest.raises(ValueError, match="holds 1920 tokens"):
        links.take(30 * 64 + 1)
    first = links.take(30 * 64)
    history.extend(ids[30 * 64 :])
    expected = fresh(30 * 64)
    later = links.take(40 * 64)  # taken before the first round ran: it still reads the first 30 chunks
    assert np.array_equal(links.round(first, scores[:30], candidates, 16, 6), expected)
    assert np.array_equal(links.round(later, scores, candidates, 16, 6), fresh(40 * 64))
    dropped = links.take(40 * 64)
    newest = links.take(40 * 64)
    links.round(newest, scores, candidates, 16, 6)
    with pytest.raises(RuntimeError, match="dropped"):  # a round that came after a newer one is never used
        links.round(dropped, scores, candidates, 16, 6)
    # a rewind: cut, then other tokens; and the history changed with no cut said: indexed anew
    del history[25 * 64 + 10 :]
    links.cut(25 * 64 + 10)
    history.extend(np.random.default_rng(2).integers(100, 5000, 14 * 64 - 10).tolist())
    assert np.array_equal(links.round(links.take(39 * 64), scores[:39], candidates, 16, 6), fresh(39 * 64))
    history[39 * 64 - 8 : 39 * 64 - 5] = [9401, 9402, 9403]  # the value the question asks, in chunk 38 now
    history.extend(ids[39 * 64 :])
    assert np.array_equal(links.round(links.take(40 * 64), scores, candidates, 16, 6), fresh(40 * 64))
    assert links.index.strength(40 * 64 - 16, 40 * 64)[38] > 0
