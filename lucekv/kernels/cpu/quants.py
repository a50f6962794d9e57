"""GGUF weight decoding: bit-exact dequantization, and the repacked form the CPU products run on.

Every supported quant type is decoded into one of three canonical kinds, so that only two fast product
kernels (plus a float one) exist: weights stay quantized as integer codes with one float32 (scale, bias)
pair per block of 16 or 32 elements, `value = scale * code + bias`. The repack is lossless: expanding it
reproduces `gguf.quants.dequantize` bit for bit (scales are products of an f16 and a small integer, so
`scale * code` is exact wherever the reference's product is, and the one rounding left is the same add).
The (scale, bias) pairs are kept factored as the file has them: float16 `d`, `dmin` per group of blocks
(a K-quant's 256-element super-block, or the block itself) and int8 sub-scales and sub-mins per block, with
`scale = d * sub_scale` and `bias = -(dmin * sub_min)`, both exact in float32. GPU kernels read the factors
(about a fifth of the bytes of float32 pairs); the CPU kernels read the products, expanded once.

numba kernels unpack the bit fields into integer codes and sub-scales; the float math (f16 fields to
float32, `d * sc`, `dmin * m`) is numpy, written in the same order as the reference so it rounds the same.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import njit

from lucekv.errors import UnsupportedModelError
from lucekv.model.gguf import TensorInfo

Q = GGMLQuantizationType
SUPPORTED_QTYPES: tuple[GGMLQuantizationType, ...] = (
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
)
FLOAT_QTYPES = (Q.F32, Q.F16, Q.BF16)


@dataclass
class PackedMatrix:
    """A weight matrix in canonical form; arrays are read-only (weights never change in place)."""

    kind: Literal["q4", "q8", "f32"]
    rows: int
    cols: int
    block: int  # elements per (scale, bias) pair: 32 or 16 (0 for f32)
    codes: np.ndarray  # q4: uint8 [rows, cols//2], per 32-block 16 bytes: low nibbles = elements 0..15,
    #                    high nibbles = 16..31;  q8: int8 [rows, cols];  f32: float32 [rows, cols]
    d: np.ndarray  # float16 [rows, groups]: the scale factor of each group's blocks ([rows, 0] for f32)
    dmin: np.ndarray  # float16 [rows, groups]: the bias factor (zeros for types without a bias)
    sub_scale: np.ndarray  # int8 [rows, cols//block] (ones where a group is one block)
    sub_min: np.ndarray  # int8 [rows, cols//block]
    # codes, scale and bias stored by groups of GROUP_ROWS rows (`group_rows`: the decode step's form): codes uint8
    # [groups, code_cols * GROUP_ROWS], scale and bias [groups, cols//block * GROUP_ROWS] float32 or float16 bits
    # (uint16); the factors stay by rows
    grouped: bool = False

    def __post_init__(self) -> None:
        # One numba specialization per kernel: mmap views are read-only, so make every array read-only.
        for f in FACTORED:
            setattr(self, f, _read_only(getattr(self, f)))

    @property
    def layout(self) -> tuple:
        """What matrices must share to be stacked into one: kind, block, group and width."""
        return self.kind, self.block, self.group, self.cols

    @property
    def group(self) -> int:
        """Blocks per (d, dmin) pair: 1, or a K-quant super-block's 8 or 16."""
        return self.sub_scale.shape[1] // max(self.d.shape[1], 1)

    @functools.cached_property
    def scale(self) -> np.ndarray:
        """float32 [rows, cols//block]: d * sub_scale."""
        return _read_only(self._per_block(self.d) * self.sub_scale.astype(np.float32))

    @functools.cached_property
    def bias(self) -> np.ndarray:
        """float32 [rows, cols//block]: -(dmin * sub_min); -0.0 for types without a bias (x + -0.0 == x)."""
        return _read_only(-(self._per_block(self.dmin) * self.sub_min.astype(np.float32)))

    @functools.cached_property
    def has_bias(self) -> bool:
        """Whether any block has a bias (the products skip the bias terms of a matrix without)."""
        return bool(np.any(self.dmin != 0) and np.any(self.sub_min != 0))

    def _per_block(self, factor: np.ndarray) -> np.ndarray:
        return np.repeat(factor.astype(np.float32), self.group, axis=1)

    def by_rows(self, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes, scale, bias) of rows r0..r1 in the row form, whichever form the matrix is stored in."""
        if not self.grouped:
            return self.codes[r0:r1], self.scale[r0:r1], self.bias[r0:r1]
        g0, g1 = r0 // GROUP_ROWS, -(-r1 // GROUP_ROWS)
        units = self.codes[g0:g1].reshape(g1 - g0, -1, GROUP_ROWS, 1 if self.kind == "q4" else 2)
        units = units.transpose(0, 2, 1, 3).reshape((g1 - g0) * GROUP_ROWS, -1)[r0 - g0 * GROUP_ROWS:][:r1 - r0]
        codes = _q4_from_pairs(units) if self.kind == "q4" else units.view(np.int8)
        scale = self._per_block(self.d[r0:r1]) * self.sub_scale[r0:r1].astype(np.float32)
        return codes, scale, -(self._per_block(self.dmin[r0:r1]) * self.sub_min[r0:r1].astype(np.float32))


FACTORED = ("codes", "d", "dmin", "sub_scale", "sub_min")  # the arrays with one row per matrix row
GROUP_ROWS = 16  # rows of a group in the grouped form: the decode kernels' 16 lanes (intdot.group_*)


def group_rows(m: PackedMatrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """m's (codes, scale, bias) in the grouped form (PackedMatrix.grouped), rows past the last padded with zeros.
    Within a group, element pair p (elements 2p, 2p + 1) of its 16 rows lies side by side: q8 two int8 a row, q4 a
    byte a row (element 2p the low nibble); then per block the 16 rows' scales, and biases. Scales and biases are
    float16 bits (uint16) where every one is a float16 (the legacy types' d and m: a memory-bound decode reads 20
    bytes a Q4_1 block instead of 24), else float32 (a K-quant's d times its sub-scale)."""
    groups = -(-m.rows // GROUP_ROWS)
    units = _q4_pairs(m.codes) if m.kind == "q4" else np.ascontiguousarray(m.codes).view(np.uint16)

    def grouped(a: np.ndarray) -> np.ndarray:
        padded = np.zeros((groups * GROUP_ROWS, a.shape[1]), a.dtype)
        padded[:m.rows] = a
        return np.ascontiguousarray(padded.reshape(groups, GROUP_ROWS, -1).transpose(0, 2, 1)).reshape(groups, -1)

    scale, bias = grouped(m.scale), grouped(m.bias)
    with np.errstate(over="ignore"):
        halves = scale.astype(np.float16), bias.astype(np.float16)
    if all(np.array_equal(h.astype(np.float32), f) for h, f in zip(halves, (scale, bias), strict=True)):
        scale, bias = (h.view(np.uint16) for h in halves)
    return grouped(units).view(np.uint8), scale, bias


def _q4_pairs(codes: np.ndarray) -> np.ndarray:
    """q4 codes (per 32-block 16 bytes: element j the low nibble of byte j, 16 + j the high) as a byte per element
    pair: element 2p in the low nibble, 2p + 1 in the high."""
    nib = codes.reshape(len(codes), -1, 16)
    elements = np.concatenate([nib & 15, nib >> 4], axis=2).reshape(len(codes), -1)
    return (elements[:, 0::2] | (elements[:, 1::2] << 4)).astype(np.uint8)


def _q4_from_pairs(pairs: np.ndarray) -> np.ndarray:
    """_q4_pairs undone."""
    elements = np.stack([pairs & 15, pairs >> 4], axis=2).reshape(len(pairs), -1, 32)
    return (elements[:, :, :16] | (elements[:, :, 16:] << 4)).reshape(len(pairs), -1).astype(np.uint8)


def stack_rows(ms: Sequence[PackedMatrix]) -> PackedMatrix:
    """One matrix holding the rows of `ms` in order (same kind, block, group and width): one product computes
    them all."""
    a = ms[0]
    if any(m.layout != a.layout for m in ms):
        raise ValueError("stack_rows needs matrices of one kind, block, group and width")
    return PackedMatrix(a.kind, sum(m.rows for m in ms), a.cols, a.block,
                        *(np.concatenate([getattr(m, f) for m in ms]) for f in FACTORED))


def interleave_rows(a: PackedMatrix, b: PackedMatrix, group: int) -> PackedMatrix:
    """Rows of a and b (same shape and kind) in alternating groups: a's first `group`, b's first `group`, a's
    next... A product then computes a row of a and the same row of b side by side (gated FFNs)."""
    if a.rows != b.rows or a.rows % group or a.layout != b.layout:
        raise ValueError(f"interleave_rows needs two matrices of one layout and the same rows, a multiple of {group}")

    def pairs(fa: np.ndarray, fb: np.ndarray) -> np.ndarray:  # one copy (an MoE layer's experts are ~1 GB)
        tail = fa.shape[1:]
        return np.stack([fa.reshape(-1, group, *tail), fb.reshape(-1, group, *tail)], axis=1).reshape(-1, *tail)

    return PackedMatrix(a.kind, 2 * a.rows, a.cols, a.block, *(pairs(getattr(a, f), getattr(b, f)) for f in FACTORED))


def permute_rows(m: PackedMatrix, order: np.ndarray) -> PackedMatrix:
    """m's rows reordered: row j of the result is row order[j] of m."""
    return PackedMatrix(m.kind, m.rows, m.cols, m.block, *(getattr(m, f)[order] for f in FACTORED))


def pack(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> PackedMatrix:
    """Repack the tensor data `raw` of numpy shape (rows, cols) into canonical form."""
    if len(shape) != 2:
        raise ValueError(f"pack needs a (rows, cols) matrix shape, got {shape}")
    rows, cols = shape
    return _decode(raw, qtype, rows, cols)


def pack_tensor(t: TensorInfo) -> PackedMatrix:
    """The canonical form of a GGUF matrix; vectors (norms, biases) go through `dequantize` instead."""
    if len(t.shape) != 2:
        raise ValueError(f"tensor {t.name!r} of shape {t.shape} is not a matrix")
    return pack(t.data, t.qtype, t.shape)


def pack_stacked(t: TensorInfo) -> PackedMatrix:
    """A stacked 3-D tensor [n, rows, cols] (an MoE layer's experts) as one matrix of n * rows rows: matrix i is rows
    i * rows .. (i + 1) * rows (`split_rows`)."""
    if len(t.shape) != 3:
        raise ValueError(f"tensor {t.name!r} of shape {t.shape} is not a stack of matrices")
    n, rows, cols = t.shape
    return pack(t.data, t.qtype, (n * rows, cols))


def split_rows(m: PackedMatrix, n: int) -> list[PackedMatrix]:
    """m's rows as n matrices of m.rows // n rows each, views of m's arrays."""
    if m.rows % n:
        raise ValueError(f"split_rows: {m.rows} rows do not split into {n} matrices")
    rows = m.rows // n
    return [PackedMatrix(m.kind, rows, m.cols, m.block, *(getattr(m, f)[i * rows:(i + 1) * rows] for f in FACTORED))
            for i in range(n)]


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """float32 array of numpy `shape`, bit-for-bit equal to `gguf.quants.dequantize`."""
    cols = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    m = _decode(raw, qtype, rows, cols)
    if qtype == Q.Q4_0:
        # scale*code + bias gives +0.0 for code 8 where the reference's d*(q-8) gives -0.0 (d < 0):
        # equal values, different bits. Subtracting the offset first reproduces the reference exactly.
        out = np.empty((rows, cols), np.float32)
        _expand_q4(m.codes, m.scale, _read_only(np.full_like(m.scale, -0.0)), np.float32(8), out)
        return out.reshape(shape)
    return dequantize_rows(m, 0, rows).reshape(shape)


def dequantize_rows(m: PackedMatrix, r0: int, r1: int) -> np.ndarray:
    """float32 [r1 - r0, cols]: rows r0..r1 expanded (embedding lookups, prefill weight tiles)."""
    if not 0 <= r0 <= r1 <= m.rows:
        raise ValueError(f"rows {r0}..{r1} out of range for a matrix of {m.rows} rows")
    if m.kind == "f32":
        return np.array(m.codes[r0:r1], dtype=np.float32)
    out = np.empty((r1 - r0, m.cols), np.float32)
    codes, scale, bias = m.by_rows(r0, r1)
    if m.kind == "q4":
        _expand_q4(codes, scale, bias, np.float32(0), out)
    else:
        _expand_q8(codes, scale, bias, out)
    return out


# ---- decoding -------------------------------------------------------------------------------------------


def _decode(raw: np.ndarray, qtype: GGMLQuantizationType, rows: int, cols: int) -> PackedMatrix:
    if qtype not in SUPPORTED_QTYPES:
        names = ", ".join(t.name for t in SUPPORTED_QTYPES)
        raise UnsupportedModelError(f"quant type {qtype.name} is not supported (supported: {names})")
    data = _raw_bytes(raw, qtype, rows * cols)
    if qtype in FLOAT_QTYPES:
        values = _float_values(data, qtype).reshape(rows, cols)
        no_d, no_sub = np.zeros((rows, 0), np.float16), np.zeros((rows, 0), np.int8)
        return PackedMatrix("f32", rows, cols, 0, values, no_d, no_d, no_sub, no_sub)
    blocks = _read_only(data.reshape(-1, GGML_QUANT_SIZES[qtype][1]))
    kind, block, codes, *factors = _BLOCK_DECODERS[qtype](blocks)
    code_cols = cols // 2 if kind == "q4" else cols
    # contiguous even where a row is one block (the reshape then keeps the strided view of the blocks)
    return PackedMatrix(kind, rows, cols, block, np.ascontiguousarray(codes.reshape(rows, code_cols)),
                        *(f.reshape(rows, -1) for f in factors))


def _raw_bytes(raw: np.ndarray, qtype: GGMLQuantizationType, n_elements: int) -> np.ndarray:
    """The tensor's bytes as a flat uint8 view, whatever dtype the reader handed out."""
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    expected = n_elements // block_size * type_size
    if n_elements % block_size or data.size != expected:
        raise ValueError(f"{qtype.name} data of {data.size} bytes does not hold {n_elements} elements "
                         f"(expected {expected} bytes, {block_size} elements per block)")
    return data


def _float_values(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == Q.F32:
        return data.view(np.float32)
    if qtype == Q.F16:
        return data.view(np.float16).astype(np.float32)
    return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)  # BF16: the high half of an f32


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """float16 [n_blocks, 1]: the f16 field at byte `offset` of each block."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16)


def _int8(values: np.ndarray) -> np.ndarray:
    return values.astype(np.int8)


def _scaled(d: np.ndarray, sub_scale: np.ndarray) -> tuple:
    """(d, dmin, sub_scale, sub_min) of a type without a bias."""
    return d, np.zeros_like(d), _int8(sub_scale), np.zeros(sub_scale.shape, np.int8)


def _per_block(d: np.ndarray, dmin: np.ndarray, sub_min: int = 1) -> tuple:
    """(d, dmin, sub_scale, sub_min) of a type with one (d, dmin) per block."""
    return d, dmin, np.ones(d.shape, np.int8), np.full(d.shape, sub_min, np.int8)


# Each block decoder: uint8 [n_blocks, type_size] -> (kind, block, codes, d, dmin, sub_scale, sub_min), arrays
# per block (see PackedMatrix).


def _decode_q4_0(blocks):
    d = _f16(blocks, 0)
    return "q4", 32, blocks[:, 2:], *_per_block(d, d, sub_min=8)  # d (q - 8); nibbles in canonical layout


def _decode_q4_1(blocks):
    return "q4", 32, blocks[:, 4:], *_per_block(_f16(blocks, 0), -_f16(blocks, 2))


def _decode_q5_0(blocks):
    return "q8", 32, _unpack_q5(blocks, 2, 16), *_scaled(_f16(blocks, 0), np.ones((blocks.shape[0], 1)))


def _decode_q5_1(blocks):
    return "q8", 32, _unpack_q5(blocks, 4, 0), *_per_block(_f16(blocks, 0), -_f16(blocks, 2))


def _decode_q8_0(blocks):
    return "q8", 32, blocks[:, 2:].view(np.int8), *_scaled(_f16(blocks, 0), np.ones((blocks.shape[0], 1)))


def _decode_q2_k(blocks):
    codes, sc, mins = _unpack_q2_k(blocks)
    return "q8", 16, codes, _f16(blocks, 80), _f16(blocks, 82), _int8(sc), _int8(mins)


def _decode_q3_k(blocks):
    codes, sc = _unpack_q3_k(blocks)
    return "q8", 16, codes, *_scaled(_f16(blocks, 108), sc)


def _decode_q4_k(blocks):
    codes, sc, mins = _unpack_q4_k(blocks)
    return "q4", 32, codes, _f16(blocks, 0), _f16(blocks, 2), _int8(sc), _int8(mins)


def _decode_q5_k(blocks):
    codes, sc, mins = _unpack_q5_k(blocks)
    return "q8", 32, codes, _f16(blocks, 0), _f16(blocks, 2), _int8(sc), _int8(mins)


def _decode_q6_k(blocks):
    return "q8", 16, _unpack_q6_k(blocks), *_scaled(_f16(blocks, 208), blocks[:, 192:208].view(np.int8))


_BLOCK_DECODERS = {
    Q.Q4_0: _decode_q4_0, Q.Q4_1: _decode_q4_1, Q.Q5_0: _decode_q5_0, Q.Q5_1: _decode_q5_1,
    Q.Q8_0: _decode_q8_0, Q.Q2_K: _decode_q2_k, Q.Q3_K: _decode_q3_k, Q.Q4_K: _decode_q4_k,
    Q.Q5_K: _decode_q5_k, Q.Q6_K: _decode_q6_k,
}


# ---- bit unpacking (numba) ------------------------------------------------------------------------------
# Sub-scales come back as float32 arrays of small integers (stored as int8).


@njit(cache=True)
def _unpack_q5(blocks, qh_at, offset):
    """Q5_0/Q5_1: 32-bit qh (bit j = bit 4 of element j), then 16 bytes of nibbles (j | j+16 << 4)."""
    codes = np.empty((blocks.shape[0], 32), np.int8)
    for i in range(blocks.shape[0]):
        qh = 0
        for k in range(4):
            qh |= np.int64(blocks[i, qh_at + k]) << (8 * k)
        for j in range(16):
            q = np.int64(blocks[i, qh_at + 4 + j])
            codes[i, j] = (q & 15 | ((qh >> j) & 1) << 4) - offset
            codes[i, j + 16] = (q >> 4 | ((qh >> (j + 16)) & 1) << 4) - offset
    return codes


@njit(cache=True)
def _unpack_q2_k(blocks):
    """Q2_K: scales[16] (low nibble scale, high nibble min), qs[64] of 2-bit codes, d, dmin."""
    n = blocks.shape[0]
    codes = np.empty((n, 256), np.int8)
    sc = np.empty((n, 16), np.float32)
    mins = np.empty((n, 16), np.float32)
    for i in range(n):
        for t in range(16):
            sc[i, t] = blocks[i, t] & 15
            mins[i, t] = blocks[i, t] >> 4
        # element h*128 + k*32 + l sits in bits 2k..2k+1 of qs[h*32 + l]
        for h in range(2):
            for k in range(4):
                for lane in range(32):
                    codes[i, h * 128 + k * 32 + lane] = (blocks[i, 16 + h * 32 + lane] >> (2 * k)) & 3
    return codes, sc, mins


@njit(cache=True)
def _unpack_q3_k(blocks):
    """Q3_K: hmask[32], qs[64] of 2-bit low parts, scales[12] (16 6-bit values, offset 32), d."""
    n = blocks.shape[0]
    codes = np.empty((n, 256), np.int8)
    sc = np.empty((n, 16), np.float32)
    for i in range(n):
        for t in range(16):
            low = (blocks[i, 96 + t % 8] >> (4 * (t // 8))) & 15
            high = (blocks[i, 104 + t % 4] >> (2 * (t // 4))) & 3
            sc[i, t] = (low | high << 4) - 32
        for h in range(2):
            for k in range(4):
                for lane in range(32):
                    e = h * 128 + k * 32 + lane
                    low = (blocks[i, 32 + h * 32 + lane] >> (2 * k)) & 3
                    # bit e // 32 of hmask[lane]; a clear bit means the code is 4 lower
                    high_clear = 1 - ((blocks[i, lane] >> (e // 32)) & 1)
                    codes[i, e] = low - 4 * high_clear
    return codes, sc


@njit(cache=True)
def _k_scale_min(scales, i, at, j):
    """6-bit scale and min of sub-block j from the 12 packed bytes at `at` (Q4_K, Q5_K)."""
    if j < 4:
        return scales[i, at + j] & 63, scales[i, at + j + 4] & 63
    sc = (scales[i, at + j + 4] & 15) | (scales[i, at + j - 4] >> 6) << 4
    mn = (scales[i, at + j + 4] >> 4) | (scales[i, at + j] >> 6) << 4
    return sc, mn


@njit(cache=True)
def _unpack_q4_k(blocks):
    """Q4_K: d, dmin, scales[12], qs[128]; sub-block 2g/2g+1 = low/high nibbles of qs[32g..32g+31].
    Re-ordered into the canonical q4 layout: byte j of a sub-block = element j | element j+16 << 4."""
    n = blocks.shape[0]
    codes = np.empty((n, 128), np.uint8)
    sc = np.empty((n, 8), np.float32)
    mins = np.empty((n, 8), np.float32)
    for i in range(n):
        for s in range(8):
            sc[i, s], mins[i, s] = _k_scale_min(blocks, i, 4, s)
            src = 16 + (s // 2) * 32
            shift = 4 * (s % 2)
            for j in range(16):
                lo = (blocks[i, src + j] >> shift) & 15
                hi = (blocks[i, src + 16 + j] >> shift) & 15
                codes[i, s * 16 + j] = lo | hi << 4
    return codes, sc, mins


@njit(cache=True)
def _unpack_q5_k(blocks):
    """Q5_K: d, dmin, scales[12], qh[32] (bit s of qh[l] = bit 4 of sub-block s element l), qs[128]."""
    n = blocks.shape[0]
    codes = np.empty((n, 256), np.int8)
    sc = np.empty((n, 8), np.float32)
    mins = np.empty((n, 8), np.float32)
    for i in range(n):
        for s in range(8):
            sc[i, s], mins[i, s] = _k_scale_min(blocks, i, 4, s)
            src = 48 + (s // 2) * 32
            shift = 4 * (s % 2)
            for lane in range(32):
                low = (blocks[i, src + lane] >> shift) & 15
                high = (blocks[i, 16 + lane] >> s) & 1
                codes[i, s * 32 + lane] = low | high << 4
    return codes, sc, mins


@njit(cache=True)
def _unpack_q6_k(blocks):
    """Q6_K: ql[128] (low nibbles), qh[64] (2-bit high parts), int8 scales[16], d; codes offset by 32."""
    n = blocks.shape[0]
    codes = np.empty((n, 256), np.int8)
    for i in range(n):
        for h in range(2):  # two halves of 128 elements
            for k in range(4):  # quarter k of a half: ql nibble k // 2 of bytes (k % 2)*32.., qh bits 2k
                for lane in range(32):
                    low = (blocks[i, h * 64 + (k % 2) * 32 + lane] >> (4 * (k // 2))) & 15
                    high = (blocks[i, 128 + h * 32 + lane] >> (2 * k)) & 3
                    codes[i, h * 128 + k * 32 + lane] = (low | high << 4) - 32
    return codes


# ---- expansion (numba) ----------------------------------------------------------------------------------


# Serial and without the GIL: the CPU backend runs one tile per thread (a prefill product's row tiles).
@njit(cache=True, nogil=True)
def _expand_q4(codes, scale, bias, code_offset, out):
    rows, n_blocks = scale.shape
    half = codes.shape[1] // n_blocks
    for r in range(rows):
        for b in range(n_blocks):
            s = scale[r, b]
            t = bias[r, b]
            k0 = b * half
            # two simple loops (low nibbles, then high) vectorize; one loop with both stores does not
            for j in range(half):
                out[r, 2 * k0 + j] = s * (np.float32(codes[r, k0 + j] & 15) - code_offset) + t
            for j in range(half):
                out[r, 2 * k0 + half + j] = s * (np.float32(codes[r, k0 + j] >> 4) - code_offset) + t


@njit(cache=True, nogil=True)
def _expand_q8(codes, scale, bias, out):
    rows, n_blocks = scale.shape
    block = codes.shape[1] // n_blocks
    for r in range(rows):
        for b in range(n_blocks):
            s = scale[r, b]
            t = bias[r, b]
            for j in range(block):
                out[r, b * block + j] = s * np.float32(codes[r, b * block + j]) + t
