"""Decode rows on the CPU backend: several sequences, each over its own blocks of one pool, in one forward. Each row
gives the numbers its sequence gives alone, bit for bit, and attention over scattered blocks equals float64."""

from __future__ import annotations

import numpy as np
import pytest

from lucekv.backends.cpu import CpuBackend
from lucekv.kernels.cpu.attention import attend_rows
from lucekv.kvflash.pager import CHUNK_TOKENS
from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import open_gguf
from lucekv.model.synth import write_synthetic_gguf


def reference_attention(q, k, v, sp, positions, window, scale):
    """float64: each query over its own slots (k, v, sp: lists per query)."""
    out = np.zeros(q.shape)
    group = q.shape[1] // k[0].shape[1]
    for t in range(len(q)):
        vis = (sp[t] >= 0) & (sp[t] <= positions[t])
        if window:
            vis &= sp[t] > positions[t] - window
        for h in range(q.shape[1]):
            s = k[t][vis, h // group].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[t, h] = p @ v[t][vis, h // group].astype(np.float64) / p.sum()
    return out


@pytest.mark.parametrize("window", [0, 40])
def test_rows_attend_over_their_own_slots_like_float64(window):
    rng = np.random.default_rng(0)
    n, n_head, n_kv, d = 3, 4, 2, 16
    lengths = [70, 5, 150]
    q = rng.standard_normal((n, n_head, d)).astype(np.float32)
    ks = [rng.standard_normal((m, n_kv, d)).astype(np.float16) for m in lengths]
    vs = [rng.standard_normal((m, n_kv, d)).astype(np.float16) for m in lengths]
    sps = [rng.permutation(m).astype(np.int32) - (m // 10) for m in lengths]  # some slots free (-1 and below)
    positions = np.array([60, 4, 149], np.int32)
    offsets = np.cumsum([0] + lengths)
    got = attend_rows(q, np.concatenate(ks).astype(np.float32), np.concatenate(vs).astype(np.float32),
                      np.concatenate(sps), offsets, positions, window, 0.25)
    want = reference_attention(q, ks, vs, sps, positions, window, 0.25)
    assert np.max(np.abs(got - want)) < 1e-5 * np.max(np.abs(want))
    alone = attend_rows(q[1:2], ks[1].astype(np.float32), vs[1].astype(np.float32), sps[1],
                        np.array([0, lengths[1]]), positions[1:2], window, 0.25)
    assert np.array_equal(alone[0], got[1])  # a row's numbers do not depend on its batch


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def backend(request, tmp_path_factory):
    path = write_synthetic_gguf(tmp_path_factory.mktemp("batch") / f"{request.param}.gguf", request.param,
                                n_ctx=1024, vocab=512)
    g = open_gguf(path)
    return CpuBackend(g, ModelSpec.from_gguf(g), "f16", 1024), path


def test_decode_rows_give_each_sequence_its_own_logits_exactly(backend):
    backend, path = backend
    rng = np.random.default_rng(1)
    # three sequences in scattered blocks of one pool (block lists in logical order)
    blocks = rng.permutation(backend.pool.size // CHUNK_TOKENS)
    lengths = [100, 7, 190]
    tables, at = [], 0
    for m in lengths:
        k = -(-(m + 1) // CHUNK_TOKENS)
        tables.append(blocks[at : at + k].astype(np.int32))
        at += k

    def slots(table, pos):
        return (table[pos // CHUNK_TOKENS] * CHUNK_TOKENS + pos % CHUNK_TOKENS).astype(np.int32)

    prompts = [rng.integers(0, 512, m).astype(np.int32) for m in lengths]
    for ids, table in zip(prompts, tables, strict=True):
        pos = np.arange(len(ids), dtype=np.int32)
        backend.forward(ids, pos, slots(table, pos), tables=[table])
    tokens = rng.integers(0, 512, 3).astype(np.int32)
    pos = np.array(lengths, np.int32)
    row_slots = np.array([slots(t, p) for t, p in zip(tables, pos, strict=True)], np.int32)
    greedy, batched = backend.decode_rows(tokens, pos, row_slots, tables, sampled=[0, 1, 2])
    assert batched.shape == (3, backend.spec.vocab_size)
    assert np.array_equal(greedy, np.argmax(batched, axis=1))
    for i in range(3):  # a decode step alone, as decode_ahead takes it
        alone = backend.forward(tokens[i : i + 1], pos[i : i + 1], row_slots[i : i + 1], all_logits=True,
                                tables=[tables[i]])
        assert np.array_equal(alone[0], batched[i]), f"row {i}"
    # and a sequence in scattered blocks computes what it computes alone in a pool of its own, slot = position
    g = open_gguf(path)
    fresh = CpuBackend(g, ModelSpec.from_gguf(g), "f16", 1024)
    ids = np.concatenate([prompts[2], tokens[2:]])
    identity = fresh.forward(ids, np.arange(len(ids), dtype=np.int32), np.arange(len(ids), dtype=np.int32))
    assert np.max(np.abs(identity[-1] - batched[2])) < 1e-4 * np.max(np.abs(identity[-1]))
