"""The one module that imports numba.cuda; every CUDA kernel module takes `cuda` from here.

Compatibility shims live here and nowhere else:
- numba-cuda 0.30 still calls `np.row_stack`, which numpy 2.4 removed: alias it before the import.
- numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, used by CI) has no warp shuffles. Kernels reduce across
  a warp through `warp_sum` / `warp_max`; on the GPU these are shuffle butterflies, in the simulator they
  exchange values through a block-wide scratch array between two barriers (`warp_sum` then adds them in the
  butterfly's order and type, as the GPU does). So in the simulator a warp
  reduction is a block barrier: kernels call them in block-uniform control flow (every thread of the
  block, the same number of times), which they do anyway to stay free of divergence. The same holds for
  `warp_broadcast` (lane `src`'s value to every lane).
- Bandwidth-bound kernels need instructions numba does not expose, so they get inline PTX here and plain
  Python twins in the simulator: `load_u32x4` / `load_f32x4` (16 bytes per lane in one `ld.global.v4`;
  numba cannot prove the alignment that would let the compiler merge four word loads). `load_u32x4` reads
  weights, through the non-coherent path (`.nc`); `load_f32x4` and `load_u32x4_coherent` read what another
  kernel wrote (activations) and stay coherent: ptxas takes `.nc` data as constant for the kernel's whole life and
  moves such loads above `griddepcontrol.wait` (seen in sm_90 SASS), where under overlapped launches
  (below) they read the grid before's output before it is written. `dot4_u8s8` / `dot4_s8s8`
  (`dp4a`: four byte products summed into an int32 in one instruction), `half2_floats` / `bits_f32`
  (words of a K/V tile, staged as raw 32-bit words, back to floats), `f32_bits` (a float's bits as an int32: the
  MoE top-k's sort keys), and `load4` / `store4` / `load1`
  (1-D array elements, four at a time in 16-byte accesses, without the wraparound arithmetic: in
  unrolled shared-memory loops that arithmetic is most of the instructions). `load_f32x4_l2` reads 16 bytes at L2
  (`ld.global.cg`): the partial sums that other blocks of the same grid wrote (a last block's reduce).
- Tensor cores: `mma_f16_16816` is one warp-wide `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`
  (operands as words of two float16, low half first, in the PTX ISA's fragment layout); its simulator twin
  gathers the warp's fragments through a scratch array between barriers, like the reductions above (so it
  too is called in block-uniform control flow). `pack_half2` (two float32 to one word of float16),
  `sub_f16x2` and `fma_f16x2` (halfwise float16 a - b, a * b + c) build the operand words. `load_matrix_x4` is
  `ldmatrix.sync.aligned.m8n8.x4.shared.b16`: four 8 x 8 float16 matrices of a 3-D shared array, matrix m's rows
  at the addresses of lanes 8m .. 8m + 7, into one word per matrix and lane (lane l: row l // 4, word l % 4, as
  mma's fragments want them), and `store_u32x4` its staging stores (four words of a row of such an array in one
  16-byte store); the ldmatrix twin swaps the lanes' addresses through a scratch array between barriers, as
  `mma_f16_16816`'s does (block-uniform control flow again). `warp_shfl_xor` is lane
  `lane ^ lane_mask`'s value (a reduction over a few neighbouring lanes).
- Integer tensor cores: `mma_s8_16832` is `mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32` (operands as words of
  four int8, lowest byte first; int32 C and D), `mma_s8_16816` its k16 shape (half the operands: a 16-column block
  of its own); their twins exchange fragments as `mma_f16_16816`'s does (block-uniform control flow). `mad_s32` is
  a * b + c in 32 bits (`mad.lo.s32`: numba's own int32 arithmetic widens to 64 bits). `prefetch_l1` brings the
  line of a 2-D array's element into L1 (`prefetch.global.L1`: no register waits for it; the simulator's does
  nothing).
- Asynchronous copies (sm_80+): `copy_async16` puts 16 bytes of a global matrix into shared memory without
  passing through registers (`cp.async.cg`), `copy_async_commit` closes a group of them, `copy_async_wait_all`
  / `copy_async_wait_one` wait until none / at most the latest group is still in flight; a barrier after the
  wait makes every thread's copies visible to the block. So a kernel copies its next tile while it computes on
  this one. In the simulator the copy is immediate and the commit and waits do nothing. The destination is
  any C-contiguous shared array, indexed in its flat order (a 3-D tile that ldmatrix then reads).
- `load_matrix_x4_trans` is `load_matrix_x4` with `.trans`: each 8 x 8 matrix transposed on the way, so a lane
  holds two rows' halves of one column (a B fragment of P V from V's rows as stored); its twin shares the
  other's exchange. `exp2_approx` is `ex2.approx.ftz.f32` (one MUFU instruction; math.exp2 compiles to the
  same with denormal handling around it): a softmax's weights, where a denormal is as good as 0.
- Overlapped launches (sm_90+): every kernel begins with `await_grid()`, `griddepcontrol.wait` (wait until the
  grid this one depends on has finished and its writes are visible) then `griddepcontrol.launch_dependents` (the
  next grid may be launched now). Outside a programmatic dependency both do nothing; inside one (the edges of a
  captured decode graph, `backends.cuda`) the next kernel's blocks are launched and made resident while this
  one's last blocks still run, instead of after them. Nothing that a kernel writes is read before the wait, so
  the overlap can never see stale data: only the decode products read before it, their first rows of weights
  (constant), so that those loads run during the kernel before. Every read of an activation is an ordinary
  (coherent) load, which the compilers keep after the wait. Before sm_90 it compiles to nothing.
- Kernels compile through `jit_kernel` / `jit_bounded` (launch bounds, which the simulator does not accept), which
  keep their compiled code on disk (numba-cuda's cache: __pycache__ beside the source, or NUMBA_CACHE_DIR), so a
  restart loads what an earlier process compiled instead of compiling it again (minutes at the 8B shape). numba
  keys an entry by the kernel's signature, the device, numba-cuda's version, its bytecode and its closure pickled;
  that pickle holds a random id for every intrinsic reached through the closure (`@intrinsic`'s uuid), so a factory's
  kernels would never be found again, and nothing outside the kernel's own file invalidates it. `KernelCache` keys
  by what decides the code instead: the digest of every kernel source file (`kernel_sources_digest`) and the values
  the closure captures (`closure_key`), so two kernels of one factory differ where their parameters do. `jit_inlined`:
  a device function inlined by NVVM (an option the simulator does not accept either); device functions are compiled
  into the kernels that call them, never cached apart.
"""

