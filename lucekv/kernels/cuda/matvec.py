"""Decode products y = W @ x with W a PackedMatrix kept quantized on the GPU (see kernels.cpu.quants).

Decode reads every weight byte once per token, so these kernels are built to stream HBM:
- Lanes own columns, not rows. Lane `l` of warp `w` owns 32 columns of a 1024-column segment; it holds
  those 32 x values in registers and walks the block's rows, loading per row one 16-byte word of q4 codes
  (one whole 32-block) or two of q8 codes, with the (scale, bias) pairs of its columns. A warp's loads of
  one row are 512 (q4) or 2 x 512 (q8) consecutive bytes, and each x value is reused for every row.
- A block has one warp per segment (more segments than MAX_WARPS take several passes) and handles
  `rows_per_block` rows, ROWS_IN_FLIGHT at a time: all their loads are issued before any is used, the
  first group's before x is staged, so that the weights' latency overlaps x's.
- x reaches the registers through shared memory, written coalesced and read back per lane; element j of
  a lane sits at 32 * j + ((lane + j) % 32), so both sides hit 32 distinct banks.
- Each row's partial dot products are summed across the warp (shuffles), then across the warps through
  shared memory: no atomics, one plain store per output.
- Codes become floats by the exponent trick (one byte permute puts a code byte under the exponent bits
  0x4B: the float 2^23 + code, exact; subtract 2^23) instead of int-to-float conversions, whose
  throughput is an eighth of an FMA's.
Bias costs no pass of its own: a column block contributes `scale * sum(code * x) + bias * sum(x)`, and
no bytes when the matrix has none (DeviceMatrix.has_bias).
Several tokens (a short batch) run as grid rows of the same kernel.
"""

from __future__ import annotations

import functools

import numpy as np
from numba.cuda import types as numba_types

from lucekv.kernels.cuda._numba import (
    SIMULATOR,
    WARP,
    blocks,
    cuda,
    exponent_byte,
    load_f32,
    load_u32x4,
    warp_sum,
)
from lucekv.kernels.cuda.packed import DeviceMatrix

SEGMENT = WARP * 32  # columns per warp and pass: 32 per lane
MAX_WARPS = 8  # x staging then takes at most 32 KiB of shared memory
MAX_ROWS_PER_BLOCK = 64
PARTIALS = MAX_WARPS * MAX_ROWS_PER_BLOCK  # one float per (warp, row) of a block
ROWS_IN_FLIGHT = {"q4": 8, "q8": 4}  # equal register footprints: 8 x (16 + 8) bytes, 4 x (32 + 16)
WARPS_PER_SM_TARGET = 8  # resident warps per SM the grid aims at: each keeps ~6 KiB of loads in flight
F32_ROWS_PER_BLOCK = 4
F32 = numba_types.float32  # the simulator sizes dynamic shared arrays from a numba type, not np.float32
LOW_NIBBLES, SIGN_BITS = np.uint32(0x0F0F0F0F), np.uint32(0x80808080)
Q4_OFFSET = np.float32(2 ** 23)
Q8_OFFSET = np.float32(2 ** 23 + 128)  # int8 code c is stored flipped: byte ^ 0x80 = c + 128


def matvec(w: DeviceMatrix, x, out, stream=0) -> None:
    """out[n, rows] = x[n, cols] @ W.T, weights streamed once per token (use for n of 1 to a few)."""
    if w.kind == "f32":
        grid = (blocks(w.rows, F32_ROWS_PER_BLOCK), x.shape[0])
        _matvec_f32[grid, F32_ROWS_PER_BLOCK * WARP, stream](w.codes, x, out)
        return
    segments = blocks(w.cols, SEGMENT)
    n_pass = blocks(segments, MAX_WARPS)
    n_warps = blocks(segments, n_pass)
    rows_per_block = _rows_per_block(w.rows, n_warps, ROWS_IN_FLIGHT[w.kind])
    grid = (blocks(w.rows, rows_per_block), x.shape[0])
    launch = (grid, n_warps * WARP, stream, n_warps * SEGMENT * 4)  # dynamic shared memory: staged x
    if w.kind == "q4":
        _matvec_q4[launch](w.codes, w.scale, w.bias, w.has_bias, x, out, n_pass, rows_per_block)
    else:
        _matvec_q8[launch](w.codes, w.scale, w.bias, w.has_bias, w.block_log2 - 4, x, out, n_pass,
                           rows_per_block)


