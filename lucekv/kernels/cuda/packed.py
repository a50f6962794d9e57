"""PackedMatrix weights on the GPU, per-element decoding for the kernels that tile or gather them, and where
products write their rows (`Epilogue`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from lucekv.kernels.cpu.quants import PackedMatrix
from lucekv.kernels.cuda._numba import cuda, half2_floats
from lucekv.kernels.cuda.act import gated
from lucekv.kernels.cuda.rope import Rotary, cos_sin, pair_dims


class Quant(NamedTuple):
    """What kernels read of a DeviceMatrix, passed as one tuple argument (see DeviceMatrix)."""

    codes: object
    high: object
    scales: object
    subs: object
    block_log2: int
    group_log2: int
    sub_scaled: bool
    has_bias: bool


@dataclass
class DeviceMatrix:
    """A PackedMatrix on the GPU, still quantized, its (scale, bias) pairs kept factored (see
    kernels.cpu.quants): a block's scale is d * sub_scale and its bias -(dmin * sub_min).

    codes: q4: uint32 [rows, cols // 8], the packed bytes as little-endian words (wide loads); q8 likewise
    [rows, cols // 4]; q6 (q8 codes that fit in [-32, 31], e.g. Q6_K, Q5_x, Q3_K, Q2_K, stored as 6-bit
    codes + 32): the low nibbles, laid out as q4's, [rows, cols // 8]; f32: float32 [rows, cols].
    high: q6: the codes' bits 4-5 as uint32 [rows, cols // 16], 8 bytes per 32 columns: bits 2s..2s+1 of
    byte j of word w hold element 4 (4w + s) + j of those columns (`q6_word` rebuilds a q8-like word).
    scales: per group of 2^group_log2 blocks the float16 bits of d (low half) and dmin (high half) as uint32,
    or of d alone as uint16 when no block has a bias.
    subs: where sub_scaled, per block the int8 sub_scale (low byte) and sub_min (high byte) as uint16, or
    sub_scale alone as uint8 without a bias; where every sub-factor is one (Q8_0, Q4_1, ...) it is a
    stand-in, never read. Unused arrays are stand-ins of the right type.
    has_bias: whether any bias is nonzero; the products then skip the bias terms entirely.
    half_scale: a power of two that brings the largest |weight| near 2^14, for the matmul's float16 staging."""

    kind: str
    rows: int
    cols: int
    block_log2: int
    group_log2: int
    codes: object
    high: object
    scales: object
    subs: object
    sub_scaled: bool
    has_bias: bool
    half_scale: float = 1.0

    @property
    def quant(self) -> Quant:
        return Quant(self.codes, self.high, self.scales, self.subs, self.block_log2, self.group_log2,
                     self.sub_scaled, self.has_bias)

    @property
    def nbytes(self) -> int:
        """The bytes a product streams: codes, high bits and the factors it reads."""
        read = (self.codes, self.high if self.kind == "q6" else None, self.scales if self.kind != "f32" else None,
                self.subs if self.sub_scaled else None)
        return sum(a.nbytes for a in read if a is not None)


HALF_TOP = 2.0**14  # where half_scale puts a matrix's largest |weight|: float16 holds up to 65504
Q6_OFFSET = 32  # q6 codes are q8 codes + 32, in 0..63


def upload(m: PackedMatrix, stream=0, place=None) -> DeviceMatrix:
    """Copy `m` to the GPU once; `place(array)`: where each of its arrays goes instead (Spark's mapped host copy)."""
    def put(a):
        a = np.ascontiguousarray(a)
        return cuda.to_device(a, stream=stream) if place is None else place(a)

    stand_in = np.zeros((1, 1), np.uint8)
    if m.kind == "f32":
        return DeviceMatrix("f32", m.rows, m.cols, 0, 0, put(np.asarray(m.codes, np.float32)),
                            *(put(stand_in) for _ in range(3)), False, False)
    has_bias = bool(np.any(m.bias != 0))
    d = m.d.view(np.uint16)
    scales = d.astype(np.uint32) | m.dmin.view(np.uint16).astype(np.uint32) << 16 if has_bias else d
    sub_scaled = bool(np.any(m.sub_scale != 1) or has_bias and np.any(m.sub_min != 1))
    sub_scale = m.sub_scale.view(np.uint8)
    subs = sub_scale.astype(np.uint16) | m.sub_min.view(np.uint8).astype(np.uint16) << 8 if has_bias else sub_scale
    kind, codes, high = _device_codes(m)
    return DeviceMatrix(kind, m.rows, m.cols, m.block.bit_length() - 1, m.group.bit_length() - 1, put(codes),
                        put(high), put(scales), put(subs if sub_scaled else stand_in), sub_scaled, has_bias,
                        half_scale(m))


def _device_codes(m: PackedMatrix) -> tuple[str, np.ndarray, np.ndarray]:
    """(kind, codes, high) as DeviceMatrix holds them."""
    stand_in = np.zeros((1, 1), np.uint32)
    codes = np.ascontiguousarray(m.codes)
    if m.kind == "q4" or m.cols % 32 or codes.min(initial=0) < -Q6_OFFSET or codes.max(initial=0) >= Q6_OFFSET:
        return m.kind, codes.view(np.uint32), stand_in
    u = (codes + np.int8(Q6_OFFSET)).view(np.uint8).reshape(m.rows, -1, 32)  # 6-bit codes, 32 columns a run
    low = (u[:, :, :16] & 15) | (u[:, :, 16:] & 15) << 4  # q4's layout
    fields = (u >> 4).reshape(m.rows, -1, 2, 4, 4)  # [row, run, word w, slot s, byte j]: element 4(4w+s)+j
    high = np.zeros(fields.shape[:3] + (4,), np.uint8)
    for slot in range(4):
        high |= fields[:, :, :, slot, :] << (2 * slot)
    return "q6", low.reshape(m.rows, -1).view(np.uint32), high.reshape(m.rows, -1).view(np.uint32)


def half_scale(m: PackedMatrix) -> float:
    """2^e with the matrix's largest |weight| (bounded by its largest |scale| times its largest |code| plus its
    largest |bias|) times 2^e in [HALF_TOP / 2, HALF_TOP]: float16 then holds every weight without overflow,
    and weights down to 2^-28 of the largest as normal numbers."""
    if m.kind == "f32":
        return 1.0
    top = float(np.max(np.abs(m.scale))) * (15 if m.kind == "q4" else 128) + float(np.max(np.abs(m.bias)))
    return float(2.0 ** np.clip(np.floor(np.log2(HALF_TOP / top)), -100, 100)) if top > 0 else 1.0


# ---- (scale, bias) of a block, element decoders -------------------------------------------------------


@cuda.jit(device=True, inline=True)
def signed_byte(v):
    """The low byte of v as an int8 value."""
    return np.int32(v & np.uint32(0xFF)) - np.int32((v & np.uint32(0x80)) << np.uint32(1))


@cuda.jit(device=True, inline=True)
def block_words(w, r, b):
    """The raw (scale word, sub word) of row r's block b: loads kept apart from the math, so that kernels can
    issue them early and decode them (`scale_bias`) when they are needed."""
    sub = np.uint32(w.subs[r, b]) if w.sub_scaled else np.uint32(0)
    return np.uint32(w.scales[r, b >> w.group_log2]), sub


@cuda.jit(device=True, inline=True)
def scale_bias(w, scale_word, sub_word):
    """(scale, bias) of a block from its words: float32 d * sub_scale and -(dmin * sub_min), exactly as the
    CPU's PackedMatrix.scale and .bias."""
    d, dmin = half2_floats(scale_word)
    if w.sub_scaled:
        d *= np.float32(signed_byte(sub_word))
        dmin *= np.float32(signed_byte(sub_word >> np.uint32(8)))
    return d, -dmin


@cuda.jit(device=True, inline=True)
def block_scale_bias(w, r, b):
    scale_word, sub_word = block_words(w, r, b)
    return scale_bias(w, scale_word, sub_word)


@cuda.jit(device=True, inline=True)
def q6_word(low, high, g):
    """The 6-bit codes of elements 4g..4g+3 of a 32-column run (one byte each, low first) from its low word
    g % 4 and high word g // 4 (see DeviceMatrix)."""
    nibbles = (low >> np.uint32(4 * (g >> 2))) & np.uint32(0x0F0F0F0F)
    return nibbles | ((high >> np.uint32(2 * (g & 3))) & np.uint32(0x03030303)) << np.uint32(4)


# Element decoders, one signature for every kind: (Quant, row, col) -> float32.


@cuda.jit(device=True, inline=True)
def _nibble(words, r, k):
    """Element k of a row in q4's layout: per 32-run 16 bytes, byte j holds element j (low) and j + 16."""
    byte = (k >> 5) * 16 + (k & 15)
    return (words[r, byte >> 2] >> np.uint32(8 * (byte & 3) + 4 * ((k >> 4) & 1))) & np.uint32(15)


@cuda.jit(device=True, inline=True)
def q4_at(w, r, k):
    s, t = block_scale_bias(w, r, k >> 5)
    return s * np.float32(_nibble(w.codes, r, k)) + t


@cuda.jit(device=True, inline=True)
def q6_at(w, r, k):
    g = (k & 31) >> 2
    high = (w.high[r, 2 * (k >> 5) + (g >> 2)] >> np.uint32(8 * (k & 3) + 2 * (g & 3))) & np.uint32(3)
    s, t = block_scale_bias(w, r, k >> w.block_log2)
    return s * np.float32(np.int32(_nibble(w.codes, r, k) | high << np.uint32(4)) - Q6_OFFSET) + t


@cuda.jit(device=True, inline=True)
def q8_at(w, r, k):
    s, t = block_scale_bias(w, r, k >> w.block_log2)
    return s * np.float32(signed_byte(w.codes[r, k >> 2] >> np.uint32(8 * (k & 3)))) + t


@cuda.jit(device=True, inline=True)
def f32_at(w, r, k):
    return w.codes[r, k]


def element_decoder(kind: str):
    return {"q4": q4_at, "q6": q6_at, "q8": q8_at, "f32": f32_at}[kind]


# ---- where a product's rows go ----------------------------------------------------------------------------


GATE_ROWS = 8  # gated products: rows in groups of 8 gate rows, then the same 8 rows of up (see interleave_rows)
NO_GATE, SILU, GELU = 0, 1, 2


class Epilogue(NamedTuple):
    """A product's destination, passed to its kernel as one tuple argument: rows [0, end0) go to out0,
    [end0, end1) to out1, the rest to out2, each plus bias[row] (a vector over all rows) and residual[t, row]
    where the flags say so. One product can thus fill the separate q, k, v arrays of stacked weights, add its
    bias and the residual stream, with no pass of its own. Unused arrays are stand-ins of the right type (never
    read or written). With `gate` (SILU or GELU) the rows are gate/up groups of GATE_ROWS and out0 receives
    act(gate) * up instead (one column per pair: the products' kernels pair them, `put` does not)."""

    out0: object
    out1: object
    out2: object
    end0: int
    end1: int
    bias: object
    has_bias: bool
    residual: object
    has_residual: bool
    gate: int


def epilogue(outs: Sequence, bias=None, residual=None, gate: int = NO_GATE) -> Epilogue:
    """outs: 1 to 3 device arrays [n, rows_i] taking consecutive rows; bias: float32 [sum rows_i];
    residual: [n, rows] (with a single output); gate: SILU or GELU for a gated product into one output."""
    if not 1 <= len(outs) <= 3:
        raise ValueError(f"a product writes 1 to 3 arrays, got {len(outs)}")
    if residual is not None and len(outs) != 1:
        raise ValueError("a residual is added to a single output")
    ends = np.cumsum([o.shape[1] for o in outs]).tolist()
    padded = list(outs) + [outs[-1]] * (3 - len(outs))
    end0, end1 = (ends + [ends[-1]] * 2)[:2]
    first = outs[0]
    return Epilogue(*padded, end0, end1, first[0] if bias is None else bias, bias is not None,
                    first if residual is None else residual, residual is not None, gate)


def as_epilogue(out) -> Epilogue:
    """A plain output array means: all rows there, nothing added."""
    return out if isinstance(out, Epilogue) else epilogue((out,))


@cuda.jit(device=True, inline=True)
def put_gated(ep, t, r, g, u):
    """Gate row r's value g and its up row's u: act(g) * u to its column of out0."""
    ep.out0[t, (r // (2 * GATE_ROWS)) * GATE_ROWS + r % GATE_ROWS] = gated(g, u, ep.gate == GELU)


@cuda.jit(device=True, inline=True)
def put(ep, t, r, v):
    """Row r of token t's product, value v, to its place (see Epilogue)."""
    if ep.has_bias:
        v += ep.bias[r]
    if ep.has_residual:
        v += ep.residual[t, r]
    if r < ep.end0:
        ep.out0[t, r] = v
    elif r < ep.end1:
        ep.out1[t, r - ep.end0] = v
    else:
        ep.out2[t, r - ep.end1] = v


class AttentionInputs(NamedTuple):
    """A one-token step's q/k/v product writing attention's inputs itself (the product then replaces a RoPE and
    store launch): its rows, from `row0` on, are the q (n_q), k (n_k) and v rows of the stacked projections, q
    and k in paired order (rope.pair_order), each row plus bias[row] where has_bias. Token t's q, rotated, goes
    to q_out[t] and its k, rotated, and v to the pool at slots[t], in natural order. Passed as one argument."""

    q_out: object  # float32 [n, n_q]
    k_pool: object  # [slots, n_kv, head_dim]
    v_pool: object
    positions: object  # int32 [n]
    slots: object
    rope: Rotary
    n_q: int
    n_k: int
    row0: int
    bias: object
    has_bias: bool


def attention_inputs(q_out, k_pool, v_pool, positions, slots, rope: Rotary, n_q: int, n_k: int, row0: int = 0,
                     bias=None) -> AttentionInputs:
    if not rope.paired and rope.neox:
        raise ValueError("a product rotates q and k in paired order only (see rope.pair_order)")
    return AttentionInputs(q_out, k_pool, v_pool, positions, slots, rope, n_q, n_k, row0,
                           q_out[0] if bias is None else bias, bias is not None)


@cuda.jit(device=True, inline=True)
def _column(ep, r):
    """Which of q (0), k (1) and v (2) row r of the stacked q/k/v rows belongs to, and its column there."""
    if r < ep.n_q:
        return 0, r
    if r < ep.n_q + ep.n_k:
        return 1, r - ep.n_q
    return 2, r - ep.n_q - ep.n_k


@cuda.jit(device=True, inline=True)
def pair_cos_sin(ep, t, r):
    """cos and sin of the rotation of the product's rows r, r + 1 (r even) for token t: (1, 0) where they are not
    rotated. Kernels take it before their rows' sums are in (its float64 math then overlaps their loads)."""
    part, col = _column(ep, r + ep.row0)
    p = col % ep.k_pool.shape[2]
    if part < 2 and p < 2 * ep.rope.inv.shape[0]:
        return cos_sin(ep.positions[t], ep.rope.inv, p // 2)
    return np.float32(1), np.float32(0)


@cuda.jit(device=True, inline=True)
def put_pair(ep, t, r, a, b, c, s):
    """Rows r, r + 1 (r even) of token t's product, values a and b, to their places (see AttentionInputs); c, s:
    `pair_cos_sin` of the rows."""
    if ep.has_bias:
        a += ep.bias[r]
        b += ep.bias[r + 1]
    part, col = _column(ep, r + ep.row0)
    head_dim = ep.k_pool.shape[2]
    head, p = col // head_dim, col % head_dim
    slot = ep.slots[t]
    if part == 2:
        ep.v_pool[slot, head, p] = a
        ep.v_pool[slot, head, p + 1] = b
        return
    d0, d1 = p, p + 1
    if p < 2 * ep.rope.inv.shape[0]:
        a, b = a * c - b * s, a * s + b * c
        d0, d1 = pair_dims(p // 2, ep.rope.inv.shape[0], ep.rope.neox)
    if part == 0:
        ep.q_out[t, col - p + d0] = a
        ep.q_out[t, col - p + d1] = b
    else:
        ep.k_pool[slot, head, d0] = a
        ep.k_pool[slot, head, d1] = b
