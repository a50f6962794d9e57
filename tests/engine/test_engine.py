"""The generation loop on tiny synthetic models: finish reasons, stops, seeds, and bad requests."""

from unittest import mock

import pytest

import lucekv
from lucekv.engine.sampling import SamplingParams
from lucekv.errors import ContextOverflowError, InvalidRequestError
from lucekv.model.synth import write_synthetic_gguf


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_synthetic_gguf(tmp_path_factory.mktemp("m") / "tiny-llama.gguf", "llama", n_ctx=128)
    return lucekv.load(path, backend="cpu")


def run(engine, prompt, **kw):
    return list(engine.generate(prompt, SamplingParams(**kw)))


def tokens(deltas):
    return [t for d in deltas for t in d.token_ids]


def test_length_finish_and_text_equals_decode(engine):
    out = run(engine, "hello world", temperature=0.0, max_tokens=12, ignore_eos=True)
    assert len(out) == 12
    assert [d.finish_reason for d in out] == [None] * 11 + ["length"]
    assert "".join(d.text for d in out) == engine.tokenizer.decode(tokens(out))
    usage = out[-1].usage
    assert usage.prompt_tokens == len(engine.tokenizer.encode("hello world"))
    assert usage.completion_tokens == 12


def test_same_seed_same_output_and_greedy_is_deterministic(engine):
    a = tokens(run(engine, "abc", temperature=1.0, seed=11, max_tokens=16, ignore_eos=True))
    b = tokens(run(engine, "abc", temperature=1.0, seed=11, max_tokens=16, ignore_eos=True))
    c = tokens(run(engine, "abc", temperature=1.0, seed=12, max_tokens=16, ignore_eos=True))
    assert a == b and a != c
    g1 = tokens(run(engine, "abc", temperature=0.0, max_tokens=8, ignore_eos=True))
    g2 = tokens(run(engine, "abc", temperature=0.0, max_tokens=8, ignore_eos=True))
    assert g1 == g2


def test_prompt_kinds_agree(engine):
    ids = engine.tokenizer.encode("the cat sat")
    by_text = tokens(run(engine, "the cat sat", temperature=0.0, max_tokens=6, ignore_eos=True))
    by_ids = tokens(run(engine, ids, temperature=0.0, max_tokens=6, ignore_eos=True))
    assert by_text == by_ids
    chat = run(engine, [{"role": "user", "content": "hi"}], temperature=0.0, max_tokens=3, ignore_eos=True)
    assert len(chat) == 3


def test_stop_token_id_ends_with_stop(engine):
    free = tokens(run(engine, "xyz", temperature=0.0, max_tokens=10, ignore_eos=True))
    target = free[4]
    cut = free.index(target)
    out = run(engine, "xyz", temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[target])
    assert tokens(out) == free[: cut + 1]
    assert out[-1].finish_reason == "stop"


