"""Elementwise ops: the gated activation of the FFN (SiLU or GELU-tanh) and residual adds."""

from __future__ import annotations

import math

import numpy as np

from lucekv.kernels.cuda._numba import await_grid, blocks, cuda, jit_kernel

THREADS = 256
GELU_C = np.float32(math.sqrt(2.0 / math.pi))
GELU_K = np.float32(0.044715)


def gated_act(gate, up, gelu: bool, out, stream=0) -> None:
    """out = act(gate) * up, all [n, width] (products of stacked gate/up rows apply it themselves)."""
    _gated_act[blocks(gate.size, THREADS), THREADS, stream](gate, up, gelu, out)


def add(x, y, out, stream=0) -> None:
    """out = x + y (out may be x)."""
    _add[blocks(x.size, THREADS), THREADS, stream](x, y, out)


@jit_kernel
def _gated_act(gate, up, gelu, out):
    await_grid()
    i = cuda.grid(1)
    width = gate.shape[1]
    if i >= gate.shape[0] * width:
        return
    t = i // width
    j = i % width
    out[t, j] = gated(gate[t, j], up[t, j], gelu)


@cuda.jit(device=True, inline=True)
def gated(g, u, gelu):
    """act(g) * u: GELU (tanh form) or SiLU."""
    if gelu:
        a = np.float32(0.5) * g * (np.float32(1) + math.tanh(GELU_C * (g + GELU_K * g * g * g)))
    else:
        a = g / (np.float32(1) + math.exp(-g))
    return a * u


@jit_kernel
def _add(x, y, out):
    await_grid()
    i = cuda.grid(1)
    width = x.shape[1]
    if i < x.shape[0] * width:
        out[i // width, i % width] = x[i // width, i % width] + y[i // width, i % width]

