"""`python -m lucekv.bench.serve_host`: what the serving path (gRPC, the event loop, the engine thread, the GIL) adds
to a GPU's step time, measured without a GPU.

A server process (`lucekv.server.app.serve`, as `lucekv serve` runs it) holds an engine of a real model's tokenizer
and shape on a backend that computes nothing and waits like a GPU (`GpuTimedBackend`): each forward is queued on a
modelled device for the time `bench steps` measured in process on the H100 for the Qwen3-8B shape's step at its batch
bucket (`STEP_MS`), and the engine thread waits for it in `time.sleep`, which lets go of the GIL as the CUDA
backend's synchronize does; before it, QUICK_RELEASES calls that let go of the GIL and return at once (the uploads
and the graph launch: each a driver call that lets go of it). The run-ahead of one greedy stream is modelled too:
its next step is queued before the token of the one before is read.

C streams at a time send requests over gRPC (`bench serve`'s client: a thread per stream), at each of --concurrency,
each concurrency in a fresh server process. Per concurrency: output tok/s and time per output token (TPOT) p50 at
the client beside the device's step at that batch (TPOT's floor), and from the server process: the engine thread's
wait for the GIL per step (each wait's overrun past the device's end, and each quick call's time, less what they
take with nobody else running) and the CPU seconds per output token of the engine thread, the event loop's thread
(the main one) and the other threads (gRPC's), with the client process's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import resource
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from lucekv.bench.serve import BenchRequest, drive, figures, free_port, lucekv_sender, wait_serving
from lucekv.bench.spec_host import InstantBackend, instant_engine

# decode step ms by batch bucket: bench/results/h100-steps-qwen3-8b-shape-mmq64.json (62408c1, step_ms_median
# alone); 64 rows extrapolated from 16 and 32
STEP_MS = {1: 3.73, 2: 8.84, 4: 9.09, 8: 8.61, 16: 12.75, 32: 18.26, 64: 29.3}
PREFILL_MS_PER_TOKEN = 0.15  # a prompt piece: STEP_MS[1] + this per token (H100, 8B shape: ~36 ms at 177 tokens)
QUICK_RELEASES = 4  # driver calls before a step's wait (CudaBackend._decode_rows: slot map, inputs, launch, copy)
N_CTX = 1024
# GpuTimedBackend.stats: decode steps (rows or one run-ahead step), their rows, prompt pieces, seconds of device
# work queued and of waiting for it, the engine thread's wait for the GIL at the device calls and their number
COUNTS = ("steps", "rows", "pieces", "device_s", "asleep_s", "gil_wait_s", "releases")


@dataclass(frozen=True)
class DeviceTimes:
    """The modelled device's ms: a decode step's by batch bucket, a prompt piece's."""

    step_ms: dict[int, float] = field(default_factory=lambda: dict(STEP_MS))
    prefill_ms_per_token: float = PREFILL_MS_PER_TOKEN

    def decode_ms(self, rows: int) -> float:
        """A decode step of `rows` rows: its batch bucket's (the graph it replays, cuda.row_bucket); past the
        table's last bucket, in proportion."""
        bucket = 1 << (rows - 1).bit_length()
        last = max(self.step_ms)
        return self.step_ms.get(bucket) or self.step_ms[last] * bucket / last

    def piece_ms(self, tokens: int) -> float:
        return self.step_ms[1] + self.prefill_ms_per_token * tokens

    def flags(self) -> list[str]:
        return ["--step-ms", ",".join(f"{k}:{v}" for k, v in self.step_ms.items()),
                "--prefill-ms-per-token", str(self.prefill_ms_per_token)]

    @classmethod
    def parse(cls, step_ms: str | None, prefill_ms_per_token: float) -> DeviceTimes:
        table = dict(STEP_MS) if not step_ms else \
            {int(k): float(v) for k, v in (item.split(":") for item in step_ms.split(","))}
        return cls(table, prefill_ms_per_token)


