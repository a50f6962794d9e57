"""Prefill products Y[n, rows] = X[n, cols] @ W.T: shared-memory tiles, weights decoded while tiling.

Correctness first: a TILE x TILE block of threads computes a TILE x TILE tile of Y; each step stages a
TILE x TILE_K slab of X and of W (decoded to float32) in shared memory. No tensor cores yet.
"""

from __future__ import annotations

import numpy as np

from lucekv.kernels.cuda._numba import blocks, cuda
from lucekv.kernels.cuda.packed import DeviceMatrix, element_decoder

TILE = 16  # tokens and weight rows per block
TILE_K = 32  # the reduction slab: one q4/q8 block of 32, two of 16
THREADS = TILE * TILE
TILE_K_PAD = TILE_K + 1  # shared rows one longer: no bank conflicts on column reads


def _make_matmul(weight_at):
    @cuda.jit
    def kernel(codes, scale, bias, block_log2, rows, x, out):
        tr = cuda.threadIdx.x  # weight row within the tile
        tt = cuda.threadIdx.y  # token within the tile
        tid = tt * TILE + tr
        r0 = cuda.blockIdx.x * TILE
        t0 = cuda.blockIdx.y * TILE
        n, cols = x.shape
        xs = cuda.shared.array((TILE, TILE_K_PAD), np.float32)
        ws = cuda.shared.array((TILE, TILE_K_PAD), np.float32)
        acc = np.float32(0)
        for k0 in range(0, cols, TILE_K):
            for e in range(tid, TILE * TILE_K, THREADS):
                i = e // TILE_K
                kk = e % TILE_K
                inside = k0 + kk < cols
                xs[i, kk] = x[t0 + i, k0 + kk] if t0 + i < n and inside else np.float32(0)
                ws[i, kk] = (weight_at(codes, scale, bias, block_log2, r0 + i, k0 + kk)
                             if r0 + i < rows and inside else np.float32(0))
            cuda.syncthreads()
            for kk in range(TILE_K):
                acc += xs[tt, kk] * ws[tr, kk]
            cuda.syncthreads()
        if t0 + tt < n and r0 + tr < rows:
            out[t0 + tt, r0 + tr] = acc

    return kernel


_KERNELS = {kind: _make_matmul(element_decoder(kind)) for kind in ("q4", "q8", "f32")}


def matmul(w: DeviceMatrix, x, out, stream=0) -> None:
    """out[n, rows] = x[n, cols] @ W.T."""
    grid = (blocks(w.rows, TILE), blocks(x.shape[0], TILE))
    _KERNELS[w.kind][grid, (TILE, TILE), stream](w.codes, w.scale, w.bias, w.block_log2, w.rows, x, out)
