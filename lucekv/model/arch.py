"""Architectures as data: what each model family's layers contain, and the hyperparameters of one model.

One decoder (`lucekv.model.decoder`) walks these; adding a family means adding an ArchSpec, not code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from lucekv.errors import UnsupportedModelError
from lucekv.model.gguf import GGUFFile


@dataclass(frozen=True)
class ArchSpec:
    name: str
    # "norm" rotates adjacent pairs (llama.cpp permutes llama's q/k at conversion); "neox" rotates halves.
    rope_style: Literal["norm", "neox"]
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE
    post_norms: bool = False  # RMSNorm on the attention and FFN outputs before each residual add
    activation: Literal["silu", "gelu_tanh"] = "silu"
    embed_scale: bool = False  # multiply token embeddings by sqrt(n_embd)
    # Sliding-window layers: every `global_every`-th layer (1-based) is global, the rest local. 0 = all global.
    global_every: int = 0
    local_rope_base: float | None = None  # RoPE base of local layers when it differs from the global one


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", rope_style="norm"),
    "qwen2": ArchSpec("qwen2", rope_style="neox"),  # q/k/v biases are read whenever the GGUF has them
    "qwen3": ArchSpec("qwen3", rope_style="neox", qk_norm=True),
    # Gemma 3 facts the GGUF does not carry (llama.cpp hard-codes them too): 5 local layers then 1 global,
    # local RoPE base 10 000, embeddings scaled by sqrt(n_embd), GELU-tanh gate. Norm weights arrive with
    # Gemma's "+1" already folded in by the converter.
    "gemma3": ArchSpec("gemma3", rope_style="neox", qk_norm=True, post_norms=True, activation="gelu_tanh",
                       embed_scale=True, global_every=6, local_rope_base=10_000.0),
}


@dataclass(frozen=True)
class ModelSpec:
    """One model's shape, read from GGUF metadata and completed by its ArchSpec."""

    arch: ArchSpec
    name: str
    n_embd: int
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_ff: int
    n_ctx: int
    vocab_size: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_scale: float  # positions are divided by this (linear RoPE scaling); 1 = none
    sliding_window: int  # 0 = none
    attn_scale: float

    def is_local(self, layer: int) -> bool:
        every = self.arch.global_every
        return self.sliding_window > 0 and every > 0 and (layer + 1) % every != 0

    def window(self, layer: int) -> int:
        return self.sliding_window if self.is_local(layer) else 0

    def layer_rope_base(self, layer: int) -> float:
        if self.is_local(layer) and self.arch.local_rope_base is not None:
            return self.arch.local_rope_base
        return self.rope_base

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> ModelSpec:
        arch = ARCHS.get(g.arch)
        if arch is None:
            raise UnsupportedModelError(
                f"{g.path.name}: architecture {g.arch!r} is not supported (supported: {', '.join(ARCHS)})")
        m = g.metadata

        def key(k: str, default=None):
            v = m.get(f"{g.arch}.{k}", default)
            if v is None:
                raise UnsupportedModelError(f"{g.path.name}: metadata key {g.arch}.{k} is missing")
            return v

        n_embd = int(key("embedding_length"))
        n_head = int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", n_embd // n_head))
        if int(key("attention.value_length", head_dim)) != head_dim:
            raise UnsupportedModelError(f"{g.path.name}: key_length != value_length is not supported")
        scaling = str(m.get(f"{g.arch}.rope.scaling.type", "none"))
        if scaling not in ("none", "linear"):
            raise UnsupportedModelError(f"{g.path.name}: RoPE scaling {scaling!r} is not supported")
        rope_scale = float(m.get(f"{g.arch}.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        tokens = m.get("tokenizer.ggml.tokens") or []
        vocab = int(m.get(f"{g.arch}.vocab_size", len(tokens)) or g.tensor("token_embd.weight").shape[0])
        return cls(
            arch=arch,
            name=str(m.get("general.name", g.path.stem)),
            n_embd=n_embd,
            n_layer=int(key("block_count")),
            n_head=n_head,
            n_kv_head=int(key("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_ff=int(key("feed_forward_length")),
            n_ctx=int(key("context_length")),
            vocab_size=vocab,
            rms_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_base=float(key("rope.freq_base", 10_000.0)),
            rope_dim=int(key("rope.dimension_count", head_dim)),
            rope_scale=rope_scale,
            sliding_window=int(m.get(f"{g.arch}.attention.sliding_window", 0)) if arch.global_every else 0,
            attn_scale=1.0 / math.sqrt(head_dim),
        )
