"""lucekv: long-context LLM inference as a gRPC service."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lucekv.engine.engine import Engine, EngineInfo
from lucekv.engine.sampling import SamplingParams
from lucekv.engine.types import GenerationDelta, Usage

__all__ = ["Engine", "EngineInfo", "GenerationDelta", "SamplingParams", "Usage", "load"]


def load(model: str | Path, **options: Any) -> Engine:
    """Load a model by registry name (fetched if missing) or GGUF path; `options` are Engine's (backend, kv_dtype,
    n_ctx, kv_pool, kv_policy, kv_tau, session limits, snapshot_store, speculation)."""
    from lucekv.model.registry import resolve_model

    return Engine(resolve_model(str(model)), **options)
