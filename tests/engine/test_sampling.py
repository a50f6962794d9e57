import numpy as np
import pytest

from lucekv.engine.sampling import Sampler, SamplingParams
from lucekv.errors import InvalidRequestError

V = 50


def logits(seed=0):
    return np.random.default_rng(seed).normal(0, 2, V).astype(np.float32)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("field,value,phrase", [
    ("temperature", -1.0, "temperature"),
    ("temperature", float("nan"), "finite"),
    ("temperature", 1e9, "temperature"),
    ("top_k", -3, "top_k"),
    ("top_p", 0.0, "top_p"),
    ("top_p", 1.5, "top_p"),
    ("min_p", 2.0, "min_p"),
    ("repetition_penalty", 0.0, "repetition_penalty"),
    ("presence_penalty", 5.0, "presence_penalty"),
    ("frequency_penalty", float("inf"), "finite"),
    ("seed", -1, "seed"),
    ("max_tokens", 0, "max_tokens"),
    ("min_tokens", 10**6, "min_tokens"),
    ("stop", [""], "stop"),
    ("top_logprobs", 99, "top_logprobs"),
    ("stop_token_ids", [V + 5], "stop_token_ids"),
])
def test_bad_values_name_the_field(field, value, phrase):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value}).validate(vocab_size=V)
    assert e.value.field == field
    assert phrase in str(e.value)


def test_greedy_is_argmax():
    x = logits()
    assert Sampler(SamplingParams(temperature=0.0), [], V).sample(x) == int(np.argmax(x))


def test_top_k_one_and_tiny_top_p_are_greedy():
    x = logits(1)
    for p in (SamplingParams(top_k=1, seed=3), SamplingParams(top_p=1e-6, seed=3)):
        s = Sampler(p, [], V)
        assert {s.sample(x) for _ in range(50)} == {int(np.argmax(x))}


def test_same_seed_same_tokens_and_different_seed_differs():
    x = logits(2)

    def draw(seed):
        s = Sampler(SamplingParams(seed=seed), [], V)
        return [s.sample(x) for _ in range(64)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_temperature_one_follows_the_softmax():
    x = logits(3)
    s = Sampler(SamplingParams(seed=0), [], V)
    n = 20000
    counts = np.bincount([s.sample(x) for _ in range(n)], minlength=V)
    p = softmax(x.astype(np.float64))
    top = np.argsort(-p)[:5]
    # binomial standard error; 5 sigma
    assert np.all(np.abs(counts[top] / n - p[top]) < 5 * np.sqrt(p[top] * (1 - p[top]) / n))


def test_top_k_and_min_p_restrict_support():
    x = logits(4)
    order = np.argsort(-x)
    s = Sampler(SamplingParams(top_k=3, seed=1), [], V)
    assert {s.sample(x) for _ in range(300)} <= set(order[:3].tolist())
    p = softmax(x.astype(np.float64))
    allowed = set(np.flatnonzero(p >= 0.5 * p.max()).tolist())
    s = Sampler(SamplingParams(min_p=0.5, seed=1), [], V)
    assert {s.sample(x) for _ in range(300)} <= allowed


def test_top_p_keeps_the_smallest_covering_prefix():
    x = np.full(V, -10.0, np.float32)
    x[[3, 7, 9]] = [3.0, 2.0, 1.0]
    p = softmax(x.astype(np.float64))
    s = Sampler(SamplingParams(top_p=float(p[3] + p[7] * 0.5), seed=0), [], V)
    assert {s.sample(x) for _ in range(300)} == {3, 7}


def test_penalties_push_seen_tokens_down():
    x = np.zeros(V, np.float32)
    x[5], x[6] = 2.0, 1.9
    s = Sampler(SamplingParams(temperature=0.0, repetition_penalty=1.2), prompt_ids=[5], vocab_size=V)
    assert s.sample(x) == 6  # 2.0 / 1.2 < 1.9
    s = Sampler(SamplingParams(temperature=0.0, presence_penalty=0.5), prompt_ids=[], vocab_size=V)
    s.observe(5)
    assert s.sample(x) == 6
    s = Sampler(SamplingParams(temperature=0.0, frequency_penalty=0.05), prompt_ids=[], vocab_size=V)
    s.observe(5)
    assert s.sample(x) == 5  # one occurrence costs 0.05: still ahead
    s.observe(5)
    s.observe(5)
    assert s.sample(x) == 6


def test_banned_tokens_are_never_drawn():
    x = logits(5)
    best = int(np.argmax(x))
    assert Sampler(SamplingParams(temperature=0.0), [], V).sample(x, banned=[best]) != best
