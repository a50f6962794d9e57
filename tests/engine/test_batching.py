"""Continuous batching on the CPU backend: requests that share steps get exactly what they get alone, cancelled ones
free what they held, and the block pool's accounting always adds up."""

from __future__ import annotations

import numpy as np
import pytest

import lucekv
from lucekv.engine.sampling import SamplingParams
from lucekv.errors import ResourceLimitError
from lucekv.model.synth import write_synthetic_gguf
from tests.kernels.cuda_sim import needs_gpu


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("batch") / "tiny.gguf", "llama", n_ctx=4096, vocab=512)


def load(model, **kw):
    # a 512-token residency budget: the long request pages, the short ones fit
    return lucekv.load(model, backend="cpu", kv_pool=512, kv_policy="quest", kv_tau=16, **kw)


def prompt(n, seed):
    return np.random.default_rng(seed).integers(10, 500, n).tolist()


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def sampled(n, seed, **kw):
    return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=n, ignore_eos=True, **kw)


HISTORY = {"s1": prompt(300, 100), "s2": prompt(150, 101)}  # first turns of two sessions, run before the batch
REQUESTS = [  # (prompt, params, session)
    (prompt(30, 1), greedy(20), ""),
    (HISTORY["s1"] + prompt(40, 2), greedy(16), "s1"),
    (prompt(1200, 3), greedy(40), ""),  # pages through its 512-token budget, reselecting as it decodes
    (prompt(5, 4), sampled(24, seed=3), ""),
    (HISTORY["s2"] + prompt(20, 5), greedy(12, logprobs=True, top_logprobs=2), "s2"),
    (prompt(64, 6), greedy(18, stop_token_ids=[]), ""),
    (prompt(200, 7), sampled(10, seed=7, repetition_penalty=1.3), ""),
    (prompt(90, 8), greedy(30), ""),  # cancelled after its third token
]
CANCELLED, CANCEL_AFTER = 7, 3


def first_turns(engine):
    for sid, ids in HISTORY.items():
        list(engine.generate(ids, greedy(4), sid))
    return engine


def tokens(deltas):
    return [t for d in deltas for t in d.token_ids]


@pytest.fixture(scope="module")
def alone(model):
    """Each request run by itself, one after another."""
    engine = first_turns(load(model))
    return [list(engine.generate(ids, params, sid)) for ids, params, sid in REQUESTS]


def test_every_request_in_a_batch_of_eight_gets_what_it_gets_alone(model, alone):
    engine = first_turns(load(model, max_batch=8))
    requests = [engine.submit(engine.prepare(ids, params), params, sid) for ids, params, sid in REQUESTS]
    out = [[] for _ in requests]
    widest = 0
    while engine.has_work:
        engine.step()
        widest = max(widest, len(engine.scheduler.running))
        for i, r in enumerate(requests):
            while r.out:
                out[i].append(r.out.popleft())
            if i == CANCELLED and len(out[i]) == CANCEL_AFTER and not r.done:
                engine.cancel(r)
    assert widest == 8  # all of them shared steps
    for i, (got, want) in enumerate(zip(out, alone, strict=True)):
        if i == CANCELLED:
            assert tokens(got) == tokens(want)[:CANCEL_AFTER] and got[-1].finish_reason is None
            continue
        assert tokens(got) == tokens(want), f"request {i}"
        assert got[-1].finish_reason == want[-1].finish_reason
        if want[0].logprobs:
            assert [d.logprobs[0].logprob for d in got] == [d.logprobs[0].logprob for d in want]
    usage = [got[-1].usage for got in out]
    assert usage[2].kv_paged_chunks > 0  # the long one paged
    assert usage[0].batch_size > 1 and usage[0].queue_time_s >= 0
    assert usage[1].cached_tokens == len(HISTORY["s1"])  # the session's turn reused its K/V
    assert_pool_adds_up(engine)


def assert_pool_adds_up(engine):
    """Every held block belongs to a sequence the engine knows (idle sessions, the idle anonymous sequence), and
    dropping those returns the pool to empty."""
    holders = [s.paged for s in engine.sessions.in_memory()]
    if engine._anonymous is not None:
        holders.append(engine._anonymous.paged)
    assert engine.blocks.used_blocks == sum(seq.held_blocks for seq in holders)
    for s in engine.sessions.in_memory():
        engine.delete_session(s.id)
    if engine._anonymous is not None:
        engine._anonymous.paged.truncate(0)
    assert engine.blocks.used_blocks == 0


