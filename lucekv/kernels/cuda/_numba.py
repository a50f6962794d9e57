"""The one module that imports numba.cuda; every CUDA kernel module takes `cuda` from here.

Compatibility shims live here and nowhere else:
- numba-cuda 0.30 still calls `np.row_stack`, which numpy 2.4 removed: alias it before the import.
- numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, used by CI) has no warp shuffles. Kernels reduce across
  a warp through `warp_sum` / `warp_max`; on the GPU these are shuffle butterflies, in the simulator they
  exchange values through a block-wide scratch array between two barriers. So in the simulator a warp
  reduction is a block barrier: kernels call them in block-uniform control flow (every thread of the
  block, the same number of times), which they do anyway to stay free of divergence.
- Bandwidth-bound kernels need three instructions numba does not expose, so they get inline PTX here and
  plain Python twins in the simulator: `load_u32x4` (16 bytes per lane in one `ld.global.nc.v4.u32`; numba
  cannot prove the alignment that would let the compiler merge four word loads), `load_f32` (a read-only
  load without numba's negative-index wraparound arithmetic) and `exponent_byte` (one `prmt`: a code byte
  becomes the float 2^23 + byte, no int-to-float conversion).
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
    # plain functions: they touch no `cuda` state, and simulated device-function calls are slow
    def load_u32x4(words, r, c):
        return words[r, c], words[r, c + 1], words[r, c + 2], words[r, c + 3]

    def load_f32(a, r, c):
        return a[r, c]

    def exponent_byte(word, j):
        return np.float32(2 ** 23 + ((int(word) >> (8 * j)) & 0xFF))

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
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    I32 = ir.IntType(32)

    def _global_nc_load(builder, context, sig, args, ptx: str, results: list):
        """Inline `ptx` reading the element at (row, col) of the 2-D array in args (no wraparound)."""
        array_type = sig.args[0]
        array = context.make_array(array_type)(context, builder, value=args[0])
        index = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:], strict=True)]
        ptr = cgutils.get_item_pointer(context, builder, array_type, array, index)
        out_type = ir.LiteralStructType(results) if len(results) > 1 else results[0]
        constraints = ",".join(["=f" if r == ir.FloatType() else "=r" for r in results] + ["l"])
        return builder.call(ir.InlineAsm(ir.FunctionType(out_type, [ptr.type]), ptx, constraints), [ptr])

    @intrinsic
    def load_u32x4(typingctx, words, r, c):
        """words[r, c:c+4] of a C-contiguous uint32 matrix, c a multiple of 4 (rows 16-byte aligned)."""
        def codegen(context, builder, sig, args):
            ptx = "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];"
            loaded = _global_nc_load(builder, context, sig, args, ptx, [I32] * 4)
            values = [builder.extract_value(loaded, i) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, values)

        return types.UniTuple(types.uint32, 4)(words, r, c), codegen

    @intrinsic
    def load_f32(typingctx, a, r, c):
        """a[r, c] of a float32 matrix that no kernel writes while this one runs, r and c non-negative."""
        def codegen(context, builder, sig, args):
            ptx = "ld.global.nc.f32 $0, [$1];"
            return _global_nc_load(builder, context, sig, args, ptx, [ir.FloatType()])

        return types.float32(a, r, c), codegen

    @intrinsic
    def exponent_byte(typingctx, word, j):
        """float32 2^23 + byte j of `word`: the byte under the exponent bits 0x4B (j a constant 0..3)."""
        def codegen(context, builder, sig, args):
            w = context.cast(builder, args[0], sig.args[0], types.uint32)
            j = context.cast(builder, args[1], sig.args[1], types.uint32)
            selector = builder.add(ir.Constant(I32, 0x7540), j)  # bytes: j, 0x00, 0x00, 0x4B
            prmt = ir.InlineAsm(ir.FunctionType(I32, [I32] * 3), "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")
            bits = builder.call(prmt, [w, ir.Constant(I32, 0x4B000000), selector])
            return builder.bitcast(bits, ir.FloatType())

        return types.float32(word, j), codegen

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
