"""KVFlash through the CPU backend: paging moves real K/V bytes and attention stays position-exact."""

import numpy as np
import pytest

import lucekv
from lucekv.engine.sampling import SamplingParams
from lucekv.errors import ConfigError, InvalidRequestError
from lucekv.kvflash.host_store import MemoryHostStore
from lucekv.kvflash.pager import PageIn, PageOut
from lucekv.model.synth import write_synthetic_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("kv") / "tiny.gguf", "llama", n_ctx=4096, vocab=512)


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(10, 500, n).tolist()


def greedy(engine, ids, n=12, **kw):
    out = list(engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)))
    return [d.token_ids[0] for d in out], out


def test_a_pool_that_holds_everything_equals_the_full_cache(model):
    ids = prompt(700)
    full, full_out = greedy(lucekv.load(model, backend="cpu", kv_dtype="f32"), ids, logprobs=True)
    pooled_engine = lucekv.load(model, backend="cpu", kv_dtype="f32", kv_pool=1024)
    pooled, pooled_out = greedy(pooled_engine, ids, logprobs=True)
    assert pooled == full
    # the two caches hold K/V a few ulps apart (the first decode step, from equal tokens, positions and slots, gives
    # logits 7e-7 apart with 2 threads), and the decode step quantizes each row's x to 16-bit codes per block, so a
    # code may round the other way: logprobs 5.0e-5 apart at most over these 12 tokens (1 thread: within 1e-5)
    for a, b in zip(full_out, pooled_out, strict=True):
        assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 5e-4
    assert pooled_engine.paged.usage().page_outs == 0


