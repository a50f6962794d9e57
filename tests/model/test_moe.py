"""Mixture-of-experts models: specs from GGUF metadata, refusals, and oracles (upcycled smollm2 against dense smollm2
and against transformers' Mixtral, tiny random Qwen2-MoE / Qwen3-MoE / Mixtral against transformers), and sessions,
paging and snapshots on an MoE model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import lucekv
from lucekv.backends.cpu import CpuOps, KVPool
from lucekv.engine.sampling import SamplingParams
from lucekv.errors import ModelError, UnsupportedModelError
from lucekv.model.arch import ModelSpec
from lucekv.model.decoder import load_weights
from lucekv.model.gguf import open_gguf
from lucekv.model.synth import MOE_ARCHS, scale_blocks, write_synthetic_gguf, write_upcycled_gguf
from tests.engine.test_sessions import conversation, prompt, roundtrip, turn
from tests.model.test_oracle import PROSE, rel_err

K_DIMS = {"n_embd": 256, "head_dim": 64, "n_ff": 512}


def tiny(tmp_path, arch: str, **kw):
    kw = {"n_layer": 2, "n_expert": 8, "n_expert_used": 3, **kw}
    return write_synthetic_gguf(tmp_path / f"{arch}.gguf", arch, **kw)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_spec_reads_the_expert_keys(tmp_path, arch):
    spec = ModelSpec.from_gguf(open_gguf(tiny(tmp_path, arch, n_ff=128)))
    assert (spec.n_expert, spec.n_expert_used) == (8, 3)
    assert spec.n_ff_expert == 128  # written as expert_feed_forward_length, and n_ff for Mixtral
    assert spec.n_ff_shared == (128 if arch == "qwen2moe" else 0)
    assert spec.arch.norm_topk == (arch != "qwen2moe") and spec.arch.shared_expert == (arch == "qwen2moe")
    dense = ModelSpec.from_gguf(open_gguf(write_synthetic_gguf(tmp_path / "dense.gguf", "llama")))
    assert dense.n_expert == 0


@pytest.mark.parametrize(("key", "value", "words"), [
    ("expert_gating_func", 2, "expert_gating_func = 2 is not supported"),
    ("expert_weights_scale", 2.5, "expert_weights_scale = 2.5"),
    ("expert_weights_norm", False, "expert_weights_norm = False"),
    ("expert_group_count", 4, "expert_group_count = 4"),
    ("leading_dense_block_count", 1, "leading_dense_block_count = 1"),
    ("expert_used_count", 9, "expert_count = 8 needs qwen3moe.expert_used_count in 1..8, not 9"),
])
def test_moe_variants_lucekv_does_not_implement_are_refused_by_name(tmp_path, key, value, words):
    g = open_gguf(tiny(tmp_path, "qwen3moe"))
    ModelSpec.from_gguf(dataclasses.replace(g, metadata={**g.metadata, "qwen3moe.expert_weights_scale": 1.0}))
    with pytest.raises(UnsupportedModelError, match=words):
        ModelSpec.from_gguf(dataclasses.replace(g, metadata={**g.metadata, f"qwen3moe.{key}": value}))


def test_a_family_without_a_dense_form_needs_experts_and_llama_shared_experts_are_refused(tmp_path):
    g = open_gguf(tiny(tmp_path, "qwen3moe"))
    with pytest.raises(UnsupportedModelError, match="qwen3moe needs qwen3moe.expert_count > 0"):
        ModelSpec.from_gguf(dataclasses.replace(g, metadata={**g.metadata, "qwen3moe.expert_count": 0}))
    g = open_gguf(tiny(tmp_path, "llama"))
    with pytest.raises(UnsupportedModelError, match="expert_shared_feed_forward_length = 64"):
        ModelSpec.from_gguf(dataclasses.replace(
            g, metadata={**g.metadata, "llama.expert_shared_feed_forward_length": 64}))


def test_expert_tensors_of_another_shape_are_refused_naming_them(tmp_path):
    g = open_gguf(tiny(tmp_path, "qwen2moe"))
    spec = ModelSpec.from_gguf(g)
    name = "blk.1.ffn_up_exps.weight"
    bad = dataclasses.replace(g, tensors={**g.tensors, name: dataclasses.replace(g.tensors[name], shape=(4, 256, 64))})
    with pytest.raises(ModelError, match=r"'blk.1.ffn_up_exps.weight' has shape \(4, 256, 64\), expected \(8, 128"):
        load_weights(bad, spec, CpuOps(spec, KVPool(spec, 64, "f32")))


# --- transformers on tiny random models ------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tiny_moe_models_match_transformers(tmp_path, arch, qtype):
    """Qwen2-MoE and Qwen3-MoE through transformers' own GGUF loader; Mixtral, which it does not read, built from the
    file's tensors (hf_anchor). 8 experts, top-3, experts narrower than n_ff where the family allows it."""
    from tests.reference import hf_logits

    dims = K_DIMS if qtype == Q.Q4_K else {}
    width = {} if arch == "llama" else {"n_ff_expert": 256 if dims else 64}
    path = tiny(tmp_path, arch, qtype=qtype, n_layer=3, tied_output=False, **dims, **width)
    engine = lucekv.load(path, backend="cpu", kv_dtype="f32")
    ids = engine.tokenizer.encode("the quick brown fox jumps over the lazy dog, again and again")[:24]
    err = rel_err(engine.score(ids), hf_logits(path, ids))
    print(f"{arch}/{qtype.name}: max relative logit error {err:.2e}")
    assert err <= 1e-4


