"""Shared by the CUDA kernel tests: skip marks, and running a test file under numba's CUDA simulator.

numba reads NUMBA_ENABLE_CUDASIM once, at import, so without a GPU a test file re-runs itself in a child
pytest with the variable set; the variable never leaks into the other tests of this process. The session starts
those children as it begins (tests/conftest.py), in the background.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from lucekv.kernels.cuda import SIMULATOR, available

needs_kernels = pytest.mark.skipif(not available(), reason="no CUDA GPU (the simulator run covers these)")
needs_gpu = pytest.mark.skipif(SIMULATOR or not available(), reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[2]


def lock_shared_allocations() -> None:
    """numba's simulator makes a block's shared array the first time a thread asks for it at a source line, without a
    lock: under load two threads of a block can both find none and each make its own, and the block's reduction then
    reads an array some threads never wrote (CI once: argmax's block-wide tree returned a wrong index). Here the
    lookup and the making are one step under a lock, keyed as numba keys them (file and line of the asking code)."""
    from numba.core import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support

    unlocked, lock = FakeCUDAShared.array, threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory (no lookup), or refused
            return unlocked(self, shape, dtype, alignment)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            if key not in self._allocations:
                dtype = numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else dtype
                self._allocations[key] = np.empty(shape, dtype)
            return self._allocations[key]

    FakeCUDAShared.array = array


if SIMULATOR:  # a child run: every test file under the simulator imports this module
    lock_shared_allocations()

_runs: dict[str, queue.Queue] = {}  # test file -> where its child run, started ahead, leaves its result

# The children that took longest in CI, longest first (file names; a file not listed runs after these): started
# first, they do not leave one thread running the longest child alone at the end.
LONGEST_RUNS = ("test_cuda_verify.py", "test_cuda_matmul.py", "test_cuda_moe.py", "test_cuda_paging.py",
                "test_cuda_mmq.py", "test_cuda_matvec.py", "test_cuda_kernels.py", "test_cuda_flash.py",
                "test_cuda_tree.py")


def longest_first(test_files: list[str]) -> list[str]:
    """The files in LONGEST_RUNS's order, the others after them in their given order."""
    rank = {name: i for i, name in enumerate(LONGEST_RUNS)}
    return sorted(test_files, key=lambda f: rank.get(Path(f).name, len(rank)))


def start_in_background(test_files: list[str], workers: int = 2) -> None:
    """Run these files' simulator children on `workers` threads, beside the rest of the session: they are
    single-threaded and take minutes (more in all than the other tests), so on a 2-core machine they share the cores
    with the main run and take both once it is done. `run_in_simulator` then waits for its file's result."""
    results = [(f, queue.Queue(maxsize=1)) for f in longest_first(test_files)]
    for f, result in results:
        _runs[str(Path(f).resolve())] = result
    todo = queue.SimpleQueue()  # not through _runs: a test takes its queue out of it as it starts waiting
    for item in results:
        todo.put(item)

    def run_some() -> None:
        while True:
            try:
                f, result = todo.get_nowait()
            except queue.Empty:
                return
            try:
                result.put(_child(f))
            except Exception as e:  # the test raises it rather than wait forever
                result.put(e)

    for i in range(workers):
        threading.Thread(target=run_some, name=f"simulator-runs-{i}", daemon=True).start()


def run_in_simulator(test_file: str) -> None:
    result = _runs.pop(str(Path(test_file).resolve()), None)
    child = result.get() if result is not None else _child(test_file)
    if isinstance(child, Exception):
        raise child
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]


def _child(test_file: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    args = ["-q", "-p", "no:cacheprovider", "-m", "not gpu and not slow", test_file]
    return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=ROOT, env=env, capture_output=True, text=True)
