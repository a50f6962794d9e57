"""CUDA verify forwards and prompt pieces padded to a bucket's width, decode rows' tables, and products of a few
tokens as matvec rows.

A verify block of n tokens replays the graph of its bucket (`verify_bucket`), the padding rows first, at position
-1, writing the pool's scratch block. Every kernel that reads positions or slots takes a padding row here next to
real ones, against the same call without it: attention (split and tensor-core), RoPE with the pool write and the
kept last query. Then the backend's bookkeeping, with a stand-in forward (a whole forward takes minutes in the
simulator) whose pool writes and kept queries are the real kernel's and with graphs simulated by running the recorded
launches again: the real rows' tokens and logits, the slot map and K/V of a sequence in the pool, the queries the
pager's scorers read, and `prepare_verify` beside that sequence. Last, products of a few tokens: matvec rows (a grid
row per token) against the tensor-core matmul, and each row equal to that token's one-token product.

Without a GPU, `test_in_simulator` runs this file under numba's CUDA simulator.
"""

from __future__ import annotations

import numpy as np
import pytest

from lucekv.kernels.cuda import available, cuda
from lucekv.kvflash.pager import CHUNK_TOKENS
from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import open_gguf
from lucekv.model.synth import write_synthetic_gguf
from tests.kernels.cuda_sim import needs_kernels, run_in_simulator
from tests.kernels.test_cuda_kernels import rel_err

VOCAB = 512


@pytest.mark.skipif(available(), reason="runs directly in this process")
def test_in_simulator():
    run_in_simulator(__file__)


# ---- kernels: a padding row beside real ones ---------------------------------------------------------------------


def attend_rows(positions: np.ndarray, flash: bool, seed: int = 3) -> np.ndarray:
    """Queries at `positions` (-1: padding) over one sequence in blocks [1, 0] of a float16 pool (its free slots
    interleaved); each query's vector drawn from its position, so that a query is the same padded or not."""
    from lucekv.kernels.cuda.attention import BLOCK, BlockTables, attend, partials
    from lucekv.kernels.cuda.flash import attend as flash_attend

    n_head, n_kv, d = 2, 1, 16
    rng = np.random.default_rng(seed)
    k_pool = (rng.standard_normal((2 * BLOCK, n_kv, d)) * 0.5).astype(np.float16)
    v_pool = rng.standard_normal((2 * BLOCK, n_kv, d)).astype(np.float16)
    slot_pos = np.full(2 * BLOCK, -1, np.int32)
    slot_pos[BLOCK : 2 * BLOCK] = np.arange(BLOCK)
    slot_pos[: BLOCK - 10] = BLOCK + np.arange(BLOCK - 10)
    q = np.stack([np.random.default_rng(1000 + int(p)).standard_normal(n_head * d) for p in positions])
    tables = BlockTables(cuda.to_device(np.array([1, 0], np.int32)), cuda.to_device(np.zeros(1, np.int32)),
                         cuda.to_device(np.array([2 * BLOCK], np.int32)),
                         cuda.to_device(np.zeros(len(positions), np.int32)))
    out = cuda.device_array((len(positions), n_head * d), np.float32)
    args = (cuda.to_device(q.astype(np.float32)), cuda.to_device(k_pool), cuda.to_device(v_pool),
            cuda.to_device(slot_pos), tables, cuda.to_device(positions.astype(np.int32)), 0, 1 / np.sqrt(d))
    if flash:
        flash_attend(*args, out)
    else:
        attend(*args, partials(len(positions), n_head, n_kv, d, 2 * BLOCK), out, one_sequence=True)
    return out.copy_to_host()


@needs_kernels
@pytest.mark.parametrize(("real", "pad", "flash"), [(2, 1, False), (17, 3, True)], ids=["split", "flash"])
def test_attention_padding_rows_see_nothing_and_change_no_real_row(real, pad, flash):
    positions = 2 * CHUNK_TOKENS - 10 + np.arange(real)
    alone = attend_rows(positions, flash)
    padded = attend_rows(np.concatenate([np.full(pad, -1), positions]), flash)
    np.testing.assert_array_equal(padded[pad:], alone)
    assert not padded[:pad].any()  # nothing visible: zeros, not NaN


