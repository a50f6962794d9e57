"""Hugging Face transformers on the same GGUF: the Python anchor of `lucekv bench decode --transformers` (speed
on the same device, logits to compare with) and the model loader of the CPU oracle tests.

transformers rebuilds the model config from GGUF metadata, but its mapping drops some keys llama.cpp
uses; `config_overrides` puts back the ones that change the math for the families lucekv supports:
- `{arch}.attention.key_length` (head_dim) is ignored for qwen3 (the config default 128 is kept) and
  qwen2 (n_embd / n_head is assumed, and its config has no head_dim to set); llama takes head_dim from
  rope.dimension_count instead.
- gemma3 has no key for the attention scale. llama.cpp uses 1/sqrt(key_length) (except Gemma-3 27B,
  which uses 1/sqrt(n_embd / n_head)); transformers uses query_pre_attn_scalar, default 256.
- RoPE scaling (`{arch}.rope.scaling.*`, linear and YaRN) is dropped: it goes back as `rope_parameters`
  (gemma3's to its global layers only). A Llama 3 file's `rope_freqs.weight` cannot be given back (transformers
  takes llama3 parameters, not factors): the caller passes them, or the load is refused.

torch and transformers are imported here only when called: they are the `ref` extra, not lucekv's needs.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SPEED_DTYPE = "bfloat16"  # what a transformers user runs a GGUF's dequantized weights in on a GPU
LOGIT_TOKENS = 64


def config_overrides(path: Path, rope_parameters: dict | None = None) -> dict[str, Any]:
    """Config values transformers' GGUF mapping misses. `rope_parameters` (transformers' form): a Llama 3 file's
    RoPE, which the file holds only as per-pair factors (`rope_freqs.weight`) that transformers cannot take."""
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, tensors = read_gguf_metadata(str(path))  # fast: leaves the token arrays unread
    arch = metadata["general.architecture"]
    overrides: dict[str, Any] = {}
    if rope_parameters is None and "rope_freqs.weight" in tensors:
        raise ValueError(f"{path.name}: transformers ignores rope_freqs.weight; pass the model's llama3 "
                         "rope_parameters")
    rope = rope_parameters or _rope_parameters(metadata, arch)
    if rope is not None:
        overrides["rope_parameters"] = rope
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if head_dim is None:
        return overrides
    if arch == "qwen2":
        n_embd, n_head = metadata["qwen2.embedding_length"], metadata["qwen2.attention.head_count"]
        if head_dim != n_embd // n_head:
            raise ValueError(f"{path.name}: transformers' Qwen2 needs head_dim = n_embd / n_head")
        return overrides
    overrides["head_dim"] = head_dim
    if arch == "gemma3":
        overrides["query_pre_attn_scalar"] = head_dim
    return overrides


def _rope_parameters(metadata: dict[str, Any], arch: str) -> dict | None:
    """A linear or YaRN RoPE scaling of the GGUF in transformers' form (its GGUF mapping drops them), or None."""
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    theta = float(metadata.get(f"{arch}.rope.freq_base", 10_000.0))
    scaled = {"rope_type": kind, "rope_theta": theta, "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    if kind == "yarn":
        scaled["original_max_position_embeddings"] = int(metadata[f"{arch}.rope.scaling.original_context_length"])
    if arch == "gemma3":  # the scaling is the global layers'; local ones rotate plainly at their own base
        return {"full_attention": scaled, "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    return scaled


def load(path: Path, device: str = "cpu", attn: str = "eager", rope_parameters: dict | None = None):
    """The GGUF at `path` in transformers, float32 weights (dequantized on load) on `device`, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation=attn,
                                                 **config_overrides(path, rope_parameters))
    return model.to(device).eval()


def logits(model, token_ids: list[int]) -> np.ndarray:
    """[len(token_ids), vocab] float32 logits of one forward pass over `token_ids`."""
    import torch

    with torch.inference_mode():
        out = model(torch.tensor([token_ids], device=model.device)).logits
    return out[0].float().cpu().numpy()


def greedy(model, token_ids: list[int], n: int) -> list[int]:
    """The next `n` greedy tokens after `token_ids`, decoded with transformers' KV cache (no EOS stop)."""
    ids, _, _ = _generate(model, token_ids, n)
    return ids


def _generate(model, token_ids: list[int], n: int) -> tuple[list[int], float, float]:
    """n greedy tokens; seconds of the prompt's forward (to the first token) and of the n - 1 steps after it.

    The chosen token stays on the device between steps, as in a tight generation loop (no host sync per token)."""
    import torch

    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    out_ids = []
    with torch.inference_mode():
        sync()
        t0 = time.perf_counter()
        step = model(torch.tensor([token_ids], device=model.device), use_cache=True)
        token = step.logits[0, -1].argmax().view(1, 1)
        sync()
        t1 = time.perf_counter()
        out_ids.append(token)
        for _ in range(n - 1):
            step = model(token, past_key_values=step.past_key_values, use_cache=True)
            token = step.logits[0, -1].argmax().view(1, 1)
            out_ids.append(token)
        sync()
        t2 = time.perf_counter()
    return [int(t) for t in torch.cat(out_ids).flatten().tolist()], t1 - t0, t2 - t1


def anchor(path: Path, prompts: list[list[int]], gen_tokens: int, reference_logits: np.ndarray) -> dict:
    """transformers' prefill and decode tok/s on `prompts` (the first warms up, as lucekv's does) and the relative
    error of `reference_logits` (lucekv's, over the first LOGIT_TOKENS of prompts[0]) against transformers' in
    float32. Runs on the GPU when torch sees one, in SPEED_DTYPE there, float32 on a CPU."""
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load(path, device, attn="sdpa")
    ids = prompts[0][:LOGIT_TOKENS]
    ref = logits(model, ids)
    err = float(np.abs(reference_logits - ref).max() / np.abs(ref).max())
    agree = float((reference_logits.argmax(-1) == ref.argmax(-1)).mean())
    dtype = SPEED_DTYPE if device == "cuda" else "float32"
    model.to(getattr(torch, dtype))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    prefill, decode = [], []
    for i, prompt in enumerate(prompts):
        _, t_first, t_rest = _generate(model, prompt, gen_tokens)
        if i:
            prefill.append(len(prompt) / t_first)
            decode.append((gen_tokens - 1) / t_rest)
            print(f"transformers run {i}: prefill {prefill[-1]:.1f} tok/s, decode {decode[-1]:.1f} tok/s",
                  file=sys.stderr)
    return {
        "transformers": transformers.__version__, "torch": torch.__version__, "device": device, "dtype": dtype,
        "attn_implementation": "sdpa",
        "prefill_tok_s_median": statistics.median(prefill), "decode_tok_s_median": statistics.median(decode),
        "prefill_tok_s": prefill, "decode_tok_s": decode,
        "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
        "logits": {"tokens": len(ids), "weights": "float32", "max_rel_err_of_lucekv": err,
                   "argmax_agree": agree},
    }
