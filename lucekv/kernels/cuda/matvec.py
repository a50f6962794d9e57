"""Decode products y = W @ x with W a PackedMatrix kept quantized on the GPU (see kernels.cpu.quants).

Decode reads every weight byte once per token, so these kernels stream HBM with few instructions per byte:
- Integer dot products. Each lane turns its 32 x values into int8 twice over: hi = round(x / s) with
  s = max|x| / 127 over those columns, lo = round((x - s hi) / u) with u = s / 256, so that
  x = u (256 hi + lo) to within u / 2 (about 16 bits). Codes times x then take one `dp4a` per 4 products
  and part (q8 codes are signed bytes already; q4 nibbles need a mask, or a shift and a mask, per word;
  q6 codes a few more to merge their high bits, and their offset of 32 comes off with one integer sum of
  x per pass) and one int-to-float conversion per block and row: a third of the instructions of float
  products.
- Lanes own columns, not rows. Lane `l` of warp `w` owns 32 columns of a 1024-column segment and keeps
  their int8 x in 16 registers; it walks the block's rows, loading per row one 16-byte word of q4 codes
  (one 32-block), one of q6 low nibbles and 8 bytes of their high bits, or two 16-byte words of q8 codes,
  and the factored scales of its blocks (`block_words`: raw words, decoded by `scale_bias` only when the
  row is used, so the loads stay in flight). A warp's code loads of one row are 512 (q4, q6) or 2 x 512
  (q8) consecutive bytes, and x is read and quantized once per block.
- A block has one warp per segment (up to MAX_WARPS; wider rows take several passes) and handles
  `rows_per_block` rows in groups of GROUP rows, double-buffered in registers: a group's loads are issued
  before the previous group is used (the first group's before x is read), so that a warp always has
  loads in flight. The first group's loads are issued even before `await_grid`: in a decode graph they run
  while the kernel before still computes (H200, the real 0.5B file's twin: decode 842.6 -> 985.0 tok/s). x, which
  the kernel before writes, is read only after the wait, and through coherent loads (`load_f32x4`, see _numba).
- Each row's partial dot products are summed across the warp (shuffles), then across the warps through
  shared memory: no atomics, one plain store per output.
Bias costs no pass of its own: a column block contributes `scale * dot + bias * sum(x)`, sum(x) taken from
the unquantized x, and no bytes when the matrix has none (DeviceMatrix.has_bias).
Several tokens (a short batch: a verify block, decode rows) of a quantized matrix big enough to fill the GPU
(`several_tokens`): each weight word loaded once for up to TOKENS_PER_BLOCK tokens, whose int8 x (normalized first
where the norm is fused), quantized once per block, a lane keeps in registers (`_make_tokens_body`, same sums as one
token's, bit for bit); smaller ones, f32 matrices and attention inputs: grid rows of the one-token kernel, one per
token.
Fusions that save a launch and a pass over the activations each: the RMSNorm of x (`norm`), taken by every
block from the 32 columns each lane loads anyway (one block-wide sum), and what the output rows receive
(an `Epilogue`: split into separate arrays, plus a bias and a residual; or `AttentionInputs`: q and k rotated,
k and v written to the KV pool, each thread storing one rotary pair). Two matrices of one x whose kinds differ
share a launch (`matvecs`): the first blocks of the grid run one's rows, the rest the other's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lucekv.kernels.cuda._numba import (
    WARP,
    await_grid,
    blocks,
    cuda,
    dot4_s8s8,
    dot4_u8s8,
    jit_bounded,
    jit_inlined,
    jit_kernel,
    load_f32x4,
    load_u32x4,
    sm_count,
    warp_shfl_xor,
    warp_sum,
)
from lucekv.kernels.cuda.packed import (
    GATE_ROWS,
    NO_GATE,
    Q6_OFFSET,
    AttentionInputs,
    DeviceMatrix,
    as_epilogue,
    block_words,
    pair_cos_sin,
    put,
    put_gated,
    put_pair,
    q6_word,
    scale_bias,
)

SEGMENT = WARP * 32  # columns per warp and pass: 32 per lane
MAX_WARPS = 16  # rows of up to 16384 columns in one pass
MAX_ROWS_PER_BLOCK = 64
PARTIALS = MAX_WARPS * MAX_ROWS_PER_BLOCK  # one float per (warp, row) of a block
GROUP = {"q4": 4, "q6": 2, "q8": 2}  # rows per register buffer: 4 x 6 words, 2 x 9, 2 x 12
RESIDENT_WARPS_PER_SM = 16  # the kernels' registers are capped at 128 per thread (launch bounds) to fit them
F32_ROWS_PER_BLOCK = 4
LOW_NIBBLES = np.uint32(0x0F0F0F0F)
ONES = np.uint32(0x01010101)  # four int8 ones: dp4a with it sums a word's bytes
HI_STEPS = np.float32(127)  # |hi| <= 127, and |lo| <= 128 before it is clamped to 127


def matvec(w: DeviceMatrix, x, out, stream=0, norm: tuple | None = None) -> None:
    """out[n, rows] = x[n, cols] @ W.T, for n of 1 to a few: weights streamed `weight_reads(w, n)` times (once per
    TOKENS_PER_BLOCK tokens where `takes_tokens`, else once per token).

    out: a device array, an Epilogue, or AttentionInputs (q/k/v rows rotated and stored). norm: (weight [cols],
    eps) to use RMSNorm(x) * weight for x, where `fuses_norm(w)`."""
    _launch([(w, out)], x, stream, norm)


def takes_tokens(w: DeviceMatrix, out, n: int) -> bool:
    """Whether `matvec` runs a product of n tokens with the several-token kernels: where `several_tokens`, into rows
    (not AttentionInputs)."""
    return several_tokens(w, n) and not isinstance(out, AttentionInputs)


def several_tokens(w: DeviceMatrix, n: int) -> bool:
    """Whether products of n > 1 tokens of w (into rows) take the several-token kernels: a quantized matrix of
    TOKEN_MIN_ROWS rows or more, or one whose `token_plan` costs less than the one-token kernel's grid rows."""
    if n < 2 or w.kind not in TOKEN_KINDS:
        return False
    return w.rows >= TOKEN_MIN_ROWS or token_plan(w, n, False).cost < _per_token_cost(w, n)


def weight_reads(w: DeviceMatrix, n: int) -> int:
    """How many times a product of n tokens of w (into rows) streams its weights: once per grid row of the
    several-token kernels, else once per token."""
    return token_plan(w, n, False).groups if several_tokens(w, n) else n


def matvecs(products: Sequence[tuple[DeviceMatrix, object]], x, stream=0, norm: tuple | None = None) -> None:
    """`matvec` of each (W, out) of products, all of x's width, quantized matrices two to a launch (their blocks
    side by side in one grid, whatever their kinds): in a decode step's chain of launches a small product costs
    more as a launch of its own than beside another. Products that `takes_tokens` have a launch each."""
    n = x.shape[0]
    for p in products:
        if takes_tokens(*p, n):
            _launch([p], x, stream, norm)
    quantized = [p for p in products if p[0].kind != "f32" and not takes_tokens(*p, n)]
    for i in range(0, len(quantized), 2):
        _launch(quantized[i:i + 2], x, stream, norm)
    for p in products:
        if p[0].kind == "f32":
            _launch([p], x, stream, norm)


