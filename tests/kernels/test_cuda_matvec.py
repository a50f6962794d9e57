"""The decode matvec at the shapes that exercise its layout: several warps per block, several passes over
the columns, segments and row blocks cut short, float64 numpy as the reference (see test_cuda_kernels.py
for how the simulator runs these without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from lucekv.kernels.cuda import available, cuda
from tests.kernels.cuda_sim import needs_gpu, needs_kernels, run_in_simulator
from tests.kernels.test_cuda_kernels import check_matvec, dense, random_packed, rel_err


@pytest.fixture(autouse=True)
def every_matrix_takes_the_several_token_kernels(monkeypatch):
    """These tests' matrices are small: the several-token kernels take them all the same (TOKEN_MIN_ROWS)."""
    from lucekv.kernels.cuda import matvec

    monkeypatch.setattr(matvec, "TOKEN_MIN_ROWS", 0)


@pytest.mark.skipif(available(), reason="kernels run directly in this process")
def test_matvec_in_simulator():
    run_in_simulator(__file__)


def test_token_plans_cover_every_token_in_whole_register_buffers_and_gate_groups(monkeypatch):
    """`token_plan` on an H100's 132 SMs: grid rows of a power of two tokens up to the kind's most, as few as cover n
    (padding less than a grid row; the fewest grid rows from TOKEN_MIN_ROWS rows), blocks of warps that own as many
    slots each, of whole register buffers and gate/up groups within the shared partials; `several_tokens` from 2
    tokens, always from TOKEN_MIN_ROWS rows; `weight_reads` counts the grid rows, or the tokens of the per-token
    path."""
    from lucekv.kernels.cuda import matvec
    from lucekv.kernels.cuda.packed import GATE_ROWS, DeviceMatrix

    monkeypatch.setattr(matvec, "sm_count", lambda: 132)
    for kind in matvec.TOKEN_KINDS:
        for rows, cols in [(128, 896), (896, 4864), (1536, 1536), (4096, 12288), (17920, 1536), (24576, 4096)]:
            w = DeviceMatrix(kind, rows, cols, 5, 3, None, None, None, None, True, True)
            assert not matvec.several_tokens(w, 1) and matvec.weight_reads(w, 1) == 1
            for n in (2, 3, 5, 8, 9, 17, 32, 65):
                for gated in (False, True):
                    plan = matvec.token_plan(w, n, gated)
                    assert plan.tokens in (2, 4, 8) and plan.tokens <= matvec.TOKENS_PER_BLOCK[kind]
                    assert (plan.groups - 1) * plan.tokens < n <= plan.groups * plan.tokens
                    n_warps, n_pass = matvec._warps_and_passes(cols)
                    assert n_warps % plan.warps == 0 and plan.warps <= matvec.TOKEN_WARPS
                    block_rows = plan.rows_per_block
                    assert block_rows % matvec.GROUP[kind] == 0 and block_rows <= matvec.MAX_TOKEN_ROWS
                    assert n_warps * block_rows * plan.tokens <= matvec.TOKEN_PARTIALS
                    assert not gated or block_rows % (2 * GATE_ROWS) == 0
                    if rows >= matvec.TOKEN_MIN_ROWS:  # weights read as few times as a grid row's tokens allow
                        assert plan.groups == -(-n // matvec.TOKENS_PER_BLOCK[kind])
                several = matvec.several_tokens(w, n)
                assert several or rows < matvec.TOKEN_MIN_ROWS
                assert matvec.weight_reads(w, n) == (matvec.token_plan(w, n, False).groups if several else n)


@needs_kernels
@pytest.mark.parametrize(("qtype", "rows", "cols"), [
    (Q.Q4_K, 3, 17408),  # 17 segments: two passes of 9 warps, the last warp idle in the second
    (Q.Q6_K, 3, 9216),  # q8 in 16-blocks, 9 segments in one pass
    (Q.Q8_0, 9, 1280),  # a segment cut short (second warp's lanes partly idle), three row blocks, one partial
], ids=lambda v: getattr(v, "name", str(v)))
def test_matvec_layouts(qtype, rows, cols):
    check_matvec(qtype, rows, cols, n=1)


def check_each_alone(product, x: np.ndarray, outs: list[int]) -> np.ndarray:
    """product(x, outs) of x's n tokens at once, [n, rows]: its first and last tokens' rows (in different grid rows
    past MAX_TOKENS tokens) must equal their own one-token products bit for bit. outs: the outputs' widths."""
    n = x.shape[0]
    together = product(cuda.to_device(x), [cuda.device_array((n, o), np.float32) for o in outs])
    for t in sorted({0, n - 1}):
        alone = product(cuda.to_device(x[t:t + 1]), [cuda.device_array((1, o), np.float32) for o in outs])
        np.testing.assert_array_equal(together[t:t + 1], alone, err_msg=f"token {t}")
    return together


@needs_kernels
@pytest.mark.parametrize(("qtype", "rows", "cols", "n"), [
    (Q.Q4_K, 6, 256, 2),
    (Q.Q6_K, 18, 1280, 3),  # two logical warps (the second's lanes partly idle), 5 row blocks, the last cut short
    (Q.Q5_0, 5, 512, 9),  # q6's device form without sub-scales; 2 grid rows of 8 tokens, the second mostly empty
    (Q.Q4_0, 3, 5120, 2),  # 5 logical warps on 3 of a block (one idle in the second round)
    (Q.Q8_0, 5, 1280, 3),  # q8 lanes' chunks c and c + 32: the second warp's second chunks past the row's end
    (Q.Q4_K, 40, 256, 8),  # 8 tokens a block, two register buffers a warp, the last block's rows mostly past the end
    (Q.Q6_K, 24, 256, 7),  # three buffers a warp (the first one twice), two grid rows, the second with a padding token
    # 17 segments: two passes of 9 logical warps, the last one's lanes idle in the second (slow: a minute in the
    # simulator, `-m slow` with NUMBA_ENABLE_CUDASIM=1)
    pytest.param(Q.Q4_K, 2, 17408, 2, marks=pytest.mark.slow),
], ids=lambda v: getattr(v, "name", str(v)))
def test_matvec_of_several_tokens_reads_each_weight_once_and_equals_each_tokens_own_product(qtype, rows, cols, n):
    """The several-token kernels (`_launch_tokens`, cut as `token_plan` chooses, the comments: in the simulator, one
    SM): within 1e-3 of float64, and bit for bit each token's own one-token product (same partials, summed in the
    same order)."""
    from lucekv.kernels.cuda.matvec import matvec
    from lucekv.kernels.cuda.packed import upload

    m = random_packed(np.random.default_rng(n), qtype, rows, cols)
    w = upload(m)
    x = np.random.default_rng(n + 1).standard_normal((n, cols)).astype(np.float32)

    def product(xd, outs):
        matvec(w, xd, outs[0])
        return outs[0].copy_to_host()

    together = check_each_alone(product, x, [rows])
    assert rel_err(together, x.astype(np.float64) @ dense(m).T) <= 1e-3


@needs_kernels
@pytest.mark.parametrize(("qtype", "rows", "cols", "n"), [
    (Q.Q4_K, 16, 1280, 5),  # two logical warps summed in order; 4 tokens a block, the second grid row 1 real token
    (Q.Q8_0, 8, 512, 3),  # q8's chunk columns
], ids=lambda v: getattr(v, "name", str(v)))
def test_matvec_of_several_tokens_normalizes_x_as_each_tokens_own_product(qtype, rows, cols, n):
    """The several-token kernels with the RMSNorm fused (each block takes 1 / rms(x) of its tokens, summed as the
    one-token kernel sums it): each token bit for bit its own fused one-token product, within 1e-3 of float64."""
    from lucekv.kernels.cuda.matvec import matvec
    from lucekv.kernels.cuda.packed import upload

    rng = np.random.default_rng(rows)
    m = random_packed(rng, qtype, rows, cols)
    w = upload(m)
    x = (rng.standard_normal((n, cols)) * 3).astype(np.float32)
    weight = rng.standard_normal(cols).astype(np.float32)
    norm = (cuda.to_device(weight), 1e-6)

    def product(xd, outs):
        matvec(w, xd, outs[0], norm=norm)
        return outs[0].copy_to_host()

    together = check_each_alone(product, x, [rows])
    x64 = x.astype(np.float64)
    normed = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + 1e-6) * weight
    assert rel_err(together, normed @ dense(m).T) <= 1e-3


