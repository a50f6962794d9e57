"""Lexical links between chunks: a second scoring round that follows the text the first round found (issue 29).

A question names what it asks about, and the scorer ranks first a chunk that holds it; the other chunks the answer
needs (another value of the same key, the next assignment of a chain of variables, the call of a function defined
there) repeat some of that text, the way the model itself follows it (its induction heads attend from a repeat to what
came after the first occurrence), while their own attention from the question may be no stronger than the haystack's.
So the second round follows links, most linked first:
- from the question (the latest tokens): the chunks it names, sharing its rarest token n-grams (summed rarity, at
  least NAMED times the most linked chunk's);
- from the line of each chunk taken (where it matched what linked it: the needle, not its neighbourhood): the chunks
  sharing an n-gram with that line and no other chunk, one holding a token few chunks hold (a chain of assignments
  repeats each variable once, on the next hop's line; the chunks of one source file share many identifiers, but
  mostly with several chunks; two digits or ` == ` may follow a needle's line into the haystack by chance), at most
  HOPS lines from the question; a chunk taken already is visited for its line too (the next hop may sit in it);
and a line crossing a chunk boundary brings the chunk on the other side too (a needle cut in two), or is left out when
the budget cannot hold it whole (then its chunks rank last: a needle without its first words misleads). Then comes
the first round's best chunk (first when the question names nothing) and what its line links to; what is left of the
budget goes by the question's other links (whole lines too, not followed), then by the first round's order. Pure
bookkeeping on token ids: no model, no keys.

Issue 29's diagnosis (bench/niah_ranks.py, qwen2.5-coder-0.5b at 4K, the draft scorer, 5 recallable blocks; the share
of the answer's needles the budget holds): the question's links alone took multivalue from 0.58 to 0.83 and left
vartrack at 0.25 (each hop repeats only the previous hop's variable, on its own line; a variable of two tokens shares
no 3-gram with its repeat, hence the 2-grams too); the lines took them to 0.88 and 0.80, of 0.92 and 0.85 possible.
The first round's best went first before: on a vartrack case it was no needle, and took the block of the fourth hop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lucekv.kvflash.pager import CHUNK_TOKENS

NGRAMS = (2, 3)  # tokens per n-gram: a name split into pieces, with a token of context
NAMED = 0.5  # a chunk linked to the question this share of the most linked one's strength or more is named by it
HOPS = 8  # lines followed from the question at most (a chain of assignments, a call of a call...)
RARE_TOKEN_CHUNKS = 4  # a line's link counts only through an n-gram holding a token at most this many chunks hold
LINE_REACH = 32  # a matched line runs to the line breaks around the match, this many tokens either way at most
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9], np.uint64)  # n-gram hashing


def line_breaks(pieces: Sequence[bytes]) -> np.ndarray:
    """bool [vocabulary]: the tokens whose bytes hold a line break (a tokenizer's `pieces`)."""
    return np.array([b"\n" in p for p in pieces], bool)


class ChunkGrams:
    """The n-grams of a sequence's first `n_chunks` chunks (within each chunk; one a chunk holds alone links nothing),
    each with its rarity over the chunks: log(n_chunks / chunks holding it); and where its lines break (`breaks`:
    bool [vocabulary] of the line-break tokens; None: unknown, a line is the match alone)."""

    def __init__(self, tokens: Sequence[int], n_chunks: int, breaks: np.ndarray | None = None):
        ids = np.asarray(tokens[: n_chunks * CHUNK_TOKENS], np.int64)
        self.n_chunks, self.n_tokens = n_chunks, len(ids)
        self.at = [_hash(ids.astype(np.uint64), n) for n in NGRAMS]  # per size, the hash at each start position
        self.line_end = np.zeros(len(ids), bool) if breaks is None else breaks[ids]
        token_chunks = _chunks_holding(ids)
        grams, holders, rare = [], [], []
        for n, hashes in zip(NGRAMS, self.at, strict=True):
            start = np.arange(len(hashes))
            inside = start // CHUNK_TOKENS == (start + n - 1) // CHUNK_TOKENS
            rarest = np.min([token_chunks[i : i + len(hashes)] for i in range(n)], axis=0)
            grams.append(hashes[inside])
            holders.append(start[inside] // CHUNK_TOKENS)
            rare.append(rarest[inside] <= RARE_TOKEN_CHUNKS)
        gram, holder, rare_token = np.concatenate(grams), np.concatenate(holders), np.concatenate(rare)
        order = np.lexsort((holder, gram))
        gram, holder, rare_token = gram[order], holder[order], rare_token[order]
        once = np.r_[True, (gram[1:] != gram[:-1]) | (holder[1:] != holder[:-1])]  # each (n-gram, chunk) once
        gram, holder, rare_token = gram[once], holder[once], rare_token[once]
        group = np.cumsum(np.r_[True, gram[1:] != gram[:-1]]) - 1
        held_by = np.bincount(group)[group]
        shared = held_by > 1
        self.gram, self.holder, self.held_by = gram[shared], holder[shared], held_by[shared]  # sorted by n-gram
        self.rare_token = rare_token[shared]  # the n-gram holds a token few chunks hold
        self.rarity = np.log(n_chunks / self.held_by)

    def strength(self, start: int, end: int, pairs_only: bool = False) -> np.ndarray:
        """float64 [n_chunks]: per chunk, the rarity of the n-grams it shares with tokens[start:end], summed (with
        `pairs_only`, of those no third chunk holds); the span's own chunks 0."""
        rows = self._rows(self._hashes(start, end))
        if pairs_only:
            rows = rows[(self.held_by[rows] == 2) & self.rare_token[rows]]
        out = np.bincount(self.holder[rows], weights=self.rarity[rows], minlength=self.n_chunks).astype(np.float64)
        out[start // CHUNK_TOKENS : -(-end // CHUNK_TOKENS)] = 0
        return out

    def match(self, chunk: int, start: int, end: int) -> tuple[int, int] | None:
        """The span [first, last] of tokens of the rarest n-gram `chunk` shares with tokens[start:end] (the first of
        equals); None if it shares none."""
        mine = np.unique(self._hashes(start, end))
        lo = chunk * CHUNK_TOKENS
        best: tuple[float, int, int] | None = None
        for n, hashes in zip(NGRAMS, self.at, strict=True):
            at = hashes[lo : max(lo, min(lo + CHUNK_TOKENS, self.n_tokens) - n + 1)]
            found = np.flatnonzero(np.isin(at, mine))
            if len(found) == 0:
                continue
            row = np.searchsorted(self.gram, at[found])
            known = row < len(self.gram)
            known[known] = self.gram[row[known]] == at[found][known]
            if not known.any():
                continue
            rarity = self.rarity[row[known]]
            i = int(np.argmax(rarity))
            if best is None or rarity[i] > best[0]:
                p = lo + int(found[known][i])
                best = (float(rarity[i]), p, p + n - 1)
        return None if best is None else best[1:]

    def line(self, first: int, last: int) -> tuple[int, int]:
        """[start, end): the line holding tokens first..last: to the line break before them and through the one after
        them, each if it is within LINE_REACH tokens (else the line stops at the match: what is known to go with it)."""
        lo, hi = max(0, first - LINE_REACH), min(self.n_tokens, last + LINE_REACH)
        before, after = np.flatnonzero(self.line_end[lo:first]), np.flatnonzero(self.line_end[last:hi])
        start = lo + int(before[-1]) + 1 if len(before) else (0 if lo == 0 else first)
        end = last + int(after[0]) + 1 if len(after) else (self.n_tokens if hi == self.n_tokens else last + 1)
        return start, end

    def _hashes(self, start: int, end: int) -> np.ndarray:
        return np.concatenate([h[start : max(start, end - n + 1)] for n, h in zip(NGRAMS, self.at, strict=True)])

    def _rows(self, hashes: np.ndarray) -> np.ndarray:
        """Rows of the table holding any of `hashes`."""
        mine = np.unique(hashes)
        lo, hi = np.searchsorted(self.gram, mine, "left"), np.searchsorted(self.gram, mine, "right")
        count = hi - lo
        before = np.cumsum(count) - count  # rows of the earlier hashes
        return np.repeat(lo - before, count) + np.arange(int(count.sum()))


def link_round(scores: np.ndarray, candidates: np.ndarray, tokens: Sequence[int], question: int,
               breaks: np.ndarray | None = None, budget: int | None = None) -> np.ndarray:
    """Scores for the second round, float64 [len(scores)]: first the chunks `follow` takes (`budget` of them at most,
    the first round's best candidate among them), then the candidates by their link to the question (the last
    `question` tokens), ties (no link: most) by the first round's order, last the chunks of lines it could not take
    whole. Chunks not among `candidates` (protected
    ones) keep their scores. `breaks`: see ChunkGrams."""
    out = np.array(scores, np.float64)
    cand = candidates[candidates < len(out)]
    cand = cand[np.isfinite(out[cand])]
    if len(cand) < 2:
        return out
    n = len(out)
    end = min(len(tokens), n * CHUNK_TOKENS)
    grams = ChunkGrams(tokens, n, breaks)
    asked = (max(0, end - question), end)
    first = out[cand]
    best = int(cand[np.argmax(first)])
    out[cand] = grams.strength(*asked)[cand] + 1e-3 * (first - first.min()) / (first.max() - first.min() + 1e-300)
    taken, cut = follow(grams, best, asked, cand, len(cand) if budget is None else budget)
    low, high = out[cand].min(), out[cand].max()
    out[taken] = high + 1 + np.arange(len(taken))[::-1]  # above any link, in the order taken
    out[cut] = low - 1  # below any: part of a needle would mislead
    return out


def follow(grams: ChunkGrams, best: int, asked: tuple[int, int], candidates: np.ndarray,
           budget: int) -> tuple[list[int], list[int]]:
    """Up to `budget` candidates in the order the links take them (see the module's doc): the chunks the question
    names (linked to it at least NAMED times as strongly as the most linked), then the chunks linked to the lines
    taken, most linked first, at most HOPS lines away from the question, as long as any is; then `best` (the first
    round's), and again what its line links to; then the question's other links, whole lines. Chunks that are not
    candidates (protected) are visited for their lines, never taken. Also the candidates linked whose line the budget
    left could not hold whole."""
    if budget <= 0:
        return [], []
    free = np.zeros(grams.n_chunks, bool)
    free[candidates] = True
    from_question = grams.strength(*asked)
    named = from_question >= max(NAMED * from_question.max(), 1e-9)  # cleared as each is visited
    from_lines = np.zeros(grams.n_chunks)  # the strongest link from a line taken, not followed yet
    via = np.zeros(grams.n_chunks, np.int64)  # that line, in `lines`
    lines: list[tuple[int, int, int]] = []  # (start, end, hops from the question)
    seen: set[tuple[int, int]] = set()
    taken: list[int] = []
    cut: list[int] = []  # chunks whose line the budget could not hold whole

    def visit(chunk: int, source: tuple[int, int], hops: int) -> None:
        """Take `chunk` if it is free, and the line where it matches `source`, with the chunks that line crosses (all
        or none: a needle cut short misleads more than one left out); the line's links are followed later. A chunk
        taken already is visited too: it may hold the chain's next line."""
        named[chunk], from_lines[chunk] = False, 0
        found = grams.match(chunk, *source)
        line = found and grams.line(*found)
        crossed = range(line[0] // CHUNK_TOKENS, (line[1] - 1) // CHUNK_TOKENS + 1) if line else []
        new = [c for c in dict.fromkeys([chunk, *crossed]) if free[c]]
        if len(taken) + len(new) > budget:
            cut.extend(new)
            free[new] = False
            return
        taken.extend(new)
        free[new] = False
        if not line or line in seen:
            return
        seen.add(line)
        if hops < HOPS:
            link = grams.strength(*line, pairs_only=True)
            stronger = (link >= from_lines) & (link > 0)  # ties: the newer line's (a chain is followed to its end)
            from_lines[stronger], via[stronger] = link[stronger], len(lines)
            lines.append((*line, hops))

    while len(taken) < budget:
        if named.any():  # the chunks the question names
            visit(int(np.argmax(np.where(named, from_question, -1))), asked, 0)
        elif from_lines.max() > 0:  # the chunks linked to the lines taken: the most linked, the newest line's of equals
            chunk = int(np.lexsort((via, from_lines))[-1])
            start, end, hops = lines[via[chunk]]
            visit(chunk, (start, end), hops + 1)
        elif free[best]:  # the first round's best (and what its line links to)
            visit(best, asked, 0)
        elif (free & (from_question > 0)).any():  # the question's other links, whole lines too (not followed)
            visit(int(np.argmax(np.where(free, from_question, 0))), asked, HOPS)
        else:
            break
    return taken, cut


def _chunks_holding(ids: np.ndarray) -> np.ndarray:
    """int64 [len(ids)]: per position, how many chunks hold its token."""
    n_chunks = -(-len(ids) // CHUNK_TOKENS) or 1
    pairs = np.unique(ids * n_chunks + np.arange(len(ids)) // CHUNK_TOKENS)  # each (token, chunk) once
    tokens, held_by = np.unique(pairs // n_chunks, return_counts=True)
    return held_by[np.searchsorted(tokens, ids)]


def _hash(ids: np.ndarray, n: int) -> np.ndarray:
    """uint64 [len(ids) - n + 1]: a hash of each run of n token ids (runs of different n hash apart)."""
    count = len(ids) - n + 1
    if count <= 0:
        return np.zeros(0, np.uint64)
    h = np.full(count, n, np.uint64)
    with np.errstate(over="ignore"):
        for i in range(n):
            h = (h ^ ids[i : i + count]) * _MIX[i]
    return h
