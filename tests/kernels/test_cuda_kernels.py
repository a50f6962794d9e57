"""CUDA kernels against float64 numpy references.

Without a GPU these run in numba's CUDA simulator, which numba selects once, at import, from
NUMBA_ENABLE_CUDASIM. Setting it inside this process could not switch an already imported numba and
would leak into every other test, so `test_kernels_in_simulator` runs this file again in a child pytest
with the variable set; there the tests below run for real (tiny shapes: the simulator runs each GPU
thread as a Python thread). On a GPU machine they run directly, plus the `gpu` tests at real shapes.
The whole-model comparison takes minutes in the simulator, so it is `slow` there:
    NUMBA_ENABLE_CUDASIM=1 pytest tests/kernels/test_cuda_kernels.py -m slow
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from lucekv.kernels.cpu.quants import PackedMatrix, dequantize_rows, pack
from lucekv.kernels.cuda import SIMULATOR, available, cuda
from tests.kernels.cuda_sim import needs_gpu, needs_kernels, run_in_simulator

gpu = pytest.mark.gpu


@pytest.mark.skipif(available(), reason="kernels run directly in this process")
def test_kernels_in_simulator():
    run_in_simulator(__file__)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - ref)) / np.max(np.abs(ref)))


def random_packed(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> PackedMatrix:
    """A random matrix in `qtype`; K-quants (gguf cannot quantize to them) as random blocks, small d."""
    if qtype == Q.F32:
        return pack(rng.standard_normal((rows, cols)).astype(np.float32), qtype, (rows, cols))
    if qtype == Q.Q6_K:
        raw = rng.integers(0, 256, size=(rows * cols // 256, 210), dtype=np.uint8)
        raw[:, 208:210] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        return pack(raw, qtype, (rows, cols))
    if qtype == Q.Q4_K:
        raw = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
        raw[:, 0:4] = np.frombuffer(np.float16([0.01, 0.005]).tobytes(), np.uint8)
        return pack(raw, qtype, (rows, cols))
    return pack(quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype), qtype, (rows, cols))


def dense(m: PackedMatrix) -> np.ndarray:
    return dequantize_rows(m, 0, m.rows).astype(np.float64)


# ---- products -------------------------------------------------------------------------------------------

# device forms: q4 (sub-scaled or not), q8, q6 (32-blocks with a bias, 16-blocks without), f32
QTYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_1, Q.Q4_K, Q.Q6_K, Q.F32]


def check_product(kernel: str, m: PackedMatrix, n: int, bound: float = 1e-3, seed: int = 0) -> None:
    """`kernel` ("matvec" or "matmul") of the packed matrix m and n random rows of x against float64 numpy."""
    from lucekv.kernels.cuda import matmul, matvec
    from lucekv.kernels.cuda.packed import upload

    product = {"matvec": matvec.matvec, "matmul": matmul.matmul}[kernel]
    x = np.random.default_rng(seed).standard_normal((n, m.cols)).astype(np.float32)
    out = cuda.device_array((n, m.rows), np.float32)
    product(upload(m), cuda.to_device(x), out)
    assert rel_err(out.copy_to_host(), x.astype(np.float64) @ dense(m).T) <= bound


def check_matvec(qtype: Q, rows: int, cols: int, n: int, seed: int = 0) -> None:
    check_product("matvec", random_packed(np.random.default_rng(seed), qtype, rows, cols), n, seed=seed + 1)


@needs_kernels
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_matvec(qtype):
    check_matvec(qtype, rows=5, cols=256, n=2)


@needs_kernels
@pytest.mark.parametrize(("qtype", "kind", "sub_scaled", "has_bias", "bits"), [
    (Q.Q4_K, "q4", True, True, 4.625),  # 16 code bytes + sub-scale and sub-min bytes per 32, d and dmin per 256
    (Q.Q4_0, "q4", True, True, 5.5),  # one d per block, its offset 8 as a sub-min
    (Q.Q4_1, "q4", False, True, 5.0),
    (Q.Q6_K, "q6", True, False, 6.5625),  # 6-bit codes, an int8 sub-scale per 16, d per 256 (as the file)
    (Q.Q5_1, "q6", False, True, 7.0),
    (Q.Q8_0, "q8", False, False, 8.5),
], ids=lambda v: getattr(v, "name", str(v)))
def test_upload_keeps_the_scales_factored(qtype, kind, sub_scaled, has_bias, bits):
    from lucekv.kernels.cuda.packed import upload

    w = upload(random_packed(np.random.default_rng(5), qtype, 4, 512))
    assert (w.kind, w.sub_scaled, w.has_bias) == (kind, sub_scaled, has_bias)
    assert 8 * w.nbytes / (4 * 512) == bits


def check_fused_product(kernel: str, m: PackedMatrix, n: int, seed: int = 0) -> None:
    """`kernel` writing three outputs (an Epilogue), with a bias, and separately one output plus a residual;
    the matvec also normalizing x itself (RMSNorm)."""
    from lucekv.kernels.cuda import matmul, matvec
    from lucekv.kernels.cuda.packed import epilogue, upload

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, m.cols)).astype(np.float32) * 3
    norm_w = rng.standard_normal(m.cols).astype(np.float32)
    bias = rng.standard_normal(m.rows).astype(np.float32)
    residual = rng.standard_normal((n, m.rows)).astype(np.float32)
    x64 = x.astype(np.float64)
    d, w = upload(m), dense(m)
    if kernel == "matvec":
        x64 = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + 1e-5) * norm_w

    def product(ep):
        if kernel == "matvec":
            matvec.matvec(d, cuda.to_device(x), ep, norm=(cuda.to_device(norm_w), 1e-5))
        else:
            matmul.matmul(d, cuda.to_device(x), ep)

    widths = [1, m.rows - 3, 2]
    outs = [cuda.device_array((n, r), np.float32) for r in widths]
    product(epilogue(outs, bias=cuda.to_device(bias)))
    got = np.concatenate([o.copy_to_host() for o in outs], axis=1)
    assert rel_err(got, x64 @ w.T + bias) <= 1e-3
    out = cuda.device_array((n, m.rows), np.float32)
    product(epilogue((out,), residual=cuda.to_device(residual)))
    assert rel_err(out.copy_to_host(), x64 @ w.T + residual) <= 1e-3


def check_gated_product(kernel: str, qtype: Q, n: int) -> None:
    """Gate and up rows interleaved: the product's output is gelu(x @ G.T) * (x @ U.T) (the matvec normalizing x)."""
    from lucekv.kernels.cpu.quants import interleave_rows
    from lucekv.kernels.cuda import matmul, matvec
    from lucekv.kernels.cuda.packed import GATE_ROWS, GELU, epilogue, upload

    rng = np.random.default_rng(11)
    gate, up = (random_packed(rng, qtype, 3 * GATE_ROWS, 256) for _ in range(2))
    x = rng.standard_normal((n, 256)).astype(np.float32)
    norm_w = rng.standard_normal(256).astype(np.float32)
    out = cuda.device_array((n, gate.rows), np.float32)
    ep = epilogue((out,), gate=GELU)
    w = upload(interleave_rows(gate, up, GATE_ROWS))
    x64 = x.astype(np.float64)
    if kernel == "matvec":
        matvec.matvec(w, cuda.to_device(x), ep, norm=(cuda.to_device(norm_w), 1e-5))
        x64 = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + 1e-5) * norm_w
    else:
        matmul.matmul(w, cuda.to_device(x), ep)
    g, u = x64 @ dense(gate).T, x64 @ dense(up).T
    ref = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u
    assert rel_err(out.copy_to_host(), ref) <= 1e-3


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_matvec_gated(qtype):
    check_gated_product("matvec", qtype, n=1)


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_matvec_fused_norm_and_epilogue(qtype):
    check_fused_product("matvec", random_packed(np.random.default_rng(9), qtype, 6, 256), n=1)


