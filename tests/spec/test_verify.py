"""Acceptance rules of a verify forward; above temperature 0 the emitted tokens must follow the target's law."""

import numpy as np

from lucekv.spec.drafter import Draft
from lucekv.spec.verify import accept_greedy, accept_rejection, accept_sampled

V = 6


def test_greedy_accepts_the_matching_prefix_then_the_targets_token():
    draft = Draft([4, 5, 6])
    assert accept_greedy(draft, np.array([4, 5, 9, 1])) == [4, 5, 9]
    assert accept_greedy(draft, np.array([4, 5, 6, 1])) == [4, 5, 6, 1]  # all accepted: the bonus
    assert accept_greedy(draft, np.array([7, 5, 6, 1])) == [7]
    assert accept_greedy(Draft(), np.array([3])) == [3]


class Scripted:
    """A TargetSampler whose draws are scripted."""

    def __init__(self, draws):
        self.draws, self.calls = iter(draws), []

    def sample(self, i):
        self.calls.append(i)
        return next(self.draws)


def test_sampled_emits_the_targets_draws_until_one_differs_from_the_draft():
    target = Scripted([4, 5, 8, 1])
    assert accept_sampled(Draft([4, 5, 6]), target) == [4, 5, 8]
    assert target.calls == [0, 1, 2]  # no draw past the first mismatch
    assert accept_sampled(Draft([1]), Scripted([1, 1])) == [1, 1]


class Chain:
    """A two-position toy: the target's p1 and p2(. | first token), a draft's q1 and q2(. | first draft token)."""

    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        self.p1, self.q1 = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V) * 0.5)
        self.p2, self.q2 = rng.dirichlet(np.ones(V), V), rng.dirichlet(np.ones(V) * 0.5, V)

    def exact(self):
        return self.p1[:, None] * self.p2  # the target's law of the first two tokens


class ToyTarget:
    def __init__(self, chain, draft, rng):
        self.chain, self.draft, self.rng, self.kept = chain, draft, rng, []

    def probs(self, i):
        return self.chain.p1 if i == 0 else self.chain.p2[self.draft.tokens[0]]

    def draw(self, probs):
        t = int(self.rng.choice(V, p=probs / probs.sum()))
        self.kept.append(t)
        return t

    def uniform(self):
        return self.rng.random()

    def keep(self, token):
        self.kept.append(token)


def first_two(chain, rng, rule):
    x1 = int(rng.choice(V, p=chain.q1))
    x2 = int(rng.choice(V, p=chain.q2[x1]))
    draft = Draft([x1, x2], np.stack([chain.q1, chain.q2[x1]]))
    out = rule(draft, ToyTarget(chain, draft, rng))
    if len(out) == 1:  # the round stopped after one token: the next one comes from plain decoding
        out.append(int(rng.choice(V, p=chain.p2[out[0]])))
    return out[:2]


def chi2(counts, expected):
    keep = expected > 0
    return float(np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep]))


def biased_rule(draft, target):
    """Accepts with p/q like the real rule, but on rejection draws from p instead of the residual."""
    out = []
    for i, (x, q) in enumerate(zip(draft.tokens, draft.probs, strict=True)):
        p = target.probs(i)
        if target.uniform() * q[x] < p[x]:
            out.append(x)
            continue
        out.append(target.draw(p))
        return out
    return out


def test_the_rejection_rule_emits_tokens_distributed_as_the_target():
    """20 000 rounds: the joint law of the first two emitted tokens against the target's, chi-square with 35
    degrees of freedom (p = 0.001 at 66.6); a rule that draws from p instead of the residual fails the same test."""
    n, df_bound = 20_000, 66.6
    for seed in range(3):
        chain = Chain(seed)
        rng = np.random.default_rng(100 + seed)
        for rule, biased in ((accept_rejection, False), (biased_rule, True)):
            counts = np.zeros((V, V))
            for _ in range(n):
                a, b = first_two(chain, rng, rule)
                counts[a, b] += 1
            stat = chi2(counts.ravel(), n * chain.exact().ravel())
            assert (stat > df_bound) == biased, (seed, rule.__name__, stat)
