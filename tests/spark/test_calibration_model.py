"""Spark's calibration models, on tiny files: the upcycled llama whose router is k-means over the dense model's own FFN
inputs, and the MoE whose router has a Zipf expert popularity."""

from __future__ import annotations

import numpy as np
import pytest

from lucekv.backends.cpu import CpuOps
from lucekv.cli import main as lucekv_main
from lucekv.model.gguf import open_gguf
from lucekv.model.synth import kmeans_routers, main, write_synthetic_gguf, write_upcycled_gguf
from lucekv.spark.cli import ffn_inputs, prompt_backend
from lucekv.spark.router import zipf_popularity
from lucekv.spark.trace import RoutingTrace

CODE = "def add(a, b):\n    for item in args.items:\n        print(item.name, item.value)\n    return 0\n" * 3
PROSE = "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun and the fox runs into the forest. " * 2
TEXTS = [("code", CODE), ("prose", PROSE)]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("dense") / "llama.gguf", "llama", n_layer=2, seed=5)


def test_ffn_inputs_are_the_dense_models_normalized_ffn_inputs(dense, tmp_path, monkeypatch):
    """The one-expert carrier kmeans_routers observes computes the dense model: the inputs it reports equal, in
    float64, rmsnorm(x) * norm of the x entering each dense FFN."""
    seen = []  # the dense model's FFN inputs, layer after layer of each forward
    gated_linear = CpuOps.gated_linear

    def spy(self, x, g, norm):
        x64 = x.astype(np.float64)
        seen.append(x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + self.spec.rms_eps) * norm)
        return gated_linear(self, x, g, norm)

    monkeypatch.setattr(CpuOps, "gated_linear", spy)
    backend, docs = prompt_backend(open_gguf(dense), TEXTS, 64)
    monkeypatch.setattr(backend, "prefill_chunk", 24)  # documents of several forwards (none of one token)
    assert all(len(ids) % 24 != 1 for _, ids in docs)
    backend.decode_step = None
    from lucekv.spark.cli import run_documents
    run_documents(backend, docs)
    reference = [np.concatenate(seen[layer::2]) for layer in range(2)]

    carrier = write_upcycled_gguf(tmp_path / "carrier.gguf", dense, n_expert=1, n_expert_used=1)
    moe_backend, moe_docs = prompt_backend(open_gguf(carrier), TEXTS, 64)
    moe_backend.prefill_chunk = 24
    observed = ffn_inputs(moe_backend, moe_docs)
    assert [len(h) for h in observed] == [sum(len(ids) for _, ids in docs)] * 2
    for layer in range(2):
        err = np.max(np.abs(observed[layer] - reference[layer])) / np.max(np.abs(reference[layer]))
        assert err < 1e-5, f"layer {layer}: relative error {err:.1e}"


def test_upcycle_kmeans_writes_the_fitted_routers_with_distinct_experts(dense, tmp_path, capsys):
    corpus = []
    for name, text in TEXTS:
        (tmp_path / f"{name}.txt").write_text(text)
        corpus += ["--corpus", str(tmp_path / f"{name}.txt")]
    out = tmp_path / "km.gguf"
    assert main(["upcycle", str(dense), str(out), "--router", "kmeans", "--experts", "3", "--max-tokens", "40",
                 *corpus]) == 0
    g = open_gguf(out)
    assert "upcycled 3x top-2 distinct k-means router" in g.metadata["general.name"]
    expected = kmeans_routers(dense, TEXTS, 3, max_tokens=40)
    for layer in range(2):
        router = np.asarray(g.tensor(f"blk.{layer}.ffn_gate_inp.weight").data)
        np.testing.assert_array_equal(router, expected[layer])
        norms = np.linalg.norm(router, axis=1)
        np.testing.assert_allclose(norms, norms[0], rtol=1e-5)  # one norm: a token's top-1 is its nearest centroid
        gate = np.asarray(g.tensor(f"blk.{layer}.ffn_gate_exps.weight").data)
        assert not np.array_equal(gate[0], gate[1])  # distinct experts
    # and it routes: every token of the corpus lands somewhere in each layer, on more than one expert
    assert lucekv_main(["spark", "trace", str(out), "--text", str(tmp_path / "code.txt"), "--text",
                        str(tmp_path / "prose.txt"), "--max-tokens", "40", "-o", str(tmp_path / "t.json")]) == 0
    counts = RoutingTrace.load(tmp_path / "t.json", g.fingerprint).counts
    assert (counts.sum(axis=1) == 80 * 2).all() and ((counts > 0).sum(axis=1) > 1).all()


def test_a_router_for_each_layer_of_the_right_shape_is_required(dense, tmp_path):
    with pytest.raises(ValueError, match="1 routers for 2 layers"):
        write_upcycled_gguf(tmp_path / "x.gguf", dense, routers=[np.zeros((4, 64), np.float32)])
    with pytest.raises(ValueError, match="router is"):
        write_upcycled_gguf(tmp_path / "x.gguf", dense, routers=[np.zeros((3, 64), np.float32)] * 2)


def test_zipf_router_skews_the_routing_of_a_random_moe(tmp_path):
    path = write_synthetic_gguf(tmp_path / "zipf.gguf", "qwen3moe", n_layer=2, n_expert=8, n_expert_used=2, seed=2,
                                router_zipf=1.0)
    g = open_gguf(path)
    assert "zipf1-router" in g.metadata["general.name"]
    (tmp_path / "a.txt").write_text(PROSE + CODE)
    assert lucekv_main(["spark", "trace", str(path), "--text", str(tmp_path / "a.txt"), "-o",
                        str(tmp_path / "t.json")]) == 0
    counts = RoutingTrace.load(tmp_path / "t.json", g.fingerprint).counts
    share = np.sort(counts, axis=1)[:, ::-1] / counts.sum(axis=1, keepdims=True)
    target = zipf_popularity(8, 2, 1.0)
    print("popularity by rank", share.round(3), "target", target.round(3))
    assert (share[:, :2].sum(axis=1) > 0.5 * target[:2].sum() + 0.5 * 2 / 8).all()  # past halfway from uniform
    assert not np.array_equal(np.argsort(counts[0]), np.arange(8))  # popularity is not the expert id


def test_zipf_needs_experts(tmp_path):
    with pytest.raises(ValueError, match="Zipf router needs experts"):
        write_synthetic_gguf(tmp_path / "x.gguf", "llama", router_zipf=1.0)
