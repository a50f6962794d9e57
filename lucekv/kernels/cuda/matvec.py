"""Decode products y = W @ x with W a PackedMatrix kept quantized on the GPU (see kernels.cpu.quants).

One warp per output row, ROWS_PER_BLOCK rows per block. Codes are read as uint32 words, so a warp's 32
lanes load 128 consecutive bytes per step (coalesced): for q4 that is 8 blocks of 32 elements, for q8 4 or
8 blocks. Each lane folds its word into `scale * sum(code * x) + bias * sum(x)`, so the bias costs no
separate pass. Several tokens (a short batch) run as grid rows of the same kernel.
"""

from __future__ import annotations

import numpy as np

from lucekv.kernels.cuda._numba import WARP, blocks, cuda, warp_sum
from lucekv.kernels.cuda.packed import DeviceMatrix

ROWS_PER_BLOCK = 4


def matvec(w: DeviceMatrix, x, out, stream=0) -> None:
    """out[n, rows] = x[n, cols] @ W.T, weights streamed once per token (use for n of 1 to a few)."""
    grid = (blocks(w.rows, ROWS_PER_BLOCK), x.shape[0])
    threads = ROWS_PER_BLOCK * WARP
    if w.kind == "q4":
        _matvec_q4[grid, threads, stream](w.codes, w.scale, w.bias, x, out)
    elif w.kind == "q8":
        _matvec_q8[grid, threads, stream](w.codes, w.scale, w.bias, w.block_log2 - 2, x, out)
    else:
        _matvec_f32[grid, threads, stream](w.codes, x, out)


@cuda.jit(device=True, inline=True)
def _warp_row():
    """(row, lane) of this thread; rows past the end do no loads but still join the warp reduction."""
    return cuda.blockIdx.x * ROWS_PER_BLOCK + cuda.threadIdx.x // WARP, cuda.threadIdx.x % WARP


@cuda.jit
def _matvec_q4(words, scale, bias, x, out):
    # a 32-block is 4 words; word k of a block holds bytes 4k..4k+3, whose low nibbles are elements
    # 4k..4k+3 and high nibbles elements 16+4k..16+4k+3
    r, lane = _warp_row()
    t = cuda.blockIdx.y
    n_words = words.shape[1] if r < words.shape[0] else 0
    acc = np.float32(0)
    for i in range(lane, n_words, WARP):
        b = i >> 2
        e = b * 32 + (i & 3) * 4
        word = words[r, i]
        dot = np.float32(0)
        xs = np.float32(0)
        for j in range(4):
            byte = (word >> np.uint32(8 * j)) & np.uint32(0xFF)
            xl = x[t, e + j]
            xh = x[t, e + 16 + j]
            dot += np.float32(byte & np.uint32(15)) * xl + np.float32(byte >> np.uint32(4)) * xh
            xs += xl + xh
        acc += scale[r, b] * dot + bias[r, b] * xs
    acc = warp_sum(acc)
    if lane == 0 and r < words.shape[0]:
        out[t, r] = acc


@cuda.jit
def _matvec_q8(words, scale, bias, words_per_block_log2, x, out):
    r, lane = _warp_row()
    t = cuda.blockIdx.y
    n_words = words.shape[1] if r < words.shape[0] else 0
    acc = np.float32(0)
    for i in range(lane, n_words, WARP):
        b = i >> words_per_block_log2
        e = i * 4
        word = words[r, i]
        dot = np.float32(0)
        xs = np.float32(0)
        for j in range(4):
            byte = np.int32((word >> np.uint32(8 * j)) & np.uint32(0xFF))
            xv = x[t, e + j]
            dot += np.float32(byte - ((byte & 0x80) << 1)) * xv  # the byte as int8
            xs += xv
        acc += scale[r, b] * dot + bias[r, b] * xs
    acc = warp_sum(acc)
    if lane == 0 and r < words.shape[0]:
        out[t, r] = acc


@cuda.jit
def _matvec_f32(w, x, out):
    r, lane = _warp_row()
    t = cuda.blockIdx.y
    cols = w.shape[1] if r < w.shape[0] else 0
    acc = np.float32(0)
    for k in range(lane, cols, WARP):
        acc += w[r, k] * x[t, k]
    acc = warp_sum(acc)
    if lane == 0 and r < w.shape[0]:
        out[t, r] = acc