def _rows_per_block(rows: int, n_warps: int, in_flight: int) -> int:
    """Rows per block: as many as keep the grid at WARPS_PER_SM_TARGET warps per SM (fewer blocks load x
    fewer times), a multiple of `in_flight`."""
    share = rows * n_warps // (_sm_count() * WARPS_PER_SM_TARGET)
    return min(max(share // in_flight, 1) * in_flight, MAX_ROWS_PER_BLOCK)


@functools.cache
def _sm_count() -> int:
    return 1 if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT


# ---- shared pieces: x staging, cross-warp sums ------------------------------------------------------------


@cuda.jit(device=True, inline=True)
def _q4_owner(k):
    """(lane, register) holding column k of a segment for q4: lane l owns columns 32l .. 32l + 31."""
    return k >> 5, k & 31


@cuda.jit(device=True, inline=True)
def _q8_owner(k):
    """q8: lane l owns the 16-column chunks l and l + 32 of the segment (registers 0..15 and 16..31)."""
    return (k & 511) >> 4, ((k >> 9) << 4) | (k & 15)


def _make_stage(owner):
    @cuda.jit(device=True, inline=True)
    def stage(x, t, first_col, xs, xr):
        """x[t, first_col:] of every warp's segment into shared memory, then this lane's 32 into xr."""
        n_warps = cuda.blockDim.x // WARP
        cols = x.shape[1]
        cuda.syncthreads()  # the previous pass has read xs
        for i in range(cuda.threadIdx.x, n_warps * SEGMENT, cuda.blockDim.x):
            c = first_col + i
            lane, j = owner(i % SEGMENT)
            xs[i - i % SEGMENT + 32 * j + ((lane + j) & 31)] = x[t, c] if c < cols else np.float32(0)
        cuda.syncthreads()
        base = (cuda.threadIdx.x // WARP) * SEGMENT
        lane = cuda.threadIdx.x % WARP
        for j in range(32):
            xr[j] = xs[base + 32 * j + ((lane + j) & 31)]

    return stage


_stage_q4 = _make_stage(_q4_owner)
_stage_q8 = _make_stage(_q8_owner)


@cuda.jit(device=True, inline=True)
def _add_row(part, i, v):
    """Warp-sum v, the partial of the block's row i, into this warp's slot of `part`."""
    v = warp_sum(v)
    if cuda.threadIdx.x % WARP == 0:
        part[(cuda.threadIdx.x // WARP) * MAX_ROWS_PER_BLOCK + i] += v


@cuda.jit(device=True, inline=True)
def _clear_partials(part):
    for i in range(cuda.threadIdx.x, MAX_WARPS * MAX_ROWS_PER_BLOCK, cuda.blockDim.x):
        part[i] = np.float32(0)


@cuda.jit(device=True, inline=True)
def _store_rows(part, first_row, rows_per_block, out, t):
    cuda.syncthreads()
    n_warps = cuda.blockDim.x // WARP
    for i in range(cuda.threadIdx.x, rows_per_block, cuda.blockDim.x):
        if first_row + i < out.shape[1]:
            acc = np.float32(0)
            for w in range(n_warps):
                acc += part[w * MAX_ROWS_PER_BLOCK + i]
            out[t, first_row + i] = acc


# ---- q4 -------------------------------------------------------------------------------------------------


@cuda.jit(device=True, inline=True)
def _q4_dot(code, i, xr):
    # word k of a 32-block holds bytes 4k..4k+3: low nibbles are elements 4k..4k+3, high ones 16+4k..
    d = np.float32(0)
    for k in range(4):
        low = code[i, k] & LOW_NIBBLES
        high = (code[i, k] >> np.uint32(4)) & LOW_NIBBLES
        for j in range(4):
            d += (exponent_byte(low, j) - Q4_OFFSET) * xr[4 * k + j]
            d += (exponent_byte(high, j) - Q4_OFFSET) * xr[16 + 4 * k + j]
    return d


@cuda.jit(device=True, inline=True)
def _q4_load(words, scale, bias, has_bias, first, b, code, sb):
    """Issue the loads of rows first.. first + 7, block b, into code / sb (zeros where b is past the row)."""
    for i in range(8):
        r = min(first + i, words.shape[0] - 1)  # rows past the end load a real row, stored nowhere
        if b < scale.shape[1]:
            code[i, 0], code[i, 1], code[i, 2], code[i, 3] = load_u32x4(words, r, 4 * b)
            sb[i, 0] = load_f32(scale, r, b)
            sb[i, 1] = load_f32(bias, r, b) if has_bias else np.float32(0)
        else:
            sb[i, 0], sb[i, 1] = np.float32(0), np.float32(0)
            for k in range(4):
                code[i, k] = np.uint32(0)


@cuda.jit
def _matvec_q4(words, scale, bias, has_bias, x, out, n_pass, rows_per_block):
    xs = cuda.shared.array(0, F32)  # dynamic: the launch sizes it
    part = cuda.shared.array(PARTIALS, np.float32)
    xr = cuda.local.array(32, np.float32)
    code = cuda.local.array((8, 4), np.uint32)  # ROWS_IN_FLIGHT["q4"] rows
    sb = cuda.local.array((8, 2), np.float32)
    t = cuda.blockIdx.y
    first_row = cuda.blockIdx.x * rows_per_block
    n_warps = cuda.blockDim.x // WARP
    _clear_partials(part)
    for p in range(n_pass):
        b = (p * n_warps + cuda.threadIdx.x // WARP) * WARP + cuda.threadIdx.x % WARP  # this lane's block
        _q4_load(words, scale, bias, has_bias, first_row, b, code, sb)  # in flight while x is staged
        _stage_q4(x, t, p * n_warps * SEGMENT, xs, xr)
        xsum = np.float32(0)
        for j in range(32):
            xsum += xr[j]
        for i0 in range(0, rows_per_block, 8):
            if i0 > 0:
                _q4_load(words, scale, bias, has_bias, first_row + i0, b, code, sb)
            for i in range(8):
                _add_row(part, i0 + i, sb[i, 0] * _q4_dot(code, i, xr) + sb[i, 1] * xsum)
    _store_rows(part, first_row, rows_per_block, out, t)


# ---- q8 -------------------------------------------------------------------------------------------------


@cuda.jit(device=True, inline=True)
def _q8_dot(code, i, h, xr):
    """Dot of chunk h (0 or 1, 16 columns in 4 words) of in-flight row i with its x registers."""
    d = np.float32(0)
    for k in range(4):
        flipped = code[i, 4 * h + k] ^ SIGN_BITS
        for j in range(4):
            d += (exponent_byte(flipped, j) - Q8_OFFSET) * xr[16 * h + 4 * k + j]
    return d


@cuda.jit(device=True, inline=True)
def _q8_load(words, scale, bias, has_bias, chunk_to_block_log2, first, c0, code, sb):
    """Issue the loads of rows first.. first + 3, chunks c0 and c0 + 32, into code / sb."""
    for i in range(4):
        r = min(first + i, words.shape[0] - 1)  # rows past the end load a real row, stored nowhere
        for h in range(2):
            c = c0 + h * WARP
            if c < words.shape[1] >> 2:
                blk = c >> chunk_to_block_log2
                w0, w1, w2, w3 = load_u32x4(words, r, 4 * c)
                code[i, 4 * h], code[i, 4 * h + 1], code[i, 4 * h + 2], code[i, 4 * h + 3] = w0, w1, w2, w3
                sb[i, 2 * h] = load_f32(scale, r, blk)
                sb[i, 2 * h + 1] = load_f32(bias, r, blk) if has_bias else np.float32(0)
            else:
                sb[i, 2 * h], sb[i, 2 * h + 1] = np.float32(0), np.float32(0)
                for k in range(4):
                    code[i, 4 * h + k] = np.uint32(0)


@cuda.jit
def _matvec_q8(words, scale, bias, has_bias, chunk_to_block_log2, x, out, n_pass, rows_per_block):
    xs = cuda.shared.array(0, F32)  # dynamic: the launch sizes it
    part = cuda.shared.array(PARTIALS, np.float32)
    xr = cuda.local.array(32, np.float32)
    code = cuda.local.array((4, 8), np.uint32)  # ROWS_IN_FLIGHT["q8"] rows, two 16-byte chunks each
    sb = cuda.local.array((4, 4), np.float32)  # scale, bias of chunk 0, then of chunk 1
    xsum = cuda.local.array(2, np.float32)
    t = cuda.blockIdx.y
    first_row = cuda.blockIdx.x * rows_per_block
    n_warps = cuda.blockDim.x // WARP
    _clear_partials(part)
    for p in range(n_pass):
        c0 = (p * n_warps + cuda.threadIdx.x // WARP) * 2 * WARP + cuda.threadIdx.x % WARP
        _q8_load(words, scale, bias, has_bias, chunk_to_block_log2, first_row, c0, code, sb)  # during staging
        _stage_q8(x, t, p * n_warps * SEGMENT, xs, xr)
        for h in range(2):
            xsum[h] = np.float32(0)
            for j in range(16):
                xsum[h] += xr[16 * h + j]
        for i0 in range(0, rows_per_block, 4):
            if i0 > 0:
                _q8_load(words, scale, bias, has_bias, chunk_to_block_log2, first_row + i0, c0, code, sb)
            for i in range(4):
                acc = np.float32(0)
                for h in range(2):
                    acc += sb[i, 2 * h] * _q8_dot(code, i, h, xr) + sb[i, 2 * h + 1] * xsum[h]
                _add_row(part, i0 + i, acc)
    _store_rows(part, first_row, rows_per_block, out, t)


# ---- f32 ------------------------------------------------------------------------------------------------


@cuda.jit
def _matvec_f32(w, x, out):
    # one warp per row: f32 weights are rare (small models' norms-sized tables), not worth a wide kernel
    r = cuda.blockIdx.x * F32_ROWS_PER_BLOCK + cuda.threadIdx.x // WARP
    lane, t = cuda.threadIdx.x % WARP, cuda.blockIdx.y
    cols = w.shape[1] if r < w.shape[0] else 0  # rows past the end do no loads but join the warp sum
    acc = np.float32(0)
    for k in range(lane, cols, WARP):
        acc += w[r, k] * x[t, k]
    acc = warp_sum(acc)
    if lane == 0 and r < w.shape[0]:
        out[t, r] = acc