@needs_kernels
def test_matvec_refuses_a_norm_it_cannot_fuse():
    from lucekv.kernels.cuda.matvec import matvec
    from lucekv.kernels.cuda.packed import upload

    w = upload(random_packed(np.random.default_rng(1), Q.F32, 3, 32))
    x = cuda.to_device(np.ones((1, 32), np.float32))
    with pytest.raises(ValueError, match="no fused RMSNorm"):
        matvec(w, x, cuda.device_array((1, 3), np.float32), norm=(cuda.to_device(np.ones(32, np.float32)), 1e-5))


@needs_kernels
def test_matvec_f32_ragged_width():
    from lucekv.kernels.cuda.matvec import matvec
    from lucekv.kernels.cuda.packed import upload

    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 45)).astype(np.float32)
    x = rng.standard_normal((1, 45)).astype(np.float32)
    out = cuda.device_array((1, 3), np.float32)
    matvec(upload(pack(w, Q.F32, w.shape)), cuda.to_device(x), out)
    assert rel_err(out.copy_to_host(), x.astype(np.float64) @ w.T.astype(np.float64)) <= 1e-3


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q5_1, Q.Q8_0, Q.Q6_K, Q.F32], ids=lambda q: q.name)
def test_embed(qtype):
    from lucekv.kernels.cuda.embed import embed
    from lucekv.kernels.cuda.packed import upload

    rng = np.random.default_rng(3)
    m = random_packed(rng, qtype, 7, 256)
    tokens = np.array([6, 0, 3], np.int32)
    out = cuda.device_array((3, 256), np.float32)
    embed(upload(m), cuda.to_device(tokens), 2.5, out)
    assert rel_err(out.copy_to_host(), dense(m)[tokens] * 2.5) <= 1e-6


# ---- norms, rope, elementwise ---------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("groups", [1, 4])
def test_rmsnorm(groups):
    from lucekv.kernels.cuda.norm import rmsnorm

    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 64)).astype(np.float32) * 3
    w = rng.standard_normal(64 // groups).astype(np.float32)
    out = cuda.device_array(x.shape, np.float32)
    rmsnorm(cuda.to_device(x), cuda.to_device(w), 1e-6, groups, out)
    xs = x.astype(np.float64).reshape(2, groups, -1)
    ref = xs / np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True) + 1e-6) * w
    assert rel_err(out.copy_to_host(), ref.reshape(x.shape)) <= 1e-3