@needs_kernels
def test_rope_and_store_of_padding_rows_writes_their_scratch_slots_and_keeps_the_last_real_query():
    from lucekv.kernels.cuda.attention import rope_and_store
    from lucekv.kernels.cuda.rope import Rotary
    from lucekv.model.rope import RopeScaling, frequencies

    n_heads, n_kv, head_dim = 2, 1, 16
    rope = Rotary(cuda.to_device(frequencies(1e4, head_dim, RopeScaling())), True, False)
    rng = np.random.default_rng(4)
    q = rng.standard_normal((3, n_heads * head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((3, n_kv * head_dim)).astype(np.float32) for _ in range(2))

    def run(pad: int):
        positions = np.array([-1] * pad + [40, 41, 42], np.int32)
        slots = np.array(list(range(6, 6 + pad)) + [1, 2, 3], np.int32)  # 6, 7: the scratch
        k_pool, v_pool = (cuda.to_device(np.full((8, n_kv, head_dim), np.nan, np.float32)) for _ in range(2))
        q_out, last_q = (cuda.device_array((rows, q.shape[1]), np.float32) for rows in (pad + 3, 1))
        rows = [np.concatenate([rng.standard_normal((pad, x.shape[1])), x]).astype(np.float32) for x in (q, k, v)]
        rope_and_store(*(cuda.to_device(x) for x in rows), cuda.to_device(positions), cuda.to_device(slots), rope,
                       k_pool, v_pool, q_out, last_q)
        return q_out.copy_to_host()[pad:], last_q.copy_to_host(), k_pool.copy_to_host(), v_pool.copy_to_host()

    (q0, last0, k0, v0), (q2, last2, k2, v2) = run(0), run(2)
    np.testing.assert_array_equal(q2, q0)
    np.testing.assert_array_equal(last2, q0[-1:])  # the last real row's, as unpadded
    np.testing.assert_array_equal(last2, last0)
    for pool0, pool2 in ((k0, k2), (v0, v2)):
        np.testing.assert_array_equal(pool2[1:4], pool0[1:4])
        assert not np.isnan(pool2[6:8]).any() and np.isnan(pool2[[0, 4, 5]]).all()  # scratch written, rest not


# ---- the backend: padded verify forwards through (simulated) graphs ------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("verify") / "tiny.gguf", "llama", n_ctx=4096, vocab=VOCAB)


def backend_of(model, use_graph: bool, max_rows: int = 1):
    from lucekv.backends.cuda import CudaBackend

    g = open_gguf(model)
    return CudaBackend(g, ModelSpec.from_gguf(g), "f32", 3 * CHUNK_TOKENS, use_graph=use_graph, max_rows=max_rows)


def stand_in_forward(spec, weights, ops, tokens, positions, slots, all_logits):
    """A forward's effects on the pool through the real kernels (mark_slots before it; here RoPE and the K/V of
    layer 0 written to the step's slots, each row's query kept as the real forward keeps it), and logits from the
    step's device inputs: row t's peak at (31 token + position) % VOCAB, -1 where position is -1 (padding)."""
    from lucekv.kernels.cuda import attention
    from lucekv.kernels.cuda.rope import Rotary

    tok, pos = ops.tokens.copy_to_host(), ops.positions.copy_to_host()
    n, pool = len(tok), ops.pool
    q, k, v = (np.stack([np.sin(np.arange(width) * (1 + t) + p) for t, p in zip(tok, pos, strict=True)]
                        ).astype(np.float32) for width in (spec.n_head * spec.head_dim,
                                                           spec.n_kv_head * spec.head_dim,
                                                           spec.n_kv_head * spec.head_dim))
    rope = Rotary(next(iter(ops._inv_freq.values())), spec.arch.rope_style == "neox", ops._paired)
    q_rot = cuda.device_array(q.shape, np.float32)
    attention.rope_and_store(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), ops.positions, ops.slots, rope,
                             pool.k[0], pool.v[0], q_rot, pool.last_q[: ops.kept_rows, 0])
    if pool.recent_rows:  # (CudaOps.set_tables counted them)
        pool.recent_q[0, : pool.recent_rows].copy_to_device(q_rot[n - pool.recent_rows :])
    logits = np.zeros((n, VOCAB), np.float32)
    logits[np.arange(n), (31 * tok + pos) % VOCAB] = np.where(pos >= 0, 1.0, -1.0)
    return cuda.to_device(logits if all_logits else logits[-1:])


