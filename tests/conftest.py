"""Shared fixtures. Real model files come from $LUCEKV_TEST_MODELS_DIR (files named `<name>.gguf`) when it
holds them, else from the registry, which downloads them once into its cache."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_path() -> Callable[[str], Path]:
    """`model_path(name)`: the path of a real model file, e.g. model_path("smollm2-135m")."""

    def find(name: str) -> Path:
        models_dir = os.environ.get("LUCEKV_TEST_MODELS_DIR")
        if models_dir and (Path(models_dir) / f"{name}.gguf").is_file():
            return Path(models_dir) / f"{name}.gguf"
        try:
            from lucekv.model.registry import ensure_model
        except ImportError as e:
            pytest.skip(f"no {name}.gguf in LUCEKV_TEST_MODELS_DIR and the registry is not importable: {e}")
        return ensure_model(name)

    return find
