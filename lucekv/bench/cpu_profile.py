"""Where a CPU decode step's time goes: per op, numba kernels against the Python between them, and the bytes the
step reads against this machine's measured memory bandwidth.

    python -m lucekv.bench.cpu_profile --model smollm2-135m [--tokens 32] [--context 128] [--json OUT]
    python -m lucekv.bench.cpu_profile --model qwen2.5-coder-0.5b --prefill 128 [--json OUT]

With --prefill N: where a prompt of N tokens (one forward: a dense model's decode step, else op by op) goes
instead, per op and kernel.

Inside the step (`phases`): each thread's time per op of the step (from the end of one phase to the end of its
share of the next: busy) and at the op's end waiting for the others (wait), from the CPU's cycle counter at each
phase's end (DecodeStep.trace); medians over the steps of each phase, summed over the layers; host_ms: a step's
wall time outside the kernel's span (Python and numpy before and after, handing the step to the threads).

Every numba kernel the backend calls (a `Dispatcher` in lucekv.kernels.cpu.* or lucekv.backends.cpu) and every
method of the backend's ops is wrapped in a timer; a step's time not spent inside any kernel is host overhead
(Python, numpy temporaries, allocation). Wall time and this process's CPU time are both kept: on a loaded machine
CPU time is the steadier figure (it excludes time waiting for a core). The timers add a few microseconds per call:
`step_ms_untimed` is the same steps without them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import numba
import numpy as np
from numba import njit, prange
from numba.core.registry import CPUDispatcher

from lucekv.bench.decode import git_commit, machine, report
from lucekv.kernels.cpu.step import KIND_F32, OP_NAMES, step_phases
from lucekv.kernels.cpu.sync import cycles

KERNEL_MODULES = ("lucekv.kernels.cpu.matvec", "lucekv.kernels.cpu.attention", "lucekv.kernels.cpu.quants",
                  "lucekv.kernels.cpu.step",
                  "lucekv.backends.cpu")
BANDWIDTH_BYTES = 1 << 30  # larger than any cache a decode step could live in


class Timers:
    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - w
                self.cpu[name] += time.process_time() - c
                self.calls[name] += 1
        return timed


@contextmanager
def instrumented(ops, timers: Timers):
    """Timers around every numba kernel of the CPU modules and every public method of `ops`, undone after."""
    patched = []
    for mod_name in KERNEL_MODULES:
        mod = importlib.import_module(mod_name)
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, CPUDispatcher):
                patched.append((mod, name, obj))
                setattr(mod, name, timers.wrap(f"kernel:{mod_name.rsplit('.', 1)[1]}.{name}", obj))
    for name in dir(type(ops)):
        if not name.startswith("__") and callable(getattr(ops, name)):
            patched.append((ops, name, None))
            setattr(ops, name, timers.wrap(f"op:{name}", getattr(ops, name)))
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def decode_bytes(backend) -> dict[str, int]:
    """Bytes of weights a decode step reads, by matrix name: codes, per-block scales and (where a matrix has them)
    biases, as the decode step's arena holds them (`lucekv.backends.cpu_step.Arenas`)."""
    arenas = backend.decode_step.arenas
    out: dict[str, int] = defaultdict(int)
    named = [(name, m) for lw in backend.weights.layers for name, v in vars(lw).items() for m in _matrices(v)]
    for name, m in [*named, ("output", backend.weights.output)]:
        kind, rows, _, _, _, bias_at, code_cols, blocks, halves = arenas.table[arenas.matrix(m)]
        per_code = 4 if kind == KIND_F32 else 1
        per_factor = 2 if halves else 4
        out[name] += int(rows * code_cols * per_code + rows * blocks * per_factor * (1 + (bias_at >= 0)))
    return dict(out)


def _matrices(obj):
    if isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _matrices(o)
    elif hasattr(obj, "codes"):
        yield obj


@njit(parallel=True, cache=True)
def _stream_sum(a, n_threads):
    part = np.zeros(n_threads, np.int64)
    step = a.shape[0] // n_threads
    for t in prange(n_threads):
        s = np.uint64(0)
        flat = a[t * step:(t + 1) * step]
        for i in range(flat.shape[0]):
            s += flat[i]
        part[t] = s
    return part.sum()


