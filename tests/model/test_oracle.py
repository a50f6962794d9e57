"""Oracle: lucekv's CPU backend against Hugging Face transformers loading the same GGUF in float32."""

import numpy as np
import pytest

import lucekv
from lucekv.engine.sampling import SamplingParams

PROSE = (
    "The history of the Roman Empire spans more than a thousand years, from the founding of the city to the "
    "fall of Constantinople. Its roads, laws and languages shaped Europe. def fibonacci(n):\n    if n < 2:\n"
    "        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n# 1234567890 tokens, caf\u00e9, \u6771\u4eac"
)
MODELS = [
    "smollm2-135m",
    pytest.param("gemma3-270m", marks=pytest.mark.slow),
    pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow),
]


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", MODELS)
def test_logits_and_greedy_tokens_match_transformers(name, model_path):
    reference = pytest.importorskip("tests.reference")
    path = model_path(name)
    engine = lucekv.load(path, backend="cpu", kv_dtype="f32")
    ids = engine.tokenizer.encode(PROSE)[:64]
    assert len(ids) == 64

    ours = engine.score(ids)
    ref = reference.hf_logits(path, ids)
    err = rel_err(ours, ref)
    print(f"{name}: max relative logit error {err:.2e}")
    assert err <= 1e-3

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    greedy = [d.token_ids[0] for d in engine.generate(ids, params)]
    assert greedy == reference.hf_greedy(path, ids, 32)


@pytest.mark.parametrize("name", MODELS)
def test_float16_kv_stays_close_to_float32(name, model_path):
    path = model_path(name)
    ids = lucekv.load(path, backend="cpu").tokenizer.encode(PROSE)[:64]
    f32 = lucekv.load(path, backend="cpu", kv_dtype="f32").score(ids)
    f16 = lucekv.load(path, backend="cpu", kv_dtype="f16").score(ids)
    err = rel_err(f16, f32)
    print(f"{name}: f16 KV vs f32 KV max relative logit error {err:.2e}")
    assert err <= 1e-2
    assert (f16.argmax(-1) == f32.argmax(-1)).mean() >= 0.95


def test_capital_of_france(model_path):
    engine = lucekv.load(model_path("smollm2-135m"), backend="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=8)
    text = "".join(d.text for d in engine.generate("The capital of France is", params))
    assert "Paris" in text


K_QUANT_DIMS = {"n_embd": 256, "head_dim": 64, "n_ff": 512}


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_K"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_every_arch_matches_transformers_on_synthetic_weights(arch, qtype, tmp_path):
    """qwen3 ships no real weights on PyPI; gemma3's window and 5:1 pattern need more layers than 270m's prompt."""
    from gguf import GGMLQuantizationType

    from lucekv.model.synth import write_synthetic_gguf
    from tests.reference import hf_logits

    dims = K_QUANT_DIMS if qtype == "Q4_K" else {}
    path = write_synthetic_gguf(tmp_path / f"{arch}.gguf", arch, qtype=GGMLQuantizationType[qtype], n_layer=6,
                                sliding_window=8, tied_output=False, **dims)
    engine = lucekv.load(path, backend="cpu", kv_dtype="f32")
    ids = engine.tokenizer.encode("the quick brown fox jumps over the lazy dog, again and again")[:24]
    assert len(ids) > 16  # longer than the sliding window, so local layers differ from global ones
    err = rel_err(engine.score(ids), hf_logits(path, ids))
    assert err <= 1e-3, f"{arch}/{qtype}: {err:.2e}"