def test_prefill_of_a_prompt_four_times_the_pool_runs_at_constant_pool_memory(model):
    engine = lucekv.load(model, backend="cpu", kv_pool=512, kv_policy="lru")
    pool_bytes = sum(k.nbytes + v.nbytes for k, v in zip(engine.backend.pool.k, engine.backend.pool.v, strict=True))
    tokens, out = greedy(engine, prompt(2048), n=8)
    assert len(tokens) == 8 and out[-1].finish_reason == "length"
    usage = engine.paged.usage()
    assert usage.resident_chunks <= 512 // 64
    assert usage.resident_chunks + usage.paged_chunks == -(-(2048 + 7) // 64)
    assert usage.page_outs >= 2048 // 64 - 512 // 64
    assert sum(k.nbytes + v.nbytes for k, v in zip(engine.backend.pool.k, engine.backend.pool.v,
                                                    strict=True)) == pool_bytes
    assert engine.paged.host.nbytes == usage.paged_chunks * engine.paged.host.chunk_bytes


def test_a_pooled_prefill_forwards_the_largest_batches_that_fit_beside_the_protected_chunks(model):
    engine = lucekv.load(model, backend="cpu", kv_pool=512, kv_policy="lru", step_tokens=1024)
    engine.backend.prefill_chunk = 1024  # more than the pool: batches shrink to whole chunks that fit
    sizes = []
    forward = engine.backend.forward
    engine.backend.forward = lambda tokens, *a, **kw: sizes.append(len(tokens)) or forward(tokens, *a, **kw)
    greedy(engine, prompt(2048), n=1)
    # 8 blocks: the first 8 chunks, then 7 beside the sink (the tail lies inside the batch), then the rest but the
    # prompt's tail, which goes alone (its queries rank the chunks to recall; lru recalls none: no recompute)
    assert sizes == [512, 448, 448, 448, 128, 64]
    assert engine.paged.usage().resident_chunks == 8


def test_a_pooled_prompt_tail_is_computed_again_after_its_queries_recall_chunks(model):
    engine = lucekv.load(model, backend="cpu", kv_pool=512, kv_policy="quest")
    calls = []  # (first position, tokens, page-ins so far) of each forward
    forward = engine.backend.forward
    engine.backend.forward = lambda tokens, pos, *a, **kw: calls.append(
        (int(pos[0]), len(tokens), engine.paged.usage().page_ins)) or forward(tokens, pos, *a, **kw)
    greedy(engine, prompt(2048, seed=3), n=1)
    tail = [c for c in calls if c[0] == 2048 - 64]
    assert tail[0][1] == 64 and 2 <= len(tail) <= 3  # the tail alone, then again after each recall (2 rounds)
    assert all(later[2] > earlier[2] for earlier, later in zip(tail, tail[1:], strict=False))  # chunks came back
    assert calls[-1][0] == 2048 - 64  # nothing else before the first sample
    # before each tail again, the resident chunks between the sink and the tail, in order, their tokens only
    again = calls[calls.index(tail[0]) + 1 : calls.index(tail[1])]
    assert again and all(pos % 64 == 0 and 64 <= pos and pos + n <= 2048 - 64 for pos, n, _ in again)
    assert [pos for pos, _, _ in again] == sorted(pos for pos, _, _ in again)
    spans = engine.paged.resident_spans(2048 - 64)  # of the last recall: whole resident chunks, neighbours joined
    resident = engine.paged.pager.resident_chunks().tolist()
    assert {p for a, b in spans for p in range(a, b)} == {p for c in resident for p in range(64 * c, 64 * c + 64)
                                                         if 64 <= p < 2048 - 64}
    assert all(b < a for (_, b), (a, _) in zip(spans, spans[1:], strict=False))


def test_a_prompt_the_pool_holds_whole_goes_without_a_tail_piece(model):
    """Nothing is paged out of a context within the residency budget, so no chunk can be recalled for its last
    tokens: one prefill piece (a 64-token tail piece touched every expert again on an MoE model)."""
    engine = lucekv.load(model, backend="cpu", kv_pool=1024, kv_policy="quest")
    calls = []
    forward = engine.backend.forward
    engine.backend.forward = lambda tokens, pos, *a, **kw: calls.append((int(pos[0]), len(tokens))) or forward(
        tokens, pos, *a, **kw)
    greedy(engine, prompt(700, seed=4), n=1)
    assert calls == [(0, 256), (256, 256), (512, 188)]  # the CPU backend's 256-token pieces, and no (636, 64)
    assert engine.paged.usage().page_outs == 0


def test_decode_never_reads_a_free_or_paged_out_slot(model):
    ids = prompt(1500, seed=1)
    engine = lucekv.load(model, backend="cpu", kv_dtype="f32", kv_pool=512, kv_policy="lru")
    reference, _ = greedy(engine, ids, n=10)
    greedy(engine, ids[:-1], n=1)  # the pool now holds the prompt but its last token, some of it paged out
    pool = engine.backend.pool
    invisible = pool.slot_pos < 0
    assert invisible.any() or engine.paged.usage().paged_chunks > 0
    for k, v in zip(pool.k, pool.v, strict=True):
        k[invisible] = np.nan
        v[invisible] = np.nan
    again, out = greedy(engine, ids, n=10, logprobs=True)
    assert again == reference
    assert all(np.isfinite(d.logprobs[0].logprob) for d in out)


def test_page_out_then_in_to_another_block_is_bit_exact(model):
    engine = lucekv.load(model, backend="cpu", kv_dtype="f16")
    backend = engine.backend
    engine.score(prompt(256))
    host = MemoryHostStore(len(backend.pool.k), 64, engine.spec.n_kv_head, engine.spec.head_dim, np.float16)
    before = [(k[64:128].copy(), v[64:128].copy()) for k, v in zip(backend.pool.k, backend.pool.v, strict=True)]
    backend.execute([PageOut(chunk=1, block=1), PageIn(chunk=1, block=5)], host)
    for (k0, v0), k, v in zip(before, backend.pool.k, backend.pool.v, strict=True):
        assert k[320:384].tobytes() == k0.tobytes() and v[320:384].tobytes() == v0.tobytes()


def test_relocated_slots_give_the_same_logits(model):
    """The same tokens in a shuffled block layout, read through their block table in logical order (as the engine's
    forwards are): attention is position-exact in slot space, the logits the same bit for bit."""
    ids = np.asarray(prompt(320, seed=2), np.int32)
    pos = np.arange(len(ids), dtype=np.int32)
    engine = lucekv.load(model, backend="cpu", kv_dtype="f32")
    in_order = np.arange(len(ids) // 64, dtype=np.int32)
    identity = engine.backend.forward(ids, pos, pos, all_logits=True, tables=[in_order])
    engine.backend.pool.clear()
    blocks = np.random.default_rng(3).permutation(engine.backend.pool.size // 64)[: len(ids) // 64].astype(np.int32)
    shuffled = (blocks[pos // 64] * 64 + pos % 64).astype(np.int32)
    relocated = engine.backend.forward(ids, pos, shuffled, all_logits=True, tables=[blocks])
    assert np.array_equal(relocated, identity)


@pytest.mark.parametrize("policy", ["quest", "meankey"])
def test_scoring_policies_run_end_to_end(model, policy):
    engine = lucekv.load(model, backend="cpu", kv_pool=512, kv_policy=policy, kv_tau=8)
    ids = prompt(1200, seed=4)
    n = engine.paged.policy.tau_eff(len(ids) + 40) + 2  # at least one reselect during decode
    tokens, _ = greedy(engine, ids, n=n)
    assert len(tokens) == n
    pager = engine.paged.pager
    resident = pager.block_of[: pager.n_chunks] >= 0
    free_choice = resident & ~pager.protected_mask()
    paged = ~resident
    assert paged.any() and free_choice.any()
    # after the reselect the chunks kept by choice score at least as high as every paged-out one
    assert pager.scores[: pager.n_chunks][free_choice].min() >= pager.scores[: pager.n_chunks][paged].max()


def test_a_pool_too_small_for_the_protections_is_refused(model):
    with pytest.raises(ConfigError, match="pool"):
        lucekv.load(model, backend="cpu", kv_pool=128)


def test_a_pinned_prefix_stays_resident_through_a_prompt_twice_the_pool(model):
    engine = lucekv.load(model, backend="cpu", kv_pool=1024, kv_policy="lru")
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    list(engine.generate(prompt(2048), params, "s", pin_prefix=200))  # chunks 0..3 hold tokens 0..199
    pager = engine.paged.pager
    assert (pager.block_of[:4] >= 0).all() and pager.pins == [(0, 200)]
    assert engine.paged.usage().page_outs > 0  # others were paged out around them
    list(engine.generate(prompt(2048) + [5], params, "s", pin_prefix=0))
    assert pager.pins == []


@pytest.mark.parametrize(("pin", "message"), [(3000, r"pin_prefix_tokens: must be in \[0, 2048\]"),
                                              (400, r"pin_prefix_tokens: pinning tokens \[0, 400\) would pin 6")])
def test_a_pin_the_pool_cannot_hold_is_refused(model, pin, message):
    engine = lucekv.load(model, backend="cpu", kv_pool=512, kv_policy="lru")
    with pytest.raises(InvalidRequestError, match=message):
        list(engine.generate(prompt(2048), SamplingParams(max_tokens=1), "s", pin_prefix=pin))
    assert engine.paged.pager.pins == []


def test_run_ahead_decode_with_reselects_equals_the_step_by_step_loop(model):
    ids = prompt(1200, seed=5)
    runs = []
    for logprobs in (False, True):  # logprobs need host logits: one step at a time
        engine = lucekv.load(model, backend="cpu", kv_pool=512, kv_policy="quest", kv_tau=8)
        n = 2 * engine.paged.policy.tau_eff(len(ids) + 80) + 70  # reselects and chunk boundaries during decode
        tokens, _ = greedy(engine, ids, n=n, logprobs=logprobs)
        usage = engine.paged.usage()
        runs.append((tokens, usage.page_ins, usage.page_outs, engine.paged.pager.scores.copy()))
    (ahead, *ahead_rest), (stepwise, *stepwise_rest) = runs
    assert ahead == stepwise
    assert ahead_rest[:2] == stepwise_rest[:2] and ahead_rest[0] > 0
    np.testing.assert_array_equal(ahead_rest[2], stepwise_rest[2])
