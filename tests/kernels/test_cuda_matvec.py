"""The decode matvec at the shapes that exercise its layout: several warps per block, several passes over
the columns, segments and row blocks cut short, float64 numpy as the reference (see test_cuda_kernels.py
for how the simulator runs these without a GPU)."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from lucekv.kernels.cuda import available
from tests.kernels.cuda_sim import needs_gpu, needs_kernels, run_in_simulator
from tests.kernels.test_cuda_kernels import check_matvec


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
