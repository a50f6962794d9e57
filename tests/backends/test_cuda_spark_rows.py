"""Spark's cache learns from decode rows (several sequences' tokens in one step, backends/cuda_spark): every real row's
experts are counted and admitted, padding rows not; in the simulator on the store's bookkeeping and, on a GPU,
through the CUDA backend's rows graphs, whose tokens equal all experts resident."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from lucekv.kernels.cuda import available, cuda
from tests.kernels.cuda_sim import needs_gpu, needs_kernels, run_in_simulator


@pytest.mark.skipif(available(), reason="kernels run directly in this process")
def test_spark_rows_in_simulator():
    run_in_simulator(__file__)


@needs_kernels
def test_a_step_of_decode_rows_counts_and_admits_every_rows_experts():
    """Experts 5 and 1 placed, one spare slot; a step of 3 rows (of a bucket of 4: the fourth is padding) selecting
    2 twice: 4 of its 6 selections cold, 2 counted twice in the trace, the padding row's 0 and 4 nowhere; 2 takes the
    spare slot, shown from the next step boundary on."""
    from lucekv.backends.cuda_spark import SparkOptions, SparkStore
    from lucekv.spark.cache import COLD
    from lucekv.spark.placement import Placement
    from lucekv.spark.trace import RoutingTrace

    spec = SimpleNamespace(n_layer=1, n_expert=8, n_expert_used=2)
    store = SparkStore(SparkOptions(Placement("fp", 8, ((5, 1),)), spare=1), spec, "fp", cuda.stream(), max_rows=4)
    store.trace = RoutingTrace.empty("fp", 1, 8, 2)
    ids = np.array([[2, 5], [2, 7], [1, 3], [0, 4]], np.int32)
    store.rows_ids(0, 4).copy_to_device(ids)  # as a 4-row graph's routers leave them
    store.observe_rows(3)
    assert (store.stats.steps, store.stats.tokens, store.stats.selections, store.stats.cold, store.stats.fills) == \
        (1, 3, 6, 4, 1)
    np.testing.assert_array_equal(store.trace.counts[0], [0, 1, 2, 1, 0, 1, 0, 1])
    assert store.slots.remap[0, 2] == 2 and store.remap.copy_to_host()[0, 2] == COLD
    store.observe_rows(3)  # read the remap of the first boundary: 2 still cold there
    assert store.stats.cold == 8 and store.remap.copy_to_host()[0, 2] == 2
    store.observe_rows(3)
    assert store.stats.cold == 8 + 2 and store.stats.tokens == 9


@pytest.mark.gpu
@needs_gpu
def test_decode_rows_under_spark_give_the_tokens_of_all_experts_resident_and_feed_the_cache_gpu(tmp_path):
    """Three sequences decoded as rows (the 4-row graph, one padding row) for 12 steps, 2 of 8 experts placed and a
    spare slot per layer: the greedy tokens of every expert resident, and the rows' experts filled the cache."""
    from lucekv.backends.cuda import CudaBackend
    from lucekv.backends.cuda_spark import SparkOptions
    from lucekv.kvflash.pager import CHUNK_TOKENS
    from lucekv.model.arch import ModelSpec
    from lucekv.model.gguf import open_gguf
    from lucekv.model.synth import write_synthetic_gguf
    from lucekv.spark.placement import Placement

    g = open_gguf(write_synthetic_gguf(tmp_path / "moe.gguf", "qwen3moe", qtype=Q.Q8_0, n_embd=256, n_head=4,
                                       n_kv_head=2, head_dim=64, n_ff=256, n_ff_expert=128, n_layer=2, n_expert=8,
                                       n_expert_used=2, seed=5))
    spec = ModelSpec.from_gguf(g)
    placement = Placement(g.fingerprint, 8, ((3, 6), (0, 5)))
    pool = 4 * CHUNK_TOKENS
    results = []
    for spark in (None, SparkOptions(placement, spare=1)):
        b = CudaBackend(g, spec, "f16", pool, max_rows=3, spark=spark)
        tables = [np.array([i], np.int32) for i in range(3)]
        last = []
        for i, table in enumerate(tables):
            ids = np.array([7 + i, 40, 99 + 5 * i, 12], np.int32)
            slots = (table[0] * CHUNK_TOKENS + np.arange(4)).astype(np.int32)
            last.append(int(np.argmax(b.forward(ids, np.arange(4, dtype=np.int32), slots, tables=[table])[-1]
                                      [: spec.vocab_size])))
        tokens = []
        for step in range(12):
            pos = np.full(3, 4 + step, np.int32)
            slots = (np.array([t[0] for t in tables]) * CHUNK_TOKENS + 4 + step).astype(np.int32)
            last = b.decode_rows(np.array(last, np.int32), pos, slots, tables, [])[0].tolist()
            tokens.append(last)
        results.append(tokens)
        if spark is not None:
            stats = b.spark.stats
            assert stats.tokens == 36 and stats.cold > 0 and stats.fills > 0
    assert results[1] == results[0]
