"""Spark's calibration models, on tiny files: the upcycled llama whose router is k-means over the dense model's own FFN
inputs, and the MoE whose router has a Zipf expert popularity."""

from __future__ import annotations

import numpy as np
import pytest

from lucekv.backends.cpu import CpuOps
from lucekv.cli import main as lucekv_main
from lucekv.model.gguf import open_gguf
from lucekv.model.synth import kmeans_routers, main, write_synthetic_gguf, write_upcycled_gguf
from lucekv.spark.cli import fit_routers, prompt_backend
from lucekv.spark.router import kmeans_router, zipf_popularity
from lucekv.spark.trace import RoutingTrace

CODE = "def add(a, b):\n    for item in args.items:\n        print(item.name, item.value)\n    return 0\n" * 3
PROSE = "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun and the fox runs into the forest. " * 2
TEXTS = [("code", CODE), ("prose", PROSE)]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("dense") / "llama.gguf", "llama", n_layer=2, seed=5)


def test_each_router_is_fitted_to_the_inputs_the_finished_model_gives_its_layer(dense, tmp_path):
    """Fitted layer after layer, the routers see what the written model computes: running the corpus through the
    written model and clustering each layer's FFN inputs again gives the same routers. (Fitted all at once on the
    dense model's inputs, the second layer's would differ: the first layer's distinct experts change its inputs.)"""
    fit = {}
    def record(layer, h):
        fit[layer] = h.copy()
        return kmeans_router(h, 3, layer)

    moe = write_upcycled_gguf(tmp_path / "placeholder.gguf", dense, n_expert=3, distinct=True)
    backend, docs = prompt_backend(open_gguf(moe), TEXTS, 48)
    routers = fit_routers(backend, docs, record)
    assert [len(h) for h in fit.values()] == [sum(len(ids) for _, ids in docs)] * 2
    written = write_upcycled_gguf(tmp_path / "km.gguf", dense, n_expert=3, distinct=True, routers=routers)
    backend, docs = prompt_backend(open_gguf(written), TEXTS, 48)
    seen = {0: [], 1: []}
    backend.ops.ffn_input_observer = lambda layer, h: seen[layer].append(h.copy())
    for _, ids in docs:  # each document one forward, as fit_routers runs it
        backend.pool.clear()
        positions = np.arange(len(ids), dtype=np.int32)
        backend.forward(ids, positions, positions.astype(np.int64))
    for layer in range(2):
        observed = np.concatenate(seen[layer])
        err = np.max(np.abs(observed - fit[layer])) / np.max(np.abs(fit[layer]))
        assert err < 1e-5, f"layer {layer}: the inputs differ by {err:.1e}"
        np.testing.assert_allclose(kmeans_router(observed, 3, layer), routers[layer], rtol=1e-4, atol=1e-6)
    # the dense model's second-layer inputs are not those
    dense_backend, docs = prompt_backend(open_gguf(dense), TEXTS, 48)
    dense_seen = []
    gated_linear = CpuOps.gated_linear
    dense_backend.decode_step = None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CpuOps, "gated_linear", lambda self, x, g, norm: dense_seen.append(x.copy()) or gated_linear(
            self, x, g, norm))
        for _, ids in docs:
            dense_backend.pool.clear()
            positions = np.arange(len(ids), dtype=np.int32)
            dense_backend.forward(ids, positions, positions.astype(np.int64))
    dense_x1 = np.concatenate(dense_seen[1::2])
    moe_x1 = np.concatenate(seen[1])
    assert not np.allclose(dense_x1 / np.linalg.norm(dense_x1, axis=1, keepdims=True),
                           moe_x1 / np.linalg.norm(moe_x1, axis=1, keepdims=True), atol=1e-2)


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
    expected = kmeans_routers(dense, TEXTS, 3, 2, max_tokens=40)
    for layer in range(2):
        router = np.asarray(g.tensor(f"blk.{layer}.ffn_gate_inp.weight").data)
        np.testing.assert_array_equal(router, expected[layer])
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


@pytest.mark.parametrize("args", [["--router", "kmeans"], ["--corpus", "x.txt"]])
def test_kmeans_and_its_corpus_come_together(dense, tmp_path, args, capsys):
    with pytest.raises(SystemExit):
        main(["upcycle", str(dense), str(tmp_path / "x.gguf"), *args])
    assert "--router kmeans needs --corpus" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
