"""Per-kernel GPU time of one CUDA decode step or verify forward, measured inside the captured graph (no launch
overhead), or of one prefill forward (`--prefill`, inside its captured graph too).

    python -m lucekv.bench.kernel_profile MODEL.gguf [--pool 131072] [--prompt 512] [--replays 20] [--prefill]
                                         [--verify N[,N..]] [--json OUT]

After a prompt of `--prompt` tokens the one-token step is captured twice: as DecodeGraph captures it, and
once more with a CUDA event recorded before every kernel launch and after the last (event nodes between
the kernel nodes). Replaying the second gives each kernel's time at its place in the step (its run plus
the gap to the next node); replaying the first gives the step's real time, so the table shows what the
event nodes add. `--verify N` does the same for a speculative round's verify forward of N tokens (the graph of its
bucket, RowsGraph: all rows' logits and argmax); several widths (`--verify 1,2,4,8,17,32`, 1: the decode step) are
profiled one after another on the same loaded model, and the JSON holds one result per width. `--prefill` times the
`--prompt`-token forward instead, the same way (its prompt piece's graph, and that forward captured with event
nodes). Launches are labelled with the CudaOps op that made them (linears with their
matrix shape and kind, and GB/s of the weight bytes they read) and grouped by (op, kernel).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections import defaultdict
from pathlib import Path

import numpy as np

from lucekv.backends.cuda import (
    CudaBackend,
    CudaOps,
    DecodeGraph,
    ForwardGraph,
    RowsGraph,
    _check,
    prefill_bucket,
    verify_bucket,
)
from lucekv.bench.matvec_speed import device_name
from lucekv.kernels.cuda import cuda, sample
from lucekv.kernels.cuda.packed import DeviceMatrix
from lucekv.kvflash.pager import CHUNK_TOKENS
from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import open_gguf

# CudaOps methods whose launches are labelled, and their labels (_products: the products of linear / project)
OPS = {"embed": "embed", "_products": "linear", "rmsnorm": "rmsnorm", "attention": "attention", "add": "add",
       "moe_ffn": "moe"}  # moe: the router, the chosen experts' products and the weighted sum (kernels tell them apart)


class LaunchRecorder:
    """While `active`, records an event node into the stream capture on `stream` before every kernel launch, labelled
    by op and kernel."""

    def __init__(self, stream):
        self.stream = stream
        self.active = False
        self.op = "step"
        self.op_bytes = 0
        self.marks: list[tuple[str, str, int]] = []  # (op, kernel, weight bytes) per launch
        self.events: list = []

    def mark(self, op: str, kernel: str, nbytes: int) -> None:
        from cuda.bindings import driver

        ev = cuda.event(timing=True)
        # external: an event record node (a plain record would only order the capture)
        _check(driver.cuEventRecordWithFlags(driver.CUevent(int(ev.handle)), driver.CUstream(int(self.stream.handle)),
                                             driver.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL))
        self.events.append(ev)
        self.marks.append((op, kernel, nbytes))

    @contextlib.contextmanager
    def patched(self):
        """Hook numba's launches and CudaOps' ops for as long as the context lasts."""
        from numba.cuda.dispatcher import _LaunchConfiguration

        launch = _LaunchConfiguration.__call__
        originals = {name: getattr(CudaOps, name) for name in OPS}
        recorder = self

        def timed_launch(config, *args):
            if recorder.active:
                recorder.mark(recorder.op, config.dispatcher.py_func.__name__, recorder.op_bytes)
                recorder.op_bytes = 0  # an op's weight bytes count once, at its first kernel
            return launch(config, *args)

        def labelled(name, fn):
            def op(self, *args, **kwargs):
                ws = [w for w, _ in args[0]] if name == "linear" else []  # (matrix, destination) pairs
                outer = recorder.op  # an op inside another (attention's q/k/v product) labels its own launches
                recorder.op = " + ".join(f"{name} {w.rows}x{w.cols} {w.kind}" for w in ws) or name
                recorder.op_bytes = sum(_weight_bytes(w) for w in ws)
                try:
                    return fn(self, *args, **kwargs)
                finally:
                    recorder.op = outer
            return op

        _LaunchConfiguration.__call__ = timed_launch
        for name, fn in originals.items():
            setattr(CudaOps, name, labelled(OPS[name], fn))
        try:
            yield self
        finally:
            _LaunchConfiguration.__call__ = launch
            for name, fn in originals.items():
                setattr(CudaOps, name, fn)


def _weight_bytes(w: DeviceMatrix) -> int:
    """What a matvec over `w` must read."""
    return w.nbytes


def replay_ms(graph, stream, replays: int) -> float:
    """Median GPU ms of one replay."""
    times = []
    for _ in range(replays):
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        graph.launch()
        end.record(stream)
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    return statistics.median(times)


def profile(path: str, pool: int, n_prompt: int, replays: int, verify: int = 1) -> dict:
    """The decode step's kernels, or with verify > 1 those of a verify forward of that many tokens."""
    return profile_widths(path, pool, n_prompt, replays, [verify])[0]


