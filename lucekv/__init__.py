"""lucekv: long-context LLM inference as a gRPC service."""

from __future__ import annotations

from pathlib import Path

from lucekv.engine.engine import Engine, EngineInfo
from lucekv.engine.sampling import SamplingParams
from lucekv.engine.types import GenerationDelta, Usage

__all__ = ["Engine", "EngineInfo", "GenerationDelta", "SamplingParams", "Usage", "load"]


def load(model: str | Path, backend: str = "auto", kv_dtype: str = "f16", n_ctx: int | None = None,
         kv_pool: int | None = None, kv_policy: str = "quest", kv_tau: int = 64) -> Engine:
    """Load a model by registry name (fetched if missing) or GGUF path. See Engine for the KV settings."""
    from lucekv.model.registry import resolve_model

    return Engine(resolve_model(str(model)), backend=backend, kv_dtype=kv_dtype, n_ctx=n_ctx, kv_pool=kv_pool,
                  kv_policy=kv_policy, kv_tau=kv_tau)
