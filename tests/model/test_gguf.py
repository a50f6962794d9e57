"""GGUF loading: metadata, fingerprint, and errors that name the problem."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

import lucekv
from lucekv.errors import ModelError, UnsupportedModelError
from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import open_gguf
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


def test_unsupported_quant_type_is_named(tmp_path):
    base = write_synthetic_gguf(tmp_path / "base.gguf", "llama")
    g = open_gguf(base)
    w = GGUFWriter(tmp_path / "iq.gguf", "llama")
    for key, value in g.metadata.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            _add(w, key, value)
    for name, t in g.tensors.items():
        if name == "blk.0.ffn_up.weight":  # IQ4_NL: 18-byte blocks of 32
            raw = np.zeros((t.shape[0], t.shape[1] // 32 * 18), np.uint8)
            w.add_tensor(name, raw, raw_dtype=GGMLQuantizationType.IQ4_NL)
        else:
            w.add_tensor(name, np.array(t.data), raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="IQ4_NL"):
        lucekv.load(tmp_path / "iq.gguf", backend="cpu")


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


def test_unknown_model_name_lists_the_known_ones():
    with pytest.raises(ModelError) as e:
        lucekv.load("no-such-model")
    assert "smollm2-135m" in str(e.value)
