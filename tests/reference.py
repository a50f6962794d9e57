"""Reference outputs from Hugging Face transformers for oracle tests: float32 weights, eager attention.

transformers rebuilds the model config from GGUF metadata, but its mapping drops some keys llama.cpp
uses; `config_overrides` puts back the ones that change the math for the families lucekv supports:
- `{arch}.attention.key_length` (head_dim) is ignored for qwen3 (the config default 128 is kept) and
  qwen2 (n_embd / n_head is assumed, and its config has no head_dim to set); llama takes head_dim from
  rope.dimension_count instead.
- gemma3 has no key for the attention scale. llama.cpp uses 1/sqrt(key_length) (except Gemma-3 27B,
  which uses 1/sqrt(n_embd / n_head)); transformers uses query_pre_attn_scalar, default 256.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.integrations.gguf import read_gguf_metadata


def config_overrides(path: Path) -> dict[str, Any]:
    metadata, _ = read_gguf_metadata(str(path))  # fast: leaves the token arrays unread
    arch = metadata["general.architecture"]
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if head_dim is None:
        return {}
    if arch == "qwen2":
        n_embd, n_head = metadata["qwen2.embedding_length"], metadata["qwen2.attention.head_count"]
        if head_dim != n_embd // n_head:
            raise ValueError(f"{path.name}: transformers' Qwen2 needs head_dim = n_embd / n_head")
        return {}
    overrides: dict[str, Any] = {"head_dim": head_dim}
    if arch == "gemma3":
        overrides["query_pre_attn_scalar"] = head_dim
    return overrides


@functools.cache
def _load(path: Path, mtime_ns: int) -> PreTrainedModel:
    del mtime_ns  # part of the cache key only: a rewritten file loads afresh
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager",
        **config_overrides(path))
    return model.eval()


def hf_model(path: str | Path) -> PreTrainedModel:
    """The GGUF at `path` loaded in transformers, once per file per process."""
    path = Path(path).resolve()
    return _load(path, path.stat().st_mtime_ns)


def hf_logits(path: str | Path, token_ids: list[int]) -> np.ndarray:
    """[len(token_ids), vocab] float32 logits of one forward pass over `token_ids`."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([token_ids])).logits
    return logits[0].float().numpy()


def hf_greedy(path: str | Path, token_ids: list[int], n: int) -> list[int]:
    """The next `n` greedy tokens after `token_ids`, decoded with transformers' KV cache (no EOS stop)."""
    model = hf_model(path)
    out: list[int] = []
    inputs, cache = torch.tensor([token_ids]), None
    with torch.no_grad():
        for _ in range(n):
            step = model(inputs, past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            inputs = torch.tensor([[out[-1]]])
    return out