@pytest.fixture
def stand_ins(monkeypatch):
    """The stand-in forward; a graph's capture records nothing and its replay runs the recorded launches again."""
    import lucekv.backends.cuda as cuda_module

    monkeypatch.setattr(cuda_module, "forward", stand_in_forward)
    monkeypatch.setattr(cuda_module, "capture_graph", lambda stream, record: (record() or record, 0))
    monkeypatch.setattr(cuda_module, "launch_graph", lambda record, stream: record())


def expected(tokens, positions) -> list[int]:
    return ((31 * np.asarray(tokens) + np.asarray(positions)) % VOCAB).tolist()


def pool_state(b) -> tuple:
    return (b.pool.kv.copy_to_host(), b.pool.slot_pos.copy(), b.pool.d_slot_pos.copy_to_host(), b.pool.high_water)


@needs_kernels
def test_prepare_verify_and_padded_verify_forwards_leave_the_sequence_and_the_paging_state_as_unpadded(model,
                                                                                                      stand_ins):
    from lucekv.backends.cuda import verify_bucket

    table = [np.array([1, 0], np.int32)]  # the sequence's blocks; block 2 is the backend's scratch
    prompt = np.arange(20, 90, dtype=np.int32)
    slots_of = (table[0][np.arange(100) // CHUNK_TOKENS] * CHUNK_TOKENS + np.arange(100) % CHUNK_TOKENS).astype(
        np.int32)

    def run(use_graph: bool) -> dict:
        b = backend_of(model, use_graph)
        pos = np.arange(len(prompt), dtype=np.int32)
        b.forward(prompt, pos, slots_of[pos], tables=table)
        before = pool_state(b)
        b.prepare_verify(5)
        after = pool_state(b)
        r = {"before": before, "after": after, "graphs": sorted(b.verify_graphs or {})}
        pos = np.arange(70, 73, dtype=np.int32)
        r["argmax"] = b.forward_argmax(np.array([5, 6, 7], np.int32), pos, slots_of[pos], tables=table).tolist()
        r["last_q"], r["recent"] = b.last_queries(), b.recent_queries()
        pos = np.arange(73, 78, dtype=np.int32)  # 5 tokens: the bucket of 8 replays them, logits to the host
        r["logits"] = b.forward(np.arange(1, 6, dtype=np.int32), pos, slots_of[pos], all_logits=True, tables=table)
        r["last_q_2"], r["recent_2"] = b.last_queries(), b.recent_queries()
        r["end"] = pool_state(b)
        return r

    plain, padded = run(False), run(True)
    assert plain["graphs"] == [] and padded["graphs"] == [verify_bucket(w) for w in (4, 8)]
    real = slice(0, 2 * CHUNK_TOKENS)  # the sequence's blocks (the padding rows write block 2, the scratch)
    for state in (padded["after"], plain["after"]):  # prepare_verify disturbs nothing of the sequence in the pool
        (kv, *paging), (kv0, *paging0) = state, padded["before"]
        np.testing.assert_array_equal(kv[:, :, real], kv0[:, :, real])
        for got, before in zip(paging, paging0, strict=True):  # the slot map (host, device), the high-water mark
            np.testing.assert_array_equal(got, before)
    assert padded["argmax"] == plain["argmax"] == expected([5, 6, 7], [70, 71, 72])
    assert padded["logits"].shape == (5, VOCAB)
    np.testing.assert_array_equal(padded["logits"], plain["logits"])
    assert np.argmax(padded["logits"], axis=1).tolist() == expected(range(1, 6), range(73, 78))
    for key in ("last_q", "recent", "last_q_2", "recent_2"):  # the scorers' queries: the real rows' only
        np.testing.assert_array_equal(padded[key], plain[key], err_msg=key)
    assert padded["recent"].shape[0] == 3 and padded["recent_2"].shape[0] == 5
    kv, slot_pos, d_slot_pos, high_water = padded["end"]
    kv0, slot_pos0, d_slot_pos0, high_water0 = plain["end"]
    np.testing.assert_array_equal(kv[:, :, real], kv0[:, :, real])
    np.testing.assert_array_equal(slot_pos, slot_pos0)
    np.testing.assert_array_equal(d_slot_pos, slot_pos)  # the device map is the host's: the scratch block free
    assert (slot_pos[2 * CHUNK_TOKENS :] == -1).all() and high_water == high_water0 == 2 * CHUNK_TOKENS


@needs_kernels
def test_prepare_captures_every_forward_a_step_may_run_and_leaves_the_sequence_as_it_was(model, stand_ins,
                                                                                       monkeypatch):
    """The engine's warm-up (step pieces of up to 40 tokens, verify blocks of up to 5, decode rows of up to 5
    sequences): the one-token step's graph, the decode rows' of 2, 4 and 8 rows, the prompt pieces' of 16, 32 and 64
    (40 tokens pad to 64) and the verify blocks' of 4 and 8, all captured from padding rows; the sequence already in
    the pool and the slot map stay as they were. Then a one-token step, prompt pieces of several widths up to 40 and
    decode rows of 2 to 5 sequences capture nothing more (nothing compiles mid-request) and give their tokens."""
    import lucekv.backends.cuda as cuda_module

    captures = []
    simulated = cuda_module.capture_graph
    monkeypatch.setattr(cuda_module, "capture_graph", lambda stream, record: captures.append(1) or simulated(
        stream, record))
    table = [np.array([1, 0], np.int32)]
    slots_of = (table[0][np.arange(100) // CHUNK_TOKENS] * CHUNK_TOKENS + np.arange(100) % CHUNK_TOKENS).astype(
        np.int32)
    b = backend_of(model, True, max_rows=5)
    pos = np.arange(20, dtype=np.int32)
    b.forward(np.arange(20, 40, dtype=np.int32), pos, slots_of[pos], tables=table)  # its bucket of 32 captured now
    (kv0, *paging0), earlier = pool_state(b), len(captures)
    b.prepare(40, 5)
    assert len(captures) - earlier == 1 + 3 + 2 + 2  # decode, rows, pieces (32 was), verify
    assert b.graph.ready and [sorted(w for w, g in graphs.items() if g.ready)
                              for graphs in (b.row_graphs, b.prefill_graphs, b.verify_graphs)] == [[2, 4, 8],
                                                                                                 [16, 32, 64], [4, 8]]
    kv, *paging = pool_state(b)
    real = slice(0, 2 * CHUNK_TOKENS)
    np.testing.assert_array_equal(kv[:, :, real], kv0[:, :, real])
    for got, before in zip(paging, paging0, strict=True):  # the slot map (host, device), the high-water mark
        np.testing.assert_array_equal(got, before)
    earlier = len(captures)
    for n in (1, 15, 17, 40):  # a one-token step and prompt pieces, at positions 20..
        pos = np.arange(20, 20 + n, dtype=np.int32)
        logits = b.forward(np.arange(n, dtype=np.int32), pos, slots_of[pos], tables=table)
        assert int(np.argmax(logits)) == expected([n - 1], [19 + n])[0]
    for rows in range(2, 6):  # decode rows: one token of `rows` sequences (the others of no blocks yet)
        pos = np.arange(60, 60 + rows, dtype=np.int32)
        tables = table + [np.zeros(0, np.int32)] * (rows - 1)
        greedy, _ = b.decode_rows(np.arange(rows, dtype=np.int32), pos, slots_of[pos], tables, [])
        assert greedy.tolist() == expected(range(rows), pos)
    assert len(captures) == earlier


def test_prompt_piece_buckets_pad_little():
    """Powers of two up to 128 tokens (a product reads its weights once whatever the rows), then at most 1.5x."""
    from lucekv.backends.cuda import prefill_bucket

    widths = [prefill_bucket(n, 512) for n in (2, 16, 17, 100, 129, 200, 257, 385, 512)]
    assert widths == [16, 16, 32, 128, 192, 256, 384, 512, 512]
    assert all(n <= prefill_bucket(n, 512) <= max(128, 1.5 * n) for n in range(2, 513))
    assert prefill_bucket(5, 16) == 16  # a smaller chunk: its own width


@needs_kernels
def test_short_prompt_pieces_replay_their_width_buckets_padded_and_leave_what_unpadded_forwards_leave(model,
                                                                                                      stand_ins):
    """Prompt pieces of 5, 20 and 3 tokens of one sequence: with graphs, the buckets of 16 (captured beforehand by
    prepare_prefill from padding rows alone, then replayed twice) and 32 (captured at its first use), padding first.
    The last logits, the scorers' queries (the last token's, the recent rows': the real ones only), K/V of the
    sequence's blocks and the slot map equal the unpadded forwards'."""
    table = [np.array([1, 0], np.int32)]
    slots_of = (table[0][np.arange(100) // CHUNK_TOKENS] * CHUNK_TOKENS + np.arange(100) % CHUNK_TOKENS).astype(
        np.int32)

    def run(use_graph: bool) -> dict:
        b = backend_of(model, use_graph)
        b.prepare_prefill(16)
        r = {"prepared": sorted(w for w, g in (b.prefill_graphs or {}).items() if g.ready), "pieces": []}
        for start, n in ((0, 5), (5, 20), (25, 3)):
            pos = np.arange(start, start + n, dtype=np.int32)
            logits = b.forward(np.arange(7, 7 + n, dtype=np.int32), pos, slots_of[pos], tables=table)
            r["pieces"].append((logits, b.last_queries(), b.recent_queries()))
        r["graphs"] = sorted(b.prefill_graphs or {})
        r["end"] = pool_state(b)
        return r

    plain, padded = run(False), run(True)
    assert plain["prepared"] == [] and padded["prepared"] == [16] and padded["graphs"] == [16, 32]
    for i, (got, ref) in enumerate(zip(padded["pieces"], plain["pieces"], strict=True)):
        logits, last_q, recent = got
        assert logits.shape == (1, VOCAB) and int(np.argmax(logits)) == expected([6 + (5, 20, 3)[i]],
                                                                                [(4, 24, 27)[i]])[0]
        for a, b, what in zip(got, ref, ("logits", "last_q", "recent"), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"piece {i}: {what}")
        assert len(recent) == (5, 20, 3)[i]
    kv, slot_pos, d_slot_pos, high_water = padded["end"]
    kv0, slot_pos0, _, high_water0 = plain["end"]
    real = slice(0, 2 * CHUNK_TOKENS)
    np.testing.assert_array_equal(kv[:, :, real], kv0[:, :, real])
    np.testing.assert_array_equal(slot_pos, slot_pos0)
    np.testing.assert_array_equal(d_slot_pos, slot_pos)
    assert high_water == high_water0 == CHUNK_TOKENS + 28


@needs_kernels
def test_activation_pools_of_kept_widths_stay_and_count(model):
    """pool_bytes: the kept width's pools stay beside the latest forward's; another width replaces the latest."""
    from lucekv.backends.cuda import CudaKVPool, CudaOps

    spec = ModelSpec.from_gguf(open_gguf(model))
    stream = cuda.stream()
    ops = CudaOps(spec, CudaKVPool(spec, 2 * CHUNK_TOKENS, "f32", stream), stream, max_tokens=16)
    ops.keep_pools(16)
    w, none = cuda.to_device(np.ones(spec.n_embd, np.float32)), np.zeros(0, np.int32)
    for n in (16, 3, 5):
        ops.begin_step(np.zeros(n, np.int32), np.full(n, -1, np.int32), np.full(n, CHUNK_TOKENS, np.int32), mark=False,
                       tables=[none])
        x = ops.rmsnorm(cuda.to_device(np.ones((n, spec.n_embd), np.float32)), w)  # an array of the pools, and
        ops.rmsnorm(x, w)  # a second
    assert ops.pool_bytes() == {16: 2 * 16 * spec.n_embd * 4, 5: 2 * 5 * spec.n_embd * 4}


# ---- decode rows' block tables ----------------------------------------------------------------------------------


def attention_reference(q, k, v, slot_pos, table, position, n_head) -> np.ndarray:
    """float64 attention of one query [n_head * head_dim] over the slots of `table`'s blocks holding positions up to
    `position`."""
    slots = (table[:, None] * CHUNK_TOKENS + np.arange(CHUNK_TOKENS)).reshape(-1)
    slots = slots[(slot_pos[slots] >= 0) & (slot_pos[slots] <= position)]
    n_kv, d = k.shape[1:]
    out = []
    for h, qh in enumerate(q.reshape(n_head, d).astype(np.float64)):
        scores = k[slots, h // (n_head // n_kv)] @ qh / np.sqrt(d)
        w = np.exp(scores - scores.max())
        out.append(w @ v[slots, h // (n_head // n_kv)] / w.sum())
    return np.concatenate(out)


@needs_kernels
def test_decode_rows_read_their_own_blocks_after_a_table_change_through_the_same_buffers(model):
    """Two decode rows over their own blocks, through the inputs and BlockTables of their width, at fixed addresses
    (what a captured rows graph reads): after row 0 takes a new block (its table changes and goes up again, the
    other row's not), the same buffers give each row attention over its own blocks as they are now."""
    from lucekv.backends.cuda import CudaBackend
    from lucekv.kernels.cuda import attention

    g = open_gguf(model)
    spec = ModelSpec.from_gguf(g)
    b = CudaBackend(g, spec, "f32", 4 * CHUNK_TOKENS, use_graph=False, max_rows=2)
    ops, pool = b.ops, b.pool
    rng = np.random.default_rng(5)
    k, v = (rng.standard_normal(pool.k[0].shape).astype(np.float32) for _ in range(2))
    pool.k[0].copy_to_device(k)
    pool.v[0].copy_to_device(v)
    pool.assign(np.arange(63, dtype=np.int32), np.arange(63, dtype=np.int32))  # row 0: block 0, positions 0..62
    pool.assign(CHUNK_TOKENS + np.arange(40, dtype=np.int32), np.arange(40, dtype=np.int32))  # row 1: block 1
    pool.upload_slot_pos()
    ops.keep_pools(2)  # the rows' width, as a rows graph keeps it
    width = spec.n_head * spec.head_dim
    first = None
    for positions, tables in (([63, 40], [[0], [1]]), ([64, 41], [[0, 2], [1]])):  # row 0 enters block 2
        tables = [np.array(t, np.int32) for t in tables]
        positions = np.array(positions, np.int32)
        slots = np.array([t[p // CHUNK_TOKENS] * CHUNK_TOKENS + p % CHUNK_TOKENS for t, p in zip(tables, positions,
                                                                                              strict=True)], np.int32)
        pool.assign(slots, positions)
        ops.begin_step(np.zeros(2, np.int32), positions, slots, tables=tables)
        first = first or (ops.tables, ops.positions)
        assert ops.tables is first[0]  # the same device buffers, as a replay reads them
        flat, start, used, seq_of = (a.copy_to_host() for a in first[0])
        for row in range(2):  # what the kernels read: each row's own blocks
            s = seq_of[row]
            np.testing.assert_array_equal(flat[start[s] : start[s] + used[s] // CHUNK_TOKENS], tables[row])
    width = spec.n_head * spec.head_dim
    q = rng.standard_normal((2, width)).astype(np.float32)
    out = cuda.device_array((2, width), np.float32)
    attention.attend(cuda.to_device(q), pool.k[0], pool.v[0], pool.d_slot_pos, first[0], first[1], 0,
                     1 / np.sqrt(spec.head_dim), attention.partials(2, spec.n_head, spec.n_kv_head, spec.head_dim,
                                                                    pool.size), out)
    got = out.copy_to_host()
    for row in range(2):  # row 0 sees its new block's slot (position 64)
        ref = attention_reference(q[row], k, v, pool.slot_pos, tables[row], positions[row], spec.n_head)
        assert rel_err(got[row], ref) <= 1e-5, f"row {row} at position {positions[row]}"


# ---- matvec rows -------------------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("product", ["down", pytest.param("gate_up", marks=pytest.mark.slow)])
def test_products_of_a_few_tokens_as_matvec_rows_equal_the_matmul_and_each_tokens_own_product(model, product):
    """down: a product with a residual; gate_up (slow: a minute in the simulator, `-m slow` with
    NUMBA_ENABLE_CUDASIM=1): gate and up interleaved, act(gate) * up, of x normalized."""
    from lucekv.backends.cuda import MATVEC_TOKEN_ROWS

    b = backend_of(model, use_graph=False)
    ops, lw = b.ops, b.weights.layers[0]
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, b.spec.n_ff if product == "down" else b.spec.n_embd)).astype(np.float32)
    residual = rng.standard_normal((3, b.spec.n_embd)).astype(np.float32)
    assert ops.as_matvec_rows(lw.w_down, 3) and ops.as_matvec_rows(lw.gate_up[0].matrix, 3)

    def run(rows_limit: int, rows: slice) -> np.ndarray:
        ops.matvec_token_rows = rows_limit
        if product == "down":
            return ops.linear(lw.w_down, cuda.to_device(x[rows]), residual=cuda.to_device(residual[rows])
                              ).copy_to_host()
        return ops.gated_linear(cuda.to_device(x[rows]), lw.gate_up, lw.ffn_norm).copy_to_host()

    got, matmul = run(MATVEC_TOKEN_ROWS, slice(0, 3)), run(0, slice(0, 3))
    assert rel_err(got, matmul) <= 2e-3  # each within 1e-3 of float64 (tests/kernels/test_cuda_kernels.py)
    # one token: the decode step's matvec; gate_up normalizes x itself there (the rows take x normalized: equal
    # within rounding), down takes the same numbers
    alone = run(MATVEC_TOKEN_ROWS, slice(1, 2))
    if product == "down":
        np.testing.assert_array_equal(got[1:2], alone)
    else:
        assert rel_err(got[1:2], alone) <= 1e-5


@needs_kernels
def test_products_of_a_few_tokens_on_the_integer_tensor_cores_agree_with_each_tokens_own_product(model):
    """The backend's route for MMQ_MIN_TOKENS..mmq_tokens tokens (CudaOps.takes_mmq, x quantized once for q, k and v):
    each token's rows within x's 16 bits of its one-token step's (x in two int8 parts; this model's q8 matvec groups
    x's columns otherwise than runs of 32: measured 3e-5; q4 / q6 rows agree to float32 rounding, test_cuda_mmq.py),
    and equal whatever the other tokens; fewer tokens, or mmq_tokens 0, take the matvec rows / matmul route."""
    from lucekv.backends.cuda import MMQ_MIN_TOKENS

    b = backend_of(model, use_graph=False)
    ops, lw = b.ops, b.weights.layers[0]
    n = MMQ_MIN_TOKENS + 1
    assert all(ops.takes_mmq(w, n) for w in (lw.w_down, lw.wo, lw.gate_up[0].matrix, lw.qkv[0].matrix))
    assert not ops.takes_mmq(lw.w_down, MMQ_MIN_TOKENS - 1)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((n, b.spec.n_embd)).astype(np.float32)

    def run(rows: slice) -> list[np.ndarray]:
        outs = ops.project(cuda.to_device(x[rows]), lw.qkv, lw.attn_norm) + [
            ops.gated_linear(cuda.to_device(x[rows]), lw.gate_up, lw.ffn_norm)]
        return [o.copy_to_host() for o in outs]

    every = run(slice(0, n))
    assert all(rel_err(a[1:2], b1) <= 1e-4 for a, b1 in zip(every, run(slice(1, 2)), strict=True))
    assert all(np.array_equal(a[1:n], b2) for a, b2 in zip(every, run(slice(1, n)), strict=True))
    ops.mmq_tokens = 0
    assert not ops.takes_mmq(lw.w_down, n)
