"""The CUDA kernels' disk cache (kernels.cuda._numba: jit_kernel, jit_bounded, KernelCache, closure_key).

No GPU needed: the keys are computed from Python values, in this process (numba.cuda without the simulator: the
dispatchers CI's main run imports) and in a child with another hash seed. Whether a warm restart loads everything
from disk is measured on the GPU (`lucekv bench startup`).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lucekv.kernels.cuda as cuda_kernels
from lucekv.kernels.cuda import SIMULATOR

needs_real_dispatchers = pytest.mark.skipif(SIMULATOR, reason="the simulator compiles nothing and caches nothing")

# factory kernels of several parameters each, as the backend makes them
_KEYS_SCRIPT = """
import json, sys
from lucekv.kernels.cuda import attention, flash, matmul, matvec
from lucekv.kernels.cuda._numba import closure_key
made = {"flash 128": flash._kernel(128), "flash 64": flash._kernel(64),
        "split 2 64": attention._split_kernel(2, 64), "split 1 64": attention._split_kernel(1, 64),
        "tokens q4 2": matvec._tokens_kernel("q4", 2), "tokens q4 4": matvec._tokens_kernel("q4", 4),
        "tokens q6 2": matvec._tokens_kernel("q6", 2),
        **{f"matmul {key}": kernel for key, kernel in list(matmul._KERNELS.items())[:3]}}
json.dump({name: repr(closure_key(k.py_func)) for name, k in made.items()}, sys.stdout)
"""


def _keys(hash_seed: str) -> dict[str, str]:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(root)}
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    out = subprocess.run([sys.executable, "-c", _KEYS_SCRIPT], capture_output=True, text=True, env=env, cwd=root,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_a_factory_kernels_key_is_the_same_in_every_process_and_its_own():
    """numba's own key pickles the closure, whose intrinsics carry a random id per process (matvec's several-token
    kernels: never found again); closure_key describes values, so another process finds the same key, and two
    kernels of one factory with other parameters get two keys."""
    first, second = _keys("1"), _keys("2")
    assert first == second
    assert all(key != "None" for key in first.values()), first
    assert len(set(first.values())) == len(first)


def _jit_calls(tree: ast.Module) -> list[str]:
    """`cuda.jit` compiling a kernel: a bare `@cuda.jit` decorator, or `cuda.jit(f)` without options."""
    found = []
    for node in ast.walk(tree):
        decorators = node.decorator_list if isinstance(node, ast.FunctionDef) else []
        for d in decorators:
            if isinstance(d, ast.Attribute) and d.attr == "jit":
                found.append(f"@cuda.jit on {node.name} (line {node.lineno})")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "jit" \
                and node.args and not node.keywords:
            found.append(f"cuda.jit(...) (line {node.lineno})")
    return found


def test_every_kernel_compiles_through_the_cached_helpers():
    """Kernels are made by jit_kernel / jit_bounded (which keep them on disk), never by cuda.jit itself; device
    functions (`cuda.jit(device=True, ...)`) compile into their kernels."""
    bare = {}
    for path in sorted(Path(cuda_kernels.__file__).parent.glob("*.py")):
        if path.name != "_numba.py" and (found := _jit_calls(ast.parse(path.read_text()))):
            bare[path.name] = found
    assert not bare, f"kernels compiled by cuda.jit directly (use jit_kernel / jit_bounded): {bare}"


class _Codegen:
    def magic_tuple(self):
        return ("runtime", (9, 0))


@needs_real_dispatchers
def test_kernel_cache_keys_by_signature_device_sources_and_closure():
    from numba import types

    from lucekv.kernels.cuda import _numba, flash, norm

    assert isinstance(norm._rmsnorm._cache, _numba.KernelCache)  # numba-cuda still consults `_cache`
    made = [flash._kernel(128), flash._kernel(64)]
    assert all(k in _numba.KERNELS for k in made)
    sig = (types.float32[:, ::1],)
    keys = [k._cache._index_key(sig, _Codegen()) for k in made]
    assert keys[0] != keys[1]  # one factory, other parameters
    assert keys[0] == made[0]._cache._index_key(sig, _Codegen())
    assert _numba.kernel_sources_digest() in keys[0]
    assert ("runtime", (9, 0)) in keys[0]


def test_closure_key_refuses_values_it_cannot_describe():
    from lucekv.kernels.cuda._numba import closure_key

    def factory(v):
        def kernel():
            return v

        return kernel

    assert closure_key(factory(3)) == closure_key(factory(3)) != closure_key(factory(4))
    assert closure_key(factory((1, "q4", 2.5))) is not None
    assert closure_key(factory(object())) is None  # such a kernel is compiled in every process, not kept