@needs_kernels
def test_matvec_of_several_tokens_epilogues():
    """Three outputs with a bias, one output plus a residual, gate and up rows to gelu(gate) * up: 3 tokens at once,
    each equal to its own one-token product and within 1e-3 of float64 (the store is the same for every kind)."""
    from lucekv.kernels.cpu.quants import interleave_rows
    from lucekv.kernels.cuda.matvec import matvec
    from lucekv.kernels.cuda.packed import GATE_ROWS, GELU, epilogue, upload

    rng = np.random.default_rng(4)
    n, cols = 3, 256
    gate, up = (random_packed(rng, Q.Q4_K, 2 * GATE_ROWS, cols) for _ in range(2))
    w = upload(gate)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    bias = rng.standard_normal(gate.rows).astype(np.float32)
    residual = rng.standard_normal((n, gate.rows)).astype(np.float32)
    x64, w64 = x.astype(np.float64), dense(gate)

    def stacked(xd, outs):
        matvec(w, xd, epilogue(outs, bias=cuda.to_device(bias)))
        return np.concatenate([o.copy_to_host() for o in outs], axis=1)

    together = check_each_alone(stacked, x, [1, gate.rows - 3, 2])
    assert rel_err(together, x64 @ w64.T + bias) <= 1e-3

    def with_residual(xd, outs):
        matvec(w, xd, epilogue(outs, residual=cuda.to_device(residual[:xd.shape[0]])))
        return outs[0].copy_to_host()

    together = with_residual(cuda.to_device(x), [cuda.device_array((n, gate.rows), np.float32)])
    assert rel_err(together, x64 @ w64.T + residual) <= 1e-3
    first_alone = with_residual(cuda.to_device(x[:1]), [cuda.device_array((1, gate.rows), np.float32)])
    np.testing.assert_array_equal(together[:1], first_alone)

    gated = upload(interleave_rows(gate, up, GATE_ROWS))

    def gated_product(xd, outs):
        matvec(gated, xd, epilogue(outs, gate=GELU))
        return outs[0].copy_to_host()

    together = check_each_alone(gated_product, x, [gate.rows])
    g, u = x64 @ w64.T, x64 @ dense(up).T
    assert rel_err(together, 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u) <= 1e-3


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("qtype", "rows", "cols"), [
    (Q.Q4_K, 12288, 4096),  # Qwen3-8B gate / up
    (Q.Q6_K, 4096, 12288),  # its down projection: two passes
    (Q.Q4_0, 4864, 896),  # Qwen2.5-0.5B: one warp with idle lanes
    (Q.Q8_0, 1000, 14336),  # Llama-8B down width, rows not a multiple of a row block
], ids=lambda v: getattr(v, "name", str(v)))
def test_matvec_model_shapes_gpu(qtype, rows, cols):
    check_matvec(qtype, rows, cols, n=2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("qtype", "rows", "cols"), [
    (Q.Q4_K, 17920, 1536),  # Qwen2.5-1.5B gate / up: 2 logical warps
    (Q.Q6_K, 1536, 8960),  # its down projection: 9 logical warps on 3 of a block
    (Q.Q4_K, 4096, 12288),  # an 8B down width, 12 logical warps
    (Q.Q4_K, 1536, 1536),  # Qwen2.5-1.5B q / o: two logical warps, the second half idle
    (Q.Q6_K, 256, 1536),  # its k / v
    (Q.Q5_0, 896, 896),  # Qwen2.5-0.5B q / o: one logical warp
], ids=lambda v: getattr(v, "name", str(v)))
def test_matvec_of_several_tokens_at_model_shapes_gpu(qtype, rows, cols):
    """Verify blocks and decode rows: each token of 2, 5, 17 and 32 equal bit for bit to the per-token path (the
    one-token kernel's grid rows), at every tokens-per-block, and within 1e-3 of float64."""
    from lucekv.kernels.cuda.matvec import matvec, matvec_per_token, matvec_tokens
    from lucekv.kernels.cuda.packed import upload

    m = random_packed(np.random.default_rng(3), qtype, rows, cols)
    w, w64 = upload(m), dense(m)
    for n in (2, 5, 17, 32):
        x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
        per_token = cuda.device_array((n, rows), np.float32)
        matvec_per_token(w, cuda.to_device(x), per_token)
        per_token = per_token.copy_to_host()
        for tokens in (None, 2, 4, 8):
            out = cuda.device_array((n, rows), np.float32)
            if tokens is None:
                matvec(w, cuda.to_device(x), out)
            else:
                matvec_tokens(w, cuda.to_device(x), out, tokens)
            np.testing.assert_array_equal(out.copy_to_host(), per_token, err_msg=f"{n} tokens, {tokens} a block")
        assert rel_err(per_token, x.astype(np.float64) @ w64.T) <= 1e-3


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("qtype", "rows", "cols"), [
    (Q.Q4_K, 1536, 1536),  # Qwen2.5-1.5B q / o
    (Q.Q4_K, 17920, 1536),  # its gate / up
    (Q.Q5_0, 896, 896),  # Qwen2.5-0.5B q / o
], ids=lambda v: getattr(v, "name", str(v)))
def test_matvec_of_several_tokens_with_the_norm_fused_at_model_shapes_gpu(qtype, rows, cols):
    """A verify block's normalized products (17 tokens) equal each token's fused one-token product bit for bit, on
    the GPU's compiler (contractions to fma and all), at every tokens-per-block."""
    from lucekv.kernels.cuda.matvec import matvec, matvec_tokens
    from lucekv.kernels.cuda.packed import upload

    rng = np.random.default_rng(5)
    m = random_packed(rng, qtype, rows, cols)
    w = upload(m)
    n = 17
    x = (rng.standard_normal((n, cols)) * 3).astype(np.float32)
    weight = rng.standard_normal(cols).astype(np.float32)
    norm = (cuda.to_device(weight), 1e-6)
    for tokens in (None, 2, 4, 8):
        out = cuda.device_array((n, rows), np.float32)
        if tokens is None:
            matvec(w, cuda.to_device(x), out, norm=norm)
        else:
            matvec_tokens(w, cuda.to_device(x), out, tokens, norm=norm)
        got = out.copy_to_host()
        for t in range(n):
            alone = cuda.device_array((1, rows), np.float32)
            matvec(w, cuda.to_device(x[t:t + 1]), alone, norm=norm)
            np.testing.assert_array_equal(got[t], alone.copy_to_host()[0], err_msg=f"token {t}, {tokens} a block")
    x64 = x.astype(np.float64)
    normed = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + 1e-6) * weight
    assert rel_err(got, normed @ dense(m).T) <= 1e-3