def test_stop_string_cuts_output_without_leaking(engine):
    free = run(engine, "xyz", temperature=0.0, max_tokens=24, ignore_eos=True)
    text = "".join(d.text for d in free)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "synthetic output too short to pick a stop string"
    out = run(engine, "xyz", temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    got = "".join(d.text for d in out)
    assert got == text[: text.index(stop)]
    assert out[-1].finish_reason == "stop"


def test_eos_finishes_with_eos_and_min_tokens_bans_it(engine, monkeypatch):
    free = tokens(run(engine, "xyz", temperature=0.0, max_tokens=6, ignore_eos=True))
    eos = free[2]
    cut = free.index(eos)
    monkeypatch.setattr(engine.tokenizer, "eog_ids", frozenset({eos}))
    out = run(engine, "xyz", temperature=0.0, max_tokens=6)
    assert tokens(out) == free[: cut + 1]
    assert out[-1].finish_reason == "eos"
    banned = run(engine, "xyz", temperature=0.0, max_tokens=6, min_tokens=6)
    assert eos not in tokens(banned)
    assert banned[-1].finish_reason == "length"


def test_logprobs_are_normalized_and_ranked(engine):
    out = run(engine, "abc", temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=5)
    for d in out:
        lp = d.logprobs[0]
        assert lp.token_id == d.token_ids[0]
        assert len(lp.top) == 5
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token


@pytest.mark.parametrize("prompt,kw,exc,phrase", [
    ("", {}, InvalidRequestError, "prompt"),
    ([], {}, InvalidRequestError, "prompt"),
    ([1, 2, 10**9], {}, InvalidRequestError, "token_ids"),
    ([1, -5], {}, InvalidRequestError, "token_ids"),
    ("hi", {"max_tokens": 10**6}, ContextOverflowError, "context"),
    ("hi", {"temperature": -2.0}, InvalidRequestError, "temperature"),
    ("hi", {"top_p": 7.0}, InvalidRequestError, "top_p"),
    ([{"role": "user"}], {}, InvalidRequestError, "content"),
])
def test_bad_requests_fail_before_compute_and_name_the_problem(engine, prompt, kw, exc, phrase):
    with pytest.raises(exc) as e:
        engine.generate(prompt, SamplingParams(**kw))
    assert phrase in str(e.value)


def test_a_prompt_extending_the_last_one_reuses_its_kv_and_matches_a_fresh_run(engine, tmp_path):
    first = run(engine, "the cat sat on", temperature=0.0, max_tokens=5, ignore_eos=True)
    history = engine.tokenizer.encode("the cat sat on") + tokens(first)
    follow_up = history + engine.tokenizer.encode(" the mat")
    reused = run(engine, follow_up, temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True)
    assert reused[-1].usage.cached_tokens == len(history) - 1  # the last sampled token was never fed back

    fresh_engine = lucekv.load(engine_path(engine), backend="cpu")
    fresh = run(fresh_engine, follow_up, temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True)
    assert fresh[-1].usage.cached_tokens == 0
    assert tokens(reused) == tokens(fresh)
    assert logprobs(reused) == logprobs(fresh)  # the history's decoded tokens have the K/V a prompt's would get


def logprobs(deltas):
    return [lp.logprob for d in deltas for lp in d.logprobs]


def test_a_prompt_sharing_a_long_prefix_with_the_last_gives_what_a_fresh_engine_gives(engine):
    """Issue 25: the prefix reused from the last request (longer than a chunk) holds the K/V rows a fresh prefill
    gives, bit for bit, so a seeded sample does not depend on what the engine served before."""
    first = [(7 * i + 5) % 200 + 3 for i in range(100)]
    second = first[:90] + [(11 * i + 1) % 200 + 3 for i in range(20)]
    params = {"temperature": 0.9, "seed": 13, "max_tokens": 12, "ignore_eos": True, "logprobs": True}
    run(engine, first, **params)
    reused = run(engine, second, **params)
    assert reused[-1].usage.cached_tokens == 90

    fresh_engine = lucekv.load(engine_path(engine), backend="cpu")
    fresh = run(fresh_engine, second, **params)
    assert fresh[-1].usage.cached_tokens == 0
    assert tokens(reused) == tokens(fresh)
    assert logprobs(reused) == logprobs(fresh)


def test_a_diverging_prompt_reuses_only_the_common_prefix(engine):
    base = engine.tokenizer.encode("one two three four five")
    run(engine, base, temperature=0.0, max_tokens=2, ignore_eos=True)
    other = base[:3] + engine.tokenizer.encode(" seven eight")
    out = run(engine, other, temperature=0.0, max_tokens=2, ignore_eos=True)
    assert out[-1].usage.cached_tokens == 3
    again = run(engine, other, temperature=0.0, max_tokens=2, ignore_eos=True)
    assert again[-1].usage.cached_tokens == len(other) - 1
    assert tokens(again) == tokens(out)


def test_a_cancelled_generation_leaves_a_consistent_cache(engine):
    prompt = engine.tokenizer.encode("alpha beta gamma")
    expected = tokens(run(engine, prompt, temperature=0.0, max_tokens=10, ignore_eos=True))
    gen = engine.generate(prompt + expected[:2], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    next(gen)
    gen.close()  # what the server does when a client cancels
    resumed = tokens(run(engine, prompt, temperature=0.0, max_tokens=10, ignore_eos=True))
    assert resumed == expected


def engine_path(engine):
    return engine.path


def test_run_ahead_greedy_decode_equals_the_step_by_step_loop(engine, monkeypatch):
    prompt = engine.tokenizer.encode("run ahead of the host")
    spy = mock.Mock(wraps=engine.backend.decode_ahead)
    monkeypatch.setattr(engine.backend, "decode_ahead", spy)
    ahead = run(engine, prompt, temperature=0.0, max_tokens=16, ignore_eos=True)
    chained = [c.args[2] is None for c in spy.call_args_list]
    assert sum(chained) >= 10  # most steps took their input from the step before, not from the host
    fresh = lucekv.load(engine_path(engine), backend="cpu")
    stepwise = run(fresh, prompt, temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=True)  # needs logits
    assert tokens(ahead) == tokens(stepwise)


def test_a_step_run_ahead_past_a_stop_stays_in_the_cache(engine):
    prompt = engine.tokenizer.encode("stop me somewhere")
    expected = tokens(run(engine, prompt, temperature=0.0, max_tokens=12, ignore_eos=True))
    stop = expected[6]
    out = tokens(run(engine, prompt, temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop]))
    assert out == expected[: expected.index(stop) + 1]
    # the step fed the stop token was already running: its K/V is kept, and the next turn reuses it
    follow_up = prompt + out + engine.tokenizer.encode(" and go on")
    reused = run(engine, follow_up, temperature=0.0, max_tokens=6, ignore_eos=True)
    assert reused[-1].usage.cached_tokens == len(prompt) + len(out)
    fresh = run(lucekv.load(engine_path(engine), backend="cpu"), follow_up, temperature=0.0, max_tokens=6,
                ignore_eos=True)
    assert tokens(reused) == tokens(fresh)