from __future__ import annotations

import functools
import hashlib
import math
import threading
import types as pytypes
from pathlib import Path

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import config, cuda  # noqa: E402  (after the alias above)

SIMULATOR: bool = bool(config.ENABLE_CUDASIM)
# `alignment=` for shared arrays read by load4 / store4 (the simulator refuses the argument: None there)
ALIGN_16 = None if SIMULATOR else 16
WARP = 32
FULL_MASK = 0xFFFFFFFF
NEG_INF = np.float32(-math.inf)
AWAIT_GRID_PTX = "griddepcontrol.wait; griddepcontrol.launch_dependents;"  # `await_grid` on sm_90+


def available() -> bool:
    """True when kernels can run: a CUDA GPU, or the simulator."""
    return SIMULATOR or cuda.is_available()


if SIMULATOR:
    # plain functions: they touch no `cuda` state, and simulated device-function calls are slow
    def load_u32x4(words, r, c):
        return words[r, c], words[r, c + 1], words[r, c + 2], words[r, c + 3]

    def load_f32x4(a, r, c):
        return a[r, c], a[r, c + 1], a[r, c + 2], a[r, c + 3]

    load_u32x4_coherent = load_f32x4

    def load_f32x4_l2(a, k, r, c):
        return a[k, r, c], a[k, r, c + 1], a[k, r, c + 2], a[k, r, c + 3]

    def half2_floats(word):
        h = np.array([int(word)], np.uint32).view(np.float16)
        return np.float32(h[0]), np.float32(h[1])

    def bits_f32(word):
        return np.array([int(word)], np.uint32).view(np.float32)[0]

    def f32_bits(v):
        return np.array([v], np.float32).view(np.int32)[0]

    def load4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    def store4(a, i, v0, v1, v2, v3):
        a[i], a[i + 1], a[i + 2], a[i + 3] = v0, v1, v2, v3

    def load1(a, i):
        return a[i]

    def store_u32x4(tile, b, r, c, v0, v1, v2, v3):
        tile[b, r, c], tile[b, r, c + 1], tile[b, r, c + 2], tile[b, r, c + 3] = v0, v1, v2, v3

    def copy_async16(tile, i, words, r, c):
        tile.reshape(-1)[i : i + 4] = words[r, c], words[r, c + 1], words[r, c + 2], words[r, c + 3]

    def copy_async_commit():
        pass

    def copy_async_wait_all():
        pass

    def copy_async_wait_one():
        pass

    def await_grid():
        pass

    def exp2_approx(x):
        return np.float32(np.exp2(np.float32(x)))

    def _bytes(word, signed):
        return [((int(word) >> (8 * j)) & 0xFF) - (256 if signed and (int(word) >> (8 * j)) & 0x80 else 0)
                for j in range(4)]

    def dot4_u8s8(a, b, c):
        return np.int32(int(c) + sum(x * y for x, y in zip(_bytes(a, False), _bytes(b, True), strict=True)))

    def dot4_s8s8(a, b, c):
        return np.int32(int(c) + sum(x * y for x, y in zip(_bytes(a, True), _bytes(b, True), strict=True)))

    _SCRATCH = 1024  # the most threads a block may have

    def _thread_index():
        """This thread's index in its block, x fastest."""
        return cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)

    def _warp_reduce(v, op):
        scratch = cuda.shared.array(_SCRATCH, np.float64)  # one array for every call: barriers guard it
        t = _thread_index()
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

    def _butterfly_sum(v):
        """The warp's sum of v as the GPU's `warp_sum` adds it (v += lane ^ offset's v, offsets 16 down to 1, in v's
        type): kernels may rely on sums equal bit for bit to that butterfly's (matvec's several-token kernels)."""
        scratch = cuda.shared.array(_SCRATCH, np.float64)
        t = _thread_index()
        cuda.syncthreads()
        scratch[t] = v
        cuda.syncthreads()
        first = t - t % WARP
        lanes = np.zeros(WARP, np.asarray(v).dtype)  # lanes past the block's threads add nothing
        last = min(first + WARP, cuda.blockDim.x * cuda.blockDim.y * cuda.blockDim.z)
        lanes[: last - first] = scratch[first:last]
        cuda.syncthreads()
        for offset in (16, 8, 4, 2, 1):
            lanes = lanes + lanes[np.arange(WARP) ^ offset]
        return type(v)(lanes[t - first])

    # device functions, so that the simulator swaps its per-launch `cuda` (threadIdx, shared) in here too
    @cuda.jit(device=True)
    def warp_sum(v):
        return _butterfly_sum(v)

    @cuda.jit(device=True)
    def warp_max(v):
        return _warp_reduce(v, max)

    def _lane_value(v, source):
        """Lane source(t)'s v for thread t, exchanged through a block-wide scratch array between barriers."""
        scratch = cuda.shared.array(_SCRATCH, np.float64)
        t = _thread_index()
        cuda.syncthreads()
        scratch[t] = v
        cuda.syncthreads()
        out = scratch[source(t)]
        cuda.syncthreads()
        return type(v)(out)

    @cuda.jit(device=True)
    def warp_shfl_xor(v, lane_mask):
        return _lane_value(v, lambda t: t ^ lane_mask)

    def pack_half2(lo, hi):
        return np.array([lo, hi], np.float16).view(np.uint32)[0]

    def sub_f16x2(a, b):
        h = np.array([int(a), int(b)], np.uint32).view(np.float16)
        return np.array([h[0] - h[2], h[1] - h[3]], np.float16).view(np.uint32)[0]

    def fma_f16x2(a, b, c):
        h = np.array([int(a), int(b), int(c)], np.uint32).view(np.float16).astype(np.float64)
        return np.array([h[0] * h[2] + h[4], h[1] * h[3] + h[5]], np.float16).view(np.uint32)[0]

    def _mma_layout():
        """(row, col) of each fragment element per lane, as the PTX ISA gives them for mma.m16n8k16 with f16
        operands: A's a0..a7 (element i in register i // 2), B's b0..b3, C's / D's c0..c3."""
        lane = np.arange(WARP)[:, None]
        group, in_group = lane >> 2, lane % 4
        i = np.arange(8)[None, :]
        a = (group + 8 * ((i >> 1) & 1), 2 * in_group + (i & 1) + 8 * (i >= 4))
        i = np.arange(4)[None, :]
        b = (2 * in_group + (i & 1) + 8 * (i >= 2), np.broadcast_to(group, (WARP, 4)))
        c = (group + 8 * (i >= 2), 2 * in_group + (i & 1))
        return a, b, c

    _MMA_A, _MMA_B, _MMA_C = _mma_layout()
    _EXCHANGE_WORDS = 6  # the most words a thread hands the block's others in one `_exchange` (mma's operands)
    _exchange_thread = threading.local()

    def _exchange(*words):
        """This thread's words (unsigned 32-bit) where every thread of the block reads them, for the twins of
        warp-wide instructions: (the block's rows of words [thread, _EXCHANGE_WORDS], this thread's row).
        Two buffers, used in turn, need one barrier per call: a call's reads of a buffer end before the next call's
        barrier, and only the call after that writes the buffer again (so every call is made in block-uniform
        control flow). A simulated thread lives for one block: its thread-local state holds the block's scratch
        (fetched once: shared.array is slow, and tells its arrays apart by the line asking, this one for every
        twin) and its count of calls."""
        mine = _exchange_thread
        if getattr(mine, "calls", None) is None:
            mine.scratch, mine.calls = cuda.shared.array((2, _SCRATCH, _EXCHANGE_WORDS), np.uint32), 0
        buffer = mine.scratch[mine.calls % 2]
        mine.calls += 1
        t = _thread_index()
        buffer[t, : len(words)] = words
        cuda.syncthreads()
        return buffer, t

    @cuda.jit(device=True)
    def mma_f16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        buffer, t = _exchange(a0, a1, a2, a3, b0, b1)
        first = t - t % WARP
        halves = buffer[first:first + WARP].view(np.float16).astype(np.float64)  # [lane, 12 halves]
        a = np.zeros((16, 16))
        a[_MMA_A] = halves[:, :8]
        b = np.zeros((16, 8))
        b[_MMA_B] = halves[:, 8:]
        d = (a @ b)[_MMA_C[0][t - first], _MMA_C[1][t - first]] + np.array([c0, c1, c2, c3], np.float64)
        return np.float32(d[0]), np.float32(d[1]), np.float32(d[2]), np.float32(d[3])

    def _warp_matrices(tile, b, r, c):
        """The four 8 x 8 float16 matrices the warp's lanes address (matrix m's rows at lanes 8m .. 8m + 7), as
        uint16 [4, 8, 8], and this thread's lane."""
        buffer, t = _exchange(b, r, c)  # every lane's address
        first = t - t % WARP
        rows = np.empty((4, 8, 4), np.uint32)
        for lane in range(WARP):
            mb, mr, mc = buffer[first + lane, :3]
            rows[lane // 8, lane % 8] = tile[mb, mr, mc : mc + 4]
        return rows.view(np.uint16), t % WARP

    def _lane_words(matrices, lane):
        """Lane's word of each matrix: row lane // 4, word lane % 4."""
        words = np.ascontiguousarray(matrices).view(np.uint32)[:, lane // 4, lane % 4]
        return words[0], words[1], words[2], words[3]

    def _mma_s8_layout(k: int):
        """(row, col) of each byte of the fragments per lane, as the PTX ISA gives them for mma.m16n8k32 (k 32) and
        mma.m16n8k16 (k 16) with s8 operands: A's bytes (word i // 4, byte i % 4), B's likewise; C / D as f16's."""
        lane = np.arange(WARP)[:, None]
        group, in_group = lane >> 2, lane % 4
        i = np.arange(k // 2)[None, :]  # A: k / 8 words of 4 bytes
        a = (group + 8 * ((i >> 2) & 1), 4 * in_group + (i & 3) + 16 * (i >= 8))
        i = np.arange(k // 4)[None, :]
        b = (4 * in_group + (i & 3) + 16 * (i >= 4), np.broadcast_to(group, (WARP, k // 4)))
        return a, b

    _MMA_S8 = {k: _mma_s8_layout(k) for k in (16, 32)}

    def _mma_s8(k, words, cs):
        """D = A B + C of the warp's s8 fragments (this thread's words: A's k / 8, then B's k / 16), in int64 then
        wrapped to int32 as the hardware's adds wrap."""
        buffer, t = _exchange(*words)
        first = t - t % WARP
        lanes = buffer[first:first + WARP, : len(words)].copy().view(np.int8).astype(np.int64)  # [lane, bytes]
        (a_at, b_at), split = _MMA_S8[k], k // 2
        a = np.zeros((16, k), np.int64)
        a[a_at] = lanes[:, :split]
        b = np.zeros((k, 8), np.int64)
        b[b_at] = lanes[:, split:]
        d = (a @ b)[_MMA_C[0][t - first], _MMA_C[1][t - first]] + np.array(cs, np.int64)
        d = d.astype(np.int32)
        return d[0], d[1], d[2], d[3]

    def mad_s32(a, b, c):
        return np.int32(((int(a) * int(b) + int(c) + 2**31) % 2**32) - 2**31)

    def prefetch_l1(a, r, c):
        pass

    @cuda.jit(device=True)
    def mma_s8_16832(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma_s8(32, (a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3))

    @cuda.jit(device=True)
    def mma_s8_16816(a0, a1, b0, c0, c1, c2, c3):
        return _mma_s8(16, (a0, a1, b0), (c0, c1, c2, c3))

    @cuda.jit(device=True)
    def load_matrix_x4(tile, b, r, c):
        return _lane_words(*_warp_matrices(tile, b, r, c))

    @cuda.jit(device=True)
    def load_matrix_x4_trans(tile, b, r, c):
        matrices, lane = _warp_matrices(tile, b, r, c)
        return _lane_words(matrices.transpose(0, 2, 1), lane)

    @cuda.jit(device=True)
    def warp_broadcast(v, src):
        return _lane_value(v, lambda t: t - t % WARP + src)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    I32 = ir.IntType(32)

    def _global_load(builder, context, sig, args, ptx: str, results: list, constant: bool):
        """Inline `ptx` reading the element at (row, col) of the 2-D array in args (no wraparound). Unless the data
        is `constant`, the asm counts as a side effect, so that LLVM keeps it after `await_grid`'s (it does not
        see the asm read memory)."""
        array_type = sig.args[0]
        array = context.make_array(array_type)(context, builder, value=args[0])
        index = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:], strict=True)]
        ptr = cgutils.get_item_pointer(context, builder, array_type, array, index)
        out_type = ir.LiteralStructType(results) if len(results) > 1 else results[0]
        constraints = ",".join(["=f" if r == ir.FloatType() else "=r" for r in results] + ["l"])
        asm = ir.InlineAsm(ir.FunctionType(out_type, [ptr.type]), ptx, constraints, side_effect=not constant)
        return builder.call(asm, [ptr])

    @intrinsic
    def load_u32x4(typingctx, words, r, c):
        """words[r, c:c+4] of a C-contiguous uint32 matrix of weights (constant: non-coherent load), c a multiple
        of 4 (rows 16-byte aligned)."""
        def codegen(context, builder, sig, args):
            ptx = "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];"
            loaded = _global_load(builder, context, sig, args, ptx, [I32] * 4, constant=True)
            values = [builder.extract_value(loaded, i) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, values)

        return types.UniTuple(types.uint32, 4)(words, r, c), codegen

    @intrinsic
    def load_f32x4(typingctx, a, r, c):
        """a[r, c:c+4] of a C-contiguous float32 matrix, c a multiple of 4 (rows 16-byte aligned): a coherent
        load, for data a kernel before this one wrote (see the module's notes)."""
        def codegen(context, builder, sig, args):
            ptx = "ld.global.v4.f32 {$0, $1, $2, $3}, [$4];"
            loaded = _global_load(builder, context, sig, args, ptx, [ir.FloatType()] * 4, constant=False)
            values = [builder.extract_value(loaded, i) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, values)

        return types.UniTuple(types.float32, 4)(a, r, c), codegen

    @intrinsic
    def load_u32x4_coherent(typingctx, words, r, c):
        """words[r, c:c+4] of a C-contiguous uint32 matrix that a kernel before this one wrote (coherent, as
        load_f32x4), c a multiple of 4 (rows 16-byte aligned)."""
        def codegen(context, builder, sig, args):
            ptx = "ld.global.v4.u32 {$0, $1, $2, $3}, [$4];"
            loaded = _global_load(builder, context, sig, args, ptx, [I32] * 4, constant=False)
            values = [builder.extract_value(loaded, i) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, values)

        return types.UniTuple(types.uint32, 4)(words, r, c), codegen

    @intrinsic
    def load_f32x4_l2(typingctx, a, k, r, c):
        """a[k, r, c:c+4] of a C-contiguous 3-D float32 array, c a multiple of 4 (rows 16-byte aligned), read at L2
        (`ld.global.cg`): what other blocks of this grid wrote before a fence, never a stale line of this SM's L1."""
        def codegen(context, builder, sig, args):
            ptx = "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];"
            loaded = _global_load(builder, context, sig, args, ptx, [ir.FloatType()] * 4, constant=False)
            values = [builder.extract_value(loaded, i) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, values)

        return types.UniTuple(types.float32, 4)(a, k, r, c), codegen

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
    def f32_bits(typingctx, v):
        """The bits of the float32 `v` as an int32 (`bits_f32` backwards): for v >= 0 they order as the floats do."""
        def codegen(context, builder, sig, args):
            return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.float32), I32)

        return types.int32(v), codegen

    def _item_pointer(context, builder, sig, args):
        """Pointer to a[i] of the 1-D array a (args[0], args[1]) without numba's negative-index wraparound."""
        array_type = sig.args[0]
        array = context.make_array(array_type)(context, builder, value=args[0])
        i = context.cast(builder, args[1], sig.args[1], types.intp)
        return cgutils.get_item_pointer(context, builder, array_type, array, [i])

    def _vector_pointer(context, builder, sig, args):
        vector = ir.VectorType(context.get_value_type(sig.args[0].dtype), 4)
        return builder.bitcast(_item_pointer(context, builder, sig, args), vector.as_pointer()), vector

    @intrinsic
    def load4(typingctx, a, i):
        """a[i:i+4] of a 1-D array in one 16-byte load: i a multiple of 4, the data 16-byte aligned."""
        def codegen(context, builder, sig, args):
            ptr, vector = _vector_pointer(context, builder, sig, args)
            loaded = builder.load(ptr, align=16, typ=vector)
            values = [builder.extract_element(loaded, ir.Constant(I32, j)) for j in range(4)]
            return context.make_tuple(builder, sig.return_type, values)

        return types.UniTuple(a.dtype, 4)(a, i), codegen

    @intrinsic
    def store4(typingctx, a, i, v0, v1, v2, v3):
        """a[i:i+4] = v0..v3 in one 16-byte store: i a multiple of 4, the data 16-byte aligned."""
        def codegen(context, builder, sig, args):
            ptr, vector = _vector_pointer(context, builder, sig, args)
            packed = ir.Constant(vector, ir.Undefined)
            for j, (v, t) in enumerate(zip(args[2:], sig.args[2:], strict=True)):
                packed = builder.insert_element(packed, context.cast(builder, v, t, sig.args[0].dtype),
                                                ir.Constant(I32, j))
            builder.store(packed, ptr, align=16)
            return context.get_dummy_value()

        return types.none(a, i, v0, v1, v2, v3), codegen

    @intrinsic
    def load1(typingctx, a, i):
        """a[i] of a 1-D array, i non-negative (no wraparound arithmetic)."""
        def codegen(context, builder, sig, args):
            return builder.load(_item_pointer(context, builder, sig, args))

        return a.dtype(a, i), codegen

    @intrinsic
    def copy_async16(typingctx, tile, i, words, r, c):
        """Start copying words[r, c:c+4] (a C-contiguous uint32 matrix in global memory, c a multiple of 4, rows
        16-byte aligned) to elements i .. i + 3 of tile in flat order (a 16-byte aligned, C-contiguous shared array,
        i a multiple of 4)."""
        def codegen(context, builder, sig, args):
            # element i of the tile in flat order (any C-contiguous array)
            tile = context.make_array(sig.args[0])(context, builder, value=args[0])
            dst = builder.gep(tile.data, [context.cast(builder, args[1], sig.args[1], types.intp)])
            words_type = sig.args[2]
            array = context.make_array(words_type)(context, builder, value=args[2])
            index = [context.cast(builder, v, t, types.intp) for v, t in zip(args[3:], sig.args[3:], strict=True)]
            src = cgutils.get_item_pointer(context, builder, words_type, array, index)
            ptx = ("{ .reg .u64 a; .reg .u32 s; cvta.to.shared.u64 a, $0; cvt.u32.u64 s, a; "
                   "cp.async.cg.shared.global [s], [$1], 16; }")
            fn = ir.FunctionType(ir.VoidType(), [dst.type, src.type])
            builder.call(ir.InlineAsm(fn, ptx, "l,l,~{memory}", side_effect=True), [dst, src])
            return context.get_dummy_value()

        return types.none(tile, i, words, r, c), codegen

    def _control(ptx: str):
        def codegen(context, builder, sig, args):
            # a memory clobber: the compiler may move no memory access across it
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), ptx, "~{memory}", side_effect=True), [])
            return context.get_dummy_value()

        return types.none(), codegen

    @intrinsic
    def copy_async_commit(typingctx):
        """Close the group of this thread's copies started since the last commit."""
        return _control("cp.async.commit_group;")

    @intrinsic
    def copy_async_wait_all(typingctx):
        """Wait until every copy this thread started has landed."""
        return _control("cp.async.wait_all;")

    @intrinsic
    def copy_async_wait_one(typingctx):
        """Wait until at most this thread's latest committed group is still in flight."""
        return _control("cp.async.wait_group 1;")

    @intrinsic
    def await_grid(typingctx):
        """Wait for the grid this kernel depends on, then let the one after it launch (see the module's notes)."""
        return _control(AWAIT_GRID_PTX if overlapped_launches() else "")

    @intrinsic
    def exp2_approx(typingctx, x):
        """2 ** x in float32 by the special function unit (ex2.approx.ftz: about 2 ulp, denormals flushed to 0)."""
        def codegen(context, builder, sig, args):
            f = ir.FloatType()
            value = context.cast(builder, args[0], sig.args[0], types.float32)
            return builder.call(ir.InlineAsm(ir.FunctionType(f, [f]), "ex2.approx.ftz.f32 $0, $1;", "=f,f"), [value])

        return types.float32(x), codegen

    @intrinsic
    def pack_half2(typingctx, lo, hi):
        """A word of two float16 (round to nearest): lo in the low half, hi in the high half."""
        def codegen(context, builder, sig, args):
            f = ir.FloatType()
            values = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args, strict=True)]
            # cvt.rn.f16x2.f32 d, a, b puts a in the upper half
            asm = ir.InlineAsm(ir.FunctionType(I32, [f, f]), "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f")
            return builder.call(asm, values)

        return types.uint32(lo, hi), codegen

    @intrinsic
    def sub_f16x2(typingctx, a, b):
        """Halfwise a - b of two words of two float16 each."""
        def codegen(context, builder, sig, args):
            values = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args, strict=True)]
            asm = ir.InlineAsm(ir.FunctionType(I32, [I32, I32]), "sub.rn.f16x2 $0, $1, $2;", "=r,r,r")
            return builder.call(asm, values)

        return types.uint32(a, b), codegen

    @intrinsic
    def fma_f16x2(typingctx, a, b, c):
        """Halfwise a * b + c of three words of two float16 each, rounded once."""
        def codegen(context, builder, sig, args):
            values = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args, strict=True)]
            asm = ir.InlineAsm(ir.FunctionType(I32, [I32] * 3), "fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r")
            return builder.call(asm, values)

        return types.uint32(a, b, c), codegen

    @intrinsic
    def mma_f16_16816(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A B + C for the warp: A 16 x 16 (row-major fragments a0..a3), B 16 x 8 (column-major fragments
        b0, b1), both float16 pairs in uint32 words; C and D 16 x 8 float32 (PTX ISA fragment layout)."""
        def codegen(context, builder, sig, args):
            f = ir.FloatType()
            words = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[:6], sig.args[:6], strict=True)]
            floats = [context.cast(builder, v, t, types.float32) for v, t in zip(args[6:], sig.args[6:], strict=True)]
            ptx = ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                   "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
            constraints = ",".join(["=f"] * 4 + ["r"] * 6 + ["f"] * 4)
            fn = ir.FunctionType(ir.LiteralStructType([f] * 4), [I32] * 6 + [f] * 4)
            # side effects: a warp-synchronous instruction that the compiler must neither drop nor move
            d = builder.call(ir.InlineAsm(fn, ptx, constraints, side_effect=True), words + floats)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(d, i) for i in range(4)])

        return types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen

    def _mma_s8_codegen(shape: str, n_words: int):
        def codegen(context, builder, sig, args):
            values = [context.cast(builder, v, t, types.int32) for v, t in zip(args, sig.args, strict=True)]
            a, b = (n_words * 2) // 3, n_words // 3  # A's words, B's words (6 -> 4 + 2, 3 -> 2 + 1)
            names = iter(f"${i}" for i in range(4 + n_words + 4))
            d, ra, rb, c = ([next(names) for _ in range(k)] for k in (4, a, b, 4))
            ptx = (f"mma.sync.aligned.{shape}.row.col.s32.s8.s8.s32 "
                   + ", ".join("{" + ", ".join(regs) + "}" for regs in (d, ra, rb, c)) + ";")
            constraints = ",".join(["=r"] * 4 + ["r"] * (n_words + 4))
            fn = ir.FunctionType(ir.LiteralStructType([I32] * 4), [I32] * (n_words + 4))
            # side effects: warp-synchronous, as mma_f16_16816
            out = builder.call(ir.InlineAsm(fn, ptx, constraints, side_effect=True), values)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(out, i) for i in range(4)])

        return codegen

    @intrinsic
    def prefetch_l1(typingctx, a, r, c):
        """Bring the line holding a[r, c] of a 2-D global array into L1 (one prefetch.global.L1; r, c in bounds)."""
        def codegen(context, builder, sig, args):
            array = context.make_array(sig.args[0])(context, builder, value=args[0])
            index = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:], strict=True)]
            ptr = cgutils.get_item_pointer(context, builder, sig.args[0], array, index)
            fn = ir.FunctionType(ir.VoidType(), [ptr.type])
            builder.call(ir.InlineAsm(fn, "prefetch.global.L1 [$0];", "l", side_effect=True), [ptr])
            return context.get_dummy_value()

        return types.none(a, r, c), codegen

    @intrinsic
    def mad_s32(typingctx, a, b, c):
        """a * b + c of three int32, wrapped to 32 bits (one mad.lo.s32)."""
        def codegen(context, builder, sig, args):
            values = [context.cast(builder, v, t, types.int32) for v, t in zip(args, sig.args, strict=True)]
            return builder.call(ir.InlineAsm(ir.FunctionType(I32, [I32] * 3), "mad.lo.s32 $0, $1, $2, $3;",
                                             "=r,r,r,r"), values)

        return types.int32(a, b, c), codegen

    @intrinsic
    def mma_s8_16832(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A B + C for the warp: A 16 x 32 (row-major fragments a0..a3), B 32 x 8 (column-major b0, b1), words
        of four int8 (lowest byte first); C and D 16 x 8 int32 (PTX ISA fragment layout)."""
        sig = types.UniTuple(types.int32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        return sig, _mma_s8_codegen("m16n8k32", 6)

    @intrinsic
    def mma_s8_16816(typingctx, a0, a1, b0, c0, c1, c2, c3):
        """`mma_s8_16832` with k 16: A 16 x 16 (a0, a1), B 16 x 8 (b0)."""
        return types.UniTuple(types.int32, 4)(a0, a1, b0, c0, c1, c2, c3), _mma_s8_codegen("m16n8k16", 3)

    def _load_matrices(ptx: str):
        """Codegen of an ldmatrix .x4 (`ptx`, its operands {$0..$3}, [$4]) from the address of tile[b, r, c]."""
        def codegen(context, builder, sig, args):
            tile_type = sig.args[0]
            array = context.make_array(tile_type)(context, builder, value=args[0])
            index = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:], strict=True)]
            ptr = cgutils.get_item_pointer(context, builder, tile_type, array, index)
            # the 32-bit shared address, computed where LLVM sees it: the cast folds into the shared array's own
            # address space, so that a base register plus constant offsets remain
            shared = builder.addrspacecast(ptr, ir.PointerType(I32, addrspace=3))
            address = builder.trunc(builder.ptrtoint(shared, ir.IntType(64)), I32)
            fn = ir.FunctionType(ir.LiteralStructType([I32] * 4), [I32])
            # reads what other threads stored before a barrier: a memory clobber keeps it after the barrier and
            # every loop iteration's load its own
            loaded = builder.call(ir.InlineAsm(fn, ptx, "=r,=r,=r,=r,r,~{memory}", side_effect=True), [address])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(loaded, i) for i in range(4)])

        return codegen

    @intrinsic
    def load_matrix_x4(typingctx, tile, b, r, c):
        """ldmatrix .x4 for the warp: this lane's word of each of four 8 x 8 float16 matrices, whose rows (8
        float16, 16 bytes) start at tile[b, r, c] of lanes 8m .. 8m + 7 for matrix m. tile: a uint32 shared array
        [., ., words], 16-byte aligned, c a multiple of 4 and the row stride a multiple of 4 words."""
        return (types.UniTuple(types.uint32, 4)(tile, b, r, c),
                _load_matrices("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];"))

    @intrinsic
    def load_matrix_x4_trans(typingctx, tile, b, r, c):
        """`load_matrix_x4` of the four matrices transposed: lane l's word of matrix m holds column l // 4 of
        stored rows 2 (l % 4) (low half) and 2 (l % 4) + 1."""
        return (types.UniTuple(types.uint32, 4)(tile, b, r, c),
                _load_matrices("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];"))

    @intrinsic
    def store_u32x4(typingctx, tile, b, r, c, v0, v1, v2, v3):
        """tile[b, r, c:c+4] = v0..v3 in one 16-byte store: tile a 3-D uint32 array, 16-byte aligned, c and the row
        stride multiples of 4."""
        def codegen(context, builder, sig, args):
            tile_type = sig.args[0]
            array = context.make_array(tile_type)(context, builder, value=args[0])
            index = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:4], sig.args[1:4], strict=True)]
            ptr = cgutils.get_item_pointer(context, builder, tile_type, array, index)
            vector = ir.VectorType(I32, 4)
            packed = ir.Constant(vector, ir.Undefined)
            for j, (v, t) in enumerate(zip(args[4:], sig.args[4:], strict=True)):
                packed = builder.insert_element(packed, context.cast(builder, v, t, types.uint32), ir.Constant(I32, j))
            builder.store(packed, builder.bitcast(ptr, vector.as_pointer()), align=16)
            return context.get_dummy_value()

        return types.none(tile, b, r, c, v0, v1, v2, v3), codegen

    @cuda.jit(device=True, inline=True)
    def warp_shfl_xor(v, lane_mask):
        return cuda.shfl_xor_sync(FULL_MASK, v, lane_mask)

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


