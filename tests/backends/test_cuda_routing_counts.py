"""Routing counts on the CUDA backend (`--spark-record`, kernels/cuda/expert_counts): the count kernel against numpy
(padding rows not counted, a take clears) and the MoE op's counts against a float64 top-k, in the simulator; on a GPU,
the backend's counts of a prompt and decode steps through its captured (padded) graphs beside the CPU backend's."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from lucekv.kernels.cuda import available, cuda
from tests.kernels.cuda_sim import needs_gpu, needs_kernels, run_in_simulator


@pytest.mark.skipif(available(), reason="kernels run directly in this process")
def test_routing_counts_in_simulator():
    run_in_simulator(__file__)


@needs_kernels
def test_padding_rows_are_not_counted_and_a_take_clears():
    from lucekv.kernels.cuda._numba import device_zeros
    from lucekv.kernels.cuda.expert_counts import count_experts, take_counts

    rng = np.random.default_rng(1)
    ids = np.stack([rng.permutation(8)[:3] for _ in range(5)]).astype(np.int32)
    positions = np.array([-1, -1, 7, 8, 9], np.int32)  # two padding rows first, as a padded prompt piece has them
    stream = cuda.stream()
    counts = device_zeros((2, 8), np.int32, stream)
    count_experts(cuda.to_device(ids, stream=stream), cuda.to_device(positions, stream=stream), counts[1], stream)
    want = np.zeros((2, 8), np.int64)
    want[1] = np.bincount(ids[2:].ravel(), minlength=8)
    np.testing.assert_array_equal(take_counts(counts, stream), want)
    np.testing.assert_array_equal(take_counts(counts, stream), 0)


@needs_kernels
def test_the_moe_op_counts_its_routed_experts(tmp_path):
    """CudaOps.moe_ffn with routing counted: a token's top-k (float64 reference from the router and the normalized
    input) added to its layer's counts."""
    from lucekv.backends.cuda import CudaKVPool, CudaOps
    from lucekv.kernels.cuda._numba import device_zeros
    from lucekv.kernels.cuda.expert_counts import take_counts
    from lucekv.model.arch import ModelSpec
    from lucekv.model.decoder import load_weights
    from lucekv.model.gguf import open_gguf
    from lucekv.model.synth import write_synthetic_gguf
    from tests.kernels import moe_reference

    g = open_gguf(write_synthetic_gguf(tmp_path / "moe.gguf", "qwen3moe", qtype=Q.Q8_0, n_embd=64, n_head=4,
                                       n_kv_head=2, head_dim=16, n_ff=64, n_ff_expert=32, n_layer=1, n_expert=8,
                                       n_expert_used=3, seed=4))
    spec = ModelSpec.from_gguf(g)
    stream = cuda.stream()
    ops = CudaOps(spec, CudaKVPool(spec, 64, "f32", stream), stream)
    layer = load_weights(g, spec, ops).layers[0]
    counts = device_zeros((1, 8), np.int32, stream)
    ops.routing_counts = [counts[0]]
    x = np.random.default_rng(3).standard_normal((1, spec.n_embd)).astype(np.float32)
    x64 = x.astype(np.float64)
    h = x64 / np.sqrt(np.mean(x64 * x64) + spec.rms_eps) * moe_reference.dequantized(g, "blk.0.ffn_norm.weight")
    want, _ = moe_reference.route(h, moe_reference.dequantized(g, "blk.0.ffn_gate_inp.weight"), 3, False)
    ops.positions = cuda.to_device(np.array([7], np.int32), stream=stream)  # (a padding row's, -1: the kernel test)
    ops.moe_ffn(cuda.to_device(x, stream=stream), layer.moe, layer.ffn_norm)
    np.testing.assert_array_equal(take_counts(counts, stream)[0], np.bincount(want[0], minlength=8))


@pytest.mark.gpu
@needs_gpu
def test_the_cuda_backend_counts_the_routing_the_cpu_backend_counts_gpu(tmp_path):
    """A 6-token prompt (a prompt piece padded to its graph's width) and 4 decode steps run ahead (the decode graph):
    per layer, every real token's experts counted on the device (padding rows and the graphs' captures not), those the
    CPU backend counts but for a near tie or two. (Minutes in the simulator: GPU only.)"""
    from lucekv.backends.cpu import CpuBackend
    from lucekv.backends.cuda import CudaBackend
    from lucekv.model.arch import ModelSpec
    from lucekv.model.gguf import open_gguf
    from lucekv.model.synth import write_synthetic_gguf

    g = open_gguf(write_synthetic_gguf(tmp_path / "moe.gguf", "qwen3moe", qtype=Q.Q8_0, n_embd=64, n_head=4,
                                       n_kv_head=2, head_dim=16, n_ff=64, n_ff_expert=32, n_layer=2, n_expert=8,
                                       n_expert_used=3, seed=4))
    spec = ModelSpec.from_gguf(g)
    backends = CpuBackend(g, spec, "f32", 64), CudaBackend(g, spec, "f32", 128)
    counts = []
    for b in backends:
        b.count_routing()
        b.prepare(16, 2)  # the graphs of prompt pieces and decode steps, captured counting (no token counted)
        tokens = np.array([5, 17, 42, 7, 99, 3], np.int32)
        pos = np.arange(len(tokens), dtype=np.int32)
        first = int(np.argmax(b.forward(tokens, pos, pos)[-1][: spec.vocab_size]))
        b.decode_ahead(6, 6, first)
        for p in range(7, 10):
            b.decode_ahead(p, p, None)
        for _ in range(4):
            b.next_token()
        counts.append(b.take_routing_counts())
        assert b.take_routing_counts().sum() == 0
    np.testing.assert_array_equal(counts[1].sum(axis=1), 10 * 3)  # every real token, no padding row, in each layer
    # the same experts as the CPU's but where the GPU's rounding (tensor-core products) flips a near tie at the k-th
    # expert: a flip moves one selection
    assert np.abs(counts[1] - counts[0]).sum() <= 2 * 2, (counts[1], counts[0])