class GpuTimedBackend(InstantBackend):
    """InstantBackend whose forwards take a GPU's time on a modelled device that runs its work in order."""

    def __init__(self, vocab_size: int, n_slots: int, device: DeviceTimes):
        super().__init__(vocab_size, n_slots)
        self.device = device
        self._busy_until = 0.0  # perf_counter when the device has run what is queued
        self._ahead_done: deque[float] = deque()  # when each run-ahead step is done
        self.quick_alone, self.sleep_alone = _calibrate()
        self.engine_thread = 0  # native id of the thread that calls the backend
        self.stats = dict.fromkeys(COUNTS, 0.0)

    def forward(self, tokens, positions, slots, all_logits=False, tables=None):
        done = self._launch(self.device.piece_ms(len(tokens)))
        out = super().forward(tokens, positions, slots, all_logits, tables)
        self._wait(done)
        return out

    def decode_rows(self, tokens, positions, slots, tables, sampled):
        done = self._launch(self.device.decode_ms(len(tokens)), len(tokens))
        out = super().decode_rows(tokens, positions, slots, tables, sampled)
        self._wait(done)
        return out

    def decode_ahead(self, position, slot, token=None, table=None):
        self._ahead_done.append(self._launch(self.device.decode_ms(1), 1))
        super().decode_ahead(position, slot, token, table)

    def next_token(self) -> int:
        self._wait(self._ahead_done.popleft())
        return super().next_token()

    def discard_ahead(self) -> None:
        self._ahead_done.clear()
        super().discard_ahead()

    def _launch(self, ms: float, rows: int = 0) -> float:
        """Queue `ms` of device work after what is queued (the uploads and the launch first): a decode step of `rows`
        rows, or with none a prompt piece; when it will be done."""
        self.engine_thread = threading.get_native_id()
        for _ in range(QUICK_RELEASES):
            self._release()
        self._busy_until = max(time.perf_counter(), self._busy_until) + ms / 1e3
        self.stats["steps" if rows else "pieces"] += 1
        self.stats["rows"] += rows
        self.stats["device_s"] += ms / 1e3
        return self._busy_until

    def _release(self) -> None:
        """A driver call that returns at once: the GIL let go and taken back."""
        t = time.perf_counter()
        select.select([], [], [], 0)
        self._count(time.perf_counter() - t - self.quick_alone)

    def _wait(self, until: float) -> None:
        """The synchronize: until the device is done, the GIL let go."""
        now = time.perf_counter()
        if until <= now:
            self._release()
            return
        time.sleep(until - now)
        self.stats["asleep_s"] += until - now
        self._count(time.perf_counter() - until - self.sleep_alone)

    def _count(self, late: float) -> None:
        self.stats["gil_wait_s"] += max(late, 0.0)
        self.stats["releases"] += 1


def _calibrate() -> tuple[float, float]:
    """Median seconds of a quick GIL-releasing call, and a 1 ms sleep's overrun, with no other thread running."""
    quick, late = [], []
    for _ in range(200):
        t = time.perf_counter()
        select.select([], [], [], 0)
        quick.append(time.perf_counter() - t)
    for _ in range(30):
        t = time.perf_counter()
        time.sleep(1e-3)
        late.append(time.perf_counter() - t - 1e-3)
    return statistics.median(quick), statistics.median(late)


def thread_cpu_s(engine_thread: int) -> dict[str, float]:
    """CPU seconds so far of this process's engine thread, main thread (the event loop's) and the others."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"engine": 0.0, "loop": 0.0, "other": 0.0}
    for task in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{task}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        key = "engine" if int(task) == engine_thread else "loop" if int(task) == os.getpid() else "other"
        out[key] += seconds
    return out


def timed_engine(model: Path, device: DeviceTimes, max_batch: int):
    """An engine of `model`'s tokenizer and shape on a GpuTimedBackend, room for max_batch sequences (and the idle
    one's), its scripted text the reference."""
    engine = instant_engine(model, N_CTX, sequences=max_batch + 1,
                            backend=functools.partial(GpuTimedBackend, device=device))
    engine.backend.reference = reference_ids(engine.tokenizer)
    return engine


# ---- the server process ------------------------------------------------------------------------------------------


def serve(model: Path, device: DeviceTimes, port: int, max_batch: int, stats_path: Path,
          switch_interval: float | None) -> None:
    """Serve the timed engine on `port`; SIGUSR1 writes the backend's stats and the threads' CPU time to stats_path."""
    from lucekv.server.app import serve as serve_engine
    from lucekv.server.config import SERVE_ENGINE, ServeConfig

    engine = timed_engine(model, device, max_batch)
    config = ServeConfig(host="127.0.0.1", port=port, engine=replace(SERVE_ENGINE, max_queue=256))

    def write_stats(*_) -> None:
        b = engine.backend
        stats = {**b.stats, "clock_s": time.perf_counter(), "cpu_s": thread_cpu_s(b.engine_thread),
                 "switch_interval_s": sys.getswitchinterval(), "quick_alone_us": b.quick_alone * 1e6,
                 "sleep_late_alone_us": b.sleep_alone * 1e6}
        part = stats_path.with_suffix(".part")  # renamed when whole: the reader never sees half of it
        part.write_text(json.dumps(stats))
        part.rename(stats_path)

    signal.signal(signal.SIGUSR1, write_stats)

    def started(_server) -> None:
        if switch_interval is not None:  # over serve's own
            sys.setswitchinterval(switch_interval)

    serve_engine(engine, config, started)


