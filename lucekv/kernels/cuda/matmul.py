"""Prefill products out[n, rows] = x[n, cols] @ W.T on tensor cores.

Quantized weights (q4, q8) go through `mma.sync.m16n8k16` (f16 operands, f32 accumulators): float32 FMAs
cannot come near the tensor cores' rate on prefill-sized products.
- Weights stay exact. A fragments hold the raw integer codes (q4 0..15, q8 -128..127: exact in f16); each
  block of 16 or 32 columns contributes `scale * D + bias * xsum` in float32, D the block's code products
  (two k16 mmas chained for 32-blocks), xsum the block's sum of x (float32, from the unrounded x; only
  when the matrix has a bias).
- Activations are split in two f16 parts, x = hi + lo (|x| must stay below 65504), each k16 slice taking
  two mmas: about float32's precision (1e-7 of the largest output on random inputs, against float64). One
  f16 rounding alone gives about 2e-4 there, and a 2-layer model's logits then drift past 1e-3 of the CPU
  backend's.
- A block of 8 warps computes 128 rows x 64 tokens, per K_STEP = 32 columns; each warp 32 rows x 32 tokens,
  2 m16 x 4 n8 tiles of 4 float32 accumulators per thread. Per step the block stages in shared memory the
  codes of 128 rows and both parts of x of 64 tokens as f16 pairs (rows of PAIRS words, padded to STRIDE
  so that the fragment loads, rows g = lane / 4 at word lane % 4, hit 32 distinct banks), plus the step's
  scales, biases and x sums. The next step's global loads are issued before the current step's mmas.
  Registers are capped at 128 per thread, so that two blocks share an SM.
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

import numpy as np

from lucekv.kernels.cuda._numba import (
    WARP,
    blocks,
    cuda,
    half2_floats,
    jit_bounded,
    load_f32x4,
    load_u32x4,
    mma_f16_16816,
    pack_half2,
    sub_f16x2,
    warp_shfl_xor,
)
from lucekv.kernels.cuda.packed import GATE_ROWS, DeviceMatrix, as_epilogue, put, put_gated

ROWS = 128  # weight rows per block tile
TOKENS = 64  # tokens per block tile
K_STEP = 32  # columns per step: one q4 block, one or two q8 blocks
THREADS = 256
BLOCKS_PER_SM = 2  # registers capped at 128 per thread (ptxas: no spills)
ROW_WARPS = 4  # warps side by side over the rows; 2 over the tokens
WARP_ROWS = ROWS // ROW_WARPS
WARP_TOKENS = TOKENS * ROW_WARPS * WARP // THREADS
M_TILES = WARP_ROWS // 16
N_TILES = WARP_TOKENS // 8
PAIRS = K_STEP // 2  # f16 pairs per staged row and step
STRIDE = PAIRS + 4
MAGIC = np.uint32(0x64006400)  # two float16 1024.0: or'ed with fields below 1024, 1024 + field
MAGIC_SIGNED = np.uint32(0x64806480)  # two float16 1152.0 = 1024 + 128
SIGN_BITS = np.uint32(0x80808080)  # flips each signed byte c to the unsigned c + 128
NIBBLE_PAIRS = np.uint32(0x000F000F)
BYTE_PAIRS = np.uint32(0x00FF00FF)
ZERO = np.uint32(0)


def _make_tensor_matmul(kind: str, block: int):
    """The kernel for `kind` codes with (scale, bias) per `block` columns."""
    load_codes, stage_codes = {"q4": (_load_q4, _stage_q4), "q8": (_load_q8, _stage_q8)}[kind]
    x_span, x_gap = (4, 16) if kind == "q4" else (8, 4)  # columns of x part p: span p .., span p + gap ..
    per_step = K_STEP // block  # (scale, bias) blocks per step
    block_log2 = block.bit_length() - 1

    def kernel(codes, scale, bias, has_bias, rows, x, ep):
        tid = cuda.threadIdx.x
        r0 = cuda.blockIdx.x * ROWS
        t0 = cuda.blockIdx.y * TOKENS
        n, cols = x.shape
        a_tile = cuda.shared.array((ROWS, STRIDE), np.uint32)
        x_tile = cuda.shared.array((2, TOKENS, STRIDE), np.uint32)  # [hi / lo part, token, pair]
        s_tile = cuda.shared.array((per_step, ROWS), np.float32)
        m_tile = cuda.shared.array((per_step, ROWS), np.float32)
        xs_tile = cuda.shared.array((per_step, TOKENS), np.float32)
        acc = cuda.local.array((M_TILES, N_TILES, 4), np.float32)
        for i in range(M_TILES):
            for j in range(N_TILES):
                for c in range(4):
                    acc[i, j, c] = np.float32(0)
        # staging: thread (a_row, a_half) decodes half a row's codes; (x_tok, x_part) a quarter of a token's x.
        # Thread indices come from masks and shifts: LLVM then knows them non-negative, drops numba's negative
        # index wraparound and folds the shared fragment addresses into a base plus constant offsets.
        a_row, a_half = (tid >> 1) & (ROWS - 1), tid & 1
        x_tok, x_part = (tid >> 2) & (TOKENS - 1), tid & 3
        r, t = r0 + a_row, t0 + x_tok
        sub = a_half if per_step == 2 else 0  # the (scale, bias) block this thread stages
        stages_scale = per_step == 2 or a_half == 0
        x_col = x_span * x_part
        words = load_codes(codes, rows, r, 0, a_half)
        s, m = _load_scale_bias(scale, bias, has_bias, rows, r, sub)
        x_first, x_second = _load_x(x, n, t, x_col, x_gap)
        # mma: warp (wr, wt) computes rows wr.., tokens wt.. of the tile; lane in group g, index tig
        warp, lane = (tid >> 5) & (THREADS // WARP - 1), tid & (WARP - 1)
        wr, wt = (warp % ROW_WARPS) * WARP_ROWS, (warp // ROW_WARPS) * WARP_TOKENS
        for k0 in range(0, cols, K_STEP):
            stage_codes(words, a_tile, a_row, a_half)
            if stages_scale:
                s_tile[sub, a_row] = s
                m_tile[sub, a_row] = m
            _stage_x(x_first, x_second, has_bias, per_step, x_tile, xs_tile, x_tok, x_part)
            cuda.syncthreads()
            k_next = min(k0 + K_STEP, cols - K_STEP)  # the last step loads its own columns again, unused
            words = load_codes(codes, rows, r, k_next, a_half)
            s, m = _load_scale_bias(scale, bias, has_bias, rows, r, (k_next >> block_log2) + sub)
            x_first, x_second = _load_x(x, n, t, k_next + x_col, x_gap)
            _mma_step(a_tile, x_tile, s_tile, m_tile, xs_tile, acc, wr, wt, lane >> 2, lane & 3, per_step)
            cuda.syncthreads()
        _store(acc, ep, rows, n, r0 + wr, t0 + wt, lane >> 2, lane & 3)

    kernel.__name__ = kernel.__qualname__ = f"_matmul_{kind}_{block}"
    return jit_bounded(kernel, THREADS, BLOCKS_PER_SM)


@cuda.jit(device=True, inline=True)
def _load_q4(words, rows, r, k0, half):
    """Code words 2 half, 2 half + 1 of row r's 32-block at k0 (zeros past the last row)."""
    if r < rows:
        c = 4 * (k0 >> 5) + 2 * half
        return words[r, c], words[r, c + 1]
    return ZERO, ZERO


