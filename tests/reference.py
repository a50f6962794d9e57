"""Reference outputs from Hugging Face transformers for oracle tests: float32 weights, eager attention, on the CPU
(the loader and its config fixes are lucekv.bench.hf_anchor's)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch  # noqa: F401  (the oracle tests skip, through importorskip of this module, without it)

from lucekv.bench import hf_anchor


@functools.cache
def _load(path: Path, mtime_ns: int):
    del mtime_ns  # part of the cache key only: a rewritten file loads afresh
    return hf_anchor.load(path)


def hf_model(path: str | Path):
    """The GGUF at `path` loaded in transformers, once per file per process."""
    path = Path(path).resolve()
    return _load(path, path.stat().st_mtime_ns)


def hf_logits(path: str | Path, token_ids: list[int]) -> np.ndarray:
    """[len(token_ids), vocab] float32 logits of one forward pass over `token_ids`."""
    return hf_anchor.logits(hf_model(path), token_ids)


def hf_greedy(path: str | Path, token_ids: list[int], n: int) -> list[int]:
    """The next `n` greedy tokens after `token_ids`, decoded with transformers' KV cache (no EOS stop)."""
    return hf_anchor.greedy(hf_model(path), token_ids, n)
