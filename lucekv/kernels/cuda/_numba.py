"""The one module that imports numba.cuda; every CUDA kernel module takes `cuda` from here.

Two compatibility shims live here and nowhere else:
- numba-cuda 0.30 still calls `np.row_stack`, which numpy 2.4 removed: alias it before the import.
- numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, used by CI) has no warp shuffles. Kernels reduce across
  a warp through `warp_sum` / `warp_max`; on the GPU these are shuffle butterflies, in the simulator they
  exchange values through a block-wide scratch array between two barriers. So in the simulator a warp
  reduction is a block barrier: kernels call them in block-uniform control flow (every thread of the
  block, the same number of times), which they do anyway to stay free of divergence.
"""

from __future__ import annotations

import math

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import config, cuda  # noqa: E402  (after the alias above)

SIMULATOR: bool = bool(config.ENABLE_CUDASIM)
WARP = 32
FULL_MASK = 0xFFFFFFFF
NEG_INF = np.float32(-math.inf)


def available() -> bool:
    """True when kernels can run: a CUDA GPU, or the simulator."""
    return SIMULATOR or cuda.is_available()


if SIMULATOR:
    _SCRATCH = 1024  # the most threads a block may have

    def _warp_reduce(v, op):
        scratch = cuda.shared.array(_SCRATCH, np.float64)  # one array for every call: barriers guard it
        t = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        cuda.syncthreads()
        scratch[t] = v
        cuda.syncthreads()
        first = t - t % WARP
        last = min(first + WARP, cuda.blockDim.x * cuda.blockDim.y * cuda.blockDim.z)
        acc = scratch[first]
        for i in range(first + 1, last):
            acc = op(acc, scratch[i])
        cuda.syncthreads()
        return type(v)(acc)

    # device functions, so that the simulator swaps its per-launch `cuda` (threadIdx, shared) in here too
    @cuda.jit(device=True)
    def warp_sum(v):
        return _warp_reduce(v, lambda a, b: a + b)

    @cuda.jit(device=True)
    def warp_max(v):
        return _warp_reduce(v, max)

else:

    @cuda.jit(device=True, inline=True)
    def warp_sum(v):
        for offset in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(FULL_MASK, v, offset)
        return v

    @cuda.jit(device=True, inline=True)
    def warp_max(v):
        for offset in (16, 8, 4, 2, 1):
            v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, offset))
        return v


def blocks(n: int, per_block: int) -> int:
    """Blocks of `per_block` items covering n items."""
    return (n + per_block - 1) // per_block


def device_zeros(shape: tuple[int, ...], dtype, stream=0):
    """A zero-filled device array, filled on the device (a KV pool can be gigabytes)."""
    if SIMULATOR:
        return cuda.to_device(np.zeros(shape, dtype), stream=stream)
    from numba.cuda.cudadrv.driver import device_memset

    a = cuda.device_array(shape, dtype, stream=stream)
    device_memset(a, 0, a.nbytes, stream=stream)
    return a
