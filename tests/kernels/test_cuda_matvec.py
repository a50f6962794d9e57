"""The decode matvec at the shapes that exercise its layout: several warps per block, several passes over
the columns, segments and row blocks cut short, float64 numpy as the reference (see test_cuda_kernels.py
for how the simulator runs these without a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from lucekv.kernels.cuda import SIMULATOR, available
from tests.kernels.test_cuda_kernels import check_matvec

needs_kernels = pytest.mark.skipif(not available(), reason="no CUDA GPU (the simulator run covers these)")
needs_gpu = pytest.mark.skipif(SIMULATOR or not available(), reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(available(), reason="kernels run directly in this process")
def test_matvec_in_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    args = ["-q", "-p", "no:cacheprovider", "-m", "not gpu and not slow", str(Path(__file__))]
    child = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=ROOT, env=env, capture_output=True,
                           text=True)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]


@needs_kernels
@pytest.mark.parametrize(("qtype", "rows", "cols"), [
    (Q.Q4_K, 3, 9216),  # 9 segments: two passes of 5 warps, the last warp idle in the second
    (Q.Q6_K, 3, 9216),  # q8 in 16-blocks, same layout
    (Q.Q8_0, 9, 1280),  # a segment cut short (second warp's lanes partly idle), three row blocks
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
