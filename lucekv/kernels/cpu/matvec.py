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

import math
from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from lucekv.kernels.cpu.intdot import (
    NATIVE_VNNI,
    TILE_ROWS,
    TILE_TOKENS,
    X_BLOCK,
    group_q4,
    group_q4_bias,
    group_q8,
    group_q8_16,
    group_q8_16_bias,
    group_q8_bias,
    prefetch,
    quantize_x16,
    tile_16,
    tile_16_bias,
    tile_32,
    tile_32_bias,
)
from lucekv.kernels.cpu.quants import GROUP_ROWS, PackedMatrix, dequantize_rows

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
    if m.grouped:  # the decode step's matrices: its products (int16 x); one thread (only op-by-op references and
        # decode rows outside the step come here)
        _matvec_grouped(_layout(m), m.has_bias, m.codes, m.scale, m.bias if m.has_bias else m.scale[:, :0], xs, out)
    elif m.kind == "q4":
        _matvec_q4(m.codes, m.scale, m.bias, xs, out, n_threads)
    elif m.kind == "q8":
        _matvec_q8(m.codes, m.scale, m.bias, xs, out, n_threads)
    else:
        _matvec_f32(m.codes, xs, out, n_threads)
    return out


INT_Q4, INT_Q8, INT_Q8_16 = range(3)  # the code layouts of the integer kernels: q4 nibbles, int8 by 32, int8 by 16
TILES = NATIVE_VNNI  # a prompt's quantized products through the tile kernels (else dequantized tiles and BLAS)


@dataclass
class PromptInput:
    """X float32 [n, cols] of a prompt's products, prepared once for every product that reads it: its tile form
    (prepare_tiles: xp, xd, xsum32, xsum16) where the tile kernels run."""

    xs: np.ndarray
    tiles: tuple[np.ndarray, ...] | None


