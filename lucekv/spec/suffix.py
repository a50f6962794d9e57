"""The suffix drafter: what followed the most recent earlier occurrence of the sequence's longest matching suffix
(prompt lookup / SuffixDecoding, algorithms.md §4.4 and §4.7). No weights: strong where output repeats what the
context holds (edits of a file it was shown, tool output, code), silent elsewhere.

`SuffixIndex` maps every n-gram (n in NGRAMS) of a token sequence to the latest place it was followed by a
token, keyed by a polynomial hash mod 2^64 of its tokens. Appending a token costs one hash and one dict write
per n; a proposal, one lookup per n and a bounded walk that measures how far the match extends backwards.
A long prompt is indexed with numpy in one go. Hash collisions cannot make a wrong output (verification rejects
a wrong draft), and a match is confirmed on the tokens anyway.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from lucekv.engine.sampling import SamplingParams
from lucekv.spec.drafter import Draft
from lucekv.spec.tree import DraftTree, best_first

NGRAMS = (2, 3, 4, 6, 8)  # suffix lengths looked up, longest first; 1-grams match too much to be worth a verify
MAX_MATCH = 64  # a match is measured backwards this far at most
BASE = 0x100000001B3  # odd, so invertible mod 2^64 (the bulk hashing divides by it)
MASK = (1 << 64) - 1
_BULK = 64  # appends of this many tokens or more are hashed with numpy
TREE_OCCURRENCES = 8  # earlier occurrences of the suffix a tree proposal reads at most
MIN_PATH_PROB = 0.1  # a tree's paths less likely than this (by the occurrences' shares) are not proposed
_COMPACT_MIN = 4096  # a table's recent entries merge into its sorted arrays past this many (and half of those)


class _Table:
    """One n's hash -> latest continuation start: sorted numpy arrays for the bulk, a dict for the appends since
    (12 bytes an entry instead of a Python dict's ~100: a 100K-token session's index stays a few MB). `earlier[s]`:
    the continuation start before s of the same hash (-1: none), so a tree walks a suffix's earlier occurrences."""

    def __init__(self) -> None:
        self.keys = np.empty(0, np.uint64)
        self.starts = np.empty(0, np.int64)
        self.recent: dict[int, int] = {}
        self._limit = _COMPACT_MIN  # recent entries past this merge into the arrays
        self.earlier = np.full(1024, -1, np.int32)
        self._unresolved: list[tuple[int, int]] = []  # (hash, start) put whose earlier start the arrays hold

    def get(self, h: int) -> int | None:
        start = self.recent.get(h)
        if start is not None:
            return start
        i = int(np.searchsorted(self.keys, np.uint64(h)))
        if i < len(self.keys) and int(self.keys[i]) == h:
            return int(self.starts[i])
        return None

    def put(self, h: int, start: int) -> None:
        before = self.recent.get(h)
        if before is None:  # the arrays' entry, if any: looked up in bulk when wanted (a searchsorted costs ~2 us)
            self._unresolved.append((h, start))
        else:
            self._grow(start + 1)
            self.earlier[start] = before
        self.recent[h] = start  # starts only grow: the latest occurrence wins
        if len(self.recent) > self._limit:
            self.put_many(np.empty(0, np.uint64), np.empty(0, np.int64))

    def put_many(self, hashes: np.ndarray, starts: np.ndarray) -> None:
        """Merge `hashes` (continuations `starts`, later than every entry held) and the recent dict into the arrays."""
        self._resolve()
        recent_keys = np.fromiter(self.recent.keys(), np.uint64, len(self.recent))
        recent_starts = np.fromiter(self.recent.values(), np.int64, len(self.recent))
        new = len(self.keys) + len(recent_keys)  # entries from here on are `hashes`
        keys = np.concatenate([self.keys, recent_keys, hashes])
        starts = np.concatenate([self.starts, recent_starts, starts])
        order = np.lexsort((starts, keys))  # by key, then start: each key's latest start comes last
        keys, starts = keys[order], starts[order]
        last = np.ones(len(keys), bool)
        last[:-1] = keys[1:] != keys[:-1]
        if len(hashes):  # each new start's predecessor of the same key is the entry just before it
            is_new = order >= new
            before = np.full(len(keys), -1, np.int64)
            before[1:] = np.where(keys[1:] == keys[:-1], starts[:-1], -1)
            self._grow(int(starts[is_new].max()) + 1)
            self.earlier[starts[is_new]] = before[is_new]
        self.keys, self.starts = keys[last], starts[last]
        self.recent = {}
        self._limit = max(_COMPACT_MIN, len(self.keys) // 2)

    def occurrences(self, start: int) -> Iterator[int]:
        """`start` and the continuation starts of the same hash before it, latest first."""
        self._resolve()
        while start >= 0:
            yield start
            start = int(self.earlier[start])

    def _resolve(self) -> None:
        """The earlier starts of the puts that found none in `recent`: the arrays' entries of their hashes."""
        if not self._unresolved:
            return
        hashes = np.array([h for h, _ in self._unresolved], np.uint64)
        starts = np.array([st for _, st in self._unresolved], np.int64)
        self._unresolved = []
        at = np.minimum(np.searchsorted(self.keys, hashes), max(len(self.keys) - 1, 0))
        found = (self.keys[at] == hashes) if len(self.keys) else np.zeros(len(hashes), bool)
        self._grow(int(starts.max()) + 1)
        self.earlier[starts] = np.where(found, self.starts[at] if len(self.keys) else -1, -1)

    def _grow(self, size: int) -> None:
        if size > len(self.earlier):
            more = np.full(max(size, 2 * len(self.earlier)) - len(self.earlier), -1, np.int32)
            self.earlier = np.concatenate([self.earlier, more])

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.starts.nbytes + self.earlier.nbytes + 100 * len(self.recent)


@dataclass(frozen=True)
class Match:
    index: SuffixIndex
    start: int  # index.tokens[start] followed the matched suffix
    length: int  # tokens of the suffix that match (>= the n-gram found)


class SuffixIndex:
    """The n-grams of an append-only token sequence, each with where it was last followed by a token."""

    def __init__(self, ngrams: Sequence[int] = NGRAMS):
        self.ngrams = tuple(sorted(ngrams, reverse=True))
        self.tokens: list[int] = []
        self._prefix = np.zeros(1024, np.uint64)  # _prefix[i]: the hash of tokens[:i]
        self._pow = {n: pow(BASE, n, 1 << 64) for n in self.ngrams}
        self._tables = {n: _Table() for n in self.ngrams}

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self._prefix.nbytes + sum(t.nbytes for t in self._tables.values()) + 8 * len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        if len(tokens) >= _BULK:
            self._extend_bulk(tokens)
            return
        for t in tokens:
            self._append(int(t))

    def suffix_hash(self, n: int) -> int:
        """The hash of the last n tokens (n <= len)."""
        end = len(self.tokens)
        return self._window_hash(end - n, end)

    def find(self, query: SuffixIndex) -> Match | None:
        """The latest place where this sequence continued the longest of `query`'s suffix n-grams, and how long the
        match really is. `query` may be this index itself: a suffix is only indexed once followed, so a match is
        always an earlier occurrence."""
        q = query.tokens
        for n in self.ngrams:
            if len(q) < n:
                continue
            start = self._tables[n].get(query.suffix_hash(n))
            if start is None or self.tokens[start - n : start] != q[len(q) - n :]:
                continue
            return Match(self, start, self._match_length(start, n, q))
        return None

    def occurrences(self, query: SuffixIndex, limit: int) -> list[Match]:
        """Up to `limit` places where this sequence continued one of `query`'s suffix n-grams: the longest n-grams'
        first, each n's latest first, every start once."""
        q, out, seen = query.tokens, [], set()
        for n in self.ngrams:
            if len(q) < n:
                continue
            first = self._tables[n].get(query.suffix_hash(n))
            for start in self._tables[n].occurrences(-1 if first is None else first):
                if len(out) == limit:
                    return out
                if start not in seen and self.tokens[start - n : start] == q[len(q) - n :]:
                    seen.add(start)
                    out.append(Match(self, start, self._match_length(start, n, q)))
        return out

    def _match_length(self, start: int, n: int, q: list[int]) -> int:
        """How far the n tokens before `start` extend backwards as a match of q's suffix (MAX_MATCH at most)."""
        length = n
        while (length < MAX_MATCH and start - length > 0 and length < len(q)
               and self.tokens[start - length - 1] == q[len(q) - length - 1]):
            length += 1
        return length

    def continuation(self, start: int, k: int, query: SuffixIndex) -> list[int]:
        """k tokens from `start` on. Where they run past this sequence's end and the match is in `query`'s own
        history, the sequence repeats with the period the match shows (a loop in the output continues)."""
        end = min(start + k, len(self.tokens))
        out = self.tokens[start:end]
        if len(out) < k and self is query:
            period = len(self.tokens) - start
            out += [self.tokens[start + j % period] for j in range(len(out), k)]
        return out

    def _append(self, t: int) -> None:
        i = len(self.tokens)
        self.tokens.append(t)
        if i + 1 >= len(self._prefix):
            self._prefix = np.concatenate([self._prefix, np.zeros(len(self._prefix), np.uint64)])
        # the prefix hashes the n-grams need, as Python ints in one read (numpy scalars cost ~0.1 us each)
        lo = max(0, i - self.ngrams[0])
        prefix = self._prefix[lo : i + 1].tolist()
        last = prefix[-1]
        self._prefix[i + 1] = (last * BASE + t + 1) & MASK
        tables, pows = self._tables, self._pow
        for n in self.ngrams:  # the n-gram just before t is now followed (by t, at index i)
            if i >= n:
                tables[n].put((last - prefix[i - n - lo] * pows[n]) & MASK, i)

    def _extend_bulk(self, tokens: Sequence[int]) -> None:
        t = np.asarray(tokens, np.int64).astype(np.uint64) + np.uint64(1)
        i0, m = len(self.tokens), len(t)
        self.tokens.extend(int(x) for x in tokens)
        size = len(self._prefix)
        while size <= i0 + m:
            size *= 2
        if size > len(self._prefix):
            self._prefix = np.concatenate([self._prefix, np.zeros(size - len(self._prefix), np.uint64)])
        # P[i0 + j] = B^j (P[i0] + sum_{l < j} t_l B^-(l+1)), mod 2^64 (numpy's uint64 arithmetic wraps)
        inv = pow(BASE, -1, 1 << 64)
        inv_pows = np.multiply.accumulate(np.full(m, inv, np.uint64))  # B^-1 .. B^-m
        pows = np.multiply.accumulate(np.full(m, BASE, np.uint64))  # B^1 .. B^m
        sums = np.cumsum(t * inv_pows, dtype=np.uint64) + self._prefix[i0]
        self._prefix[i0 + 1 : i0 + m + 1] = pows * sums
        for n in self.ngrams:
            starts = np.arange(max(i0, n), i0 + m, dtype=np.int64)  # each new token follows the n-gram before it
            if len(starts):
                hashes = self._prefix[starts] - self._prefix[starts - n] * np.uint64(self._pow[n])
                self._tables[n].put_many(hashes, starts)

    def _window_hash(self, start: int, end: int) -> int:
        return (int(self._prefix[end]) - int(self._prefix[start]) * self._pow[end - start]) & MASK


class SuffixDrafter:
    """Drafts from the sequence's own history (prompt and output) and, where that has no match, from a shared index
    of recent outputs (`RecentOutputs`, server-wide). Draft length grows with the match: k = ceil(per_match * m); the
    match's continuation up to max_len comes along as the draft's `more` (the speculator fills its verify block with
    it).

    With `tree`, a proposal is a DraftTree of up to max_len nodes: the chain above first, then best-first over what
    followed the suffix's earlier occurrences (up to TREE_OCCURRENCES of them, each continued as far as the chain
    rule lets its own match: ceil(per_match * its match length)), a next token's probability being its share of
    the occurrences that reach it, weighted by their match lengths; paths below MIN_PATH_PROB are left out
    (SuffixDecoding's tree, algorithms.md §4.4)."""

    def __init__(self, shared: RecentOutputs | None = None, per_match: float = 1.0, tree: bool = False):
        self.index = SuffixIndex()
        self.shared = shared
        self.per_match = per_match
        self.tree = tree
        self.name = "suffix-tree" if tree else "suffix"
        self.cheap = not tree  # the gate's shadow scores chains
        self._turn_start = 0

    def begin(self, tokens: Sequence[int], params: SamplingParams | None = None) -> None:
        """Keeps the index when `tokens` continue what it holds (a session's next turn), else indexes afresh."""
        n = len(self.index)
        if n > len(tokens) or self.index.tokens != list(tokens[:n]):
            self.index, n = SuffixIndex(self.index.ngrams), 0
        self.index.extend(tokens[n:])
        self._turn_start = len(tokens)

    def propose(self, max_len: int) -> Draft | DraftTree:
        chain = self._chain(max_len)
        return self._tree(chain.tokens, max_len) if self.tree else chain

    def _chain(self, max_len: int) -> Draft:
        if max_len <= 0:
            return Draft()
        match = self.index.find(self.index)
        if self.shared is not None:
            other = self.shared.index.find(self.index)
            if other is not None and (match is None or other.length > match.length):
                match = other
        if match is None:
            return Draft()
        k = min(max_len, math.ceil(self.per_match * match.length))
        tokens = match.index.continuation(match.start, max_len, self.index)
        return Draft(tokens[:k], more=tokens[k:])

    def _tree(self, chain: list[int], budget: int) -> DraftTree:
        if budget <= 0:
            return DraftTree()
        followers = [(self.index.continuation(m.start, min(budget, math.ceil(self.per_match * m.length)), self.index),
                      m.length) for m in self.index.occurrences(self.index, TREE_OCCURRENCES)]

        def expand(path: Sequence[int]) -> list[tuple[int, float]]:
            d = len(path)
            weights: dict[int, float] = {}
            for tokens, n in followers:
                if len(tokens) > d and tokens[:d] == list(path):
                    weights[tokens[d]] = weights.get(tokens[d], 0) + n
            total = sum(weights.values())
            return [(t, w / total) for t, w in weights.items()]

        return best_first(expand, budget, seed=chain, min_prob=MIN_PATH_PROB)

    def accept(self, tokens: Sequence[int]) -> None:
        self.index.extend(tokens)

    def end(self) -> None:
        if self.shared is not None:
            self.shared.add(self.index.tokens[self._turn_start :])
        self._turn_start = len(self.index)


class RecentOutputs:
    """A server-wide suffix index over the latest outputs of every turn, at most about `capacity` tokens (when
    full, the older half is dropped by re-indexing the newer half)."""

    def __init__(self, capacity: int = 1 << 18):
        self.capacity = capacity
        self.index = SuffixIndex()

    def add(self, tokens: Sequence[int]) -> None:
        if len(self.index) + len(tokens) > self.capacity:
            keep = (self.index.tokens + list(tokens))[-(self.capacity // 2) :]
            self.index = SuffixIndex(self.index.ngrams)
            self.index.extend(keep)
            return
        self.index.extend(tokens)
