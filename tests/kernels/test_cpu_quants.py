"""CPU quant kernels against gguf's numpy reference: dequantization bit for bit, products against float64."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from numba import njit

from lucekv.errors import UnsupportedModelError
from lucekv.kernels.cpu import matvec as matvec_module
from lucekv.kernels.cpu.intdot import (
    TILE_ROWS,
    TILE_TOKENS,
    group_q4,
    group_q4_bias,
    group_q4_bias_generic,
    group_q4_generic,
    group_q8,
    group_q8_16,
    group_q8_16_bias,
    group_q8_16_bias_generic,
    group_q8_16_generic,
    group_q8_bias,
    group_q8_bias_generic,
    group_q8_generic,
    quantize_x16,
    tile_16,
    tile_16_bias,
    tile_16_bias_generic,
    tile_16_generic,
    tile_32,
    tile_32_bias,
    tile_32_bias_generic,
    tile_32_generic,
)
from lucekv.kernels.cpu.matvec import (
    MATMUL_TILE_ROWS,
    matmul,
    matvec,
    matvec_rows,
)
from lucekv.kernels.cpu.quants import (
    SUPPORTED_QTYPES,
    PackedMatrix,
    dequantize,
    dequantize_rows,
    group_rows,
    pack,
    pack_tensor,
)
from lucekv.model.gguf import TensorInfo, open_gguf

# Byte offsets of each block's f16 fields (d, and dmin/m where the type has one), from ggml's block structs.
F16_FIELDS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}
BLOCK_QTYPES = list(F16_FIELDS)
FLOAT_QTYPES = [Q.F32, Q.F16, Q.BF16]
EXPECTED_FORM = {  # (kind, elements per scale/bias pair)
    Q.Q4_0: ("q4", 32), Q.Q4_1: ("q4", 32), Q.Q4_K: ("q4", 32),
    Q.Q5_0: ("q8", 32), Q.Q5_1: ("q8", 32), Q.Q8_0: ("q8", 32), Q.Q5_K: ("q8", 32),
    Q.Q2_K: ("q8", 16), Q.Q3_K: ("q8", 16), Q.Q6_K: ("q8", 16),
    Q.F32: ("f32", 0), Q.F16: ("f32", 0), Q.BF16: ("f32", 0),
}


def random_finite_f16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """Any f16 bit pattern but inf/NaN: signs, zeros, subnormals and the largest values all occur."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    is_special = (bits & 0x7C00) == 0x7C00
    bits[is_special] &= np.uint16(0xBFFF)  # clear the exponent's top bit: a finite number
    return bits


