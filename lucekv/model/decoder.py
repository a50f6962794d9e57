"""The one decoder: a forward pass over any ArchSpec, written against a backend's ops.

The decoder never touches device memory itself; `Ops` (see lucekv.backends) owns weights, the KV slot
pool and the kernels. This mirrors ggml's backend boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import GGUFFile, TensorInfo

Matrix = Any  # a backend's packed weight handle
Projections = Any  # a backend's handle of several matrices (and biases) applied to one input
Gated = Any  # a backend's handle of a gated FFN's gate and up matrices
Vector = Any  # a backend's float32 vector
Act = Any  # a backend's activation array, [n_tokens, width]


class Ops(Protocol):
    """A backend's side of the boundary. The compound ops (a norm before a product, a residual added by it,
    RoPE inside attention) let a backend fuse them; `norm` always means RMSNorm with the model's epsilon."""

    def matrix(self, t: TensorInfo) -> Matrix: ...
    def projections(self, ws: Sequence[TensorInfo], biases: Sequence[TensorInfo | None]) -> Projections: ...
    def gated(self, gate: TensorInfo, up: TensorInfo) -> Gated: ...
    def vector(self, t: TensorInfo) -> Vector: ...
    def embed(self, table: Matrix, tokens: np.ndarray, scale: float) -> Act: ...
    def project(self, x: Act, p: Projections, norm: Vector) -> list[Act]:
        """norm(x) through each matrix of p (plus its bias)."""
    def linear(self, w: Matrix, x: Act, norm: Vector | None = None, residual: Act | None = None) -> Act:
        """[residual +] (norm(x) or x) @ W.T"""
    def gated_linear(self, x: Act, g: Gated, norm: Vector) -> Act:
        """act(norm(x) @ W_gate.T) * (norm(x) @ W_up.T), act the architecture's (SiLU or GELU-tanh)."""
    def rmsnorm(self, x: Act, w: Vector, groups: int = 1) -> Act: ...
    def attention(self, layer: int, x: Act, lw: LayerWeights, positions: np.ndarray, slots: np.ndarray,
                  window: int) -> Act:
        """q, k, v of x (`project_qkv`), RoPE on q and k (`ModelSpec.layer_rope`), k and v written to `slots`,
        then q attends over the pool."""
    def add(self, x: Act, y: Act) -> Act: ...
    def rows(self, x: Act, idx: slice) -> Act: ...


@dataclass
class LayerWeights:
    attn_norm: Vector
    qkv: Projections  # q, k, v (with their biases, where the model has them)
    wo: Matrix
    ffn_norm: Vector
    gate_up: Gated
    w_down: Matrix
    q_norm: Vector | None = None
    k_norm: Vector | None = None
    post_attn_norm: Vector | None = None
    post_ffn_norm: Vector | None = None


@dataclass
class Weights:
    token_embd: Matrix
    output_norm: Vector
    output: Matrix  # token_embd itself when the output is tied
    layers: list[LayerWeights]


def load_weights(g: GGUFFile, spec: ModelSpec, ops: Ops) -> Weights:
    layers = []
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        qkv = [p + f"attn_{x}" for x in "qkv"]
        layers.append(LayerWeights(
            attn_norm=ops.vector(g.tensor(p + "attn_norm.weight")),
            qkv=ops.projections([g.tensor(n + ".weight") for n in qkv], [g.optional_tensor(n + ".bias") for n in qkv]),
            wo=ops.matrix(g.tensor(p + "attn_output.weight")),
            ffn_norm=ops.vector(g.tensor(p + "ffn_norm.weight")),
            gate_up=ops.gated(g.tensor(p + "ffn_gate.weight"), g.tensor(p + "ffn_up.weight")),
            w_down=ops.matrix(g.tensor(p + "ffn_down.weight")),
            q_norm=ops.vector(g.tensor(p + "attn_q_norm.weight")) if spec.arch.qk_norm else None,
            k_norm=ops.vector(g.tensor(p + "attn_k_norm.weight")) if spec.arch.qk_norm else None,
            post_attn_norm=ops.vector(g.tensor(p + "post_attention_norm.weight")) if spec.arch.post_norms else None,
            post_ffn_norm=ops.vector(g.tensor(p + "post_ffw_norm.weight")) if spec.arch.post_norms else None,
        ))
    if spec.rope_scaling.freq_factors is not None:
        g.tensor("rope_freqs.weight")  # taken: the spec holds its values (ModelSpec.layer_rope)
    token_embd = ops.matrix(g.tensor("token_embd.weight"))
    output = g.optional_tensor("output.weight")
    weights = Weights(token_embd, ops.vector(g.tensor("output_norm.weight")),
                      token_embd if output is None else ops.matrix(output), layers)
    g.refuse_unused_tensors()
    return weights


def forward(spec: ModelSpec, w: Weights, ops: Ops, tokens: np.ndarray, positions: np.ndarray,
            slots: np.ndarray, all_logits: bool = False) -> Act:
    """Run `tokens` at `positions`, writing their K/V to pool `slots`; logits of the last token (or all)."""
    x = ops.embed(w.token_embd, tokens, float(np.sqrt(spec.n_embd)) if spec.arch.embed_scale else 1.0)
    for i, lw in enumerate(w.layers):
        attn = ops.attention(i, x, lw, positions, slots, spec.window(i))
        x = _add_branch(ops, x, lw.wo, attn, lw.post_attn_norm)
        x = _add_branch(ops, x, lw.w_down, ops.gated_linear(x, lw.gate_up, norm=lw.ffn_norm), lw.post_ffn_norm)
    if not all_logits:
        x = ops.rows(x, slice(-1, None))
    return ops.linear(w.output, x, norm=w.output_norm)


def project_qkv(spec: ModelSpec, ops: Ops, x: Act, lw: LayerWeights) -> tuple[Act, Act, Act]:
    """q, k, v of the attention norm of x, q and k normalized per head where the model has q/k norms (before RoPE,
    which `Ops.attention` applies)."""
    q, k, v = ops.project(x, lw.qkv, norm=lw.attn_norm)
    if lw.q_norm is not None:
        q = ops.rmsnorm(q, lw.q_norm, groups=spec.n_head)
        k = ops.rmsnorm(k, lw.k_norm, groups=spec.n_kv_head)
    return q, k, v


def _add_branch(ops: Ops, x: Act, w: Matrix, h: Act, post_norm: Vector | None) -> Act:
    """x + W h, the branch normalized first where the architecture has a post-norm (Gemma 3)."""
    if post_norm is None:
        return ops.linear(w, h, residual=x)
    return ops.add(x, ops.rmsnorm(ops.linear(w, h), post_norm))
