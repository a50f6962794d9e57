"""RoPE scalings against transformers on synthetic models: linear, YaRN (Qwen2.5's long context), Llama 3.x's
`rope_freqs.weight`, and gemma3, whose scaling is its global layers' only."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType

import lucekv
from lucekv.model.synth import write_synthetic_gguf

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # a short original context: most pairs of head_dim 16 change
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "factor": 8.0}
THETA = {"llama": 10_000.0, "qwen2": 1_000_000.0, "qwen3": 1_000_000.0, "gemma3": 1_000_000.0}
TEXT = "the quick brown fox jumps over the lazy dog, again and again; def main(args): return 0"


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def unscaled(arch: str) -> dict:
    plain = {"rope_type": "default", "rope_theta": THETA[arch]}
    if arch == "gemma3":
        return {"full_attention": plain, "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    return plain


@pytest.mark.parametrize(("arch", "scaling"), [("llama", LLAMA3), ("llama", YARN), ("qwen2", YARN),
                                               ("qwen3", LINEAR), ("gemma3", LINEAR)])
def test_scaled_rope_matches_transformers(arch, scaling, tmp_path):
    from lucekv.bench import hf_anchor

    path = write_synthetic_gguf(tmp_path / f"{arch}.gguf", arch, qtype=GGMLQuantizationType.F32, tied_output=False,
                                n_layer=6 if arch == "gemma3" else 2, n_ctx=4096, rope_scaling=scaling)
    engine = lucekv.load(path, backend="cpu", kv_dtype="f32")
    ids = engine.tokenizer.encode(TEXT)[:40]
    assert len(ids) > 24  # positions well past gemma3's window, where the scalings differ
    ours = engine.score(ids)
    # transformers reads no RoPE scaling from a GGUF: hf_anchor gives linear and YaRN back from the metadata, and
    # llama3's parameters (the file holds only their per-pair factors) are passed as the model's config has them
    llama3 = dict(scaling, rope_theta=THETA[arch]) if scaling is LLAMA3 else None
    err = rel_err(ours, hf_anchor.logits(hf_anchor.load(path, rope_parameters=llama3), ids))
    assert err <= 1e-5, f"{arch} {scaling['rope_type']}: {err:.2e}"
    # what the agreement rests on: transformers without the scaling computes another model
    plain = hf_anchor.logits(hf_anchor.load(path, rope_parameters=unscaled(arch)), ids)
    assert rel_err(ours, plain) > 1e-2


def test_a_llama3_file_is_refused_by_the_anchor_without_its_parameters(tmp_path):
    from lucekv.bench import hf_anchor

    path = write_synthetic_gguf(tmp_path / "m.gguf", "llama", rope_scaling=LLAMA3)
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        hf_anchor.config_overrides(path)
