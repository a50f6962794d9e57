"""The CPU backend's whole-model decode step against the decoder's op-by-op forward on the same backend."""

from __future__ import annotations

from itertools import pairwise

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import lucekv
from lucekv.kernels.cpu.step import TILES, embed_rows, round_to_f16
from lucekv.kvflash.pager import CHUNK_TOKENS
from lucekv.model.decoder import forward
from lucekv.model.synth import write_synthetic_gguf

# every product kernel (q4, q8 by 32 and by 16, f32), biases (qwen2), q/k norms (qwen3), post norms, GELU,
# sliding windows and the embedding scale (gemma3, 6 layers: one global)
CASES = [("llama", Q.Q4_1, {}), ("qwen2", Q.Q5_0, {"ffn_down.weight": Q.Q6_K}), ("qwen3", Q.Q4_K, {}),
         ("gemma3", Q.F16, {"ffn_up.weight": Q.Q8_0})]
K_DIMS = {"n_embd": 256, "head_dim": 64, "n_ff": 512}
# The step's products take x as int16 codes per 32-block (1.5e-5 of a block's largest element), the op-by-op path
# float32: measured up to 2.2e-4 apart in the logits (relative to the largest) on the llama Q4_1 verify block, whose
# synthetic biases are ~7x its scales (the float sums cancel, so x's rounding weighs more), 4.3e-5 on qwen2
STEP_BOUND = 5e-4
# The post-RoPE queries of the same token, step against op by op: up to 1.4e-4 apart (relative to the largest) on the
# qwen3 Q4_K case, whose second layer meets the prompt's K/V (the prompt's int16 tile products; 7.5e-5 when they
# were float32 BLAS: a different K/V, differently sensitive to x's rounding), 8e-5 or less on the others
QUERY_BOUND = 2e-4


@pytest.mark.parametrize("kv_dtype", ["f16", "f32"])
@pytest.mark.parametrize("arch,qtype,overrides", CASES, ids=[c[0] for c in CASES])
def test_decode_step_equals_op_by_op_forward(arch, qtype, overrides, kv_dtype, tmp_path):
    dims = K_DIMS if qtype == Q.Q4_K or Q.Q6_K in overrides.values() else {}
    path = write_synthetic_gguf(tmp_path / f"{arch}.gguf", arch, qtype=qtype, qtype_overrides=overrides,
                                n_layer=6 if arch == "gemma3" else 2, sliding_window=8, **dims)
    backend = lucekv.load(path, backend="cpu", kv_dtype=kv_dtype).backend
    ids = np.arange(5, 25, dtype=np.int32)
    n = len(ids)
    at = np.arange(n, dtype=np.int32)
    backend.forward(ids[:-1], at[:-1], at[:-1])  # a prompt longer than the window: local layers see a part
    one = at[-1:]
    backend.pool.assign(one, one)
    backend.ops.begin_step(1, None)
    ref = forward(backend.spec, backend.weights, backend.ops, ids[-1:], one, one)
    ref_q = backend.last_queries()
    for threads in (1, 2):
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        try:
            logits = backend.forward(ids[-1:], one, one)
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        err = np.abs(logits - ref).max() / np.abs(ref).max()
        assert err <= STEP_BOUND, f"{arch} {kv_dtype} {threads} threads: {err:.2e}"
        assert np.abs(backend.last_queries() - ref_q).max() <= QUERY_BOUND * np.abs(ref_q).max()