def matvec_tokens(w: DeviceMatrix, x, out, tokens: int, stream=0, norm: tuple | None = None) -> None:
    """`matvec` with the several-token kernels at up to `tokens` tokens a block whatever n (benchmarks compare)."""
    _launch_tokens(w, x, _xnorm(x, norm), as_epilogue(out), stream, tokens)


def matvec_per_token(w: DeviceMatrix, x, out, stream=0) -> None:
    """`matvec` with the weights streamed once per token whatever n: the one-token kernel with a grid row per token
    (the path of products of several tokens before the several-token kernels: benchmarks compare the two)."""
    _launch([(w, out)], x, stream, None, per_token=True)


def _launch(products: list[tuple[DeviceMatrix, object]], x, stream, norm: tuple | None, per_token: bool = False
            ) -> None:
    """One launch: one matrix, or two quantized ones (per_token: see matvec_per_token)."""
    qkv = [isinstance(out, AttentionInputs) for _, out in products]
    if len(set(qkv)) > 1:
        raise ValueError("products of one launch write one kind of destination")
    dest = "qkv" if qkv[0] else "rows"
    ws = [w for w, _ in products]
    eps = [out if dest == "qkv" else as_epilogue(out) for _, out in products]
    gated = [dest == "rows" and ep.gate != NO_GATE for ep in eps]
    for w, g in zip(ws, gated, strict=True):
        if w.cols != x.shape[1]:
            raise ValueError(f"a {w.rows}x{w.cols} matrix times x of {x.shape[1]} columns")
        if norm is not None and not fuses_norm(w):
            raise ValueError(f"no fused RMSNorm for a {w.kind} matrix of {w.cols} columns")
        if (g or dest == "qkv") and w.kind == "f32":
            raise ValueError("gated products and products into attention's inputs take quantized matrices")
    w, xnorm = ws[0], _xnorm(x, norm)
    if len(ws) == 1 and not per_token and takes_tokens(w, eps[0], x.shape[0]):
        _launch_tokens(w, x, xnorm, eps[0], stream)
        return
    if w.kind == "f32":
        grid = (blocks(w.rows, F32_ROWS_PER_BLOCK), x.shape[0])
        _matvec_f32[grid, F32_ROWS_PER_BLOCK * WARP, stream](w.codes, x, eps[0])
        return
    n_warps, n_pass = _warps_and_passes(w.cols)
    rows = _rows_per_block([(m.rows, m.kind, g) for m, g in zip(ws, gated, strict=True)], n_warps)
    grid = [blocks(m.rows, r) for m, r in zip(ws, rows, strict=True)]
    launch = ((sum(grid), x.shape[0]), n_warps * WARP, stream)
    if len(ws) == 1:
        _KERNELS[w.kind, dest][launch](w.quant, x, xnorm, eps[0], n_pass, rows[0])
    else:
        _pair_kernel(ws[0].kind, ws[1].kind, dest)[launch](ws[0].quant, ws[1].quant, x, xnorm, *eps, n_pass, *rows,
                                                           grid[0])


def _xnorm(x, norm: tuple | None) -> tuple:
    """The kernels' norm argument: the norm's weight as a [1, cols] matrix (wide loads), or a stand-in of that type."""
    return (x, np.float32(0), False) if norm is None else (norm[0].reshape(1, -1), np.float32(norm[1]), True)


def _warps_and_passes(cols: int) -> tuple[int, int]:
    """Warps of a block and passes over the columns of a row of `cols`: a warp per segment, up to MAX_WARPS."""
    segments = blocks(cols, SEGMENT)
    n_pass = blocks(segments, MAX_WARPS)
    return blocks(segments, n_pass), n_pass


def _launch_tokens(w: DeviceMatrix, x, xnorm: tuple, ep, stream, tokens: int | None = None) -> None:
    """x's rows as `token_plan` cuts them (tokens: at most that many a block)."""
    plan = token_plan(w, x.shape[0], ep.gate != NO_GATE, tokens)
    n_warps, n_pass = _warps_and_passes(w.cols)
    grid = (blocks(w.rows, plan.rows_per_block), plan.groups)
    _tokens_kernel(w.kind, plan.tokens)[grid, plan.warps * WARP, stream](w.quant, x, xnorm, ep, n_warps, n_pass,
                                                                          plan.rows_per_block)


def fuses_norm(w: DeviceMatrix) -> bool:
    """Whether `matvec` can normalize x itself: a quantized matrix whose rows one pass of the block covers."""
    return w.kind != "f32" and w.cols <= MAX_WARPS * SEGMENT


