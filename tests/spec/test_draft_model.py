"""The draft-model drafter: a second GGUF with the target's tokenizer, its K/V kept in step with the sequence."""

import numpy as np
import pytest

import lucekv
from lucekv.engine.sampling import SamplingParams
from lucekv.errors import ConfigError
from lucekv.model.synth import write_synthetic_gguf
from lucekv.spec.config import SpecConfig

VOCAB = 512


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft")
    return {seed: write_synthetic_gguf(d / f"m{seed}.gguf", "llama", n_ctx=4096, vocab=VOCAB, seed=seed)
            for seed in (0, 1)}


def load(target, draft, pool=None):
    return lucekv.load(target, backend="cpu", kv_dtype="f32", kv_pool=pool, kv_policy="lru",
                       speculation=SpecConfig(draft_model=draft, max_draft=6))


def greedy(engine, ids, speculation, session_id="", n=100):
    out = list(engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), session_id,
                               speculation=speculation))
    return [t for d in out for t in d.token_ids], out[-1].usage


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(10, 500, n).tolist()


@pytest.mark.parametrize("pool", [None, 512], ids=["whole context", "paged pool"])
def test_a_model_drafting_for_itself_is_accepted_and_equals_plain_greedy(models, pool):
    ids = prompt(600 if pool else 100)
    plain, _ = greedy(load(models[0], models[0], pool), ids, "off", n=60)
    spec, usage = greedy(load(models[0], models[0], pool), ids, "draft", n=60)
    assert spec == plain
    s = usage.speculation
    assert s.drafter == "draft" and s.accepted > 0
    if pool is None:  # (a paging target attends to fewer chunks than its draft, which holds the whole context)
        assert s.accepted >= 0.9 * s.drafted and s.rounds <= len(plain) // 5


def test_another_model_is_mostly_rejected_and_the_output_is_still_the_targets(models):
    ids = prompt(300, seed=1)
    plain, _ = greedy(load(models[0], models[1]), ids, "off")
    spec, usage = greedy(load(models[0], models[1]), ids, "draft")
    assert spec == plain
    assert usage.speculation.accepted < usage.speculation.drafted / 2


def test_turns_of_a_session_keep_the_drafts_kv_in_step(models):
    first, second = prompt(200, seed=2), prompt(20, seed=3)
    ref = load(models[0], models[1])
    a, _ = greedy(ref, first, "off", "s", n=40)
    b, _ = greedy(ref, first + a + second, "off", "s", n=40)
    engine = load(models[0], models[1])
    assert greedy(engine, first, "draft", "s", n=40)[0] == a
    held = len(engine.sessions.get("s").drafters["draft"].held)  # the session keeps its drafter
    assert greedy(engine, first + a + second, "draft", "s", n=40)[0] == b
    assert held >= len(first) + 30  # the second turn reused the first's draft K/V


def test_a_draft_model_with_another_vocabulary_is_refused(models, tmp_path):
    other = write_synthetic_gguf(tmp_path / "other.gguf", "llama", n_ctx=4096, vocab=VOCAB + 64)
    with pytest.raises(ConfigError, match="tokenizer is not the target's"):
        load(models[0], other)


def test_the_draft_models_backend_is_prepared_at_engine_start(models, monkeypatch):
    """Its prompt pieces and one-token steps compiled and captured before any request, as the target's are."""
    from lucekv.backends.cpu import CpuBackend

    prepared = []
    monkeypatch.setattr(CpuBackend, "prepare", lambda self, step_tokens, verify_width: prepared.append(
        (self.spec.n_embd, step_tokens, verify_width, self.prefill_chunk)))
    engine = load(models[0], models[1])
    draft = engine.drafters["draft"]().backend
    assert len(prepared) == 2 and (draft.spec.n_embd, draft.prefill_chunk, 1, draft.prefill_chunk) in prepared


@pytest.mark.slow  # CI time; the synthetic pairs above cover the drafter in the default run
def test_smollm2_drafting_for_itself_equals_plain_greedy_for_128_tokens(model_path):
    from tests.spec.test_spec_real import assert_same_greedy, greedy

    path = model_path("smollm2-135m")
    engine = lucekv.load(path, backend="cpu", speculation=SpecConfig(draft_model=path))
    text = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    _, plain_out = greedy(engine, "off", text, logprobs=True)
    spec, out = greedy(engine, "draft", text)
    assert_same_greedy(spec, plain_out)  # (this prompt has a near-tie at token 70, a 0.0009 logprob gap)
    s = out[-1].usage.speculation
    assert s.accepted >= 0.8 * s.drafted


def chi2_bound(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability 0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.slow  # 400 generations; the rejection rule itself is tested fast in test_verify.py
def test_sampling_with_a_draft_model_keeps_the_targets_distribution(models):
    check_rounds_keep_the_distribution(load(models[0], models[1]), "draft")


def check_rounds_keep_the_distribution(engine, mode: str, n: int = 400) -> None:
    """Token 2 of many seeded generations at temperature 0.5 comes out of a round (a draft of the drafter's,
    accepted by p/q or replaced from the residual): its frequencies against the exact marginal
    sum_t1 p(t1) p(t2 | t1) computed from the target's logits, chi-square at p = 0.001."""
    from lucekv.engine.sampling import Sampler

    ids = prompt(12, seed=5)
    params = SamplingParams(temperature=0.5, max_tokens=3, ignore_eos=True)
    first = Sampler(params, ids, engine.spec.vocab_size).distribution(engine.score(ids)[-1])
    marginal = np.zeros(engine.spec.vocab_size)
    for t1 in np.flatnonzero(first > 1e-4):
        marginal += first[t1] * Sampler(params, ids, engine.spec.vocab_size).distribution(
            engine.score(ids + [int(t1)])[-1])
    counts = np.zeros_like(marginal)
    rounds = rejected = 0
    for seed in range(n):
        out = list(engine.generate(ids, SamplingParams(temperature=0.5, max_tokens=3, ignore_eos=True, seed=seed),
                                   speculation=mode))
        counts[[t for d in out for t in d.token_ids][1]] += 1
        s = out[-1].usage.speculation
        rounds, rejected = rounds + s.rounds, rejected + s.drafted - s.accepted
    assert rejected > n / 10  # the residual draws were exercised
    expected = n * marginal
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    stat = float(np.sum((observed - expected) ** 2 / np.maximum(expected, 1e-9)))
    assert stat < chi2_bound(len(observed) - 1), (stat, len(observed))