@cuda.jit(device=True, inline=True)
def _load_q8(words, rows, r, k0, half):
    """Columns k0 + 16 half .. + 15 of row r: 4 words of signed bytes (zeros past the last row)."""
    if r < rows:
        return load_u32x4(words, r, (k0 >> 2) + 4 * half)
    return ZERO, ZERO, ZERO, ZERO


@cuda.jit(device=True, inline=True)
def _stage_q4(words, a_tile, row, half):
    # code word w = 2 half + i, shift 0, 8, 4, 12: columns (4w, 4w + 2), (4w + 1, 4w + 3), then + 16
    for i in range(2):
        for v in range(4):
            fields = (words[i] >> np.uint32(8 * (v & 1) + 4 * (v >> 1))) & NIBBLE_PAIRS
            a_tile[row, 8 * half + 4 * i + v] = sub_f16x2(fields | MAGIC, MAGIC)


@cuda.jit(device=True, inline=True)
def _stage_q8(words, a_tile, row, half):
    # code word w = 4 half + i, bytes (0, 2) then (1, 3): columns (4w, 4w + 2), (4w + 1, 4w + 3)
    for i in range(4):
        unsigned = words[i] ^ SIGN_BITS
        for v in range(2):
            fields = (unsigned >> np.uint32(8 * v)) & BYTE_PAIRS
            a_tile[row, 8 * half + 2 * i + v] = sub_f16x2(fields | MAGIC, MAGIC_SIGNED)


