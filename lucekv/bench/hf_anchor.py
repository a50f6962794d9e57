"""Hugging Face transformers on the same GGUF: the Python anchor of `lucekv bench decode --transformers` (speed
on the same device, logits to compare with) and the model loader of the CPU oracle tests.

transformers rebuilds the model config from GGUF metadata, but its mapping drops some keys llama.cpp
uses; `config_overrides` puts back the ones that change the math for the families lucekv supports:
- `{arch}.attention.key_length` (head_dim) is ignored for qwen3 (the config default 128 is kept) and
  qwen2 and qwen2moe (n_embd / n_head is assumed, and their configs have no head_dim to set); llama takes
  head_dim from rope.dimension_count instead.
- gemma3 has no key for the attention scale. llama.cpp uses 1/sqrt(key_length) (except Gemma-3 27B,
  which uses 1/sqrt(n_embd / n_head)); transformers uses query_pre_attn_scalar, default 256.
- RoPE scaling (`{arch}.rope.scaling.*`, linear and YaRN) is dropped: it goes back as `rope_parameters`
  (gemma3's to its global layers only). A Llama 3 file's `rope_freqs.weight` cannot be given back (transformers
  takes llama3 parameters, not factors): the caller passes them, or the load is refused.
- qwen2moe and qwen3moe: the experts' width `expert_feed_forward_length` (and qwen2moe's shared expert's,
  `expert_shared_feed_forward_length`) are not mapped (the config defaults, 768 to 5632, are kept).
A Mixtral-style GGUF (llama with experts) transformers' loader reads as a dense LlamaForCausalLM; `load` builds a
MixtralForCausalLM from the file's dequantized tensors instead (`_llama_moe`).

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
    for key, name in (("expert_feed_forward_length", "moe_intermediate_size"),
                      ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")):
        if arch in ("qwen2moe", "qwen3moe") and f"{arch}.{key}" in metadata:
            overrides[name] = metadata[f"{arch}.{key}"]
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if head_dim is None:
        return overrides
    if arch in ("qwen2", "qwen2moe"):
        n_embd, n_head = metadata[f"{arch}.embedding_length"], metadata[f"{arch}.attention.head_count"]
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

    if _is_llama_moe(path):
        model = _llama_moe(path, attn)
    else:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                     attn_implementation=attn,
                                                     **config_overrides(path, rope_parameters))
    return model.to(device).eval()


def _is_llama_moe(path: Path) -> bool:
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(path))
    return metadata["general.architecture"] == "llama" and metadata.get("llama.expert_count", 0) > 0


def _llama_moe(path: Path, attn: str):
    """transformers' MixtralForCausalLM holding a Mixtral-style GGUF's weights, dequantized to float32 by gguf:
    llama.cpp names mapped to transformers', q and k rows put back in Hugging Face's order (llama.cpp's converter
    interleaves each head's two rotary halves), gate and up experts concatenated as Mixtral keeps them."""
    import torch
    from gguf.quants import dequantize
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.initialization import no_init_weights

    from lucekv.model.gguf import Reader

    reader = Reader(path)
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")}
    if meta.get("llama.rope.scaling.type", "none") != "none" or "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise ValueError(f"{path.name}: the Mixtral reference rotates plainly; this file scales its RoPE")
    weights = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}

    def key(k: str, default: Any = None) -> Any:
        return meta.get(f"llama.{k}", default)

    n_head, n_embd = key("attention.head_count"), key("embedding_length")
    n_kv_head = key("attention.head_count_kv", n_head)
    config = MixtralConfig(
        vocab_size=weights["token_embd.weight"].shape[0], hidden_size=n_embd,
        intermediate_size=key("feed_forward_length"), num_hidden_layers=key("block_count"),
        num_attention_heads=n_head, num_key_value_heads=n_kv_head,
        head_dim=key("attention.key_length", n_embd // n_head), max_position_embeddings=key("context_length"),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_type": "default", "rope_theta": key("rope.freq_base", 10_000.0)},
        num_local_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
        tie_word_embeddings="output.weight" not in weights)

    def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
        return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)

    state = {"model.embed_tokens.weight": weights["token_embd.weight"],
             "model.norm.weight": weights["output_norm.weight"],
             "lm_head.weight": weights.get("output.weight", weights["token_embd.weight"])}
    for i in range(config.num_hidden_layers):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        state |= {
            h + "input_layernorm.weight": weights[b + "attn_norm.weight"],
            h + "self_attn.q_proj.weight": unpermute(weights[b + "attn_q.weight"], n_head),
            h + "self_attn.k_proj.weight": unpermute(weights[b + "attn_k.weight"], n_kv_head),
            h + "self_attn.v_proj.weight": weights[b + "attn_v.weight"],
            h + "self_attn.o_proj.weight": weights[b + "attn_output.weight"],
            h + "post_attention_layernorm.weight": weights[b + "ffn_norm.weight"],
            h + "mlp.gate.weight": weights[b + "ffn_gate_inp.weight"],
            h + "mlp.experts.gate_up_proj": np.concatenate([weights[b + "ffn_gate_exps.weight"],
                                                            weights[b + "ffn_up_exps.weight"]], axis=1),
            h + "mlp.experts.down_proj": weights[b + "ffn_down_exps.weight"],
        }
    with no_init_weights():  # every weight is loaded next: random initialization would take most of the time
        model = MixtralForCausalLM._from_config(config, attn_implementation=attn, dtype=torch.float32)
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, assign=True)
    return model


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
