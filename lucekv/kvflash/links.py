"""Lexical links between chunks: a second scoring round that follows the text the first round found (issue 29).

A question names what it asks about, and the scorer ranks first a chunk that holds it; the other chunks the answer
needs (another value of the same key, the next assignment of a chain of variables, the call of a function defined
there) repeat some of that text, the way the model itself follows it (its induction heads attend from a repeat to what
came after the first occurrence), while their own attention from the question may be no stronger than the haystack's.
So after the first round's best chunk the rest of the budget goes to the chunks sharing the rarest token n-grams with
the question (the latest tokens), then to the first round's order. Pure bookkeeping on token ids: no model, no keys.

Issue 29's diagnosis (bench/niah_ranks.py, qwen2.5-coder-0.5b at 4K, the draft scorer, 5 recallable blocks): the
share of a multivalue answer's needles whose chunks the budget holds went from 0.58 to 0.83 over 6 cases (0.92 is
the most it can hold); a second round by the drafter's own chunk-to-chunk attention, which needs a second
whole-context pass, 0.67. Links from the best chunk too reached 0.88, but also filled a multikey pool with the
distractor needles (they repeat the asked one's phrase), and the answer named one (case 2: 1.0 -> 0.0). Vartrack's
chain is not followed: each hop repeats only the previous hop's variable, one 3-gram, while the chunks of one source
file share many identifiers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lucekv.kvflash.pager import CHUNK_TOKENS

NGRAM = 3  # tokens per n-gram: a name or a number split into pieces, with a token of context
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9], np.uint64)  # n-gram hashing


class ChunkGrams:
    """The n-grams of a sequence's first `n_chunks` chunks (within each chunk; one a chunk holds alone links nothing),
    each with its rarity over the chunks: log(n_chunks / chunks holding it)."""

    def __init__(self, tokens: Sequence[int], n_chunks: int):
        self.tokens, self.n_chunks = tokens, n_chunks
        grams = _hash(np.asarray(tokens[: n_chunks * CHUNK_TOKENS], np.int64).astype(np.uint64))
        start = np.arange(len(grams))
        inside = start // CHUNK_TOKENS == (start + NGRAM - 1) // CHUNK_TOKENS
        pairs = np.unique(np.stack([grams[inside], (start[inside] // CHUNK_TOKENS).astype(np.uint64)]), axis=1)
        gram, holder = pairs[0], pairs[1].astype(np.int64)  # each (n-gram, chunk) once
        distinct, held_by = np.unique(gram, return_counts=True)
        shared = held_by[np.searchsorted(distinct, gram)] > 1
        self.gram, self.holder = gram[shared], holder[shared]
        self.rarity = np.log(n_chunks / held_by[np.searchsorted(distinct, self.gram)])

    def strength(self, start: int, end: int) -> np.ndarray:
        """float64 [n_chunks]: per chunk, the rarity of the n-grams it shares with tokens[start:end], summed (the
        span's own chunks 0)."""
        mine = np.unique(_hash(np.asarray(self.tokens[start:end], np.int64).astype(np.uint64)))
        shared = np.isin(self.gram, mine)
        out = np.bincount(self.holder[shared], weights=self.rarity[shared], minlength=self.n_chunks)
        out[start // CHUNK_TOKENS : -(-end // CHUNK_TOKENS)] = 0
        return out


def link_strength(tokens: Sequence[int], n_chunks: int, sources: list[tuple[int, int]]) -> np.ndarray:
    """float64 [n_chunks]: per chunk, the largest over `sources` (token spans [start, end)) of ChunkGrams.strength."""
    grams = ChunkGrams(tokens, n_chunks)
    return np.max([grams.strength(a, b) for a, b in sources], axis=0, initial=0.0)


def link_round(scores: np.ndarray, candidates: np.ndarray, tokens: Sequence[int], question: int) -> np.ndarray:
    """Scores for the second round, float64 [len(scores)]: the first round's best candidate first, then the candidates
    by their link to the question (the last `question` tokens), ties (no link: most) by the first round's order. Chunks
    not among `candidates` (protected ones) keep their scores."""
    out = np.array(scores, np.float64)
    cand = candidates[candidates < len(out)]
    cand = cand[np.isfinite(out[cand])]
    if len(cand) < 2:
        return out
    n = len(out)
    end = min(len(tokens), n * CHUNK_TOKENS)
    best = int(cand[np.argmax(out[cand])])
    link = link_strength(tokens, n, [(max(0, end - question), end)])
    first = out[cand]
    out[cand] = link[cand] + 1e-3 * (first - first.min()) / (first.max() - first.min() + 1e-300)  # ties: below any
    out[best] = np.inf  # shared n-gram's rarity
    return out


def _hash(ids: np.ndarray) -> np.ndarray:
    """uint64 [len(ids) - NGRAM + 1]: a hash of each run of NGRAM token ids."""
    n = len(ids) - NGRAM + 1
    if n <= 0:
        return np.zeros(0, np.uint64)
    h = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        for i in range(NGRAM):
            h = (h ^ ids[i : i + n]) * _MIX[i]
    return h
