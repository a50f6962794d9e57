"""Embedding lookup: rows of a packed table, decoded on the GPU and optionally scaled."""

from __future__ import annotations

import numpy as np

from lucekv.kernels.cuda._numba import await_grid, blocks, cuda, jit_kernel
from lucekv.kernels.cuda.packed import DeviceMatrix, element_decoder

THREADS = 128


def _make_embed(weight_at):
    @jit_kernel
    def kernel(w, tokens, mult, out):
        await_grid()
        k = cuda.grid(1)
        t = cuda.blockIdx.y
        if k < out.shape[1]:
            out[t, k] = weight_at(w, tokens[t], k) * mult

    return kernel


_KERNELS = {kind: _make_embed(element_decoder(kind)) for kind in ("q4", "q6", "q8", "f32")}


def embed(table: DeviceMatrix, tokens, scale: float, out, stream=0) -> None:
    """out[n, cols] = table[tokens[i]] * scale; tokens int32 [n] on the device."""
    grid = (blocks(table.cols, THREADS), tokens.shape[0])
    _KERNELS[table.kind][grid, THREADS, stream](table.quant, tokens, np.float32(scale), out)
