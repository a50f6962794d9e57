"""Synthetic GGUF writer: llama.cpp's layout, sane random weights, and files transformers loads as-is."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, TokenType
from gguf.quants import Q4_K, dequantize
from transformers import AutoTokenizer

from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import TensorInfo, open_gguf
from lucekv.model.synth import ARCHS, SUPPORTED_QTYPES, write_synthetic_gguf, write_twin_gguf
from lucekv.model.tokenizer import Tokenizer
from tests.reference import hf_greedy, hf_logits, hf_model

Q = GGMLQuantizationType
K_DIMS = {"n_embd": 256, "n_head": 4, "n_kv_head": 2, "head_dim": 64, "n_ff": 512}  # rows of 256 for K-quants
SMALL_DIMS = {"n_embd": 64, "n_head": 4, "n_kv_head": 2, "head_dim": 16, "n_ff": 128}


def dims_for(qtype: GGMLQuantizationType) -> dict[str, int]:
    return K_DIMS if qtype.name.endswith("_K") else SMALL_DIMS


def expected_shapes(arch: str, n_layer: int, vocab: int, tied: bool, n_embd: int, n_head: int,
                    n_kv_head: int, head_dim: int, n_ff: int) -> dict[str, tuple[int, ...]]:
    """llama.cpp's tensor names for each family, written out by hand (numpy order: rows, row length)."""
    q, kv = n_head * head_dim, n_kv_head * head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, n_embd),
                                          "output_norm.weight": (n_embd,)}
    if not tied:
        shapes["output.weight"] = (vocab, n_embd)
    for i in range(n_layer):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": (n_embd,), b + "attn_q.weight": (q, n_embd),
            b + "attn_k.weight": (kv, n_embd), b + "attn_v.weight": (kv, n_embd),
            b + "attn_output.weight": (n_embd, q), b + "ffn_norm.weight": (n_embd,),
            b + "ffn_gate.weight": (n_ff, n_embd), b + "ffn_up.weight": (n_ff, n_embd),
            b + "ffn_down.weight": (n_embd, n_ff),
        }
        if arch == "qwen2":
            shapes |= {b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)}
        if arch in ("qwen3", "gemma3"):
            shapes |= {b + "attn_q_norm.weight": (head_dim,), b + "attn_k_norm.weight": (head_dim,)}
        if arch == "gemma3":
            shapes |= {b + "post_attention_norm.weight": (n_embd,), b + "post_ffw_norm.weight": (n_embd,)}
    return shapes


def values(t: TensorInfo) -> np.ndarray:
    return dequantize(np.asarray(t.data), t.qtype).reshape(t.shape)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_QTYPES, key=lambda t: t.name), ids=lambda t: t.name)
@pytest.mark.parametrize("arch", ARCHS)
def test_written_file_has_llama_cpp_layout_and_sane_weights(tmp_path: Path, arch: str, qtype):
    dims = dims_for(qtype)
    path = write_synthetic_gguf(tmp_path / "m.gguf", arch, qtype=qtype, n_layer=2, **dims)
    g = open_gguf(path)
    m = g.metadata
    vocab = len(m["tokenizer.ggml.tokens"])
    tied = arch == "gemma3"

    assert g.arch == arch
    assert {n: t.shape for n, t in g.tensors.items()} == expected_shapes(arch, 2, vocab, tied, **dims)
    for name, t in g.tensors.items():
        assert t.qtype == (qtype if len(t.shape) == 2 else Q.F32), name
    assert m[f"{arch}.embedding_length"] == dims["n_embd"]
    assert m[f"{arch}.block_count"] == 2
    assert m[f"{arch}.feed_forward_length"] == dims["n_ff"]
    assert m[f"{arch}.attention.head_count"] == dims["n_head"]
    assert m[f"{arch}.attention.head_count_kv"] == dims["n_kv_head"]
    assert m[f"{arch}.attention.key_length"] == m[f"{arch}.attention.value_length"] == dims["head_dim"]
    assert m[f"{arch}.rope.dimension_count"] == dims["head_dim"]
    assert m[f"{arch}.context_length"] == 512
    assert m[f"{arch}.rope.freq_base"] > 0 and 0 < m[f"{arch}.attention.layer_norm_rms_epsilon"] < 1e-4
    assert (f"{arch}.attention.sliding_window" in m) == (arch == "gemma3")
    assert len(m["tokenizer.ggml.token_type"]) == vocab

    for name, t in g.tensors.items():
        w = values(t)
        assert np.isfinite(w).all(), name
        if name.endswith("norm.weight"):  # gemma3 included: its stored norms carry the folded-in "+1"
            assert 0.8 < w.mean() < 1.2, name
        elif len(t.shape) == 2:
            scale = 1 / np.sqrt(t.shape[1])
            assert 0.3 * scale < w.std() < 1.5 * scale, name
            assert abs(w.mean()) < 0.2 * w.std(), name
            assert np.abs(w).max() < 8 * w.std(), name


