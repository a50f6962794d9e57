"""Shared by the CUDA kernel tests: skip marks, and running a test file under numba's CUDA simulator.

numba reads NUMBA_ENABLE_CUDASIM once, at import, so without a GPU a test file re-runs itself in a child
pytest with the variable set; the variable never leaks into the other tests of this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lucekv.kernels.cuda import SIMULATOR, available

needs_kernels = pytest.mark.skipif(not available(), reason="no CUDA GPU (the simulator run covers these)")
needs_gpu = pytest.mark.skipif(SIMULATOR or not available(), reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[2]


def run_in_simulator(test_file: str) -> None:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    args = ["-q", "-p", "no:cacheprovider", "-m", "not gpu and not slow", test_file]
    child = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=ROOT, env=env, capture_output=True,
                           text=True)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