def reference_ids(tokenizer) -> np.ndarray:
    """The scripted model's text (InstantBackend.reference): this package's docstrings, N_CTX tokens or more."""
    import lucekv.engine.engine
    import lucekv.server.service
    import lucekv.server.worker

    text = "\n\n".join(m.__doc__ for m in (lucekv.engine.engine, lucekv.server.service, lucekv.server.worker,
                                           sys.modules[__name__]))
    ids = tokenizer.encode(text, add_special=False)
    return np.array((ids * (N_CTX // len(ids) + 1))[: N_CTX + 1], np.int32)


# ---- the client --------------------------------------------------------------------------------------------------


def requests_of(reference: list[int], n: int, seed: int) -> list[BenchRequest]:
    """n requests: prompts of 32..256 tokens of the reference text from various offsets, outputs of 64..256."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length, at = rng.randint(32, 256), rng.randrange(0, 256)
        out.append(BenchRequest(reference[at : at + length], rng.randint(64, 256)))
    return out


def in_process(model: Path, device: DeviceTimes, concurrency: int, requests: list[BenchRequest]) -> dict:
    """The same requests, `concurrency` at a time, through the timed engine in this process (Engine.submit / step, no
    server): what the server's figures would be if it added nothing. Timed as the client times them."""
    from lucekv.bench.serve import Timing
    from lucekv.engine.sampling import SamplingParams

    engine = timed_engine(model, device, concurrency)
    todo, running, timings = deque(requests), {}, []
    t0 = time.perf_counter()
    while todo or running:
        while todo and len(running) < concurrency:
            r = todo.popleft()
            params = SamplingParams(temperature=0.0, max_tokens=r.output_tokens, ignore_eos=True)
            running[engine.submit(r.prompt_ids, params)] = Timing(0.0, time.perf_counter(), 0)  # total: the send
        engine.step()
        now = time.perf_counter()
        for request, t in list(running.items()):
            while request.out:
                t.tokens += len(request.out.popleft().token_ids)
                t.ttft = t.ttft or now - t.total
            if request.done:
                t.total = now - t.total
                timings.append(running.pop(request))
    return figures(timings, time.perf_counter() - t0)


def measure(model: Path, device: DeviceTimes, concurrency: int, requests: list[BenchRequest],
            switch_interval: float | None) -> dict:
    from lucekv.client import Client

    port = free_port()
    stats_path = Path(tempfile.gettempdir()) / f"lucekv-serve-host-{os.getpid()}-{port}.json"
    cmd = [sys.executable, "-m", "lucekv.bench.serve_host", "--serve-port", str(port), "--model", str(model),
           "--max-batch", str(concurrency), "--stats", str(stats_path), *device.flags()]
    if switch_interval is not None:
        cmd += ["--switch-interval", str(switch_interval)]
    proc = wait_serving(subprocess.Popen(cmd, stderr=subprocess.DEVNULL), port)
    try:
        with Client(f"127.0.0.1:{port}") as client:
            send = lucekv_sender(client)
            drive([BenchRequest(r.prompt_ids[:16], 4) for r in requests[:concurrency]], concurrency, send)
            before, cpu0 = server_stats(proc, stats_path), resource.getrusage(resource.RUSAGE_SELF)
            timings, wall = drive(requests, concurrency, send)
            after, cpu1 = server_stats(proc, stats_path), resource.getrusage(resource.RUSAGE_SELF)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        stats_path.unlink(missing_ok=True)
    server = {k: v - before[k] for k, v in after.items() if k in (*COUNTS, "clock_s")}
    server["cpu_s"] = {k: v - before["cpu_s"][k] for k, v in after["cpu_s"].items()}
    row = {"concurrency": concurrency, **figures(timings, wall)}
    tokens = row["output_tokens"]
    device_ms = device.decode_ms(concurrency)
    alone = in_process(model, device, concurrency, requests)
    client_cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    steps = server["steps"]  # decode steps (a step may hold prompt pieces too)
    step_s = server["clock_s"] / steps
    engine_cpu_s = server["cpu_s"]["engine"] / steps
    row |= {"device_step_ms": device_ms, "in_process": alone,
            "tpot_p50_over_in_process_ms": row["tpot_ms_p50"] - alone["tpot_ms_p50"],
            "tok_s_over_in_process": row["output_tok_s"] / alone["output_tok_s"],
            "server_steps": steps, "rows_per_step": server["rows"] / steps, "prompt_pieces": server["pieces"],
            # the engine thread's time per step on the server: on the device, running, and neither (the GIL, a core)
            "engine_ms_per_step": {"wall": step_s * 1e3, "device_wait": server["asleep_s"] / steps * 1e3,
                                   "cpu": engine_cpu_s * 1e3,
                                   "waiting_for_gil_or_core": (step_s - server["asleep_s"] / steps - engine_cpu_s)
                                   * 1e3,
                                   "gil_wait_at_device_calls": server["gil_wait_s"] / steps * 1e3},
            "gil_releases_per_step": server["releases"] / steps,
            "cpu_us_per_output_token": {**{k: v / tokens * 1e6 for k, v in server["cpu_s"].items()},
                                        "client": client_cpu / tokens * 1e6},
            "switch_interval_ms": after["switch_interval_s"] * 1e3,
            "calibration_us": {"quick_call": after["quick_alone_us"], "sleep_overrun": after["sleep_late_alone_us"]}}
    e = row["engine_ms_per_step"]
    print(f"C={concurrency}: {row['output_tok_s']:.0f} tok/s, TPOT p50 {row['tpot_ms_p50']:.2f} ms (device "
          f"{device_ms:.2f}; in process {alone['output_tok_s']:.0f} tok/s, TPOT p50 {alone['tpot_ms_p50']:.2f}); "
          "engine thread ms/step: " +
          ", ".join(f"{k} {v:.2f}" for k, v in e.items()) + "; CPU us/token: " +
          ", ".join(f"{k} {v:.0f}" for k, v in row["cpu_us_per_output_token"].items()), file=sys.stderr)
    return row


def server_stats(proc: subprocess.Popen, path: Path) -> dict:
    """The server's stats now (SIGUSR1: it writes them)."""
    path.unlink(missing_ok=True)
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):  # not yet (or half) written
            time.sleep(0.02)
    raise RuntimeError("the server wrote no stats")


def run(model: Path, device: DeviceTimes, concurrencies: list[int], switch_interval: float | None, seed: int
        ) -> dict:
    from lucekv.bench.decode import git_commit, machine
    from lucekv.model.gguf import open_gguf
    from lucekv.model.tokenizer import Tokenizer

    reference = reference_ids(Tokenizer.from_metadata(open_gguf(model).metadata)).tolist()
    result = {"bench": "serve_host", "commit": git_commit(), "machine": machine(), "model": model.name,
              "load_avg_1_5_15_min_at_start": list(os.getloadavg()), "device": asdict(device),
              "quick_releases": QUICK_RELEASES,
              "command": " ".join(["python -m lucekv.bench.serve_host", *sys.argv[1:]]), "rows": []}
    for c in concurrencies:
        requests = requests_of(reference, max(16, 2 * c), seed)
        result["rows"].append(measure(model, device, c, requests, switch_interval))
    result["load_avg_1_5_15_min_at_end"] = list(os.getloadavg())
    return result


def main(argv: list[str] | None = None) -> int:
    from lucekv.bench.decode import report
    from lucekv.model.registry import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="its tokenizer and shape (no weights are read)")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--switch-interval", type=float, help="the server's sys.setswitchinterval (default: serve's own)")
    ap.add_argument("--step-ms", help="the device's decode step ms by batch bucket, 'ROWS:MS,...' (default: the 8B "
                    "shape's on the H100, STEP_MS)")
    ap.add_argument("--prefill-ms-per-token", type=float, default=PREFILL_MS_PER_TOKEN)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--serve-port", type=int, help=argparse.SUPPRESS)  # the server process
    ap.add_argument("--max-batch", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--stats", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    model = resolve_model(a.model)
    device = DeviceTimes.parse(a.step_ms, a.prefill_ms_per_token)
    if a.serve_port:
        serve(model, device, a.serve_port, a.max_batch, a.stats, a.switch_interval)
        return 0
    report(run(model, device, [int(c) for c in a.concurrency.split(",")], a.switch_interval, a.seed), a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