# --- upcycled smollm2 ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def upcycled(tmp_path_factory, model_path):
    """(dense path, identical-experts MoE path, distinct-experts MoE path): 4 experts, top-2."""
    dense = model_path("smollm2-135m")
    out = tmp_path_factory.mktemp("upcycled")
    return (dense, write_upcycled_gguf(out / "same.gguf", dense),
            write_upcycled_gguf(out / "distinct.gguf", dense, distinct=True))


@pytest.fixture(scope="module")
def prose_ids(upcycled):
    return lucekv.load(upcycled[0], backend="cpu").tokenizer.encode(PROSE)[:64]


@pytest.fixture(scope="module")
def dense_run(upcycled, prose_ids):
    """Dense smollm2's logits over the prose and its 16 greedy tokens after it."""
    return logits_and_greedy(upcycled[0], prose_ids)


def logits_and_greedy(path, ids, n=16):  # 16 tokens: the MoE's op-by-op CPU decode takes ~1 s a token on 2 cores
    engine = lucekv.load(path, backend="cpu", kv_dtype="f32")
    # the op-by-op path with float32 prompt products, the one MoE models take: dense and upcycled compare the same
    # arithmetic (the dense decode step's and prompt tiles' int16 inputs put them ~1e-4 off that path)
    engine.backend.decode_step = None
    engine.backend.ops.tile_prompts = False
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return engine.score(ids), [d.token_ids[0] for d in engine.generate(ids, params)]


def test_upcycled_smollm2_equals_dense_smollm2(upcycled, prose_ids, dense_run):
    assert open_gguf(upcycled[1]).tensor("blk.3.ffn_gate_exps.weight").shape == (4, 1536, 576)
    dense_logits, dense_tokens = dense_run
    moe_logits, moe_tokens = logits_and_greedy(upcycled[1], prose_ids)
    err = rel_err(moe_logits, dense_logits)
    print(f"upcycled vs dense smollm2: max relative logit error {err:.2e}")
    assert err <= 1e-5
    assert moe_tokens == dense_tokens


def test_upcycled_smollm2_with_distinct_experts_matches_transformers_mixtral(upcycled, prose_ids, dense_run):
    from tests.reference import hf_logits

    distinct = upcycled[2]
    ours = lucekv.load(distinct, backend="cpu", kv_dtype="f32").score(prose_ids)
    err = rel_err(ours, hf_logits(distinct, prose_ids))
    print(f"upcycled smollm2, distinct experts, vs transformers Mixtral: max relative logit error {err:.2e}")
    assert err <= 1e-4
    assert rel_err(ours, dense_run[0]) > 0.1  # routing and weighting now change the function


def test_distinct_experts_are_exactly_scaled_byte_copies(upcycled):
    from gguf.quants import dequantize

    dense, _, distinct = upcycled
    d, m = open_gguf(dense), open_gguf(distinct)
    down = m.tensor("blk.29.ffn_down_exps.weight")
    for e, (layer, factor) in enumerate([(29, 0.5), (0, 1.0), (1, 2.0), (2, 0.5)]):
        src = d.tensor(f"blk.{layer}.ffn_down.weight")
        np.testing.assert_array_equal(dequantize(np.asarray(down.data)[e], down.qtype),
                                      dequantize(np.asarray(src.data), src.qtype) * factor)
    with pytest.raises(ValueError, match="not exact"):
        scale_blocks(np.asarray(src.data), src.qtype, 2.0 ** -30)


# --- sessions, paging, snapshots --------------------------------------------------------------------------------


def test_a_restored_moe_session_continues_like_the_uninterrupted_one(tmp_path):
    """qwen3moe with a KV pool of 512 slots and a 700-token first turn: paged out, snapshotted, restored into another
    engine, continued."""
    model = tiny(tmp_path, "qwen3moe", n_ctx=4096, vocab=512)

    def load():
        return lucekv.load(model, backend="cpu", kv_dtype="f32", kv_pool=512, kv_policy="lru")

    first, second = prompt(700, seed=2), prompt(20, seed=3)
    a, b, _ = conversation(load(), "s", first, second)
    engine = load()
    turn(engine, first, "s")
    assert engine.paged.usage().paged_chunks > 0
    fresh = load()
    roundtrip(engine, "s", fresh, new_id="moved")
    b_moved, usage = turn(fresh, first + a + second, "moved")
    assert b_moved == b and usage.cached_tokens == len(first) + len(a) - 1