def rope_reference(x: np.ndarray, n_heads: int, head_dim: int, rope_dim: int, positions: np.ndarray, base: float,
                   scale: float, neox: bool) -> np.ndarray:
    ang = positions[:, None] / scale * (1.0 / base ** (np.arange(0, rope_dim, 2) / rope_dim))[None, :]
    ref = x.astype(np.float64).reshape(len(x), n_heads, head_dim).copy()
    lo, hi = (slice(0, rope_dim // 2), slice(rope_dim // 2, rope_dim)) if neox else \
        (slice(0, rope_dim, 2), slice(1, rope_dim, 2))
    a, b = ref[..., lo].copy(), ref[..., hi].copy()
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    ref[..., lo], ref[..., hi] = a * c - b * s, a * s + b * c
    return ref.reshape(x.shape)


@needs_kernels
@pytest.mark.parametrize(("neox", "paired", "normed"), [(False, False, False), (True, False, False),
                                                        (True, True, False), (True, False, True)])
def test_rope_and_store(neox, paired, normed):
    """q and k rotated (norm or neox style, a neox model's pairs on adjacent columns where paired), first normalized
    per head where normed (qwen3's q/k norms), k and v stored, against float64."""
    from lucekv.kernels.cuda.attention import rope_and_store
    from lucekv.kernels.cuda.rope import Rotary, pair_order
    from lucekv.model.rope import RopeScaling, frequencies

    rng = np.random.default_rng(5)
    n_heads, n_kv, head_dim, rope_dim, base, scale = 3, 1, 16, 12, 1e6, 2.0  # 4 dimensions pass unrotated
    q = rng.standard_normal((2, n_heads * head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((2, n_kv * head_dim)).astype(np.float32) for _ in range(2))
    positions, slots = np.array([5, 70001], np.int32), np.array([3, 0], np.int32)
    k_pool, v_pool = (cuda.to_device(np.full((4, n_kv, head_dim), np.nan, np.float32)) for _ in range(2))
    q_out, last_q = cuda.device_array(q.shape, np.float32), cuda.device_array((2, q.shape[1]), np.float32)
    # paired: q and k as a product of paired weights gives them (see rope.pair_order); the outputs stay natural
    q_in, k_in = (x[:, pair_order(h, head_dim, rope_dim)] if paired else x for x, h in ((q, n_heads), (k, n_kv)))
    rope = Rotary(cuda.to_device(frequencies(base, rope_dim, RopeScaling("linear", scale))), neox, paired)
    norms = [(1 + 0.5 * rng.standard_normal(head_dim)).astype(np.float32) for _ in range(2)]
    eps = 1e-6
    rope_and_store(cuda.to_device(q_in), cuda.to_device(k_in), cuda.to_device(v), cuda.to_device(positions),
                   cuda.to_device(slots), rope, k_pool, v_pool, q_out, last_q,
                   (*(cuda.to_device(w) for w in norms), eps) if normed else None)

    def normalized(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        heads = x.astype(np.float64).reshape(len(x), -1, head_dim)
        return (heads / np.sqrt(np.mean(heads * heads, axis=2, keepdims=True) + eps) * w).reshape(x.shape)

    if normed:
        q, k = normalized(q, norms[0]), normalized(k, norms[1])
    ref_q = rope_reference(q, n_heads, head_dim, rope_dim, positions, base, scale, neox)
    ref_k = rope_reference(k, n_kv, head_dim, rope_dim, positions, base, scale, neox)
    assert rel_err(q_out.copy_to_host(), ref_q) <= 1e-6
    assert np.array_equal(last_q.copy_to_host(), q_out.copy_to_host()[-2:])  # the last rows, as many as it holds
    assert rel_err(k_pool.copy_to_host()[slots].reshape(2, -1), ref_k) <= 1e-6
    assert np.array_equal(v_pool.copy_to_host()[slots].reshape(2, -1), v)
    assert np.isnan(k_pool.copy_to_host()[[1, 2]]).all()  # other slots untouched


def check_product_into_attention(qtypes: tuple[Q, Q, Q], neox: bool, kv_dtype=np.float32) -> None:
    """One token's q/k/v products writing attention's inputs (AttentionInputs): q and k rotated, k and v in the
    pool, against float64 numpy (RMSNorm, products of the natural weights, bias, RoPE). Matrices of one kind share
    a product, as CudaOps stacks them; a neox model's q and k rows are in paired order."""
    from lucekv.kernels.cpu.quants import permute_rows, stack_rows
    from lucekv.kernels.cuda import matvec
    from lucekv.kernels.cuda.packed import attention_inputs, upload
    from lucekv.kernels.cuda.rope import Rotary, pair_order
    from lucekv.model.rope import RopeScaling, frequencies

    rng = np.random.default_rng(7)
    n_head, n_kv, head_dim, rope_dim, cols, base, scale = 4, 2, 16, 12, 256, 1e4, 2.0  # 4 dimensions unrotated
    heads = (n_head, n_kv, n_kv)
    ms = [random_packed(rng, qt, h * head_dim, cols) for qt, h in zip(qtypes, heads, strict=True)]
    biases = [rng.standard_normal(m.rows).astype(np.float32) for m in ms]
    x = rng.standard_normal((1, cols)).astype(np.float32) * 3
    norm_w = rng.standard_normal(cols).astype(np.float32)
    positions, slots = np.array([70001], np.int32), np.array([2], np.int32)
    x64 = x.astype(np.float64)
    x64 = x64 / np.sqrt(np.mean(x64 * x64) + 1e-5) * norm_w
    ref = [x64 @ dense(m).T + b for m, b in zip(ms, biases, strict=True)]
    ref_q, ref_k = (rope_reference(r, h, head_dim, rope_dim, positions, base, scale, neox)
                    for r, h in zip(ref[:2], heads[:2], strict=True))
    for i in range(2 if neox else 0):
        order = pair_order(heads[i], head_dim, rope_dim)
        ms[i], biases[i] = permute_rows(ms[i], order), biases[i][order]

    q_out = cuda.device_array((1, n_head * head_dim), np.float32)
    k_pool, v_pool = (cuda.to_device(np.full((4, n_kv, head_dim), np.nan, kv_dtype)) for _ in range(2))
    rope = Rotary(cuda.to_device(frequencies(base, rope_dim, RopeScaling("linear", scale))), neox, neox)
    stacks = [[0, 1, 2]] if len(set(qtypes)) == 1 else [[0, 1], [2]]  # two: one launch of the pair kernel
    products, row0 = [], 0
    for stack in stacks:
        w = upload(stack_rows([ms[i] for i in stack]))
        bias = cuda.to_device(np.concatenate([biases[i] for i in stack]))
        products.append((w, attention_inputs(q_out, k_pool, v_pool, cuda.to_device(positions), cuda.to_device(slots),
                                             rope, ms[0].rows, ms[1].rows, row0, bias)))
        row0 += w.rows
    matvec.matvecs(products, cuda.to_device(x), norm=(cuda.to_device(norm_w), 1e-5))
    bound = 1e-3 if kv_dtype == np.float32 else 1e-2
    assert rel_err(q_out.copy_to_host(), ref_q) <= 1e-3
    assert rel_err(k_pool.copy_to_host()[slots].reshape(1, -1), ref_k) <= bound
    assert rel_err(v_pool.copy_to_host()[slots].reshape(1, -1), ref[2]) <= bound
    assert np.isnan(np.delete(k_pool.copy_to_host(), slots, axis=0)).all()  # other slots untouched
    assert np.isnan(np.delete(v_pool.copy_to_host(), slots, axis=0)).all()


@needs_kernels
@pytest.mark.parametrize("qtypes", [(Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q4_0, Q.F32)], ids=["q4k-q6k", "q8-q4-f32"])
def test_matvecs_of_several_kinds(qtypes):
    """Products of one x in matrices of different kinds: two quantized ones share a launch (their blocks side by
    side), a third or a float32 one takes its own; each with its own epilogue (bias, residual), the matvec
    normalizing x itself."""
    from lucekv.kernels.cuda import matvec
    from lucekv.kernels.cuda.packed import epilogue, upload

    rng = np.random.default_rng(11)
    ms = [random_packed(rng, qt, rows, 256) for qt, rows in zip(qtypes, (40, 12, 8), strict=False)]
    x = rng.standard_normal((1, 256)).astype(np.float32) * 3
    norm_w = rng.standard_normal(256).astype(np.float32)
    biases = [rng.standard_normal(m.rows).astype(np.float32) for m in ms]
    residual = rng.standard_normal((1, ms[1].rows)).astype(np.float32)
    outs = [cuda.device_array((1, m.rows), np.float32) for m in ms]
    eps = [epilogue((o,), bias=cuda.to_device(b)) for o, b in zip(outs, biases, strict=True)]
    eps[1] = epilogue((outs[1],), residual=cuda.to_device(residual))
    norm = None if Q.F32 in qtypes else (cuda.to_device(norm_w), 1e-5)  # a float32 matrix fuses no norm
    matvec.matvecs([(upload(m), ep) for m, ep in zip(ms, eps, strict=True)], cuda.to_device(x), norm=norm)
    x64 = x.astype(np.float64)
    if norm is not None:
        x64 = x64 / np.sqrt(np.mean(x64 * x64) + 1e-5) * norm_w
    added = [biases[0], residual[0], *biases[2:]]
    for m, out, a in zip(ms, outs, added, strict=True):
        assert rel_err(out.copy_to_host(), x64 @ dense(m).T + a) <= 1e-3


@needs_kernels
@pytest.mark.parametrize(("qtypes", "neox"), [
    ((Q.Q8_0,) * 3, True),  # one product, paired q and k
    ((Q.Q4_K, Q.Q4_K, Q.Q6_K), False),  # q and k in one product, v in another (its rows from row0 on)
], ids=["q8-neox", "q4k-q6k-norm"])
def test_matvec_into_attention_inputs(qtypes, neox):
    check_product_into_attention(qtypes, neox)


@needs_kernels
@pytest.mark.parametrize("gelu", [False, True])
def test_gated_act_and_add(gelu):
    from lucekv.kernels.cuda.act import add, gated_act

    rng = np.random.default_rng(6)
    g, u = (rng.standard_normal((2, 40)).astype(np.float32) * 3 for _ in range(2))
    out = cuda.device_array(g.shape, np.float32)
    gated_act(cuda.to_device(g), cuda.to_device(u), gelu, out)
    g64 = g.astype(np.float64)
    act = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3))) if gelu else \
        g64 / (1 + np.exp(-g64))
    assert rel_err(out.copy_to_host(), act * u) <= 1e-3
    total = cuda.device_array(g.shape, np.float32)
    add(cuda.to_device(g), cuda.to_device(u), total)
    assert rel_err(total.copy_to_host(), g64 + u) <= 1e-6


# ---- attention and sampling -----------------------------------------------------------------------------


def attention_reference(q, k_pool, v_pool, slot_pos, positions, window, scale):
    """float64 softmax attention per query and head over the visible slots (GQA by head groups)."""
    n_slots, n_kv, d = k_pool.shape
    n_head = q.shape[1] // d
    out = np.zeros((len(positions), n_head, d))
    for t, pos in enumerate(positions):
        vis = (slot_pos >= 0) & (slot_pos <= pos) & ((slot_pos > pos - window) if window > 0 else True)
        for h in range(n_head):
            kvh = h // (n_head // n_kv)
            sc = k_pool[vis, kvh].astype(np.float64) @ q[t, h * d:(h + 1) * d].astype(np.float64) * scale
            p = np.exp(sc - sc.max())
            out[t, h] = p @ v_pool[vis, kvh].astype(np.float64) / p.sum()
    return out.reshape(len(positions), -1)


def check_attention(n_slots, n_head, n_kv, d, positions, window, kv_dtype, seed=0, ordered=False, launches=1,
                    flash=False, free=0.1):
    """Random pool with a shuffled (or, `ordered`, increasing) slot -> position map and a `free` share of free
    slots, queries at `positions`; `launches` times with the same scratch, as a replayed graph does. `flash`: the
    tensor-core prefill kernel (`flash.attend`) instead of the per-query one."""
    from lucekv.kernels.cuda.attention import BLOCK, attend, identity_tables, partials
    from lucekv.kernels.cuda.flash import attend as flash_attend

    rng = np.random.default_rng(seed)
    slot_pos = (np.arange(n_slots) if ordered else rng.permutation(n_slots)).astype(np.int32)
    slot_pos[rng.random(n_slots) < free] = -1
    n = len(positions)
    q = rng.standard_normal((n, n_head * d)).astype(np.float32)
    k_pool = (rng.standard_normal((n_slots, n_kv, d)) * 0.5).astype(kv_dtype)
    v_pool = rng.standard_normal((n_slots, n_kv, d)).astype(kv_dtype)
    # the queries' own positions in free slots, as a step writes them
    own = np.flatnonzero(slot_pos == -1)[:n]
    slot_pos[own] = positions[: len(own)]
    dk, dv = cuda.to_device(k_pool), cuda.to_device(v_pool)
    out = cuda.device_array((n, n_head * d), np.float32)
    scale = 1 / np.sqrt(d)
    # the high-water mark: slots past it are never read (the pool behind it holds NaN)
    used = n_slots - 7
    k_pool[used:], v_pool[used:], slot_pos[used:] = np.nan, np.nan, 0
    dk[used:].copy_to_device(k_pool[used:])
    dv[used:].copy_to_device(v_pool[used:])
    d_used = cuda.to_device(np.array([used], np.int32))
    parts = partials(n, n_head, n_kv, d, n_slots)
    ref = attention_reference(q, k_pool[:used], v_pool[:used], slot_pos[:used], positions, window, scale)
    first = None
    tables = identity_tables(cuda.to_device(np.arange(-(-n_slots // BLOCK), dtype=np.int32)), d_used,
                             cuda.to_device(np.zeros(n, np.int32)))
    args = cuda.to_device(q), dk, dv, cuda.to_device(slot_pos), tables, cuda.to_device(positions), window, scale
    for _ in range(launches):
        if flash:
            flash_attend(*args, out)
        else:
            attend(*args, parts, out)
        got = out.copy_to_host()
        assert rel_err(got, ref) <= (1e-2 if kv_dtype == np.float16 else 1e-3)
        first = got if first is None else first
        np.testing.assert_array_equal(got, first)


@needs_kernels
@pytest.mark.parametrize(("kv_dtype", "window"), [
    (np.float32, 0), (np.float16, 20),
    pytest.param(np.float32, 20, marks=pytest.mark.slow),  # ~13 s in the simulator; the two others cover its parts
], ids=["f32", "f16-window", "f32-window"])
def test_attention(kv_dtype, window):
    # 93 slots used of 100: two chunks, the first of two tiles (the second copied while the first is scored),
    # the last partial; GQA 4 heads on 2 KV heads; head_dim 16: most lanes hold no dimension
    check_attention(100, 4, 2, 16, np.array([50, 92], np.int32), window, kv_dtype)


@needs_kernels
def test_attention_skips_hidden_tiles_and_launches_again():
    # slots in position order, a 40-position window at 190: the first two chunks' tiles are all hidden (neither
    # copied nor scored), the last chunk holds one slot; a second launch on the same scratch gives the same output
    check_attention(200, 2, 1, 16, np.array([190], np.int32), 40, np.float16, ordered=True, launches=2)


@needs_kernels
def test_attention_wide_rows():
    # float32 rows of 160 values: K and V of a tile do not fit the buffer together, V is copied after K, one
    # tile buffer; 200 slots: 4 chunks, more than the simulator's combine warps, whose lanes hold 16 bytes of a
    # row or none
    check_attention(200, 2, 1, 160, np.array([190], np.int32), 0, np.float32)


def check_table_attention(layout, n_head, n_kv, d, window, flash=False, seed=3):
    """Sequences in scattered blocks of one float16 pool: `layout` lists, per query, (its sequence's blocks in
    logical order, its position); each query reads its own sequence's slots in that order. With `flash` one
    sequence's queries through the tensor-core kernel."""
    from lucekv.kernels.cuda.attention import BLOCK, BlockTables, attend, partials
    from lucekv.kernels.cuda.flash import attend as flash_attend

    rng = np.random.default_rng(seed)
    n_blocks = 1 + max(b for blocks, _ in layout for b in blocks)
    k_pool = (rng.standard_normal((n_blocks * BLOCK, n_kv, d)) * 0.5).astype(np.float16)
    v_pool = rng.standard_normal((n_blocks * BLOCK, n_kv, d)).astype(np.float16)
    slot_pos = np.full(n_blocks * BLOCK, 7, np.int32)  # slots of no sequence here hold a position every query sees
    seqs = list(dict.fromkeys(tuple(blocks) for blocks, _ in layout))
    for blocks in seqs:
        slots = (np.array(blocks)[:, None] * BLOCK + np.arange(BLOCK)).ravel()
        pos = np.arange(len(slots), dtype=np.int32)
        pos[rng.random(len(slots)) < 0.1] = -1  # free slots inside the sequence
        slot_pos[slots] = pos
    n = len(layout)
    q = rng.standard_normal((n, n_head * d)).astype(np.float32)
    positions = np.array([p for _, p in layout], np.int32)
    starts = np.cumsum([0] + [len(b) for b in seqs])
    tables = BlockTables(cuda.to_device(np.concatenate([np.array(b, np.int32) for b in seqs])),
                         cuda.to_device(starts[:-1].astype(np.int32)),
                         cuda.to_device(np.array([len(b) * BLOCK for b in seqs], np.int32)),
                         cuda.to_device(np.array([seqs.index(tuple(b)) for b, _ in layout], np.int32)))
    out = cuda.device_array((n, n_head * d), np.float32)
    args = (cuda.to_device(q), cuda.to_device(k_pool), cuda.to_device(v_pool), cuda.to_device(slot_pos), tables,
            cuda.to_device(positions), window, 1 / np.sqrt(d))
    if flash:
        flash_attend(*args, out)
    else:
        attend(*args, partials(n, n_head, n_kv, d, n_blocks * BLOCK), out)
    got = out.copy_to_host()
    for t, (blocks, pos) in enumerate(layout):
        slots = (np.array(blocks)[:, None] * BLOCK + np.arange(BLOCK)).ravel()
        ref = attention_reference(q[t : t + 1], k_pool[slots], v_pool[slots], slot_pos[slots], [pos], window,
                                  1 / np.sqrt(d))
        assert rel_err(got[t : t + 1], ref) <= 1e-2, f"query {t}"


@needs_kernels
def test_attention_rows_read_their_own_sequences_blocks():
    # three sequences in scattered blocks, one query each (decode rows)
    check_table_attention([((4, 1), 100), ((0, 5, 2), 150), ((3,), 40)], 4, 2, 16, window=0)


@pytest.mark.slow  # ~8 s in the simulator; test_attention_skips_hidden_tiles covers windows over blocks in order
@needs_kernels
def test_attention_rows_read_their_blocks_through_a_window():
    check_table_attention([((2, 0), 120)], 2, 1, 16, window=30)


def test_attention_splits_and_supported_heads():
    from lucekv.kernels.cuda.attention import splits, unsupported

    assert splits(1, 8, 131072) == 128  # a decode step over a long pool: many chunks
    assert splits(1, 8, 4096) == 64  # no more than a 4096-slot pool fills with 64-slot chunks
    assert splits(512, 8, 131072) == 1  # a prefill's queries fill the GPU alone
    assert unsupported(32, 8, 128) is None
    assert "head_dim 100" in unsupported(32, 8, 100)
    assert "at most 8 per KV head" in unsupported(32, 2, 128)


@needs_kernels
@pytest.mark.parametrize("cols, n", [(400, 400), (403, 403), (300, 297)])
def test_argmax(cols, n):
    from lucekv.kernels.cuda.sample import argmax, argmax_scratch

    rng = np.random.default_rng(7)
    logits = rng.standard_normal((4, cols)).astype(np.float32)
    logits[1, [17, n - 1]] = 50.0  # a tie: the first index wins, as in numpy
    logits[2, [n - 2, n - 1]] = 60.0  # a tie in the columns past the whole runs of 4
    logits[3, n:] = 99.0  # past n: not looked at
    out = cuda.device_array(4, np.int32)
    scratch = argmax_scratch(4)
    for _ in range(2):  # the blocks' counters reset themselves for the next launch
        argmax(cuda.to_device(logits), n, out, scratch)
        assert out.copy_to_host().tolist() == np.argmax(logits[:, :n], axis=1).tolist()
        logits[0] = logits[0, ::-1]


# ---- real shapes, GPU only ------------------------------------------------------------------------------


@gpu
@needs_gpu
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.Q6_K], ids=lambda q: q.name)
def test_matvec_gpu(qtype):
    check_matvec(qtype, rows=4096, cols=4096, n=1)


@gpu
@needs_gpu
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_attention_gpu(kv_dtype):
    check_attention(4096, 32, 8, 128, np.array([4000], np.int32), 0, kv_dtype)
    check_attention(4096, 32, 8, 128, np.array([3000, 4095], np.int32), 1024, kv_dtype, seed=1)
    # a prefill's many queries: one chunk each (no split)
    check_attention(4096, 32, 8, 128, np.arange(3796, 4096, dtype=np.int32), 0, kv_dtype, seed=2)


# ---- the backend against the CPU backend ----------------------------------------------------------------


# CUDA logits against the CPU backend's once a prompt went through the prefill matmul, whose operands are float16
# (measured on an H200: 5e-4 to 1.9e-3 for the synthetic 2- and 6-layer models here; the bound is 1e-2)
F16_PREFILL = 5e-3


def check_backend_matches_cpu(tmp_path, arch: str, qtype: Q, decode_steps: int, kv_dtype: str = "f32",
                              prompt: int = 4, **dims) -> None:
    from lucekv.backends.cpu import CpuBackend
    from lucekv.backends.cuda import CudaBackend
    from lucekv.model.arch import ModelSpec
    from lucekv.model.gguf import open_gguf
    from lucekv.model.synth import write_synthetic_gguf

    g = open_gguf(write_synthetic_gguf(tmp_path / f"{arch}.gguf", arch, qtype=qtype, **dims))
    spec = ModelSpec.from_gguf(g)
    cpu, gpu = CpuBackend(g, spec, kv_dtype, 64), CudaBackend(g, spec, kv_dtype, 64)
    tokens = np.array([5, 17, 42, 7] * (prompt // 4), np.int32)
    pos = np.arange(len(tokens), dtype=np.int32)
    ref = cpu.forward(tokens, pos, pos, all_logits=True)
    assert rel_err(gpu.forward(tokens, pos, pos, all_logits=True), ref) <= F16_PREFILL
    for step in range(decode_steps):
        tok = np.array([np.argmax(ref[-1])], np.int32)
        p = np.array([len(tokens) + step], np.int32)
        ref = cpu.forward(tok, p, p)
        assert rel_err(gpu.forward(tok, p, p), ref) <= F16_PREFILL  # the prompt's K/V came from the prefill


@gpu
@needs_gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_backend_matches_cpu(tmp_path, arch):
    k_quant_dims = dict(n_embd=256, n_head=4, head_dim=64, n_ff=512) if arch == "qwen3" else {}
    check_backend_matches_cpu(tmp_path, arch, Q.Q4_K if arch == "qwen3" else Q.Q8_0, 8, **k_quant_dims,
                              n_layer=6 if arch == "gemma3" else 2)


@gpu
@needs_gpu
@pytest.mark.parametrize(("arch", "scaling"), [("llama", "LLAMA3"), ("qwen2", "YARN")])
def test_backend_matches_cpu_with_scaled_rope(tmp_path, arch, scaling):
    """Llama 3's per-pair factors through the one-token product's epilogue (norm style), YaRN's speeds and
    softmax scale through the paired neox one."""
    from tests.model import test_rope

    check_backend_matches_cpu(tmp_path, arch, Q.Q8_0, 8, n_layer=2, rope_scaling=getattr(test_rope, scaling))


@gpu
@needs_gpu
def test_backend_matches_cpu_through_the_flash_prefill(tmp_path):
    """A float16 pool and a 40-token prompt: the prompt's attention runs in `flash` (GQA groups of 4)."""
    check_backend_matches_cpu(tmp_path, "qwen2", Q.Q8_0, 4, kv_dtype="f16", prompt=40, n_embd=256, n_head=8,
                              n_kv_head=2, head_dim=32, n_ff=512, n_layer=2)


@pytest.mark.slow
@pytest.mark.skipif(not SIMULATOR, reason="the simulator variant of test_backend_matches_cpu")
def test_backend_matches_cpu_simulated(tmp_path):
    check_backend_matches_cpu(tmp_path, "llama", Q.Q4_0, 1, n_layer=2)


def small_qwen2(tmp_path):
    from lucekv.model.arch import ModelSpec
    from lucekv.model.gguf import open_gguf
    from lucekv.model.synth import write_synthetic_gguf

    g = open_gguf(write_synthetic_gguf(tmp_path / "m.gguf", "qwen2", qtype=Q.Q4_0, n_embd=256, n_head=8,
                                       n_kv_head=2, head_dim=32, n_ff=512, n_layer=4))
    return g, ModelSpec.from_gguf(g)


def check_pieces_replay(g, spec, pieces: list[int], decode_steps: int = 8, pool: int = 320) -> set[int]:
    """A prompt in pieces of these lengths, then greedy decode steps, on a backend with graphs: each piece replays
    the graph of its width bucket, padded (padding rows first), captured at the bucket's first use. Each piece's
    logits equal exactly those of an eager backend fed the same padded inputs (the replay is the eager forward),
    and within F16_PREFILL those of an eager backend fed the piece alone (a width picks its kernels: the
    tensor-core attention from flash.MIN_TOKENS queries, matvec rows or matmul by tokens x rows, the splits); the
    decode steps after equal the padded eager backend's exactly (the same K/V). Returns the widths captured."""
    from lucekv.backends.cuda import CudaBackend, prefill_bucket
    from lucekv.kvflash.pager import CHUNK_TOKENS

    eager, padded = (CudaBackend(g, spec, "f16", pool, use_graph=False) for _ in range(2))
    graphed = CudaBackend(g, spec, "f16", pool, use_graph=True)
    tokens = 3 + np.arange(sum(pieces), dtype=np.int32) % 97
    # the sequence's blocks (slot = position), the same for all three: the padded backend's padding rows cover the
    # scratch block, which would otherwise widen its attention's range (the high-water mark) and its rounding
    table = [np.arange(-(-(len(tokens) + decode_steps) // CHUNK_TOKENS), dtype=np.int32)]
    start = 0
    for n in pieces:
        pos = np.arange(start, start + n, dtype=np.int32)
        width = prefill_bucket(n, graphed.prefill_chunk)
        b = graphed.forward(tokens[pos], pos, pos, tables=table)
        alone = eager.forward(tokens[pos], pos, pos, tables=table)
        c = padded.forward(*padded._padded(width, tokens[pos], pos, pos, first=True), tables=table)
        assert np.array_equal(b, c), f"piece of {n} at {start} (width {width})"
        assert rel_err(b, alone) <= F16_PREFILL, f"piece of {n} at {start}"
        start += n
    for step in range(decode_steps):
        tok, p = np.array([np.argmax(b[-1])], np.int32), np.array([start + step], np.int32)
        b, c = graphed.forward(tok, p, p, tables=table), padded.forward(tok, p, p, tables=table)
        assert np.array_equal(b, c), f"step {step}"
    return {w for w, graph in graphed.prefill_graphs.items() if graph.ready}


@gpu
@needs_gpu
def test_prompt_pieces_replay_the_graphs_of_their_width_buckets(tmp_path):
    """Pieces of 5, 16, 40, 16 and 100 tokens: widths 16 (captured, then replayed padded and unpadded), 64, 128."""
    g, spec = small_qwen2(tmp_path)
    assert check_pieces_replay(g, spec, [5, 16, 40, 16, 100]) == {16, 64, 128}


@gpu
@needs_gpu
def test_prefill_graph_replays_full_chunks(tmp_path, monkeypatch):
    """A prompt of three full prefill chunks and a partial one (padded to the chunk's width), through the chunk's
    graph; a full chunk's logits of every position (run eagerly: the graph keeps the last token's) equal too."""
    from lucekv.backends.cuda import CudaBackend

    monkeypatch.setattr(CudaBackend, "prefill_chunk", 16)
    g, spec = small_qwen2(tmp_path)
    assert check_pieces_replay(g, spec, [16, 16, 16, 5], pool=128) == {16}
    eager = CudaBackend(g, spec, "f16", 128, use_graph=False)
    graphed = CudaBackend(g, spec, "f16", 128, use_graph=True)
    pos = np.arange(16, dtype=np.int32)
    a, b = eager.forward(pos + 3, pos, pos, all_logits=True), graphed.forward(pos + 3, pos, pos, True)
    assert a.shape == (16, spec.vocab_size) and np.array_equal(a, b)


@gpu
@needs_gpu
def test_decode_graph_replays_the_eager_step(tmp_path):
    """Replayed decode steps give exactly the eager step's logits, and the same greedy tokens; on sm_90+ with
    every kernel launched before the one before it has finished (programmatic edges)."""
    from lucekv.backends.cuda import CudaBackend
    from lucekv.kernels.cuda._numba import overlapped_launches

    g, spec = small_qwen2(tmp_path)
    eager = CudaBackend(g, spec, "f16", 600, use_graph=False)
    graphed = CudaBackend(g, spec, "f16", 600, use_graph=True)
    # a prompt of a prefill bucket's width: the graphed backend replays it unpadded, the kernels the eager one runs
    # (a padded piece is not bit-identical: its width picks other products)
    tokens = np.arange(3, 35, dtype=np.int32)
    pos = np.arange(len(tokens), dtype=np.int32)
    a, b = eager.forward(tokens, pos, pos), graphed.forward(tokens, pos, pos)
    assert np.array_equal(a, b)
    for step in range(300):  # past one attention chunk (SPLIT slots)
        tok = np.array([np.argmax(a[-1])], np.int32)
        p = np.array([len(tokens) + step], np.int32)
        a, b = eager.forward(tok, p, p), graphed.forward(tok, p, p)
        assert np.array_equal(a, b), f"step {step}"
    assert graphed.graph.ready
    if overlapped_launches():  # six kernels a layer: all but the few edges into and out of non-kernel nodes
        assert graphed.graph.overlapped_edges >= 6 * spec.n_layer

