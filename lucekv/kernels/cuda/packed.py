"""PackedMatrix weights on the GPU, per-element decoding for the kernels that tile or gather them, and where
products write their rows (`Epilogue`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from lucekv.kernels.cpu.quants import PackedMatrix
from lucekv.kernels.cuda._numba import cuda
from lucekv.kernels.cuda.act import gated


@dataclass
class DeviceMatrix:
    """A PackedMatrix on the GPU, still quantized.

    codes: q4 / q8: uint32 [rows, words], the packed bytes as little-endian words (wide loads);
    f32: float32 [rows, cols]. scale, bias: float32 [rows, cols // block] ([1, 1] placeholders for f32).
    block_log2: log2 of the elements per (scale, bias) block (0 for f32).
    has_bias: whether any bias is nonzero; types without one (Q8_0, Q6_K, ...) have all -0.0, and the
    decode matvec then skips reading them (a sixth of a 16-block q8 matrix's bytes).
    half_scale: a power of two that brings the largest |weight| near 2^14, for the matmul's float16 staging."""

    kind: str
    rows: int
    cols: int
    block_log2: int
    codes: object
    scale: object
    bias: object
    has_bias: bool
    half_scale: float = 1.0


HALF_TOP = 2.0**14  # where half_scale puts a matrix's largest |weight|: float16 holds up to 65504


def upload(m: PackedMatrix, stream=0) -> DeviceMatrix:
    """Copy `m` to the GPU once."""
    if m.kind == "f32":
        codes = np.ascontiguousarray(m.codes, np.float32)
        scale = bias = np.zeros((1, 1), np.float32)
    else:
        codes = np.ascontiguousarray(m.codes).view(np.uint32)
        scale, bias = np.ascontiguousarray(m.scale), np.ascontiguousarray(m.bias)
    return DeviceMatrix(m.kind, m.rows, m.cols, max(m.block.bit_length() - 1, 0),
                        cuda.to_device(codes, stream=stream), cuda.to_device(scale, stream=stream),
                        cuda.to_device(bias, stream=stream), bool(np.any(bias != 0)), half_scale(m))


def half_scale(m: PackedMatrix) -> float:
    """2^e with the matrix's largest |weight| (bounded by its largest |scale| times its largest |code| plus its
    largest |bias|) times 2^e in [HALF_TOP / 2, HALF_TOP]: float16 then holds every weight without overflow,
    and weights down to 2^-28 of the largest as normal numbers."""
    if m.kind == "f32":
        return 1.0
    top = float(np.max(np.abs(m.scale))) * (15 if m.kind == "q4" else 128) + float(np.max(np.abs(m.bias)))
    return float(2.0 ** np.clip(np.floor(np.log2(HALF_TOP / top)), -100, 100)) if top > 0 else 1.0


# Element decoders, one signature for every kind: (codes, scale, bias, block_log2, row, col) -> float32.


@cuda.jit(device=True, inline=True)
def q4_at(words, scale, bias, block_log2, r, k):
    # canonical q4: per 32-block 16 bytes; byte j holds element j (low nibble) and j + 16 (high)
    b = k >> 5
    j = k & 31
    byte = b * 16 + (j & 15)
    shift = np.uint32(8 * (byte & 3) + 4 * (j >> 4))
    code = (words[r, byte >> 2] >> shift) & np.uint32(15)
    return scale[r, b] * np.float32(code) + bias[r, b]


@cuda.jit(device=True, inline=True)
def q8_at(words, scale, bias, block_log2, r, k):
    byte = np.int32((words[r, k >> 2] >> np.uint32(8 * (k & 3))) & np.uint32(0xFF))
    b = k >> block_log2
    return scale[r, b] * np.float32(byte - ((byte & 0x80) << 1)) + bias[r, b]


@cuda.jit(device=True, inline=True)
def f32_at(w, scale, bias, block_log2, r, k):
    return w[r, k]


def element_decoder(kind: str):
    return {"q4": q4_at, "q8": q8_at, "f32": f32_at}[kind]


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
