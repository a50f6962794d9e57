"""Two in-process replicas sharing one real Redis: a session moves between them through its blob, token for
token as if it had stayed on one; a session is served by one replica at a time."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import grpc
import pytest
from server_harness import ProbeEngine, ServerThread

import lucekv
from lucekv.client import Client, SamplingOptions
from lucekv.engine.sampling import SamplingParams
from lucekv.errors import ConfigError
from lucekv.model.gguf import open_gguf
from lucekv.snapshot.redis_store import RedisSnapshotStore

GREEDY = SamplingOptions(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def replicas(tiny_model, redis_url):
    """Two servers on engines whose snapshot store is the same Redis database."""
    fingerprint = open_gguf(tiny_model).fingerprint
    stores = [RedisSnapshotStore(redis_url, fingerprint, lease_seconds=5) for _ in range(2)]
    probes = [ProbeEngine(lucekv.load(tiny_model, backend="cpu", snapshot_store=s)) for s in stores]
    servers = [ServerThread(p) for p in probes]
    yield servers, probes, stores
    for server, store in zip(servers, stores, strict=True):
        server.stop()
        store.close()


def uninterrupted(engine, turns: list[str]) -> list[list[int]]:
    """Each turn's tokens when one engine serves the whole conversation in one session."""
    history: list[int] = []
    out = []
    for text in turns:
        history += engine.tokenizer.encode(text, add_special=not history)
        ids = [t for d in engine.generate(history, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                          "ref") for t in d.token_ids]
        out.append(ids)
        history += ids
    engine.delete_session("ref")
    return out


def test_a_session_moves_between_replicas_through_the_store_token_identical(replicas, reference_engine):
    (a, b), _, stores = replicas
    turns = ["Once upon a time", " and then", " the end", " or not"]
    expected = uninterrupted(reference_engine, turns)
    history: list[int] = []
    with Client(a.address) as ca, Client(b.address) as cb:
        for i, (text, client) in enumerate(zip(turns, [ca, cb, ca, ca], strict=True)):
            before = len(history)
            history += reference_engine.tokenizer.encode(text, add_special=not history)
            got = client.complete(history, GREEDY, session_id="conv")
            assert got.token_ids == expected[i], f"turn {i}"
            # the K/V of all the history (but its last token, whose K/V the turn before never computed) came
            # from the session: on B from A's blob, on A again from B's blob (its own copy was stale)
            assert got.usage.cached_tokens == max(before - 1, 0), f"turn {i}"
            history += got.token_ids
        assert stores[0].keys() == ["conv"]
        assert [s.session_id for s in cb.list_sessions()] == ["conv"]


def test_two_replicas_never_serve_one_session_at_once(replicas):
    (a, b), probes, _ = replicas
    probes[0].step_delay = 0.02
    with Client(a.address) as ca, Client(b.address) as cb:
        long = ca.generate("Hello", SamplingOptions(max_tokens=60, ignore_eos=True), session_id="race")
        chunks = iter(long)
        next(chunks)
        for call in (lambda: cb.complete("Hello", GREEDY, session_id="race"), lambda: cb.delete_session("race"),
                     lambda: list(cb.snapshot("race"))):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "another replica" in refused.value.details()
        assert 1 + sum(len(c.token_ids) for c in chunks) == 60
        probes[0].step_delay = 0.0
        assert cb.complete("Hello", GREEDY, session_id="race").usage.cached_tokens > 0  # now b's turn, from the blob


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_without_redis_session_calls_are_unavailable_and_the_rest_goes_on(tiny_model, tmp_path):
    port = _free_port()
    redis_process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                      "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        store = _connect_when_up(f"redis://127.0.0.1:{port}/0", open_gguf(tiny_model).fingerprint)
        server = ServerThread(ProbeEngine(lucekv.load(tiny_model, backend="cpu", snapshot_store=store)))
        with Client(server.address) as c:
            c.complete("Hello", GREEDY, session_id="s")
            redis_process.kill()
            redis_process.wait()
            for call in (lambda: c.complete("Hello", GREEDY, session_id="s"), lambda: c.list_sessions()):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "Redis" in refused.value.details()
            assert c.complete("Hello", GREEDY).usage.completion_tokens == GREEDY.max_tokens
        server.stop()  # saving and releasing fail, logged: the stop itself does not
    finally:
        redis_process.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _connect_when_up(url: str, fingerprint: str) -> RedisSnapshotStore:
    deadline = time.monotonic() + 10
    while True:
        try:
            return RedisSnapshotStore(url, fingerprint)
        except ConfigError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
