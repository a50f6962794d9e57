"""Sessions in the engine: turns reuse K/V, sessions take turns in one pool, snapshots restore exactly."""

import dataclasses

import numpy as np
import pytest

import lucekv
from lucekv.engine.sampling import SamplingParams
from lucekv.errors import NotFoundError, PreconditionError, ResourceLimitError
from lucekv.model.synth import write_synthetic_gguf
from lucekv.snapshot.blob import FLAG_PARTIAL, SnapshotError, read_snapshot, write_snapshot
from lucekv.snapshot.store import MemorySnapshotStore
from tests.kernels.cuda_sim import needs_gpu

POOLS = {"whole context": None, "paged pool": 512}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("sessions") / "tiny.gguf", "llama", n_ctx=4096, vocab=512)


def load(model, pool, **kw):
    return lucekv.load(model, backend="cpu", kv_dtype="f32", kv_pool=pool, kv_policy="lru", **kw)


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(10, 500, n).tolist()


def turn(engine, ids, session_id="", n=8):
    """Greedy tokens and the final usage of one generation."""
    out = list(engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), session_id))
    return [d.token_ids[0] for d in out], out[-1].usage


def conversation(engine, session_id, first, second):
    """Two turns: the second prompt is the first, its answer, and `second`. Returns both answers."""
    a, _ = turn(engine, first, session_id)
    b, usage = turn(engine, first + a + second, session_id)
    return a, b, usage


def roundtrip(engine, session_id, other, new_id="", upto=None):
    header, chunks = engine.snapshot(session_id, upto)
    snap = read_snapshot(write_snapshot(header, chunks.__getitem__), other.layout, max_tokens=other.n_ctx,
                         vocab_size=other.spec.vocab_size)
    return other.restore(snap, new_id)


@pytest.mark.parametrize("pool", POOLS.values(), ids=POOLS.keys())
def test_a_second_turn_reuses_the_session_and_equals_a_fresh_run(model, pool):
    first, second = prompt(300), prompt(40, seed=1)
    engine = load(model, pool)
    a, b, usage = conversation(engine, "chat", first, second)
    assert usage.cached_tokens == len(first) + len(a) - 1  # all but the first turn's last token, never forwarded
    fresh_b, fresh_usage = turn(load(model, pool), first + a + second)
    assert b == fresh_b and fresh_usage.cached_tokens == 0


@pytest.mark.parametrize("pool", POOLS.values(), ids=POOLS.keys())
def test_interleaved_sessions_each_equal_their_run_alone(model, pool):
    alone = {sid: conversation(load(model, pool), sid, prompt(700, seed=s), prompt(30, seed=s + 10))[:2]
             for s, sid in enumerate(("x", "y"))}
    engine = load(model, pool)
    a_x, _ = turn(engine, prompt(700, seed=0), "x")
    a_y, _ = turn(engine, prompt(700, seed=1), "y")
    turn(engine, prompt(100, seed=5))  # an anonymous request between turns
    b_x, usage_x = turn(engine, prompt(700, seed=0) + a_x + prompt(30, seed=10), "x")
    b_y, usage_y = turn(engine, prompt(700, seed=1) + a_y + prompt(30, seed=11), "y")
    assert (a_x, b_x) == alone["x"] and (a_y, b_y) == alone["y"]
    assert usage_x.cached_tokens == usage_y.cached_tokens == 700 + 8 - 1
    # idle sessions keep their blocks while the pool has room: both are in it, and came back without a copy
    assert {i.session_id: i.state for i in engine.sessions.infos()} == {"x": "live", "y": "live"}
    if pool is None:
        assert engine.sessions.get("x").paged.usage().page_ins == 0


@pytest.mark.parametrize("pool", POOLS.values(), ids=POOLS.keys())
def test_snapshot_restored_elsewhere_continues_like_the_uninterrupted_session(model, pool):
    first, second = prompt(1000, seed=2), prompt(20, seed=3)
    a, b, _ = conversation(load(model, pool), "s", first, second)
    engine = load(model, pool)
    turn(engine, first, "s")
    if pool:
        assert engine.paged.usage().paged_chunks > 0  # the blob holds chunks that were paged out
    fresh = load(model, pool)
    info = roundtrip(engine, "s", fresh, new_id="moved")
    assert (info.session_id, info.state, info.n_tokens) == ("moved", "parked", len(first) + len(a) - 1)
    b_moved, usage = turn(fresh, first + a + second, "moved")
    assert b_moved == b and usage.cached_tokens == len(first) + len(a) - 1
    roundtrip(engine, "s", engine, new_id="copy")  # the same server, under a new id
    assert turn(engine, first + a + second, "copy")[0] == b


def test_a_partial_snapshot_stops_at_a_chunk_and_the_rest_is_recomputed(model):
    first, second = prompt(500, seed=4), prompt(20, seed=5)
    a, b, _ = conversation(load(model, 512), "s", first, second)
    engine = load(model, 512)
    turn(engine, first, "s")
    header, _ = engine.snapshot("s", upto_tokens=300)
    assert header.n_tokens == 256 and header.flags & FLAG_PARTIAL
    fresh = load(model, 512)
    roundtrip(engine, "s", fresh, upto=300)
    b_partial, usage = turn(fresh, first + a + second, "s")
    assert b_partial == b and usage.cached_tokens == 256


