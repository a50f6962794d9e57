"""Concurrent Generate streams share the engine's steps: each stream gets what it gets alone, cancellations at
random leave nothing behind, and the server reports its batch."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from server_harness import ProbeEngine, ServerThread, load_engine

from lucekv.client import Client, SamplingOptions
from lucekv.engine.sampling import SamplingParams


def prompts(n: int, longest: int = 120) -> list[list[int]]:
    """Random prompts, each with a first token of its own (no prompt reuses another's K/V as a prefix)."""
    rng = random.Random(3)
    return [[10 + i] + [rng.randrange(40, 300) for _ in range(rng.randrange(2, longest))] for i in range(n)]


def alone(engine, ids: list[int], n: int, seed: int | None = None) -> list[int]:
    params = SamplingParams(temperature=0.0 if seed is None else 0.9, seed=seed, max_tokens=n, ignore_eos=True)
    return [t for d in engine.generate(ids, params) for t in d.token_ids]


def test_concurrent_streams_each_get_what_they_get_alone(tiny_model, reference_engine):
    running = ServerThread(ProbeEngine(load_engine(tiny_model, max_batch=8)))
    cases = [(ids, 12 + i % 5, None if i % 3 else i) for i, ids in enumerate(prompts(8))]  # greedy, some sampled
    try:
        with Client(running.address) as c:
            def one(case):
                ids, n, seed = case
                options = SamplingOptions(temperature=0.0 if seed is None else 0.9, seed=seed, max_tokens=n,
                                          ignore_eos=True)
                chunks = list(c.generate(ids, options))
                return [t for ch in chunks for t in ch.token_ids], chunks[-1].usage

            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(one, cases))
            info = c.server_info()
    finally:
        running.stop()
    for (ids, n, seed), (tokens, _) in zip(cases, results, strict=True):
        assert tokens == alone(reference_engine, ids, n, seed)
    assert max(usage.batch_size for _, usage in results) > 1  # they shared steps
    assert info.max_batch == 8 and info.running_requests == 0 and info.kv_cache_tokens > 0


def test_streams_cancelled_at_random_leave_no_block_behind(tiny_model, reference_engine):
    """A CI-size soak: 24 streams, 6 at a time, a third cancelled after a random number of tokens; no INTERNAL, the
    finished ones correct, and the pool's blocks afterwards all with sequences the engine keeps."""
    probe = ProbeEngine(load_engine(tiny_model, max_batch=6, kv_cache=2048))  # a small pool: blocks run short
    running = ServerThread(probe)
    rng = random.Random(5)
    cases = [(ids, rng.randrange(4, 40), rng.random() < 0.33) for ids in prompts(24, longest=450)]
    finished: list[tuple[list[int], int, list[int]]] = []
    lock = threading.Lock()
    try:
        with Client(running.address) as c:
            def one(case):
                ids, n, cancel = case
                stream = c.generate(ids, SamplingOptions(temperature=0.0, max_tokens=n, ignore_eos=True))
                tokens = []
                try:
                    for chunk in stream:
                        tokens += chunk.token_ids
                        if cancel and len(tokens) >= n // 2:
                            stream.cancel()
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.CANCELLED, e
                    return
                with lock:
                    finished.append((ids, n, tokens))

            with ThreadPoolExecutor(6) as pool:
                list(pool.map(one, cases))
    finally:
        running.stop()
    assert len(finished) >= 10
    for ids, n, tokens in finished:
        assert tokens == alone(reference_engine, ids, n)
    engine = probe._engine
    holders = [s.paged for s in engine.sessions.in_memory()]
    if engine._anonymous is not None:
        holders.append(engine._anonymous.paged)
    assert engine.blocks.used_blocks == sum(seq.held_blocks for seq in holders)
    assert not engine.has_work
