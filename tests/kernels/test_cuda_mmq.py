"""The integer tensor-core product of 2..64 tokens (kernels/cuda/mmq.py) and its mma intrinsics, against numpy (see
test_cuda_kernels.py for how the simulator runs these without a GPU).

The intrinsic tests pin the PTX ISA's s8 fragment layouts down with exact integers: in the simulator they check the
twins, on a GPU the hardware. The products are checked against an exact oracle of what the kernel computes (x rounded
to int8 per 32-column run as `quantize` rounds it, then float64), tightly, and against float64 of the unquantized x at
int8's precision; a token's outputs must not depend on the other tokens, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from lucekv.kernels.cpu.quants import PackedMatrix
from lucekv.kernels.cuda import available, cuda
from lucekv.kernels.cuda._numba import mma_s8_16816, mma_s8_16832
from lucekv.kernels.cuda.mmq import MAGIC, _joined
from tests.kernels.cuda_sim import needs_kernels, run_in_simulator
from tests.kernels.test_cuda_kernels import dense, random_packed, rel_err


@pytest.mark.skipif(available(), reason="kernels run directly in this process")
def test_mmq_in_simulator():
    run_in_simulator(__file__)


# ---- intrinsics ------------------------------------------------------------------------------------------


@cuda.jit
def _mma_s8_kernel(a, b, c, d, d16):
    lane = cuda.threadIdx.x
    out = mma_s8_16832(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1], c[lane, 0],
                       c[lane, 1], c[lane, 2], c[lane, 3])
    for i in range(4):
        d[lane, i] = out[i]
    out = mma_s8_16816(a[lane, 0], a[lane, 1], b[lane, 0], c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    for i in range(4):
        d16[lane, i] = out[i]


def _words(values: np.ndarray) -> np.ndarray:
    """uint32 words of the int8 values [..., 4], the first lowest."""
    return np.ascontiguousarray(values.astype(np.int8)).view(np.uint32)[..., 0]


@needs_kernels
def test_mma_s8_fragment_layouts():
    rng = np.random.default_rng(12)
    a = rng.integers(-128, 128, (16, 32))
    b = rng.integers(-128, 128, (32, 8))
    c = rng.integers(-2**20, 2**20, (16, 8))
    g, tig = np.arange(32) // 4, np.arange(32) % 4
    cols = 4 * tig[:, None] + np.arange(4)[None, :]  # a lane's 4 consecutive k of a word
    a_frag = np.stack([_words(a[g[:, None], cols]), _words(a[g[:, None] + 8, cols]),
                       _words(a[g[:, None], cols + 16]), _words(a[g[:, None] + 8, cols + 16])], axis=1)
    b_frag = np.stack([_words(b[cols, g[:, None]]), _words(b[cols + 16, g[:, None]])], axis=1)
    k = 2 * tig
    c_frag = np.stack([c[g, k], c[g, k + 1], c[g + 8, k], c[g + 8, k + 1]], axis=1).astype(np.int32)
    d_frag, d16_frag = (cuda.device_array((32, 4), np.int32) for _ in range(2))
    _mma_s8_kernel[1, 32](cuda.to_device(a_frag), cuda.to_device(b_frag), cuda.to_device(c_frag), d_frag, d16_frag)
    for got, d in [(d_frag, a @ b + c), (d16_frag, a[:, :16] @ b[:16] + c)]:  # k16: a0, a1 and b0 are its k 0..15
        ref = np.stack([d[g, k], d[g, k + 1], d[g + 8, k], d[g + 8, k + 1]], axis=1)
        assert np.array_equal(got.copy_to_host(), ref)


@cuda.jit
def _joined_kernel(hi, lo, two, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = _joined(hi[i] + MAGIC, lo[i] + MAGIC, two)


@needs_kernels
def test_sums_become_the_floats_a_conversion_of_their_join_rounds_to():
    """The parts' sums (mma results with C = MAGIC) to float32 without a conversion instruction: 256 hi + lo rounded
    once, as cvt.rn.f32.s32 of the int32 join (numpy's conversion) rounds it, beyond 2^24 too; hi alone for one part."""
    rng = np.random.default_rng(11)
    hi = rng.integers(-2**21, 2**21, 256).astype(np.int32)
    lo = rng.integers(-2**21, 2**21, 256).astype(np.int32)
    hi[:4], lo[:4] = [2**16 + 1, -(2**16) - 1, 0, 5], [1, -1, 3, -7]  # 2^24 + 257: a tie-free rounding; exact ones
    for two, want in [(True, (hi.astype(np.int64) * 256 + lo).astype(np.float32)), (False, hi.astype(np.float32))]:
        out = cuda.device_array(hi.size, np.float32)
        _joined_kernel[1, 256](cuda.to_device(hi), cuda.to_device(lo), two, out)
        assert np.array_equal(out.copy_to_host(), want)


# ---- products --------------------------------------------------------------------------------------------


def quantized_x(x: np.ndarray, parts: int) -> np.ndarray:
    """x as `quantize` rounds it (one int8 part per column, or hi and lo), in float64, from float32 math as the
    kernel's."""
    runs = x.reshape(x.shape[0], -1, 32)
    amax = np.max(np.abs(runs), axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    d = (amax / np.float32(127)).astype(np.float32)
    hi = np.floor(runs * inv + np.float32(0.5))
    if parts == 1:
        return (hi.astype(np.float64) * d).reshape(x.shape)
    lo = np.minimum(np.floor((runs - hi * d) * (inv * np.float32(256)) + np.float32(0.5)), 127)
    return ((hi.astype(np.float64) * 256 + lo) * (d / np.float32(256))).reshape(x.shape)


def oracle(m: PackedMatrix, x: np.ndarray, parts: int = 2) -> np.ndarray:
    """What the kernel computes, in float64: weights times the rounded x, block biases times the unrounded sums."""
    bias = np.repeat(m.bias.astype(np.float64), m.block, axis=1)
    return quantized_x(x, parts) @ (dense(m) - bias).T + x.astype(np.float64) @ bias.T


def random_k_quant(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> PackedMatrix:
    """Random blocks of Q5_K or Q3_K (as random_packed makes Q4_K's: gguf cannot quantize to them), small d."""
    from gguf import GGML_QUANT_SIZES

    from lucekv.kernels.cpu.quants import pack

    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    d, at = {Q.Q5_K: ((0.01, 0.005), 0), Q.Q3_K: ((0.01,), size - 2)}[qtype]
    fields = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    raw[:, at:at + fields.size] = fields
    return pack(raw, qtype, (rows, cols))


def run_mmq(m: PackedMatrix, x: np.ndarray, parts: int = 2) -> np.ndarray:
    from lucekv.kernels.cuda import mmq
    from lucekv.kernels.cuda.packed import upload

    w = upload(m)
    assert mmq.serves(w, x.shape[0])
    out = cuda.device_array((x.shape[0], m.rows), np.float32)
    mmq.mmq(w, cuda.to_device(x), out, parts=parts)
    return out.copy_to_host()


@needs_kernels
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize(("qtype", "rows", "cols", "n"), [
    (Q.Q4_K, 20, 256, 3),  # q4 with a bias (mins), a partial row tile, 1 token tile
    (Q.Q6_K, 16, 256, 9),  # q6 in 16-blocks (two k16 mmas a run), 2 token tiles
    (Q.Q8_0, 5, 128, 2),  # q8 in 32-blocks
    (Q.Q5_1, 17, 128, 4),  # q6 in 32-blocks with a bias
    (Q.Q4_0, 16, 256, 2),  # q4 without a bias
    (Q.Q5_K, 16, 256, 2),  # q6 in 32-blocks with a bias, scale words a step
    (Q.Q3_K, 16, 256, 2),  # q6 in 16-blocks
], ids=lambda v: getattr(v, "name", str(v)))
def test_mmq(qtype, rows, cols, n, parts):
    rng = np.random.default_rng(3)
    m = (random_k_quant if qtype in (Q.Q5_K, Q.Q3_K) else random_packed)(rng, qtype, rows, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x[-1, 32:64] = 0  # a run of zeros: scale 0
    got = run_mmq(m, x, parts)
    assert rel_err(got, oracle(m, x, parts)) <= 1e-5
    assert rel_err(got, x.astype(np.float64) @ dense(m).T) <= (2e-2 if parts == 1 else 1e-4)  # int8 x, or 16 bits


@needs_kernels
def test_columns_split_over_blocks(monkeypatch):
    """Uneven splits of the columns (4 of 5 steps: 2, 1, 1, 1), their sums added by the row tile's last block (1
    token tile) or by the second launch (2): the same bits for a token either way; the tickets back at 0 after the
    product (a graph replays it). Then a gated product in 2 splits."""
    from lucekv.kernels.cpu.quants import interleave_rows
    from lucekv.kernels.cuda import mmq
    from lucekv.kernels.cuda.packed import GATE_ROWS, SILU, epilogue, upload

    monkeypatch.setattr(mmq, "MIN_STEPS", 1)
    monkeypatch.setattr(mmq, "sm_count", lambda: 1)  # (the simulator's; on a GPU too)
    monkeypatch.setattr(mmq, "RESIDENT_WARPS", 8)  # 4 blocks of two warps a wave
    rng = np.random.default_rng(6)
    m = random_packed(rng, Q.Q8_0, 20, 320)
    x = rng.standard_normal((9, 320)).astype(np.float32)
    w = upload(m)
    assert mmq.plan(w) == (2, 4) and mmq.last_block_reduces(1) and not mmq.last_block_reduces(2)
    scratch = mmq.partials(w, 3)
    first = cuda.device_array((3, m.rows), np.float32)
    mmq.product(w, mmq.quantize(cuda.to_device(x[:3]), mmq.scratch(3, 320)), first, scratch_sums=scratch)
    assert not scratch.tickets.copy_to_host().any()  # ready for the next product
    every = run_mmq(m, x)
    assert rel_err(every, oracle(m, x)) <= 1e-5
    assert np.array_equal(first.copy_to_host(), every[:3])
    gate, up = (random_packed(rng, Q.Q4_K, GATE_ROWS, 256) for _ in range(2))
    w = upload(interleave_rows(gate, up, GATE_ROWS))
    assert mmq.plan(w).splits == 2
    out = cuda.device_array((2, GATE_ROWS), np.float32)
    x = x[:2, :256].copy()
    mmq.mmq(w, cuda.to_device(x), epilogue((out,), gate=SILU))
    g, u = oracle(gate, x), oracle(up, x)
    assert rel_err(out.copy_to_host(), g / (1 + np.exp(-g)) * u) <= 1e-5


@needs_kernels
def test_quantize_normalizes_x_where_asked():
    """RMSNorm(x) * weight quantized in x's launch (the backend's products of normalized x)."""
    from lucekv.kernels.cuda import mmq
    from lucekv.kernels.cuda.packed import upload

    rng = np.random.default_rng(8)
    m = random_packed(rng, Q.Q6_K, 16, 256)
    x = rng.standard_normal((3, 256)).astype(np.float32) * 3
    weight = rng.standard_normal(256).astype(np.float32)
    out = cuda.device_array((3, m.rows), np.float32)
    w = upload(m)
    mmq.product(w, mmq.quantize(cuda.to_device(x), mmq.scratch(3, 256), norm=(cuda.to_device(weight), 1e-5)), out)
    x64 = x.astype(np.float64)
    normed = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + 1e-5) * weight
    assert rel_err(out.copy_to_host(), normed @ dense(m).T) <= 1e-4


@needs_kernels
@pytest.mark.parametrize(("qtype", "rows", "cols", "parts", "norm", "threads"), [
    (Q.Q4_K, 20, 256, 2, True, 32),  # 2 warps, 4 units a thread, normalized; 2 splits; 2 quantize blocks a token
    (Q.Q6_K, 48, 512, 1, False, 96),  # 3 warps (a lane group without a unit), 5 uneven splits of 8 steps; 2 quantize
    # blocks a token, the second with runs for a third of its lanes
], ids=str)
def test_blocks_quantize_x_as_the_quantize_launch_does(monkeypatch, qtype, rows, cols, parts, norm, threads):
    """Up to 8 tokens the product's blocks quantize x themselves, step by step (`float_x`): the codes and scales of
    `quantize`'s launch (blocks of `threads` a token's runs), so the same outputs bit for bit."""
    from lucekv.kernels.cuda import mmq
    from lucekv.kernels.cuda.packed import upload

    monkeypatch.setattr(mmq, "MIN_STEPS", 1)
    monkeypatch.setattr(mmq, "sm_count", lambda: 1)  # (the simulator's; on a GPU too)
    monkeypatch.setattr(mmq, "QUANTIZE_THREADS", threads)
    rng = np.random.default_rng(9)
    m = random_packed(rng, qtype, rows, cols)
    x = rng.standard_normal((3, cols)).astype(np.float32) * 3
    x[1, 64:96] = 0  # a run of zeros: scale 0
    w, xd = upload(m), cuda.to_device(x)
    by_norm = (cuda.to_device(rng.standard_normal(cols).astype(np.float32)), 1e-5) if norm else None
    assert mmq.quantizes_itself(3) and mmq.plan(w).splits == (2 if norm else 5)
    outs = [cuda.device_array((3, rows), np.float32) for _ in range(2)]
    mmq.product(w, mmq.float_x(xd, parts, by_norm), outs[0])
    mmq.product(w, mmq.quantize(xd, mmq.scratch(3, cols, parts), norm=by_norm), outs[1])
    got = outs[0].copy_to_host()
    assert np.array_equal(got, outs[1].copy_to_host())
    if not norm:
        assert rel_err(got, oracle(m, x, parts)) <= 1e-5


@needs_kernels
def test_two_parts_agree_with_each_tokens_one_token_matvec():
    """x in two parts: each run's integer sums are the one-token matvec's, so a token's outputs differ from its own
    decode step's only by float32 rounding (the sums' order)."""
    from lucekv.kernels.cuda.matvec import matvec
    from lucekv.kernels.cuda.packed import upload

    rng = np.random.default_rng(7)
    m = random_packed(rng, Q.Q4_K, 20, 256)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    got = run_mmq(m, x)
    for t in range(2):
        out = cuda.device_array((1, m.rows), np.float32)
        matvec(upload(m), cuda.to_device(x[t:t + 1]), out)
        assert rel_err(got[t:t + 1], out.copy_to_host().astype(np.float64)) <= 2e-6


@needs_kernels
def test_a_tokens_outputs_do_not_depend_on_the_others():
    """Token 1 of 2 and of 11 (two token tiles): the same sums in the same order, bit for bit."""
    rng = np.random.default_rng(4)
    m = random_packed(rng, Q.Q4_K, 16, 256)
    x = rng.standard_normal((11, 256)).astype(np.float32)
    assert np.array_equal(run_mmq(m, x[:2])[1], run_mmq(m, x)[1])


@needs_kernels
def test_mmq_gated_and_epilogue():
    from lucekv.kernels.cpu.quants import interleave_rows
    from lucekv.kernels.cuda import mmq
    from lucekv.kernels.cuda.packed import GATE_ROWS, SILU, epilogue, upload

    rng = np.random.default_rng(5)
    gate, up = (random_packed(rng, Q.Q4_K, 2 * GATE_ROWS, 256) for _ in range(2))
    x = rng.standard_normal((3, 256)).astype(np.float32)
    out = cuda.device_array((3, gate.rows), np.float32)
    mmq.mmq(upload(interleave_rows(gate, up, GATE_ROWS)), cuda.to_device(x), epilogue((out,), gate=SILU))
    g, u = oracle(gate, x), oracle(up, x)
    assert rel_err(out.copy_to_host(), g / (1 + np.exp(-g)) * u) <= 1e-5
    # three outputs, a bias; then a residual
    m = random_packed(rng, Q.Q6_K, 20, 256)
    bias = rng.standard_normal(20).astype(np.float32)
    outs = [cuda.device_array((3, r), np.float32) for r in (1, 17, 2)]
    mmq.mmq(upload(m), cuda.to_device(x), epilogue(outs, bias=cuda.to_device(bias)))
    assert rel_err(np.concatenate([o.copy_to_host() for o in outs], axis=1), oracle(m, x) + bias) <= 1e-5


def test_serves_and_plans(monkeypatch):
    """2..64 tokens of q4 / q6 / q8 in whole steps; 16-column blocks only without biases; the warps of a block (on an
    H100's 132 SMs) split the steps to fill a wave."""
    from lucekv.kernels.cuda import mmq
    from lucekv.kernels.cuda.packed import DeviceMatrix

    monkeypatch.setattr(mmq, "sm_count", lambda: 132)

    def matrix(kind, rows=4096, cols=4096, block_log2=5, has_bias=False, group_log2=3):
        return DeviceMatrix(kind, rows, cols, block_log2, group_log2, None, None, None, None, True, has_bias)

    q4k = matrix("q4", has_bias=True)
    assert mmq.serves(q4k, 2) and mmq.serves(q4k, 64) and not mmq.serves(q4k, 1) and not mmq.serves(q4k, 65)
    assert not mmq.serves(matrix("f32"), 8) and not mmq.serves(matrix("q4", cols=96, has_bias=True), 8)
    assert mmq.serves(matrix("q6", block_log2=4), 8) and not mmq.serves(matrix("q6", block_log2=4, has_bias=True), 8)
    assert mmq.grouped(q4k) and mmq.grouped(matrix("q6", block_log2=4))
    assert mmq.serves(matrix("q4"), 8) and not mmq.grouped(matrix("q4"))  # uint8 sub words: a scale word per run
    assert not mmq.serves(matrix("q6", block_log2=4, group_log2=1), 8)  # a step's 4 blocks in two groups
    for kind in mmq.RUNS:
        for rows, cols in [(16, 128), (4096, 12288), (24576, 4096), (1024, 4096), (151936, 896)]:
            p = mmq.plan(matrix(kind, rows, cols))
            steps = cols // (mmq.RUN * mmq.RUNS[kind])
            assert 1 <= p.warps <= mmq.MAX_WARPS
            assert p.splits == 1 or steps // p.splits >= mmq.MIN_STEPS
    # the 8B's: gate+up's 192 row tiles fill the GPU, down's 32 take 8 splits of 24 steps, o's 8 of 4
    assert [mmq.plan(matrix(*shape)) for shape in [("q4", 24576, 4096), ("q6", 4096, 12288), ("q4", 4096, 4096)]] == [
        (8, 1), (8, 8), (8, 8)]
    # the 1.5B's down (12 row tiles): 17 splits of 70 steps (4 or 5 each), 22 of 140 for q6; its q (12 steps): 3
    assert [mmq.plan(matrix(*shape)) for shape in [("q4", 1536, 8960), ("q6", 1536, 8960), ("q4", 1536, 1536)]] == [
        (8, 17), (8, 22), (8, 3)]


@needs_kernels
def test_quantize_refuses_what_it_cannot_take():
    from lucekv.kernels.cuda import mmq

    with pytest.raises(ValueError, match="multiple of 64"):
        mmq.quantize(cuda.to_device(np.zeros((2, 96), np.float32)), mmq.scratch(2, 128))
    with pytest.raises(ValueError, match="1..64 tokens"):
        mmq.quantize(cuda.to_device(np.zeros((65, 64), np.float32)), mmq.scratch(64, 64))
    with pytest.raises(ValueError, match="scratch of shapes"):
        mmq.quantize(cuda.to_device(np.zeros((9, 64), np.float32)), mmq.scratch(8, 64))
    with pytest.raises(ValueError, match="1 or 2 int8 parts"):
        mmq.scratch(8, 64, parts=3)
