"""Products with a PackedMatrix: matvec (decode, weights stay quantized) and tiled matmul (prefill).

How the matvec kernels get vectorized without fastmath (which would allow reassociation):
- Each row keeps 16 float32 lanes `acc[j]` (one AVX-512 vector); the inner loop over a 16-element
  chunk adds into them lane by lane (vertical adds, no reduction), and the lanes are summed once per row.
  A block's scale multiplies its chunk's products; its bias multiplies a precomputed block sum of x.
- numba leaves LLVM's SLP vectorizer off, so only the loop vectorizer helps. A 16-trip loop alone is
  fully unrolled into scalar code, but one that also walks ROW_GROUP rows is too big to unroll and gets
  vectorized into a single 16-wide iteration, with the x loads and loop overhead shared by the rows.
  Row groups past the end are clamped to the last row (it is computed again and written twice).
- Loops run from 0 with step 1 so LLVM can prove indices non-negative; otherwise numba's negative-index
  wraparound turns contiguous loads into gathers. Each thread's rows are a separate function: LLVM
  vectorizes it better than the body of a prange loop.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from lucekv.kernels.cpu.intdot import dot_q4, dot_q8, dot_q8_16, prefetch
from lucekv.kernels.cpu.quants import PackedMatrix, dequantize_rows

MATMUL_TILE_ROWS = 256  # rows dequantized per BLAS call: 256 x 4864 float32 is 5 MB, stays in L3
LANES = 16  # float32 accumulators per row: one AVX-512 vector
ROW_GROUP = 4  # rows sharing one pass over x
PREFETCH_GROUPS = 2  # row groups ahead whose codes are touched while this one computes
CACHE_LINE = 64


def matvec(m: PackedMatrix, x: np.ndarray) -> np.ndarray:
    """float32 [rows] = W @ x for x float32 [cols]."""
    if x.shape != (m.cols,):
        raise ValueError(f"matvec: x has shape {x.shape}, expected ({m.cols},)")
    return matvec_rows(m, x[None, :])[0]


def matvec_rows(m: PackedMatrix, xs: np.ndarray) -> np.ndarray:
    """float32 [n, rows] = X @ W.T for X float32 [n, cols], a few rows (a batch's decode tokens): each group of weight
    rows is read from memory once for all of X's rows, and each row's result equals `matvec` of it alone, bit for bit
    (the same operations in the same order)."""
    if xs.ndim != 2 or xs.shape[1] != m.cols:
        raise ValueError(f"matvec: X has shape {xs.shape}, expected (n, {m.cols})")
    xs = np.require(xs, np.float32, ["C", "W"])  # one numba specialization: contiguous, writable float32
    out = np.empty((xs.shape[0], m.rows), np.float32)
    n_threads = numba.get_num_threads()  # read out here: inside a kernel it keeps the kernel out of the cache
    if m.kind == "q4":
        _matvec_q4(m.codes, m.scale, m.bias, xs, out, n_threads)
    elif m.kind == "q8":
        _matvec_q8(m.codes, m.scale, m.bias, xs, out, n_threads)
    else:
        _matvec_f32(m.codes, xs, out, n_threads)
    return out


def matmul(m: PackedMatrix, xs: np.ndarray) -> np.ndarray:
    """float32 [n, rows] = X @ W.T for X float32 [n, cols]: BLAS on float32 tiles of dequantized rows."""
    if xs.ndim != 2 or xs.shape[1] != m.cols:
        raise ValueError(f"matmul: X has shape {xs.shape}, expected (n, {m.cols})")
    if xs.shape[0] == 1:
        return matvec(m, xs[0])[None, :]
    xs = np.ascontiguousarray(xs, dtype=np.float32)
    out = np.empty((xs.shape[0], m.rows), np.float32)
    matmul_rows(m, xs, out, 0, m.rows)
    return out


def matmul_rows(m: PackedMatrix, xs: np.ndarray, out: np.ndarray, r0: int, r1: int) -> None:
    """out[:, r0:r1] = X @ W[r0:r1].T, tile by tile (float32 X [n, cols] and out [n, rows]). Threads may each
    take a range of rows of one product: nothing here holds the GIL for long (numba nogil, BLAS)."""
    if m.kind == "f32":
        out[:, r0:r1] = xs @ m.codes[r0:r1].T
        return
    for t0 in range(r0, r1, MATMUL_TILE_ROWS):
        t1 = min(t0 + MATMUL_TILE_ROWS, r1)
        np.matmul(xs, dequantize_rows(m, t0, t1).T, out=out[:, t0:t1])


@njit(cache=True)
def _block_sums(xs, block):
    """[n, cols // block]: each row's sums over blocks of `block` columns."""
    sums = np.empty((xs.shape[0], xs.shape[1] // block), np.float32)
    block_sums(xs, block, sums)
    return sums


@njit(cache=True, nogil=True)
def block_sums(xs, block, sums):
    """sums [n, cols // block] = each row's sums over blocks of `block` columns."""
    for t in range(xs.shape[0]):
        for b in range(sums.shape[1]):
            s = np.float32(0)
            for j in range(block):
                s += xs[t, b * block + j]
            sums[t, b] = s


@njit(cache=True)
def _row_bias(bias, r, xsum):
    """Row r's bias terms; a bias of no columns (a type without one, in the decode step's arena) adds nothing."""
    t = np.float32(0)
    for b in range(bias.shape[1]):
        t += bias[r, b] * xsum[b]
    return t


@njit(cache=True)
def _lane_sum(acc):
    t = np.float32(0)
    for j in range(acc.shape[0]):
        t += acc[j]
    return t


@njit(cache=True)
def _touch_lines(flat, start, stop):
    """Load one byte per cache line of flat[start:stop] (clipped to the array) and return their OR.

    A software prefetch: numba has no prefetch intrinsic, and without it a q8 matrix larger than the
    cache streams from DRAM at half the bandwidth. The caller returns the OR so the loads stay."""
    t = np.uint8(0)
    for line in range(max(0, min(stop, flat.shape[0]) - start) // CACHE_LINE):
        t |= np.uint8(flat[start + line * CACHE_LINE])
    return t


@njit(cache=True)
def _thread_rows(t, n_threads, rows):
    return t * rows // n_threads, (t + 1) * rows // n_threads


@njit(parallel=True, fastmath=False, cache=True)
def _matvec_q4(codes, scale, bias, xs, out, n_threads):
    n_blocks = scale.shape[1]
    # x re-ordered to the byte order of the codes: xlo[t, k] / xhi[t, k] meet the low / high nibble of byte k
    xlo = np.empty((xs.shape[0], codes.shape[1]), np.float32)
    xhi = np.empty((xs.shape[0], codes.shape[1]), np.float32)
    for t in range(xs.shape[0]):
        for b in range(n_blocks):
            for j in range(LANES):
                xlo[t, b * LANES + j] = xs[t, 2 * b * LANES + j]
                xhi[t, b * LANES + j] = xs[t, 2 * b * LANES + LANES + j]
    xsum = _block_sums(xs, 2 * LANES)
    touched = np.zeros(n_threads, np.uint8)  # returned, so that the prefetch loads are not dropped
    for th in prange(n_threads):
        r0, r1 = _thread_rows(th, n_threads, out.shape[1])
        touched[th] = _q4_rows(codes, scale, bias, xlo, xhi, xsum, out, r0, r1)
    return touched.max()


@njit(cache=True)
def _q4_rows(codes, scale, bias, xlo, xhi, xsum, out, r0, r1):
    """Rows r0..r1 for every row of x (the group's codes stay in cache between them); a 32-block is 16 bytes: one
    chunk of LANES bytes, two elements per byte. Returns the OR of its prefetch loads (_touch_lines), as _q8_rows."""
    low = np.uint8(15)
    shift = np.uint8(4)
    acc = np.empty((ROW_GROUP, LANES), np.float32)
    s = np.empty(ROW_GROUP, np.float32)
    flat = codes.reshape(-1)
    touched = np.uint8(0)
    for g in range((r1 - r0 + ROW_GROUP - 1) // ROW_GROUP):
        first = r0 + g * ROW_GROUP
        ahead = (first + PREFETCH_GROUPS * ROW_GROUP) * codes.shape[1]  # rows are contiguous in flat
        touched |= _touch_lines(flat, ahead, ahead + ROW_GROUP * codes.shape[1])
        for t in range(xlo.shape[0]):
            acc[:] = 0
            for b in range(scale.shape[1]):
                for i in range(ROW_GROUP):
                    s[i] = scale[min(first + i, r1 - 1), b]
                k0 = b * LANES
                for j in range(LANES):
                    xl = xlo[t, k0 + j]
                    xh = xhi[t, k0 + j]
                    for i in range(ROW_GROUP):
                        c = codes[min(first + i, r1 - 1), k0 + j]
                        lo = np.float32(np.uint8(c & low))
                        hi = np.float32(np.uint8(c >> shift))
                        acc[i, j] += s[i] * (lo * xl + hi * xh)
            for i in range(ROW_GROUP):
                r = min(first + i, r1 - 1)
                out[t, r] = _lane_sum(acc[i]) + _row_bias(bias, r, xsum[t])
    return touched


@njit(parallel=True, fastmath=False, cache=True)
def _matvec_q8(codes, scale, bias, xs, out, n_threads):
    xsum = _block_sums(xs, codes.shape[1] // scale.shape[1])
    touched = np.zeros(n_threads, np.uint8)  # returned, so that the prefetch loads are not dropped
    for th in prange(n_threads):
        r0, r1 = _thread_rows(th, n_threads, out.shape[1])
        touched[th] = _q8_rows(codes, scale, bias, xs, xsum, out, r0, r1)
    return touched.max()


@njit(cache=True)
def _q8_rows(codes, scale, bias, xs, xsum, out, r0, r1):
    """Rows r0..r1 for every row of x, in chunks of LANES codes; a block (32 or 16 codes) is two chunks or one."""
    chunk_shift = codes.shape[1] // scale.shape[1] // 32  # chunk h lies in block h >> chunk_shift
    acc = np.empty((ROW_GROUP, LANES), np.float32)
    s = np.empty(ROW_GROUP, np.float32)
    flat = codes.reshape(-1)
    touched = np.uint8(0)
    for g in range((r1 - r0 + ROW_GROUP - 1) // ROW_GROUP):
        first = r0 + g * ROW_GROUP
        ahead = (first + PREFETCH_GROUPS * ROW_GROUP) * codes.shape[1]  # rows are contiguous in flat
        touched |= _touch_lines(flat, ahead, ahead + ROW_GROUP * codes.shape[1])
        for t in range(xs.shape[0]):
            acc[:] = 0
            for h in range(codes.shape[1] // LANES):
                for i in range(ROW_GROUP):
                    s[i] = scale[min(first + i, r1 - 1), h >> chunk_shift]
                k0 = h * LANES
                for j in range(LANES):
                    xv = xs[t, k0 + j]
                    for i in range(ROW_GROUP):
                        acc[i, j] += s[i] * (np.float32(codes[min(first + i, r1 - 1), k0 + j]) * xv)
            for i in range(ROW_GROUP):
                r = min(first + i, r1 - 1)
                out[t, r] = _lane_sum(acc[i]) + _row_bias(bias, r, xsum[t])
    return touched


INT_Q4, INT_Q8, INT_Q8_16 = range(3)  # the weight layouts of _int_rows


@njit(cache=True, nogil=True)
def _int_rows(layout, codes, scale, bias, xq, xd, xsum, out, r0, r1):
    """Rows r0..r1 of out = X W^T for every row t of X given as int16 codes xq [n, cols] with one scale per 32-block
    xd [n, cols // 32] (intdot.quantize_x16), plus each row's bias terms against xsum (X's float block sums over the
    weight's blocks). codes: the rows' bytes (uint8 [rows, code_cols]) in one of the layouts INT_*: q4 nibbles or
    int8 codes by 32-blocks, or int8 codes by 16-blocks. A row's number for X row t depends on t alone. The cache
    lines of the row group two ahead are prefetched (llvm.prefetch: 1.44 against 2.15 ms for the 49152x576 q8
    output head with _touch_lines' loads, 1 thread)."""
    n_chunks = xq.shape[1] // 32
    code_cols, n_blocks, n_bias = codes.shape[1], scale.shape[1], bias.shape[1]
    flat, scales, biases = codes.reshape(-1), scale.reshape(-1), bias.reshape(-1)
    for first in range(r0, r1, ROW_GROUP):
        ahead = (first + PREFETCH_GROUPS * ROW_GROUP) * code_cols  # rows are contiguous in flat
        for at in range(ahead, min(ahead + ROW_GROUP * code_cols, flat.shape[0]), CACHE_LINE):
            prefetch(flat, at)
        for r in range(first, min(first + ROW_GROUP, r1)):
            for t in range(xq.shape[0]):
                args = (flat, r * code_cols, xq[t], 0, scales, r * n_blocks, xd[t], 0, n_chunks, biases, r * n_bias,
                        xsum[t], 0, n_bias)
                if layout == INT_Q4:
                    out[t, r] = dot_q4(*args)
                elif layout == INT_Q8:
                    out[t, r] = dot_q8(*args)
                else:
                    out[t, r] = dot_q8_16(*args)


@njit(parallel=True, fastmath=False, cache=True)
def _matvec_f32(w, xs, out, n_threads):
    for th in prange(n_threads):
        r0, r1 = _thread_rows(th, n_threads, out.shape[1])
        _f32_rows(w, xs, out, r0, r1)


@njit(cache=True)
def _f32_rows(w, xs, out, r0, r1):
    cols = w.shape[1]
    n_chunks = cols // LANES
    acc = np.empty((ROW_GROUP, LANES), np.float32)
    for g in range((r1 - r0 + ROW_GROUP - 1) // ROW_GROUP):
        first = r0 + g * ROW_GROUP
        for t in range(xs.shape[0]):
            acc[:] = 0
            for h in range(n_chunks):
                k0 = h * LANES
                for j in range(LANES):
                    xv = xs[t, k0 + j]
                    for i in range(ROW_GROUP):
                        acc[i, j] += w[min(first + i, r1 - 1), k0 + j] * xv
            for i in range(ROW_GROUP):
                r = min(first + i, r1 - 1)
                tail = np.float32(0)
                for k in range(n_chunks * LANES, cols):
                    tail += w[r, k] * xs[t, k]
                out[t, r] = _lane_sum(acc[i]) + tail
