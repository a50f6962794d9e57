"""Architectures as data: what each model family's layers contain, and the hyperparameters of one model.

One decoder (`lucekv.model.decoder`) walks these; adding a family means adding an ArchSpec, not code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from gguf.quants import dequantize

from lucekv.errors import UnsupportedModelError
from lucekv.model import rope
from lucekv.model.gguf import GGUFFile
from lucekv.model.rope import LayerRope, RopeScaling


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
    # Mixture of experts, in every layer of a model whose GGUF has `expert_count` > 0 (`moe_only`: the family has
    # no dense form): a softmax router picks each token's top-k experts, weighted by their probabilities, those
    # renormalised to sum to 1 where `norm_topk`; a `shared_expert` runs beside them for every token, its output
    # scaled by the sigmoid of a gate of its own. llama.cpp fixes these per family, not from metadata.
    moe_only: bool = False
    norm_topk: bool = True
    shared_expert: bool = False


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", rope_style="norm"),  # with experts: Mixtral (top-2, renormalised)
    "qwen2": ArchSpec("qwen2", rope_style="neox"),  # q/k/v biases are read whenever the GGUF has them
    "qwen3": ArchSpec("qwen3", rope_style="neox", qk_norm=True),
    "qwen2moe": ArchSpec("qwen2moe", rope_style="neox", moe_only=True, norm_topk=False, shared_expert=True),
    "qwen3moe": ArchSpec("qwen3moe", rope_style="neox", qk_norm=True, moe_only=True),
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
    rope_scaling: RopeScaling  # of the global layers; local layers of a family with their own base rotate plainly
    sliding_window: int  # 0 = none
    attn_scale: float  # 1/sqrt(head_dim); a layer's own (`layer_rope`) may carry RoPE's magnitude too
    n_expert: int = 0  # experts per layer; 0 = a dense FFN
    n_expert_used: int = 0  # experts each token is routed to (top-k)
    n_ff_expert: int = 0  # FFN width of one expert
    n_ff_shared: int = 0  # FFN width of the shared expert (arch.shared_expert)

    def is_local(self, layer: int) -> bool:
        every = self.arch.global_every
        return self.sliding_window > 0 and every > 0 and (layer + 1) % every != 0

    def window(self, layer: int) -> int:
        return self.sliding_window if self.is_local(layer) else 0

    def layer_rope(self, layer: int) -> LayerRope:
        """The layer's rotary speeds and softmax scale. Local layers of a family with a local RoPE base (gemma3)
        rotate at that base unscaled, as llama.cpp and transformers do: a long-context scaling is the global
        layers'."""
        plain = self.is_local(layer) and self.arch.local_rope_base is not None
        base, scaling = (self.arch.local_rope_base, RopeScaling()) if plain else (self.rope_base, self.rope_scaling)
        return LayerRope(rope.frequencies(base, self.rope_dim, scaling),
                         self.attn_scale * rope.magnitude(scaling) ** 2)

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> ModelSpec:
        arch = ARCHS.get(g.arch)
        if arch is None:
            raise UnsupportedModelError(
                f"{g.path.name}: architecture {g.arch!r} is not supported (supported: {', '.join(ARCHS)})")
        meta = ArchMetadata(g)
        n_embd = int(meta.require("embedding_length"))
        n_head = int(meta.require("attention.head_count"))
        head_dim = int(meta.get("attention.key_length", n_embd // n_head))
        if int(meta.get("attention.value_length", head_dim)) != head_dim:
            raise UnsupportedModelError(f"{g.path.name}: key_length != value_length is not supported")
        rope_dim = int(meta.get("rope.dimension_count", head_dim))
        tokens = g.metadata.get("tokenizer.ggml.tokens") or []
        vocab = int(meta.get("vocab_size", len(tokens)) or g.tensor("token_embd.weight").shape[0])
        spec = cls(
            arch=arch,
            name=str(g.metadata.get("general.name", g.path.stem)),
            n_embd=n_embd,
            n_layer=int(meta.require("block_count")),
            n_head=n_head,
            n_kv_head=int(meta.get("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_ff=int(meta.require("feed_forward_length")),
            n_ctx=int(meta.require("context_length")),
            vocab_size=vocab,
            rms_eps=float(meta.require("attention.layer_norm_rms_epsilon")),
            rope_base=float(meta.get("rope.freq_base", 10_000.0)),
            rope_dim=rope_dim,
            rope_scaling=_rope_scaling(g, meta, rope_dim),
            sliding_window=int(meta.get("attention.sliding_window", 0)) if arch.global_every else 0,
            attn_scale=1.0 / math.sqrt(head_dim),
            **_experts(g, meta, arch),
        )
        meta.refuse_unread()
        return spec


# Keys that change nothing lucekv computes: read so that the check of unread keys lets them pass.
INFORMATIONAL_KEYS = ("rope.scaling.finetuned",)


class ArchMetadata:
    """The `{arch}.*` metadata of a GGUF, read through `get` / `require`; `refuse_unread` then refuses the file if
    it holds a key nobody read: a setting lucekv does not implement may change the math (a softcap, another
    attention, a scaling), and computing the model without it would give different numbers silently."""

    def __init__(self, g: GGUFFile):
        self._g = g
        self._prefix = f"{g.arch}."
        self._read: set[str] = set()
        for key in INFORMATIONAL_KEYS:
            self.get(key)

    def get(self, key: str, default=None):
        self._read.add(key)
        return self._g.metadata.get(self._prefix + key, default)

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise UnsupportedModelError(f"{self._g.path.name}: metadata key {self._prefix}{key} is missing")
        return value

    def refuse_unread(self) -> None:
        unread = sorted(k for k in self._g.metadata if k.startswith(self._prefix) and k[len(self._prefix):]
                        not in self._read)
        if unread:
            raise UnsupportedModelError(
                f"{self._g.path.name}: metadata {', '.join(unread)} {'is' if len(unread) == 1 else 'are'} not "
                "implemented by lucekv; such a setting may change the model's math, so the file is refused "
                "rather than run differently")


def _rope_scaling(g: GGUFFile, meta: ArchMetadata, rope_dim: int) -> RopeScaling:
    name = g.path.name
    kind = str(meta.get("rope.scaling.type", "none"))
    factor = float(meta.get("rope.scaling.factor", 1.0))
    legacy_linear = meta.get("rope.scale_linear")  # older files' key for a linear factor
    if legacy_linear is not None and kind == "none":
        kind, factor = "linear", float(legacy_linear)
    if kind not in rope.SCALING_KINDS:
        raise UnsupportedModelError(f"{name}: RoPE scaling {kind!r} ({g.arch}.rope.scaling.type) is not supported "
                                    f"(supported: {', '.join(rope.SCALING_KINDS)})")
    if kind == "none" and factor != 1.0:
        raise UnsupportedModelError(f"{name}: {g.arch}.rope.scaling.factor is {factor} without a scaling type")
    if kind != "none" and not factor > 0:
        raise UnsupportedModelError(f"{name}: {g.arch}.rope.scaling.factor must be positive, not {factor}")
    original = int(meta.get("rope.scaling.original_context_length", 0))
    if kind == "yarn" and original <= 0:
        raise UnsupportedModelError(f"{name}: YaRN needs {g.arch}.rope.scaling.original_context_length")
    return RopeScaling(
        kind=kind, factor=factor if kind != "none" else 1.0, original_context=original,
        beta_fast=float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(meta.get("rope.scaling.yarn_beta_slow", 1.0)),
        attn_factor=float(meta.get("rope.scaling.attn_factor", 1.0)),
        freq_factors=_freq_factors(g, rope_dim))


def _freq_factors(g: GGUFFile, rope_dim: int) -> tuple[float, ...] | None:
    """Llama 3.x's per-pair divisors of the rotary speeds (`rope_freqs.weight`), or None."""
    t = g.optional_tensor("rope_freqs.weight")
    if t is None:
        return None
    if t.shape != (rope_dim // 2,):
        raise UnsupportedModelError(f"{g.path.name}: rope_freqs.weight has shape {t.shape}, expected "
                                    f"({rope_dim // 2},): one factor per rotary pair")
    factors = np.asarray(dequantize(t.data, t.qtype), np.float64).reshape(-1)
    if not np.all(np.isfinite(factors) & (factors > 0)):
        raise UnsupportedModelError(f"{g.path.name}: rope_freqs.weight holds factors that are not positive numbers")
    return tuple(float(f) for f in factors)


# llama.cpp's expert_gating_func values (LLAMA_EXPERT_GATING_FUNC_TYPE_*): the router's probabilities
GATING_SOFTMAX = 1


def _experts(g: GGUFFile, meta: ArchMetadata, arch: ArchSpec) -> dict[str, int]:
    """ModelSpec's MoE fields from the `{arch}.expert_*` keys. The MoE variants lucekv does not implement (other
    gating functions, scaled or differently normalised weights, groups of experts, leading dense layers) are refused
    naming the key and its value; the same keys holding what lucekv implements pass."""
    name, key = g.path.name, meta.get
    n_expert = int(key("expert_count", 0))
    if n_expert == 0:
        if arch.moe_only:
            raise UnsupportedModelError(f"{name}: {g.arch} needs {g.arch}.expert_count > 0")
        return {}
    n_used = int(key("expert_used_count", 0))
    if not 0 < n_used <= n_expert:
        raise UnsupportedModelError(f"{name}: {g.arch}.expert_count = {n_expert} needs {g.arch}.expert_used_count "
                                    f"in 1..{n_expert}, not {n_used}")
    implemented = {  # key: (its value, or the value llama.cpp assumes without it; the one lucekv implements)
        "expert_gating_func": (key("expert_gating_func", GATING_SOFTMAX), GATING_SOFTMAX),
        "expert_weights_scale": (float(key("expert_weights_scale", 1.0)) or 1.0, 1.0),  # llama.cpp: 0 means 1
        "expert_weights_norm": (bool(key("expert_weights_norm", arch.norm_topk)), arch.norm_topk),
        "expert_shared_count": (int(key("expert_shared_count", int(arch.shared_expert))), int(arch.shared_expert)),
        "expert_group_count": (int(key("expert_group_count", 0)), 0),
        "leading_dense_block_count": (int(key("leading_dense_block_count", 0)), 0),
    }
    if not arch.shared_expert:  # a llama MoE's shared experts (Granite) have no gate: not qwen2moe's, refused
        implemented["expert_shared_feed_forward_length"] = (int(key("expert_shared_feed_forward_length", 0)), 0)
    for k, (value, supported) in implemented.items():
        if value != supported:
            raise UnsupportedModelError(f"{name}: {g.arch}.{k} = {value} is not supported for {g.arch} "
                                        f"(lucekv implements {supported})")
    # llama.cpp's widths: a llama MoE's experts are feed_forward_length wide, a Qwen MoE's expert_feed_forward_length
    # (default feed_forward_length / top-k); the loader checks the expert tensors' shapes against them
    n_ff = int(meta.require("feed_forward_length"))
    n_ff_expert = int(key("expert_feed_forward_length", 0))
    if g.arch == "llama":
        if n_ff_expert not in (0, n_ff):
            raise UnsupportedModelError(f"{name}: llama.expert_feed_forward_length = {n_ff_expert} differs from "
                                        f"feed_forward_length {n_ff}, the width llama.cpp gives a llama MoE's experts")
        n_ff_expert = n_ff
    n_ff_expert = n_ff_expert or n_ff // n_used
    n_ff_shared = (int(key("expert_shared_feed_forward_length", 0)) or n_ff) if arch.shared_expert else 0
    return {"n_expert": n_expert, "n_expert_used": n_used, "n_ff_expert": n_ff_expert, "n_ff_shared": n_ff_shared}
