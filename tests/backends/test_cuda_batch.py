"""Decode rows on the CUDA backend: several sequences in scattered blocks of one pool, one token each in one forward
(through a captured graph per batch size bucket on a GPU), against the CPU backend's rows."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from lucekv.kernels.cuda import SIMULATOR
from lucekv.kvflash.pager import CHUNK_TOKENS
from tests.kernels.cuda_sim import needs_gpu
from tests.kernels.test_cuda_kernels import F16_PREFILL, rel_err


def check_rows(tmp_path, use_graph: bool, lengths: list[int], steps: int, kv_dtype: str = "f32") -> None:
    """Prefill sequences of `lengths` tokens into scattered blocks, then decode `steps` tokens of all of them as
    rows (the last step without the first sequence): the CUDA rows' logits against the CPU backend's, and each
    greedy token the argmax of its row."""
    from lucekv.backends.cpu import CpuBackend
    from lucekv.backends.cuda import CudaBackend
    from lucekv.model.arch import ModelSpec
    from lucekv.model.gguf import open_gguf
    from lucekv.model.synth import write_synthetic_gguf

    g = open_gguf(write_synthetic_gguf(tmp_path / "m.gguf", "qwen2", qtype=Q.Q8_0, n_embd=256, n_head=8,
                                       n_kv_head=2, head_dim=32, n_ff=512, n_layer=2))
    spec = ModelSpec.from_gguf(g)
    n_blocks = sum(-(-(m + steps) // CHUNK_TOKENS) for m in lengths) + 2
    pool = n_blocks * CHUNK_TOKENS
    cpu = CpuBackend(g, spec, kv_dtype, pool)
    gpu = CudaBackend(g, spec, kv_dtype, pool + CHUNK_TOKENS, use_graph=use_graph, max_rows=len(lengths))
    rng = np.random.default_rng(4)
    blocks = rng.permutation(n_blocks).astype(np.int32)
    tables, at = [], 0
    for m in lengths:
        k = -(-(m + steps) // CHUNK_TOKENS)
        tables.append(blocks[at : at + k])
        at += k

    def slots(table, pos):
        return (table[pos // CHUNK_TOKENS] * CHUNK_TOKENS + pos % CHUNK_TOKENS).astype(np.int32)

    last = []
    for m, table in zip(lengths, tables, strict=True):
        ids = rng.integers(0, spec.vocab_size, m).astype(np.int32)
        pos = np.arange(m, dtype=np.int32)
        ref = cpu.forward(ids, pos, slots(table, pos), tables=[table])
        assert rel_err(gpu.forward(ids, pos, slots(table, pos), tables=[table]), ref) <= F16_PREFILL
        last.append(int(np.argmax(ref[-1])))
    for step in range(steps):
        rows = list(range(len(lengths)))[1 if step == steps - 1 else 0 :]  # the last step: a smaller batch
        tok = np.array([last[i] for i in rows], np.int32)
        pos = np.array([lengths[i] + step for i in rows], np.int32)
        row_slots = np.array([slots(tables[i], p) for i, p in zip(rows, pos, strict=True)], np.int32)
        row_tables = [tables[i] for i in rows]
        ref = cpu.forward(tok, pos, row_slots, tables=row_tables)
        greedy, logits = gpu.decode_rows(tok, pos, row_slots, row_tables, sampled=range(len(rows)))
        assert logits.shape == ref.shape and rel_err(logits, ref) <= F16_PREFILL, f"step {step}"
        assert greedy.tolist() == np.argmax(logits[:, : spec.vocab_size], axis=1).tolist()
        for i, r in enumerate(rows):
            last[r] = int(np.argmax(ref[i]))
    if use_graph:
        assert set(gpu.row_graphs) == {4, 2} and all(g.ready for g in gpu.row_graphs.values())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_decode_rows_through_bucket_graphs_match_the_cpu_rows(tmp_path, kv_dtype):
    # 3 rows: the bucket of 4 with a padding row, replayed after its capture; then 2 rows: the bucket of 2
    check_rows(tmp_path, True, [70, 5, 150], steps=6, kv_dtype=kv_dtype)


@pytest.mark.gpu
@needs_gpu
def test_eager_decode_rows_match_the_cpu_rows(tmp_path):
    check_rows(tmp_path, False, [70, 5, 150], steps=3)


@pytest.mark.slow
@pytest.mark.skipif(not SIMULATOR, reason="the simulator variant of the GPU tests above")
def test_decode_rows_simulated(tmp_path):
    check_rows(tmp_path, False, [20, 3], steps=2)
