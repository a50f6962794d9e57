"""`lucekv spark trace`: the experts the CPU backend's MoE op routes each token to, counted per layer, checked against
top-k recomputed in float64 from the router weights and the hidden states entering each MoE layer."""

from __future__ import annotations

import numpy as np
import pytest

from lucekv.backends.cpu import CpuOps
from lucekv.bench import serve
from lucekv.cli import main
from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import open_gguf
from lucekv.model.synth import write_synthetic_gguf
from lucekv.model.tokenizer import Tokenizer
from lucekv.spark.placement import Placement
from lucekv.spark.trace import RoutingTrace

DOCS = ["The quick brown fox jumps over the lazy dog, and then it runs far away into the forest. " * 3,
        "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "qwen3moe.gguf"
    return write_synthetic_gguf(path, "qwen3moe", n_layer=2, n_expert=8, n_expert_used=3, seed=3)


@pytest.fixture
def texts(tmp_path):
    files = []
    for i, doc in enumerate(DOCS):
        (tmp_path / f"doc{i}.txt").write_text(doc)
        files += ["--text", str(tmp_path / f"doc{i}.txt")]
    return files


def reference_top_k(g, spec: ModelSpec, layer: int, x: np.ndarray, norm: np.ndarray) -> np.ndarray:
    """Each token's top-k experts in float64: the router (F32 in the file) on rmsnorm(x) * norm (softmax keeps the
    order of the logits)."""
    router = np.asarray(g.tensor(f"blk.{layer}.ffn_gate_inp.weight").data, np.float64)
    x = x.astype(np.float64)
    h = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + spec.rms_eps) * norm
    logits = h @ router.T
    top = np.argsort(-logits, axis=1, kind="stable")[:, :spec.n_expert_used]
    ranked = np.sort(logits, axis=1)[:, ::-1]
    gap = ranked[:, spec.n_expert_used - 1] - ranked[:, spec.n_expert_used]
    assert gap.min() > 1e-4, "a near tie at the k-th expert: float32 and float64 may pick differently"
    return top


def test_counts_are_the_top_k_of_the_router_in_float64(moe, texts, tmp_path, monkeypatch, capsys):
    g = open_gguf(moe)
    spec = ModelSpec.from_gguf(g)
    seen = []  # (layer, x, norm) entering every MoE layer of every forward
    moe_ffn = CpuOps.moe_ffn

    def spy(self, x, m, norm):
        seen.append((m.layer, x.copy(), norm.copy()))
        return moe_ffn(self, x, m, norm)

    monkeypatch.setattr(CpuOps, "moe_ffn", spy)
    # chunks of 16 tokens: a document spans several forwards
    monkeypatch.setattr("lucekv.backends.cpu.CpuBackend.prefill_chunk", 16)
    assert main(["spark", "trace", str(moe), *texts, "-o", str(tmp_path / "t.json")]) == 0
    trace = RoutingTrace.load(tmp_path / "t.json", g.fingerprint)

    tokenizer = Tokenizer.from_metadata(g.metadata)
    n_tokens = sum(len(tokenizer.encode(d)) for d in DOCS)
    assert n_tokens > 2 * 16
    assert trace.tokens == n_tokens and (trace.top_k, trace.n_layer, trace.n_expert) == (3, 2, 8)
    np.testing.assert_array_equal(trace.counts.sum(axis=1), n_tokens * 3)
    expected = np.zeros_like(trace.counts)
    for layer, x, norm in seen:
        expected[layer] += np.bincount(reference_top_k(g, spec, layer, x, norm).ravel(), minlength=8)
    assert sum(len(x) for layer, x, _ in seen if layer == 0) == n_tokens
    np.testing.assert_array_equal(trace.counts, expected)
    assert (trace.counts > 0).sum() > 8  # routing varies from token to token
    assert f"{n_tokens} tokens of 2 documents" in capsys.readouterr().out


def test_max_tokens_cuts_each_document_and_calibrate_accepts_the_trace(moe, texts, tmp_path, capsys):
    assert main(["spark", "trace", str(moe), *texts, "--max-tokens", "10", "-o", str(tmp_path / "t.json")]) == 0
    assert "[2/2] doc1.txt: 10 tokens" in capsys.readouterr().err
    assert RoutingTrace.load(tmp_path / "t.json").tokens == 20
    assert main(["spark", "calibrate", str(moe), str(tmp_path / "t.json"), "--expert-vram", "1",
                 "-o", str(tmp_path / "p.json")]) == 0
    assert Placement.load(tmp_path / "p.json", open_gguf(moe).fingerprint).n_expert == 8


def test_sharegpt_conversations_are_documents(moe, tmp_path, monkeypatch, capsys):
    conversations = [serve.Conversation(f"question {i}?", f"answer {i}.") for i in range(3)]
    monkeypatch.setattr(serve, "load_conversations", lambda path: conversations)
    assert main(["spark", "trace", str(moe), "--sharegpt", "2", "-o", str(tmp_path / "t.json")]) == 0
    err = capsys.readouterr().err
    assert "[2/2] sharegpt[1]" in err and "sharegpt[2]" not in err
    tokenizer = Tokenizer.from_metadata(open_gguf(moe).metadata)
    n = sum(len(tokenizer.encode(f"{c.prompt}\n\n{c.reply}")) for c in conversations[:2])
    assert RoutingTrace.load(tmp_path / "t.json").tokens == n


def test_a_dense_model_and_missing_text_are_refused(moe, texts, tmp_path, capsys):
    dense = write_synthetic_gguf(tmp_path / "dense.gguf", "llama")
    assert main(["spark", "trace", str(dense), *texts, "-o", str(tmp_path / "t.json")]) == 2
    assert "is not a mixture of experts" in capsys.readouterr().err
    assert main(["spark", "trace", str(moe), "-o", str(tmp_path / "t.json")]) == 2
    assert "needs text" in capsys.readouterr().err
    assert main(["spark", "trace", str(moe), "--text", str(tmp_path / "missing.txt"), "-o",
                 str(tmp_path / "t.json")]) == 2
    assert "cannot read the text file" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()
