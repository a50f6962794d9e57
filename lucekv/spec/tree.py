"""Draft trees (DDTree, algorithms.md §2): several candidates per depth, verified in one target forward.

A tree's verify block is [last, n_1 .. n_k]: block index 0 is the sequence's last token (the root), node j sits
at block index j and its parent at `parents[j - 1]` < j, so a node comes after its ancestors. A node's position
is the root's plus its depth; each node attends to the context and to its ancestors only (`ancestors`). The
accepted path is the longest one whose every token the target chose at its parent, plus the target's own next
token: greedy, its argmax (`accept_tree_greedy`); sampled, a draw at each node of the path, descending while it
names a child (`accept_tree_sampled`): the emitted tokens are the target's own draws, so their law is the
target's (for deterministic children this is the multi-candidate rejection rule, algorithms.md §3.3).

Which nodes a tree holds: the `budget` paths of highest estimated probability, chosen best-first (`best_first`).
Bookkeeping only: no numba, no GPU.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from lucekv.spec.verify import TargetSampler

MAX_NODES = 62  # a node's ancestors fit one int64 bit mask (bits 0..62) with the root's bit


@dataclass(frozen=True)
class DraftTree:
    """Nodes 1..len(tokens) of a verify block (0 is the root): node j's token `tokens[j - 1]`, its parent
    `parents[j - 1]` (< j). Siblings carry distinct tokens."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or len(self.tokens) > MAX_NODES:
            raise ValueError(f"a draft tree of {len(self.tokens)} tokens and {len(self.parents)} parents (at most "
                             f"{MAX_NODES} nodes)")
        seen = set()
        for j, p in enumerate(self.parents, start=1):
            if not 0 <= p < j or (p, self.tokens[j - 1]) in seen:
                raise ValueError(f"node {j}: parent {p} must precede it and siblings carry distinct tokens")
            seen.add((p, self.tokens[j - 1]))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """Each node the child of the one before (no node at all included)."""
        return self.parents == list(range(len(self)))

    def prefix(self, n: int) -> DraftTree:
        """Its first n nodes: a tree too, as parents come first."""
        return self if n >= len(self) else DraftTree(self.tokens[:n], self.parents[:n])

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(list(tokens), list(range(len(tokens))))

    def depths(self) -> np.ndarray:
        """int32 [1 + len]: each block index's depth (the root's 0)."""
        d = np.zeros(1 + len(self), np.int32)
        for j, p in enumerate(self.parents, start=1):
            d[j] = d[p] + 1
        return d

    def ancestors(self) -> np.ndarray:
        """int64 [1 + len]: bit i of entry j is set iff block index i is j or one of its ancestors (what j sees of
        the block)."""
        m = np.zeros(1 + len(self), np.int64)
        m[0] = 1
        for j, p in enumerate(self.parents, start=1):
            m[j] = m[p] | (1 << j)
        return m

    def child(self, node: int, token: int) -> int | None:
        """The child of `node` that carries `token`, if any."""
        for j in range(node + 1, len(self) + 1):
            if self.parents[j - 1] == node and self.tokens[j - 1] == token:
                return j
        return None


def accept_tree_greedy(tree: DraftTree, targets: np.ndarray) -> tuple[list[int], list[int]]:
    """The accepted path's block indices (the root first) and the tokens the round emits: the path's node tokens
    then the target's greedy token after its last node. targets[j]: the greedy token after block index j."""
    path = [0]
    while (nxt := tree.child(path[-1], int(targets[path[-1]]))) is not None:
        path.append(nxt)
    return path, [*(tree.tokens[j - 1] for j in path[1:]), int(targets[path[-1]])]


def accept_tree_sampled(tree: DraftTree, rows, host: Callable[[_AlongPath], TargetSampler]
                        ) -> tuple[list[int], list[int]]:
    """As accept_tree_greedy, with a draw of the request's sampler at each node of the path: `host(rows)` is the
    sampler over the block's logits, whose i-th emitted token comes from the row of the path's i-th node."""
    path = [0]
    target = host(_AlongPath(rows, path))
    tokens = []
    while True:
        tokens.append(target.sample(len(tokens)))
        nxt = tree.child(path[-1], tokens[-1])
        if nxt is None:
            return path, tokens
        path.append(nxt)


class _AlongPath:
    """A verify block's logits read along a path that grows as it is walked: row i is the path's i-th node's."""

    def __init__(self, rows, path: list[int]):
        self._rows, self._path = rows, path

    def __getitem__(self, i: int) -> np.ndarray:
        return self._rows[self._path[i]]


Expand = Callable[[Sequence[int]], Sequence[tuple[int, float]]]


def best_first(expand: Expand, budget: int, seed: Sequence[int] = (), min_prob: float = 0.0) -> DraftTree:
    """The tree of the `budget` most probable paths: `expand(path)` gives the candidate next tokens after a path of
    tokens (from the root) with their probabilities given the path. A path's estimated probability is the product
    along it, so a node never outranks its parent and the chosen set stays a tree (algorithms.md §2.1); ties go to
    the candidate offered first. `seed`: a chain taken first whatever its estimate (the chain drafter's proposal:
    the tree then holds it; a seed token `expand` does not offer counts as certain). Paths less probable than
    `min_prob` are left out."""
    tokens: list[int] = []
    parents: list[int] = []
    paths: list[tuple[int, ...]] = [()]
    offers = [dict(expand(()))]  # node -> {token: probability given its path}
    heap: list[tuple[float, int, int, int]] = []  # (-path probability, arrival, parent, token)
    arrival = itertools.count()

    def offer(node: int, prob: float) -> None:
        for t, p in offers[node].items():
            if p > 0 and prob * p >= min_prob:
                heapq.heappush(heap, (-prob * p, next(arrival), node, t))

    def add(parent: int, token: int, prob: float) -> None:
        tokens.append(token)
        parents.append(parent)
        paths.append((*paths[parent], token))
        offers.append(dict(expand(paths[-1])))
        offer(len(tokens), prob)

    offer(0, 1.0)
    prob = 1.0
    for t in seed[:budget]:
        prob *= offers[len(tokens)].get(t, 1.0)
        add(len(tokens), t, prob)
    taken = set(zip(parents, tokens, strict=True))
    while heap and len(tokens) < budget:
        neg, _, parent, token = heapq.heappop(heap)
        if (parent, token) not in taken:
            taken.add((parent, token))
            add(parent, token, -neg)
    return DraftTree(tokens, parents)
