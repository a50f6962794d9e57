"""The mixture-of-experts FFN in numpy float64, from a layer's GGUF tensors dequantized by gguf: the reference of the
CPU and CUDA MoE kernels. Experts are dequantized when a token first uses them (an A3B layer holds 600M weights)."""

from __future__ import annotations

import functools

import numpy as np
from gguf.quants import dequantize

from lucekv.model.gguf import GGUFFile


def dequantized(g: GGUFFile, name: str, index: int | None = None) -> np.ndarray:
    """Tensor `name` (its matrix `index` where it is a stack) in float64."""
    t = g.tensor(name)
    data, shape = np.asarray(t.data), t.shape
    if index is not None:
        data, shape = data[index], shape[1:]
    return dequantize(data, t.qtype).reshape(shape).astype(np.float64)


class MoeLayer:
    def __init__(self, g: GGUFFile, layer: int):
        self._g, self._prefix = g, f"blk.{layer}."
        self.router = self._values("ffn_gate_inp")
        self.shared = None
        if self._prefix + "ffn_gate_inp_shexp.weight" in g.tensors:
            self.shared = tuple(self._values(n) for n in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp",
                                                          "ffn_gate_inp_shexp"))

    def _values(self, name: str, index: int | None = None) -> np.ndarray:
        return dequantized(self._g, f"{self._prefix}{name}.weight", index)

    @functools.cache  # noqa: B019  (one layer per test: the cache lives as long as it)
    def expert(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Expert e's gate [n_ff, n_embd], up and down [n_embd, n_ff]."""
        return tuple(self._values(n, e) for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))


def moe_layer(g: GGUFFile, layer: int) -> MoeLayer:
    return MoeLayer(g, layer)


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
            gate, up, down = m.expert(int(ids[t, r]))
            out[t] += w[t, r] * (down @ (silu(gate @ h[t]) * (up @ h[t])))
    if m.shared is not None:
        gate, up, down, gate_inp = m.shared
        sig = 1 / (1 + np.exp(-(h @ gate_inp.reshape(-1))))
        out += sig[:, None] * ((silu(h @ gate.T) * (h @ up.T)) @ down.T)
    return out
