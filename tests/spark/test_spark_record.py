"""`lucekv serve --spark-record FILE`: the routing of served traffic (prompts and decoded tokens) counted by the backend
and written as a routing trace every N requests and at shutdown, equal to what `lucekv spark trace` counts for the
same tokens; continued after a restart, refused for another model or a dense one; `spark calibrate` merges such
traces."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import lucekv
from lucekv.cli import main
from lucekv.client import Client, SamplingOptions
from lucekv.errors import ConfigError
from lucekv.model.gguf import open_gguf
from lucekv.model.synth import write_synthetic_gguf
from lucekv.spark.cli import prompt_backend, record_trace
from lucekv.spark.placement import Placement, calibrated
from lucekv.spark.record import TraceRecorder
from lucekv.spark.trace import RoutingTrace
from tests.server.server_harness import ProbeEngine, ServerThread

GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "qwen3moe.gguf"
    return write_synthetic_gguf(path, "qwen3moe", n_layer=2, n_expert=8, n_expert_used=3, seed=3)


def traced(path, documents: list[list[int]]) -> RoutingTrace:
    """What `lucekv spark trace` counts for these token ids (its backend, its prompt forwards)."""
    g = open_gguf(path)
    backend, _ = prompt_backend(g, [], 512)
    spec = backend.spec
    trace = RoutingTrace.empty(g.fingerprint, spec.n_layer, spec.n_expert, spec.n_expert_used)
    record_trace(backend, [(str(i), np.asarray(ids, np.int32)) for i, ids in enumerate(documents)], trace)
    return trace


def test_served_traffic_is_recorded_as_spark_trace_counts_it(moe, tmp_path):
    """Three greedy requests (prompts of 40-60 tokens, 12 decoded): the file written after the second (every 2)
    counts the first two requests' forwarded tokens (prompt and every generated token but the last), the one written
    at shutdown all three, each equal to `spark trace` over the same ids; a restarted server continues the file."""
    out = tmp_path / "live.json"
    rng = np.random.default_rng(5)
    prompts = [rng.integers(10, 200, n).tolist() for n in (40, 60, 50)]
    engine = ProbeEngine(lucekv.load(moe, backend="cpu", spark_record=out, spark_record_every=2))
    server = ServerThread(engine)
    forwarded = []
    try:
        with Client(server.address) as client:
            for i, prompt in enumerate(prompts):
                reply = client.complete(prompt, SamplingOptions(**GREEDY), speculation="off")
                assert len(reply.token_ids) == GREEDY["max_tokens"]
                forwarded.append(prompt + reply.token_ids[:-1])
                if i == 0:
                    assert not out.exists()
                if i == 1:  # written every 2 requests, before the second's reply
                    early = RoutingTrace.load(out, open_gguf(moe).fingerprint)
    finally:
        server.stop()
    expected = traced(moe, forwarded[:2])
    assert early.tokens == sum(map(len, forwarded[:2])) == expected.tokens
    np.testing.assert_array_equal(early.counts, expected.counts)
    final = RoutingTrace.load(out, open_gguf(moe).fingerprint)
    expected.add(traced(moe, forwarded[2:]))
    assert final.tokens == sum(map(len, forwarded))
    np.testing.assert_array_equal(final.counts, expected.counts)
    assert (final.counts > 0).sum() > 8 and not out.with_name(out.name + ".tmp").exists()

    again = lucekv.load(moe, backend="cpu", spark_record=out)  # a restart: the file is continued
    assert len([t for d in again.generate(prompts[0], lucekv.SamplingParams(**GREEDY)) for t in d.token_ids]) == 12
    assert again.save_routing_trace()
    np.testing.assert_array_equal(RoutingTrace.load(out).counts,
                                  final.counts + traced(moe, [forwarded[0]]).counts)


def test_another_models_trace_a_dense_model_and_a_missing_directory_are_refused(moe, tmp_path):
    other = tmp_path / "other.json"
    RoutingTrace.empty("another model", 2, 8, 3).save(other)
    with pytest.raises(ConfigError, match="another model"):
        lucekv.load(moe, backend="cpu", spark_record=other)
    dense = write_synthetic_gguf(tmp_path / "dense.gguf", "llama")
    with pytest.raises(ConfigError, match="not a mixture of experts"):
        lucekv.load(dense, backend="cpu", spark_record=tmp_path / "t.json")
    with pytest.raises(ConfigError, match="does not exist"):
        lucekv.load(moe, backend="cpu", spark_record=tmp_path / "missing" / "t.json")
    with pytest.raises(ConfigError, match="--spark-record-every must be >= 1"):
        lucekv.load(moe, backend="cpu", spark_record=tmp_path / "t.json", spark_record_every=0)


def test_a_failed_write_keeps_the_previous_file_whole_and_the_counts(moe, tmp_path, monkeypatch, caplog):
    """The rename fails (a full disk, say): the request is served, the error logged, the old file intact, and the next
    write has every count."""
    out = tmp_path / "live.json"
    engine = lucekv.load(moe, backend="cpu", spark_record=out, spark_record_every=1)
    list(engine.generate([5, 6, 7, 8], lucekv.SamplingParams(**GREEDY)))
    before = out.read_bytes()

    def refuse(self, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("pathlib.Path.replace", refuse)
    with caplog.at_level(logging.ERROR):
        reply = [t for d in engine.generate([9, 10, 11, 12], lucekv.SamplingParams(**GREEDY)) for t in d.token_ids]
    assert len(reply) == GREEDY["max_tokens"] and "No space left on device" in caplog.text
    assert out.read_bytes() == before
    monkeypatch.undo()
    assert engine.save_routing_trace()
    assert RoutingTrace.load(out).tokens == 2 * (4 + GREEDY["max_tokens"] - 1)


def test_the_recorder_counts_requests_and_continues_a_file(tmp_path):
    out = tmp_path / "t.json"
    r = TraceRecorder(out, "fp", 2, 4, 2, every=3)
    assert [r.request_ended() for _ in range(6)] == [False, False, True, False, False, True]
    r.add(np.array([[1, 1, 0, 0], [0, 2, 0, 0]]))
    r.save()
    again = TraceRecorder(out, "fp", 2, 4, 2, every=3)
    again.add(np.array([[0, 1, 1, 0], [0, 0, 1, 1]]))
    np.testing.assert_array_equal(again.trace.counts, [[1, 2, 1, 0], [0, 2, 1, 1]])
    with pytest.raises(ConfigError, match="another model"):
        TraceRecorder(out, "other", 2, 4, 2, every=3)


def test_calibrate_merges_several_traces_and_refuses_an_empty_one(moe, tmp_path, capsys):
    g = open_gguf(moe)
    a, b = RoutingTrace.empty(g.fingerprint, 2, 8, 3), RoutingTrace.empty(g.fingerprint, 2, 8, 3)
    a.counts[:, :3] = 10  # 10 tokens on experts 0-2
    b.counts[:, 5:] = 30  # 30 tokens on experts 5-7
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    from lucekv.spark.cli import expert_bytes

    sizes = expert_bytes(g)
    vram = 4 * sum(sizes) / 2**30  # four experts a layer
    assert main(["spark", "calibrate", str(moe), str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                 "--expert-vram", repr(vram), "-o", str(tmp_path / "p.json")]) == 0
    merged = RoutingTrace.empty(g.fingerprint, 2, 8, 3)
    merged.counts[:] = a.counts + b.counts
    placement = Placement.load(tmp_path / "p.json", g.fingerprint)
    assert placement == calibrated(merged, sizes, int(4 * sum(sizes)))
    assert all(h[:3] == (5, 6, 7) for h in placement.hot)  # b's busier experts first in every layer
    assert sum(map(len, placement.hot)) == 8 and any(0 in h for h in placement.hot)  # then a's
    RoutingTrace.empty(g.fingerprint, 2, 8, 3).save(tmp_path / "empty.json")
    assert main(["spark", "calibrate", str(moe), str(tmp_path / "empty.json"), "--expert-vram", "1",
                 "-o", str(tmp_path / "q.json")]) == 2
    assert "count no tokens" in capsys.readouterr().err


def test_the_cpu_backend_counts_routing_while_asked(moe):
    """count_routing: a forward's tokens counted in every layer; a take starts the counts afresh; switched off, no
    counts to take."""
    g = open_gguf(moe)
    backend, _ = prompt_backend(g, [], 64)
    backend.count_routing()
    pos = np.arange(5, dtype=np.int32)
    backend.forward(np.array([5, 6, 7, 8, 9], np.int32), pos, pos)
    np.testing.assert_array_equal(backend.take_routing_counts().sum(axis=1), [5 * 3, 5 * 3])
    assert backend.take_routing_counts().sum() == 0
    backend.count_routing(False)
    backend.forward(np.array([10], np.int32), np.array([5], np.int32), np.array([5], np.int32))
    with pytest.raises(ValueError, match="not counted"):
        backend.take_routing_counts()
