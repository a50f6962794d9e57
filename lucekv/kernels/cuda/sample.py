"""Greedy sampling on the GPU: argmax of each row of logits, so only token ids cross to the host.

A row is split across BLOCKS blocks (one block alone streams a 150K-token vocabulary at one SM's bandwidth:
measured 12 us on an H200 step). Each block writes its best (value, index) pair; the last block of the row to
finish (a counter, reset by that block) picks the best of those and writes the answer: one launch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from lucekv.kernels.cuda._numba import NEG_INF, SIMULATOR, await_grid, cuda, jit_kernel, load_f32x4

# (the simulator runs threads one by one, and pays for every barrier)
THREADS = 64 if SIMULATOR else 256
BLOCKS = 2 if SIMULATOR else 64  # per row: ~2 16-byte loads per thread at 150K columns
NO_INDEX = np.int32(0x7FFFFFFF)


class ArgmaxScratch(NamedTuple):
    """Per row: each block's best value and index, and the count of blocks done (zero between launches)."""

    values: object
    indices: object
    done: object


def argmax_scratch(rows: int, stream=0) -> ArgmaxScratch:
    return ArgmaxScratch(cuda.device_array((rows, BLOCKS), np.float32, stream=stream),
                         cuda.device_array((rows, BLOCKS), np.int32, stream=stream),
                         cuda.to_device(np.zeros(rows, np.int32), stream=stream))


def argmax(logits, n: int, out, scratch: ArgmaxScratch, stream=0) -> None:
    """out[i] = the first index of the largest of logits[i, :n] (numpy's tie rule); out int32 [rows]."""
    _argmax[(BLOCKS, logits.shape[0]), THREADS, stream](logits, n, scratch.values, scratch.indices, scratch.done,
                                                         out)


@cuda.jit(device=True, inline=True)
def _better(v, i, best_v, best_i):
    return v > best_v or (v == best_v and i < best_i)


@cuda.jit(device=True, inline=True)
def _block_best(v, i):
    """The best (value, first index) of the block's pairs: a tree over shared memory."""
    tid = cuda.threadIdx.x
    best_v = cuda.shared.array(THREADS, np.float32)
    best_i = cuda.shared.array(THREADS, np.int32)
    best_v[tid] = v
    best_i[tid] = i
    cuda.syncthreads()
    step = THREADS // 2
    while step > 0:
        if tid < step and _better(best_v[tid + step], best_i[tid + step], best_v[tid], best_i[tid]):
            best_v[tid] = best_v[tid + step]
            best_i[tid] = best_i[tid + step]
        cuda.syncthreads()
        step //= 2
    return best_v[0], best_i[0]


@jit_kernel
def _argmax(logits, n, part_v, part_i, done, out):
    # thread g of the row's grid scans columns in increasing order, keeping its first maximum: runs of 4 at 4g,
    # 4(g + G), ... (16-byte loads where rows are 16-byte aligned), then the columns past the last whole run
    await_grid()
    row = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    g = cuda.blockIdx.x * THREADS + tid
    grid = cuda.gridDim.x * THREADS
    v = NEG_INF
    i = NO_INDEX
    runs_end = n // 4 * 4 if logits.shape[1] % 4 == 0 else 0
    for c in range(4 * g, runs_end, 4 * grid):
        a0, a1, a2, a3 = load_f32x4(logits, row, c)
        if a0 > v:
            v, i = a0, np.int32(c)
        if a1 > v:
            v, i = a1, np.int32(c + 1)
        if a2 > v:
            v, i = a2, np.int32(c + 2)
        if a3 > v:
            v, i = a3, np.int32(c + 3)
    for c in range(runs_end + g, n, grid):
        x = logits[row, c]
        if x > v:
            v, i = x, np.int32(c)
    v, i = _block_best(v, i)
    last = cuda.shared.array(1, np.int32)
    if tid == 0:
        part_v[row, cuda.blockIdx.x] = v
        part_i[row, cuda.blockIdx.x] = i
        cuda.threadfence()  # the pair is visible to every block before this one counts as done
        last[0] = cuda.atomic.add(done, row, 1) == cuda.gridDim.x - 1
    cuda.syncthreads()
    if last[0]:
        v, i = (part_v[row, tid], part_i[row, tid]) if tid < cuda.gridDim.x else (NEG_INF, NO_INDEX)
        v, i = _block_best(v, i)
        if tid == 0:
            out[row] = i if i != NO_INDEX else 0  # every value -inf: numpy's answer
            done[row] = 0
