"""The draft-model scorer: its reader's bookkeeping, its ranking, and a draft-policy session's exact replay and
restore (the synthetic model drafts for itself: same tokenizer)."""

from __future__ import annotations

import numpy as np
import pytest

import lucekv
from lucekv.engine.sampling import SamplingParams
from lucekv.errors import ConfigError
from lucekv.kvflash.draft import DRAFT_QUERIES, DraftReader, DraftScorer
from lucekv.model.synth import write_synthetic_gguf
from lucekv.snapshot.blob import read_snapshot, write_snapshot


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("draft") / "tiny.gguf", "llama", n_ctx=4096, vocab=512)


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(10, 500, n).tolist()


def counting_reader(model) -> tuple[DraftReader, list[int]]:
    engine = lucekv.load(model, backend="cpu", kv_dtype="f32")
    forwarded: list[int] = []
    forward = engine.backend.forward
    engine.backend.forward = lambda tokens, *a, **kw: forwarded.append(len(tokens)) or forward(tokens, *a, **kw)
    return DraftReader(engine), forwarded


def test_the_reader_forwards_only_what_is_new_and_keeps_the_drafters_keys(model):
    reader, forwarded = counting_reader(model)
    history, owner = prompt(700), object()
    reader.read(owner, history, [300])
    assert sum(forwarded) == 300 and forwarded[-1] >= DRAFT_QUERIES
    forwarded.clear()
    reader.read(owner, history, [300])  # nothing new: nothing read
    assert forwarded == []
    reader.read(owner, history, [300, 305])  # the last DRAFT_QUERIES tokens come from one forward: 11 read again
    assert forwarded == [DRAFT_QUERIES]
    forwarded.clear()
    other = history[:200] + prompt(200, seed=1)  # another sequence, or another owner: its steps from the start
    reader.read(owner, other, [300, 400])
    assert forwarded == [256, 44, 100]  # the backend's batches of 256
    forwarded.clear()
    reader.read(object(), other, [400])
    assert forwarded == [256, 144]  # the backend's batches, the last holding the last DRAFT_QUERIES tokens
    queries, sealed, rest = reader.inputs()
    assert sealed.shape[1] == 384 and rest.shape[1] == 16 and queries.shape[0] == DRAFT_QUERIES
    fresh = lucekv.load(model, backend="cpu", kv_dtype="f32")
    pos = np.arange(400, dtype=np.int32)
    fresh.backend.forward(np.asarray(other, np.int32), pos, pos)
    keys = np.stack(fresh.backend.pool.k)[:, :400]
    np.testing.assert_allclose(np.concatenate([sealed, rest], axis=1), keys.astype(np.float16), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(queries, fresh.backend.recent_queries()[-DRAFT_QUERIES:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("layer", "first"), [(2, True), (0, False)])
def test_draft_scores_rank_first_the_chunk_one_head_looks_at_past_the_first_third_of_the_layers(layer, first):
    rng = np.random.default_rng(3)
    rows, layers, heads, kv, d, n = 4, 3, 4, 2, 16, 64 * 10 + 5
    queries = rng.standard_normal((rows, layers, heads, d)).astype(np.float32)
    keys = rng.standard_normal((layers, n, kv, d)).astype(np.float16)
    q = queries[:, layer, 1].mean(axis=0)  # q-head 1 (KV head 0): every query leans its way
    keys[layer, 3 * 64 + 10, 0] = 12 * q / np.linalg.norm(q)
    scorer = DraftScorer(reader=None, history=list)
    scores = scorer.score((1, queries, keys[:, :640], keys[:, 640:]))
    assert scores.shape == (11,) and (int(np.argmax(scores)) == 3) == first  # layer 0 (positional) is not read


def generate(engine, ids, session_id="", n=40):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [d.token_ids[0] for d in engine.generate(ids, params, session_id)]


def draft_engine(model):
    return lucekv.load(model, backend="cpu", kv_dtype="f32", kv_pool=512, kv_policy="draft", kv_drafter=model,
                       kv_tau=16)


def test_a_draft_session_replays_exactly_and_a_restored_one_selects_the_same_chunks(model):
    first, second = prompt(1500, seed=4), prompt(30, seed=5)
    a = draft_engine(model)
    out_a = generate(a, first, "s")  # 40 tokens at tau 16: reselects during decode too
    assert a.paged.usage().page_ins > 0
    b = draft_engine(model)
    assert generate(b, first, "s") == out_a
    assert b.sessions.get("s").paged.state() == a.sessions.get("s").paged.state()
    header, chunks = a.snapshot("s")
    fresh = draft_engine(model)
    fresh.restore(read_snapshot(write_snapshot(header, chunks.__getitem__), fresh.layout, max_tokens=fresh.n_ctx,
                                vocab_size=fresh.spec.vocab_size), "s")
    nxt = first + out_a + second
    assert generate(fresh, nxt, "s") == generate(a, nxt, "s")
    assert fresh.sessions.get("s").paged.state() == a.sessions.get("s").paged.state()


def test_a_draft_policy_needs_a_drafter_with_the_same_tokenizer(model, tmp_path):
    with pytest.raises(ConfigError, match="--kv-drafter"):
        lucekv.load(model, backend="cpu", kv_pool=512, kv_policy="draft")
    other = write_synthetic_gguf(tmp_path / "other.gguf", "llama", n_ctx=4096, vocab=600)
    with pytest.raises(ConfigError, match="tokenizer"):
        lucekv.load(model, backend="cpu", kv_pool=512, kv_policy="draft", kv_drafter=other)


def test_the_default_policy_is_draft_with_a_drafter_and_quest_without(model):
    assert lucekv.load(model, backend="cpu", kv_pool=512, kv_drafter=model).info.kv_policy == "draft"
    assert lucekv.load(model, backend="cpu", kv_pool=512).info.kv_policy == "quest"