@cuda.jit(device=True, inline=True)
def block_sum(v, sums):
    """v summed over the block, for every thread (warp by warp, then the warps' sums in order); `sums` holds one value
    per warp (shared)."""
    v = warp_sum(v)
    cuda.syncthreads()  # every thread has read what an earlier call left in `sums`
    if cuda.threadIdx.x % WARP == 0:
        sums[cuda.threadIdx.x // WARP] = v
    cuda.syncthreads()
    total = np.float32(0)
    for k in range(cuda.blockDim.x // WARP):
        total += sums[k]
    return total


def overlapped_launches() -> bool:
    """Whether kernels compiled for the current device take part in programmatic dependent launches (sm_90+).
    Asked through numba's dispatcher, which compiles for that device."""
    from numba.cuda import dispatcher

    return not SIMULATOR and dispatcher.get_current_device().compute_capability >= (9, 0)


def jit_kernel(kernel):
    """cuda.jit for a kernel, its compiled code kept on disk (see the module's notes)."""
    return _cached(kernel, None)


def jit_bounded(kernel, threads: int, blocks_per_sm: int):
    """`jit_kernel` with launch bounds: at most `threads` per block, registers left for `blocks_per_sm` resident
    blocks. The simulator takes no launch bounds (and has no registers to bound)."""
    return _cached(kernel, (threads, blocks_per_sm))


KERNELS: list = []  # every kernel made by jit_kernel / jit_bounded (kernel_cache_counts reads their caches)


def _cached(kernel, bounds: tuple[int, int] | None):
    if SIMULATOR:  # it compiles nothing: nothing to keep
        return cuda.jit(kernel)
    dispatcher = cuda.jit(kernel) if bounds is None else cuda.jit(kernel, launch_bounds=bounds)
    key = closure_key(kernel)
    if key is not None:  # else compiled in every process, as before
        dispatcher._cache = KernelCache(kernel, (bounds, key))
    KERNELS.append(dispatcher)
    return dispatcher


def kernel_cache_counts() -> tuple[int, int]:
    """(loaded from the disk cache, compiled) kernel signatures in this process so far."""
    stats = [k.stats for k in KERNELS]
    return sum(sum(s.cache_hits.values()) for s in stats), sum(sum(s.cache_misses.values()) for s in stats)


KERNEL_SOURCES = Path(__file__).resolve().parents[1]  # lucekv/kernels: the CUDA kernels and the code they read


@functools.cache
def kernel_sources_digest() -> str:
    """SHA-256 of every source file under lucekv/kernels: a change to any of them (an intrinsic's PTX here, an
    epilogue in packed.py) recompiles every kernel, where numba's own check sees the kernel's file alone."""
    h = hashlib.sha256()
    for path in sorted(KERNEL_SOURCES.rglob("*.py")):
        h.update(str(path.relative_to(KERNEL_SOURCES)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


class _NoKey(Exception):
    """A closure holds a value `closure_key` cannot describe."""


def closure_key(fn) -> tuple | None:
    """A description of the values fn's closure captures, the same in every process for the same values, or None
    where one is no plain value (the kernel is then not cached). Functions, device functions and intrinsics are named
    by module and qualified name (their code is in `kernel_sources_digest`; a function's bytecode is hashed too) with
    their own closures described."""
    try:
        return _describe(fn)
    except (_NoKey, RecursionError):
        return None


def _describe(v):
    if v is None or isinstance(v, (bool, int, float, str, bytes, np.generic)):
        return type(v).__name__, repr(v)
    if isinstance(v, tuple):  # NamedTuples too
        return type(v).__qualname__, tuple(_describe(x) for x in v)
    if isinstance(v, list):
        return "list", tuple(_describe(x) for x in v)
    if isinstance(v, dict):
        return "dict", tuple(sorted((repr(k), _describe(x)) for k, x in v.items()))
    if isinstance(v, (set, frozenset)):
        return "set", tuple(sorted(repr(_describe(x)) for x in v))
    if isinstance(v, np.dtype):
        return "dtype", v.str
    if isinstance(v, np.ndarray):
        return "ndarray", v.dtype.str, v.shape, hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
    if isinstance(v, pytypes.FunctionType):  # its bytecode too (as numba's key), for one defined outside the digest
        cells = tuple(_describe(c.cell_contents) for c in v.__closure__ or ())
        code = hashlib.sha256(v.__code__.co_code).hexdigest()
        return "function", v.__module__, v.__qualname__, code, cells, _describe(v.__defaults__)
    if isinstance(v, pytypes.ModuleType):
        return "module", v.__name__
    if isinstance(v, type):
        return "type", v.__module__, v.__qualname__
    py_func = getattr(v, "py_func", None)  # a jitted function (the simulator's: `fn`)
    if py_func is None and isinstance(getattr(v, "fn", None), pytypes.FunctionType):
        py_func = v.fn
    if py_func is not None:
        return "jit", _describe(py_func)
    defn = getattr(v, "_defn", None)  # an @intrinsic
    if isinstance(defn, pytypes.FunctionType):
        return "intrinsic", defn.__module__, defn.__qualname__
    raise _NoKey(type(v).__qualname__)


if not SIMULATOR:
    import numba_cuda
    from numba.cuda.dispatcher import CUDACache

    class KernelCache(CUDACache):
        """numba-cuda's disk cache of one kernel (file names, locations, staleness by the kernel file's time stamp,
        the saved cubins: all numba's), keyed by `key` and the kernel sources' digest instead of the pickled
        closure (see the module's notes). key: the launch bounds and the closure's `closure_key`."""

        def __init__(self, kernel, key: tuple):
            self._key = hashlib.sha256(repr(key).encode()).hexdigest()  # the index holds it: a digest, not the tree
            super().__init__(kernel)

        def _index_key(self, sig, codegen):
            key = (sig, codegen.magic_tuple(), numba_cuda.__version__, kernel_sources_digest(), self._key)
            launch_config = getattr(self, "_launch_config_key", None)  # as CUDACache's, for kernels that read it
            return key if launch_config is None else (*key, ("launch_config", launch_config))


def jit_inlined(fn):
    """A device function that the GPU compiler inlines (NVVM's alwaysinline): numba types it once per signature,
    where its own inlining (`inline=True`) types a callee again at every call site, which for the several-token
    matvec's unrolled calls took minutes. The simulator takes no such option."""
    return cuda.jit(fn, device=True) if SIMULATOR else cuda.jit(fn, device=True, forceinline=True)


@functools.cache
def sm_count() -> int:
    """Multiprocessors of the current device (1 in the simulator)."""
    return 1 if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT


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


def ordering_event():
    """An event for stream order only (no timing: cheaper to record). The simulator's events take no options."""
    return cuda.event() if SIMULATOR else cuda.event(timing=False)
