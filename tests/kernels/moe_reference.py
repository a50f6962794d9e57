"""The mixture-of-experts FFN in numpy float64, from a layer's GGUF tensors dequantized by gguf: the reference of the
CPU and CUDA MoE kernels."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.quants import dequantize

from lucekv.model.gguf import GGUFFile


@dataclass
class MoeLayer:
    router: np.ndarray  # [n_expert, n_embd]
    gate: np.ndarray  # [n_expert, n_ff, n_embd]
    up: np.ndarray
    down: np.ndarray  # [n_expert, n_embd, n_ff]
    shared: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None  # gate, up, down, gate_inp [n_embd]


def moe_layer(g: GGUFFile, layer: int) -> MoeLayer:
    def values(name: str) -> np.ndarray:
        t = g.tensor(f"blk.{layer}.{name}.weight")
        return dequantize(np.asarray(t.data), t.qtype).reshape(t.shape).astype(np.float64)

    shared = None
    if f"blk.{layer}.ffn_gate_inp_shexp.weight" in g.tensors:
        shared = tuple(values(n) for n in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp"))
    return MoeLayer(*(values(n) for n in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")), shared)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def route(h: np.ndarray, router: np.ndarray, k: int, renormalise: bool) -> tuple[np.ndarray, np.ndarray]:
    """(ids [n, k], weights [n, k]): the k most probable experts of the router's softmax, in float64."""
    logits = h @ router.T
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=1)
    return ids, w / w.sum(axis=1, keepdims=True) if renormalise else w


def moe_ffn(h: np.ndarray, m: MoeLayer, k: int, renormalise: bool) -> np.ndarray:
    """The FFN output (no residual) of normalized inputs h [n, n_embd]."""
    h = h.astype(np.float64)
    ids, w = route(h, m.router, k, renormalise)
    out = np.zeros_like(h)
    for t in range(len(h)):
        for r in range(k):
            e = ids[t, r]
            out[t] += w[t, r] * (m.down[e] @ (silu(m.gate[e] @ h[t]) * (m.up[e] @ h[t])))
    if m.shared is not None:
        gate, up, down, gate_inp = m.shared
        sig = 1 / (1 + np.exp(-(h @ gate_inp.reshape(-1))))
        out += sig[:, None] * ((silu(h @ gate.T) * (h @ up.T)) @ down.T)
    return out
