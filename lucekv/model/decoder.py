"""The one decoder: a forward pass over any ArchSpec, written against a backend's ops.

The decoder never touches device memory itself; `Ops` (see lucekv.backends) owns weights, the KV slot
pool and the kernels. This mirrors ggml's backend boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from lucekv.errors import ModelError
from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import GGUFFile, TensorInfo

Matrix = Any  # a backend's packed weight handle
Projections = Any  # a backend's handle of several matrices (and biases) applied to one input
Gated = Any  # a backend's handle of a gated FFN's gate and up matrices
Experts = Any  # a backend's handle of one layer's router and stacked expert matrices
Vector = Any  # a backend's float32 vector
Act = Any  # a backend's activation array, [n_tokens, width]


class Ops(Protocol):
    """A backend's side of the boundary. The compound ops (a norm before a product, a residual added by it,
    RoPE inside attention) let a backend fuse them; `norm` always means RMSNorm with the model's epsilon."""

    def matrix(self, t: TensorInfo) -> Matrix: ...
    def projections(self, ws: Sequence[TensorInfo], biases: Sequence[TensorInfo | None]) -> Projections: ...
    def gated(self, gate: TensorInfo, up: TensorInfo) -> Gated: ...
    def experts(self, router: TensorInfo, gate: TensorInfo, up: TensorInfo, down: TensorInfo) -> Experts:
        """router [n_expert, n_embd]; gate, up [n_expert, n_ff_expert, n_embd]; down [n_expert, n_embd, n_ff_expert]."""
    def vector(self, t: TensorInfo) -> Vector: ...
    def embed(self, table: Matrix, tokens: np.ndarray, scale: float) -> Act: ...
    def project(self, x: Act, p: Projections, norm: Vector) -> list[Act]:
        """norm(x) through each matrix of p (plus its bias)."""
    def linear(self, w: Matrix, x: Act, norm: Vector | None = None, residual: Act | None = None) -> Act:
        """[residual +] (norm(x) or x) @ W.T"""
    def gated_linear(self, x: Act, g: Gated, norm: Vector) -> Act:
        """act(norm(x) @ W_gate.T) * (norm(x) @ W_up.T), act the architecture's (SiLU or GELU-tanh)."""
    def moe_ffn(self, x: Act, m: MoeWeights, norm: Vector) -> Act:
        """x + the mixture of experts of h = norm(x): each token's top-k experts (ModelSpec.n_expert_used) of the
        router's softmax, each a SiLU-gated FFN of h, summed weighted by their probabilities (renormalised to sum to
        1 where the architecture's norm_topk says so), plus the shared expert of h scaled by sigmoid(h . gate) where
        m has one."""
    def rmsnorm(self, x: Act, w: Vector, groups: int = 1) -> Act: ...
    def attention(self, layer: int, x: Act, lw: LayerWeights, positions: np.ndarray, slots: np.ndarray,
                  window: int) -> Act:
        """q, k, v of x (`project_qkv`), RoPE on q and k (`ModelSpec.layer_rope`), k and v written to `slots`,
        then q attends over the pool."""
    def add(self, x: Act, y: Act) -> Act: ...
    def rows(self, x: Act, idx: slice) -> Act: ...


@dataclass
class SharedExpert:
    gate_up: Gated
    down: Matrix
    gate: Matrix  # [1, n_embd]: sigmoid(norm(x) . gate) scales the shared expert's output


@dataclass
class MoeWeights:
    layer: int  # the decoder layer it is the FFN of (routing observers count per layer)
    experts: Experts
    shared: SharedExpert | None = None