def prompt_input(xs: np.ndarray, split: Callable[[int, Callable[[int, int], None]], None] | None = None,
                 tiles: bool = True) -> PromptInput:
    """X prepared for `prompt_rows`; split(n, part): part(i0, i1) over shares of range(n) (the backend's threads; by
    default all on this one), here over groups of TILE_TOKENS tokens. tiles=False: float X, every product through
    BLAS on dequantized tiles."""
    xs = np.ascontiguousarray(xs, dtype=np.float32)
    if not (tiles and TILES) or xs.shape[1] % X_BLOCK:
        return PromptInput(xs, None)
    n, cols = xs.shape
    groups = -(-n // TILE_TOKENS)
    tiles = (np.empty((groups, cols // 2 * TILE_TOKENS), np.int32),
             *(np.empty((groups, cols // b * TILE_TOKENS), np.float32) for b in (X_BLOCK, 32, 16)))
    (split or (lambda n_items, part: part(0, n_items)))(groups, lambda g0, g1: prepare_tiles(xs, g0, g1, *tiles))
    return PromptInput(xs, tiles)


def prompt_rows(m: PackedMatrix, x: PromptInput, out: np.ndarray, r0: int, r1: int) -> None:
    """out[:, r0:r1] = X @ W[r0:r1].T (float32 out [n, rows]). Threads may each take a range of rows of one product:
    nothing here holds the GIL for long (numba nogil, BLAS). Quantized weights through the tile kernels, where they
    run, else (and float weights) through BLAS on dequantized tiles."""
    if m.kind == "f32" or x.tiles is None:
        matmul_rows(m, x.xs, out, r0, r1)
        return
    xp, xd, xsum32, xsum16 = x.tiles
    _tile_rows(_layout(m), m.grouped, np.ascontiguousarray(m.codes).view(np.uint8), m.scale, m.bias, m.has_bias,
               xp, xd, xsum16 if m.block == 16 else xsum32, out, r0, r1)


def _layout(m: PackedMatrix) -> int:
    """The INT_* layout of a quantized matrix's codes."""
    return INT_Q4 if m.kind == "q4" else INT_Q8_16 if m.block == 16 else INT_Q8


def matmul(m: PackedMatrix, xs: np.ndarray) -> np.ndarray:
    """float32 [n, rows] = X @ W.T for X float32 [n, cols] (a prompt's tokens; one token: the matvec)."""
    if xs.ndim != 2 or xs.shape[1] != m.cols:
        raise ValueError(f"matmul: X has shape {xs.shape}, expected (n, {m.cols})")
    if xs.shape[0] == 1:
        return matvec(m, xs[0])[None, :]
    out = np.empty((xs.shape[0], m.rows), np.float32)
    prompt_rows(m, prompt_input(xs), out, 0, m.rows)
    return out


def matmul_rows(m: PackedMatrix, xs: np.ndarray, out: np.ndarray, r0: int, r1: int) -> None:
    """out[:, r0:r1] = X @ W[r0:r1].T through BLAS, tile by tile of dequantized rows (float32 X [n, cols])."""
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
    """sums [n, cols // block] = each row's sums over blocks of `block` columns, added by 16 columns as
    prepare_tiles adds them (a 32-block's: its two 16-sums added), so decode and prefill products agree bit for bit."""
    for t in range(xs.shape[0]):
        for b in range(sums.shape[1]):
            s = np.float32(0)
            for h in range(block // 16):
                s16 = np.float32(0)
                for j in range(16):
                    s16 += xs[t, b * block + h * 16 + j]
                s += s16
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


@njit(cache=True, nogil=True)
def _matvec_grouped(layout, with_bias, codes, scale, bias, xs, out):
    """out = X W^T for a grouped W (PackedMatrix.grouped), each row of X quantized to int16 by 32-blocks."""
    n, cols = xs.shape
    xq = np.empty((n, cols), np.int16)
    xd = np.empty((n, cols // X_BLOCK), np.float32)
    for t in range(n):
        quantize_x16(xs[t], xq[t], xd[t])
    xsum = _block_sums(xs, cols // (scale.shape[1] // GROUP_ROWS))
    group_rows(layout, with_bias, codes, scale, bias, xq.reshape(-1).view(np.int32).reshape(n, cols // 2), xd, xsum,
               out, 0, out.shape[1])


@njit(cache=True, nogil=True)
def group_rows(layout, with_bias, codes, scale, bias, xp, xd, xsum, out, r0, r1):
    """Rows r0..r1 (r0 a multiple of GROUP_ROWS) of out = X W^T (out float32 [n, rows]), W grouped (codes uint8
    [groups, code_cols * 16], scale and bias float32 [groups, n_blocks * 16], layout INT_*; with_bias: W has bias
    terms, else bias is not read), X given as int16 codes in int32 pairs xp [n, cols / 2] with their scales xd [n,
    cols / 32] (intdot.quantize_x16) and its float sums over W's blocks xsum [n, n_blocks]. Each group's codes go
    through every row of X while they are in cache; the lines of the group two ahead are prefetched. A row's numbers
    for X row t depend on t alone."""
    n, group_bytes, group_floats = xp.shape[0], codes.shape[1], scale.shape[1]
    n_blocks = group_floats // GROUP_ROWS
    flat, scales, biases = codes.reshape(-1), scale.reshape(-1), bias.reshape(-1)
    partial = np.empty(GROUP_ROWS, np.float32)
    for g in range(r0 // GROUP_ROWS, -(-r1 // GROUP_ROWS)):
        ahead = (g + 2) * group_bytes
        for at in range(ahead, min(ahead + group_bytes, flat.shape[0]), CACHE_LINE):
            prefetch(flat, at)
        first = g * GROUP_ROWS
        whole = first + GROUP_ROWS <= r1
        for t in range(n):
            dst, d_at = (out[t], first) if whole else (partial, 0)
            args = (flat, g * group_bytes, xp[t], 0, scales, g * group_floats, xd[t], 0, n_blocks, biases,
                    g * group_floats, xsum[t], 0, dst, d_at)
            if layout == INT_Q4:
                if with_bias:
                    group_q4_bias(*args)
                else:
                    group_q4(*args)
            elif layout == INT_Q8:
                if with_bias:
                    group_q8_bias(*args)
                else:
                    group_q8(*args)
            elif with_bias:
                group_q8_16_bias(*args)
            else:
                group_q8_16(*args)
            if not whole:
                out[t, first:r1] = partial[:r1 - first]


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


@njit(cache=True, nogil=True)
def prepare_tiles(xs, g0, g1, xp, xd, xsum32, xsum16):
    """Groups g0..g1 of TILE_TOKENS tokens of X float32 [n, cols] as the tile kernels take them (lanes past n:
    zeros): xp int32 [groups, cols / 2 * 16] (pair p of token l's int16 codes, intdot.quantize_x16, at p * 16 + l),
    xd float32 [groups, cols / 32 * 16] (their scales), xsum32 / xsum16 float32 [groups, cols / 32 (16) * 16]: x's
    sums over blocks of 32 (16) elements (a 32-block's: its two 16-blocks' sums added)."""
    n, cols = xs.shape
    xq = np.zeros((TILE_TOKENS, cols), np.int16)
    xdr = np.zeros((TILE_TOKENS, cols // X_BLOCK), np.float32)
    for g in range(g0, g1):
        t0 = g * TILE_TOKENS
        lanes = min(TILE_TOKENS, n - t0)
        if lanes < TILE_TOKENS:
            xq[:] = 0
            xdr[:] = 0
            xsum16[g, :] = 0
        for lane in range(lanes):
            x = xs[t0 + lane]
            quantize_x16(x, xq[lane], xdr[lane])
            for b in range(cols // 16):
                s16 = np.float32(0)
                for j in range(16):
                    s16 += x[b * 16 + j]
                xsum16[g, b * TILE_TOKENS + lane] = s16
        pairs = xq.reshape(-1).view(np.int32)
        for p in range(cols // 2):
            for lane in range(TILE_TOKENS):
                xp[g, p * TILE_TOKENS + lane] = pairs[lane * (cols // 2) + p]
        for b in range(cols // X_BLOCK):
            for lane in range(TILE_TOKENS):
                xd[g, b * TILE_TOKENS + lane] = xdr[lane, b]
        for b in range(cols // 32):
            for lane in range(TILE_TOKENS):
                xsum32[g, b * TILE_TOKENS + lane] = (xsum16[g, 2 * b * TILE_TOKENS + lane]
                                                     + xsum16[g, (2 * b + 1) * TILE_TOKENS + lane])


@njit(cache=True, nogil=True)
def _widen_pairs(layout, codes, w, i):
    """One row's codes (uint8 [code_cols], layout INT_*) as int32 pairs of int16 codes (lo = element 2p, hi = 2p + 1)
    into w[p * TILE_ROWS + i] (row i of a tile)."""
    if layout == INT_Q4:  # per 32-block 16 bytes: elements 0..15 the low nibbles, 16..31 the high ones
        for b in range(codes.shape[0] // 16):
            for q in range(8):
                c0, c1 = np.int32(codes[b * 16 + 2 * q]), np.int32(codes[b * 16 + 2 * q + 1])
                w[(b * 16 + q) * TILE_ROWS + i] = (c0 & 15) | ((c1 & 15) << 16)
                w[(b * 16 + 8 + q) * TILE_ROWS + i] = (c0 >> 4) | ((c1 >> 4) << 16)
    else:
        signed = codes.view(np.int8)
        for p in range(codes.shape[0] // 2):
            w[p * TILE_ROWS + i] = (np.int32(signed[2 * p]) & 0xFFFF) | (np.int32(signed[2 * p + 1]) << 16)


def float32_of(v):
    """A grouped matrix's scale or bias as float32: a float32 as it is, float16 bits (uint16) widened exactly."""


@overload(float32_of, jit_options={"cache": True, "nogil": True})
def _float32_of(v):
    if isinstance(v, types.Integer):
        def widen(v):
            e, m = (v >> 10) & 31, np.int64(v & 1023)
            x = np.float32(math.ldexp(np.float64(m if e == 0 else m + 1024), (1 if e == 0 else e) - 25))
            return -x if v & 0x8000 else x
        return widen
    return lambda v: v


@njit(cache=True, nogil=True, inline="always")
def _grouped_pair(layout, codes, k):
    """Pair k of a group's codes (group_rows' form: pair p of the group's row i is k = p * GROUP_ROWS + i) as int32:
    two int16 codes, lo = element 2p."""
    if layout == INT_Q4:
        c = np.int32(codes[k])
        return (c & 15) | ((c >> 4) << 16)
    return (np.int32(np.int8(codes[2 * k])) & 0xFFFF) | (np.int32(np.int8(codes[2 * k + 1])) << 16)


@njit(cache=True, nogil=True)
def _group_tile(layout, codes, scale, bias, with_bias, first, r1, w, sc, bi):
    """Rows first..first + TILE_ROWS of a grouped matrix (past r1: the last row again) as a tile's w, sc and bi (see
    intdot.tile_*): a whole group's are its codes widened in order and its scales as they are."""
    if first % GROUP_ROWS == 0 and first + GROUP_ROWS <= r1:
        g = first // GROUP_ROWS
        group = codes[g]
        if layout == INT_Q4:  # one loop per layout: each vectorizes
            for k in range(w.shape[0]):
                w[k] = _grouped_pair(INT_Q4, group, k)
        else:
            for k in range(w.shape[0]):
                w[k] = _grouped_pair(INT_Q8, group, k)
        for k in range(sc.shape[0]):
            sc[k] = float32_of(scale[g, k])
            if with_bias:
                bi[k] = float32_of(bias[g, k])
        return
    for i in range(TILE_ROWS):
        r = min(first + i, r1 - 1)
        g, j = r // GROUP_ROWS, r % GROUP_ROWS
        for p in range(w.shape[0] // TILE_ROWS):
            w[p * TILE_ROWS + i] = _grouped_pair(layout, codes[g], p * GROUP_ROWS + j)
        for b in range(sc.shape[0] // TILE_ROWS):
            sc[b * TILE_ROWS + i] = float32_of(scale[g, b * GROUP_ROWS + j])
            if with_bias:
                bi[b * TILE_ROWS + i] = float32_of(bias[g, b * GROUP_ROWS + j])


@njit(cache=True, nogil=True)
def _tile_rows(layout, grouped, codes, scale, bias, with_bias, xp, xd, xsum, out, r0, r1):
    """Rows r0..r1 of out = X W^T for X prepared by prepare_tiles (xsum: the block sums over W's blocks); codes: the
    rows' bytes (uint8 [rows, code_cols]) in layout INT_*, or grouped (group_rows' form: a group's codes and scales
    are a tile's); with_bias: W has bias terms (else bias is ignored)."""
    n, n_groups = out.shape[0], xp.shape[0]
    n_pairs = xp.shape[1] // TILE_TOKENS
    n_blocks = scale.shape[1] // GROUP_ROWS if grouped else scale.shape[1]
    w = np.empty(n_pairs * TILE_ROWS, np.int32)
    sc = np.empty(n_blocks * TILE_ROWS, np.float32)
    bi = np.zeros(n_blocks * TILE_ROWS, np.float32)
    acc = np.empty(TILE_ROWS * TILE_TOKENS, np.float32)
    for first in range(r0, r1, TILE_ROWS):
        if grouped:
            _group_tile(layout, codes, scale, bias, with_bias, first, r1, w, sc, bi)
        else:
            for i in range(TILE_ROWS):
                r = min(first + i, r1 - 1)  # past the end: the last row again, not written
                _widen_pairs(layout, codes[r], w, i)
                for b in range(n_blocks):
                    sc[b * TILE_ROWS + i] = scale[r, b]
                    if with_bias:
                        bi[b * TILE_ROWS + i] = bias[r, b]
        for g in range(n_groups):
            if layout == INT_Q8_16:
                if with_bias:
                    tile_16_bias(w, xp[g], xd[g], sc, bi, xsum[g], acc, n_blocks)
                else:
                    tile_16(w, xp[g], xd[g], sc, bi, xsum[g], acc, n_blocks)
            elif with_bias:
                tile_32_bias(w, xp[g], xd[g], sc, bi, xsum[g], acc, n_blocks)
            else:
                tile_32(w, xp[g], xd[g], sc, bi, xsum[g], acc, n_blocks)
            for i in range(min(TILE_ROWS, r1 - first)):
                for lane in range(min(TILE_TOKENS, n - g * TILE_TOKENS)):
                    out[g * TILE_TOKENS + lane, first + i] = acc[i * TILE_TOKENS + lane]