def test_random_cancellations_leave_no_block_behind_and_finished_streams_correct(model):
    rng = np.random.default_rng(9)
    engine = lucekv.load(model, backend="cpu", max_batch=6, kv_cache=4096)  # blocks run short: parking happens
    reference = lucekv.load(model, backend="cpu")
    preempted = []
    schedule = engine.scheduler.schedule

    def watched():
        step = schedule()
        preempted.extend(step.preempted)
        return step

    engine.scheduler.schedule = watched
    specs = [(prompt(int(rng.integers(1, 1500)), 50 + i), int(rng.integers(1, 40)), f"s{i % 3}" if i % 4 == 0 else "")
             for i in range(24)]
    live, finished, cancelled = [], 0, 0
    pending = list(specs)
    while pending or engine.has_work:
        for _ in range(int(rng.integers(0, 3))):
            if pending:
                ids, n, sid = pending.pop(0)
                live.append((engine.submit(ids, greedy(n), sid), ids, n, sid))
        engine.step()
        for entry in list(live):
            r, ids, n, sid = entry
            if not r.done and r.n_out and rng.random() < 0.03:
                engine.cancel(r)
                cancelled += 1
            if r.done:
                live.remove(entry)
                if r.finish and not sid:  # a session's answer depends on its history: compare anonymous ones
                    want = tokens(reference.generate(ids, greedy(n)))
                    assert [d.token_ids[0] for d in r.out] == want
                    finished += 1
                assert r.error is None
    assert finished > 5 and cancelled > 0 and preempted
    assert_pool_adds_up(engine)


def test_a_call_on_a_busy_session_waits_for_the_one_before_and_continues_from_it(model):
    first, more = prompt(100, 30), prompt(10, 31)
    reference = load(model)
    answer = tokens(reference.generate(first, greedy(6), "s"))
    follow_up = first + answer + more
    expected = tokens(reference.generate(follow_up, greedy(4), "s"))
    engine = load(model, max_batch=4)
    one, two = engine.submit(first, greedy(6), "s"), engine.submit(follow_up, greedy(4), "s")
    assert engine.scheduler.waiting == type(engine.scheduler.waiting)([one])  # the second waits outside the queue
    while engine.has_work:
        engine.step()
    assert tokens(one.out) == answer and tokens(two.out) == expected
    assert two.out[-1].usage.cached_tokens == len(first) + len(answer) - 1


def test_a_full_queue_is_refused_before_any_compute(model):
    engine = lucekv.load(model, backend="cpu", max_batch=1, max_queue=1)
    engine.submit(prompt(10, 1), greedy(5))  # the place in the batch
    engine.submit(prompt(10, 2), greedy(5))  # the one place in the queue
    with pytest.raises(ResourceLimitError, match="places in the request queue"):
        engine.submit(prompt(10, 3), greedy(5))


@pytest.mark.gpu
@needs_gpu
def test_a_batch_on_the_cuda_backend_decodes_what_the_cpu_backend_does(model):
    """Greedy requests batched on CUDA (decode rows through the bucket graphs, the tensor-core products) against the
    same batch on the CPU backend (which equals each request alone): the tokens agree (measured differences of such
    products are ~1e-3 of the logits; these synthetic models' top tokens are far apart)."""
    greedy_requests = [(ids, params, sid) for ids, params, sid in REQUESTS if params.greedy and not sid]
    outs = []
    for backend in ("cpu", "cuda"):
        engine = lucekv.load(model, backend=backend, kv_dtype="f16", max_batch=8)
        requests = [engine.submit(ids, params) for ids, params, _ in greedy_requests]
        while engine.has_work:
            engine.step()
        outs.append([[d.token_ids[0] for d in r.out] for r in requests])
        if backend == "cuda":
            assert set(engine.backend.row_graphs) >= {4}  # 4 greedy requests decode as the bucket of 4
    assert outs[0] == outs[1]
