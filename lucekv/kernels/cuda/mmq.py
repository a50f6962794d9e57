"""Products out[n, rows] = x[n, cols] @ W.T of a quantized matrix and 2..64 tokens on the integer tensor cores
(the idea of llama.cpp's MMQ): a short batch (decode rows, a verify block) reads each weight once, and neither the
weights nor x become floats before the tensor cores.

- x is quantized first (`quantize`: one small launch, a block per token, RMSNorm'd there where the products' x is),
  or, up to one token tile (`quantizes_itself`: verify blocks, decode batches), by each block of the product itself as
  it stages x's steps (`float_x`: no launch before the product; the same device functions, the same bits), per
  32-column run (8 lanes a run, 4 columns each), in one of two precisions
  (`parts`): one int8 code per column, round(x / d) with d = max|x| / 127 (llama.cpp's q8_1: ~5e-3 of a product's
  largest output against float64), or two, hi = round(x / d) and lo = round((x - d hi) / u) with u = d / 256, as the
  matvecs quantize x (`matvec._quantize_x`: 16 bits, ~1e-5; each part its own mma, their int32 sums joined as
  256 hi + lo: for q4 and q6, whose matvecs quantize x in the same runs, exactly their integer sums of a run, so that
  decode rows agree with each token's own one-token step to float32 rounding, as issue 25 wants greedy tokens to;
  q8's matvec groups x's columns otherwise: within x's 16 bits). Per run the scale (d, or u) and minus the run's sum
  of x (for biases, as the matvecs take it, from the unquantized x). The words go in the order the mma's B
  fragments want them (`x_word`): a thread's two words of a run, for two consecutive runs, are 16 contiguous bytes,
  one load.
- Weights go to `mma.sync.m16n8k32.s8` (`mma_s8_16832`) as they are stored: rows on m, the tokens on n (8 per
  mma column, up to 64), one 32-column run per mma. In the PTX ISA's A layout, lane (group g, thread q) holds
  columns 4q..4q+3 and 16+4q..16+4q+3 of rows g and g+8; word q of a q4 run holds exactly those columns (low
  nibbles, high nibbles), so a lane takes one word per row and run and widens its nibbles to bytes with a mask and
  a shift. q6 codes (stored + 32) rebuild their bytes from the low word and the high bits (`q6_word`), then lose
  the 32 with a bytewise subtraction; q8 codes are signed bytes already (two words a row and run). Each warp copies
  its 16 rows' codes (and q6's high words) of a step into shared memory, 16 bytes a lane (`cp.async`), and takes
  its words from there with ldmatrix (`_matrices`: two runs' words of rows g and g + 8 in one instruction): loaded
  from global memory a word a lane, a request touched 8 lines for 16 bytes of each, a quarter of what a 16-byte
  load moves for the same L1 work.
- Each run's result (exact) is scaled by (the row's block scale x the token's run scale) into float32
  accumulators: the mmas start from C = MAGIC, so that a part's int32 sum is the bits of a float from which one
  subtraction leaves the sum (`_exact`), and the parts join in float32, rounded once as a conversion of their int32
  join would be (`_joined`): no conversion instruction (a quarter of the FMA pipe's rate, four a token tile and run,
  the most of any unit's work at many tokens), plus the block's bias times the token's sum of x where the matrix
  has biases (Q4_K's mins). 16-column blocks (Q6_K) take two k16 mmas (`mma_s8_16816`), one per block, whose
  sums their sub-scales combine in float32 (exact with one part) before one scaling by d (the group's) x the
  token's scale. The kernels are specialized by kind, 16-column blocks, biases (no branch between the mmas), scale
  words a step (`grouped`), token tiles and x's parts.
- A block is up to MAX_WARPS warps of 16 rows each (a warp: one m tile, every token tile), all walking the same
  columns in step: the block copies each step of x (words and scales, from L2) into shared memory once
  (`cp.async`, 16 bytes a thread, the next step's while this one computes; a barrier a step), where its warps read
  their B fragments and scales 16 bytes a lane without bank conflicts. Read from global memory, every warp's loads
  of x (and its prefetches of the next step's into L1) touched 8 lines a request, as many L1 requests as the
  weights' at 8 tokens and 5x theirs at 64: the cost that grew with the tokens. A step is RUNS[kind] runs of every
  row (two where many tokens leave too few registers); a warp copies its next step's codes and loads its scale words
  (the K-quants' scale word once and their sub words in one load of 4 or 8 bytes, others a scale and sub word per
  run) into second buffers while it computes on this one, and its first step's before `await_grid`. Matrices of few
  row tiles split their columns over `splits` blocks (`plan`: any number, uneven ranges of whole steps, to fill a
  wave of resident blocks), whose partial sums the row tile's last block to finish adds in order (an atomic ticket
  after a fence; `last_block_reduces`: up to 2 token tiles), or beyond, a second launch (`_reduce_kernel`, the same
  order: the same bits). Outputs go through the Epilogue (rows split, bias, residual;
  a 16-row tile is one gate/up group: a lane holds a gate row and its up row). The plan depends on the matrix's
  shape only, never on n: a token's outputs are the same sums in the same order whatever the other tokens, bit for
  bit.
- Weights stream once per product; x (1 or 2 bytes a column and token) is read by every block, from L2.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from lucekv.kernels.cuda._numba import (
    ALIGN_16,
    WARP,
    await_grid,
    bits_f32,
    blocks,
    copy_async16,
    copy_async_commit,
    copy_async_wait_all,
    copy_async_wait_one,
    cuda,
    device_zeros,
    half2_floats,
    jit_bounded,
    jit_inlined,
    jit_kernel,
    load4,
    load_f32x4,
    load_f32x4_l2,
    load_matrix_x4,
    mma_s8_16816,
    mma_s8_16832,
    sm_count,
    warp_shfl_xor,
    warp_sum,
)
from lucekv.kernels.cuda.matvec import HI_STEPS, _nearest, _pack4, _unrolled
from lucekv.kernels.cuda.packed import (
    NO_GATE,
    DeviceMatrix,
    as_epilogue,
    block_words,
    put,
    put_gated,
    q6_word,
    signed_byte,
)

TILE_ROWS = 16  # rows per block: one mma row tile (and one gate/up group of gated products)
TOKEN_TILE = 8  # tokens per mma column tile
MAX_TOKENS = 64
PARTS = 2  # int8 parts of x by default (see the module's notes)
RUN = 32  # columns per run: one mma's k
RUNS = {"q4": 4, "q6": 2, "q8": 2}  # runs per step: a row's 64 bytes of q4 codes (two full sectors), 32 of q6/q8's
MAX_WARPS = 8
RESIDENT_WARPS = 16  # warps an SM holds at the kernels' launch bounds (128 registers a thread)
MIN_STEPS = 4  # steps of a split of the columns, at least
LAST_BLOCK_TILES = 1  # token tiles up to which a row tile's last block adds the splits' sums (`last_block_reduces`;
# 2 measured 21 us slower an 8B layer at 16 tokens on an H100: bench/results/h100-mmq-speed-8b-layers.json)
QUANTIZE_THREADS = 128  # threads of a block of `_quantize_kernel`: RUN_LANES to a 32-column run, 16 runs of a token
RUN_LANES = 8  # lanes that quantize a run together, 4 columns (one 16-byte load) each
REDUCE_THREADS = 128
LOW_NIBBLES = np.uint32(0x0F0F0F0F)
SIGN_BITS = np.uint32(0x80808080)
Q6_BYTES = np.uint32(0x20202020)  # Q6_OFFSET in each byte
MAGIC = np.int32(0x4B400000)  # the bits of 1.5 * 2^23: C of the mmas, whose sums of a part and run stay below 2^22
MAGIC_FLOAT = np.float32(12582912.0)
_ZEROS4 = (np.float32(0),) * 4


class QuantizedX(NamedTuple):
    """x as `quantize` writes it: words uint32 [parts x n_pad, cols // 4] (int8 codes in `x_word`'s order: token t's
    hi part in row t, its lo part in row n_pad + t), scales float32 [cols // 32, 2 n_pad] (per run, token t's scale
    at 2t and minus its sum of x at 2t + 1); n real tokens of n_pad."""

    words: object
    scales: object
    n: int

    @property
    def parts(self) -> int:
        return self.words.shape[0] * 2 // self.scales.shape[1]

    @property
    def n_pad(self) -> int:
        return self.scales.shape[1] // 2


class FloatX(NamedTuple):
    """x float32 [n, cols] of up to TOKEN_TILE tokens for a product whose blocks quantize it themselves, each its
    columns a step at a time, as `quantize` would (no launch before the product: `float_x`); xnorm as
    `_quantize_kernel` takes it."""

    x: object
    xnorm: tuple
    parts: int

    @property
    def n(self) -> int:
        return self.x.shape[0]

    @property
    def n_pad(self) -> int:
        return TOKEN_TILE


def serves(w: DeviceMatrix, n: int) -> bool:
    """Whether `mmq` takes a product of n tokens of w: 2..MAX_TOKENS tokens of a quantized matrix whose rows are
    whole steps, in blocks of 32 columns or more (Q8_0, Q4_0, Q5_1..), or `grouped` (the K-quants, Q6_K's 16-column
    blocks too)."""
    if w.kind not in RUNS or not 2 <= n <= MAX_TOKENS or w.cols % (RUN * RUNS[w.kind]):
        return False
    return w.block_log2 >= 5 or grouped(w)


def grouped(w: DeviceMatrix) -> bool:
    """Sub-scaled blocks whose (d, dmin) groups cover a step, of 32 columns with biases (Q4_K, Q5_K: uint16 sub
    words) or of 16 without (Q6_K, Q3_K: uint8): `_kernel` loads a step's scale word once and its sub words four
    bytes or eight in one load (other matrices: a scale and a sub word per run)."""
    if not w.sub_scaled or (w.block_log2, w.has_bias) not in ((5, True), (4, False)):
        return False
    return 1 << w.group_log2 >= (RUN * RUNS[w.kind]) >> w.block_log2


def mmq(w: DeviceMatrix, x, out, stream=0, parts: int = PARTS) -> None:
    """out[n, rows] (a device array or an Epilogue) = x[n, cols] @ W.T, x quantized in `parts` (see `quantize`) by
    the product's blocks where they do (`quantizes_itself`), else here."""
    n = x.shape[0]
    qx = float_x(x, parts) if quantizes_itself(n) else quantize(x, scratch(n, x.shape[1], parts, stream), stream)
    product(w, qx, out, stream)


