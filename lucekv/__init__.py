"""lucekv: long-context LLM inference as a gRPC service."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lucekv.engine.config import EngineConfig, engine_config
from lucekv.engine.engine import Engine, EngineInfo
from lucekv.engine.sampling import SamplingParams
from lucekv.engine.types import GenerationDelta, Usage
from lucekv.snapshot.store import SnapshotStore

__all__ = ["Engine", "EngineConfig", "EngineInfo", "GenerationDelta", "SamplingParams", "Usage", "load"]


def load(model: str | Path, config: EngineConfig | None = None, *, snapshot_store: SnapshotStore | None = None,
         **options: Any) -> Engine:
    """Load a model by registry name (fetched if missing) or GGUF path. `options`: EngineConfig's fields by name
    (backend, kv_dtype, n_ctx, kv_pool, kv_policy, kv_tau, max_batch, speculation, ...), over `config` if given (an
    unknown name is a TypeError); `snapshot_store`: where idle sessions spill (lucekv.snapshot.store)."""
    from lucekv.model.registry import resolve_model

    config = engine_config(config, **options).check()  # before a model is fetched
    return Engine(resolve_model(str(model)), config, snapshot_store)
