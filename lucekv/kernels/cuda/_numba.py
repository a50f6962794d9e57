"""The one module that imports numba.cuda; every CUDA kernel module takes `cuda` from here.

Compatibility shims live here and nowhere else:
- numba-cuda 0.30 still calls `np.row_stack`, which numpy 2.4 removed: alias it before the import.
- numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, used by CI) has no warp shuffles. Kernels reduce across
  a warp through `warp_sum` / `warp_max`; on the GPU these are shuffle butterflies, in the simulator they
  exchange values through a block-wide scratch array between two barriers. So in the simulator a warp
  reduction is a block barrier: kernels call them in block-uniform control flow (every thread of the
  block, the same number of times), which they do anyway to stay free of divergence. The same holds for
  `warp_broadcast` (lane `src`'s value to every lane).
- Bandwidth-bound kernels need instructions numba does not expose, so they get inline PTX here and plain
  Python twins in the simulator: `load_u32x4` / `load_f32x4` (16 bytes per lane in one `ld.global.nc.v4`;
  numba cannot prove the alignment that would let the compiler merge four word loads), `load_f32` (a
  read-only load without numba's negative-index wraparound arithmetic), `dot4_u8s8` / `dot4_s8s8`
  (`dp4a`: four byte products summed into an int32 in one instruction), and `half2_floats` / `bits_f32`
  (words of a K/V tile, staged as raw 32-bit words, back to floats).
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

    def load_f32x4(a, r, c):
        return a[r, c], a[r, c + 1], a[r, c + 2], a[r, c + 3]

    def load_f32(a, r, c):
        return a[r, c]

    def half2_floats(word):
        h = np.array([int(word)], np.uint32).view(np.float16)
        return np.float32(h[0]), np.float32(h[1])

    def bits_f32(word):
        return np.array([int(word)], np.uint32).view(np.float32)[0]

    def _bytes(word, signed):
        return [((int(word) >> (8 * j)) & 0xFF) - (256 if signed and (int(word) >> (8 * j)) & 0x80 else 0)
                for j in range(4)]

    def dot4_u8s8(a, b, c):
        return np.int32(int(c) + sum(x * y for x, y in zip(_bytes(a, False), _bytes(b, True), strict=True)))

    def dot4_s8s8(a, b, c):
        return np.int32(int(c) + sum(x * y for x, y in zip(_bytes(a, True), _bytes(b, True), strict=True)))

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

    @cuda.jit(device=True)
    def warp_broadcast(v, src):
        scratch = cuda.shared.array(_SCRATCH, np.float64)
        t = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        cuda.syncthreads()
        scratch[t] = v
        cuda.syncthreads()
        out = scratch[t - t % WARP + src]
        cuda.syncthreads()
        return type(v)(out)

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
    def load_f32x4(typingctx, a, r, c):
        """a[r, c:c+4] of a C-contiguous float32 matrix that no kernel writes while this one runs, c a multiple
        of 4 (rows 16-byte aligned)."""
        def codegen(context, builder, sig, args):
            ptx = "ld.global.nc.v4.f32 {$0, $1, $2, $3}, [$4];"
            loaded = _global_nc_load(builder, context, sig, args, ptx, [ir.FloatType()] * 4)
            values = [builder.extract_value(loaded, i) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, values)

        return types.UniTuple(types.float32, 4)(a, r, c), codegen

    def _dp4a(ptx: str):
        def codegen(context, builder, sig, args):
            values = [context.cast(builder, v, t, types.int32) for v, t in zip(args, sig.args, strict=True)]
            return builder.call(ir.InlineAsm(ir.FunctionType(I32, [I32] * 3), ptx, "=r,r,r,r"), values)

        return codegen

    @intrinsic
    def dot4_u8s8(typingctx, a, b, c):
        """c + the sum of the 4 products of a's unsigned bytes and b's signed bytes (int32, one dp4a)."""
        return types.int32(a, b, c), _dp4a("dp4a.u32.s32 $0, $1, $2, $3;")

    @intrinsic
    def dot4_s8s8(typingctx, a, b, c):
        """c + the sum of the 4 products of a's and b's signed bytes (int32, one dp4a)."""
        return types.int32(a, b, c), _dp4a("dp4a.s32.s32 $0, $1, $2, $3;")

    @intrinsic
    def half2_floats(typingctx, word):
        """The two float16 halves of a uint32 word as float32 (low half first)."""
        def codegen(context, builder, sig, args):
            ptx = "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }"
            w = context.cast(builder, args[0], sig.args[0], types.uint32)
            f = ir.FloatType()
            pair = builder.call(ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([f, f]), [I32]), ptx, "=f,=f,r"),
                                [w])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(pair, i) for i in range(2)])

        return types.UniTuple(types.float32, 2)(word), codegen

    @intrinsic
    def bits_f32(typingctx, word):
        """The float32 whose bits are the uint32 `word`."""
        def codegen(context, builder, sig, args):
            return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.uint32), ir.FloatType())

        return types.float32(word), codegen

    @intrinsic
    def load_f32(typingctx, a, r, c):
        """a[r, c] of a float32 matrix that no kernel writes while this one runs, r and c non-negative."""
        def codegen(context, builder, sig, args):
            ptx = "ld.global.nc.f32 $0, [$1];"
            return _global_nc_load(builder, context, sig, args, ptx, [ir.FloatType()])

        return types.float32(a, r, c), codegen

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

    @cuda.jit(device=True, inline=True)
    def warp_broadcast(v, src):
        return cuda.shfl_sync(FULL_MASK, v, src)


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