def quantizes_itself(n: int) -> bool:
    """Whether a product of n tokens takes x as floats (`float_x`), its blocks quantizing it: one token tile (a step's
    x of 8 tokens is q4's 4 runs x 8 tokens, a run to 8 lanes: one 16-byte load a thread of 8 warps). The ~7 us
    quantize launch before a verify block's or a decode batch's every product saved; beyond, every block would
    quantize more tokens than its lanes take in one load."""
    return n <= TOKEN_TILE


def float_x(x, parts: int = PARTS, norm: tuple | None = None) -> FloatX:
    """x [n, cols] (float32, n up to TOKEN_TILE, cols a multiple of 64) for products that quantize it in `parts`
    themselves; norm: (weight [cols], eps) for RMSNorm(x) * weight (as `quantize`)."""
    n, cols = x.shape
    if cols % (2 * RUN) or not 1 <= n <= TOKEN_TILE or parts not in (1, 2):
        raise ValueError(f"mmq's blocks quantize 1..{TOKEN_TILE} tokens of a multiple of {2 * RUN} columns in 1 or 2 "
                         f"int8 parts, not {x.shape} in {parts}")
    return FloatX(x, _xnorm(x, norm), parts)


def _xnorm(x, norm: tuple | None) -> tuple:
    """`_quantize_kernel`'s xnorm: (weight, eps, True) of a norm, else a stand-in."""
    return (x[0], np.float32(0), False) if norm is None else (norm[0], np.float32(norm[1]), True)


def padded(n: int) -> int:
    return blocks(n, TOKEN_TILE) * TOKEN_TILE