def profile_widths(path: str, pool: int, n_prompt: int, replays: int, widths: list[int]) -> list[dict]:
    """`profile` of each width after one prompt, on one loaded model."""
    g = open_gguf(path)
    spec = ModelSpec.from_gguf(g)
    b = CudaBackend(g, spec, "f16", pool)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, spec.vocab_size, n_prompt).astype(np.int32)
    pos = np.arange(n_prompt, dtype=np.int32)
    logits = b.forward(prompt, pos, pos)
    return [_profile_width(path, b, spec, rng, logits, pool, n_prompt, replays, w) for w in widths]


def _profile_width(path: str, b: CudaBackend, spec: ModelSpec, rng, logits, pool: int, n_prompt: int, replays: int,
                   verify: int) -> dict:
    if verify == 1:
        for i in range(2):  # the first step runs eagerly and captures b.graph, the second replays it
            p = np.array([n_prompt + i], np.int32)
            logits = b.forward(np.array([np.argmax(logits[-1])], np.int32), p, p)
        graph, timed = b.graph, DecodeGraph(b)
        inputs, tables = (np.array([1], np.int32), *[np.array([n_prompt + 2], np.int32)] * 2), None
    else:  # a verify block after the prompt: its bucket's graph (captured at its first use) replayed
        p = np.arange(n_prompt, n_prompt + verify, dtype=np.int32)
        block = rng.integers(3, spec.vocab_size, verify).astype(np.int32)
        tables = [np.arange(-(-(n_prompt + verify) // CHUNK_TOKENS), dtype=np.int32)]  # slot = position
        for _ in range(2):
            b.forward_argmax(block, p, p, tables=tables)
        graph = b.verify_graphs[verify_bucket(verify)]
        timed = RowsGraph(b, graph.n_tokens)
        inputs = b._padded(graph.n_tokens, block, p, p, first=True)
    b.stream.synchronize()
    step_ms = replay_ms(graph, b.stream, replays)

    recorder = LaunchRecorder(b.stream)
    real_argmax = sample.argmax

    def argmax_with_end_mark(*args, **kwargs):  # the step's last launch
        real_argmax(*args, **kwargs)
        recorder.mark("end", "", 0)

    with recorder.patched():
        sample.argmax = argmax_with_end_mark
        recorder.active = True
        try:
            timed.capture(*inputs)
        finally:
            recorder.active = False
            sample.argmax = real_argmax
    rows, timed_ms = _replay_marked(b, timed, recorder, inputs, tables, replays)
    return {"bench": "kernel_profile", "device": device_name(cuda.get_current_device()), "model": Path(path).name,
            "pool": pool, "prompt_tokens": n_prompt, "tokens": verify, "graph_width": graph.n_tokens,
            "replays": replays, "kernels_per_step": len(recorder.marks) - 1, "graph_step_ms": step_ms,
            "timed_step_ms": timed_ms,
            "sum_of_kernels_ms": sum(r["total_us"] for r in rows) / 1000, "kernels": rows}


def _replay_marked(b: CudaBackend, timed, recorder: LaunchRecorder, inputs: tuple, tables, replays: int
                   ) -> tuple[list[dict], float]:
    """Replays of `timed` (captured with the recorder's event nodes, the last after its last kernel) on `inputs`:
    (kernel_rows of the launches, the median ms from the first event to the last)."""
    tokens, positions, slots = inputs
    b.pool.assign(slots, positions)
    b.ops.begin_step(tokens, positions, slots, tables=tables)
    per_launch: list[list[float]] = [[] for _ in recorder.marks[:-1]]
    timed_ms = []
    for _ in range(replays):
        timed.launch()
        b.stream.synchronize()
        ev = recorder.events
        for i in range(len(per_launch)):
            per_launch[i].append(cuda.event_elapsed_time(ev[i], ev[i + 1]) * 1000)
        timed_ms.append(cuda.event_elapsed_time(ev[0], ev[-1]))
    return kernel_rows(recorder.marks[:-1], per_launch), statistics.median(timed_ms)


class _EndMarkedForward(ForwardGraph):
    """A prompt piece's graph whose capture ends with an event node after its last kernel."""

    def __init__(self, backend: CudaBackend, n_tokens: int, recorder: LaunchRecorder):
        super().__init__(backend, n_tokens)
        self.recorder = recorder

    def _record_after(self) -> None:
        self.recorder.mark("end", "", 0)


def profile_prefill(path: str, pool: int, n_prompt: int, replays: int) -> dict:
    """Per-kernel time of one `n_prompt`-token forward (last logits) inside its captured graph, as `profile` times
    the decode step: the prefill graph replayed as the engine replays it, then the same forward captured once more
    with an event node before every kernel. (An eager forward with events said little: at the 30B-A3B shape its ~700
    launches made it host-bound, ~410 us a launch.)"""
    g = open_gguf(path)
    spec = ModelSpec.from_gguf(g)
    b = CudaBackend(g, spec, "f16", pool)
    prompt = np.random.default_rng(0).integers(3, spec.vocab_size, n_prompt).astype(np.int32)
    pos = np.arange(n_prompt, dtype=np.int32)
    for _ in range(2):  # the first runs eagerly and captures the piece's graph, the second replays it
        b.forward(prompt, pos, pos)
    graph = b.prefill_graphs[prefill_bucket(n_prompt, b.prefill_chunk)]
    b.stream.synchronize()
    forward_ms = replay_ms(graph, b.stream, replays)
    recorder = LaunchRecorder(b.stream)
    timed = _EndMarkedForward(b, graph.n_tokens, recorder)
    inputs = b._padded(graph.n_tokens, prompt, pos, pos, first=True)
    with recorder.patched():
        recorder.active = True
        try:
            timed.capture(*inputs)
        finally:
            recorder.active = False
    rows, timed_ms = _replay_marked(b, timed, recorder, inputs, None, replays)
    return {"bench": "kernel_profile_prefill", "device": device_name(cuda.get_current_device()),
            "model": Path(path).name, "pool": pool, "prompt_tokens": n_prompt, "graph_width": graph.n_tokens,
            "replays": replays, "kernels_per_forward": len(recorder.marks) - 1, "forward_ms": forward_ms,
            "tok_s": n_prompt / forward_ms * 1000, "timed_forward_ms": timed_ms,
            "sum_of_kernels_ms": sum(r["total_us"] for r in rows) / 1000, "kernels": rows}


def kernel_rows(marks: list[tuple[str, str, int]], per_launch: list[list[float]]) -> list[dict]:
    """Launch times (median over runs, us) grouped by (op, kernel), the most time first."""
    groups: dict[tuple[str, str], dict] = defaultdict(lambda: {"count": 0, "us": 0.0, "bytes": 0})
    for (op, kernel, nbytes), times in zip(marks, per_launch, strict=True):
        row = groups[(op, kernel)]
        row["count"] += 1
        row["us"] += statistics.median(times)
        row["bytes"] += nbytes
    return [{"op": op, "kernel": kernel, "count": row["count"], "total_us": row["us"],
             "us_each": row["us"] / row["count"],
             "gbps": row["bytes"] / (row["us"] * 1e3) if row["bytes"] else None}
            for (op, kernel), row in sorted(groups.items(), key=lambda kv: -kv[1]["us"])]


def print_table(r: dict) -> None:
    if r["bench"] == "kernel_profile":
        what = "graph step" if r["tokens"] == 1 else f"verify forward of {r['tokens']} (graph of {r['graph_width']})"
        print(f"{r['device']}, {r['model']}, pool {r['pool']}, after {r['prompt_tokens']} tokens: "
              f"{what} {r['graph_step_ms']:.3f} ms; with event nodes {r['timed_step_ms']:.3f} ms, "
              f"{r['kernels_per_step']} kernels")
    else:
        print(f"{r['device']}, {r['model']}, pool {r['pool']}, {r['prompt_tokens']}-token forward: graph "
              f"{r['forward_ms']:.2f} ms ({r['tok_s']:.0f} tok/s); with event nodes {r['timed_forward_ms']:.2f} ms, "
              f"{r['kernels_per_forward']} kernels")
    print(f"{'op':34s} {'kernel':22s} {'n':>4s} {'us each':>9s} {'total us':>9s} {'share':>6s} {'GB/s':>6s}")
    total = sum(x["total_us"] for x in r["kernels"])
    for x in r["kernels"]:
        gbps = f"{x['gbps']:6.0f}" if x["gbps"] else ""
        print(f"{x['op']:34s} {x['kernel']:22s} {x['count']:4d} {x['us_each']:9.2f} {x['total_us']:9.1f} "
              f"{x['total_us'] / total:6.1%} {gbps}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--pool", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--prefill", action="store_true", help="time the prompt's forward instead of a decode step")
    ap.add_argument("--verify", default="1", help="time a verify forward of this many tokens instead, or of each of "
                    "several widths (e.g. 1,2,4,8,17,32; 1: the decode step)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.prefill:
        results = [profile_prefill(a.model, a.pool, a.prompt, a.replays)]
    else:
        results = profile_widths(a.model, a.pool, a.prompt, a.replays, [int(w) for w in a.verify.split(",")])
    for r in results:
        print_table(r)
    if len(results) > 1:
        print("ms by width: " + ", ".join(f"{r['tokens']}: {r['graph_step_ms']:.3f}" for r in results))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(results[0] if len(results) == 1 else results, indent=2) + "\n")


if __name__ == "__main__":
    main()
