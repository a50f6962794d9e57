"""Draft trees: their bookkeeping, the best-first choice against brute force, the walks (greedy, and sampled: the
target's law, chi-square), and the suffix drafter's trees."""

import numpy as np
import pytest

from lucekv.spec.suffix import NGRAMS, SuffixDrafter, SuffixIndex
from lucekv.spec.tree import DraftTree, accept_tree_greedy, accept_tree_sampled, best_first
from tests.spec.test_suffix import match_length

V = 6


def test_depths_ancestors_and_children():
    tree = DraftTree([5, 6, 7, 8, 9], [0, 0, 1, 1, 3])
    assert tree.depths().tolist() == [0, 1, 1, 2, 2, 3]
    assert [int(m) for m in tree.ancestors()] == [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b101011]
    assert tree.child(1, 8) == 4 and tree.child(0, 8) is None
    assert tree.prefix(3) == DraftTree([5, 6, 7], [0, 0, 1])
    chain = DraftTree.chain([4, 4, 4])
    assert chain.parents == [0, 1, 2] and chain.depths().tolist() == [0, 1, 2, 3]
    assert chain.is_chain and DraftTree().is_chain and not tree.is_chain


@pytest.mark.parametrize("tokens, parents", [([1, 2], [0, 2]), ([1, 1], [0, 0]), ([1], [])])
def test_a_malformed_tree_is_refused(tokens, parents):
    with pytest.raises(ValueError):
        DraftTree(tokens, parents)


def test_the_greedy_walk_follows_the_targets_tokens_down_the_tree():
    tree = DraftTree([5, 6, 7, 8], [0, 0, 2, 2])  # 0 -> {5: 1, 6: 2}, 2 -> {7: 3, 8: 4}
    assert accept_tree_greedy(tree, np.array([6, 0, 8, 0, 3])) == ([0, 2, 4], [6, 8, 3])
    assert accept_tree_greedy(tree, np.array([5, 9, 0, 0, 0])) == ([0, 1], [5, 9])
    assert accept_tree_greedy(tree, np.array([4, 0, 0, 0, 0])) == ([0], [4])


def expanding(table):
    """An `expand` over a dict path -> [(token, prob)]."""
    return lambda path: table.get(tuple(path), [])


def test_best_first_takes_the_most_probable_paths():
    """Against brute force over every prefix-closed set: the chosen nodes' path probabilities are the top ones."""
    rng = np.random.default_rng(0)
    for _ in range(30):
        table, paths, frontier = {}, {(): 1.0}, [()]
        for path in frontier:  # a random tree of candidates, 3 levels, up to 3 children each
            if len(path) == 3:
                continue
            kids = rng.choice(9, rng.integers(1, 4), replace=False)
            probs = rng.dirichlet(np.ones(len(kids)))
            table[path] = [(int(t), float(p)) for t, p in zip(kids, probs, strict=True)]
            for t, p in table[path]:
                paths[(*path, t)] = paths[path] * p
                frontier.append((*path, t))
        budget = int(rng.integers(1, 8))
        tree = best_first(expanding(table), budget)
        chosen = sorted(_paths(tree))
        assert len(chosen) == min(budget, len(paths) - 1)
        best = sorted((p for k, p in paths.items() if k), reverse=True)[: len(chosen)]
        np.testing.assert_allclose(sorted((paths[c] for c in chosen), reverse=True), best)


def test_best_first_holds_its_seed_chain_first():
    table = {(): [(1, 0.9), (2, 0.1)], (1,): [(3, 1.0)], (2,): [(4, 1.0)], (2, 4): [(5, 1.0)]}
    tree = best_first(expanding(table), 4, seed=[2, 4, 5])
    assert tree.tokens[:3] == [2, 4, 5] and tree.parents[:3] == [0, 1, 2]
    assert tree.tokens[3] == 1 and tree.parents[3] == 0  # then the best of the rest


def _paths(tree):
    out = []
    for j in range(1, len(tree) + 1):
        path, k = [], j
        while k:
            path.append(tree.tokens[k - 1])
            k = tree.parents[k - 1]
        out.append(tuple(reversed(path)))
    return out


# ---- sampled walks keep the target's law ----------------------------------------------------------------------


class Toy:
    """The target's p1 and p2(. | first token) over V tokens, and a tree of candidates for the first two."""

    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        self.p1, self.p2 = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V), V)
        first = rng.choice(V, 3, replace=False).tolist()
        tokens, parents = list(first), [0, 0, 0]
        for j in range(len(first)):  # two second-level candidates under each
            for u in rng.choice(V, 2, replace=False).tolist():
                tokens.append(u)
                parents.append(j + 1)
        self.tree = DraftTree(tokens, parents)

    def rows(self):
        """Row j: the target's distribution after block index j (the root's p1, a first-level node's p2)."""
        return [self.p1] + [self.p2[t] if p == 0 else np.full(V, 1 / V) for t, p in
                            zip(self.tree.tokens, self.tree.parents, strict=True)]


class Sampler:
    def __init__(self, rows, rng):
        self.rows, self.rng = rows, rng

    def sample(self, i):
        return int(self.rng.choice(V, p=self.rows[i]))


