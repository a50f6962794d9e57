"""RMSNorm over groups of a row: groups=1 is the usual norm, groups=n_heads the per-head q/k norm.

One block per (token, group). Each thread loads its (at most PER_THREAD) elements into registers with
all loads issued at once, so a norm costs about one memory latency: a single warp walking a 4096-wide
row paid one per 32 elements (measured: 60 us per norm on an H100), a block looping over it one per pass.
"""

from __future__ import annotations

import math

import numpy as np

from lucekv.kernels.cuda._numba import WARP, await_grid, blocks, cuda, jit_kernel, warp_sum

MAX_THREADS = 1024
MAX_WARPS = MAX_THREADS // WARP
PER_THREAD = 8  # rows up to 8192 wide in registers; wider ones (none known) are read twice


def rmsnorm(x, w, eps: float, groups: int, out, stream=0) -> None:
    """out[t, g*d:(g+1)*d] = x[t, ...] / rms * w for each token t and group g of width d = len(w)."""
    threads = min(MAX_THREADS, blocks(blocks(w.shape[0], PER_THREAD // 2), WARP) * WARP)
    _rmsnorm[(x.shape[0], groups), threads, stream](x, w, np.float32(eps), out)


@jit_kernel
def _rmsnorm(x, w, eps, out):
    await_grid()
    t = cuda.blockIdx.x
    d = w.shape[0]
    g0 = cuda.blockIdx.y * d
    tid = cuda.threadIdx.x
    step = cuda.blockDim.x
    sums = cuda.shared.array(MAX_WARPS, np.float32)
    v = cuda.local.array(PER_THREAD, np.float32)
    for j in range(PER_THREAD):
        i = tid + j * step
        v[j] = x[t, g0 + i] if i < d else np.float32(0)
    ss = np.float32(0)
    for j in range(PER_THREAD):
        ss += v[j] * v[j]
    for i in range(tid + PER_THREAD * step, d, step):
        ss += x[t, g0 + i] * x[t, g0 + i]
    ss = warp_sum(ss)
    if tid % WARP == 0:
        sums[tid // WARP] = ss
    cuda.syncthreads()
    total = np.float32(0)
    for k in range(step // WARP):
        total += sums[k]
    inv = np.float32(1) / math.sqrt(total / np.float32(d) + eps)
    for j in range(PER_THREAD):
        i = tid + j * step
        if i < d:
            out[t, g0 + i] = v[j] * inv * w[i]
    for i in range(tid + PER_THREAD * step, d, step):
        out[t, g0 + i] = x[t, g0 + i] * inv * w[i]