def memory_bandwidth(repeats: int = 5) -> dict[str, float]:
    """Best-of-`repeats` GB/s reading BANDWIDTH_BYTES (as uint64 words) with 1 and with every numba thread."""
    a = np.ones(BANDWIDTH_BYTES // 8, np.uint64)
    out = {}
    for n in sorted({1, numba.get_num_threads()}):
        _stream_sum(a[:1024], n)
        best = min(_timed(lambda n=n: _stream_sum(a, n)) for _ in range(repeats))
        out[f"read_gb_s_{n}_threads"] = a.nbytes / best / 1e9
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@njit
def _cycles_now() -> int:
    return cycles()


def phase_profile(backend, step, tokens: int, first: int) -> dict:
    """`tokens` steps (step(n, position)) traced by the decode step's phases (see the module's docstring)."""
    n = numba.get_num_threads()
    traces, walls = [], []
    c0, w0 = _cycles_now(), time.perf_counter()
    for p in range(first, first + tokens):
        backend.decode_step.trace = np.zeros((n, step_phases(backend.spec.n_layer) + 1, 3), np.int64)
        t = time.perf_counter()
        step(p)
        walls.append(time.perf_counter() - t)
        traces.append(backend.decode_step.trace)
    backend.decode_step.trace = None
    hz = (_cycles_now() - c0) / (time.perf_counter() - w0)
    tr = np.stack(traces)  # [steps, threads, phases + 1, 3]
    begin, end = tr[:, :, -1, 0], tr[:, :, -1, 1]
    arrive, leave, used = tr[:, :, :-1, 0], tr[:, :, :-1, 1], tr[0, 0, :-1, 0] > 0
    before = np.concatenate([begin[:, :, None], leave[:, :, :-1]], axis=2)  # when each phase began, thread by thread
    busy = np.median(arrive - before, axis=0)[:, used] * 1e3 / hz  # [threads, phases]
    wait = np.median(leave - arrive, axis=0)[:, used] * 1e3 / hz
    ops = tr[0, 0, :-1, 2][used]
    spans = (end.max(axis=1) - begin.min(axis=1)) * 1e3 / hz
    return {
        "threads": n, "cycles_per_s": hz,
        "phases": {OP_NAMES[op]: {"busy_ms": busy[:, ops == op].sum(axis=1).round(4).tolist(),
                                  "wait_ms": wait[:, ops == op].sum(axis=1).round(4).tolist(),
                                  "phases": int((ops == op).sum())} for op in sorted(set(ops.tolist()))},
        "busy_ms": busy.sum(axis=1).round(4).tolist(), "wait_ms": wait.sum(axis=1).round(4).tolist(),
        "late_start_ms": np.median(begin - begin.min(axis=1, keepdims=True), axis=0).round(4).tolist(),
        "span_ms": float(np.median(spans)), "host_ms": float(np.median(1e3 * np.array(walls) - spans)),
    }


def profile(model: str, tokens: int, context: int, kv_dtype: str) -> dict:
    import lucekv
    from lucekv.bench.decode import prompt_ids
    from lucekv.model.registry import resolve_model

    path = resolve_model(model)
    engine = lucekv.load(path, backend="cpu", kv_dtype=kv_dtype)
    backend = engine.backend
    ids = np.array(prompt_ids(engine.tokenizer.encode, context, 0), np.int32)
    backend.forward(ids, np.arange(len(ids), dtype=np.int32), np.arange(len(ids), dtype=np.int32))

    def steps(n: int, first: int) -> list[float]:
        times = []
        for p in range(first, first + n):
            one = np.array([p], np.int32)
            t = time.perf_counter()
            backend.forward(ids[p % len(ids):][:1], one, one)
            times.append(time.perf_counter() - t)
        return times

    steps(4, len(ids))  # warm-up: numba's dispatch and caches
    c0 = time.process_time()
    untimed = steps(tokens, len(ids) + 4)
    untimed_cpu = time.process_time() - c0
    timers = Timers()
    with instrumented(backend.ops, timers):
        c0 = time.process_time()
        timed = steps(tokens, len(ids) + 4)  # same positions again: the same work
        timed_cpu = time.process_time() - c0
    inside = phase_profile(backend, lambda p: steps(1, p), tokens, len(ids) + 4)
    per_tok = {k: 1e3 * v / tokens for k, v in timers.wall.items()}
    kernels_ms = sum(v for k, v in per_tok.items() if k.startswith("kernel:"))
    step_ms = 1e3 * float(np.median(timed))
    read = decode_bytes(backend)
    total_bytes = sum(read.values())
    bw = memory_bandwidth()
    untimed_ms = 1e3 * float(np.median(untimed))
    return {
        "bench": "cpu_profile", "commit": git_commit(), "machine": machine(), "load_avg": os.getloadavg(),
        "numba_threads": numba.get_num_threads(), "model": path.name, "kv_dtype": kv_dtype,
        "context": context, "tokens": tokens,
        "step_ms_untimed": untimed_ms, "step_cpu_ms_untimed": 1e3 * untimed_cpu / tokens,
        "step_ms_timed": step_ms, "step_cpu_ms_timed": 1e3 * timed_cpu / tokens,
        "kernels_ms": kernels_ms, "outside_kernels_ms": step_ms - kernels_ms,
        "per_token_ms": dict(sorted(per_tok.items(), key=lambda kv: -kv[1])),
        "per_token_cpu_ms": {k: 1e3 * v / tokens for k, v in timers.cpu.items()},
        "calls_per_token": {k: v / tokens for k, v in timers.calls.items()},
        "weight_bytes_per_step": read, "weight_mb_per_step": total_bytes / 1e6,
        "achieved_gb_s": total_bytes / untimed_ms / 1e6, "memory_bandwidth": bw, "inside_step": inside,
    }


def profile_prefill(model: str, tokens: int, kv_dtype: str, repeats: int = 3) -> dict:
    """A prompt of `tokens` tokens through the backend (what the engine's prefill runs): the best of
    `repeats` untimed forwards, then one timed per op and kernel (the same work: the same slots again)."""
    import lucekv
    from lucekv.bench.decode import prompt_ids
    from lucekv.model.registry import resolve_model

    path = resolve_model(model)
    engine = lucekv.load(path, backend="cpu", kv_dtype=kv_dtype)
    backend = engine.backend
    ids = np.array(prompt_ids(engine.tokenizer.encode, tokens, 0), np.int32)
    at = np.arange(len(ids), dtype=np.int32)
    backend.forward(ids, at, at)  # warm-up: numba's dispatch and caches
    untimed = []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        backend.forward(ids, at, at)
        untimed.append((time.perf_counter() - w, time.process_time() - c))
    timers = Timers()
    with instrumented(backend.ops, timers):
        w = time.perf_counter()
        backend.forward(ids, at, at)
        timed_ms = 1e3 * (time.perf_counter() - w)
    wall, cpu = min(untimed)
    return {
        "bench": "cpu_profile_prefill", "commit": git_commit(), "machine": machine(), "load_avg": os.getloadavg(),
        "numba_threads": numba.get_num_threads(), "model": path.name, "kv_dtype": kv_dtype, "tokens": len(ids),
        "prefill_ms_untimed": 1e3 * wall, "prefill_cpu_ms_untimed": 1e3 * cpu, "tok_s": len(ids) / wall,
        "prefill_ms_timed": timed_ms,
        "ms": {k: 1e3 * v for k, v in sorted(timers.wall.items(), key=lambda kv: -kv[1])},
        "cpu_ms": {k: 1e3 * v for k, v in sorted(timers.cpu.items(), key=lambda kv: -kv[1])},
        "calls": dict(timers.calls),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--kv-dtype", default="f16")
    ap.add_argument("--prefill", type=int, metavar="N", help="profile a prompt of N tokens instead")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.prefill:
        result = profile_prefill(args.model, args.prefill, args.kv_dtype)
        report(result, args.json)
        print(f"prefill {result['prefill_ms_untimed']:.0f} ms ({result['prefill_cpu_ms_untimed']:.0f} CPU ms, "
              f"{result['tok_s']:.1f} tok/s)", file=sys.stderr)
        return 0
    result = profile(args.model, args.tokens, args.context, args.kv_dtype)
    report(result, args.json)
    print(f"step {result['step_ms_untimed']:.2f} ms ({result['step_cpu_ms_untimed']:.2f} CPU ms), kernels "
          f"{result['kernels_ms']:.2f} ms, outside {result['outside_kernels_ms']:.2f} ms; "
          f"{result['weight_mb_per_step']:.1f} MB read at {result['achieved_gb_s']:.1f} GB/s "
          f"(machine {result['memory_bandwidth']})", file=sys.stderr)
    inside = result["inside_step"]
    for op, t in inside["phases"].items():
        print(f"  {op:10s} busy {' '.join(f'{v:.3f}' for v in t['busy_ms'])} wait "
              f"{' '.join(f'{v:.3f}' for v in t['wait_ms'])} ms ({t['phases']} phases)", file=sys.stderr)
    print(f"  span {inside['span_ms']:.3f} ms, host {inside['host_ms']:.3f} ms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
