"""GGUF loading: metadata, fingerprint, and errors that name the problem."""

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

import lucekv
from lucekv.errors import ModelError, UnsupportedModelError
from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import Reader, open_gguf
from lucekv.model.synth import write_synthetic_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf", "qwen2")


def test_reads_metadata_tensors_and_a_stable_fingerprint(tiny, tmp_path):
    g = open_gguf(tiny)
    assert g.arch == "qwen2"
    assert g.tensor("token_embd.weight").shape[1] == 64
    assert "blk.0.attn_q.bias" in g.tensors
    assert open_gguf(tiny).fingerprint == g.fingerprint
    other = write_synthetic_gguf(tmp_path / "other.gguf", "qwen2", n_layer=3)
    assert open_gguf(other).fingerprint != g.fingerprint


def test_the_plain_view_reader_reads_what_ggufs_own_reader_reads(tiny):
    """Reader (gguf's reader over a plain ndarray of the memory map, for speed) gives every field and tensor as
    gguf's GGUFReader does, the tokenizer's string arrays included, and still reads through the map."""
    ours, theirs = Reader(tiny), GGUFReader(tiny)
    assert type(ours.data) is np.ndarray and isinstance(ours.data.base, np.memmap)
    assert {k: f.contents() for k, f in ours.fields.items()} == {k: f.contents() for k, f in theirs.fields.items()}
    assert any(isinstance(f.contents(), list) and isinstance(f.contents()[0], str) for f in ours.fields.values())
    assert [(t.name, t.data_offset) for t in ours.tensors] == [(t.name, t.data_offset) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors, strict=True))


def test_missing_file(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        open_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(ModelError, match="not a GGUF file"):
        open_gguf(p)


@pytest.mark.parametrize("keep", [0.3, 0.9, 0.999])
def test_truncated_file(tiny, tmp_path, keep):
    data = tiny.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelError, match="truncated"):
        open_gguf(p)


def test_truncated_header(tiny, tmp_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny.read_bytes()[:200])
    with pytest.raises(ModelError, match="truncated or corrupt"):
        open_gguf(p)


def write_raw(path, arch, tensors):
    w = GGUFWriter(path, arch)
    w.add_block_count(1)
    for name, data, qtype in tensors:
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_is_named(tmp_path):
    p = write_raw(tmp_path / "m.gguf", "mamba", [("x", np.zeros(4, np.float32), GGMLQuantizationType.F32)])
    with pytest.raises(UnsupportedModelError, match="'mamba'"):
        ModelSpec.from_gguf(open_gguf(p))


def rewrite(base: Path, out: Path, keys: dict | None = None, tensors: dict | None = None) -> Path:
    """`base` written again to `out` with metadata `keys` and `tensors` ({name: (data, qtype)}) added or replaced."""
    g = open_gguf(base)
    w = GGUFWriter(out, g.arch)
    for key, value in {**g.metadata, **(keys or {})}.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            _add(w, key, value)
    for name, (data, qtype) in {**{n: (np.array(t.data), t.qtype) for n, t in g.tensors.items()},
                                **(tensors or {})}.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add(w: GGUFWriter, key, value):
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value) if value >= 0 else w.add_int32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value))


def test_unsupported_quant_type_is_named(tmp_path):
    base = write_synthetic_gguf(tmp_path / "base.gguf", "llama")
    rows, cols = open_gguf(base).tensor("blk.0.ffn_up.weight").shape
    iq = np.zeros((rows, cols // 32 * 18), np.uint8)  # IQ4_NL: 18-byte blocks of 32
    path = rewrite(base, tmp_path / "iq.gguf", tensors={"blk.0.ffn_up.weight": (iq, GGMLQuantizationType.IQ4_NL)})
    with pytest.raises(UnsupportedModelError, match="IQ4_NL"):
        lucekv.load(path, backend="cpu")


F32 = GGMLQuantizationType.F32


@pytest.mark.parametrize(("arch", "key", "value"), [
    ("llama", "llama.attn_logit_softcapping", 50.0),  # Gemma 2 style: would change every attention score
    ("qwen2", "qwen2.attention.sliding_window", 4096),  # a window lucekv keeps only for gemma3's local layers
    ("llama", "llama.expert_count", 8),
])
def test_a_metadata_key_lucekv_does_not_implement_is_refused_by_name(tmp_path, arch, key, value):
    path = rewrite(write_synthetic_gguf(tmp_path / "base.gguf", arch), tmp_path / "m.gguf", keys={key: value})
    with pytest.raises(UnsupportedModelError, match=key.replace(".", r"\.")):
        lucekv.load(path, backend="cpu")


@pytest.mark.parametrize(("name", "shape"), [("blk.0.ffn_down.bias", (64,)), ("blk.1.attn_q_norm.weight", (16,))])
def test_a_tensor_lucekv_does_not_implement_is_refused_by_name(tmp_path, name, shape):
    base = write_synthetic_gguf(tmp_path / "base.gguf", "llama")
    path = rewrite(base, tmp_path / "m.gguf", tensors={name: (np.ones(shape, np.float32), F32)})
    with pytest.raises(UnsupportedModelError, match=name.replace(".", r"\.")):
        lucekv.load(path, backend="cpu")


@pytest.mark.parametrize(("keys", "tensors", "message"), [
    ({"llama.rope.scaling.type": "longrope"}, {}, "longrope"),
    ({"llama.rope.scaling.factor": 4.0}, {}, "without a scaling type"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, {}, "original_context_length"),
    ({}, {"rope_freqs.weight": (np.ones(3, np.float32), F32)}, r"rope_freqs\.weight has shape"),
    ({}, {"rope_freqs.weight": (np.zeros(8, np.float32), F32)}, "not positive"),
])
def test_rope_settings_lucekv_cannot_follow_are_refused(tmp_path, keys, tensors, message):
    path = rewrite(write_synthetic_gguf(tmp_path / "base.gguf", "llama"), tmp_path / "m.gguf", keys, tensors)
    with pytest.raises(UnsupportedModelError, match=message):
        ModelSpec.from_gguf(open_gguf(path))


def test_unknown_model_name_lists_the_known_ones():
    with pytest.raises(ModelError) as e:
        lucekv.load("no-such-model")
    assert "smollm2-135m" in str(e.value)
