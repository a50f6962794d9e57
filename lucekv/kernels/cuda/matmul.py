"""Prefill products out[n, rows] = x[n, cols] @ W.T on tensor cores.

Quantized weights (q4, q8) go through `mma.sync.m16n8k16`: float16 operands, float32 accumulators (float32
FMAs cannot come near the tensor cores' rate on prefill-sized products).
- Both operands are staged in shared memory as float16 pairs: a weight as `scale * code + bias` of its block,
  one halfwise fma on two exact f16 codes; x rounded once per product, before it (`stage_halves`: one small
  launch writes x's float16 pairs in the order the tile stages them, so that a thread copies 16 bytes of them
  per step: half the bytes of float32 x, which every row tile of the product reads again). Float16 storage
  costs about 4e-4 of a product's largest value (against float64, random inputs); llama.cpp rounds x to 8 bits
  per block there. So that no weight overflows or falls into f16's subnormals, each matrix is staged times a
  power of two that brings its largest weight near 2^14 (`DeviceMatrix.half_scale`), divided out of the float32
  sums at the store (exact). |x| must stay below 65504.
- A block computes 128 rows x 64 tokens (8 warps) or, for long prompts (`pick_tile`), 128 rows x 128 tokens
  (each weight is dequantized once per 128 tokens): the long tile, 16 warps (a thread stages a quarter row
  instead of a half), one block per SM, or the wide tile, 8 warps of 64 rows x 32 tokens, two blocks per SM
  where the product has blocks enough (fewer fragment loads and decodes per mma, and one block's barrier wait
  is the other's time to compute), per K_STEP = 32 columns; each warp of the others 32 rows x 32 tokens, 2 m16
  x 4 n8 tiles of 4 float32 accumulators per thread (the wide tile's 4 x 4). Shared memory holds two steps
  (double buffering: one barrier per step): 128 rows of weights and the tokens of x, rows of PAIRS words padded
  to STRIDE (16-byte aligned rows) so that the fragment loads hit 32 distinct banks. Fragments come from shared
  memory through `ldmatrix` .x4: per k16 slice, one per m-tile (A) and one per two n-tiles (B), 4 instructions
  for 8 mma (6 for 16 in the wide tile). Each step's global loads are issued two steps ahead (two register
  sets, even and odd steps). Registers are capped at 128 per thread: two 8-warp blocks per SM, or one 16-warp
  block. The grid's x runs over the token tiles: the blocks of one row tile, reading the same weights, run
  together.
- The order of k inside a step is free as long as A and B share it, so codes are staged in the order the
  packed bytes give them: a word with two 4-bit (8-bit) fields at bits 0 and 16, or'ed into the exponent
  of float16 1024, is two exact f16 codes after one `sub.f16x2`. Staged word j holds the columns
  (e, e + 2) with e = 4 (j // 4) + (j % 2) + 16 ((j // 2) % 2) for q4 (byte b of a 32-block holds column
  b in its low nibble, b + 16 in its high one) and e = 4 (j // 2) + j % 2 for q8; x is staged alike.
  Words 0..7 of a step are its first k16 slice: for q8 these hold columns 0..15, as 16-blocks need.
Dense (f32) weights, rare (small models' float matrices), keep a float32 FMA kernel: 64 x 64 tiles, each
thread 4 x 4 outputs in registers, X staged k-major so that a thread reads its 4 tokens and 4 rows of one k
from two short runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from lucekv.kernels.cuda._numba import (
    ALIGN_16,
    WARP,
    await_grid,
    blocks,
    cuda,
    fma_f16x2,
    jit_bounded,
    jit_kernel,
    load_f32x4,
    load_matrix_x4,
    load_u32x4,
    load_u32x4_coherent,
    mma_f16_16816,
    pack_half2,
    sm_count,
    store_u32x4,
    sub_f16x2,
)
from lucekv.kernels.cuda.packed import (
    GATE_ROWS,
    DeviceMatrix,
    as_epilogue,
    block_words,
    put,
    put_gated,
    q6_word,
    scale_bias,
)

ROWS = 128  # weight rows per block tile
TOKENS = 64  # tokens per block tile (the grouped MoE products use this tile too)
LONG_TOKENS = 128  # tokens per block tile for long prompts
LONG_PROMPT = 256  # from this many tokens on, the long tile where its blocks fill the GPU (see `pick_tile`)
K_STEP = 32  # columns per step: one q4 block, one or two q8 blocks
THREADS = 256
BLOCKS_PER_SM = 2  # registers capped at 128 per thread
WARP_TOKENS = 32
N_TILES = WARP_TOKENS // 8


class Tile(NamedTuple):
    """A block tile: ROWS rows x `tokens` tokens, each warp `warp_rows` rows x WARP_TOKENS tokens."""

    tokens: int
    warp_rows: int

    @property
    def row_warps(self) -> int:
        """Warps side by side over the rows; the rest over the tokens."""
        return ROWS // self.warp_rows

    @property
    def threads(self) -> int:
        return self.row_warps * self.tokens // WARP_TOKENS * WARP

    @property
    def m_tiles(self) -> int:
        return self.warp_rows // 16

    @property
    def name(self) -> str:
        return f"t{self.tokens}" + ("" if self.warp_rows == 32 else f"w{self.warp_rows}")


SHORT_TILE = Tile(TOKENS, 32)  # 8 warps: two blocks per SM
LONG_TILE = Tile(LONG_TOKENS, 32)  # 16 warps: each weight dequantized once per 128 tokens, one block per SM
WIDE_TILE = Tile(LONG_TOKENS, 64)  # 8 warps of 64 x 32: as LONG_TILE's dequantizing, two blocks per SM
TILE_SHAPES = (SHORT_TILE, LONG_TILE, WIDE_TILE)
PAIRS = K_STEP // 2  # f16 pairs per staged row and step
STRIDE = PAIRS + 4
MAGIC = np.uint32(0x64006400)  # two float16 1024.0: or'ed with fields below 1024, 1024 + field
MAGIC_SIGNED = np.uint32(0x64806480)  # two float16 1152.0 = 1024 + 128
MAGIC_Q6 = np.uint32(0x64206420)  # two float16 1056.0 = 1024 + Q6_OFFSET
SIGN_BITS = np.uint32(0x80808080)  # flips each signed byte c to the unsigned c + 128
NIBBLE_PAIRS = np.uint32(0x000F000F)
BYTE_PAIRS = np.uint32(0x00FF00FF)
ZERO = np.uint32(0)
INDEX_MASK = 0x7FFFFFFF  # an index (below 2^31) and this mask: itself, known non-negative (no wraparound code)


def pick_tile(rows: int, n: int) -> Tile:
    """The block tile of a product of `rows` weight rows and n tokens: from LONG_PROMPT tokens on, a 128-token
    tile where its blocks fill at least three quarters of the GPU: the wide tile where they fill both of an SM's
    places (two blocks per SM), else the long tile (one); small matrices (a 0.5b's attention) keep the short tile's
    twice as many blocks, two per SM."""
    if n >= LONG_PROMPT:
        long_blocks = blocks(rows, ROWS) * blocks(n, LONG_TOKENS)
        if 4 * long_blocks >= 3 * BLOCKS_PER_SM * sm_count():
            return WIDE_TILE
        if 4 * long_blocks >= 3 * sm_count():
            return LONG_TILE
    return SHORT_TILE


def x_order(kind: str) -> tuple[int, int]:
    """(span, gap): the columns of x that a staged row's words 4p .. 4p + 3 hold (p = 0..3, each step of K_STEP) are
    span p + (0, 2), + (1, 3), then span p + gap + (0, 2), + (1, 3): the order of the codes' fields (see the module's
    notes)."""
    return (4, 16) if kind == "q4" else (8, 4)


def _make_tile(kind: str, block: int, shape: Tile = SHORT_TILE, halves: bool = False):
    """A block's tile for `kind` codes with (scale, bias) per `block` columns: rows r0.. of w (`rows` in all) times
    tokens t0.. of x (`shape.tokens` of them), those below t_end. x: float32 [n, cols], or with `halves` its float16
    pairs in the staged order (`stage_halves`), uint32 [n, cols // 2]. a_tile, x_tile: the block's shared arrays
    (`_shared_tiles`), allocated by the kernel: a kernel of two products' tiles holds one pair of them."""
    tokens, threads, m_tiles, row_warps = shape.tokens, shape.threads, shape.m_tiles, shape.row_warps
    split = threads // ROWS  # threads staging one row of weights: 2 (halves) or 4 (quarters)
    load_codes, stage_codes = {("q4", 2): (_load_q4, _stage_q4), ("q6", 2): (_load_q6, _stage_q6),
                               ("q8", 2): (_load_q8, _stage_q8), ("q4", 4): (_load_q4_quarter, _stage_q4),
                               ("q6", 4): (_load_q6_quarter, _stage_q6),
                               ("q8", 4): (_load_q8_quarter, _stage_q8)}[kind, split]
    x_span, x_gap = x_order(kind)  # columns of x part p: span p .., span p + gap ..
    per_token = threads // tokens  # threads staging one token's x: 4 (a part each) or 2 (two parts each)
    if not halves and per_token != 4:
        raise ValueError(f"a tile of {threads} threads and {tokens} tokens stages x from its halves only")
    load_x, stage_x, x_shift = ((_load_x_halves, _stage_x_halves, 1) if per_token == 4 else
                                (_load_x_halves2, _stage_x_halves2, 1)) if halves else (_load_x, _stage_x, 0)
    per_token_log2 = per_token.bit_length() - 1
    mma_step, store = _mma_steps(m_tiles), _stores(m_tiles)
    per_step = K_STEP // block  # (scale, bias) blocks per step
    block_log2 = block.bit_length() - 1
    split_log2 = split.bit_length() - 1

    @cuda.jit(device=True, inline=True)
    def tile(w, rows, half_scale, x, t_end, ep, r0, t0, a_tile, x_tile):
        tid = cuda.threadIdx.x
        n, cols = t_end, x.shape[1] << x_shift
        acc = cuda.local.array((m_tiles, N_TILES, 4), np.float32)
        for i in range(m_tiles):
            for j in range(N_TILES):
                for c in range(4):
                    acc[i, j, c] = np.float32(0)
        # staging: thread (a_row, a_part) decodes a half or a quarter of a row's codes; (x_tok, x_part) a quarter
        # or a half of a token's x. Thread indices come from masks and shifts: LLVM then knows them non-negative, drops
        # numba's negative index wraparound and folds the shared fragment addresses into a base plus constant
        # offsets.
        a_row, a_part = (tid >> split_log2) & (ROWS - 1), tid & (split - 1)
        x_tok, x_part = (tid >> per_token_log2) & (tokens - 1), tid & (per_token - 1)
        # rows past the last and tokens past t_end stage the last one's (finite) values again, into products that
        # no store writes: loads without branches
        r, t = min(r0 + a_row, rows - 1) & INDEX_MASK, min(t0 + x_tok, n - 1) & INDEX_MASK
        sub = a_part >> (split_log2 - 1) if per_step == 2 else 0  # the (scale, bias) block of this thread's part
        x_col = x_span * x_part if not halves else (16 >> per_token_log2) * x_part  # a float32 column, or a word
        # a step's first column masked, as the rows above: LLVM then knows every index non-negative and drops
        # numba's wraparound arithmetic from the loads (64-bit shifts, ands and adds, most of a step's address math)
        k1 = min(K_STEP, cols - K_STEP) & INDEX_MASK
        # two register sets of loads in flight, for even and odd steps: a step's loads are issued two steps
        # (two rounds of mmas) before they are staged
        words0 = load_codes(w, r, 0, a_part)
        sw0 = block_words(w, r, sub)
        x0 = load_x(x, t, x_col, x_gap)
        words1 = load_codes(w, r, k1, a_part)
        sw1 = block_words(w, r, (k1 >> block_log2) + sub)
        x1 = load_x(x, t, (k1 >> x_shift) + x_col, x_gap)
        # mma: warp (wr, wt) computes rows wr.., tokens wt.. of the tile
        warp, lane = (tid >> 5) & (threads // WARP - 1), tid & (WARP - 1)
        wr, wt = (warp % row_warps) * (ROWS // row_warps), (warp // row_warps) * WARP_TOKENS
        for k0 in range(0, cols, 2 * K_STEP):
            # even step, buffer 0 (the last step loads its own columns again, unused)
            s2, m2 = _half_scale_bias(w, sw0, half_scale)
            stage_codes(words0, s2, m2, a_tile, 0, a_row, a_part)
            stage_x(x0, x_tile, 0, x_tok, x_part)
            # the registers just staged take the loads of two steps on, issued before the barrier: its wait hides
            # some of their latency too
            k_next = min(k0 + 2 * K_STEP, cols - K_STEP) & INDEX_MASK
            words0 = load_codes(w, r, k_next, a_part)
            sw0 = block_words(w, r, (k_next >> block_log2) + sub)
            x0 = load_x(x, t, (k_next >> x_shift) + x_col, x_gap)
            cuda.syncthreads()  # this step is staged; every warp is done with the step before (the other buffer)
            mma_step(a_tile, x_tile, 0, acc, wr, wt, lane)
            if k0 + K_STEP < cols:  # odd step, buffer 1
                s2, m2 = _half_scale_bias(w, sw1, half_scale)
                stage_codes(words1, s2, m2, a_tile, 1, a_row, a_part)
                stage_x(x1, x_tile, 1, x_tok, x_part)
                k_next = min(k0 + 3 * K_STEP, cols - K_STEP) & INDEX_MASK
                words1 = load_codes(w, r, k_next, a_part)
                sw1 = block_words(w, r, (k_next >> block_log2) + sub)
                x1 = load_x(x, t, (k_next >> x_shift) + x_col, x_gap)
                cuda.syncthreads()
                mma_step(a_tile, x_tile, 1, acc, wr, wt, lane)
        store(acc, np.float32(1) / half_scale, ep, rows, n, r0 + wr, t0 + wt, lane >> 2, lane & 3)

    return tile


def _shared_tiles(tokens: int):
    """A device function giving a block its tiles' shared arrays: weights and x, [step parity, row, pair]."""
    @cuda.jit(device=True, inline=True)
    def shared_tiles():
        return (cuda.shared.array((2, ROWS, STRIDE), np.uint32, alignment=ALIGN_16),
                cuda.shared.array((2, tokens, STRIDE), np.uint32, alignment=ALIGN_16))

    return shared_tiles


SHARED_TILES = {tokens: _shared_tiles(tokens) for tokens in (TOKENS, LONG_TOKENS)}


def _make_tensor_matmul(kind: str, block: int, shape: Tile, halves: bool):
    """The product's kernel: with `halves` (x staged by `stage_halves`) the grid's x runs over the token tiles, so
    that the blocks of one row tile (reading the same weights) run together; else over the row tiles (last
    session's kernel, kept for comparison)."""
    tile = _make_tile(kind, block, shape, halves) if shape != SHORT_TILE or halves else TILES[kind, block]
    tokens = shape.tokens
    shared_tiles = SHARED_TILES[tokens]

    if halves:
        def kernel(w, rows, half_scale, x, ep):
            await_grid()
            a_tile, x_tile = shared_tiles()
            tile(w, rows, half_scale, x, x.shape[0], ep, cuda.blockIdx.y * ROWS, cuda.blockIdx.x * tokens, a_tile,
                 x_tile)
    else:
        def kernel(w, rows, half_scale, x, ep):
            await_grid()
            a_tile, x_tile = shared_tiles()
            tile(w, rows, half_scale, x, x.shape[0], ep, cuda.blockIdx.x * ROWS, cuda.blockIdx.y * tokens, a_tile,
                 x_tile)

    kernel.__name__ = kernel.__qualname__ = (f"_matmul_{kind}_{block}" + ("" if shape == SHORT_TILE else
                                                                           f"_{shape.name}")
                                             + ("_halves" if halves else ""))
    return jit_bounded(kernel, shape.threads, BLOCKS_PER_SM * THREADS // shape.threads)


@functools.cache
def _pair_kernel(key_a: tuple[str, int], key_b: tuple[str, int], shape: Tile):
    """One launch of two products (`matmuls`): grid rows of a's row tiles, then b's; x over the token tiles."""
    tile_a, tile_b = _make_tile(*key_a, shape, True), _make_tile(*key_b, shape, True)
    tokens = shape.tokens
    shared_tiles = SHARED_TILES[tokens]

    def kernel(wa, rows_a, half_scale_a, xa, ep_a, wb, rows_b, half_scale_b, xb, ep_b):
        await_grid()
        a_tile, x_tile = shared_tiles()
        first_b = (rows_a + ROWS - 1) // ROWS  # b's first grid row
        y, t0 = cuda.blockIdx.y, cuda.blockIdx.x * tokens
        if y < first_b:  # the same for the whole block
            tile_a(wa, rows_a, half_scale_a, xa, xa.shape[0], ep_a, y * ROWS, t0, a_tile, x_tile)
        else:
            tile_b(wb, rows_b, half_scale_b, xb, xb.shape[0], ep_b, (y - first_b) * ROWS, t0, a_tile, x_tile)

    kernel.__name__ = kernel.__qualname__ = f"_matmul_{key_a[0]}_{key_a[1]}_{key_b[0]}_{key_b[1]}_{shape.name}"
    return jit_bounded(kernel, shape.threads, BLOCKS_PER_SM * THREADS // shape.threads)


@cuda.jit(device=True, inline=True)
def _load_q4(w, r, k0, half):
    """Code words 2 half, 2 half + 1 of row r's 32-block at k0."""
    c = 4 * (k0 >> 5) + 2 * half
    return w.codes[r, c], w.codes[r, c + 1]


@cuda.jit(device=True, inline=True)
def _load_q4_quarter(w, r, k0, quarter):
    """Code word `quarter` of row r's 32-block at k0."""
    return (w.codes[r, 4 * (k0 >> 5) + quarter],)


@cuda.jit(device=True, inline=True)
def _load_q6(w, r, k0, half):
    """Columns k0 + 16 half .. + 15 of row r as 4 words of 6-bit codes + 32, laid out as q8's."""
    low = load_u32x4(w.codes, r, 4 * (k0 >> 5))
    high = w.high[r, 2 * (k0 >> 5) + half]
    return (q6_word(low[0], high, 4 * half), q6_word(low[1], high, 4 * half + 1),
            q6_word(low[2], high, 4 * half + 2), q6_word(low[3], high, 4 * half + 3))


@cuda.jit(device=True, inline=True)
def _load_q6_quarter(w, r, k0, quarter):
    """Columns k0 + 8 quarter .. + 7 of row r as 2 words of 6-bit codes + 32."""
    low = 4 * (k0 >> 5) + 2 * (quarter & 1)
    high = w.high[r, 2 * (k0 >> 5) + (quarter >> 1)]
    return q6_word(w.codes[r, low], high, 2 * quarter), q6_word(w.codes[r, low + 1], high, 2 * quarter + 1)


@cuda.jit(device=True, inline=True)
def _load_q8(w, r, k0, half):
    """Columns k0 + 16 half .. + 15 of row r: 4 words of signed bytes."""
    return load_u32x4(w.codes, r, (k0 >> 2) + 4 * half)


@cuda.jit(device=True, inline=True)
def _load_q8_quarter(w, r, k0, quarter):
    """Columns k0 + 8 quarter .. + 7 of row r: 2 words of signed bytes."""
    c = (k0 >> 2) + 2 * quarter
    return w.codes[r, c], w.codes[r, c + 1]


@cuda.jit(device=True, inline=True)
def _q4_pair(word, shift, s2, m2):
    fields = (word >> np.uint32(shift)) & NIBBLE_PAIRS
    return fma_f16x2(sub_f16x2(fields | MAGIC, MAGIC), s2, m2)


@cuda.jit(device=True, inline=True)
def _stage_q4(words, s2, m2, a_tile, buf, row, part):
    # this part's code words w = len(words) part + i (of the block's 4), shift 0, 8, 4, 12: columns (4w, 4w + 2),
    # (4w + 1, 4w + 3), then + 16; one 16-byte store each
    for i in range(len(words)):
        store_u32x4(a_tile, buf, row, 4 * (len(words) * part + i), _q4_pair(words[i], 0, s2, m2),
                    _q4_pair(words[i], 8, s2, m2), _q4_pair(words[i], 4, s2, m2), _q4_pair(words[i], 12, s2, m2))


@cuda.jit(device=True, inline=True)
def _byte_pair(word, shift, flip, offset, s2, m2):
    fields = ((word ^ flip) >> np.uint32(shift)) & BYTE_PAIRS
    return fma_f16x2(sub_f16x2(fields | MAGIC, offset), s2, m2)


@cuda.jit(device=True, inline=True)
def _stage_bytes(words, flip, offset, s2, m2, a_tile, buf, row, part):
    """Byte codes (each c ^ flip is c + offset - 1024 over MAGIC's 1024) as float16 pairs times scale plus bias.
    Code word w = len(words) part + i (of the step's 8), bytes (0, 2) then (1, 3): columns (4w, 4w + 2),
    (4w + 1, 4w + 3)."""
    for i in range(0, len(words), 2):  # two code words: one 16-byte store
        store_u32x4(a_tile, buf, row, 2 * (len(words) * part + i), _byte_pair(words[i], 0, flip, offset, s2, m2),
                    _byte_pair(words[i], 8, flip, offset, s2, m2), _byte_pair(words[i + 1], 0, flip, offset, s2, m2),
                    _byte_pair(words[i + 1], 8, flip, offset, s2, m2))


@cuda.jit(device=True, inline=True)
def _stage_q8(words, s2, m2, a_tile, buf, row, part):
    _stage_bytes(words, SIGN_BITS, MAGIC_SIGNED, s2, m2, a_tile, buf, row, part)


@cuda.jit(device=True, inline=True)
def _stage_q6(words, s2, m2, a_tile, buf, row, part):
    _stage_bytes(words, ZERO, MAGIC_Q6, s2, m2, a_tile, buf, row, part)


@cuda.jit(device=True, inline=True)
def _half_scale_bias(w, words, half_scale):
    """A block's scale and bias, times half_scale, each as a float16 pair."""
    s, m = scale_bias(w, words[0], words[1])
    return pack_half2(s * half_scale, s * half_scale), pack_half2(m * half_scale, m * half_scale)


@cuda.jit(device=True, inline=True)
def _load_x(x, t, k, gap):
    """x[t, k..k+3] and x[t, k+gap..k+gap+3], k = the step's column + span part."""
    return load_f32x4(x, t, k), load_f32x4(x, t, k + gap)


@cuda.jit(device=True, inline=True)
def _stage_x(runs, x_tile, buf, tok, part):
    """Staged words 4 part .. 4 part + 3 of token `tok` from its two runs of 4 columns, rounded to float16 here
    (after the barrier before: the loads had two steps to land)."""
    first, second = runs
    store_u32x4(x_tile, buf, tok, 4 * part, pack_half2(first[0], first[2]), pack_half2(first[1], first[3]),
                pack_half2(second[0], second[2]), pack_half2(second[1], second[3]))


@cuda.jit(device=True, inline=True)
def _load_x_halves(x, t, word, gap):
    """Staged words 4 part .. 4 part + 3 of token t from its halves (`stage_halves`), word = the step's first word
    + 4 part."""
    return load_u32x4_coherent(x, t, word)


@cuda.jit(device=True, inline=True)
def _stage_x_halves(words, x_tile, buf, tok, part):
    store_u32x4(x_tile, buf, tok, 4 * part, words[0], words[1], words[2], words[3])


@cuda.jit(device=True, inline=True)
def _load_x_halves2(x, t, word, gap):
    """Staged words 8 half .. 8 half + 7 of token t (two threads a token), word = the step's first + 8 half."""
    return load_u32x4_coherent(x, t, word), load_u32x4_coherent(x, t, word + 4)


@cuda.jit(device=True, inline=True)
def _stage_x_halves2(runs, x_tile, buf, tok, half):
    first, second = runs
    store_u32x4(x_tile, buf, tok, 8 * half, first[0], first[1], first[2], first[3])
    store_u32x4(x_tile, buf, tok, 8 * half + 4, second[0], second[1], second[2], second[3])


@functools.cache
def _mma_steps(m_tiles: int):
    """A warp's step of products for its m_tiles x N_TILES tiles of 16 x 8 (see the function's notes)."""
    @cuda.jit(device=True, inline=True)
    def mma_step(a_tile, x_tile, buf, acc, wr, wt, lane):
        """One step's products, into acc. Per k16 slice (staged words 8 kk .. 8 kk + 7) the fragments come through
        ldmatrix .x4, each lane naming one 8-word row start: for an m-tile, matrices (rows 0-7, words 0-3),
        (rows 8-15, words 0-3), (rows 0-7, words 4-7), (rows 8-15, words 4-7) are A's a0..a3; for two n-tiles,
        (tokens 0-7, words 0-3), (0-7, 4-7), (8-15, 0-3), (8-15, 4-7) are the first n-tile's b0, b1, then the
        second's."""
        a = cuda.local.array((m_tiles, 4), np.uint32)
        b = cuda.local.array(4, np.uint32)
        a_row, a_word = lane & 15, 4 * (lane >> 4)
        b_tok, b_word = (lane & 7) + 8 * (lane >> 4), 4 * ((lane >> 3) & 1)
        for kk in range(K_STEP // 16):
            for i in range(m_tiles):
                a[i, 0], a[i, 1], a[i, 2], a[i, 3] = load_matrix_x4(a_tile, buf, wr + 16 * i + a_row,
                                                                    8 * kk + a_word)
            for jj in range(0, N_TILES, 2):  # B streams past, two n-tiles at a time (no more registers than that)
                b[0], b[1], b[2], b[3] = load_matrix_x4(x_tile, buf, wt + 8 * jj + b_tok, 8 * kk + b_word)
                for j in range(2):
                    for i in range(m_tiles):
                        t = jj + j
                        acc[i, t, 0], acc[i, t, 1], acc[i, t, 2], acc[i, t, 3] = mma_f16_16816(
                            a[i, 0], a[i, 1], a[i, 2], a[i, 3], b[2 * j], b[2 * j + 1], acc[i, t, 0],
                            acc[i, t, 1], acc[i, t, 2], acc[i, t, 3])

    return mma_step


@functools.cache
def _stores(m_tiles: int):
    """A warp's store of its m_tiles x N_TILES accumulator tiles through the epilogue."""
    @cuda.jit(device=True, inline=True)
    def store(acc, unscale, ep, rows, n, r0, t0, g, tig):
        # accumulators c and c + 2 are rows 8 apart: with gate/up groups of GATE_ROWS = 8 a gate row and its up row
        for i in range(m_tiles):
            for j in range(N_TILES):
                for c in range(4):
                    t = t0 + 8 * j + 2 * tig + (c & 1)
                    r = r0 + 16 * i + g + GATE_ROWS * (c >> 1)
                    if t < n and r < rows:
                        if not ep.gate:
                            put(ep, t, r, acc[i, j, c] * unscale)
                        elif c < 2:
                            put_gated(ep, t, r, acc[i, j, c] * unscale, acc[i, j, c + 2] * unscale)

    return store


TILES = {(kind, block): _make_tile(kind, block) for kind, block in (("q4", 32), ("q6", 32), ("q6", 16), ("q8", 32),
                                                                   ("q8", 16))}
_KERNELS = {(*key, shape, halves): _make_tensor_matmul(*key, shape, halves) for key in TILES
            for shape in TILE_SHAPES for halves in (True, False) if halves or shape != WIDE_TILE}


@jit_kernel
def _stage_halves(x, span, gap, out):
    """out[t, 4 q .. 4 q + 3] = step s = q // 4's staged words 4 p .. 4 p + 3 (p = q % 4) of token t: x's columns
    c = 32 s + span p + (0, 2), + (1, 3), then c + gap + (0, 2), + (1, 3), as float16 pairs (low half first; see
    `x_order`). One thread per 4 words: two 16-byte loads."""
    await_grid()
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    parts = out.shape[1] >> 2
    if i < out.shape[0] * parts:
        t = i // parts
        stage_words(x, t, span, gap, out, t, i % parts)


@cuda.jit(device=True, inline=True)
def stage_words(x, row, span, gap, out, t, q):
    """out[t, 4 q .. 4 q + 3]: x[row]'s staged words of `_stage_halves` (the grouped MoE products gather rows so)."""
    c = 32 * (q >> 2) + span * (q & 3)
    first, second = load_f32x4(x, row, c), load_f32x4(x, row, c + gap)
    out[t, 4 * q] = pack_half2(first[0], first[2])
    out[t, 4 * q + 1] = pack_half2(first[1], first[3])
    out[t, 4 * q + 2] = pack_half2(second[0], second[2])
    out[t, 4 * q + 3] = pack_half2(second[1], second[3])


def stage_halves(kind: str, x, out, stream=0) -> None:
    """x [n, cols] float32 rounded to float16 once, into out [n, cols // 2] uint32 in the order a `kind` product's
    tile stages it (`x_order`): the tile then copies 16 bytes of it per thread and step."""
    n, cols = x.shape
    if out.shape != (n, cols // 2) or cols % K_STEP:
        raise ValueError(f"stage_halves: x {x.shape} into {out.shape}: need [n, cols // 2], cols a multiple of "
                         f"{K_STEP}")
    _stage_halves[blocks(out.size // 4, THREADS), THREADS, stream](x, *x_order(kind), out)


F32_TILE = 64  # tokens and rows per block tile of the float32 kernel
F32_THREADS = 256  # 16 x 16 threads, 4 x 4 outputs each
F32_STRIDE = F32_TILE + 4  # padded shared rows: 16-byte aligned, the transposed stores spread over the banks
F32_K_STEP = 32


@jit_kernel
def _matmul_f32(w, x, ep):
    await_grid()
    tid = cuda.threadIdx.x
    tx = tid % 16  # rows tx*4 .. tx*4 + 3 of the tile
    ty = tid // 16  # tokens ty*4 .. ty*4 + 3
    r0 = cuda.blockIdx.x * F32_TILE
    t0 = cuda.blockIdx.y * F32_TILE
    n, cols = x.shape
    rows = w.shape[0]
    xs = cuda.shared.array((F32_K_STEP, F32_STRIDE), np.float32)
    ws = cuda.shared.array((F32_K_STEP, F32_STRIDE), np.float32)
    acc = cuda.local.array((4, 4), np.float32)
    a = cuda.local.array(4, np.float32)
    b = cuda.local.array(4, np.float32)
    for i in range(4):
        for j in range(4):
            acc[i, j] = np.float32(0)
    kk = tid % F32_K_STEP  # staging: column kk of tokens / rows tid // 32 + 8 i
    for k0 in range(0, cols, F32_K_STEP):
        inside_k = k0 + kk < cols
        for i in range(F32_TILE * F32_K_STEP // F32_THREADS):
            tt = tid // F32_K_STEP + i * (F32_THREADS // F32_K_STEP)
            xs[kk, tt] = x[t0 + tt, k0 + kk] if t0 + tt < n and inside_k else np.float32(0)
            ws[kk, tt] = w[r0 + tt, k0 + kk] if r0 + tt < rows and inside_k else np.float32(0)
        cuda.syncthreads()
        for k in range(F32_K_STEP):
            for i in range(4):
                a[i] = xs[k, ty * 4 + i]
                b[i] = ws[k, tx * 4 + i]
            for i in range(4):
                for j in range(4):
                    acc[i, j] += a[i] * b[j]
        cuda.syncthreads()
    for i in range(4):
        t = t0 + ty * 4 + i
        for j in range(4):
            r = r0 + tx * 4 + j
            if t < n and r < rows:
                put(ep, t, r, acc[i, j])


def matmul(w: DeviceMatrix, x, out, stream=0, tile: Tile | None = None, halves=None,
           staged: bool = True) -> None:
    """out[n, rows] = x[n, cols] @ W.T; out: a device array or an Epilogue. Quantized W: x goes to the tensor cores
    as float16, rounded once into `halves` (uint32 [n, cols // 2] device scratch; None: allocated here, for eager
    callers only, as a captured graph needs fixed addresses) by `stage_halves`, then the product.
    `tile`: the block tile (one of TILE_SHAPES; by default `pick_tile`'s choice), for benchmarks and tests;
    `staged=False`: x rounded in the tile as last session's kernel did (benchmarks compare the two; not the wide
    tile)."""
    n = x.shape[0]
    if w.kind != "f32" and w.cols % K_STEP:
        raise ValueError(f"matmul: {w.kind} weights need a multiple of {K_STEP} columns, got {w.cols}")
    ep = as_epilogue(out)
    if ep.gate and w.kind == "f32":
        raise ValueError("gated products take quantized matrices")
    if w.kind == "f32":
        _matmul_f32[(blocks(w.rows, F32_TILE), blocks(n, F32_TILE)), F32_THREADS, stream](w.codes, x, ep)
        return
    if tile is None:
        tile = pick_tile(w.rows, n)
    kernel = _KERNELS[w.kind, 1 << w.block_log2, tile, staged]
    grid = (blocks(w.rows, ROWS), blocks(n, tile.tokens))
    if staged:
        x, grid = _staged(w, x, halves, stream), grid[::-1]
    kernel[grid, tile.threads, stream](w.quant, w.rows, np.float32(w.half_scale), x, ep)


def _staged(w: DeviceMatrix, x, halves, stream):
    """x's float16 pairs in w's staged order, in `halves` (None: a new array)."""
    if halves is None:
        halves = cuda.device_array((x.shape[0], w.cols // 2), np.uint32, stream=stream)
    stage_halves(w.kind, x, halves, stream)
    return halves


def matmuls(products: Sequence[tuple[DeviceMatrix, object]], x, stream=0,
            halves: Callable[[tuple[int, int]], object] | None = None) -> None:
    """Each (W, out) of `products` times the same x, as `matmul`, the quantized ones two to a launch: one grid of
    both's blocks, so that the last wave of one fills up with the other's (the 8B's q/k product at 512 tokens is
    1.2 waves of blocks, its v product a quarter of one). halves(order): a scratch of uint32 [n, cols // 2] for x
    staged in that `x_order`, the same for the same order (None: new arrays, for eager callers only)."""
    quantized = [(w, out) for w, out in products if w.kind != "f32"]
    for w, out in products:
        if w.kind == "f32":
            matmul(w, x, out, stream)
    for i in range(0, len(quantized) - 1, 2):
        _matmul_pair(*quantized[i], *quantized[i + 1], x, stream, halves)
    if len(quantized) % 2:
        w, out = quantized[-1]
        matmul(w, x, out, stream, halves=None if halves is None else halves(x_order(w.kind)))


def _matmul_pair(wa: DeviceMatrix, out_a, wb: DeviceMatrix, out_b, x, stream, halves) -> None:
    n = x.shape[0]
    for w in (wa, wb):
        if w.cols % K_STEP:
            raise ValueError(f"matmul: {w.kind} weights need a multiple of {K_STEP} columns, got {w.cols}")
    tile = pick_tile(wa.rows + wb.rows, n)
    xa = _staged(wa, x, None if halves is None else halves(x_order(wa.kind)), stream)
    xb = xa if x_order(wb.kind) == x_order(wa.kind) else _staged(
        wb, x, None if halves is None else halves(x_order(wb.kind)), stream)
    kernel = _pair_kernel((wa.kind, 1 << wa.block_log2), (wb.kind, 1 << wb.block_log2), tile)
    grid = (blocks(n, tile.tokens), blocks(wa.rows, ROWS) + blocks(wb.rows, ROWS))
    kernel[grid, tile.threads, stream](wa.quant, wa.rows, np.float32(wa.half_scale), xa, as_epilogue(out_a),
                                              wb.quant, wb.rows, np.float32(wb.half_scale), xb, as_epilogue(out_b))