def first_two(toy, rng, walk):
    path, out = walk(toy.tree, toy.rows(), lambda rows: Sampler(rows, rng))
    assert len(path) == len(out) and path[0] == 0
    if len(out) == 1:  # the round ended after one token: the next one comes from plain decoding
        out.append(int(rng.choice(V, p=toy.p2[out[0]])))
    return out[:2]


def biased_walk(tree, rows, host):
    """Descends into the first child whenever the target's draw names any child (not the one it names)."""
    target = host(rows)
    t = target.sample(0)
    kids = [j for j in range(1, len(tree) + 1) if tree.parents[j - 1] == 0]
    if not any(tree.tokens[j - 1] == t for j in kids):
        return [0], [t]
    return [0, kids[0]], [tree.tokens[kids[0] - 1], int(np.argmax(rows[kids[0]]))]


def test_the_sampled_tree_walk_emits_tokens_distributed_as_the_target():
    """5 000 rounds: the joint law of the first two emitted tokens against the target's, chi-square with 35
    degrees of freedom (p = 0.001 at 66.6); a walk that descends into the wrong child fails the same test (by far:
    thousands at 10 000 rounds)."""
    n, df_bound = 5_000, 66.6
    for seed in range(2):
        toy = Toy(seed)
        exact = (toy.p1[:, None] * toy.p2).ravel()
        for walk, biased in ((accept_tree_sampled, False), (biased_walk, True)):
            rng = np.random.default_rng(100 + seed)
            counts = np.zeros((V, V))
            for _ in range(n):
                a, b = first_two(toy, rng, walk)
                counts[a, b] += 1
            keep = exact > 0
            stat = float(np.sum((counts.ravel()[keep] - n * exact[keep]) ** 2 / (n * exact[keep])))
            assert (stat > df_bound) == biased, (seed, walk.__name__, stat)


# ---- the suffix drafter's trees -------------------------------------------------------------------------------


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "one by one"])
def test_occurrences_are_every_earlier_continuation_of_the_suffix(bulk):
    rng = np.random.default_rng(5)
    for _ in range(100):
        tokens = rng.integers(0, 3, rng.integers(1, 200)).tolist()
        index = SuffixIndex()
        if bulk:
            index.extend(tokens[: len(tokens) // 2])
            index.extend(tokens[len(tokens) // 2 :])
        else:
            for t in tokens:
                index.extend([t])
        expected, seen = [], set()
        for n in sorted(NGRAMS, reverse=True):
            for start in range(len(tokens) - 1, n - 1, -1):
                if tokens[start - n : start] == tokens[len(tokens) - n :] and start not in seen:
                    seen.add(start)
                    expected.append((start, match_length(tokens, start, tokens)))
        found = [(m.start, m.length) for m in index.occurrences(index, 10**6)]
        assert found == expected
        assert found[:3] == [(m.start, m.length) for m in index.occurrences(index, 3)]


def test_a_suffix_tree_holds_the_chain_and_the_other_continuations():
    history = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 1, 2]
    chain, tree = SuffixDrafter(), SuffixDrafter(tree=True)
    for d in (chain, tree):
        d.begin(history)
    draft, proposal = chain.propose(8), tree.propose(8)
    assert proposal.tokens[: len(draft)] == draft.tokens and proposal.parents[: len(draft)] == [0, 1]
    # what followed each occurrence of the suffix [1, 2], as far as its match (2 tokens) lets it: 3 7, 5 6, 3 4
    assert set(_paths(proposal)) == {(3,), (3, 7), (5,), (3, 4), (5, 6)}
    assert tree.propose(0) == DraftTree() and SuffixDrafter(tree=True).propose(4) == DraftTree()


def test_every_path_of_a_suffix_tree_is_a_continuation_seen_before():
    rng = np.random.default_rng(9)
    for _ in range(50):
        history = rng.integers(0, 4, 120).tolist()
        drafter = SuffixDrafter(tree=True)
        drafter.begin(history)
        proposal = drafter.propose(12)
        assert len(proposal) <= 12
        text = "," + ",".join(map(str, history)) + ","
        for path in _paths(proposal):
            # a continuation past the history's end repeats the last match's period: check the first two tokens
            head = "," + ",".join(map(str, path[:2])) + ","
            assert head in text


def test_tree_nodes_are_numbered_parents_first():
    rng = np.random.default_rng(2)
    for _ in range(20):
        d = SuffixDrafter(tree=True)
        d.begin(rng.integers(0, 3, 80).tolist())
        t = d.propose(16)
        assert all(p < j for j, p in enumerate(t.parents, start=1))
        assert len(set(zip(t.parents, t.tokens, strict=True))) == len(t)


def test_a_dflash_block_tree_holds_the_argmax_chain_then_the_most_probable_paths():
    from lucekv.spec.dflash import block_tree

    logits = np.log(np.array([[0.6, 0.3, 0.1, 0.0 + 1e-9], [0.5, 0.4, 0.05, 0.05]]))
    tree = block_tree(logits, 4)
    assert tree.tokens[:2] == [0, 0] and tree.parents[:2] == [0, 1]
    # then 0 -> 1 (0.6 * 0.4 = 0.24) and 1 (0.3), by probability: 1 at the root first
    assert tree.tokens[2:] == [1, 1] and tree.parents[2:] == [0, 1]
