"""Prefill products Y[n, rows] = X[n, cols] @ W.T: register-tiled, weights decoded once per tile.

A block of THREADS threads computes a TOKENS x ROWS tile of Y, each thread a 4 x 4 sub-tile in registers
(tokens ty*4.., rows tx*4..). Per K_STEP columns the block stages X (transposed: k-major, so that a thread
reads its 4 tokens and 4 rows of one k from two short contiguous runs) and W in shared memory; W is
decoded from its packed form while staged, each element once per tile instead of once per product, and
each staged value feeds 4 products. Shared rows are PAD floats longer to spread the transposed stores
over the banks. No tensor cores yet.
"""

from __future__ import annotations

import numpy as np

from lucekv.kernels.cuda._numba import blocks, cuda
from lucekv.kernels.cuda.packed import DeviceMatrix

TOKENS = 64  # tokens per block tile
ROWS = 64  # weight rows per block tile
K_STEP = 32  # one q4 / Q8_0 block, two 16-blocks
THREADS = 256  # 16 x 16 threads, 4 x 4 outputs each
PAD = 4  # keeps 16-byte alignment of shared rows
TOKENS_PAD = TOKENS + PAD
ROWS_PAD = ROWS + PAD
LOW_NIBBLES = np.uint32(0x0F0F0F0F)


def _make_matmul(kind: str, stage_w):
    def kernel(codes, scale, bias, block_log2, rows, x, out):
        tid = cuda.threadIdx.x
        tx = tid % 16  # rows tx*4 .. tx*4 + 3 of the tile
        ty = tid // 16  # tokens ty*4 .. ty*4 + 3
        r0 = cuda.blockIdx.x * ROWS
        t0 = cuda.blockIdx.y * TOKENS
        n, cols = x.shape
        xs = cuda.shared.array((K_STEP, TOKENS_PAD), np.float32)
        ws = cuda.shared.array((K_STEP, ROWS_PAD), np.float32)
        acc = cuda.local.array((4, 4), np.float32)
        a = cuda.local.array(4, np.float32)
        b = cuda.local.array(4, np.float32)
        for i in range(4):
            for j in range(4):
                acc[i, j] = np.float32(0)
        kk = tid % K_STEP  # X staging: column kk of tokens tid // 32 + 8 i
        w_row = tid // 4  # W staging: 8 columns (part w_part) of row w_row
        w_part = tid % 4
        for k0 in range(0, cols, K_STEP):
            for i in range(TOKENS * K_STEP // THREADS):
                tt = tid // K_STEP + i * (THREADS // K_STEP)
                inside = t0 + tt < n and k0 + kk < cols
                xs[kk, tt] = x[t0 + tt, k0 + kk] if inside else np.float32(0)
            stage_w(codes, scale, bias, block_log2, rows, r0 + w_row, k0, w_part, ws, w_row)
            cuda.syncthreads()
            for k in range(K_STEP):
                for i in range(4):
                    a[i] = xs[k, ty * 4 + i]
                    b[i] = ws[k, tx * 4 + i]
                for i in range(4):
                    for j in range(4):
                        acc[i, j] += a[i] * b[j]
            cuda.syncthreads()
        for i in range(4):
            t = t0 + ty * 4 + i
            for j in range(4):
                r = r0 + tx * 4 + j
                if t < n and r < rows:
                    out[t, r] = acc[i, j]

    kernel.__name__ = kernel.__qualname__ = f"_matmul_{kind}"
    return cuda.jit(kernel)


@cuda.jit(device=True, inline=True)
def _stage_q4(words, scale, bias, block_log2, rows, r, k0, part, ws, c):
    """Columns of word `part` of row r's 32-block at k0 (4 low nibbles: k 4p.., 4 high: 16 + 4p..)."""
    if r < rows:
        b = k0 >> 5
        w = words[r, 4 * b + part]
        s = scale[r, b]
        m = bias[r, b]
        low = w & LOW_NIBBLES
        high = (w >> np.uint32(4)) & LOW_NIBBLES
        for j in range(4):
            shift = np.uint32(8 * j)
            ws[4 * part + j, c] = s * np.float32((low >> shift) & np.uint32(0xFF)) + m
            ws[16 + 4 * part + j, c] = s * np.float32((high >> shift) & np.uint32(0xFF)) + m
    else:
        for j in range(4):
            ws[4 * part + j, c] = np.float32(0)
            ws[16 + 4 * part + j, c] = np.float32(0)


@cuda.jit(device=True, inline=True)
def _stage_q8(words, scale, bias, block_log2, rows, r, k0, part, ws, c):
    """Columns 8 part .. 8 part + 7 of row r at k0 (two words of signed bytes)."""
    if r < rows:
        blk = (k0 + 8 * part) >> block_log2
        s = scale[r, blk]
        m = bias[r, blk]
        for h in range(2):
            w = words[r, (k0 >> 2) + 2 * part + h]
            for j in range(4):
                byte = np.int32((w >> np.uint32(8 * j)) & np.uint32(0xFF))
                ws[8 * part + 4 * h + j, c] = s * np.float32(byte - ((byte & 0x80) << 1)) + m
    else:
        for j in range(8):
            ws[8 * part + j, c] = np.float32(0)


@cuda.jit(device=True, inline=True)
def _stage_f32(w, scale, bias, block_log2, rows, r, k0, part, ws, c):
    for j in range(8):
        k = k0 + 8 * part + j
        ws[8 * part + j, c] = w[r, k] if r < rows and k < w.shape[1] else np.float32(0)


_KERNELS = {kind: _make_matmul(kind, stage) for kind, stage in (("q4", _stage_q4), ("q8", _stage_q8),
                                                            ("f32", _stage_f32))}


def matmul(w: DeviceMatrix, x, out, stream=0) -> None:
    """out[n, rows] = x[n, cols] @ W.T."""
    grid = (blocks(w.rows, ROWS), blocks(x.shape[0], TOKENS))
    _KERNELS[w.kind][grid, THREADS, stream](w.codes, w.scale, w.bias, w.block_log2, w.rows, x, out)
