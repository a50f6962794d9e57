"""Spark storage on the CUDA backend (backends/cuda_spark): a placement of another model is refused before anything
is allocated; on a GPU, every placement and cache size decodes the tokens of all experts resident. (The products
over the storage are compared with the all-resident ones in the simulator: tests/kernels/test_cuda_moe.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from lucekv.backends.cuda_spark import SparkOptions, SparkStore
from lucekv.errors import ConfigError
from lucekv.spark.placement import Placement
from tests.kernels.cuda_sim import needs_gpu


def test_a_placement_of_another_model_or_layout_is_refused():
    spec = SimpleNamespace(n_layer=1, n_expert=8, n_expert_used=2)
    with pytest.raises(ConfigError, match="another model"):
        SparkStore(SparkOptions(Placement("other", 8, ((0,),))), spec, "this", stream=None)
    with pytest.raises(ConfigError, match="2 layers x 8 experts, the model 1 x 8"):
        SparkStore(SparkOptions(Placement("this", 8, ((0,), (1,)))), spec, "this", stream=None)


@pytest.mark.gpu
@needs_gpu
def test_any_placement_and_cache_decode_the_tokens_of_all_experts_resident_gpu(tmp_path, model_path):
    """The k-means-routed upcycled smollm2 (8 distinct experts, top-2, routers fitted to its own FFN inputs on code and
    prose): 128 greedy tokens after a 64-token prose prompt (prefill: the grouped matmul, reading cold experts through
    the mapping) with 30% and 50% of the experts' bytes placed uniformly, calibrated (on a trace of code decoded on the
    GPU), and calibrated with a spare slot per layer (then again after promotions): identical to every expert on the
    GPU, cold experts served."""
    from lucekv.backends.cuda import CudaBackend
    from lucekv.bench.spark import CALIBRATION, MEASURED, greedy_decode
    from lucekv.model.arch import ModelSpec
    from lucekv.model.gguf import open_gguf
    from lucekv.model.synth import kmeans_routers, write_upcycled_gguf
    from lucekv.model.tokenizer import Tokenizer
    from lucekv.spark.cli import expert_bytes
    from lucekv.spark.placement import calibrated, uniform
    from lucekv.spark.trace import RoutingTrace

    dense = model_path("smollm2-135m")
    routers = kmeans_routers(dense, [("code", CALIBRATION * 8), ("prose", MEASURED * 8)], 8, 2, max_tokens=256)
    g = open_gguf(write_upcycled_gguf(tmp_path / "kmeans.gguf", dense, n_expert=8, n_expert_used=2, distinct=True,
                                      routers=routers, router_label="kmeans"))
    spec = ModelSpec.from_gguf(g)
    tok = Tokenizer.from_metadata(g.metadata)
    prompt = np.asarray(tok.encode(MEASURED * 8)[:64], np.int32)
    want, _ = greedy_decode(CudaBackend(g, spec, "f16", 512), prompt, 128)

    everything = Placement(g.fingerprint, 8, tuple(tuple(range(8)) for _ in range(spec.n_layer)))
    backend = CudaBackend(g, spec, "f16", 512, spark=SparkOptions(everything))
    trace = backend.spark.trace = RoutingTrace.empty(g.fingerprint, spec.n_layer, 8, 2)
    greedy_decode(backend, np.asarray(tok.encode(CALIBRATION * 8)[:64], np.int32), 64)
    backend.spark.trace = None
    assert trace.tokens == 64 and backend.spark.stats.cold == 0
    sizes = expert_bytes(g)
    for share in (0.3, 0.5):
        budget = int(share * 8 * sum(sizes))
        for name, options in {"uniform": SparkOptions(uniform(g.fingerprint, 8, sizes, budget)),
                              "calibrated": SparkOptions(calibrated(trace, sizes, budget)),
                              "calibrated+cache": SparkOptions(calibrated(trace, sizes, budget - sum(sizes)), 1, 4)
                              }.items():
            backend.place_experts(options)
            got, speed = greedy_decode(backend, prompt, 128)
            stats = backend.spark.stats.to_json()
            print(f"{share:.0%} {name}: {speed:.1f} tok/s, {stats}")
            assert got == want, f"{share:.0%} {name}: first difference at {np.flatnonzero(np.array(got) != want)[0]}"
            assert stats["cold_per_token"] > 0
            assert (stats["fills"] > 0) == (options.spare > 0)
            if options.promote:  # a request's end: busier cold experts placed, then the same tokens again
                assert backend.spark.promote()
                again, _ = greedy_decode(backend, prompt, 128)
                assert again == want, f"{share:.0%} {name} after promotions"


def test_the_engine_refuses_a_placement_for_another_model_or_on_the_cpu_backend(tmp_path):
    import lucekv
    from lucekv.model.gguf import open_gguf
    from lucekv.model.synth import write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path / "moe.gguf", "qwen3moe", n_layer=1, n_expert=4, n_expert_used=2, n_ff=64)
    placement = tmp_path / "placement.json"
    Placement("another model", 4, ((0, 1),)).save(placement)
    with pytest.raises(ConfigError, match="expert placement is of another model"):
        lucekv.load(str(path), backend="cpu", spark_placement=placement)
    Placement(open_gguf(path).fingerprint, 4, ((0, 1),)).save(placement)
    with pytest.raises(ConfigError, match="needs the CUDA backend"):
        lucekv.load(str(path), backend="cpu", spark_placement=placement, spark_spare=1)