@cuda.jit(device=True, inline=True)
def _load_scale_bias(scale, bias, has_bias, rows, r, b):
    if r < rows:
        return scale[r, b], bias[r, b] if has_bias else np.float32(0)
    return np.float32(0), np.float32(0)


@cuda.jit(device=True, inline=True)
def _load_x(x, n, t, k, gap):
    """x[t, k..k+3] and x[t, k+gap..k+gap+3] (zeros past the last token)."""
    if t < n:
        return load_f32x4(x, t, k), load_f32x4(x, t, k + gap)
    z = np.float32(0)
    return (z, z, z, z), (z, z, z, z)


@cuda.jit(device=True, inline=True)
def _stage_x(first, second, has_bias, per_step, x_tile, xs_tile, tok, part):
    """Staged words 4 part .. 4 part + 3 of token `tok` from its two runs of 4 columns, and its sums of x per
    (scale, bias) block: over the 4 parts of the token for one block per step, over parts (0, 1) and (2, 3)
    for two."""
    _stage_pair(x_tile, tok, 4 * part, first[0], first[2])
    _stage_pair(x_tile, tok, 4 * part + 1, first[1], first[3])
    _stage_pair(x_tile, tok, 4 * part + 2, second[0], second[2])
    _stage_pair(x_tile, tok, 4 * part + 3, second[1], second[3])
    if has_bias:
        total = (first[0] + first[1]) + (first[2] + first[3]) + ((second[0] + second[1]) + (second[2] + second[3]))
        total += warp_shfl_xor(total, 1)
        if per_step == 1:
            total += warp_shfl_xor(total, 2)
        if part % (4 // per_step) == 0:
            xs_tile[part * per_step // 4, tok] = total
    elif part == 0:
        for b in range(per_step):
            xs_tile[b, tok] = np.float32(0)


@cuda.jit(device=True, inline=True)
def _stage_pair(x_tile, tok, j, lo, hi):
    """Word j of token `tok`: (lo, hi) rounded to f16 in part 0, what the rounding left out in part 1."""
    rounded = pack_half2(lo, hi)
    lo_rounded, hi_rounded = half2_floats(rounded)
    x_tile[0, tok, j] = rounded
    x_tile[1, tok, j] = pack_half2(lo - lo_rounded, hi - hi_rounded)


@cuda.jit(device=True, inline=True)
def _mma_step(a_tile, x_tile, s_tile, m_tile, xs_tile, acc, wr, wt, g, tig, per_step):
    """One step's products of the warp's M_TILES x N_TILES tiles, into acc. Per m-tile and (scale, bias) block,
    the block's A fragments and row scales stay in registers while the n-tiles' B fragments stream past (few
    registers live, so that two blocks fit an SM); a block's k16 slices, both parts of x, chain into one D."""
    slices = 2 // per_step  # k16 slices per block
    a = cuda.local.array((2, 4), np.uint32)  # [slice of the block, register]
    rs = cuda.local.array((2, 2), np.float32)  # [row g / g + 8, scale / bias]
    z = np.float32(0)
    for i in range(M_TILES):
        row = wr + 16 * i + g
        for b in range(per_step):
            for h in range(2):
                rs[h, 0] = s_tile[b, row + 8 * h]
                rs[h, 1] = m_tile[b, row + 8 * h]
            for kk in range(slices):
                col = 8 * (b * slices + kk) + tig
                a[kk, 0] = a_tile[row, col]
                a[kk, 1] = a_tile[row + 8, col]
                a[kk, 2] = a_tile[row, col + 4]
                a[kk, 3] = a_tile[row + 8, col + 4]
            for j in range(N_TILES):
                tok = wt + 8 * j + g  # B's column
                pair = wt + 8 * j + 2 * tig  # D's columns: c0, c1 (row g) and c2, c3 (row g + 8)
                d = (z, z, z, z)
                for kk in range(slices):
                    col = 8 * (b * slices + kk) + tig
                    for part in range(2):
                        d = mma_f16_16816(a[kk, 0], a[kk, 1], a[kk, 2], a[kk, 3], x_tile[part, tok, col],
                                          x_tile[part, tok, col + 4], d[0], d[1], d[2], d[3])
                x0, x1 = xs_tile[b, pair], xs_tile[b, pair + 1]
                for h in range(2):
                    acc[i, j, 2 * h] += rs[h, 0] * d[2 * h] + rs[h, 1] * x0
                    acc[i, j, 2 * h + 1] += rs[h, 0] * d[2 * h + 1] + rs[h, 1] * x1


@cuda.jit(device=True, inline=True)
def _store(acc, ep, rows, n, r0, t0, g, tig):
    # accumulators c and c + 2 are rows 8 apart: with gate/up groups of GATE_ROWS = 8 a gate row and its up row
    for i in range(M_TILES):
        for j in range(N_TILES):
            for c in range(4):
                t = t0 + 8 * j + 2 * tig + (c & 1)
                r = r0 + 16 * i + g + GATE_ROWS * (c >> 1)
                if t < n and r < rows:
                    if not ep.gate:
                        put(ep, t, r, acc[i, j, c])
                    elif c < 2:
                        put_gated(ep, t, r, acc[i, j, c], acc[i, j, c + 2])


_KERNELS = {(kind, block): _make_tensor_matmul(kind, block) for kind, block in (("q4", 32), ("q8", 32), ("q8", 16))}

F32_TILE = 64  # tokens and rows per block tile of the float32 kernel
F32_THREADS = 256  # 16 x 16 threads, 4 x 4 outputs each
F32_STRIDE = F32_TILE + 4  # padded shared rows: 16-byte aligned, the transposed stores spread over the banks
F32_K_STEP = 32


@cuda.jit
def _matmul_f32(w, x, ep):
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


def matmul(w: DeviceMatrix, x, out, stream=0) -> None:
    """out[n, rows] = x[n, cols] @ W.T; out: a device array or an Epilogue."""
    n = x.shape[0]
    if w.kind != "f32" and w.cols % K_STEP:
        raise ValueError(f"matmul: {w.kind} weights need a multiple of {K_STEP} columns, got {w.cols}")
    ep = as_epilogue(out)
    if ep.gate and w.kind == "f32":
        raise ValueError("gated products take quantized matrices")
    if w.kind == "f32":
        _matmul_f32[(blocks(w.rows, F32_TILE), blocks(n, F32_TILE)), F32_THREADS, stream](w.codes, x, ep)
        return
    kernel = _KERNELS[w.kind, 1 << w.block_log2]
    kernel[(blocks(w.rows, ROWS), blocks(n, TOKENS)), THREADS, stream](w.codes, w.scale, w.bias, w.has_bias,
                                                                        w.rows, x, ep)
