"""`lucekv bench serve`: the same measurement as `bench decode`, taken at a gRPC client of a server process."""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lucekv.bench.decode import file_sha256, git_commit, machine, prompt_ids, report
from lucekv.client import Client, SamplingOptions
from lucekv.model.registry import resolve_model

STARTUP_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, proc: subprocess.Popen) -> None:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before serving")
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            time.sleep(0.5)
    raise RuntimeError(f"the server did not start serving within {STARTUP_TIMEOUT_S} s")


def timed_completion(client: Client, ids: list[int], gen_tokens: int) -> tuple[float, float, float]:
    """(client time to first token, client decode tok/s, server-reported decode tok/s)."""
    t0 = time.perf_counter()
    t_first = t_last = 0.0
    n = 0
    for chunk in client.generate(ids, SamplingOptions(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)):
        t_last = time.perf_counter()
        n += len(chunk.token_ids)
        if n == len(chunk.token_ids):
            t_first = t_last
    if chunk.usage.cached_tokens:
        raise RuntimeError("a benchmark run reused cached KV: its first-token figure would be wrong")
    return t_first - t0, (n - 1) / (t_last - t_first), chunk.usage.decode_tokens_per_second


def run(model: str, prompt_tokens: int, gen_tokens: int, repeats: int, engine_flags: list[str]) -> dict:
    path = resolve_model(model)
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "lucekv.cli", "serve", "--model", str(path), "--port", address.rsplit(":", 1)[1],
           *engine_flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_serving(address, proc)
        with Client(address) as client:
            ttft, decode, server_decode = [], [], []
            for i in range(repeats + 1):  # the first run warms the server up and is not counted
                ids = prompt_ids(client.tokenize, prompt_tokens, i)
                first, tok_s, server_tok_s = timed_completion(client, ids, gen_tokens)
                if i:
                    ttft.append(first)
                    decode.append(tok_s)
                    server_decode.append(server_tok_s)
                    print(f"run {i}: first token {first * 1e3:.0f} ms, decode {tok_s:.1f} tok/s", file=sys.stderr)
            info = client.server_info()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {
        "bench": "serve",
        "commit": git_commit(),
        "machine": machine(),
        "model": {"name": info.model_name, "arch": info.arch, "file": path.name, "sha256": file_sha256(path)},
        "backend": info.backend,
        "engine_flags": engine_flags,
        "command": "lucekv " + " ".join(sys.argv[1:]),
        "prompt_tokens": len(ids),
        "gen_tokens": gen_tokens,
        "repeats": repeats,
        "client_ttft_ms_median": statistics.median(ttft) * 1e3,
        "client_decode_tok_s_median": statistics.median(decode),
        "server_decode_tok_s_median": statistics.median(server_decode),
        "client_ttft_ms": [t * 1e3 for t in ttft],
        "client_decode_tok_s": decode,
    }


def main(args) -> int:
    kv_pool = {None: "off"}.get(args.kv_pool, args.kv_pool)
    flags = ["--backend", args.backend, "--kv-dtype", args.kv_dtype, "--kv-pool", str(kv_pool),
             "--kv-policy", args.kv_policy, "--kv-tau", str(args.kv_tau)]
    report(run(args.model, args.prompt_tokens, args.gen_tokens, args.repeats, flags), args.json)
    return 0