@pytest.mark.parametrize("arch,qtype,overrides", CASES[:2], ids=[c[0] for c in CASES[:2]])
def test_verify_block_equals_its_tokens_one_at_a_time(arch, qtype, overrides, tmp_path):
    """A verify block (one sequence's tokens, every logit) is decode-step rows: row i gives what token i gives alone
    after the tokens before it, bit for bit, on any thread count; and it stays within the step's bound of the
    op-by-op forward. The sequence's blocks are scattered, as the engine's are."""
    dims = K_DIMS if Q.Q6_K in overrides.values() else {}
    path = write_synthetic_gguf(tmp_path / f"{arch}.gguf", arch, qtype=qtype, qtype_overrides=overrides, n_layer=2,
                                sliding_window=8, **dims)
    backend = lucekv.load(path, backend="cpu", kv_dtype="f16").backend
    table = np.array([3, 1], np.int32)  # logical blocks 0, 1 in pool blocks 3, 1
    ids = np.arange(5, 5 + CHUNK_TOKENS + 6, dtype=np.int32)  # the block crosses into the second chunk
    pos = np.arange(len(ids), dtype=np.int32)
    slots = table[pos // CHUNK_TOKENS] * CHUNK_TOKENS + pos % CHUNK_TOKENS
    start = CHUNK_TOKENS - 3
    backend.forward(ids[:start], pos[:start], slots[:start], tables=[table[:1]])  # the prompt (op by op)
    block = ids[start:], pos[start:], slots[start:]
    for threads in (1, 2):
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        try:
            backend.pool.truncate(start)
            got = backend.forward(*block, all_logits=True, tables=[table])
            greedy = backend.forward_argmax(*block, tables=[table])
            queries = backend.last_queries()
            backend.pool.truncate(start)
            alone = [backend.forward(ids[p:p + 1], pos[p:p + 1], slots[p:p + 1], all_logits=True,
                                     tables=[table[:p // CHUNK_TOKENS + 1]]) for p in range(start, len(ids))]
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        assert np.array_equal(got, np.concatenate(alone)), f"{threads} threads"
        assert np.array_equal(greedy, np.argmax(got, axis=1))
        assert np.array_equal(queries, backend.last_queries())
    backend.pool.truncate(start)
    backend.pool.assign(block[2], block[1])
    backend.ops.begin_step(len(block[0]), [table])
    ref = forward(backend.spec, backend.weights, backend.ops, *block, all_logits=True)
    assert np.abs(got - ref).max() <= STEP_BOUND * np.abs(ref).max()
    # a prompt piece (the last logits only) is rows of the step too: a piece of one token gives its row's logits
    backend.pool.truncate(start)
    assert np.array_equal(backend.forward(ids[start:start + 1], pos[start:start + 1], slots[start:start + 1],
                                          tables=[table]), got[:1])


def test_prefill_with_fewer_kv_heads_than_threads(tmp_path):
    """One kv head, two threads: one thread's share of the heads is empty (gemma3-270m has one kv head)."""
    path = write_synthetic_gguf(tmp_path / "one_kv.gguf", "llama", n_kv_head=1)
    engine = lucekv.load(path, backend="cpu", kv_dtype="f32")
    ids = list(range(5, 25))
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        two = engine.score(ids)
    finally:
        numba.set_num_threads(1)
    try:
        one = engine.score(ids)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert np.abs(two - one).max() <= 1e-5 * np.abs(one).max()


def test_round_to_f16_equals_numpy():
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 65504.0, 65520.0, 1e-8, 6e-8, 3e-8, 2.98e-8, 6.1e-5, -6.1e-5,
                        1.0009765625, 1.00048828125, 1.00146484375], np.float32)
    values = np.concatenate([special, rng.normal(0, 1, 4000).astype(np.float32),
                             rng.normal(0, 1e-5, 4000).astype(np.float32),
                             rng.normal(0, 3e4, 1000).astype(np.float32),
                             rng.integers(0, 1 << 32, 4000, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    values = values[~np.isnan(values)]
    out = np.empty(len(values), np.uint16)
    round_to_f16(values.view(np.uint32), out)
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16).view(np.uint16)
    assert np.array_equal(out, expected), values[out != expected][:5]


@pytest.mark.parametrize("arch,qtype,overrides", CASES, ids=[c[0] for c in CASES])
def test_step_embeddings_from_the_arena_equal_the_op_by_op_ones(arch, qtype, overrides, tmp_path):
    """The step embeds tokens from its grouped arena (embed_rows): the rows quants.dequantize_rows gives, bit for bit
    (Q4_1: q4 with float16 biases; Q5_0: q8; Q4_K: float32 scales; F16: float, and gemma3's embedding scale), the last
    row too."""
    dims = K_DIMS if qtype == Q.Q4_K or Q.Q6_K in overrides.values() else {}
    path = write_synthetic_gguf(tmp_path / f"{arch}.gguf", arch, qtype=qtype, qtype_overrides=overrides, n_layer=1,
                                **dims)
    backend = lucekv.load(path, backend="cpu", kv_dtype="f32").backend
    step, table = backend.decode_step, backend.weights.token_embd
    tokens = np.array([0, 5, 17, table.rows - 1], np.int64)
    got = np.empty((len(tokens), table.cols), np.float32)
    a = step.arenas
    embed_rows(a.codes, a.scales, a.table, step.token_embd, tokens, step.embed_scale, got)
    scale = float(np.sqrt(backend.spec.n_embd)) if backend.spec.arch.embed_scale else 1.0
    assert np.array_equal(got, backend.ops.embed(table, tokens, scale))


@pytest.mark.parametrize("arch,qtype,overrides,tiles", [(*CASES[0], False), (*CASES[0], True), (*CASES[3], False)],
                         ids=["llama", "llama-tiles", "gemma3"])
def test_a_prompt_gives_the_same_rows_however_it_is_cut_into_pieces(arch, qtype, overrides, tiles, tmp_path):
    """A prompt's K/V rows and last logits do not depend on how it is cut into pieces (a reused prefix leaves the rest
    of a prompt to compute, from any position; one token may be left): every token's numbers are its own, bit for
    bit, on any thread count. `tiles`: pieces of 16 tokens or more through the tile kernels (where the CPU has VNNI;
    here their generic IR), shorter ones through the row kernels."""
    path = write_synthetic_gguf(tmp_path / f"{arch}.gguf", arch, qtype=qtype, qtype_overrides=overrides,
                                n_layer=6 if arch == "gemma3" else 2, sliding_window=8)
    backend = lucekv.load(path, backend="cpu", kv_dtype="f16").backend
    backend.decode_step.dims[TILES] = tiles
    n = 2 * CHUNK_TOKENS + 22
    ids = (np.arange(n, dtype=np.int32) * 7 + 5) % 200 + 3
    pos = np.arange(n, dtype=np.int32)
    table = np.array([2, 0, 1], np.int32)  # logical blocks in scattered pool blocks, as the engine's
    slots = table[pos // CHUNK_TOKENS] * CHUNK_TOKENS + pos % CHUNK_TOKENS

    def prefill(cuts: list[int], threads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        backend.pool.truncate(0)
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        try:
            for s, e in pairwise(cuts):
                logits = backend.forward(ids[s:e], pos[s:e], slots[s:e], tables=[table[:-(-e // CHUNK_TOKENS)]])
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        return logits, backend.pool.k_all[:, slots].copy(), backend.pool.v_all[:, slots].copy()

    whole = prefill([0, n], 1)
    for cuts, threads in (([0, n], 2), ([0, 1, n], 1), ([0, n - 1, n], 2), ([0, 70, n], 2),
                          ([0, CHUNK_TOKENS, 2 * CHUNK_TOKENS, n], 1), ([0, 5, 100, n], 2)):
        got = prefill(cuts, threads)
        for name, a, b in zip(("logits", "K", "V"), got, whole, strict=True):
            assert np.array_equal(a, b), f"{name} of cuts {cuts}, {threads} threads"
