"""The one decoder: a forward pass over any ArchSpec, written against a backend's ops.

The decoder never touches device memory itself; `Ops` (see lucekv.backends) owns weights, the KV slot
pool and the kernels. This mirrors ggml's backend boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import GGUFFile, TensorInfo

Matrix = Any  # a backend's packed weight handle
Vector = Any  # a backend's float32 vector
Act = Any  # a backend's activation array, [n_tokens, width]


class Ops(Protocol):
    def matrix(self, t: TensorInfo) -> Matrix: ...
    def vector(self, t: TensorInfo) -> Vector: ...
    def embed(self, table: Matrix, tokens: np.ndarray, scale: float) -> Act: ...
    def linear(self, w: Matrix, x: Act, bias: Vector | None = None) -> Act: ...
    def rmsnorm(self, x: Act, w: Vector, eps: float, groups: int = 1) -> Act: ...
    def rope(self, x: Act, n_heads: int, positions: np.ndarray, base: float) -> Act: ...
    def attention(self, layer: int, q: Act, k: Act, v: Act, positions: np.ndarray, slots: np.ndarray,
                  window: int) -> Act: ...
    def gated_act(self, gate: Act, up: Act) -> Act: ...
    def add(self, x: Act, y: Act) -> Act: ...
    def rows(self, x: Act, idx: slice) -> Act: ...


@dataclass
class LayerWeights:
    attn_norm: Vector
    wq: Matrix
    wk: Matrix
    wv: Matrix
    wo: Matrix
    ffn_norm: Vector
    w_gate: Matrix
    w_up: Matrix
    w_down: Matrix
    bq: Vector | None = None
    bk: Vector | None = None
    bv: Vector | None = None
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
    def opt_vec(name: str) -> Vector | None:
        return ops.vector(g.tensors[name]) if name in g.tensors else None

    layers = []
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=ops.vector(g.tensor(p + "attn_norm.weight")),
            wq=ops.matrix(g.tensor(p + "attn_q.weight")),
            wk=ops.matrix(g.tensor(p + "attn_k.weight")),
            wv=ops.matrix(g.tensor(p + "attn_v.weight")),
            wo=ops.matrix(g.tensor(p + "attn_output.weight")),
            ffn_norm=ops.vector(g.tensor(p + "ffn_norm.weight")),
            w_gate=ops.matrix(g.tensor(p + "ffn_gate.weight")),
            w_up=ops.matrix(g.tensor(p + "ffn_up.weight")),
            w_down=ops.matrix(g.tensor(p + "ffn_down.weight")),
            bq=opt_vec(p + "attn_q.bias"),
            bk=opt_vec(p + "attn_k.bias"),
            bv=opt_vec(p + "attn_v.bias"),
            q_norm=ops.vector(g.tensor(p + "attn_q_norm.weight")) if spec.arch.qk_norm else None,
            k_norm=ops.vector(g.tensor(p + "attn_k_norm.weight")) if spec.arch.qk_norm else None,
            post_attn_norm=ops.vector(g.tensor(p + "post_attention_norm.weight")) if spec.arch.post_norms else None,
            post_ffn_norm=ops.vector(g.tensor(p + "post_ffw_norm.weight")) if spec.arch.post_norms else None,
        ))
    token_embd = ops.matrix(g.tensor("token_embd.weight"))
    output = ops.matrix(g.tensors["output.weight"]) if "output.weight" in g.tensors else token_embd
    return Weights(token_embd, ops.vector(g.tensor("output_norm.weight")), output, layers)


def forward(spec: ModelSpec, w: Weights, ops: Ops, tokens: np.ndarray, positions: np.ndarray,
            slots: np.ndarray, all_logits: bool = False) -> Act:
    """Run `tokens` at `positions`, writing their K/V to pool `slots`; logits of the last token (or all)."""
    eps = spec.rms_eps
    x = ops.embed(w.token_embd, tokens, float(np.sqrt(spec.n_embd)) if spec.arch.embed_scale else 1.0)
    for i, lw in enumerate(w.layers):
        h = ops.rmsnorm(x, lw.attn_norm, eps)
        q = ops.linear(lw.wq, h, lw.bq)
        k = ops.linear(lw.wk, h, lw.bk)
        v = ops.linear(lw.wv, h, lw.bv)
        if spec.arch.qk_norm:
            q = ops.rmsnorm(q, lw.q_norm, eps, groups=spec.n_head)
            k = ops.rmsnorm(k, lw.k_norm, eps, groups=spec.n_kv_head)
        base = spec.layer_rope_base(i)
        q = ops.rope(q, spec.n_head, positions, base)
        k = ops.rope(k, spec.n_kv_head, positions, base)
        attn = ops.attention(i, q, k, v, positions, slots, spec.window(i))
        o = ops.linear(lw.wo, attn)
        if lw.post_attn_norm is not None:
            o = ops.rmsnorm(o, lw.post_attn_norm, eps)
        x = ops.add(x, o)
        h = ops.rmsnorm(x, lw.ffn_norm, eps)
        f = ops.linear(lw.w_down, ops.gated_act(ops.linear(lw.w_gate, h), ops.linear(lw.w_up, h)))
        if lw.post_ffn_norm is not None:
            f = ops.rmsnorm(f, lw.post_ffn_norm, eps)
        x = ops.add(x, f)
    if not all_logits:
        x = ops.rows(x, slice(-1, None))
    return ops.linear(w.output, ops.rmsnorm(x, w.output_norm, eps))