def test_restoring_over_a_busy_session_changes_nothing(model):
    engine = load(model, None)
    turn(engine, prompt(100), "s")
    before = engine.session_info("s")
    engine.sessions.begin_request("s")
    with pytest.raises(PreconditionError, match="a Generate call is using it"):
        roundtrip(engine, "s", engine)
    engine.sessions.end_request("s")
    assert engine.session_info("s") == before


def test_session_limit_refuses_without_a_store_and_spills_the_oldest_with_one(model):
    engine = load(model, None, max_sessions=2)
    turn(engine, prompt(100), "a")
    turn(engine, prompt(100), "b")
    with pytest.raises(ResourceLimitError, match="2 sessions are held in memory"):
        turn(engine, prompt(100), "c")
    first, second = prompt(200, seed=6), prompt(10, seed=7)
    a, b, _ = conversation(load(model, None), "a", first, second)
    engine = load(model, None, max_sessions=2, snapshot_store=MemorySnapshotStore(1 << 30))
    turn(engine, first, "a")
    turn(engine, prompt(100), "b")
    turn(engine, prompt(100), "c")  # "a" is the least recently used: it goes to the store
    states = {i.session_id: (i.state, i.n_tokens) for i in engine.sessions.infos()}
    assert states["a"] == ("stored", len(first) + len(a) - 1) and "a" in engine.store
    b_again, usage = turn(engine, first + a + second, "a")  # loaded back from the store
    assert b_again == b and usage.cached_tokens == len(first) + len(a) - 1


def test_host_memory_limit_spills_idle_sessions(model):
    # a pool of one whole context (64 blocks): "b" takes blocks back from the idle "a", whose chunks page to host
    engine = load(model, None, session_memory_gib=2**-30, snapshot_store=MemorySnapshotStore(1 << 30), kv_cache=4096)
    turn(engine, prompt(2100), "a")
    turn(engine, prompt(2100), "b")  # "a" is partly in host memory, over the 1-byte limit: spilled
    assert {i.session_id: i.state for i in engine.sessions.infos()} == {"a": "stored", "b": "live"}


def test_deleted_sessions_are_gone_everywhere(model):
    store = MemorySnapshotStore(1 << 30)
    engine = load(model, 512, snapshot_store=store)
    turn(engine, prompt(100), "a")
    turn(engine, prompt(100), "b")
    assert engine.save_sessions() == 2 and sorted(store.keys()) == ["a", "b"]
    engine.delete_session("a")
    with pytest.raises(NotFoundError):
        engine.session_info("a")
    assert store.keys() == ["b"]
    restarted = load(model, 512, snapshot_store=store)  # finds "b" in the store
    assert [(i.session_id, i.state) for i in restarted.sessions.infos()] == [("b", "stored")]


@pytest.mark.parametrize("pager", [{"residency": {"pool_tokens": 512, "resident": "x"}, "policy": "lru"},
                                   {"residency": {"pool_tokens": 512}, "policy": "lru"}, {"policy": "lru"}])
def test_a_malformed_pager_state_is_refused_and_changes_nothing(model, pager):
    engine = load(model, 512)
    turn(engine, prompt(600), "s")
    header, chunks = engine.snapshot("s")
    forged = read_snapshot(write_snapshot(dataclasses.replace(header, pager=pager), chunks.__getitem__),
                           engine.layout, max_tokens=engine.n_ctx, vocab_size=engine.spec.vocab_size)
    before = engine.session_info("s")
    with pytest.raises(SnapshotError, match="pager state is malformed"):
        engine.restore(forged, "s")
    assert engine.session_info("s") == before


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("pool", POOLS.values(), ids=POOLS.keys())
def test_sessions_on_the_cuda_backend_move_between_engines_exactly(model, pool):
    first, second = prompt(1000, seed=8), prompt(20, seed=9)

    def cuda(**kw):
        return lucekv.load(model, backend="cuda", kv_dtype="f32", kv_pool=pool, kv_policy="quest", **kw)

    a, b, _ = conversation(cuda(), "s", first, second)
    engine = cuda()
    turn(engine, first, "s")
    turn(engine, prompt(300, seed=10), "other")  # "s" is parked on the host meanwhile
    fresh = cuda()
    roundtrip(engine, "s", fresh)
    assert turn(fresh, first + a + second, "s")[0] == b
    assert turn(engine, first + a + second, "s")[0] == b  # and back from the host in the first engine


def test_a_quest_session_with_unscored_and_missing_chunks_restores_exactly(model):
    """quest scores hold +inf (newer than the last reselect) and -inf (no summary): the blob keeps them exactly."""
    first, second = prompt(1000, seed=11), prompt(20, seed=12)

    def quest():
        return lucekv.load(model, backend="cpu", kv_dtype="f32", kv_pool=512, kv_policy="quest")

    a, b, _ = conversation(quest(), "s", first, second)
    engine = quest()
    turn(engine, first, "s")
    scores = engine.paged.pager.scores[: engine.paged.pager.n_chunks]
    assert np.isinf(scores).any()
    fresh = quest()
    roundtrip(engine, "s", fresh)
    assert turn(fresh, first + a + second, "s")[0] == b
