"""Every CUDA kernel begins with `await_grid()`, but the decode products, which load only weights before it.

A captured decode graph launches each kernel before the one it depends on has finished (programmatic edges,
`backends.cuda.overlap_kernel_launches`). That is safe only for a kernel that reads and writes nothing another
kernel writes before its `await_grid()`: a kernel added without it would race with the kernel before it, on the
GPU alone and not every time. The matvec bodies issue their first weight loads (constant data) before it, on
purpose. This reads the sources, so it runs everywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lucekv.kernels.cuda as cuda_kernels

JIT_WRAPPERS = {"jit_kernel", "jit_bounded", "_bounded"}  # functions that compile their first argument as a kernel
# the decode products load their first weights before the wait: the matvec kernels and MoE's routed products hand
# their block to a body (`_make_run_body`, `_make_q8_body`: a `stream`), which waits itself; MoE's router and mmq's
# product kernel wait after their first weights (their names: `kernel`)
PRODUCT_KERNELS = {"matvec.py:kernel", "mmq.py:kernel", "moe.py:kernel"}
PRODUCT_FILES = ("matvec.py", "mmq.py", "moe.py")
# what a decode product may do before the wait: allocate, load weights (the step's words, a router row, an
# expert's rows; mmq's copies of its first step's codes into shared memory, `stage_w`), clear its shared partials
# (and the barrier after that clearing: block-local, no global memory)
BEFORE_THE_WAIT = {"array", "_begin", "_clear_partials", "float32", "range", "min", "load_group", "_q8_load",
                   "load_step", "load_row", "expert_rows", "resident_rows", "syncthreads", "stage_w"}


def _is_cuda_jit(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "jit" and getattr(node.value, "id", None) == "cuda"


def _kernel_names(tree: ast.Module) -> set[str]:
    """Functions compiled as kernels: decorated with a bare `@cuda.jit` or `@_bounded`, or passed to
    `cuda.jit(f)`, `jit_bounded(f, ...)` or `_bounded(f)` (device functions are `@cuda.jit(device=True)`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                if _is_cuda_jit(d) or (isinstance(d, ast.Name) and d.id in JIT_WRAPPERS):
                    names.add(node.name)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Name):
            f = node.func
            if (_is_cuda_jit(f) and not node.keywords) or (isinstance(f, ast.Name) and f.id in JIT_WRAPPERS):
                names.add(node.args[0].id)
    return names


def _first_call(fn: ast.FunctionDef) -> str | None:
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Call) and isinstance(first.value.func, ast.Name):
        return first.value.func.id
    return None


def test_every_kernel_begins_with_await_grid():
    found, late = [], []
    for path in sorted(Path(cuda_kernels.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = _kernel_names(tree)
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in names):
            found.append(f"{path.name}:{fn.name}")
            if _first_call(fn) != "await_grid" and f"{path.name}:{fn.name}" not in PRODUCT_KERNELS:
                late.append(f"{path.name}:{fn.name} (line {fn.lineno})")
    # the kernels of norm, act, embed, matvec, matmul, attention, kv_copy and sample: the search finds them all
    assert len(found) >= 17, found
    assert not late, f"kernels that do not begin with await_grid(): {late}"


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "?"


def _own_calls(fn: ast.FunctionDef) -> list[ast.Call]:
    """The calls of fn's statements (not its decorators, nor the functions defined inside it), in order."""
    calls, todo = [], [s for s in fn.body if not isinstance(s, ast.FunctionDef)]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Call):
            calls.append(node)
        todo.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.FunctionDef))
    return sorted(calls, key=lambda n: (n.lineno, n.col_offset))


def test_the_decode_products_load_only_weights_before_await_grid():
    waiting = 0
    for name in PRODUCT_FILES:
        tree = ast.parse((Path(cuda_kernels.__file__).parent / name).read_text())
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            names = [_call_name(c) for c in _own_calls(fn)]
            if "await_grid" not in names:
                continue
            waiting += 1
            assert names.count("await_grid") == 1, f"{name} line {fn.lineno}"
            before = set(names[: names.index("await_grid")])
            assert before <= BEFORE_THE_WAIT, f"{name} line {fn.lineno}: {sorted(before - BEFORE_THE_WAIT)} first"
    # matvec's q4/q6 and q8 streams and its several-token body, mmq's kernel, MoE's router and prefill kernels
    assert waiting >= 10, waiting