@pytest.mark.gpu
@needs_gpu
def test_a_product_in_a_replayed_graph_reads_what_the_kernel_before_it_wrote():
    """RMSNorm then a product of its output x, captured as a graph: on sm_90+ the edge between them is
    programmatic, so the product's blocks start (and load their first weights) while the norm still runs. Each
    replay's product must be of that replay's x, never of the one before: no load of x may run before the wait.
    (It failed when x was read through the non-coherent path: ptxas moved those loads above the wait.)"""
    from lucekv.backends.cuda import capture_graph, launch_graph
    from lucekv.kernels.cuda._numba import overlapped_launches
    from lucekv.kernels.cuda.matvec import matvec
    from lucekv.kernels.cuda.norm import rmsnorm
    from lucekv.kernels.cuda.packed import upload

    rng = np.random.default_rng(11)
    cols = 1 << 18  # one block normalizes the row, for tens of microseconds: the product is resident long before
    m = random_packed(rng, Q.Q8_0, 64, cols)
    norm_w = rng.standard_normal(cols).astype(np.float32)
    stream = cuda.stream()
    w, scale = upload(m), cuda.to_device(norm_w)
    x_in, x, out = (cuda.device_array((1, n), np.float32) for n in (cols, cols, m.rows))

    def step() -> None:
        rmsnorm(x_in, scale, 1e-6, 1, x, stream)
        matvec(w, x, out, stream)

    step()  # compiled before the capture, which only records launches
    graph, overlapped = capture_graph(stream, step)
    assert overlapped == (1 if overlapped_launches() else 0)
    w64 = dense(m).T
    for replay in range(16):
        xi = rng.standard_normal((1, cols)).astype(np.float32)
        x_in.copy_to_device(xi, stream=stream)
        launch_graph(graph, stream)
        got = out.copy_to_host(stream=stream)
        stream.synchronize()
        x64 = xi.astype(np.float64)
        ref = x64 / np.sqrt(np.mean(x64 * x64) + 1e-6) * norm_w @ w64
        assert rel_err(got, ref) <= 1e-3, f"replay {replay}"
