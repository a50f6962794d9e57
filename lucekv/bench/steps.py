"""`lucekv bench steps`: the engine's step in process (Engine.submit / step, no gRPC), where its host time goes.

- Time to first token of one prompt alone, at each of `--ttft-tokens` (its first run apart: a width whose prefill
  graph is captured at first use pays the capture there).
- At each of `--concurrency`, C requests of a `--prompt-tokens` prompt decode `--gen-tokens` tokens together: the
  time of each step where all C decode (after a warm-up round that captures the batch's graph), and per step the
  time inside the backend's calls (decode_rows, CudaOps.begin_step, RowsGraph.replay_rows, the slot map's
  assign...; nested: decode_rows holds the others).
- `--gil-probe` (CUDA): whether the engine thread lets go of the GIL while it waits for the device. A second thread
  counts in a loop; the main thread keeps the device busy (a sleeping kernel, ~50 ms) and waits for it through each
  of the waits the backend uses. The count the other thread made during a wait, over what it makes in that time
  with the GIL free, is the share of the wait it could run: ~1 lets go, ~0 holds it (a server's gRPC thread then
  stalls for the wait).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import lucekv
from lucekv.bench.decode import file_sha256, git_commit, machine, prompt_ids, report
from lucekv.engine.sampling import SamplingParams
from lucekv.server.app import SWITCH_INTERVAL_S


class CallTimes:
    """Time spent inside callables (an object's attribute: a bound method on an instance, or a function on a class),
    by name, while installed (`with`): each is wrapped, and put back at the end."""

    def __init__(self, targets: dict[str, tuple[object, str]]):
        self.targets = {key: (obj, attr) for key, (obj, attr) in targets.items() if hasattr(obj, attr)}
        self.seconds = dict.fromkeys(self.targets, 0.0)
        self.calls = dict.fromkeys(self.targets, 0)
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> CallTimes:
        for key, (obj, attr) in self.targets.items():
            self._saved.append((obj, attr, obj.__dict__.get(attr)))  # None: the attribute came from the class
            setattr(obj, attr, self._timed(key, getattr(obj, attr)))
        return self

    def __exit__(self, *exc) -> None:
        for obj, attr, own in reversed(self._saved):
            if own is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, own)

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        return dict(self.seconds), dict(self.calls)

    def _timed(self, key: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - t
                self.calls[key] += 1

        return timed


def call_targets(engine) -> dict[str, tuple[object, str]]:
    """The backend's calls a step makes, by name (those the backend has)."""
    backend = engine.backend
    targets = {"decode_rows": (backend, "decode_rows"), "forward": (backend, "forward"),
               "decode_ahead": (backend, "decode_ahead"), "next_token": (backend, "next_token"),
               "pool.assign": (backend.pool, "assign")}
    if hasattr(backend, "ops"):
        targets["ops.begin_step"] = (backend.ops, "begin_step")
        targets["ops.set_tables"] = (backend.ops, "set_tables")
    if backend.name == "cuda":
        from lucekv.backends.cuda import RowsGraph

        targets["RowsGraph.replay_rows"] = (RowsGraph, "replay_rows")
    return targets


def run_until_done(engine, requests) -> None:
    while not all(r.done for r in requests):
        engine.step()


def time_to_first_token(engine, tokens: int, repeats: int, first_run: int) -> dict:
    """One prompt of `tokens` tokens alone, max_tokens 1: its first run (a capture where its width's graph is new)
    and the median of `repeats` more; each prompt new (no cached K/V)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for run in range(first_run, first_run + repeats + 1):
        ids = prompt_ids(engine.tokenizer.encode, tokens, run)
        t = time.perf_counter()
        r = engine.submit(ids, params)
        run_until_done(engine, [r])
        times.append(time.perf_counter() - t)
        if r.cached:
            raise RuntimeError("a time-to-first-token run reused cached K/V")
    return {"prompt_tokens": tokens, "first_run_ms": times[0] * 1e3,
            "median_ms": statistics.median(times[1:]) * 1e3, "runs_ms": [t * 1e3 for t in times[1:]]}


def steps_at(engine, concurrency: int, prompt_tokens: int, gen_tokens: int, first_run: int,
             contend: bool = False) -> dict:
    """C requests decoding together: the steps where all C decode, and the backend's calls in them, per step; with
    `contend`, beside a thread running Python all along (as a server's gRPC thread may: `busy_thread`), at the GIL
    switch interval `lucekv serve` sets."""
    tokenize = engine.tokenizer.encode

    def batch(run0: int, max_tokens: int) -> list:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [engine.submit(prompt_ids(tokenize, prompt_tokens, run0 + i), params) for i in range(concurrency)]

    run_until_done(engine, batch(first_run, 8))  # warm-up: the batch bucket's graph captured
    requests = batch(first_run + concurrency, gen_tokens)
    step_s: list[float] = []
    timer = CallTimes(call_targets(engine))
    inside, calls = dict.fromkeys(timer.seconds, 0.0), dict.fromkeys(timer.seconds, 0)
    interval = SWITCH_INTERVAL_S if contend else sys.getswitchinterval()
    with timer, busy_thread(contend), switch_interval(interval):
        while not all(r.done for r in requests):
            steady = all(r.n_out >= 1 and not r.done for r in requests)
            before = timer.snapshot()
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            if steady:
                step_s.append(dt)
                after = timer.snapshot()
                for key in inside:
                    inside[key] += after[0][key] - before[0][key]
                    calls[key] += after[1][key] - before[1][key]
    n = len(step_s)
    median = statistics.median(step_s)
    return {"concurrency": concurrency, "switch_interval_ms": interval * 1e3, "steps": n,
            "step_ms_median": median * 1e3,
            "step_ms_p90": sorted(step_s)[int(0.9 * (n - 1))] * 1e3, "step_ms_mean": sum(step_s) / n * 1e3,
            "tok_s_at_median": concurrency / median,
            "per_step_ms": {k: v / n * 1e3 for k, v in inside.items() if calls[k]},
            "calls_per_step": {k: v / n for k, v in calls.items() if v}}


@contextlib.contextmanager
def switch_interval(seconds: float):
    """sys.setswitchinterval(seconds) while the block runs."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@contextlib.contextmanager
def busy_thread(on: bool = True):
    """A second thread running Python (counting) while the block runs. Each time the engine thread lets go of the GIL
    (any driver call through cuda.bindings does, a wait or not) this thread may take it, and the engine thread gets it
    back only when this one is made to drop it: after the switch interval (sys.getswitchinterval(), 5 ms by
    default; `steps_at` sets serve's). A step's time beside it, against alone, is what those hand-offs cost."""
    count = [0]  # what it has counted: yielded
    if not on:
        yield count
        return
    stop = threading.Event()

    def counter() -> None:
        while not stop.is_set():
            count[0] += 1

    thread = threading.Thread(target=counter, daemon=True)
    thread.start()
    try:
        yield count
    finally:
        stop.set()
        thread.join()


def gil_probe(engine, busy_ms: float = 50.0) -> dict:
    """Whether each of the backend's device waits lets go of the GIL: see the module's docstring."""
    import numpy as np

    from lucekv.backends.cuda import synchronize
    from lucekv.kernels.cuda import cuda
    from lucekv.kernels.cuda._numba import ordering_event

    @cuda.jit
    def sleep_kernel(microseconds):
        for _ in range(microseconds):
            cuda.nanosleep(1000)

    stream = engine.backend.stream
    small = cuda.device_array(1024, np.float32, stream=stream)

    def event_wait() -> None:
        e = ordering_event()
        e.record(stream)
        e.synchronize()

    waits: dict[str, Callable[[], object]] = {
        "cuStreamSynchronize (backends.cuda.synchronize: replay, replay_rows)": lambda: synchronize(stream),
        "numba Stream.synchronize (eager forwards, paging)": stream.synchronize,
        "numba Event.synchronize (the run-ahead step's token)": event_wait,
        "numba copy_to_host to pageable memory (eager logits, last_queries)": lambda: small.copy_to_host(stream=stream),
    }
    sleep_kernel[1, 1, stream](10)  # compiled before any timing
    synchronize(stream)
    with switch_interval(1e-4), busy_thread() as count:  # the counter takes a free GIL at once
        c0, t0 = count[0], time.perf_counter()
        time.sleep(busy_ms / 1e3)  # the GIL free: the counter's full rate
        rate = (count[0] - c0) / (time.perf_counter() - t0)
        result: dict = {"counter_per_s_gil_free": rate, "busy_ms": busy_ms, "waits": {}}
        for name, wait in waits.items():
            sleep_kernel[1, 1, stream](int(busy_ms * 1e3))
            c0, t0 = count[0], time.perf_counter()
            wait()
            seconds = time.perf_counter() - t0
            ran = (count[0] - c0) / (rate * seconds)
            result["waits"][name] = {"wait_ms": seconds * 1e3, "counter_share": ran,
                                     "lets_go_of_gil": bool(ran > 0.5)}
    return result


def run(model: str, concurrency: list[int], prompt_tokens: int, gen_tokens: int, ttft_tokens: list[int],
        repeats: int, engine_options: dict, probe: bool, contend: bool = False) -> dict:
    from lucekv.model.registry import resolve_model

    path = resolve_model(model)
    t = time.perf_counter()
    engine = lucekv.load(path, **engine_options)
    load_s = time.perf_counter() - t
    backend = engine.backend
    result: dict = {
        "bench": "steps", "commit": git_commit(), "machine": machine(),
        "model": {"name": engine.info.model_name, "file": path.name, "sha256": file_sha256(path)},
        "backend": engine.info.backend, "engine_options": {k: str(v) for k, v in engine_options.items()},
        "command": "lucekv " + " ".join(Path(a).name if "/" in a else a for a in sys.argv[1:]),
        "engine_load_s": load_s,
        "prefill_graphs_at_start": sorted(w for w, g in (getattr(backend, "prefill_graphs", None) or {}).items()
                                          if g.ready),
    }
    if backend.name == "cuda":
        from lucekv.kernels.cuda import cuda

        name = cuda.get_current_device().name
        result["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
    run0 = 0
    result["time_to_first_token"] = []
    for n in ttft_tokens:
        result["time_to_first_token"].append(time_to_first_token(engine, n, repeats, run0))
        run0 += repeats + 1
        print(f"TTFT {n} tokens: {result['time_to_first_token'][-1]}", file=sys.stderr)
    result["steps"] = []
    for c in concurrency:
        for beside in (False, True) if contend else (False,):
            result["steps"].append({**steps_at(engine, c, prompt_tokens, gen_tokens, run0, beside),
                                    "beside_busy_thread": beside})
            run0 += 2 * c
            print(f"C={c}: {result['steps'][-1]}", file=sys.stderr)
    if backend.name == "cuda":  # what the graphs' widths keep on the device
        result["activation_pools_mib"] = {n: b / 2**20 for n, b in sorted(backend.ops.pool_bytes().items())}
    if probe:
        if backend.name != "cuda":
            raise SystemExit("--gil-probe needs the CUDA backend")
        result["gil_probe"] = gil_probe(engine)
    return result


def main(args) -> int:
    from lucekv.cli_server import engine_options

    concurrency = [int(c) for c in args.concurrency.split(",")]
    ttft = [int(n) for n in args.ttft_tokens.split(",")] if args.ttft_tokens else []
    options = engine_options(args)
    options["max_batch"] = max(options.get("max_batch") or 1, *concurrency)
    report(run(args.model, concurrency, args.prompt_tokens, args.gen_tokens, ttft, args.repeats, options,
               args.gil_probe, args.contend), args.json)
    return 0
