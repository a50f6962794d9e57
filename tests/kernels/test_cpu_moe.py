"""CPU mixture of experts: routing, grouping by expert, and the MoE FFN on every quant type against float64."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from lucekv.backends.cpu import CpuOps, KVPool
from lucekv.kernels.cpu.moe import group_by_expert, route
from lucekv.kernels.cpu.quants import SUPPORTED_QTYPES
from lucekv.model.arch import ModelSpec
from lucekv.model.decoder import load_weights
from lucekv.model.gguf import open_gguf
from lucekv.model.synth import write_synthetic_gguf
from tests.kernels import moe_reference


def test_route_takes_the_top_k_of_the_softmax_renormalised_or_not():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((50, 16)).astype(np.float32)
    for renormalise in (False, True):
        ids, weights = route(logits, 4, renormalise)
        ref_ids, ref_w = moe_reference.route(logits.astype(np.float64), np.eye(16), 4, renormalise)  # h @ I = logits
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_allclose(weights, ref_w, rtol=1e-6)
    assert np.allclose(route(logits, 4, True)[1].sum(axis=1), 1, atol=1e-6)
    assert (route(logits, 4, False)[1].sum(axis=1) < 1).all()


def test_route_breaks_ties_by_the_lower_expert_id():
    ids, weights = route(np.array([[0.5, 2.0, 0.5, 2.0, 0.5]], np.float32), 3, True)
    assert ids.tolist() == [[1, 3, 0]]
    assert weights[0, 0] == weights[0, 1] > weights[0, 2]


def test_group_by_expert_is_a_stable_counting_sort():
    ids = np.array([[2, 0], [2, 1], [0, 2]], np.int32)
    order, starts = group_by_expert(ids, 4)
    assert starts.tolist() == [0, 2, 3, 6, 6]
    assert order.tolist() == [1, 4, 3, 0, 2, 5]  # expert 0: flat 1, 4; expert 1: 3; expert 2: 0, 2, 5


def small_dims(qtype: Q) -> dict:
    if qtype.name.endswith("_K"):
        return {"n_embd": 256, "head_dim": 64, "n_ff": 256}
    return {"n_embd": 64, "head_dim": 16, "n_ff": 64}


@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_moe_ffn_matches_float64_on_every_quant_type(tmp_path, qtype):
    """qwen2moe (a shared expert beside 8 routed ones, top-3, weights not renormalised), every matrix in `qtype`: a
    prefill of 7 tokens and each token alone against the float64 reference."""
    path = write_synthetic_gguf(tmp_path / "m.gguf", "qwen2moe", qtype=qtype, n_layer=1, n_expert=8,
                                n_expert_used=3, seed=3, **small_dims(qtype))
    g = open_gguf(path)
    spec = ModelSpec.from_gguf(g)
    ops = CpuOps(spec, KVPool(spec, 64, "f32"))
    layer = load_weights(g, spec, ops).layers[0]
    x = np.random.default_rng(1).standard_normal((7, spec.n_embd)).astype(np.float32)
    h = ops.rmsnorm(x, layer.ffn_norm)
    ref = moe_reference.moe_ffn(h, moe_reference.moe_layer(g, 0), 3, renormalise=False)

    prefill = ops.moe_ffn(x, layer.moe, layer.ffn_norm) - x
    err = np.abs(prefill - ref).max() / np.abs(ref).max()
    assert err < 2e-6, f"{qtype.name}: {err:.2e}"
    one_by_one = np.concatenate([ops.moe_ffn(x[i:i + 1], layer.moe, layer.ffn_norm) for i in range(len(x))]) - x
    assert np.abs(one_by_one - ref).max() / np.abs(ref).max() < 2e-6
