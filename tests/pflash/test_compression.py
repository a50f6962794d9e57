"""PFlash through the engine (a synthetic model drafting for itself: same tokenizer): a compressed prompt is the
kept tokens prefilled as a prompt of their own; keeping everything changes nothing; a session's next turn reuses
what was kept, and a restored one stays coherent; bad keep ratios are refused."""

from __future__ import annotations

import numpy as np
import pytest

import lucekv
from lucekv.engine.sampling import SamplingParams
from lucekv.errors import ConfigError, InvalidRequestError
from lucekv.model.synth import write_synthetic_gguf
from lucekv.server.service import response_from_delta
from lucekv.snapshot.blob import read_snapshot, write_snapshot
from tests.kernels.cuda_sim import needs_gpu

THRESHOLD = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("pflash") / "tiny.gguf", "llama", n_ctx=4096, vocab=512)


@pytest.fixture(scope="module")
def plain(model):
    return lucekv.load(model, backend="cpu", kv_dtype="f32")


@pytest.fixture(scope="module")
def compressing(model):
    return lucekv.load(model, backend="cpu", kv_dtype="f32", prefill_compression=0.25, prefill_threshold=THRESHOLD,
                       prefill_drafter=model)


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(10, 500, n).tolist()


def generate(engine, ids, session_id="", n=12, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    deltas = list(engine.generate(ids, params, session_id, **kw))
    return [t for d in deltas for t in d.token_ids], deltas[-1].usage


def test_a_compressed_prompt_is_its_kept_tokens_prefilled_alone(compressing, plain):
    ids = prompt(1500)
    out, usage = generate(compressing, ids, "a")
    c = usage.compression
    assert (c.keep_ratio, c.scored_tokens) == (0.25, 1500) and c.kept_tokens == 11 * 32 + 28  # round(47 * 0.25)
    assert (usage.prompt_tokens, usage.prefilled_tokens) == (1500, c.kept_tokens)
    kept = compressing.sessions.get("a").tokens[: c.kept_tokens]
    assert kept[:32] == ids[:32] and kept[-92:] == ids[-92:]  # head and tail: 1 and 3 spans of a budget of 12
    assert generate(plain, kept)[0] == out


def test_keeping_everything_is_plain_prefill_token_for_token(model, compressing, plain):
    ids = prompt(900, seed=1)
    want, _ = generate(plain, ids)
    out, usage = generate(compressing, ids, prefill_keep=0.99)  # round(29 * 0.99) = 29 spans: all of them
    assert out == want and usage.compression.kept_tokens == 900 and usage.prefilled_tokens == 900
    out, usage = generate(compressing, ids, prefill_keep=1.0)  # 1: no compression, no drafter
    assert out == want and usage.compression is None
    out, usage = generate(compressing, prompt(THRESHOLD, seed=9))  # not longer than the threshold
    assert usage.compression is None and usage.prefilled_tokens == THRESHOLD
    keep_all = lucekv.load(model, backend="cpu", kv_dtype="f32", prefill_compression=1.0, prefill_drafter=model,
                           prefill_threshold=THRESHOLD)
    out, usage = generate(keep_all, ids)  # the default 1: no compression either
    assert out == want and usage.compression is None and keep_all.info.prefill_keep_ratio == 1.0


def test_a_compressed_sessions_next_turn_reuses_what_was_kept_also_after_a_snapshot_and_restore(
        model, compressing, plain):
    ids = prompt(1500, seed=2)
    out, usage = generate(compressing, ids, "s")
    kept = compressing.sessions.get("s").tokens[: usage.compression.kept_tokens]
    turn = ids + out + prompt(40, seed=3)  # the client resends the history
    header, chunks = compressing.snapshot("s")
    assert header.prompt_alias == (tuple(ids), len(kept))
    out2, usage2 = generate(compressing, turn, "s")
    assert usage2.cached_tokens == len(kept) + len(out) - 1 and usage2.compression is None
    assert usage2.prefilled_tokens == 41 and usage2.prompt_tokens == len(turn)
    assert out2 == generate(plain, kept + out + turn[len(ids) + len(out) :])[0]
    # restored elsewhere: the blob holds the kept tokens and the alias, so the turn reuses them there too
    blob = b"".join(write_snapshot(header, chunks.__getitem__))
    other = lucekv.load(model, backend="cpu", kv_dtype="f32")
    other.restore(read_snapshot([blob], other.layout, max_tokens=other.n_ctx, vocab_size=other.spec.vocab_size),
                  "s")
    assert other.sessions.get("s").tokens == kept + out[:-1]
    out3, usage3 = generate(other, turn, "s")
    assert out3 == out2 and (usage3.cached_tokens, usage3.prefilled_tokens) == (usage2.cached_tokens, 41)
    # a blob of a session whose alias no longer holds (a turn that diverged) has none
    generate(other, turn[:100] + prompt(10, seed=8), "s")
    assert other.snapshot("s")[0].prompt_alias is None


def test_a_blobs_prompt_alias_is_checked(model, compressing):
    from lucekv.snapshot.blob import SnapshotError

    ids = prompt(900, seed=6)
    generate(compressing, ids, "b", prefill_keep=0.5)
    header, chunks = compressing.snapshot("b")
    n = header.n_tokens
    for alias, message in [(((1, 2), n + 1), "stands for"), (((1, 10**6), 5), "token id"), (((1,), 0), "stands")]:
        bad = header.__class__(**{**header.__dict__, "prompt_alias": alias})
        with pytest.raises(SnapshotError, match=message):
            read_snapshot(write_snapshot(bad, chunks.__getitem__), compressing.layout, max_tokens=compressing.n_ctx,
                          vocab_size=compressing.spec.vocab_size)


def test_the_usage_reaches_the_client(compressing):
    _, usage = generate(compressing, prompt(1000, seed=4))
    from lucekv.engine.types import GenerationDelta

    u = response_from_delta(GenerationDelta([1], "x", finish_reason="length", usage=usage), "r").usage
    assert (u.prefilled_tokens, u.compression.kept_tokens, u.compression.scored_tokens) == \
        (usage.prefilled_tokens, usage.compression.kept_tokens, 1000)
    assert u.compression.keep_ratio == 0.25 and u.compression.score_ms > 0


def test_bad_keep_ratios_and_compression_without_a_drafter_are_refused(model, compressing, plain):
    params = SamplingParams(max_tokens=4)
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(InvalidRequestError, match="prefill_keep_ratio"):
            compressing.prepare(prompt(10), params, prefill_keep=bad)
    with pytest.raises(InvalidRequestError, match="not available"):
        plain.prepare(prompt(10), params, prefill_keep=0.5)
    plain.prepare(prompt(10), params, prefill_keep=1.0)  # no compression: fine anywhere
    assert (plain.info.prefill_compression, compressing.info.prefill_compression) == (False, True)
    assert compressing.info.prefill_keep_ratio == 0.25 and compressing.info.prefill_threshold == THRESHOLD
    with pytest.raises(ConfigError, match="needs a drafter"):
        lucekv.load(model, backend="cpu", prefill_compression=0.1)
    with pytest.raises(ConfigError, match="keep ratio"):
        lucekv.load(model, backend="cpu", prefill_compression=1.5, prefill_drafter=model)


def test_a_drafter_with_another_tokenizer_is_refused(model, tmp_path):
    other = write_synthetic_gguf(tmp_path / "other.gguf", "llama", n_ctx=4096, vocab=600)
    with pytest.raises(ConfigError, match="tokenizer"):
        lucekv.load(model, backend="cpu", prefill_compression=0.1, prefill_drafter=other)


@pytest.mark.gpu
@needs_gpu
def test_on_cuda_a_compressed_prompt_is_its_kept_tokens_and_the_spans_are_the_cpus(model, compressing):
    """The same engine path on the CUDA backend (drafter and target): the compressed prompt is its kept tokens
    prefilled alone, and the drafter keeps the spans the CPU's does (float16 K/V may reorder a near-tie: 90%)."""
    cuda = lucekv.load(model, backend="cuda", kv_dtype="f32", prefill_compression=0.25, prefill_threshold=THRESHOLD,
                       prefill_drafter=model, max_batch=4)
    ids = prompt(1500, seed=7)
    out, usage = generate(cuda, ids, "a")
    kept = cuda.sessions.get("a").tokens[: usage.compression.kept_tokens]
    assert generate(cuda, kept)[0] == out
    kept_at = [set(e.compressor.select(ids, 0, 0.25).positions().tolist()) for e in (cuda, compressing)]
    assert len(kept_at[0]) == len(kept_at[1]) == len(kept) and len(kept_at[0] & kept_at[1]) >= 0.9 * len(kept)


def test_a_drafter_cut_to_its_first_layers_reads_them_as_the_whole_one_does(model, compressing):
    cut = lucekv.load(model, backend="cpu", kv_dtype="f32", prefill_compression=0.25, prefill_threshold=THRESHOLD,
                      prefill_drafter=model, prefill_drafter_layers=1)
    assert cut.compressor.reader.engine.spec.n_layer == 1
    ids = prompt(1000, seed=5)
    inputs = []
    for reader in (compressing.compressor.reader, cut.compressor.reader):
        reader.read(object(), ids, [len(ids)])
        inputs.append(reader.inputs())
    (q, sealed, rest), (q1, sealed1, rest1) = inputs
    np.testing.assert_array_equal(sealed1, sealed[:1])
    np.testing.assert_array_equal(rest1, rest[:1])
    np.testing.assert_array_equal(q1, q[:, :1])
    with pytest.raises(ConfigError, match="first 3"):
        lucekv.load(model, backend="cpu", prefill_compression=0.25, prefill_drafter=model, prefill_drafter_layers=3)