def random_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int, f16_bits=None) -> np.ndarray:
    """uint8 [rows, bytes per row]: random bytes with finite f16 fields, as the GGUF reader hands them out."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block_size
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        bits = random_finite_f16_bits(rng, n_blocks) if f16_bits is None else f16_bits(n_blocks)
        blocks[:, offset:offset + 2] = bits.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(rows, -1)


def random_raw(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Realistic magnitudes (scales ~0.02, weights ~N(0,1)) for the product tests."""
    if qtype == Q.F32:
        return rng.normal(size=(rows, cols)).astype(np.float32)
    if qtype == Q.F16:
        return rng.normal(size=(rows, cols)).astype(np.float16)
    if qtype == Q.BF16:
        return (rng.normal(size=(rows, cols)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return random_blocks(rng, qtype, rows, cols,
                         lambda n: rng.normal(0, 0.02, n).astype(np.float16).view(np.uint16))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", BLOCK_QTYPES, ids=lambda q: q.name)
def test_dequantize_equals_gguf_bit_for_bit(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(rng, qtype, 6, 512)
    ours = dequantize(raw, qtype, (6, 512))
    assert ours.shape == (6, 512)
    assert same_bits(ours, gguf_dequantize(raw, qtype))


def test_dequantize_float_types_bit_for_bit():
    rng = np.random.default_rng(0)
    f32 = rng.normal(size=(3, 40)).astype(np.float32)
    assert same_bits(dequantize(f32, Q.F32, (3, 40)), f32)
    f16 = random_finite_f16_bits(rng, 120).view(np.float16).reshape(3, 40)
    assert same_bits(dequantize(f16, Q.F16, (3, 40)), gguf_dequantize(f16, Q.F16))
    bf16 = rng.integers(0, 1 << 16, (3, 40), dtype=np.uint16)
    expected = gguf_dequantize(bf16.view(np.uint8), Q.BF16)
    assert same_bits(dequantize(bf16, Q.BF16, (3, 40)), expected)  # reader may hand out uint16 ...
    assert same_bits(dequantize(bf16.view(np.uint8), Q.BF16, (3, 40)), expected)  # ... or bytes


def test_dequantize_vector_keeps_its_shape():
    rng = np.random.default_rng(1)
    raw = random_blocks(rng, Q.Q8_0, 1, 96).reshape(-1)
    ours = dequantize(raw, Q.Q8_0, (96,))
    assert ours.shape == (96,)
    assert same_bits(ours, gguf_dequantize(raw, Q.Q8_0))


@pytest.mark.parametrize("qtype", BLOCK_QTYPES + FLOAT_QTYPES, ids=lambda q: q.name)
def test_packed_form_expands_to_gguf_values(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    rows, cols = 7, 512
    float_type = qtype in FLOAT_QTYPES
    raw = random_raw(rng, qtype, rows, cols) if float_type else random_blocks(rng, qtype, rows, cols)
    m = pack(raw, qtype, (rows, cols))
    kind, block = EXPECTED_FORM[qtype]
    assert (m.kind, m.block, m.rows, m.cols) == (kind, block, rows, cols)
    code_shape, code_dtype = {"q4": ((rows, cols // 2), np.uint8), "q8": ((rows, cols), np.int8),
                              "f32": ((rows, cols), np.float32)}[kind]
    assert m.codes.shape == code_shape and m.codes.dtype == code_dtype
    if kind != "f32":
        assert m.scale.shape == m.bias.shape == (rows, cols // block)

    ref = gguf_dequantize(raw.view(np.uint8) if qtype == Q.BF16 else raw, qtype).reshape(rows, cols)
    ours = dequantize_rows(m, 0, rows)
    if qtype == Q.Q4_0:
        # scale*code + bias with bias = -8d gives +0.0 where gguf's d*(q-8) gives -0.0: equal values only
        assert np.array_equal(ours, ref)
        assert np.all((ours.view(np.uint32) == ref.view(np.uint32)) | (ours == 0))
    else:
        assert same_bits(ours, ref)
    assert same_bits(dequantize_rows(m, 2, 5), ours[2:5])


def test_q4_codes_use_the_canonical_nibble_order():
    """Q4_K stores sub-blocks as low/high nibbles of 32 shared bytes; the repack must put element j of a
    32-block in the low nibble of byte j and element 16 + j in the high nibble, as Q4_0 does."""
    rng = np.random.default_rng(7)
    raw = random_blocks(rng, Q.Q4_K, 2, 512)
    m = pack(raw, Q.Q4_K, (2, 512))
    nibbles = m.codes.reshape(2, 16, 16)
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=2).astype(np.float32)  # element order
    expanded = m.scale[:, :, None] * codes + m.bias[:, :, None]
    assert np.array_equal(expanded.reshape(2, 512), gguf_dequantize(raw, Q.Q4_K))


def assert_close_to_float64(ours: np.ndarray, w: np.ndarray, xs: np.ndarray) -> None:
    """Error of each output within 1e-4 of sum|w||x|: float32 accumulation's bound, with headroom."""
    w64, x64 = w.astype(np.float64), xs.astype(np.float64)
    err = np.abs(ours - x64 @ w64.T)
    scale = np.abs(x64) @ np.abs(w64).T
    assert np.all(err <= 1e-4 * scale), f"max relative error {np.max(err / scale):.2e}"


# Rows past one matmul tile and not a multiple of it; cols with an odd number of 32-blocks where the type
# allows it (the q4 kernel pairs blocks), and a tail past the f32 kernel's 32 lanes.
PRODUCT_SHAPES = {q: (MATMUL_TILE_ROWS + 45, 512) for q in BLOCK_QTYPES} | {
    Q.Q4_0: (MATMUL_TILE_ROWS + 45, 288), Q.Q4_1: (37, 288), Q.Q5_0: (37, 288), Q.Q8_0: (37, 96),
    Q.F32: (MATMUL_TILE_ROWS + 45, 100), Q.F16: (37, 64), Q.BF16: (37, 64),
}


@pytest.mark.parametrize("qtype", list(PRODUCT_SHAPES), ids=lambda q: q.name)
def test_matvec_and_matmul_match_float64(qtype):
    rng = np.random.default_rng(200 + int(qtype))
    rows, cols = PRODUCT_SHAPES[qtype]
    raw = random_raw(rng, qtype, rows, cols)
    m = pack(raw, qtype, (rows, cols))
    w = dequantize(raw, qtype, (rows, cols))
    x = rng.normal(size=cols).astype(np.float32)
    y = matvec(m, x)
    assert y.shape == (rows,) and y.dtype == np.float32
    assert_close_to_float64(y[None, :], w, x[None, :])
    for n in (1, 5):
        xs = rng.normal(size=(n, cols)).astype(np.float32)
        ys = matmul(m, xs)
        assert ys.shape == (n, rows) and ys.dtype == np.float32
        assert_close_to_float64(ys, w, xs)
    # a batch's decode rows: each row exactly what matvec gives it alone
    rows_out = matvec_rows(m, xs)
    assert all(np.array_equal(rows_out[t], matvec(m, xs[t])) for t in range(len(xs)))


def grouped(m: PackedMatrix) -> PackedMatrix:
    """m in the decode step's form (PackedMatrix.grouped), as the step's arenas hold it."""
    g = copy.copy(m)
    g.codes, scale, bias = group_rows(m)
    g.__dict__.update(scale=scale, bias=bias)
    for a in (g.codes, scale, bias):
        a.flags.writeable = False  # as the arenas' (one compiled form)
    g.grouped = True
    return g


@njit(cache=True)
def _group0(codes, scale, bias, xp, xd, xsum, out):
    """A group of each kernel (q4, q8, q8_16, each without and with bias terms) as the step runs it (native where the
    CPU has AVX-512 VNNI), in out[0, k], and in intdot's generic IR, in out[1, k]; xp: one token's cols / 2 pairs."""
    n32, n16 = xp.shape[0] // 16, xp.shape[0] // 8
    a32 = (codes, 0, xp, 0, scale, 0, xd, 0, n32, bias, 0, xsum, 0)
    a16 = (codes, 0, xp, 0, scale, 0, xd, 0, n16, bias, 0, xsum, 0)
    group_q4(*a32, out[0, 0], 0)
    group_q4_generic(*a32, out[1, 0], 0)
    group_q4_bias(*a32, out[0, 1], 0)
    group_q4_bias_generic(*a32, out[1, 1], 0)
    group_q8(*a32, out[0, 2], 0)
    group_q8_generic(*a32, out[1, 2], 0)
    group_q8_bias(*a32, out[0, 3], 0)
    group_q8_bias_generic(*a32, out[1, 3], 0)
    group_q8_16(*a16, out[0, 4], 0)
    group_q8_16_generic(*a16, out[1, 4], 0)
    group_q8_16_bias(*a16, out[0, 5], 0)
    group_q8_16_bias_generic(*a16, out[1, 5], 0)


def test_group_kernels_native_equal_generic():
    """The decode group kernels with VNNI and in their generic IR give the same bits (exact int32 sums, the same float
    steps), codes and x at their extremes."""
    rng = np.random.default_rng(8)
    cols = 96
    codes = rng.integers(0, 256, size=cols * 16, dtype=np.uint8)  # as many bytes as a q8 group of cols
    codes[:32] = 128  # int8 -128
    xq = rng.integers(-32767, 32768, size=cols).astype(np.int16)
    xq[:32] = -32767
    # 16 rows' factors of cols / 16 blocks at most, float16 values: as float32 and as float16 bits the same numbers
    scale, bias = rng.normal(size=(2, cols)).astype(np.float16)
    xd, xsum = rng.uniform(0, 1e-3, size=cols // 32).astype(np.float32), rng.normal(size=cols // 16).astype(np.float32)
    out, halves = np.empty((2, 2, 6, 16), np.float32)
    _group0(codes, scale.astype(np.float32), bias.astype(np.float32), xq.view(np.int32), xd, xsum, out)
    _group0(codes, scale.view(np.uint16), bias.view(np.uint16), xq.view(np.int32), xd, xsum, halves)
    assert np.array_equal(out[0], out[1]) and np.array_equal(halves, out)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q5_0, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_grouped_products_match_float64_and_the_prompt_tiles(qtype, monkeypatch):
    """The decode step's products (weights grouped by 16 rows, x rounded to int16 per 32-block): against float64 of
    the same rounded x within float32's bound, every row alone as in a batch, bit for bit what a prompt's tiles give
    the same token; the grouped form expands to the same weights."""
    monkeypatch.setattr(matvec_module, "TILES", True)  # also where the CPU has no VNNI: the generic IR
    rng = np.random.default_rng(300 + int(qtype))
    rows, cols = 37, 512 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 288  # 37 rows: a last group of 5
    raw = random_raw(rng, qtype, rows, cols)
    m = pack(raw, qtype, (rows, cols))
    g = grouped(m)
    assert (g.scale.dtype == np.uint16) == (qtype in (Q.Q4_1, Q.Q8_0, Q.Q5_0))  # float16 where exact, else float32
    w = dequantize(raw, qtype, (rows, cols))
    assert np.array_equal(dequantize_rows(g, 0, rows), w) and np.array_equal(dequantize_rows(g, 7, 21), w[7:21])
    xs = rng.normal(size=(2, cols)).astype(np.float32) * rng.choice([1e-3, 1.0, 30.0], size=cols).astype(np.float32)
    xs[0, :32] = 0  # a block of zeros: scale 0, codes 0
    xq, xd = np.empty((2, cols), np.int16), np.empty((2, cols // 32), np.float32)
    for t in range(2):
        quantize_x16(xs[t], xq[t], xd[t])
    step = xd.repeat(32, axis=1).astype(np.float64)
    assert np.all(np.abs(step * xq - xs) <= step / 2 * 1.01)  # float32's x / step is off by up to 0.002 steps
    out = matvec_rows(g, xs)
    # the codes' part meets the rounded x; the biases meet x's float block sums
    bias = np.repeat(m.bias, m.block, axis=1).astype(np.float64)
    xr = step * xq
    ref = xr @ (w - bias).T + xs.astype(np.float64) @ bias.T
    assert np.all(np.abs(out - ref) <= 1e-4 * (np.abs(xr) @ np.abs(w.astype(np.float64)).T))
    assert np.array_equal(matvec_rows(g, xs[1:])[0], out[1])
    prompt = np.concatenate([xs, rng.normal(size=(TILE_TOKENS, cols)).astype(np.float32)])
    assert np.array_equal(matmul(m, prompt)[:2], out) and np.array_equal(matmul(g, prompt), matmul(m, prompt))


@njit(cache=True)
def _tiles_native_and_generic(w, xp, xd, scale, bias, xsum16, xsum32, n_pairs):
    """Each tile kernel (32- and 16-blocks, with and without bias terms) as _tile_rows runs it (VNNI where the CPU
    has it) and in intdot's generic IR (what a CPU without runs): out[0] and out[1]."""
    out = np.empty((2, 4, TILE_ROWS * TILE_TOKENS), np.float32)
    nb32, nb16 = n_pairs // 16, n_pairs // 8
    tile_32(w, xp, xd, scale, bias, xsum32, out[0, 0], nb32)
    tile_32_generic(w, xp, xd, scale, bias, xsum32, out[1, 0], nb32)
    tile_32_bias(w, xp, xd, scale, bias, xsum32, out[0, 1], nb32)
    tile_32_bias_generic(w, xp, xd, scale, bias, xsum32, out[1, 1], nb32)
    tile_16(w, xp, xd, scale, bias, xsum16, out[0, 2], nb16)
    tile_16_generic(w, xp, xd, scale, bias, xsum16, out[1, 2], nb16)
    tile_16_bias(w, xp, xd, scale, bias, xsum16, out[0, 3], nb16)
    tile_16_bias_generic(w, xp, xd, scale, bias, xsum16, out[1, 3], nb16)
    return out


def test_tile_kernels_native_equal_generic():
    """The VNNI tile kernels and their generic IR give the same bits (exact int32 sums, the same float steps), and
    the generic one's numbers are float64's within float32's bound, codes at their extremes."""
    rng = np.random.default_rng(7)
    n_pairs = 48  # 3 blocks of 32, 6 of 16
    codes = rng.integers(-128, 128, size=(TILE_ROWS, 2 * n_pairs)).astype(np.int16)
    codes[0] = -128
    xq = rng.integers(-32767, 32768, size=(TILE_TOKENS, 2 * n_pairs)).astype(np.int16)
    xq[1] = -32767
    w = np.ascontiguousarray(codes.view(np.int32).T).reshape(-1)  # pair p of row i at p * TILE_ROWS + i
    xp = np.ascontiguousarray(xq.view(np.int32).T).reshape(-1)
    xd = rng.uniform(0, 1e-3, size=(n_pairs // 16, TILE_TOKENS)).astype(np.float32)
    scale, bias = (rng.normal(size=TILE_ROWS * n_pairs // 8).astype(np.float32) for _ in range(2))
    xsum16, xsum32 = (rng.normal(size=n_pairs // k * TILE_TOKENS).astype(np.float32) for k in (8, 16))
    out = _tiles_native_and_generic(w, xp, xd.reshape(-1), scale, bias, xsum16, xsum32, n_pairs)
    assert np.array_equal(out[0], out[1])
    # the 16-block kernel with its bias terms, in float64
    sums = (codes.astype(np.int64).reshape(TILE_ROWS, 1, -1, 16) * xq.astype(np.int64).reshape(1, TILE_TOKENS, -1, 16)
            ).sum(axis=-1)  # [row, token, 16-block]
    sc, bi = scale.reshape(-1, TILE_ROWS).T[:, None, :6], bias.reshape(-1, TILE_ROWS).T[:, None, :6]
    xd16 = np.repeat(xd.T, 2, axis=1)[None].astype(np.float64)
    ref = (sums * sc * xd16 + bi * xsum16.reshape(-1, TILE_TOKENS).T[None]).sum(axis=-1)
    got = out[1, 3].reshape(TILE_ROWS, TILE_TOKENS)
    bound = (np.abs(sums * sc * xd16) + np.abs(bi * xsum16.reshape(-1, TILE_TOKENS).T[None])).sum(axis=-1)
    assert np.all(np.abs(got - ref) <= 1e-6 * bound)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q8_0, Q.Q5_1, Q.Q6_K], ids=lambda q: q.name)
def test_prompt_tiles_match_float64(qtype, monkeypatch):
    """A prompt's products through the tile kernels (tokens the lanes, weight rows broadcast): within float32's bound
    of float64 on the int16-rounded x (as the decode step's), every token's row the same alone as among others."""
    monkeypatch.setattr(matvec_module, "TILES", True)  # also where the CPU has no VNNI: the generic IR
    rng = np.random.default_rng(400 + int(qtype))
    rows, cols = 37, 512 if qtype in (Q.Q4_K, Q.Q6_K) else 288  # rows: a tile of 8 past the last whole one
    raw = random_raw(rng, qtype, rows, cols)
    m = pack(raw, qtype, (rows, cols))
    w = dequantize(raw, qtype, (rows, cols)).astype(np.float64)
    n = TILE_TOKENS + 3  # a second, partial group of tokens
    xs = rng.normal(size=(n, cols)).astype(np.float32) * rng.choice([1e-3, 1.0, 30.0], size=cols).astype(np.float32)
    xs[0, :32] = 0
    out = matmul(m, xs)
    xq, xd = np.empty((n, cols), np.int16), np.empty((n, cols // 32), np.float32)
    for t in range(n):
        quantize_x16(xs[t], xq[t], xd[t])
    xr = xd.repeat(32, axis=1).astype(np.float64) * xq
    bias = np.repeat(m.bias, m.block, axis=1).astype(np.float64)
    ref = xr @ (w - bias).T + xs.astype(np.float64) @ bias.T
    assert np.all(np.abs(out - ref) <= 1e-4 * (np.abs(xr) @ np.abs(w).T))
    assert np.array_equal(matmul(m, xs[[5, 17]]), out[[5, 17]])


def test_shape_errors_are_refused():
    m = pack(random_raw(np.random.default_rng(3), Q.Q8_0, 4, 64), Q.Q8_0, (4, 64))
    with pytest.raises(ValueError, match="expected"):
        matvec(m, np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="out of range"):
        dequantize_rows(m, 2, 5)
    with pytest.raises(ValueError, match="does not hold"):
        pack(np.zeros(10, np.uint8), Q.Q8_0, (4, 64))


def test_supported_types_are_the_mapped_ones():
    assert set(SUPPORTED_QTYPES) == set(EXPECTED_FORM)


def test_unsupported_quant_type_is_named():
    raw = np.zeros(66, np.uint8)
    with pytest.raises(UnsupportedModelError, match=r"IQ2_XXS is not supported \(supported: F32, F16"):
        dequantize(raw, Q.IQ2_XXS, (256,))
    with pytest.raises(UnsupportedModelError, match="IQ2_XXS"):
        pack(raw, Q.IQ2_XXS, (1, 256))


def test_pack_tensor_takes_matrices_only():
    rng = np.random.default_rng(4)
    raw = random_raw(rng, Q.Q4_1, 3, 64)
    m = pack_tensor(TensorInfo("w", Q.Q4_1, (3, 64), raw))
    assert same_bits(dequantize_rows(m, 0, 3), gguf_dequantize(raw, Q.Q4_1))
    with pytest.raises(ValueError, match="not a matrix"):
        pack_tensor(TensorInfo("norm", Q.F32, (64,), np.ones(64, np.float32)))


@pytest.mark.parametrize("name", [
    "smollm2-135m",
    pytest.param("gemma3-270m", marks=pytest.mark.slow),
    pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow),
])
def test_real_tensors_of_every_type(name, model_path):
    """The first rows of one tensor per quant type in a real file: dequantize and matvec."""
    rng = np.random.default_rng(5)
    by_type: dict[Q, TensorInfo] = {}
    for t in open_gguf(model_path(name)).tensors.values():
        if len(t.shape) == 2:
            by_type.setdefault(t.qtype, t)
    assert by_type
    for qtype, t in by_type.items():
        rows, cols = min(t.shape[0], 64), t.shape[1]
        raw = t.data[:rows]
        ours = dequantize(raw, qtype, (rows, cols))
        assert same_bits(ours, gguf_dequantize(raw, qtype).reshape(rows, cols)), t.name
        x = rng.normal(size=cols).astype(np.float32)
        assert_close_to_float64(matvec(pack(raw, qtype, (rows, cols)), x)[None, :], ours, x[None, :])
