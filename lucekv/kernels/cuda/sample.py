"""Greedy sampling on the GPU: argmax of each row of logits, so only token ids cross to the host."""

from __future__ import annotations

import numpy as np

from lucekv.kernels.cuda._numba import NEG_INF, cuda

THREADS = 256


def argmax(logits, out, stream=0) -> None:
    """out[i] = the first index of the largest value of logits[i] (numpy's tie rule); out int32 [n]."""
    _argmax[logits.shape[0], THREADS, stream](logits, out)


@cuda.jit
def _argmax(logits, out):
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    best_v = cuda.shared.array(THREADS, np.float32)
    best_i = cuda.shared.array(THREADS, np.int32)
    v = NEG_INF
    idx = np.int32(0x7FFFFFFF)
    for k in range(tid, logits.shape[1], THREADS):
        x = logits[row, k]
        if x > v:  # strided scan: the first maximum of this thread's elements
            v = x
            idx = np.int32(k)
    best_v[tid] = v
    best_i[tid] = idx
    cuda.syncthreads()
    step = THREADS // 2
    while step > 0:
        if tid < step:
            ov = best_v[tid + step]
            oi = best_i[tid + step]
            if ov > best_v[tid] or (ov == best_v[tid] and oi < best_i[tid]):
                best_v[tid] = ov
                best_i[tid] = oi
        cuda.syncthreads()
        step //= 2
    if tid == 0:
        out[row] = best_i[0]
