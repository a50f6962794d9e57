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


@pytest.mark.skipif(available(), reason="kernels run directly in this process")
def test_matvec_in_simulator():
    run_in_simulator(__file__)


@needs_kernels
@pytest.mark.parametrize(("qtype", "rows", "cols"), [
    (Q.Q4_K, 3, 17408),  # 17 segments: two passes of 9 warps, the last warp idle in the second
    (Q.Q6_K, 3, 9216),  # q8 in 16-blocks, 9 segments in one pass
    (Q.Q8_0, 9, 1280),  # a segment cut short (second warp's lanes partly idle), three row blocks, one partial
], ids=lambda v: getattr(v, "name", str(v)))
def test_matvec_layouts(qtype, rows, cols):
    check_matvec(qtype, rows, cols, n=1)


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