@dataclass
class LayerWeights:
    attn_norm: Vector
    qkv: Projections  # q, k, v (with their biases, where the model has them)
    wo: Matrix
    ffn_norm: Vector
    gate_up: Gated | None  # a dense FFN's; None where the layer has experts (moe)
    w_down: Matrix | None
    moe: MoeWeights | None = None
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
        dense = spec.n_expert == 0
        layers.append(LayerWeights(
            attn_norm=ops.vector(g.tensor(p + "attn_norm.weight")),
            qkv=ops.projections([g.tensor(n + ".weight") for n in qkv], [g.optional_tensor(n + ".bias") for n in qkv]),
            wo=ops.matrix(g.tensor(p + "attn_output.weight")),
            ffn_norm=ops.vector(g.tensor(p + "ffn_norm.weight")),
            gate_up=ops.gated(g.tensor(p + "ffn_gate.weight"), g.tensor(p + "ffn_up.weight")) if dense else None,
            w_down=ops.matrix(g.tensor(p + "ffn_down.weight")) if dense else None,
            moe=None if dense else _moe_weights(g, spec, ops, i),
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


def _moe_weights(g: GGUFFile, spec: ModelSpec, ops: Ops, layer: int) -> MoeWeights:
    """A layer's router and stacked experts (llama.cpp's layout: ffn_{gate,up,down}_exps, one 3-D tensor each) and
    its shared expert where the architecture has one, their shapes checked against the metadata's widths."""
    e, d, ff, sh = spec.n_expert, spec.n_embd, spec.n_ff_expert, spec.n_ff_shared
    p = f"blk.{layer}."

    def t(name: str, *shape: int) -> TensorInfo:
        info = g.tensor(p + name + ".weight")
        if info.shape != shape:
            raise ModelError(f"{g.path.name}: tensor {info.name!r} has shape {info.shape}, expected {shape} from the "
                             f"metadata (numpy order)")
        return info

    experts = ops.experts(t("ffn_gate_inp", e, d), t("ffn_gate_exps", e, ff, d), t("ffn_up_exps", e, ff, d),
                          t("ffn_down_exps", e, d, ff))
    if not spec.arch.shared_expert:
        return MoeWeights(layer, experts)
    gate = g.tensor(p + "ffn_gate_inp_shexp.weight")  # llama.cpp reads [n_embd] and [1, n_embd] alike
    gate = t("ffn_gate_inp_shexp", *((1, d) if len(gate.shape) == 2 else (d,)))
    return MoeWeights(layer, experts, SharedExpert(ops.gated(t("ffn_gate_shexp", sh, d), t("ffn_up_shexp", sh, d)),
                                                   ops.matrix(t("ffn_down_shexp", d, sh)),
                                                   ops.matrix(replace(gate, shape=(1, d)))))


def forward(spec: ModelSpec, w: Weights, ops: Ops, tokens: np.ndarray, positions: np.ndarray,
            slots: np.ndarray, all_logits: bool = False, capture: Callable[[int, Act], None] | None = None) -> Act:
    """Run `tokens` at `positions`, writing their K/V to pool `slots`; logits of the last token (or all). capture(i,
    x) sees each layer's output (the residual stream after layer i) as it is made (a backend that reuses its
    activation buffers copies what it keeps)."""
    x = embed(spec, w, ops, tokens)
    for i, lw in enumerate(w.layers):
        x = decoder_layer(spec, ops, i, lw, x, positions, slots)
        if capture is not None:
            capture(i, x)
    if not all_logits:
        x = ops.rows(x, slice(-1, None))
    return ops.linear(w.output, x, norm=w.output_norm)


def embed(spec: ModelSpec, w: Weights, ops: Ops, tokens: np.ndarray) -> Act:
    return ops.embed(w.token_embd, tokens, float(np.sqrt(spec.n_embd)) if spec.arch.embed_scale else 1.0)


def decoder_layer(spec: ModelSpec, ops: Ops, i: int, lw: LayerWeights, x: Act, positions: np.ndarray,
                  slots: np.ndarray) -> Act:
    """Layer i: attention, then the FFN (dense or mixture of experts), each added to the residual x."""
    attn = ops.attention(i, x, lw, positions, slots, spec.window(i))
    x = _add_branch(ops, x, lw.wo, attn, lw.post_attn_norm)
    if lw.moe is None:
        return _add_branch(ops, x, lw.w_down, ops.gated_linear(x, lw.gate_up, norm=lw.ffn_norm), lw.post_ffn_norm)
    return ops.moe_ffn(x, lw.moe, norm=lw.ffn_norm)


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