def _rows_per_block(shapes: list[tuple[int, str, bool]], n_warps: int, copies: int = 1,
                    most: int = MAX_ROWS_PER_BLOCK, resident_warps: int = RESIDENT_WARPS_PER_SM) -> list[int]:
    """Rows per block of each (rows, kind, gated) matrix of one launch: multiples of both register buffers' rows
    (and of whole gate/up groups), with blocks of about the same number of buffer loads, the fewest that let one
    wave of resident blocks cover the matrices. A second wave, or SMs left without a block, cost up to a third of a
    big product's time (measured: 12-warp blocks of 44 rows of a 4096 x 12288 matrix left 38 of 132 SMs idle).
    copies: grid rows of that many blocks each (several-token products); most: the rows a block holds at most;
    resident_warps: the warps an SM holds at the kernel's launch bounds."""
    slots = sm_count() * max(resident_warps // n_warps, 1)
    steps = [max(2 * GROUP[kind], 2 * GATE_ROWS) if gated else 2 * GROUP[kind] for _, kind, gated in shapes]
    for k in range(1, MAX_ROWS_PER_BLOCK + 1):
        per_block = [min(blocks(k * 2 * GROUP[kind], step) * step, most)
                     for (_, kind, _), step in zip(shapes, steps, strict=True)]
        if copies * sum(blocks(rows, r) for (rows, _, _), r in zip(shapes, per_block, strict=True)) <= slots:
            return per_block
    return per_block


# ---- shared pieces: x as two int8 parts, cross-warp sums --------------------------------------------------


@cuda.jit(device=True, inline=True)
def _load_x16(x, t, c, xv, o):
    """x[t, c:c+16] into xv[o:o+16]; zeros past the end of the row (rows are whole 16-column chunks)."""
    if c + 16 <= x.shape[1]:
        for k in range(4):
            xv[o + 4 * k], xv[o + 4 * k + 1], xv[o + 4 * k + 2], xv[o + 4 * k + 3] = load_f32x4(x, t, c + 4 * k)
    else:
        for k in range(16):
            xv[o + k] = np.float32(0)


@cuda.jit(device=True, inline=True)
def _normalize(xv, ca, cb, xnorm, sums):
    """xv, this lane's columns ca..ca+15 and cb..cb+15 of the row, times weight / rms(row) when xnorm says so
    (the whole block sums the squares: each column belongs to exactly one lane)."""
    w, eps, on = xnorm
    if on:
        wv = cuda.local.array(32, np.float32)
        _load_x16(w, 0, ca, wv, 0)  # in flight during the sum
        _load_x16(w, 0, cb, wv, 16)
        ss = np.float32(0)
        for j in range(32):
            ss += xv[j] * xv[j]
        ss = warp_sum(ss)
        if cuda.threadIdx.x % WARP == 0:
            sums[cuda.threadIdx.x // WARP] = ss
        cuda.syncthreads()
        total = np.float32(0)
        for k in range(cuda.blockDim.x // WARP):
            total += sums[k]
        inv = np.float32(1) / math.sqrt(total / np.float32(w.shape[1]) + eps)
        for j in range(32):
            xv[j] *= inv * wv[j]


@cuda.jit(device=True, inline=True)
def _nearest(v):
    return np.int32(math.floor(v + np.float32(0.5)))


@cuda.jit(device=True, inline=True)
def _pack4(a, b, c, d):
    """Four ints in -128..127 as the signed bytes of one word, a lowest."""
    return np.uint32((a & 0xFF) | ((b & 0xFF) << 8) | ((c & 0xFF) << 16) | ((d & 0xFF) << 24))


@cuda.jit(device=True, inline=True)
def _quantize_x(xv, xq, o):
    """xv (32 floats) as int8 words: xq[o + k] the hi parts of xv[4k:4k+4], xq[o + 8 + k] the lo parts; returns
    u. (o: where a token's 16 words start, 16 t for token t of a several-token product.)"""
    amax = np.float32(0)
    for j in range(32):
        amax = max(amax, abs(xv[j]))
    inv = HI_STEPS / amax if amax > np.float32(0) else np.float32(0)
    s = amax / HI_STEPS
    lo_inv = inv * np.float32(256)
    for k in range(8):
        h0 = _nearest(xv[4 * k] * inv)
        h1 = _nearest(xv[4 * k + 1] * inv)
        h2 = _nearest(xv[4 * k + 2] * inv)
        h3 = _nearest(xv[4 * k + 3] * inv)
        xq[o + k] = _pack4(h0, h1, h2, h3)
        lo0 = min(_nearest((xv[4 * k] - np.float32(h0) * s) * lo_inv), 127)
        lo1 = min(_nearest((xv[4 * k + 1] - np.float32(h1) * s) * lo_inv), 127)
        lo2 = min(_nearest((xv[4 * k + 2] - np.float32(h2) * s) * lo_inv), 127)
        lo3 = min(_nearest((xv[4 * k + 3] - np.float32(h3) * s) * lo_inv), 127)
        xq[o + 8 + k] = _pack4(lo0, lo1, lo2, lo3)
    return s / np.float32(256)


@cuda.jit(device=True, inline=True)
def _sum16(xv, o):
    acc = np.float32(0)
    for j in range(16):
        acc += xv[o + j]
    return acc


@cuda.jit(device=True, inline=True)
def _add_row(part, i, v):
    """Warp-sum v, the partial of the block's row i, into this warp's slot of `part`."""
    v = warp_sum(v)
    if cuda.threadIdx.x % WARP == 0:
        part[(cuda.threadIdx.x // WARP) * MAX_ROWS_PER_BLOCK + i] += v


@cuda.jit(device=True, inline=True)
def _clear_partials(part):
    for i in range(cuda.threadIdx.x, PARTIALS, cuda.blockDim.x):
        part[i] = np.float32(0)
    cuda.syncthreads()


@cuda.jit(device=True, inline=True)
def _begin(block, rows_per_block, part):
    """(first row, warps) of a product's block `block`, its partial sums cleared."""
    _clear_partials(part)
    return block * rows_per_block, cuda.blockDim.x // WARP


@cuda.jit(device=True, inline=True)
def _row_sum(part, i, n_warps):
    acc = np.float32(0)
    for w in range(n_warps):
        acc += part[w * MAX_ROWS_PER_BLOCK + i]
    return acc


@cuda.jit(device=True, inline=True)
def _no_rotation(ep, t, first_row, rows_per_block):
    return np.float32(1), np.float32(0)


@cuda.jit(device=True, inline=True)
def _pair_rotation(ep, t, first_row, rows_per_block):
    """cos and sin of the rows this thread stores in `_store_pairs`: the block's rows 2i, 2i + 1 (thread i)."""
    r = 2 * cuda.threadIdx.x
    return pair_cos_sin(ep, t, first_row + r) if r < rows_per_block else (np.float32(1), np.float32(0))


@cuda.jit(device=True, inline=True)
def _store_pairs(part, first_row, rows_per_block, rows, ep, t, rotation):
    """The block's rows to attention's inputs (AttentionInputs), rows 2i, 2i + 1 by thread i."""
    cuda.syncthreads()
    n_warps = cuda.blockDim.x // WARP
    i = 2 * cuda.threadIdx.x
    if i < rows_per_block and first_row + i < rows:
        c, s = rotation
        put_pair(ep, t, first_row + i, _row_sum(part, i, n_warps), _row_sum(part, i + 1, n_warps), c, s)


@cuda.jit(device=True, inline=True)
def _store_rows(part, first_row, rows_per_block, rows, ep, t, rotation):
    cuda.syncthreads()
    n_warps = cuda.blockDim.x // WARP
    if ep.gate:  # thread i: the i-th gate row of the block and its up row, GATE_ROWS further
        for i in range(cuda.threadIdx.x, rows_per_block // 2, cuda.blockDim.x):
            g = (i // GATE_ROWS) * 2 * GATE_ROWS + i % GATE_ROWS
            if first_row + g < rows:
                put_gated(ep, t, first_row + g, _row_sum(part, g, n_warps), _row_sum(part, g + GATE_ROWS, n_warps))
        return
    for i in range(cuda.threadIdx.x, rows_per_block, cuda.blockDim.x):
        if first_row + i < rows:
            put(ep, t, first_row + i, _row_sum(part, i, n_warps))


# ---- q4 and q6: each lane owns a run of 32 columns ------------------------------------------------------


@cuda.jit(device=True, inline=True)
def _q4_load(w, r, run, buf, i):
    """Row r's words of the run into buf[i]: 4 code words, the scale word, the sub word."""
    buf[i, 0], buf[i, 1], buf[i, 2], buf[i, 3] = load_u32x4(w.codes, r, 4 * run)
    buf[i, 4], buf[i, 5] = block_words(w, r, run)


@cuda.jit(device=True, inline=True)
def _q4_row(w, buf, i, xq, o, xs):
    """Row i's partial: word k holds elements 4k.. (low nibbles) and 16 + 4k.. (high), one 32-block."""
    hi = np.int32(0)
    lo = np.int32(0)
    for k in range(4):
        low = buf[i, k] & LOW_NIBBLES
        high = (buf[i, k] >> np.uint32(4)) & LOW_NIBBLES
        hi = dot4_u8s8(low, xq[o + k], hi)
        hi = dot4_u8s8(high, xq[o + 4 + k], hi)
        lo = dot4_u8s8(low, xq[o + 8 + k], lo)
        lo = dot4_u8s8(high, xq[o + 12 + k], lo)
    u, xsum0, xsum1, _, _ = xs
    s, t = scale_bias(w, buf[i, 4], buf[i, 5])
    acc = s * (u * np.float32(np.int32(hi * 256 + lo)))
    return acc + t * (xsum0 + xsum1) if w.has_bias else acc


@cuda.jit(device=True, inline=True)
def _q6_load(w, r, run, buf, i):
    """Row r's words of the run into buf[i]: 4 low words, 2 high words, the scale word, the sub words of
    columns 0..15 and 16..31 (one block of 32, or two of 16)."""
    buf[i, 0], buf[i, 1], buf[i, 2], buf[i, 3] = load_u32x4(w.codes, r, 4 * run)
    buf[i, 4] = w.high[r, 2 * run]
    buf[i, 5] = w.high[r, 2 * run + 1]
    buf[i, 6], buf[i, 7] = block_words(w, r, (32 * run) >> w.block_log2)
    buf[i, 8] = block_words(w, r, (32 * run + 16) >> w.block_log2)[1]


@cuda.jit(device=True, inline=True)
def _q6_half(buf, i, h, xq, o):
    """sum((code + 32) * x) / u over columns 16h..16h+15 of row i."""
    hi = np.int32(0)
    lo = np.int32(0)
    for k in range(4):
        code = q6_word(buf[i, k], buf[i, 4 + h], 4 * h + k)
        hi = dot4_u8s8(code, xq[o + 4 * h + k], hi)
        lo = dot4_u8s8(code, xq[o + 8 + 4 * h + k], lo)
    return hi * 256 + lo


@cuda.jit(device=True, inline=True)
def _q6_row(w, buf, i, xq, o, xs):
    u, xsum0, xsum1, offset0, offset1 = xs
    s0, t0 = scale_bias(w, buf[i, 6], buf[i, 7])
    s1, t1 = scale_bias(w, buf[i, 6], buf[i, 8])
    acc = s0 * (u * np.float32(_q6_half(buf, i, 0, xq, o) - offset0))
    acc += s1 * (u * np.float32(_q6_half(buf, i, 1, xq, o) - offset1))
    return acc + t0 * xsum0 + t1 * xsum1 if w.has_bias else acc


@cuda.jit(device=True, inline=True)
def _offset_sum(xq, o, h):
    """Q6_OFFSET * sum(x) / u over columns 16h..16h+15 in x's int8 parts: what q6 codes, stored + 32, add."""
    hi = np.int32(0)
    lo = np.int32(0)
    for k in range(4):
        hi = dot4_s8s8(ONES, xq[o + 4 * h + k], hi)
        lo = dot4_s8s8(ONES, xq[o + 8 + 4 * h + k], lo)
    return Q6_OFFSET * (hi * 256 + lo)


@cuda.jit(device=True, inline=True)
def _run_columns(run):
    """The x columns of a q4 / q6 lane's run: 32 from 32 run on."""
    return 32 * run, 32 * run + 16


def _bounded(kernel):
    """Registers capped at 128 per thread: RESIDENT_WARPS_PER_SM warps fit an SM whatever the block size."""
    return jit_bounded(kernel, MAX_WARPS * WARP, RESIDENT_WARPS_PER_SM // MAX_WARPS)


# where a product's rows go: (what a thread computes early for its rows, the store), by `matvec`'s dest
DESTS = {"rows": (_no_rotation, _store_rows), "qkv": (_pair_rotation, _store_pairs)}


def _body_of(stream, store_rows):
    """`body(w, x, tx, xnorm, ep, t, n_pass, rows_per_block, block, part, sums)`: block `block` of the product of x's
    row tx to token t's rows of ep, a warp per column segment (`stream`), then the rows stored."""

    @cuda.jit(device=True, inline=True)
    def body(w, x, tx, xnorm, ep, t, n_pass, rows_per_block, block, part, sums):
        first_row, n_warps = _begin(block, rows_per_block, part)
        rotation = stream(w, x, tx, xnorm, ep, t, n_pass, first_row, rows_per_block, cuda.threadIdx.x // WARP,
                          n_warps, part, sums)
        store_rows(part, first_row, rows_per_block, w.codes.shape[0], ep, t, rotation)

    return body


def _group_loader(group: int, load, words: int):
    """`load_group(w, first, run, buf)`: rows first.. first + group - 1 of a lane's run into buf (zeros where the run
    is past the row's end), by `load` (see _make_run_body)."""

    @cuda.jit(device=True, inline=True)
    def load_group(w, first, run, buf):
        for i in range(group):
            r = min(first + i, w.codes.shape[0] - 1)  # rows past the end load a real row, stored nowhere
            if run < w.codes.shape[1] >> 2:
                load(w, r, run, buf, i)
            else:
                for k in range(words):
                    buf[i, k] = np.uint32(0)

    return load_group


def _make_run_body(kind: str, load, row, words: int, dest: str):
    """(stream, body) for `kind` storing to `dest` (see _body_of): `load(w, r, run, buf, i)` issues row r's `words`
    words of a lane's run into buf[i], `row(w, buf, i, xq, xs)` is that row's partial dot product, xs = (u, sums of
    x over columns 0..15 and 16..31, `_offset_sum` of both)."""
    group = GROUP[kind]
    rotation_of, store_rows = DESTS[dest]
    load_group = _group_loader(group, load, words)

    @cuda.jit(device=True, inline=True)
    def add_group(w, part, i0, buf, xq, xs):
        for i in range(group):
            _add_row(part, i0 + i, row(w, buf, i, xq, 0, xs))

    @cuda.jit(device=True, inline=True)
    def stream(w, x, tx, xnorm, ep, t, n_pass, first_row, rows_per_block, warp, n_warps, part, sums):
        """Warp `warp` of the n_warps over a row's columns: its partials of rows first_row.. of the product of x's row
        tx into its slot of `part` (cleared); returns what this thread stores with (see DESTS)."""
        xv = cuda.local.array(32, np.float32)
        xq = cuda.local.array(16, np.uint32)
        buf_a = cuda.local.array((group, words), np.uint32)  # two register buffers of `group` rows
        buf_b = cuda.local.array((group, words), np.uint32)
        rotation = (np.float32(1), np.float32(0))
        for p in range(n_pass):
            run = (p * n_warps + warp) * WARP + cuda.threadIdx.x % WARP  # this lane's run
            load_group(w, first_row, run, buf_a)  # in flight while x is read
            if p == 0:
                await_grid()
            _load_x16(x, tx, 32 * run, xv, 0)
            _load_x16(x, tx, 32 * run + 16, xv, 16)
            if p == 0:  # while the loads are in flight
                rotation = rotation_of(ep, t, first_row, rows_per_block)
            _normalize(xv, 32 * run, 32 * run + 16, xnorm, sums)
            xsum0 = _sum16(xv, 0)
            xsum1 = _sum16(xv, 16)
            u = _quantize_x(xv, xq, 0)
            xs = (u, xsum0, xsum1, _offset_sum(xq, 0, 0), _offset_sum(xq, 0, 1))  # (q4 leaves the offsets unused)
            for i0 in range(0, rows_per_block, 2 * group):
                load_group(w, first_row + i0 + group, run, buf_b)
                add_group(w, part, i0, buf_a, xq, xs)
                if i0 + 2 * group < rows_per_block:
                    load_group(w, first_row + i0 + 2 * group, run, buf_a)
                add_group(w, part, i0 + group, buf_b, xq, xs)
        return rotation

    return stream, _body_of(stream, store_rows)


# ---- several tokens: each weight word loaded once for all of them ----------------------------------------------
# A short batch (verify blocks, decode rows) as grid rows of the one-token kernel reads every weight once per token,
# all but the first from L2. The block of `_make_tokens_body` takes `tokens` tokens and is laid out as the one-token
# kernel's block: its warp k owns logical warps ("slots": the one-token kernel's warps, each a run of segments) k,
# k + warps, .. (the warps: the largest divisor of the slots up to TOKEN_WARPS, so that every warp has as many), and
# for each of them quantizes the tokens' x over its columns into its own registers (16 words a token), then streams
# all the block's rows over those columns, double-buffered as the one-token kernel streams them, applying each
# weight word to every token: no barrier and no shared copy of x between the first x read and the final store.
# A register buffer's rows x tokens partials are warp-summed EXCHANGE_ITEMS at a time (`add_items`): a halving
# exchange, about one shuffle per partial, in one stretch of independent work (the one-token kernel spends five
# dependent shuffles per row). Each output is the same sum in the same order as the one-token kernel's (same
# partial per lane, the same butterfly tree over the lanes, a slot's passes added in order, then the slots in
# order): equal bit for bit to the token's own product.

TOKEN_WARPS = 4  # warps per block of the several-token kernels, at most
# their launch bounds by tokens per block, in blocks of TOKEN_WARPS warps an SM (so TOKEN_WARPS times that many warps
# whatever the block size): 2 tokens fit 168 registers a thread (ptxas, sm_90: q4 24 bytes of spill loads, none in
# the loop over the rows; q6, q8 none), 4 and 8 take up to 255 (at 168, 240-290 bytes of spill loads; at 255, 8
# tokens 20 (q4) and 96 (q8) bytes, none in the loop over the rows, 4 tokens none)
TOKEN_BLOCKS_PER_SM = {2: 3, 4: 2, 8: 2}
# tokens per block: x takes 16 registers per token; q6's 8-token kernel spills (ptxas, sm_90: 236 bytes of spill
# loads before these kernels), so q6 takes 4: 8 tokens in two grid rows
TOKENS_PER_BLOCK = {"q4": 8, "q6": 4, "q8": 8}
# rows per register buffer by tokens, at most (`GROUP`), and partials warp-summed together (`add_items`), at most
# where a row's tokens allow: 8 tokens' x takes 128 registers, and two buffers of 4 q4 rows or 16 partials beside it
# spilled in the loop over the rows (ptxas, sm_90: 151 local loads and stores there; none with these)
TOKEN_GROUP = {2: 4, 4: 4, 8: 2}
EXCHANGE_ITEMS = 8
MAX_TOKENS = max(TOKENS_PER_BLOCK.values())
MAX_TOKEN_ROWS = 128  # rows per block of the several-token kernels, at most
TOKEN_PARTIALS = 4096  # a block's partial sums, one float per (slot, row, token): 16 KB, 8 one-warp blocks an SM
X_FIELDS = 5  # per token and lane besides its 16 words of x: u, the sums of x over columns 0..15 and 16..31 and
# their `_offset_sum`s (see _make_run_body)
# Where the several-token kernels go and how they cut a product: by a cost model of the time of a product on a GPU
# that products of a few tokens leave latency-bound, waves of resident blocks x the instructions of one warp's work,
# counted in token-rows (a row's products for one token) with one token's quantized x over a lane's columns costing
# QUANTIZE_ROWS of them (~600 instructions against ~35 for a q4 row, from the code), and the instructions of a warp
# of T tokens 1 + log2(T) / 2 times as fast as the one-token kernel's (a row's products for its tokens are
# independent: they interleave; `_token_ilp`). Fitted on the kernels before these (bench/results/h100-matvec-rows.json,
# H100) at the 0.5B's and 1.5B's shapes; matrices of TOKEN_MIN_ROWS rows or more, where the per-token path's weight
# reads also cost HBM bandwidth, which it does not count, always take the several-token kernels.
# `python -m lucekv.bench.matvec_speed --rows` times every tokens-per-block against the per-token path.
QUANTIZE_ROWS = 16
TOKEN_MIN_ROWS = 4096


@dataclass(frozen=True)
class TokenPlan:
    """How a product of several tokens is cut: grid rows of `tokens` tokens (the last maybe padded), blocks of
    `warps` warps and `rows_per_block` rows; cost: the model's estimate (token-rows of the one-token kernel)."""

    tokens: int
    groups: int
    warps: int
    rows_per_block: int
    cost: float


def token_plan(w: DeviceMatrix, n: int, gated: bool, tokens: int | None = None) -> TokenPlan:
    """The several-token kernels' cheapest cut of a product of n tokens by the cost model: grid rows of a power of two
    up to TOKENS_PER_BLOCK (or `tokens`) tokens each, as few as cover n; rows per block of whole register buffers
    (`GROUP`) and gate/up groups, their partials within TOKEN_PARTIALS (see `rank`)."""
    if (tokens or MAX_TOKENS) < 2:
        raise ValueError(f"the several-token kernels take 2 tokens a block or more, not {tokens}")
    n_warps, n_pass = _warps_and_passes(w.cols)
    warps = _token_warps(n_warps)
    step = 2 * GATE_ROWS if gated else GROUP[w.kind]  # (GATE_ROWS: a multiple of every GROUP)

    def rank(plan: TokenPlan) -> tuple:
        """The cheapest cut, of a matrix of TOKEN_MIN_ROWS rows or more the cheapest of those reading the weights the
        fewest times: there the weights' bytes, which the model does not count, cost more than its latencies."""
        return (plan.groups if w.rows >= TOKEN_MIN_ROWS else 0, plan.cost)

    best = None
    most = 2
    while most <= min(TOKENS_PER_BLOCK[w.kind], tokens or MAX_TOKENS):
        groups = blocks(n, most)
        per_block = 1 << (blocks(n, groups) - 1).bit_length()
        room = min(MAX_TOKEN_ROWS, TOKEN_PARTIALS // (n_warps * per_block)) // step * step
        slots = sm_count() * (TOKEN_WARPS * TOKEN_BLOCKS_PER_SM[per_block] // warps)
        for rows_per_block in range(step, max(room, step) + 1, step):
            waves = blocks(groups * blocks(w.rows, rows_per_block), slots)
            chain = n_warps // warps * n_pass * per_block * (QUANTIZE_ROWS + rows_per_block)
            plan = TokenPlan(per_block, groups, warps, rows_per_block, waves * chain / _token_ilp(per_block))
            if best is None or rank(plan) < rank(best):
                best = plan
        most *= 2
    return best


def _token_warps(n_warps: int) -> int:
    """Warps of a several-token block for `n_warps` slots: the largest divisor up to TOKEN_WARPS (every warp owns as
    many slots: the simulator's warp sums are block-wide barriers, and a warp without work would idle)."""
    return max(d for d in range(1, TOKEN_WARPS + 1) if n_warps % d == 0)


def _token_ilp(tokens: int) -> float:
    return 1 + math.log2(tokens) / 2


def _per_token_cost(w: DeviceMatrix, n: int) -> float:
    """The cost model's estimate of the one-token kernel's grid rows for n tokens (see token_plan)."""
    n_warps, n_pass = _warps_and_passes(w.cols)
    rows = _rows_per_block([(w.rows, w.kind, False)], n_warps)[0]
    waves = blocks(n * blocks(w.rows, rows), sm_count() * max(RESIDENT_WARPS_PER_SM // n_warps, 1))
    return waves * n_pass * (QUANTIZE_ROWS + rows)


@functools.cache
def _unrolled(step, times: int):
    """A device function f(args, j0) that runs step(args, j0 + j) for j in range(times) as straight code: the
    compiler may keep a loop over a big body (a row's products for 8 tokens) rolled, and then the registers it
    indexes by j (x of each token) would be local memory. (step: a `jit_inlined` function, as f.)"""
    if times == 1:
        return step
    half = _unrolled(step, times // 2)
    rest = _unrolled(step, times - times // 2)

    @jit_inlined
    def run(args, j0):
        half(args, j0)
        rest(args, j0 + times // 2)

    return run


def _make_tokens_body(kind: str, load, row, words: int, columns, tokens: int):
    """A block's work for `kind` and `tokens` tokens from x's row tg * tokens on, storing rows (see _make_run_body;
    columns(run): the x columns of a lane's run, 16 from each)."""
    group = min(GROUP[kind], TOKEN_GROUP[tokens])
    load_group = _group_loader(group, load, words)
    x_words = 16 * tokens  # (array sizes must be constants of their own)
    exchange = max(min(group, EXCHANGE_ITEMS // tokens), 1)  # rows of a register buffer warp-summed together
    items = exchange * tokens  # their partials, row i's for token j item i * tokens + j
    halvings = items.bit_length() - 1

    @jit_inlined
    def token_partial(args, j):
        w, buf, i, xq, xs, v, o = args
        v[o + j] = row(w, buf, i, xq, 16 * j, (xs[j, 0], xs[j, 1], xs[j, 2], xs[j, 3], xs[j, 4]))

    token_partials = _unrolled(token_partial, tokens)

    @jit_inlined
    def row_partials(args, i):
        w, buf, e, xq, xs, v = args
        token_partials((w, buf, e + i, xq, xs, v, i * tokens), 0)

    exchange_partials = _unrolled(row_partials, exchange)

    @cuda.jit(device=True, inline=True)
    def add_items(part, slot, rows_per_block, i0, v):
        """v, this lane's partials of the rows i0.. for every token (items), warp-summed into slot's place in `part`:
        the lanes whose bit 16 is clear keep the first half of the items and add their partner's (16 lanes away),
        the others the second half, and so on down to one item a lane, then a butterfly. Each lane adds exactly what
        `warp_sum`'s butterfly adds there for its item (the same sum, bit for bit), in items - 1 + 5 - log2(items)
        shuffles for all of them instead of 5 each."""
        lane = cuda.threadIdx.x % WARP
        k = 0  # the item this lane keeps
        for h in range(halvings):
            offset = 16 >> h
            half = items >> (h + 1)
            upper = (lane & offset) != 0
            for m in range(items // 2):
                if m < half:
                    sent = warp_shfl_xor(v[m] if upper else v[m + half], offset)
                    v[m] = (v[m + half] if upper else v[m]) + sent
            if upper:
                k += half
        total = v[0]
        for h in range(halvings, 5):
            total += warp_shfl_xor(total, 16 >> h)
        if lane % (WARP >> halvings) == 0:
            part[(slot * rows_per_block + i0 + k // tokens) * tokens + k % tokens] += total

    @jit_inlined
    def add_exchange(args, s):
        """The partials of a register buffer's rows s * exchange.. for every token, into `part` (`add_items`)."""
        w, part, slot, rows_per_block, i0, buf, xq, xs, v = args
        exchange_partials((w, buf, s * exchange, xq, xs, v), 0)
        add_items(part, slot, rows_per_block, i0 + s * exchange, v)

    add_group = _unrolled(add_exchange, group // exchange)  # add_group((w, part, slot, rows_per_block, i0, ..), 0)

    @jit_inlined
    def quantize_token(args, j):
        """Token j's x over the lane's columns into xq and xs, normalized where xnorm says so (scales: the tokens'
        1 / rms, see _normalize), quantized as the one-token kernel quantizes it (a padding token past x's rows: the
        last real one's, computed and stored nowhere)."""
        x, t0, real, cols, xnorm, scales, xq, xs = args
        jr = min(j, real - 1)
        xv = cuda.local.array(32, np.float32)
        _load_x16(x, t0 + jr, cols[0], xv, 0)
        _load_x16(x, t0 + jr, cols[1], xv, 16)
        norm_w, _, on = xnorm
        if on:
            wv = cuda.local.array(32, np.float32)
            _load_x16(norm_w, 0, cols[0], wv, 0)
            _load_x16(norm_w, 0, cols[1], wv, 16)
            inv = scales[jr]
            for c in range(32):
                xv[c] *= inv * wv[c]
        xs[j, 1] = _sum16(xv, 0)
        xs[j, 2] = _sum16(xv, 16)
        xs[j, 0] = _quantize_x(xv, xq, 16 * j)
        xs[j, 3] = _offset_sum(xq, 16 * j, 0)
        xs[j, 4] = _offset_sum(xq, 16 * j, 1)

    quantize_tokens = _unrolled(quantize_token, tokens)

    @cuda.jit(device=True, inline=True)
    def inverse_rms(x, t0, n_warps, xnorm, scales):
        """scales[j] = 1 / rms(x[t0 + j]) for the tokens j that this warp takes (j % warps == its warp), summed
        as `_normalize` sums in the one-token kernel (each lane's 32 columns, the warp's butterfly, the slots in
        order; rows of one pass). Every warp takes the same number of tokens (a padding one: x's last real row,
        its scale stored nowhere), so that the warp sums stay block-uniform (the simulator's are barriers)."""
        norm_w, eps, _ = xnorm
        real = min(tokens, x.shape[0] - t0)
        warps = cuda.blockDim.x // WARP
        warp = cuda.threadIdx.x // WARP
        xv = cuda.local.array(32, np.float32)
        for k in range((tokens + warps - 1) // warps):
            j = warp + k * warps
            t = t0 + min(j, real - 1)
            total = np.float32(0)
            for slot in range(n_warps):
                ca, cb = columns(slot * WARP + cuda.threadIdx.x % WARP)
                _load_x16(x, t, ca, xv, 0)
                _load_x16(x, t, cb, xv, 16)
                ss = np.float32(0)
                for c in range(32):
                    ss += xv[c] * xv[c]
                total += warp_sum(ss)
            if j < real:
                scales[j] = np.float32(1) / math.sqrt(total / np.float32(norm_w.shape[1]) + eps)

    @cuda.jit(device=True, inline=True)
    def body(w, x, tg, xnorm, ep, n_warps, n_pass, rows_per_block, block, part, scales):
        """Block `block` of the products of x's rows tg * tokens.. (those that exist) to their rows of ep, x
        normalized first where xnorm says so (see _normalize); n_warps, n_pass: the one-token kernel's layout of the
        columns; scales: the tokens' 1 / rms(x)."""
        xq = cuda.local.array(x_words, np.uint32)
        xs = cuda.local.array((tokens, X_FIELDS), np.float32)
        buf_a = cuda.local.array((group, words), np.uint32)
        buf_b = cuda.local.array((group, words), np.uint32)
        v = cuda.local.array(items, np.float32)
        for i in range(cuda.threadIdx.x, n_warps * rows_per_block * tokens, cuda.blockDim.x):
            part[i] = np.float32(0)
        warps = cuda.blockDim.x // WARP
        warp = cuda.threadIdx.x // WARP
        lane = cuda.threadIdx.x % WARP
        first_row = block * rows_per_block
        t0 = tg * tokens
        load_group(w, first_row, warp * WARP + lane, buf_a)  # in flight while x is read
        await_grid()
        real = min(tokens, x.shape[0] - t0)
        if xnorm[2]:
            inverse_rms(x, t0, n_warps, xnorm, scales)
        cuda.syncthreads()  # partials cleared, scales taken
        for k in range(n_warps // warps):
            slot = warp + k * warps
            for p in range(n_pass):
                run = (p * n_warps + slot) * WARP + lane
                if k > 0 or p > 0:
                    load_group(w, first_row, run, buf_a)
                quantize_tokens((x, t0, real, columns(run), xnorm, scales, xq, xs), 0)
                for i0 in range(0, rows_per_block, 2 * group):
                    if i0 + group < rows_per_block:
                        load_group(w, first_row + i0 + group, run, buf_b)
                    add_group((w, part, slot, rows_per_block, i0, buf_a, xq, xs, v), 0)
                    if i0 + 2 * group < rows_per_block:
                        load_group(w, first_row + i0 + 2 * group, run, buf_a)
                    if i0 + group < rows_per_block:
                        add_group((w, part, slot, rows_per_block, i0 + group, buf_b, xq, xs, v), 0)
        cuda.syncthreads()
        _store_token_rows(part, tokens, tg, x.shape[0], first_row, rows_per_block, w.codes.shape[0], n_warps, ep)

    return body


@cuda.jit(device=True, inline=True)
def _token_row_sum(part, tokens, rows_per_block, i, j, n_warps):
    """Row i of token j of the block: its slots' partials added in order (as `_row_sum`)."""
    acc = np.float32(0)
    for w in range(n_warps):
        acc += part[(w * rows_per_block + i) * tokens + j]
    return acc


@cuda.jit(device=True, inline=True)
def _store_token_rows(part, tokens, tg, n, first_row, rows_per_block, rows, n_warps, ep):
    """The block's rows of its tokens to ep (as `_store_rows`): thread k takes row k // tokens of token k % tokens."""
    per_token = rows_per_block // 2 if ep.gate else rows_per_block
    for k in range(cuda.threadIdx.x, per_token * tokens, cuda.blockDim.x):
        i, j = k // tokens, k % tokens
        t = tg * tokens + j
        if t < n:
            if ep.gate:
                g = (i // GATE_ROWS) * 2 * GATE_ROWS + i % GATE_ROWS
                if first_row + g < rows:
                    put_gated(ep, t, first_row + g, _token_row_sum(part, tokens, rows_per_block, g, j, n_warps),
                              _token_row_sum(part, tokens, rows_per_block, g + GATE_ROWS, j, n_warps))
            elif first_row + i < rows:
                put(ep, t, first_row + i, _token_row_sum(part, tokens, rows_per_block, i, j, n_warps))


@functools.cache
def _tokens_kernel(kind: str, tokens: int):
    """The product of one matrix and `tokens` tokens per grid row: block (b, g) does rows b * rows_per_block.. of
    x's rows g * tokens.."""
    body = _make_tokens_body(kind, *_TOKEN_PARTS[kind], tokens)

    def kernel(w, x, xnorm, ep, n_warps, n_pass, rows_per_block):
        part = cuda.shared.array(TOKEN_PARTIALS, np.float32)
        scales = cuda.shared.array(tokens, np.float32)
        body(w, x, cuda.blockIdx.y, xnorm, ep, n_warps, n_pass, rows_per_block, cuda.blockIdx.x, part, scales)

    kernel.__name__ = kernel.__qualname__ = f"_matvec_{kind}_tokens{tokens}"
    return jit_bounded(kernel, TOKEN_WARPS * WARP, TOKEN_BLOCKS_PER_SM[tokens])


# ---- q8 -------------------------------------------------------------------------------------------------


@cuda.jit(device=True, inline=True)
def _q8_dot(code, i, h, xq, o):
    """sum(code * x) / u for chunk h (0 or 1: 16 columns in 4 words of signed bytes) of in-flight row i (x's words
    from xq[o] on)."""
    hi = np.int32(0)
    lo = np.int32(0)
    for k in range(4):
        hi = dot4_s8s8(code[i, 4 * h + k], xq[o + 4 * h + k], hi)
        lo = dot4_s8s8(code[i, 4 * h + k], xq[o + 8 + 4 * h + k], lo)
    return np.float32(np.int32(hi * 256 + lo))


@cuda.jit(device=True, inline=True)
def _q8_partial(w, code, sw, i, s_at, xq, o, u, xsum0, xsum1):
    """Row i's partial: its codes code[i, 0:8], the scale and sub words of its chunks sw[i, s_at:s_at + 4]."""
    s0, t0 = scale_bias(w, sw[i, s_at], sw[i, s_at + 1])
    s1, t1 = scale_bias(w, sw[i, s_at + 2], sw[i, s_at + 3])
    acc = s0 * (u * _q8_dot(code, i, 0, xq, o)) + s1 * (u * _q8_dot(code, i, 1, xq, o))
    if w.has_bias:
        acc += t0 * xsum0 + t1 * xsum1
    return acc


@cuda.jit(device=True, inline=True)
def _q8_load(w, first, c0, code, sw):
    """Issue the loads of rows first and first + 1, chunks c0 and c0 + 32, into code / sw (raw words)."""
    for i in range(2):
        r = min(first + i, w.codes.shape[0] - 1)  # rows past the end load a real row, stored nowhere
        for h in range(2):
            c = c0 + h * WARP
            if c < w.codes.shape[1] >> 2:
                w0, w1, w2, w3 = load_u32x4(w.codes, r, 4 * c)
                code[i, 4 * h], code[i, 4 * h + 1], code[i, 4 * h + 2], code[i, 4 * h + 3] = w0, w1, w2, w3
                sw[i, 2 * h], sw[i, 2 * h + 1] = block_words(w, r, (16 * c) >> w.block_log2)
            else:
                sw[i, 2 * h], sw[i, 2 * h + 1] = np.uint32(0), np.uint32(0)
                for k in range(4):
                    code[i, 4 * h + k] = np.uint32(0)


@cuda.jit(device=True, inline=True)
def _q8_rows(w, part, i0, code, sw, xq, u, xsum0, xsum1):
    for i in range(2):
        _add_row(part, i0 + i, _q8_partial(w, code, sw, i, 0, xq, 0, u, xsum0, xsum1))


@cuda.jit(device=True, inline=True)
def _q8_run_load(w, r, run, buf, i):
    """`load` of the several-token kernels (see _make_run_body): row r's chunks of the lane's `run` (as the q8 body's
    lanes own them: chunks c0 and c0 + 32, `_chunk_columns`), codes to buf[i, 0:8], scale and sub words after."""
    c0 = run + (run // WARP) * WARP
    for h in range(2):
        c = c0 + h * WARP
        if c < w.codes.shape[1] >> 2:
            buf[i, 4 * h], buf[i, 4 * h + 1], buf[i, 4 * h + 2], buf[i, 4 * h + 3] = load_u32x4(w.codes, r, 4 * c)
            buf[i, 8 + 2 * h], buf[i, 9 + 2 * h] = block_words(w, r, (16 * c) >> w.block_log2)
        else:
            buf[i, 8 + 2 * h], buf[i, 9 + 2 * h] = np.uint32(0), np.uint32(0)
            for k in range(4):
                buf[i, 4 * h + k] = np.uint32(0)


@cuda.jit(device=True, inline=True)
def _q8_run_row(w, buf, i, xq, o, xs):
    u, xsum0, xsum1, _, _ = xs
    return _q8_partial(w, buf, buf, i, 8, xq, o, u, xsum0, xsum1)


@cuda.jit(device=True, inline=True)
def _chunk_columns(run):
    """The x columns of a q8 lane's run: 16-column chunks c0 and c0 + 32 of its segment (see _make_q8_body)."""
    c0 = run + (run // WARP) * WARP
    return 16 * c0, 16 * (c0 + WARP)


def _make_q8_body(dest: str):
    """(stream, body) for q8 storing to `dest` (see _make_run_body)."""
    rotation_of, store_rows = DESTS[dest]

    @cuda.jit(device=True, inline=True)
    def stream(w, x, tx, xnorm, ep, t, n_pass, first_row, rows_per_block, warp, n_warps, part, sums):
        xv = cuda.local.array(32, np.float32)
        xq = cuda.local.array(16, np.uint32)
        code_a = cuda.local.array((2, 8), np.uint32)  # two buffers of GROUP["q8"] rows, two 16-byte chunks each
        sw_a = cuda.local.array((2, 4), np.uint32)  # scale and sub words of chunk 0, then of chunk 1
        code_b = cuda.local.array((2, 8), np.uint32)
        sw_b = cuda.local.array((2, 4), np.uint32)
        rotation = (np.float32(1), np.float32(0))
        for p in range(n_pass):
            # lane l owns the 16-column chunks l and l + 32 of its warp's segment
            c0 = (p * n_warps + warp) * 2 * WARP + cuda.threadIdx.x % WARP
            _q8_load(w, first_row, c0, code_a, sw_a)  # in flight while x is read
            if p == 0:
                await_grid()
            _load_x16(x, tx, 16 * c0, xv, 0)
            _load_x16(x, tx, 16 * (c0 + WARP), xv, 16)
            if p == 0:  # while the loads are in flight
                rotation = rotation_of(ep, t, first_row, rows_per_block)
            _normalize(xv, 16 * c0, 16 * (c0 + WARP), xnorm, sums)
            xsum0 = _sum16(xv, 0)
            xsum1 = _sum16(xv, 16)
            u = _quantize_x(xv, xq, 0)
            for i0 in range(0, rows_per_block, 4):
                _q8_load(w, first_row + i0 + 2, c0, code_b, sw_b)
                _q8_rows(w, part, i0, code_a, sw_a, xq, u, xsum0, xsum1)
                if i0 + 4 < rows_per_block:
                    _q8_load(w, first_row + i0 + 4, c0, code_a, sw_a)
                _q8_rows(w, part, i0 + 2, code_b, sw_b, xq, u, xsum0, xsum1)
        return rotation

    return stream, _body_of(stream, store_rows)


# ---- f32 ------------------------------------------------------------------------------------------------


@jit_kernel
def _matvec_f32(w, x, ep):
    # one warp per row: f32 weights are rare (small models' norms-sized tables), not worth a wide kernel
    await_grid()
    r = cuda.blockIdx.x * F32_ROWS_PER_BLOCK + cuda.threadIdx.x // WARP
    lane, t = cuda.threadIdx.x % WARP, cuda.blockIdx.y
    cols = w.shape[1] if r < w.shape[0] else 0  # rows past the end do no loads but join the warp sum
    acc = np.float32(0)
    for k in range(lane, cols, WARP):
        acc += w[r, k] * x[t, k]
    acc = warp_sum(acc)
    if lane == 0 and r < w.shape[0]:
        put(ep, t, r, acc)


_RUN_KINDS = {"q4": (_q4_load, _q4_row, 6), "q6": (_q6_load, _q6_row, 9)}
# the several-token kernels' (load, row, words, columns) by kind (`_launch_tokens`)
_TOKEN_PARTS = {**{kind: (*parts, _run_columns) for kind, parts in _RUN_KINDS.items()},
                "q8": (_q8_run_load, _q8_run_row, 12, _chunk_columns)}
TOKEN_KINDS = tuple(_TOKEN_PARTS)
# (kind, dest) -> (stream, body): a warp's partials of a block's rows, and a block's product (see _body_of)
_PARTS = {**{(kind, dest): _make_run_body(kind, *parts, dest) for kind, parts in _RUN_KINDS.items() for dest in DESTS},
          **{("q8", dest): _make_q8_body(dest) for dest in DESTS}}
_BODIES = {key: body for key, (_, body) in _PARTS.items()}
STREAMS = {kind: _PARTS[kind, "rows"][0] for kind in TOKEN_KINDS}  # (the routed products' sum, kernels.cuda.moe)


def _kernel_name(kinds: Sequence[str], dest: str) -> str:
    return "_matvec_" + "_".join(kinds) + ("_qkv" if dest == "qkv" else "")


def _make_kernel(kind: str, dest: str):
    """The product of one matrix: block b does rows b * rows_per_block.."""
    body = _BODIES[kind, dest]

    def kernel(w, x, xnorm, ep, n_pass, rows_per_block):
        part = cuda.shared.array(PARTIALS, np.float32)
        sums = cuda.shared.array(MAX_WARPS, np.float32)
        body(w, x, cuda.blockIdx.y, xnorm, ep, cuda.blockIdx.y, n_pass, rows_per_block, cuda.blockIdx.x, part, sums)

    kernel.__name__ = kernel.__qualname__ = _kernel_name([kind], dest)
    return _bounded(kernel)


@functools.cache
def _pair_kernel(kind_a: str, kind_b: str, dest: str):
    """The products of two matrices of one x: the first `blocks_a` blocks do wa's rows, the others wb's (each
    block's branch is uniform, so the barriers of a body stay block-wide)."""
    body_a, body_b = _BODIES[kind_a, dest], _BODIES[kind_b, dest]

    def kernel(wa, wb, x, xnorm, ep_a, ep_b, n_pass, rows_a, rows_b, blocks_a):
        part = cuda.shared.array(PARTIALS, np.float32)
        sums = cuda.shared.array(MAX_WARPS, np.float32)
        t = cuda.blockIdx.y
        if cuda.blockIdx.x < blocks_a:
            body_a(wa, x, t, xnorm, ep_a, t, n_pass, rows_a, cuda.blockIdx.x, part, sums)
        else:
            body_b(wb, x, t, xnorm, ep_b, t, n_pass, rows_b, cuda.blockIdx.x - blocks_a, part, sums)

    kernel.__name__ = kernel.__qualname__ = _kernel_name([kind_a, kind_b], dest)
    return _bounded(kernel)


_KERNELS = {key: _make_kernel(*key) for key in _BODIES}