def scratch(n: int, cols: int, parts: int = PARTS, stream=0) -> QuantizedX:
    """Device arrays for `quantize` of n tokens of `cols` columns in `parts` (1 or 2) int8 parts."""
    if parts not in (1, 2):
        raise ValueError(f"x goes to the tensor cores in 1 or 2 int8 parts, not {parts}")
    n_pad = padded(n)
    return QuantizedX(cuda.device_array((parts * n_pad, cols // 4), np.uint32, stream=stream),
                      cuda.device_array((cols // RUN, 2 * n_pad), np.float32, stream=stream), n)


def quantize(x, into: QuantizedX, stream=0, norm: tuple | None = None) -> QuantizedX:
    """x [n, cols] (float32, cols a multiple of 64) as int8 codes per 32-column run (see the module's notes) into
    arrays from `scratch` (their parts); padding tokens get zero codes and scales. norm: (weight [cols], eps) to
    quantize RMSNorm(x) * weight instead (the launch that would normalize x saved)."""
    n, cols = x.shape
    if cols % (2 * RUN) or not 1 <= n <= MAX_TOKENS:
        raise ValueError(f"mmq quantizes 1..{MAX_TOKENS} tokens of a multiple of {2 * RUN} columns, not {x.shape}")
    qx = into._replace(n=n)
    if qx.n_pad != padded(n) or qx.words.shape[1] != cols // 4 or qx.scales.shape[0] != cols // RUN:
        raise ValueError(f"scratch of shapes {qx.words.shape}, {qx.scales.shape} for x of {x.shape}")
    grid = (qx.n_pad, blocks(cols // RUN, QUANTIZE_THREADS // RUN_LANES))
    _quantize_kernel[grid, QUANTIZE_THREADS, stream](x, _xnorm(x, norm), qx.words, qx.scales)
    return qx


@cuda.jit(device=True, inline=True)
def x_word(run, k):
    """Where word k (columns 4k..4k+3) of a run goes in a token's row of QuantizedX.words: the 16 words of runs 2p
    and 2p + 1 as lane q's B fragments of both, (run 2p: cols 4q.., 16 + 4q..; run 2p + 1: the same) for q = 0..3."""
    return 16 * (run >> 1) + 4 * (k & 3) + 2 * (run & 1) + (k >> 2)


@jit_kernel
def _quantize_kernel(x, xnorm, words, scales):
    """Block (t, b): token t's runs from b x (threads / RUN_LANES) on (a padding token: zeros), RUN_LANES lanes a run
    (`_run_words`), one 16-byte load of x a lane, every block's at once: a block a token walking its runs in turn
    waited on a load per 16 runs, 8 of 4096 columns, 24 of 12288 (H100, 16 tokens: 7 and 19 us between a product
    with this launch and without). Normalized first where xnorm says so (RMSNorm as
    `norm.rmsnorm` defines it: the row's squares summed by the block's first warp, `_inv_rms`, shared with the
    others); two parts where `words` has rows for them."""
    await_grid()
    t = cuda.blockIdx.x
    runs, n_pad = scales.shape[0], scales.shape[1] // 2
    r = cuda.blockIdx.y * (cuda.blockDim.x // RUN_LANES) + cuda.threadIdx.x // RUN_LANES
    k = cuda.threadIdx.x % RUN_LANES  # this lane's word of the run
    c = RUN * r + 4 * k
    real = t < x.shape[0] and r < runs
    v0, v1, v2, v3 = load_f32x4(x, t, c) if real else _ZEROS4
    norm_w, eps, on = xnorm
    if on:
        w0, w1, w2, w3 = load4(norm_w, c) if real else _ZEROS4
        shared = cuda.shared.array(1, np.float32)
        first_warp = cuda.threadIdx.x < WARP
        inv_rms = _inv_rms(x, t, first_warp and t < x.shape[0], eps)  # (every warp: the simulator's shuffles)
        if cuda.threadIdx.x == 0:
            shared[0] = inv_rms
        cuda.syncthreads()
        if real:
            v0, v1, v2, v3 = _normed(v0, v1, v2, v3, shared[0], w0, w1, w2, w3)
    two = words.shape[0] > n_pad
    hi, lo, scale, minus_sum = _run_words(v0, v1, v2, v3, two)
    if r < runs:
        words[t, x_word(r, k)] = hi
        if two:
            words[n_pad + t, x_word(r, k)] = lo
        if k == 0:
            scales[r, 2 * t], scales[r, 2 * t + 1] = scale, minus_sum


@cuda.jit(device=True, inline=True)
def _inv_rms(x, t, real, eps):
    """1 / RMS of token t's row (eps added), for every lane of the calling warp: lane l's squares of columns 4l.., 4l
    + 128.. in order, then the warp's butterfly. One warp's sum, in one order, wherever it is computed: so the
    products that quantize x themselves (`_kernel`) get `_quantize_kernel`'s bits."""
    ss = np.float32(0)
    for c in range(4 * (cuda.threadIdx.x % WARP), x.shape[1] if real else 0, 4 * WARP):
        v0, v1, v2, v3 = load_f32x4(x, t, c)
        ss += v0 * v0 + v1 * v1 + v2 * v2 + v3 * v3
    return np.float32(1) / math.sqrt(warp_sum(ss) / np.float32(x.shape[1]) + eps)


@cuda.jit(device=True, inline=True)
def _normed(v0, v1, v2, v3, inv_rms, w0, w1, w2, w3):
    """Four columns of x (v0..v3) times inv_rms x their norm weights (w0..w3)."""
    return v0 * (inv_rms * w0), v1 * (inv_rms * w1), v2 * (inv_rms * w2), v3 * (inv_rms * w3)


@cuda.jit(device=True, inline=True)
def _run_words(v0, v1, v2, v3, two):
    """A run quantized by its RUN_LANES lanes (an aligned group of a warp), lane k holding its columns 4k..4k + 3
    (v0..v3): this lane's word of hi codes and of lo codes (two parts, else 0) and the run's scale and minus its sum
    (the same on every lane of the group). d = max|x| / 127, hi = round(x / d), lo = round((x - d hi) / u), u = d /
    256 (as matvec._quantize_x). Called in block-uniform control flow (the simulator's shuffles are barriers)."""
    amax = max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3)))
    total = v0 + v1 + v2 + v3
    for offset in (4, 2, 1):
        amax = max(amax, warp_shfl_xor(amax, offset))
        total += warp_shfl_xor(total, offset)
    inv = HI_STEPS / amax if amax > np.float32(0) else np.float32(0)
    d = amax / HI_STEPS
    h0, h1, h2, h3 = _nearest(v0 * inv), _nearest(v1 * inv), _nearest(v2 * inv), _nearest(v3 * inv)
    if not two:
        return _pack4(h0, h1, h2, h3), np.uint32(0), d, -total
    lo_inv = inv * np.float32(256)
    lo0 = min(_nearest((v0 - np.float32(h0) * d) * lo_inv), 127)
    lo1 = min(_nearest((v1 - np.float32(h1) * d) * lo_inv), 127)
    lo2 = min(_nearest((v2 - np.float32(h2) * d) * lo_inv), 127)
    lo3 = min(_nearest((v3 - np.float32(h3) * d) * lo_inv), 127)
    return _pack4(h0, h1, h2, h3), _pack4(lo0, lo1, lo2, lo3), d / np.float32(256), -total


# ---- a lane's A fragments of a pair of runs, from its warp's staged step: words of rows g (lo) and g + 8 (hi) --
# A warp's step of weights sits in shared memory [row, word]: the code words of its runs, then q6's high words (two
# a run), as the rows hold them. One ldmatrix .x4 of 8-row matrices of 16 bytes gives lane (g, q) word q of rows g
# and g + 8 at two places of the row at once, as the A fragments want them.


@cuda.jit(device=True, inline=True)
def _matrices(w_s, wb, col, lane):
    """Rows 0-7 and 8-15 at words col.., then at col + 4.. (lanes 8m .. 8m + 7 address matrix m's rows)."""
    return load_matrix_x4(w_s, wb, (lane & 7) + ((lane >> 3) & 1) * 8, col + 4 * (lane >> 4))


@cuda.jit(device=True, inline=True)
def _q4_run(lo, hi):
    return lo & LOW_NIBBLES, hi & LOW_NIBBLES, (lo >> np.uint32(4)) & LOW_NIBBLES, (hi >> np.uint32(4)) & LOW_NIBBLES


@cuda.jit(device=True, inline=True)
def _q4_pair(w_s, wb, p, runs, lane):
    lo0, hi0, lo1, hi1 = _matrices(w_s, wb, 8 * p, lane)
    return _q4_run(lo0, hi0), _q4_run(lo1, hi1)


@cuda.jit(device=True, inline=True)
def _signed(codes):
    """Bytes c in 0..63 (q6 codes + 32) as the signed bytes c - 32: no borrow crosses a byte with bit 7 set."""
    return ((codes | SIGN_BITS) - Q6_BYTES) ^ SIGN_BITS


@cuda.jit(device=True, inline=True)
def _q6_run(lo, hi, lo_high0, lo_high1, hi_high0, hi_high1, q):
    return (_signed(q6_word(lo, lo_high0, q)), _signed(q6_word(hi, hi_high0, q)),
            _signed(q6_word(lo, lo_high1, 4 + q)), _signed(q6_word(hi, hi_high1, 4 + q)))


@cuda.jit(device=True, inline=True)
def _q6_pair(w_s, wb, p, runs, lane):
    lo0, hi0, lo1, hi1 = _matrices(w_s, wb, 8 * p, lane)
    g, q = lane >> 2, lane & 3
    h = 4 * runs + 4 * p  # the pair's high words, after the step's code words
    return (_q6_run(lo0, hi0, w_s[wb, g, h], w_s[wb, g, h + 1], w_s[wb, g + 8, h], w_s[wb, g + 8, h + 1], q),
            _q6_run(lo1, hi1, w_s[wb, g, h + 2], w_s[wb, g, h + 3], w_s[wb, g + 8, h + 2], w_s[wb, g + 8, h + 3], q))


@cuda.jit(device=True, inline=True)
def _q8_pair(w_s, wb, p, runs, lane):
    return _matrices(w_s, wb, 16 * p, lane), _matrices(w_s, wb, 16 * p + 8, lane)


_PAIRS = {"q4": _q4_pair, "q6": _q6_pair, "q8": _q8_pair}
STAGED_WORDS = {"q4": (4, 0), "q6": (4, 2), "q8": (8, 0)}  # (code words, high words) of a row and run


class Plan(NamedTuple):
    """How `product` cuts a matrix: blocks of `warps` warps of TILE_ROWS rows each, `splits` blocks sharing a row
    tile's columns in ranges of whole RUNS[kind] steps, steps // splits each and one more for the first steps %
    splits (`_kernel`)."""

    warps: int
    splits: int


def plan(w: DeviceMatrix) -> Plan:
    """Row tiles of MAX_WARPS warps (every warp of a block reads the same x at once: one L2 read per block), and as
    many splits of the columns (any number, MIN_STEPS steps each at least) as fill a wave of resident blocks: the
    1.5B's down product (12 row tiles, 70 steps) takes 17 (204 blocks), where powers of two dividing the steps gave
    it 2 (24 blocks on 132 SMs). The shape alone decides: a token's sums must be in the same order whatever n."""
    steps = w.cols // (RUN * RUNS[w.kind])
    warps = min(MAX_WARPS, blocks(w.rows, TILE_ROWS))
    tiles = blocks(w.rows, TILE_ROWS * warps)
    slots = sm_count() * max(RESIDENT_WARPS // warps, 1)
    return Plan(warps, max(1, min(slots // tiles, steps // MIN_STEPS)))


class Partials(NamedTuple):
    """Scratch of a product whose columns `plan` splits: the splits' sums float32 [splits, n_pad, rows rounded up to
    4] (16-byte rows: the last block reads them 4 rows at a time), and a ticket per row tile int32 (zeros: the
    blocks of a row tile count themselves in, and its last one sets it back to 0 for the next product)."""

    sums: object
    tickets: object


def partials(w: DeviceMatrix, n: int, stream=0) -> Partials | None:
    """Scratch for the partial sums of a product of n tokens of w where `plan` splits its columns, else None."""
    p = plan(w)
    if p.splits == 1:
        return None
    sums = cuda.device_array((p.splits, padded(n), blocks(w.rows, 4) * 4), np.float32, stream=stream)
    return Partials(sums, device_zeros((blocks(w.rows, TILE_ROWS * p.warps),), np.int32, stream))


def product(w: DeviceMatrix, qx: QuantizedX | FloatX, out, stream=0, scratch_sums=None) -> None:
    """out (an array [n, rows] or an Epilogue) = the product of w and x, quantized (`quantize`) or as floats that
    the product's blocks quantize (`float_x`) (see `serves`); scratch_sums: `partials(w, n)` (made here if None)."""
    floats = isinstance(qx, FloatX)
    cols = qx.x.shape[1] if floats else qx.words.shape[1] * 4
    if not serves(w, qx.n) or cols != w.cols:
        raise ValueError(f"mmq does not take {qx.n} tokens of {cols} columns of a {w.kind} "
                         f"{w.rows}x{w.cols} matrix in blocks of {1 << w.block_log2}")
    ep = as_epilogue(out)
    p = plan(w)
    by_step, tiles = grouped(w), qx.n_pad // TOKEN_TILE
    kernel = _kernel(w.kind, w.block_log2 == 4, w.has_bias, by_step, tiles, qx.parts, p.warps if floats else 0)
    grid = (blocks(w.rows, TILE_ROWS * p.warps), p.splits)
    # a step's sub words of a row in one load: 4 or 8 bytes (a stand-in where not grouped)
    subs = w.subs.view(sub_type(w.kind, w.block_log2, w.has_bias, tiles, qx.parts)) if by_step else w.codes
    xa, xb = (qx.x, qx.xnorm) if floats else (qx.words, qx.scales)
    if p.splits == 1:
        kernel[grid, p.warps * WARP, stream](w.quant, subs, xa, xb, ep, qx.n, _no_partials())
        return
    part = partials(w, qx.n, stream) if scratch_sums is None else scratch_sums
    if part.sums.shape[:2] != (p.splits, qx.n_pad) or part.sums.shape[2] < w.rows or part.tickets.size != grid[0]:
        raise ValueError(f"partial sums of shape {part.sums.shape}, {part.tickets.size} tickets for {p.splits} "
                         f"splits of {qx.n} tokens x {w.rows} rows")
    kernel[grid, p.warps * WARP, stream](w.quant, subs, xa, xb, ep, qx.n, part)
    if not last_block_reduces(tiles):
        _reduce_kernel[blocks(qx.n * w.rows, REDUCE_THREADS), REDUCE_THREADS, stream](part.sums, ep, qx.n, w.rows)


def last_block_reduces(tiles: int) -> bool:
    """Whether the splits' sums of a product of `tiles` token tiles are added by each row tile's last block to finish
    (`_kernel`: no second launch, ~5 us on an H100) rather than by `_reduce_kernel`: up to LAST_BLOCK_TILES, where
    that block's reads at L2 (splits x tokens x its rows) stay small; beyond, one block reading them all would take
    longer than a launch spread over the GPU. The same sums in the same order either way: the same bits."""
    return tiles <= LAST_BLOCK_TILES


def _step_runs(kind: str, tiles: int, parts: int) -> int:
    """Runs a step of `_kernel`: RUNS[kind], but two where the tokens' accumulators and x's parts leave no registers
    for a second buffer of four (ptxas, sm_90: q4 at 32 tokens in two parts spilled 392 bytes with four, its codes
    in registers then). The sums' order is the same (runs one after another, splits of whole RUNS[kind] steps)."""
    return RUNS[kind] if tiles * parts <= 2 else min(RUNS[kind], 2)


def sub_type(kind: str, block_log2: int, bias: bool, tiles: int, parts: int):
    """The words `_kernel` reads a grouped matrix's sub words in: a step's of a row (uint32 or uint64)."""
    step_bytes = (_step_runs(kind, tiles, parts) * RUN >> block_log2) * (2 if bias else 1)
    return np.uint64 if step_bytes == 8 else np.uint32


@functools.cache
def _no_partials() -> Partials:
    """The partial sums' stand-in where the columns are not split (never read or written)."""
    return Partials(cuda.device_array((1, 1, 4), np.float32), cuda.device_array(1, np.int32))


@jit_kernel
def _reduce_kernel(sums, ep, n, rows):
    """Thread i: row i % rows of token i // rows, its splits' partial sums added in order, to ep (a gated product's
    gate rows take their up rows', TILE_ROWS // 2 further; the up rows' threads store nothing)."""
    await_grid()
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i >= n * rows:
        return
    t, r = i // rows, i % rows
    gated = ep.gate != NO_GATE
    if gated and r % TILE_ROWS >= TILE_ROWS // 2:
        return
    v = np.float32(0)
    for k in range(sums.shape[0]):
        v += sums[k, t, r]
    if gated:
        u = np.float32(0)
        for k in range(sums.shape[0]):
            u += sums[k, t, r + TILE_ROWS // 2]
        put_gated(ep, t, r, v, u)
    else:
        put(ep, t, r, v)


@cuda.jit(device=True, inline=True)
def _last_block_adds(part, ep, n, last):
    """After a block of a split product stored its partial sums: the row tile's last block to get here adds every
    split's sums of its rows in order (as `_reduce_kernel` adds them: the same bits) and puts them into ep, then sets
    the tile's ticket back to 0 (a graph replays the product with the same tickets). A thread takes 4 rows of a token
    at a time (a gated product's 4 gate rows and their up rows), read at L2."""
    tile = cuda.blockIdx.x
    done = cuda.shared.array(1, np.int32)
    cuda.threadfence()  # this block's sums are visible to the tile's last block before it counts this one
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        done[0] = cuda.atomic.add(part.tickets, tile, 1) == cuda.gridDim.y - 1
    cuda.syncthreads()
    if not done[0]:
        return
    quads = cuda.blockDim.x // WARP * TILE_ROWS // 4
    gated = ep.gate != NO_GATE
    for i in range(cuda.threadIdx.x, n * quads, cuda.blockDim.x):
        t, r = i // quads, (tile * quads + i % quads) * 4
        if r > last or (gated and r % TILE_ROWS >= TILE_ROWS // 2):
            continue
        v0, v1, v2, v3 = _split_sums(part.sums, t, r)
        if gated:
            u0, u1, u2, u3 = _split_sums(part.sums, t, r + TILE_ROWS // 2)
            put_gated(ep, t, r, v0, u0)
            put_gated(ep, t, r + 1, v1, u1)
            put_gated(ep, t, r + 2, v2, u2)
            put_gated(ep, t, r + 3, v3, u3)
        else:
            put(ep, t, r, v0)
            for c, v in ((1, v1), (2, v2), (3, v3)):
                if r + c <= last:
                    put(ep, t, r + c, v)
    if cuda.threadIdx.x == 0:
        part.tickets[tile] = 0


@cuda.jit(device=True, inline=True)
def _split_sums(sums, t, r):
    """Rows r..r + 3 of token t, every split's sums added in order from 0; four splits' loads at a time in flight
    (one chain of L2 latencies per split is what would cost)."""
    v0 = v1 = v2 = v3 = np.float32(0)
    splits = sums.shape[0]
    for k in range(0, splits - splits % 4, 4):
        a0, a1, a2, a3 = load_f32x4_l2(sums, k, t, r)
        b0, b1, b2, b3 = load_f32x4_l2(sums, k + 1, t, r)
        c0, c1, c2, c3 = load_f32x4_l2(sums, k + 2, t, r)
        d0, d1, d2, d3 = load_f32x4_l2(sums, k + 3, t, r)
        v0 = v0 + a0 + b0 + c0 + d0
        v1 = v1 + a1 + b1 + c1 + d1
        v2 = v2 + a2 + b2 + c2 + d2
        v3 = v3 + a3 + b3 + c3 + d3
    for k in range(splits - splits % 4, splits):
        a0, a1, a2, a3 = load_f32x4_l2(sums, k, t, r)
        v0, v1, v2, v3 = v0 + a0, v1 + a1, v2 + a2, v3 + a3
    return v0, v1, v2, v3


@cuda.jit(device=True, inline=True)
def _block_scale(scale_word, sub, sub_scaled, bias):
    """(scale, dmin x sub_min: minus the bias) of a block of 32 columns or more from its group's scale word and its
    sub word (scale_bias's factors, the bias's sign left to x's sums)."""
    d, dmin = half2_floats(scale_word)
    if sub_scaled:
        d *= np.float32(signed_byte(sub))
        dmin *= np.float32(signed_byte(sub >> np.uint32(8)))
    return d, dmin if bias else np.float32(0)


@cuda.jit(device=True, inline=True)
def _halves_scale(scale_word, sub0, sub1):
    """(d, first sub-scale, second sub-scale) of a run of two 16-column blocks of one group (see serves)."""
    d, _ = half2_floats(scale_word)
    return d, np.float32(signed_byte(sub0)), np.float32(signed_byte(sub1))


@cuda.jit(device=True, inline=True)
def _exact(biased):
    """The float32 of an mma's int32 sum s from its result with C = MAGIC (MAGIC + s, |s| < 2^22): those bits are
    the float 1.5 * 2^23 + s, whose subtraction leaves s exactly. An add on the FMA pipe where cvt.rn.f32.s32 takes
    the conversion unit (a quarter of its rate, four per token tile and run)."""
    return bits_f32(biased) - MAGIC_FLOAT


@cuda.jit(device=True, inline=True)
def _joined(hi, lo, two):
    """The float32 of 256 hi + lo (the parts' int32 sums, as mma results with C = MAGIC), rounded once as a
    conversion of the int32 join would round it (exact below 2^24); hi alone with one part."""
    if two:
        return _exact(hi) * np.float32(256) + _exact(lo)
    return _exact(hi)


@cuda.jit(device=True, inline=True)
def _hi_lo(a, xh, xl, two):
    """A's product with x's hi part (B words xh), joined with its lo part's (xl) where x has two (256 hi + lo), k32,
    as float32."""
    m = MAGIC
    c0, c1, c2, c3 = mma_s8_16832(a[0], a[1], a[2], a[3], xh[0], xh[1], m, m, m, m)
    e0, e1, e2, e3 = mma_s8_16832(a[0], a[1], a[2], a[3], xl[0], xl[1], m, m, m, m) if two else (c0, c1, c2, c3)
    return _joined(c0, e0, two), _joined(c1, e1, two), _joined(c2, e2, two), _joined(c3, e3, two)


@cuda.jit(device=True, inline=True)
def _hi_lo16(a0, a1, xh, xl, two):
    """`_hi_lo` of a k16 mma: A (a0, a1) times x's parts (one B word each)."""
    m = MAGIC
    c0, c1, c2, c3 = mma_s8_16816(a0, a1, xh, m, m, m, m)
    e0, e1, e2, e3 = mma_s8_16816(a0, a1, xl, m, m, m, m) if two else (c0, c1, c2, c3)
    return _joined(c0, e0, two), _joined(c1, e1, two), _joined(c2, e2, two), _joined(c3, e3, two)


@cuda.jit(device=True, inline=True)
def _block_products(a, xh, xl, lo, hi, d0, neg0, d1, neg1, acc, j, bias, two):
    """One 32-column block of rows g (lo: its scale, minus bias) and g + 8 (hi) for tokens 2q, 2q + 1 of tile j: the
    sums (A a times x's parts xh, xl) times scale x the token's scale, plus the bias x the token's sum of x
    (minus bias x minus sum: products added, which the compiler fuses, where a product subtracted it does not)
    where the matrix has biases."""
    c0, c1, c2, c3 = _hi_lo(a, xh, xl, two)
    acc[4 * j] += c0 * (lo[0] * d0)
    acc[4 * j + 1] += c1 * (lo[0] * d1)
    acc[4 * j + 2] += c2 * (hi[0] * d0)
    acc[4 * j + 3] += c3 * (hi[0] * d1)
    if bias:
        acc[4 * j] += lo[1] * neg0
        acc[4 * j + 1] += lo[1] * neg1
        acc[4 * j + 2] += hi[1] * neg0
        acc[4 * j + 3] += hi[1] * neg1


@cuda.jit(device=True, inline=True)
def _halves_products(a, xh, xl, lo, hi, d0, neg0, d1, neg1, acc, j, bias, two):
    """Two 16-column blocks (one k16 mma each, per part of x) of one group: their int32 sums combined by the
    sub-scales (in float32: exact for one part, |sum| <= 2^16 and |sub-scale| <= 2^7; within float32's rounding for
    two), then times d x the token's scale (no biases: see serves)."""
    e0, e1, e2, e3 = _hi_lo16(a[0], a[1], xh[0], xl[0], two)
    f0, f1, f2, f3 = _hi_lo16(a[2], a[3], xh[1], xl[1], two)
    acc[4 * j] += (e0 * lo[1] + f0 * lo[2]) * (lo[0] * d0)
    acc[4 * j + 1] += (e1 * lo[1] + f1 * lo[2]) * (lo[0] * d1)
    acc[4 * j + 2] += (e2 * hi[1] + f2 * hi[2]) * (hi[0] * d0)
    acc[4 * j + 3] += (e3 * hi[1] + f3 * hi[2]) * (hi[0] * d1)


@functools.cache
def _kernel(kind: str, halves: bool, bias: bool, by_step: bool, tiles: int, parts: int, quantizing: int = 0):
    """The product of `tiles` token tiles for `kind` (halves: 16-column blocks, two k16 mmas a run; bias: the matrix
    has biases; by_step: scale words loaded once a step, see `grouped`; parts: x's int8 parts): block (b, k) does
    rows b * 16 warps.. (16 a warp) over the k-th of the grid's y splits of the steps. x comes quantized
    (`QuantizedX`: words, scales), or, where `quantizing` gives the blocks' warps (one token tile), as floats that
    each block quantizes itself step by step (`FloatX`: x, xnorm)."""
    two = parts == 2
    pair_fragments = _PAIRS[kind]
    runs = _step_runs(kind, tiles, parts)
    block_log2 = 4 if halves else 5  # (by_step: see `grouped`)
    sub_bytes = 2 if bias else 1
    sub_words = (runs * RUN >> block_log2) * sub_bytes // 4  # a step's sub words of a row (by_step): one load
    # per row: the step's scale word and sub words (by_step), or each run's scale and sub words
    row_words = 1 + sub_words if by_step else 2 * runs
    step_words = 2 * row_words  # a lane's words of a step: rows g and g + 8
    outputs = 4 * tiles  # a lane's accumulators: per token tile rows g, g + 8 x two tokens
    products = _halves_products if halves else _block_products
    reduces = last_block_reduces(tiles)
    plan_step = RUNS[kind] // runs  # the kernel's steps in a step of `plan` (whole RUNS[kind] runs)

    @cuda.jit(device=True, inline=True)
    def load_step(w, subs, rows, step, buf, prev, fresh):
        """This lane's scale words of a step, rows g and g + 8 (see row_words): loads only, decoded where they are
        used. A group's scale word (by_step) is loaded at its first step (or a `fresh` start) and else copied from
        prev, the step before's words (steps never straddle groups: see `grouped`)."""
        for h in range(2):
            r = rows[h]
            o = h * row_words
            first = (RUN * step * runs) >> w.block_log2  # the step's first block
            if by_step:
                if fresh or first & ((1 << w.group_log2) - 1) == 0:
                    buf[o] = np.uint32(w.scales[r, first >> w.group_log2])
                else:
                    buf[o] = prev[o]
                if sub_words == 2:  # subs: uint64 (see sub_type)
                    both = subs[r, (first * sub_bytes) >> 3]
                    buf[o + 1], buf[o + 2] = np.uint32(both & np.uint64(0xFFFFFFFF)), np.uint32(both >> np.uint64(32))
                else:
                    buf[o + 1] = subs[r, (first * sub_bytes) >> 2]
            else:
                for u in range(runs):
                    buf[o + 2 * u], buf[o + 2 * u + 1] = block_words(w, r, first + u)

    code_words, high_words = STAGED_WORDS[kind]
    plan_step_words = code_words * RUNS[kind]  # a row's code words of a step of `plan`
    code_chunks = runs * code_words // 4  # 16-byte chunks of a row's step: its code words, then its high words
    row_chunks = code_chunks + runs * high_words // 4
    # an odd number of chunks a staged row, so that ldmatrix's 8 rows of 16 bytes fall on distinct banks
    # the block's staged weights: [2 warp + buffer, row, word] (shapes: constants of the closure, not arithmetic)
    w_shape = (2 * MAX_WARPS, TILE_ROWS, 4 * (row_chunks + 1 - row_chunks % 2))
    stride = w_shape[2]

    @cuda.jit(device=True, inline=True)
    def stage_w(w, step, wb, first, last, lane, w_s):
        """Start copying the warp's rows' codes (and high words) of a step into w_s[wb], 16 bytes a lane: lanes 2i
        and 2i + 1 row i's chunks in turn (a lane's row and chunks the same every step)."""
        row, h = lane >> 1, lane & 1
        r = min(first + row, last)
        for k in range((row_chunks + 1) // 2):
            piece = 2 * k + h
            at = (wb * TILE_ROWS + row) * stride + 4 * piece
            if 2 * k + 1 < code_chunks or (2 * k < code_chunks and h == 0):
                copy_async16(w_s, at, w.codes, r, step * runs * code_words + 4 * piece)
            elif piece < row_chunks:
                copy_async16(w_s, at, w.high, r, step * runs * high_words + 4 * (piece - code_chunks))


    @cuda.jit(device=True, inline=True)
    def sub_of(buf, o, block):
        """The sub word (scale byte, then min byte where there are biases) of the step's block `block`, from the
        row's sub words at buf[o:]."""
        at = block * sub_bytes
        return buf[o + (at >> 2)] >> np.uint32(8 * (at & 3))

    @cuda.jit(device=True, inline=True)
    def scales_of(w, buf, h, u):
        """Row h's (0: g, 1: g + 8) scale factors of the step's run u (see _block_scale, _halves_scale)."""
        o = h * row_words
        if not by_step:
            return _block_scale(buf[o + 2 * u], buf[o + 2 * u + 1], w.sub_scaled, bias)
        if halves:
            return _halves_scale(buf[o], sub_of(buf, o + 1, 2 * u), sub_of(buf, o + 1, 2 * u + 1))
        return _block_scale(buf[o], sub_of(buf, o + 1, u), True, bias)

    n_pad = TOKEN_TILE * tiles
    pairs = runs // 2
    # a step of x in shared memory, per buffer: words [part, pair, token, 16] (a token's pair of runs: lane q's B
    # words of both at 4q, so that a warp's 16-byte reads of 8 tokens cover the 32 banks twice, without conflicts),
    # then scales [run, 2 n_pad] (as QuantizedX.scales' rows)
    x_words = parts * pairs * n_pad * 16
    x_scales = runs * 2 * n_pad
    lo_words = pairs * n_pad * 16  # where the lo part's words begin
    x_sizes = (2 * x_words, 2 * x_scales)  # both buffers

    @cuda.jit(device=True, inline=True)
    def stage_x(xw, xs, step, b, xw_s, xs_s):
        """Start copying a step of x (its words and scales) into buffer b, 16 bytes a thread in turn."""
        for i in range(cuda.threadIdx.x, x_words // 4, cuda.blockDim.x):
            t, pp = (i >> 2) % n_pad, (i >> 2) // n_pad  # (token, part x pairs + pair) of the 4 words at 4i
            copy_async16(xw_s, b * x_words + 4 * i, xw, (pp // pairs) * n_pad + t,
                         16 * (step * pairs + pp % pairs) + 4 * (i & 3))
        for i in range(cuda.threadIdx.x, x_scales // 4, cuda.blockDim.x):
            copy_async16(xs_s, b * x_scales + 4 * i, xs, step * runs + i // (n_pad // 2), 4 * (i % (n_pad // 2)))

    @cuda.jit(device=True, inline=True)
    def copy_first(xw, xs, begin, end, xr, inv_s, xw_s, xs_s):
        stage_x(xw, xs, begin, 0, xw_s, xs_s)

    @cuda.jit(device=True, inline=True)
    def copy_next(xw, xs, s, end, b, xr, inv_s, xw_s, xs_s):
        stage_x(xw, xs, s, b, xw_s, xs_s)

    # where the blocks quantize x: a step's units (token u % n_pad, run u // n_pad of the step), RUN_LANES lanes a
    # unit, the block's lane groups taking units g, g + groups, .. (`per_thread` of them, one where 8 warps quantize
    # q4's 4 runs of 8 tokens); a unit's 4 columns of x, then the norm's 4 weights, in xr
    groups = max(quantizing, 1) * WARP // RUN_LANES
    units = n_pad * runs
    per_thread = blocks(units, groups)
    fetched = 8 * per_thread  # xr's size

    @cuda.jit(device=True, inline=True)
    def fetch_x(x, xnorm, step, xr):
        """Start loading this thread's columns of x (and the norm's weights, where it normalizes) of a step into
        xr, to be used a step of products later (`put_x`); padding tokens get zeros."""
        norm_w, _, on = xnorm
        k = cuda.threadIdx.x % RUN_LANES
        for j in range(per_thread):
            u = cuda.threadIdx.x // RUN_LANES + j * groups
            c = RUN * (step * runs + u // n_pad) + 4 * k
            real = u < units and u % n_pad < x.shape[0]
            xr[8 * j], xr[8 * j + 1], xr[8 * j + 2], xr[8 * j + 3] = load_f32x4(x, u % n_pad, c) if real else _ZEROS4
            if on:
                xr[8 * j + 4], xr[8 * j + 5], xr[8 * j + 6], xr[8 * j + 7] = load4(norm_w, c) if real else _ZEROS4

    @cuda.jit(device=True, inline=True)
    def put_x(x, xnorm, xr, inv_s, b, xw_s, xs_s):
        """This thread's units of the step fetched into xr, normalized where xnorm says so and quantized as
        `_quantize_kernel` quantizes them (the same device functions: the same bits), into shared buffer b in
        `stage_x`'s layout."""
        _, _, on = xnorm
        k = cuda.threadIdx.x % RUN_LANES
        for j in range(per_thread):
            u = cuda.threadIdx.x // RUN_LANES + j * groups
            t, run = u % n_pad, u // n_pad
            v0, v1, v2, v3 = xr[8 * j], xr[8 * j + 1], xr[8 * j + 2], xr[8 * j + 3]
            if on and u < units and t < x.shape[0]:
                v0, v1, v2, v3 = _normed(v0, v1, v2, v3, inv_s[t], xr[8 * j + 4], xr[8 * j + 5], xr[8 * j + 6],
                                         xr[8 * j + 7])
            hi, lo, scale, minus_sum = _run_words(v0, v1, v2, v3, two)
            if u < units:
                at = b * x_words + ((run >> 1) * n_pad + t) * 16 + 4 * (k & 3) + 2 * (run & 1) + (k >> 2)
                xw_s[at] = hi
                if two:
                    xw_s[at + lo_words] = lo
                if k == 0:
                    xs_s[b * x_scales + run * 2 * n_pad + 2 * t] = scale
                    xs_s[b * x_scales + run * 2 * n_pad + 2 * t + 1] = minus_sum

    @cuda.jit(device=True, inline=True)
    def quantize_first(x, xnorm, begin, end, xr, inv_s, xw_s, xs_s):
        """The tokens' 1 / RMS where xnorm says so (a warp a token, as `_quantize_kernel`), the first step of x
        quantized into buffer 0, and the second's loads started."""
        _, eps, on = xnorm
        if on:
            warp = cuda.threadIdx.x // WARP
            for t0 in range(0, n_pad, quantizing):
                inv_rms = _inv_rms(x, t0 + warp, t0 + warp < x.shape[0], eps)
                if cuda.threadIdx.x % WARP == 0 and t0 + warp < n_pad:
                    inv_s[t0 + warp] = inv_rms
            cuda.syncthreads()
        fetch_x(x, xnorm, begin, xr)
        put_x(x, xnorm, xr, inv_s, 0, xw_s, xs_s)
        if begin + 1 < end:
            fetch_x(x, xnorm, begin + 1, xr)

    @cuda.jit(device=True, inline=True)
    def quantize_next(x, xnorm, s, end, b, xr, inv_s, xw_s, xs_s):
        """Step s of x (fetched a step ago) quantized into buffer b, and step s + 1's loads started."""
        put_x(x, xnorm, xr, inv_s, b, xw_s, xs_s)
        if s + 1 < end:
            fetch_x(x, xnorm, s + 1, xr)

    x_first, x_next = (quantize_first, quantize_next) if quantizing else (copy_first, copy_next)

    @jit_inlined
    def tile_run(args, j):
        """Token tile j's products of the step's run u: acc[4j..4j+3] (row g tokens 2q, 2q + 1, row g + 8 the
        same)."""
        a, xh, xl, xs_s, at, lo, hi, acc, q = args
        d0, neg0, d1, neg1 = load4(xs_s, at + 2 * TOKEN_TILE * j + 4 * q)
        products(a, xh, xl, lo, hi, d0, neg0, d1, neg1, acc, j, bias, two)

    @jit_inlined
    def tile_pair(args, j):
        """Token tile j's products of the step's runs 2p and 2p + 1 (one 16-byte read of this lane's B words of
        both, per part of x, from the staged step at b)."""
        xw_s, xs_s, b, p, frags, scales, acc, g, q = args
        at = b * x_words + (p * n_pad + TOKEN_TILE * j + g) * 16 + 4 * q
        b0, b1, b2, b3 = load4(xw_s, at)
        l0, l1, l2, l3 = load4(xw_s, at + lo_words) if two else (b0, b1, b2, b3)
        (lo0, hi0), (lo1, hi1) = scales
        s_at = b * x_scales + 2 * p * 2 * n_pad
        tile_run((frags[0], (b0, b1), (l0, l1), xs_s, s_at, lo0, hi0, acc, q), j)
        tile_run((frags[1], (b2, b3), (l2, l3), xs_s, s_at + 2 * n_pad, lo1, hi1, acc, q), j)

    tiles_pair = _unrolled(tile_pair, tiles)

    @jit_inlined
    def pair_step(args, p):
        """Runs 2p and 2p + 1 of the step staged in buffer b (its scale words in buf)."""
        w, w_s, xw_s, xs_s, b, buf, acc, lane = args
        g, q = lane >> 2, lane & 3
        u0, u1 = 2 * p, 2 * p + 1
        frags = pair_fragments(w_s, 2 * (cuda.threadIdx.x // WARP) + b, p, runs, lane)
        scales = ((scales_of(w, buf, 0, u0), scales_of(w, buf, 1, u0)),
                  (scales_of(w, buf, 0, u1), scales_of(w, buf, 1, u1)))
        tiles_pair((xw_s, xs_s, b, p, frags, scales, acc, g, q), 0)

    pairs_step = _unrolled(pair_step, pairs)

    @cuda.jit(device=True, inline=True)
    def stage(w, xa, xb, s, end, b, first, last, lane, w_s, xr, inv_s, xw_s, xs_s):
        """Start copying step s's codes (the warp's rows) into buffers b, and x (the block's share: copied, or
        quantized from xr): one group."""
        stage_w(w, s, 2 * (cuda.threadIdx.x // WARP) + b, first, last, lane, w_s)
        x_next(xa, xb, s, end, b, xr, inv_s, xw_s, xs_s)
        copy_async_commit()

    @cuda.jit(device=True, inline=True)
    def next_step(w, subs, rows, buf, prev, xa, xb, s, end, b, first, last, lane, w_s, xr, inv_s, xw_s, xs_s):
        """Step s's scale words into buf (prev: the step before's) and its codes and x into shared buffers b where
        s < end (the step before's copies then waited for), else the last copies waited for; a barrier (the step
        before's staged for all)."""
        if s < end:
            load_step(w, subs, rows, s, buf, prev, False)
            stage(w, xa, xb, s, end, b, first, last, lane, w_s, xr, inv_s, xw_s, xs_s)
            copy_async_wait_one()
        else:
            copy_async_wait_all()
        cuda.syncthreads()

    def kernel(w, subs, xa, xb, ep, n, part):
        acc = cuda.local.array(outputs, np.float32)
        xr = cuda.local.array(fetched, np.float32)
        inv_s = cuda.shared.array(n_pad, np.float32)
        buf_a = cuda.local.array(step_words, np.uint32)
        buf_b = cuda.local.array(step_words, np.uint32)
        w_s = cuda.shared.array(w_shape, np.uint32, alignment=ALIGN_16)
        xw_s = cuda.shared.array(x_sizes[0], np.uint32, alignment=ALIGN_16)
        xs_s = cuda.shared.array(x_sizes[1], np.float32, alignment=ALIGN_16)
        for i in range(outputs):
            acc[i] = np.float32(0)
        lane = cuda.threadIdx.x % WARP
        g, q = lane >> 2, lane & 3
        first = (cuda.blockIdx.x * (cuda.blockDim.x // WARP) + cuda.threadIdx.x // WARP) * TILE_ROWS
        last = w.codes.shape[0] - 1
        rows = (min(first + g, last), min(first + 8 + g, last))  # rows past the end load a real row, stored nowhere
        # the plan's steps, split k taking `fewer` of them or, the first `longer` splits, one more (the form with the
        # fewest registers: `k steps // splits` bounds spilled 8 bytes more at 64 tokens, ptxas sm_90)
        steps, k = w.codes.shape[1] // plan_step_words, cuda.blockIdx.y
        fewer = steps // cuda.gridDim.y
        longer = steps - fewer * cuda.gridDim.y
        begin = (k * fewer + min(k, longer)) * plan_step
        end = begin + (fewer + (k < longer)) * plan_step
        load_step(w, subs, rows, begin, buf_a, buf_b, True)  # constant weights: in flight before the wait
        stage_w(w, begin, 2 * (cuda.threadIdx.x // WARP), first, last, lane, w_s)
        await_grid()
        x_first(xa, xb, begin, end, xr, inv_s, xw_s, xs_s)
        copy_async_commit()
        # even steps: scale words in buf_a, codes and x in shared buffers 0; odd: buf_b, 1. Each step's loads and
        # copies are in flight while the step before computes; a barrier after a step's products keeps its buffers
        # until every warp is done
        for s in range(begin, end, 2):
            next_step(w, subs, rows, buf_b, buf_a, xa, xb, s + 1, end, 1, first, last, lane, w_s, xr, inv_s, xw_s,
                      xs_s)
            pairs_step((w, w_s, xw_s, xs_s, 0, buf_a, acc, lane), 0)
            cuda.syncthreads()
            if s + 1 < end:
                next_step(w, subs, rows, buf_a, buf_b, xa, xb, s + 2, end, 0, first, last, lane, w_s, xr, inv_s,
                          xw_s, xs_s)
                pairs_step((w, w_s, xw_s, xs_s, 1, buf_b, acc, lane), 0)
                cuda.syncthreads()
        gated = ep.gate != NO_GATE
        for j in range(tiles):
            for i in range(4):
                r, t = first + g + 8 * (i >> 1), TOKEN_TILE * j + 2 * q + (i & 1)
                if cuda.gridDim.y > 1:
                    if t < n and r <= last:
                        part.sums[cuda.blockIdx.y, t, r] = acc[4 * j + i]
                elif gated:  # rows g and g + 8 of a tile: a gate row and its up row
                    if i < 2 and t < n and r <= last:
                        put_gated(ep, t, r, acc[4 * j + i], acc[4 * j + i + 2])
                elif t < n and r <= last:
                    put(ep, t, r, acc[4 * j + i])
        if reduces and cuda.gridDim.y > 1:
            _last_block_adds(part, ep, n, last)

    kernel.__name__ = kernel.__qualname__ = (f"_mmq_{kind}{'_halves' * halves}{'_bias' * bias}{'_by_step' * by_step}"
                                             f"_tokens{TOKEN_TILE * tiles}_parts{parts}"
                                             f"{f'_quantizing{quantizing}' * bool(quantizing)}")
    return jit_bounded(kernel, MAX_WARPS * WARP, RESIDENT_WARPS // MAX_WARPS)
