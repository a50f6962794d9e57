"""The prefill matmul (tensor cores for q4 / q8, float32 FMAs for f32) and the intrinsics it is built on,
against numpy (see test_cuda_kernels.py for how the simulator runs these without a GPU).

The intrinsic tests pin the PTX ISA's fragment layout of mma.m16n8k16 down with exact arithmetic: in the
simulator they check the twin, on a GPU the hardware. The products cover every (kind, block, bias) variant
with partial row and token tiles, at float16 storage's precision (weights and x reach the tensor cores as
float16: about 4e-4 of the largest output against float64).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from lucekv.kernels.cpu.quants import PackedMatrix
from lucekv.kernels.cuda import available, cuda
from lucekv.kernels.cuda._numba import ALIGN_16, fma_f16x2, load_matrix_x4, mma_f16_16816, pack_half2, sub_f16x2
from tests.kernels.cuda_sim import needs_gpu, needs_kernels, run_in_simulator
from tests.kernels.test_cuda_kernels import (
    check_fused_product,
    check_gated_product,
    check_product,
    dense,
    random_packed,
    rel_err,
)


@pytest.mark.skipif(available(), reason="kernels run directly in this process")
def test_matmul_in_simulator():
    run_in_simulator(__file__)


# ---- intrinsics ------------------------------------------------------------------------------------------


@cuda.jit
def _mma_kernel(a, b, c, d):
    lane = cuda.threadIdx.x
    out = mma_f16_16816(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1], c[lane, 0],
                        c[lane, 1], c[lane, 2], c[lane, 3])
    for i in range(4):
        d[lane, i] = out[i]


def _pairs(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """uint32 words of two float16: lo in the low half."""
    return np.stack([lo, hi], axis=-1).astype(np.float16).view(np.uint32)[..., 0]


@needs_kernels
def test_mma_fragment_layout():
    # small integers and eighths: every product and sum is exact in float32, so D must match bit for bit
    rng = np.random.default_rng(10)
    a = rng.integers(-8, 9, (16, 16)).astype(np.float64)
    b = rng.integers(-64, 65, (16, 8)) / 8
    c = rng.integers(-100, 101, (16, 8)) / 4
    g, tig = np.arange(32) // 4, np.arange(32) % 4
    k = 2 * tig
    a_frag = np.stack([_pairs(a[g, k], a[g, k + 1]), _pairs(a[g + 8, k], a[g + 8, k + 1]),
                       _pairs(a[g, k + 8], a[g, k + 9]), _pairs(a[g + 8, k + 8], a[g + 8, k + 9])], axis=1)
    b_frag = np.stack([_pairs(b[k, g], b[k + 1, g]), _pairs(b[k + 8, g], b[k + 9, g])], axis=1)
    c_frag = np.stack([c[g, k], c[g, k + 1], c[g + 8, k], c[g + 8, k + 1]], axis=1).astype(np.float32)
    d_frag = cuda.device_array((32, 4), np.float32)
    _mma_kernel[1, 32](cuda.to_device(a_frag), cuda.to_device(b_frag), cuda.to_device(c_frag), d_frag)
    d = a @ b + c
    ref = np.stack([d[g, k], d[g, k + 1], d[g + 8, k], d[g + 8, k + 1]], axis=1)
    assert np.array_equal(d_frag.copy_to_host(), ref.astype(np.float32))


@cuda.jit
def _ldmatrix_kernel(words, rows, cols, out):
    lane = cuda.threadIdx.x
    tile = cuda.shared.array((2, 16, 20), np.uint32, alignment=ALIGN_16)
    for i in range(lane, 2 * 16 * 20, 32):
        tile[i // 320, (i // 20) % 16, i % 20] = words[i]
    cuda.syncthreads()
    got = load_matrix_x4(tile, 1, rows[lane], cols[lane])
    for m in range(4):
        out[lane, m] = got[m]


@needs_kernels
def test_ldmatrix_gives_each_lane_its_row_and_word():
    # distinct words; lanes name the rows of 4 matrices in a scrambled order, at word offsets 0, 4, 8, 12, 16
    rng = np.random.default_rng(13)
    words = rng.permutation(2 * 16 * 20).astype(np.uint32) + np.uint32(1000)
    rows, cols = rng.integers(0, 16, 32).astype(np.int32), 4 * rng.integers(0, 5, 32).astype(np.int32)
    out = cuda.device_array((32, 4), np.uint32)
    _ldmatrix_kernel[1, 32](cuda.to_device(words), cuda.to_device(rows), cuda.to_device(cols), out)
    tile = words.reshape(2, 16, 20)
    lane = np.arange(32)
    # matrix m's row lane // 4 starts where lane 8m + lane // 4 points; this lane holds its word lane % 4
    ref = np.stack([tile[1, rows[8 * m + lane // 4], cols[8 * m + lane // 4] + lane % 4] for m in range(4)], axis=1)
    assert np.array_equal(out.copy_to_host(), ref)


@cuda.jit
def _half2_kernel(lo, hi, packed, diff, fused):
    i = cuda.threadIdx.x
    a, b = pack_half2(lo[i], hi[i]), pack_half2(hi[i], lo[i])
    packed[i] = a
    diff[i] = sub_f16x2(a, b)
    fused[i] = fma_f16x2(a, b, pack_half2(lo[i], lo[i]))


@needs_kernels
def test_pack_subtract_and_fma_half2():
    rng = np.random.default_rng(11)
    lo, hi = (rng.standard_normal(32).astype(np.float32) * 100 for _ in range(2))
    lo[:4] = [1024 + 7, 0.1, -60000, 1e-6]  # an integer, an inexact value, a large one, an f16 subnormal
    hi[:4] = [3, 0.5, 1e-3, 7]  # fma products: exact, exact, 60 (from -60000), tiny
    packed, diff, fused = (cuda.device_array(32, np.uint32) for _ in range(3))
    _half2_kernel[1, 32](cuda.to_device(lo), cuda.to_device(hi), packed, diff, fused)
    ref = _pairs(lo, hi)
    assert np.array_equal(packed.copy_to_host(), ref)
    halves = ref.view(np.float16).reshape(32, 2)
    swapped = halves[:, ::-1]
    assert np.array_equal(diff.copy_to_host().view(np.float16).reshape(32, 2), halves - swapped)
    # fma rounds once: the float64 a * b + c rounded to float16
    once = (halves.astype(np.float64) * swapped + halves[:, :1]).astype(np.float16)
    assert np.array_equal(fused.copy_to_host().view(np.float16).reshape(32, 2), once)


# ---- products --------------------------------------------------------------------------------------------


def tile_shape(name: str | None):
    """matmul's block tile of that name ("long", "wide"; None: matmul's choice)."""
    from lucekv.kernels.cuda import matmul as mm

    return None if name is None else {"long": mm.LONG_TILE, "wide": mm.WIDE_TILE}[name]


def check_matmul(m: PackedMatrix, n: int, bound: float, seed: int = 8, tile: str | None = None) -> None:
    """The product against float64 numpy; `tile`: force that block tile (the long one for a few tokens)."""
    if tile is None:
        check_product("matmul", m, n, bound, seed)
        return
    from lucekv.kernels.cuda.matmul import matmul
    from lucekv.kernels.cuda.packed import upload

    x = np.random.default_rng(seed).standard_normal((n, m.cols)).astype(np.float32)
    out = cuda.device_array((n, m.rows), np.float32)
    matmul(upload(m), cuda.to_device(x), out, tile=tile_shape(tile))
    assert rel_err(out.copy_to_host(), x.astype(np.float64) @ dense(m).T) <= bound


@needs_kernels
@pytest.mark.parametrize(("qtype", "rows", "cols", "n"), [
    (Q.Q4_K, 20, 256, 3),  # q4 with a bias
    (Q.Q4_1, 130, 32, 70),  # two row tiles and two token tiles, the second of each partial
    (Q.Q8_0, 40, 96, 9),  # q8 in 32-blocks, no bias: three steps
    (Q.Q5_1, 20, 64, 5),  # q8 in 32-blocks with a bias
    (Q.Q6_K, 20, 256, 4),  # q8 in 16-blocks, no bias
    (Q.F32, 70, 45, 66),  # the float32 kernel: ragged width, partial tiles
], ids=lambda v: getattr(v, "name", str(v)))
def test_matmul(qtype, rows, cols, n):
    # float16 operands (measured 3.4e-4 for Q4_K); the f32 kernel is exact to float32
    check_matmul(random_packed(np.random.default_rng(2), qtype, rows, cols), n, bound=1e-5 if qtype == Q.F32 else 1e-3)


@needs_kernels
@pytest.mark.parametrize("tile", ["long", "wide"])
@pytest.mark.parametrize(("qtype", "rows", "cols", "n"), [
    (Q.Q4_1, 20, 64, 5),  # long: quarter rows of q4, one code word per thread; wide: half rows, x by halves
    (Q.Q8_0, 20, 64, 3),  # q8: two (long) or four (wide) code words per thread (q6, 16-blocks: below)
], ids=lambda v: getattr(v, "name", str(v)))
def test_matmul_long_tiles(qtype, rows, cols, n, tile):
    check_matmul(random_packed(np.random.default_rng(5), qtype, rows, cols), n, bound=1e-3, tile=tile)


@needs_kernels
@pytest.mark.parametrize(("qtype", "tile"), [(Q.Q4_K, None), (Q.Q5_1, "long")], ids=["q4", "q6-long_tile"])
def test_x_rounded_once_gives_the_tiles_products_bit_for_bit(qtype, tile):
    # x rounded to float16 before the product (stage_halves) or in the tile (staged=False, last session's kernel):
    # the same staged operands in the same order, so the same float32 sums; both against float64 too
    from lucekv.kernels.cuda.matmul import matmul
    from lucekv.kernels.cuda.packed import upload

    m = random_packed(np.random.default_rng(6), qtype, 20, 256 if qtype == Q.Q4_K else 64)
    x = cuda.to_device(np.random.default_rng(7).standard_normal((5, m.cols)).astype(np.float32))
    w, outs = upload(m), [cuda.device_array((5, m.rows), np.float32) for _ in range(2)]
    for staged, out in zip((True, False), outs, strict=True):
        matmul(w, x, out, tile=tile_shape(tile), staged=staged)
    got, before = (o.copy_to_host() for o in outs)
    assert np.array_equal(got, before)
    assert rel_err(got, x.copy_to_host().astype(np.float64) @ dense(m).T) <= 1e-3


@needs_kernels
def test_matmuls_launch_two_products_of_one_x_together():
    # q4 + q6 in one launch (x staged in two orders), then q8 alone reusing the second order's scratch, then f32;
    # partial row tiles in both of the pair's products, an epilogue with a bias on one of them
    from lucekv.kernels.cuda.matmul import matmuls
    from lucekv.kernels.cuda.packed import epilogue, upload

    rng = np.random.default_rng(9)
    ms = [random_packed(rng, q, rows, 64) for q, rows in ((Q.Q4_1, 130), (Q.Q5_1, 20), (Q.Q8_0, 20), (Q.F32, 6))]
    n = 5
    x = rng.standard_normal((n, 64)).astype(np.float32)
    bias = rng.standard_normal(20).astype(np.float32)
    outs = [cuda.device_array((n, m.rows), np.float32) for m in ms]
    scratch = {}

    def halves(order):
        return scratch.setdefault(order, cuda.device_array((n, 32), np.uint32))

    eps = [outs[0], epilogue((outs[1],), bias=cuda.to_device(bias)), outs[2], outs[3]]
    matmuls([(upload(m), ep) for m, ep in zip(ms, eps, strict=True)], cuda.to_device(x), halves=halves)
    assert len(scratch) == 2
    for m, out, add in zip(ms, outs, (0, bias, 0, 0), strict=True):
        ref = x.astype(np.float64) @ dense(m).T + add
        assert rel_err(out.copy_to_host(), ref) <= (1e-5 if m.kind == "f32" else 1e-3)


@needs_kernels
def test_every_tile_sums_alike():
    # each output's products go into its accumulator in the same order (k steps, then k16 slices) whatever the
    # tile: the short, long and wide tiles agree bit for bit
    from lucekv.kernels.cuda.matmul import TILE_SHAPES, matmul
    from lucekv.kernels.cuda.packed import upload

    w = upload(random_packed(np.random.default_rng(14), Q.Q4_1, 20, 64))
    x = cuda.to_device(np.random.default_rng(15).standard_normal((5, 64)).astype(np.float32))
    outs = [cuda.device_array((5, 20), np.float32) for _ in TILE_SHAPES]
    for tile, out in zip(TILE_SHAPES, outs, strict=True):
        matmul(w, x, out, tile=tile)
    first = outs[0].copy_to_host()
    assert all(np.array_equal(out.copy_to_host(), first) for out in outs[1:])


def test_stage_halves_refuses_a_wrong_scratch():
    from lucekv.kernels.cuda.matmul import stage_halves

    with pytest.raises(ValueError, match="cols // 2"):
        stage_halves("q4", np.zeros((2, 64), np.float32), np.zeros((2, 16), np.uint32))


@needs_kernels
def test_matmul_of_tiny_weights_keeps_float16_precision():
    # weights around 1e-6 are float16 subnormals as they are: staged times half_scale they are not
    m = random_packed(np.random.default_rng(4), Q.Q8_0, 20, 64)
    tiny = PackedMatrix(m.kind, m.rows, m.cols, m.block, m.codes, m.d * np.float16(2.0**-14), m.dmin, m.sub_scale,
                        m.sub_min)
    check_matmul(tiny, n=3, bound=1e-3)


@needs_kernels
def test_matmul_epilogue():
    check_fused_product("matmul", random_packed(np.random.default_rng(3), Q.Q8_0, 6, 64), n=3)


@needs_kernels
def test_matmul_gated():
    check_gated_product("matmul", Q.Q8_0, n=3)


@needs_kernels
@pytest.mark.parametrize(("codes", "tile"), [((-128, 128), None), ((0, 4), None), ((0, 4), "long"), ((0, 4), "wide")],
                         ids=["q8", "q6", "q6-long_tile", "q6-wide_tile"])
def test_matmul_16_blocks_with_bias(codes, tile):
    # sub-scaled 16-blocks with a bias, as Q2_K packs (its 256-column super-blocks would cost the simulator 8
    # steps): byte codes (device q8), or Q2_K's own 2-bit codes (device q6)
    rng = np.random.default_rng(12)
    rows, cols = 20, 64
    d = rng.uniform(0.0005, 0.001, (rows, 1)).astype(np.float16)
    dmin = rng.uniform(0.001, 0.002, (rows, 1)).astype(np.float16)
    sub_scale, sub_min = (rng.integers(1, 64, (rows, cols // 16), dtype=np.int8) for _ in range(2))
    m = PackedMatrix("q8", rows, cols, 16, rng.integers(*codes, (rows, cols), dtype=np.int8), d, dmin, sub_scale,
                     sub_min)
    check_matmul(m, n=5, bound=1e-3, tile=tile)


def test_matmul_rejects_ragged_quantized_width():
    from lucekv.kernels.cuda.matmul import matmul
    from lucekv.kernels.cuda.packed import DeviceMatrix

    with pytest.raises(ValueError, match="multiple of 32"):
        matmul(DeviceMatrix("q8", 4, 48, 4, 0, None, None, None, None, False, False), np.zeros((2, 48), np.float32),
               None)


def test_long_prompts_take_a_long_tile_where_its_blocks_fill_the_gpu(monkeypatch):
    from lucekv.kernels.cuda import matmul as mm

    monkeypatch.setattr(mm, "sm_count", lambda: 132)  # an H100
    assert mm.pick_tile(24576, 255) == mm.SHORT_TILE  # a prompt piece below LONG_PROMPT
    assert mm.pick_tile(24576, 256) == mm.WIDE_TILE  # 192 x 2 blocks: two to an SM
    assert mm.pick_tile(4096, 2048) == mm.WIDE_TILE  # 32 x 16
    assert mm.pick_tile(5120 + 1024, 512) == mm.LONG_TILE  # 48 x 4 = 192 blocks: a q/k + v pair, one to an SM
    assert mm.pick_tile(4096, 512) == mm.LONG_TILE  # 32 x 4 = 128 blocks: 97% of the SMs
    assert mm.pick_tile(4096, 256) == mm.SHORT_TILE  # 64 blocks would leave half the SMs idle
    assert mm.pick_tile(896, 512) == mm.SHORT_TILE  # a 0.5b's attention at pp512: 7 x 4 blocks


# ---- real shapes, GPU only -------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("qtype", "rows", "cols", "n"), [
    (Q.Q4_K, 4096, 4096, 300),  # Qwen3-8B attention projections
    (Q.Q6_K, 4096, 12288, 100),  # its down projection
    (Q.Q4_K, 12288, 4096, 77),  # gate / up: many row tiles, a partial token tile
    (Q.Q8_0, 1000, 4096, 129),  # rows not a multiple of the tile
    (Q.Q4_K, 5120, 4096, 515),  # the long tile (40 x 5 blocks), a partial token tile
    (Q.Q6_K, 12288, 4096, 300),  # the long tile: 96 x 3 blocks
    (Q.F32, 1000, 896, 77),
], ids=lambda v: getattr(v, "name", str(v)))
def test_matmul_gpu(qtype, rows, cols, n):
    check_matmul(random_packed(np.random.default_rng(2), qtype, rows, cols), n, bound=1e-3)