def test_kquant_blocks_have_distinct_scales_and_centred_sub_blocks(tmp_path: Path):
    path = write_synthetic_gguf(tmp_path / "m.gguf", "llama", qtype=Q.Q4_K, **K_DIMS)
    t = open_gguf(path).tensor("blk.0.ffn_up.weight")
    raw = np.asarray(t.data).reshape(-1, 144)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
    assert np.isfinite(d).all() and (d > 0).all()
    assert d.max() / d.min() > 1.5  # varies per block, so a kernel reading a neighbour's scale shows
    scales, mins = Q4_K.get_scale_min(raw[:, 4:16])
    assert (scales != mins).mean() > 0.5  # a kernel swapping sub-block scale and min shows
    sub_block_means = values(t).reshape(-1, 32).mean(axis=1)
    assert sub_block_means.std() < 0.3 * values(t).std()  # no large per-sub-block offsets


def test_overrides_pick_types_by_suffix_and_vocab_pads(tmp_path: Path):
    overrides = {"ffn_down.weight": Q.Q6_K, "token_embd.weight": Q.F16}
    path = write_synthetic_gguf(tmp_path / "m.gguf", "qwen2", qtype=Q.Q8_0, vocab=1000,
                                qtype_overrides=overrides, **K_DIMS)
    g = open_gguf(path)
    assert {g.tensor(f"blk.{i}.ffn_down.weight").qtype for i in range(2)} == {Q.Q6_K}
    assert g.tensor("token_embd.weight").qtype == Q.F16
    assert g.tensor("blk.1.ffn_up.weight").qtype == Q.Q8_0
    assert g.tensor("token_embd.weight").shape == (1000, 256)
    tokens, types = g.metadata["tokenizer.ggml.tokens"], g.metadata["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 1000 and len(set(tokens)) == 1000
    assert types[-1] == TokenType.UNUSED


def test_a_tensor_own_name_outranks_a_suffix(tmp_path: Path):
    # "output.weight" is also the suffix of "blk.0.attn_output.weight", and comes first here
    overrides = {"output.weight": Q.Q8_0, "blk.0.attn_output.weight": Q.Q5_0, "ffn_up.weight": Q.Q8_0,
                 "blk.1.ffn_up.weight": Q.F32}
    g = open_gguf(write_synthetic_gguf(tmp_path / "m.gguf", "llama", qtype=Q.Q4_0, tied_output=False,
                                       qtype_overrides=overrides))
    assert [g.tensor(n).qtype for n in ("output.weight", "blk.0.attn_output.weight", "blk.1.attn_output.weight")] \
        == [Q.Q8_0, Q.Q5_0, Q.Q8_0]
    assert g.tensor("blk.1.ffn_up.weight").qtype == Q.F32  # (F32 is 0: an own name's type, even a falsy one)


def test_a_twin_has_every_matrix_type_and_the_shape_of_its_model(tmp_path: Path):
    # a "real" file in a Q4_K_M-like mix: per-layer types, and o in Q5_0 while the output head is Q8_0
    mix = {"blk.0.attn_v.weight": Q.Q8_0, "blk.1.attn_v.weight": Q.Q5_0, "blk.0.ffn_down.weight": Q.Q6_K,
           "blk.1.ffn_down.weight": Q.Q4_K, "attn_output.weight": Q.Q5_0, "output.weight": Q.Q8_0}
    real = write_synthetic_gguf(tmp_path / "real.gguf", "qwen2", qtype=Q.Q5_0, vocab=600, tied_output=False,
                                qtype_overrides=mix, seed=1, **K_DIMS)
    twin = write_twin_gguf(tmp_path / "twin.gguf", real)
    a, b = open_gguf(real), open_gguf(twin)
    layout = {n: (t.qtype, t.shape) for n, t in a.tensors.items()}
    assert layout == {n: (t.qtype, t.shape) for n, t in b.tensors.items()}
    assert b.tensor("blk.1.attn_output.weight").qtype == Q.Q5_0 and b.tensor("output.weight").qtype == Q.Q8_0
    spec = ModelSpec.from_gguf(b)
    assert ModelSpec.from_gguf(a) == dataclasses.replace(spec, name=ModelSpec.from_gguf(a).name)
    assert not np.array_equal(values(a.tensor("blk.0.ffn_up.weight")), values(b.tensor("blk.0.ffn_up.weight")))


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path):
    a = write_synthetic_gguf(tmp_path / "a.gguf", "gemma3", qtype=Q.Q5_K, seed=3, **K_DIMS)
    b = write_synthetic_gguf(tmp_path / "b.gguf", "gemma3", qtype=Q.Q5_K, seed=3, **K_DIMS)
    c = write_synthetic_gguf(tmp_path / "c.gguf", "gemma3", qtype=Q.Q5_K, seed=4, **K_DIMS)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"arch": "mistral"}, "not supported"),
    ({"arch": "llama", "qtype": Q.Q4_K}, "token_embd.weight: row length 64 .* block size 256"),
    ({"arch": "llama", "qtype": Q.Q4_K, **K_DIMS, "n_ff": 320}, "blk.0.ffn_down.weight: row length 320"),
    ({"arch": "llama", "qtype": Q.IQ4_NL}, "IQ4_NL is not supported"),
    ({"arch": "llama", "vocab": 100}, "smaller than the tokenizer"),
    ({"arch": "llama", "n_kv_head": 3}, "not a multiple"),
])
def test_bad_requests_are_refused_with_the_reason(tmp_path: Path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        write_synthetic_gguf(tmp_path / "m.gguf", **kwargs)


# --- transformers as the reference --------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_the_weights_written(tmp_path: Path, arch: str, qtype):
    path = write_synthetic_gguf(tmp_path / f"{arch}.gguf", arch, qtype=qtype, **dims_for(qtype))
    g = open_gguf(path)
    config = hf_model(path).config
    # head_dim is key_length, which transformers' mapping drops; Qwen2 derives it as n_embd / n_head.
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert head_dim == dims_for(qtype)["head_dim"]
    if arch == "gemma3":
        assert config.query_pre_attn_scalar == head_dim  # llama.cpp's 1/sqrt(head_dim) attention scale
        assert config.sliding_window == 8
    hf = hf_model(path).model
    assert np.array_equal(hf.embed_tokens.weight.detach().numpy(), values(g.tensor("token_embd.weight")))
    stored_norm = values(g.tensor("blk.1.attn_norm.weight"))
    hf_norm = hf.layers[1].input_layernorm.weight.detach().numpy()
    # transformers' Gemma RMSNorm multiplies by (1 + w): it takes the "+1" back out of the stored value.
    np.testing.assert_allclose(hf_norm, stored_norm - 1 if arch == "gemma3" else stored_norm, atol=1e-7)

    ids = list(range(3, 40, 3))
    logits = hf_logits(path, ids)
    assert logits.shape == (len(ids), len(g.metadata["tokenizer.ggml.tokens"]))
    assert np.isfinite(logits).all()
    assert (logits.std(axis=1) > 0.2).all()


def test_transformers_unties_output_only_when_the_file_has_one(tmp_path: Path):
    tied = write_synthetic_gguf(tmp_path / "tied.gguf", "llama", tied_output=True)
    untied = write_synthetic_gguf(tmp_path / "untied.gguf", "llama")
    assert "output.weight" not in open_gguf(tied).tensors
    assert hf_model(tied).config.tie_word_embeddings
    lm_head = hf_model(untied).lm_head.weight.detach().numpy()
    assert np.array_equal(lm_head, values(open_gguf(untied).tensor("output.weight")))


def logits_at(path: Path, ids: list[int], position: int) -> np.ndarray:
    return hf_logits(path, ids[:position + 1])[position]


def test_transformers_applies_gemma3_sliding_window_like_llama_cpp(tmp_path: Path):
    """llama.cpp lets position q see k when q - k < window. With 2 local layers the last position depends
    on tokens back to 2 * (window - 1) before it and not one further; a global 6th layer sees them all."""
    window, last = 8, 24
    local = write_synthetic_gguf(tmp_path / "local.gguf", "gemma3", n_layer=2, sliding_window=window)
    ids = [(7 * i) % 300 + 10 for i in range(last + 1)]
    base = logits_at(local, ids, last)
    edge = last - 2 * (window - 1)

    def changed(at: int) -> list[int]:
        return ids[:at] + [ids[at] + 1] + ids[at + 1:]

    np.testing.assert_array_equal(logits_at(local, changed(edge - 1), last), base)
    assert np.abs(logits_at(local, changed(edge), last) - base).max() > 1e-3

    with_global = write_synthetic_gguf(tmp_path / "global.gguf", "gemma3", n_layer=6, sliding_window=window)
    assert hf_model(with_global).config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert np.abs(logits_at(with_global, changed(0), last) - logits_at(with_global, ids, last)).max() > 1e-3


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_hf_greedy_with_cache_matches_full_recompute(tmp_path: Path, arch: str):
    path = write_synthetic_gguf(tmp_path / "m.gguf", arch, n_layer=6, sliding_window=8)
    prompt = [11, 42, 97, 150, 203, 7, 64]
    tokens = hf_greedy(path, prompt, 8)  # runs past the window, so the cache must slide
    expected = list(prompt)
    for _ in range(8):
        expected.append(int(hf_logits(path, expected)[-1].argmax()))
    assert tokens == expected[len(prompt):]


TEXTS = ["The quick brown fox, def main(args): 42 héllo 🙂", "  two spaces\n\nand newlines\tx",
         "<|im_start|>user\nhi<|im_end|>", "<start_of_turn>user\nNumbers 12345<end_of_turn>"]


@pytest.mark.parametrize("arch", ARCHS)
def test_lucekv_and_transformers_tokenize_the_same(tmp_path: Path, arch: str):
    path = write_synthetic_gguf(tmp_path / "m.gguf", arch)
    ours = Tokenizer.from_metadata(open_gguf(path).metadata)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert len(theirs) == len(open_gguf(path).metadata["tokenizer.ggml.tokens"])
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids, skip_special=True)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat, tokenize=False,
                                                                        add_generation_prompt=True)
