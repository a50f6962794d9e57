"""The auto KV pool under Spark (`--gpu-memory-gib`, `--kv-pool auto`): sized from the GPU memory the placement leaves
(its expert tables: placed experts and spare slots), not as if every expert were on the GPU. Pure arithmetic on the
tensor bytes of the 30B-A3B speed model (`lucekv.model.synth.write_qwen3_30b_a3b_shape`), nothing allocated."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from lucekv.backends.cuda_spark import SparkOptions
from lucekv.engine.config import EngineConfig
from lucekv.engine.engine import (
    AUTO_POOL_SHARE,
    auto_pool_tokens,
    gpu_weight_bytes,
    kv_room_tokens,
    kv_token_bytes,
    usable_bytes,
)
from lucekv.errors import ConfigError
from lucekv.spark.experts import expert_bytes
from lucekv.spark.placement import Placement

GIB = 1 << 30
CONTEXT = 131072  # 128K


def a3b_file():
    """A stand-in for the GGUF file of the 30B-A3B speed model (its Q4_K_M mix) with its tensors' bytes, no data."""
    from lucekv.model.synth import QWEN3_30B_A3B, _Dims, _tensor_specs, _tensor_type, q4_k_m_types

    d = QWEN3_30B_A3B
    dims = _Dims(d["n_embd"], d["n_layer"], d["n_head"], d["n_kv_head"], d["head_dim"], d["n_ff"], CONTEXT, 0,
                 d["n_expert"], d["n_expert_used"], d["n_ff_expert"])
    overrides = q4_k_m_types(d["n_layer"])
    tensors = {}
    for s in _tensor_specs("qwen3moe", dims, d["vocab"], tied=False):
        block, size = GGML_QUANT_SIZES[_tensor_type(s, Q.Q4_K, overrides)]
        tensors[s.name] = SimpleNamespace(data=SimpleNamespace(nbytes=s.n_elements // block * size))
    spec = SimpleNamespace(n_layer=d["n_layer"], n_kv_head=d["n_kv_head"], head_dim=d["head_dim"])
    return SimpleNamespace(arch="qwen3moe", metadata={"qwen3moe.expert_count": d["n_expert"]}, tensors=tensors,
                           path=Path("a3b.gguf")), spec


def test_the_a3b_shape_at_128k_fits_16_gib_with_half_its_experts_placed():
    """An 80 GiB GPU whose CUDA context takes 0.5 GiB, bounded to 16 GiB in use. All experts on the GPU: 16.35 GiB of
    experts alone (the size `bench spark` measured), no pool fits. Half of every layer's expert bytes in tables (56
    placed + 8 spare slots of 128): the auto pool gets 90% of what the context and weights leave of 16 GiB (61888
    tokens, near half the 128K context), and context + weights + pool stay under 16 GiB. Unbounded, the whole 128K
    context fits."""
    free, total = int(79.5 * GIB), 80 * GIB
    usable = usable_bytes(free, total, 16)
    assert usable == int(15.5 * GIB) and usable_bytes(free, total, 0) == free
    g, spec = a3b_file()
    sizes = expert_bytes(g)
    assert sum(sizes) * 128 / GIB == pytest.approx(16.34765625)
    token = kv_token_bytes(spec, np.dtype(np.float16))
    assert token == 96 * 1024

    everything = gpu_weight_bytes(g)
    assert everything > 16 * GIB
    with pytest.raises(ConfigError, match="keep fewer experts on the GPU"):
        auto_pool_tokens(kv_room_tokens(usable, everything, token), CONTEXT)

    placement = Placement("fp", 128, tuple(tuple(range(56)) for _ in sizes))
    spark = SparkOptions(placement, spare=8)
    weights = gpu_weight_bytes(g, spark)
    assert weights == everything - 64 * sum(sizes)  # the 64 experts no slot holds stay in host memory
    pool = auto_pool_tokens(kv_room_tokens(usable, weights, token), CONTEXT)
    left = AUTO_POOL_SHARE * (usable - weights)
    assert left - 64 * token < pool * token <= left
    assert CONTEXT // 4 < pool < CONTEXT and (total - free) + weights + pool * token < 16 * GIB
    print(f"A3B shape, 50% of the experts' bytes on the GPU: weights {weights / GIB:.2f} GiB, auto pool {pool} tokens "
          f"({pool * token / GIB:.2f} GiB) of a {CONTEXT}-token context, 16 GiB in use at most")

    assert auto_pool_tokens(kv_room_tokens(usable_bytes(free, total, 0), everything, token), CONTEXT) is None


def test_a_negative_gpu_memory_is_refused():
    with pytest.raises(ConfigError, match="--gpu-memory-gib must be >= 0"):
        EngineConfig(gpu_memory_gib=-1).check()
