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

Cost (`lucekv bench links`): the n-grams are indexed as the tokens come (GramIndex), and a round's walk costs the
chunks it visits: 3.2 ms of CPU a reselect at 128K tokens, where rebuilding the table over the whole context at
each cost 54 ms.
"""

from __future__ import annotations

import heapq
import threading
from array import array
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from lucekv.kvflash.pager import CHUNK_TOKENS

NGRAMS = (2, 3)  # tokens per n-gram: a name split into pieces, with a token of context
NAMED = 0.5  # a chunk linked to the question this share of the most linked one's strength or more is named by it
HOPS = 8  # lines followed from the question at most (a chain of assignments, a call of a call...)
RARE_TOKEN_CHUNKS = 4  # a line's link counts only through an n-gram holding a token at most this many chunks hold
LINE_REACH = 32  # a matched line runs to the line breaks around the match, this many tokens either way at most
TAIL_CHECK = 64  # tokens of the history last fed that must still be there when more come (else it is fed anew)
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9], np.uint64)  # n-gram hashing
_NONE = -1  # no chunk, no position
_UNHELD = np.iinfo(np.int32).max  # an n-gram no other chunk holds, in a search for the fewest holders


def line_breaks(pieces: Sequence[bytes]) -> np.ndarray:
    """bool [vocabulary]: the tokens whose bytes hold a line break (a tokenizer's `pieces`)."""
    return np.array([b"\n" in p for p in pieces], bool)


class GramIndex:
    """The n-grams of a sequence's tokens, grown as the tokens come: `extend` costs O(new tokens), a query O(its span
    and the chunks it names), whatever the context. An n-gram links the chunks that hold it whole (one a chunk holds
    alone links nothing), with the rarity log(n_chunks / chunks holding it); `breaks` (bool [vocabulary] of the
    line-break tokens; None: unknown, a line is the match alone) bound its lines.

    Every n-gram seen gets an id (a dict from its hash, which only grows); per id the chunks holding it, in order (the
    first two in arrays, from the third on in an `array` per id: no object the garbage collector walks). Being
    grown in steps or at once gives the same index (tests/kvflash/test_links.py), so it is state no snapshot needs:
    a restored sequence builds it again from its tokens."""

    def __init__(self, breaks: np.ndarray | None = None):
        self.breaks = breaks
        self.n_tokens = 0
        self._ids = np.zeros(0, np.int64)
        self._line_end = np.zeros(0, bool)
        self._gid = {n: np.zeros(0, np.int32) for n in NGRAMS}  # per size, the id of the n-gram starting at each token
        self._ids_of = _IdTable()  # n-gram hash -> id
        self._n_ids = 0
        self._hash = np.zeros(0, np.uint64)  # per id: its hash (sums over n-grams go in hash order)
        self._held_by = np.zeros(0, np.int32)  # per id: chunks holding it
        self._holder = np.zeros((0, 2), np.int32)  # per id: the first two of them
        self._last = np.zeros(0, np.int32)  # per id: the latest (the partial chunk goes on growing)
        self._more: defaultdict[int, array] = defaultdict(partial(array, "i"))  # per id held by 3+ chunks: the third on
        self._marked = np.zeros(0, bool)  # per id: among a match's source (scratch, cleared after each)
        self._token_chunks = np.zeros(0, np.int32)  # per token id: chunks holding it
        self._token_last = np.zeros(0, np.int32)  # per token id: the latest

    @property
    def n_chunks(self) -> int:
        return -(-self.n_tokens // CHUNK_TOKENS)

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Index the tokens that follow the ones indexed."""
        new = np.asarray(tokens, np.int64)
        if len(new) == 0:
            return
        n0, n1 = self.n_tokens, self.n_tokens + len(new)
        self._ids = _grown(self._ids, n1)
        self._ids[n0:n1] = new
        self._line_end = _grown(self._line_end, n1)
        self._line_end[n0:n1] = False if self.breaks is None else self.breaks[new]
        self._count_tokens(new, np.arange(n0, n1) // CHUNK_TOKENS)
        first = {n: max(0, n0 - n + 1) for n in NGRAMS}  # the n-grams ending in the new tokens start here
        hashes = [_hash(self._ids[first[n] : n1].astype(np.uint64), n) for n in NGRAMS]
        gids = np.split(self._ids_for(np.concatenate(hashes)), np.cumsum([len(h) for h in hashes])[:-1])
        starts = [np.arange(first[n], first[n] + len(h)) for n, h in zip(NGRAMS, hashes, strict=True)]
        for n, at, g in zip(NGRAMS, starts, gids, strict=True):
            self._gid[n] = _grown(self._gid[n], n1)
            self._gid[n][at] = g
        self.n_tokens = n1
        inside = [at // CHUNK_TOKENS == (at + n - 1) // CHUNK_TOKENS for n, at in zip(NGRAMS, starts, strict=True)]
        self._add_holders(np.concatenate([g[i] for g, i in zip(gids, inside, strict=True)]),
                          np.concatenate([at[i] // CHUNK_TOKENS for at, i in zip(starts, inside, strict=True)]))

    def cut(self, n_tokens: int) -> None:
        """Keep the first n_tokens (indexed again: a cut is rare, a step of a session rewound)."""
        if n_tokens < self.n_tokens:
            kept = self._ids[:n_tokens].copy()
            self.__init__(self.breaks)
            self.extend(kept)

    def strength(self, start: int, end: int, pairs_only: bool = False) -> np.ndarray:
        """float64 [n_chunks]: per chunk, the rarity of the n-grams it shares with tokens[start:end], summed (with
        `pairs_only`, of those no third chunk holds and that hold a token at most RARE_TOKEN_CHUNKS chunks hold); the
        span's own chunks 0."""
        if pairs_only:  # each weighs log(n_chunks / 2): their order is no matter
            gids = self._span(start, end)
            tokens_rare = self._token_chunks[self._ids[start:end]] <= RARE_TOKEN_CHUNKS
            rare = np.concatenate([_any_of(tokens_rare, n)[: len(g)] for n, g in zip(NGRAMS, gids, strict=True)])
            gids = np.concatenate(gids)
            gids = np.sort(gids[rare & (self._held_by[gids] == 2)])
            gids = gids[_run_starts(gids)]
            holders, held = self._holder[gids].ravel(), np.full(len(gids), 2)
        else:  # summed in their hashes' order, whatever the ids
            gids = np.concatenate(self._span(start, end))
            order = np.argsort(self._hash[gids])
            gids = gids[order][_run_starts(self._hash[gids][order])]
            gids = gids[self._held_by[gids] > 1]
            held = self._held_by[gids]
            lists = [self._holder[g] if h == 2 else np.r_[self._holder[g], self._more[g]]
                     for g, h in zip(gids.tolist(), held.tolist(), strict=True)]
            holders = np.concatenate(lists) if lists else np.zeros(0, np.int32)
        rarity = np.log(self.n_chunks / held)
        out = np.bincount(holders, weights=np.repeat(rarity, held), minlength=self.n_chunks).astype(np.float64)
        out[start // CHUNK_TOKENS : -(-end // CHUNK_TOKENS)] = 0
        return out

    def lines(self, chunks: np.ndarray, start: int, end: int) -> np.ndarray:
        """int64 [len(chunks), 2]: per chunk, the line [start, end) around the rarest n-gram it shares with
        tokens[start:end] (`line`; the first of equals, the shorter n-gram of equals), or _NONE twice if it shares
        none."""
        first = self._matches(np.asarray(chunks, np.int64), np.concatenate(self._span(start, end)))
        out = np.full((len(first), 2), _NONE, np.int64)
        found = first[:, 0] >= 0
        out[found] = self._lines(first[found, 0], first[found, 1])
        return out

    # ---- growing ----------------------------------------------------------------------------------------------

    def _count_tokens(self, tokens: np.ndarray, chunks: np.ndarray) -> None:
        """Count the chunks now holding each token (a chunk's tokens may come in several extends)."""
        size = int(tokens.max()) + 1
        self._token_chunks = _grown(self._token_chunks, size)
        self._token_last = _grown(self._token_last, size, _NONE)
        token, chunk, starts = _pairs(tokens, chunks)
        counted = token[self._token_last[token] != chunk]  # sorted
        first = np.flatnonzero(_run_starts(counted))
        self._token_chunks[counted[first]] += np.diff(np.r_[first, len(counted)]).astype(np.int32)
        ends = np.r_[starts[1:], len(token)] - 1
        self._token_last[token[ends]] = chunk[ends]

    def _ids_for(self, hashes: np.ndarray) -> np.ndarray:
        """int32 ids of n-gram hashes, new ones numbered on (in hash order)."""
        order = np.argsort(hashes)
        distinct = _run_starts(hashes[order])
        keys = hashes[order][distinct]
        got = self._ids_of.find(keys, self._hash)
        unknown = got < 0
        if unknown.any():
            first, self._n_ids = self._n_ids, self._n_ids + int(unknown.sum())
            got[unknown] = np.arange(first, self._n_ids)
            self._hash = _grown(self._hash, self._n_ids)
            self._hash[first : self._n_ids] = keys[unknown]
            self._ids_of.add(first, self._n_ids, self._hash)
            self._held_by = _grown(self._held_by, self._n_ids)
            self._holder = _grown(self._holder, self._n_ids, _NONE)
            self._last = _grown(self._last, self._n_ids, _NONE)
        out = np.empty(len(hashes), np.int32)
        out[order] = got[np.cumsum(distinct) - 1]
        return out

    def _add_holders(self, gids: np.ndarray, chunks: np.ndarray) -> None:
        """Record that `chunks` hold n-grams `gids` (pairs in any order, repeats and known ones allowed)."""
        gid, chunk, _ = _pairs(gids.astype(np.int64), chunks)
        new = self._last[gid] != chunk  # a chunk that was partial holds some already
        gid, chunk = gid[new], chunk[new]
        starts = np.flatnonzero(_run_starts(gid))
        counts = np.diff(np.r_[starts, len(gid)])
        rank = self._held_by[gid] + np.arange(len(gid)) - np.repeat(starts, counts)
        for r in (0, 1):
            self._holder[gid[rank == r], r] = chunk[rank == r]
        more = rank >= 2  # per n-gram, its chunks from the third on: one extend each, in C loops
        runs = np.flatnonzero(_run_starts(gid[more])).tolist()
        held = chunk[more].tolist()
        arrays = map(self._more.__getitem__, gid[more][runs].tolist())
        deque(map(array.extend, arrays, map(held.__getitem__, map(slice, runs, [*runs[1:], len(held)]))), maxlen=0)
        self._held_by[gid[starts]] += counts.astype(np.int32)
        self._last[gid[starts + counts - 1]] = chunk[starts + counts - 1]

    # ---- reading ----------------------------------------------------------------------------------------------

    def _span(self, start: int, end: int) -> list[np.ndarray]:
        """Per size, the ids of the n-grams of tokens[start:end] (views)."""
        return [self._gid[n][start : max(start, end - n + 1)] for n in NGRAMS]

    def _matches(self, chunks: np.ndarray, source: np.ndarray) -> np.ndarray:
        """int64 [len(chunks), 2]: per chunk, the first and last token of the rarest n-gram it holds whole among
        the ids `source` that another chunk holds too: the first of equals, the shorter of equals; or _NONE twice."""
        self._marked = _grown(self._marked, self._n_ids)
        self._marked[source] = True
        fewest = np.full(len(chunks), _UNHELD)  # chunks holding it: the rarest is held by fewest
        out = np.full((len(chunks), 2), _NONE, np.int64)
        for n in NGRAMS:
            at = chunks[:, None] * CHUNK_TOKENS + np.arange(CHUNK_TOKENS - n + 1)
            valid = at <= self.n_tokens - n
            gids = self._gid[n][np.where(valid, at, 0)]
            held = np.where(valid & self._marked[gids], self._held_by[gids], 0)
            held[held < 2] = _UNHELD
            i = np.argmin(held, axis=1)
            h = held[np.arange(len(chunks)), i]
            better = h < fewest
            fewest[better] = h[better]
            out[better, 0] = at[better, i[better]]
            out[better, 1] = out[better, 0] + n - 1
        self._marked[source] = False
        return out

    def _lines(self, first: np.ndarray, last: np.ndarray) -> np.ndarray:
        """[k, 2]: the lines [start, end) holding tokens first..last: to the line break before them and through the
        one after them, each if it is within LINE_REACH tokens (else the line stops at the match: what is known to go
        with it)."""
        before = first[:, None] - LINE_REACH + np.arange(LINE_REACH)
        after = last[:, None] + np.arange(LINE_REACH)
        breaks_before = (before >= 0) & self._line_end[np.maximum(before, 0)]
        breaks_after = (after < self.n_tokens) & self._line_end[np.minimum(after, self.n_tokens - 1)]
        k = np.arange(len(first))
        last_before = before[k, LINE_REACH - 1 - np.argmax(breaks_before[:, ::-1], axis=1)]
        first_after = after[k, np.argmax(breaks_after, axis=1)]
        start = np.where(breaks_before.any(axis=1), last_before + 1, np.where(first <= LINE_REACH, 0, first))
        end = np.where(breaks_after.any(axis=1), first_after + 1,
                       np.where(last + LINE_REACH >= self.n_tokens, self.n_tokens, last + 1))
        return np.stack([start, end], axis=1)


class _IdTable:
    """The ids of uint64 hashes (`hashes[id]`, kept by the caller), by open addressing in numpy, every key of a call at
    once: a key's first slot from its high bits (a multiplicative hash's best mixed), then the next ones; grown to
    stay at most half full. (A dict took a Python call per key: 0.4 ms a reselect at 128K.)"""

    def __init__(self):
        self.slots = np.full(1 << 10, _NONE, np.int32)

    def find(self, keys: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        """int64: the id of each key, or _NONE."""
        out = np.full(len(keys), _NONE, np.int64)
        todo, slot = np.arange(len(keys)), self._home(keys)
        while len(todo):
            ids = self.slots[slot]
            used = ids >= 0
            hit = used.copy()
            hit[used] = hashes[ids[used]] == keys[todo[used]]
            out[todo[hit]] = ids[hit]
            todo, slot = todo[used & ~hit], (slot[used & ~hit] + 1) & (len(self.slots) - 1)
        return out

    def add(self, first: int, end: int, hashes: np.ndarray) -> None:
        """Add ids first..end-1 (keys hashes[id], new and distinct)."""
        if 2 * end > len(self.slots):
            self.slots = np.full(1 << (2 * end).bit_length(), _NONE, np.int32)
            first = 0
        todo = np.arange(first, end)
        slot = self._home(hashes[todo])
        while len(todo):
            free = self.slots[slot] < 0
            self.slots[slot[free]] = todo[free]  # keys wanting one slot: one of them takes it
            won = np.zeros(len(todo), bool)
            won[free] = self.slots[slot[free]] == todo[free]
            todo, slot = todo[~won], (slot[~won] + 1) & (len(self.slots) - 1)

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return (keys >> np.uint64(65 - len(self.slots).bit_length())).astype(np.int64)


def link_round(scores: np.ndarray, candidates: np.ndarray, index: GramIndex, question: int,
               budget: int | None = None) -> np.ndarray:
    """Scores for the second round, float64 [len(scores)] (the index's chunks): first the chunks `follow` takes
    (`budget` of them at most, the first round's best candidate among them), then the candidates by their link to the
    question (the last `question` tokens), ties (no link: most) by the first round's order, last the chunks of lines
    it could not take whole. Chunks not among `candidates` (protected ones) keep their scores."""
    out = np.array(scores, np.float64)
    if len(out) != index.n_chunks:
        raise ValueError(f"{len(out)} chunks scored, {index.n_chunks} indexed")
    cand = candidates[candidates < len(out)]
    cand = cand[np.isfinite(out[cand])]
    if len(cand) < 2:
        return out
    asked = (max(0, index.n_tokens - question), index.n_tokens)
    first = out[cand]
    best = int(cand[np.argmax(first)])
    from_question = index.strength(*asked)
    out[cand] = from_question[cand] + 1e-3 * (first - first.min()) / (first.max() - first.min() + 1e-300)
    taken, cut = follow(index, best, asked, cand, len(cand) if budget is None else budget, from_question)
    low, high = out[cand].min(), out[cand].max()
    out[taken] = high + 1 + np.arange(len(taken))[::-1]  # above any link, in the order taken
    out[cut] = low - 1  # below any: part of a needle would mislead
    return out


def follow(index: GramIndex, best: int, asked: tuple[int, int], candidates: np.ndarray, budget: int,
           from_question: np.ndarray | None = None) -> tuple[list[int], list[int]]:
    """Up to `budget` candidates in the order the links take them (see the module's doc): the chunks the question
    names (linked to it at least NAMED times as strongly as the most linked), then the chunks linked to the lines
    taken, most linked first, at most HOPS lines away from the question, as long as any is; then `best` (the first
    round's), and again what its line links to; then the question's other links, whole lines. Chunks that are not
    candidates (protected) are visited for their lines, never taken. Also the candidates linked whose line the budget
    left could not hold whole. `from_question`: index.strength(*asked), when known.

    Its cost goes with the chunks it visits, not the context: the question's links in their order, their lines
    found for as many at once as the budget may take, the lines' links kept in a heap."""
    if budget <= 0:
        return [], []
    free = np.zeros(index.n_chunks, bool)
    free[candidates] = True
    from_question = index.strength(*asked) if from_question is None else from_question
    linked = np.flatnonzero(from_question > 0)
    linked = linked[np.lexsort((linked, -from_question[linked]))]  # most linked first, then the earlier chunk
    n_named = int(np.count_nonzero(from_question[linked] >= max(NAMED * from_question.max(), 1e-9)))
    asked_lines = _AskedLines(index, asked, linked)
    visited = np.zeros(index.n_chunks, bool)  # a named chunk is visited once, whatever took it
    from_lines = np.zeros(index.n_chunks)  # the strongest link from a line taken, not followed yet
    via = np.zeros(index.n_chunks, np.int64)  # that line, in `lines`
    heap: list[tuple[float, int, int]] = []  # (-from_lines, -via, -chunk): the most linked, newest line, last chunk
    lines: list[tuple[int, int, int]] = []  # (start, end, hops from the question)
    seen: set[tuple[int, int]] = set()
    taken: list[int] = []
    cut: list[int] = []  # chunks whose line the budget could not hold whole
    next_named = next_linked = 0

    def visit(chunk: int, line: tuple[int, int] | None, hops: int) -> None:
        """Take `chunk` if it is free, and its `line` (where it matched what linked it), with the chunks that line
        crosses (all or none: a needle cut short misleads more than one left out); the line's links are followed
        later. A chunk taken already is visited too: it may hold the chain's next line."""
        visited[chunk], from_lines[chunk] = True, 0
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
            link = index.strength(*line, pairs_only=True)
            stronger = np.flatnonzero((link >= from_lines) & (link > 0))  # ties: the newer line's (a chain is
            from_lines[stronger], via[stronger] = link[stronger], len(lines)  # followed to its end)
            for c in stronger.tolist():
                heapq.heappush(heap, (-from_lines[c], -len(lines), -c))
            lines.append((*line, hops))

    def strongest_line_link() -> int | None:
        while heap:
            strength, line, chunk = heap[0]
            if from_lines[-chunk] == -strength and via[-chunk] == -line and -strength > 0:
                return -chunk
            heapq.heappop(heap)  # visited since, or linked more strongly by a newer line
        return None

    while len(taken) < budget:
        while next_named < n_named and visited[linked[next_named]]:
            next_named += 1
        while next_linked < len(linked) and not free[linked[next_linked]]:
            next_linked += 1
        if next_named < n_named:  # the chunks the question names
            chunk = int(linked[next_named])
            visit(chunk, asked_lines.get(chunk, budget - len(taken)), 0)
        elif (chunk := strongest_line_link()) is not None:  # the chunks linked to the lines taken
            start, end, hops = lines[via[chunk]]
            visit(chunk, _tuple(index.lines(np.array([chunk]), start, end)[0]), hops + 1)
        elif free[best]:  # the first round's best (and what its line links to)
            visit(best, asked_lines.get(best, budget - len(taken)), 0)
        elif next_linked < len(linked):  # the question's other links, whole lines too (not followed)
            chunk = int(linked[next_linked])
            visit(chunk, asked_lines.get(chunk, budget - len(taken)), HOPS)
        else:
            break
    return taken, cut


class _AskedLines:
    """The lines where chunks match the question, found for the next `ahead` of the question's links at a time (the
    order `follow` takes them in), or one chunk that is not among them."""

    def __init__(self, index: GramIndex, asked: tuple[int, int], linked: np.ndarray):
        self.index, self.asked, self.linked = index, asked, linked
        self.rank = {c: i for i, c in enumerate(linked.tolist())}
        self.known: dict[int, tuple[int, int] | None] = {}

    def get(self, chunk: int, ahead: int) -> tuple[int, int] | None:
        if chunk not in self.known:
            at = self.rank.get(chunk)
            batch = [chunk] if at is None else [c for c in self.linked[at : at + max(1, ahead)].tolist()
                                                  if c not in self.known]
            for c, line in zip(batch, self.index.lines(np.array(batch), *self.asked), strict=True):
                self.known[c] = _tuple(line)
        return self.known[chunk]


def _tuple(line: np.ndarray) -> tuple[int, int] | None:
    return None if line[0] == _NONE else (int(line[0]), int(line[1]))


class SequenceLinks:
    """One sequence's second round: its GramIndex, fed from the sequence's tokens on the engine's thread at each
    reselect (O(new tokens)) and grown and read on the thread scoring it, one round at a time. A round reads the
    index as the history stood when it was taken (`take`), whatever was fed since for later rounds; a round taken
    before another that ran first (a reselect dropped for a prompt's) fails: its scores are never used."""

    def __init__(self, history: Callable[[], Sequence[int]], breaks: np.ndarray | None = None):
        self.history = history
        self.index = GramIndex(breaks)
        self._lock = threading.Lock()  # one round grows and reads the index at a time
        self._changes: deque[tuple[int, list[int]]] = deque()  # (cut to, tokens after): what the index lacks
        self._fed = 0  # history tokens handed over (the engine thread's view)
        self._tail: list[int] = []  # the last of them, still to be found in the history
        self._taken = self._applied = 0  # changes handed over, and applied to the index

    def take(self, n_tokens: int) -> int:
        """Hand over the history's tokens up to n_tokens; returns the ticket `round` reads the index at. Raises
        ValueError if the history holds fewer."""
        history = self.history()
        if len(history) < n_tokens:
            raise ValueError(f"the sequence's history holds {len(history)} tokens, not the {n_tokens} scored")
        if n_tokens < self._fed or list(history[self._fed - len(self._tail) : self._fed]) != self._tail:
            self.cut(0)  # the history changed but by growing, and no cut said so: index it anew
        tokens = list(history[self._fed : n_tokens])
        self._changes.append((self._fed, tokens))
        self._tail = (self._tail + tokens)[-TAIL_CHECK:]
        self._fed, self._taken = n_tokens, self._taken + 1
        return self._taken

    def cut(self, n_tokens: int) -> None:
        """The history was cut to n_tokens."""
        if n_tokens < self._fed:
            self._changes.append((n_tokens, []))
            self._fed, self._tail, self._taken = n_tokens, [], self._taken + 1

    def round(self, ticket: int, scores: np.ndarray, candidates: np.ndarray, question: int,
              budget: int | None = None) -> np.ndarray:
        """link_round on the index as of `ticket`."""
        with self._lock:
            if self._applied > ticket:
                raise RuntimeError(f"link round {ticket} came after round {self._applied}: it was dropped")
            while self._applied < ticket:
                cut_to, tokens = self._changes.popleft()
                self.index.cut(cut_to)
                self.index.extend(tokens)
                self._applied += 1
            return link_round(scores, candidates, self.index, question, budget)


def _pairs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct pairs (a, b) of non-negative int64s below 2**31, sorted by a then b, as (a, b, where each a's run
    starts). (Sorting, as np.unique does; numpy 2.4's np.unique hashes, ten times slower on these sizes.)"""
    pairs = np.sort(a << 32 | b)
    pairs = pairs[_run_starts(pairs)]
    a = pairs >> 32
    return a, pairs & 0xFFFFFFFF, np.flatnonzero(_run_starts(a))


def _any_of(flags: np.ndarray, n: int) -> np.ndarray:
    """bool [len(flags) - n + 1]: whether any of each n consecutive flags is set."""
    out = flags[: max(0, len(flags) - n + 1)].copy()
    for i in range(1, n):
        out |= flags[i : i + len(out)]
    return out


def _run_starts(sorted_values: np.ndarray) -> np.ndarray:
    """bool: where a run of equal values starts."""
    return np.r_[True, sorted_values[1:] != sorted_values[:-1]] if len(sorted_values) else np.zeros(0, bool)


def _grown(a: np.ndarray, n: int, fill: int = 0) -> np.ndarray:
    """`a` with room for n rows (doubling, so appends cost O(1) each), new rows `fill`."""
    if n <= len(a):
        return a
    out = np.full((max(n, 2 * len(a)), *a.shape[1:]), fill, a.dtype)
    out[: len(a)] = a
    return out


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
