"""RMSNorm over groups of a row: groups=1 is the usual norm, groups=n_heads the per-head q/k norm."""

from __future__ import annotations

import math

import numpy as np

from lucekv.kernels.cuda._numba import WARP, cuda, warp_sum


def rmsnorm(x, w, eps: float, groups: int, out, stream=0) -> None:
    """out[t, g*d:(g+1)*d] = x[t, ...] / rms * w for each token t and group g of width d = len(w)."""
    _rmsnorm[(x.shape[0], groups), WARP, stream](x, w, np.float32(eps), out)


@cuda.jit
def _rmsnorm(x, w, eps, out):
    # one warp per (token, group)
    t = cuda.blockIdx.x
    d = w.shape[0]
    g0 = cuda.blockIdx.y * d
    lane = cuda.threadIdx.x
    ss = np.float32(0)
    for i in range(lane, d, WARP):
        v = x[t, g0 + i]
        ss += v * v
    ss = warp_sum(ss)
    inv = np.float32(1) / math.sqrt(ss / np.float32(d) + eps)
    for i in range(lane, d, WARP):
        out[t, g0 + i] = x[t, g0 + i] * inv * w[i]
