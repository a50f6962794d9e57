"""`lucekv bench spark MODEL`: decode speed of an MoE whose experts are not all on the GPU (Spark, DESIGN §7), CUDA.

For each share of the experts' bytes resident (`--resident 0.3,0.5,0.7`): uniform placement (the same experts of every
layer, as a trace-free server would keep), calibrated placement (from a routing trace), and calibrated placement with
spare cache slots (the placement's budget less the slots', so the three hold the same GPU bytes); beside all experts
on the GPU. Cold experts are read over PCIe from mapped host memory (backends/cuda_spark). Each row: decode tok/s,
cold selections and cache fills per token, expert table bytes, GPU memory in use, and whether its greedy tokens are
those of all-GPU (they must be). The calibration trace comes from `--trace FILE` (`lucekv spark trace`), or is recorded
on the GPU by decoding a calibration prompt of other text than the measured one. With `--llama-bench PATH`: llama.cpp
on the same file with the experts of the first N layers on the CPU (`--n-cpu-moe N`, N = (1 - share) x layers: the same
expert VRAM), and with none there, in the same run.

With `--long-context TOKENS` (`run_long`): the engine as a server runs it, within `--gpu-memory-gib` (the KV pool sized
by `--kv-pool auto` from what the expert tables leave), one share resident as calibrated + cache: the calibration trace
counted by the engine itself on the device (as `serve --spark-record` counts) serving a prompt of code, unless
`--trace`; then decode on a context of TOKENS installed as `bench depth` installs it (random token ids and K/V restored
as a session: decode reads every resident row and weight whatever their values; prefill is not measured) or, with
`--prefill`, prefilled as a prompt, past one KVFlash reselect, beside a 1K context. Each: decode tok/s, cold
selections and fills per token; the pool, the GPU bytes of weights and tables, and the GPU memory in use (sampled
in-process, and its peak over the run from nvidia-smi). Last, the 1K run again with the routing counted (what
`--spark-record` costs a decode step).
"""

from __future__ import annotations

import gc
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from lucekv.errors import ConfigError

MEASURED = ("The history of the Roman Empire spans more than a thousand years. Its roads, laws and languages shaped "
            "the continent long after its fall, and historians still argue about why it ended. ")
CALIBRATION = ("def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
               "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
               "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n")
WARMUP = 8  # decode steps before the clock starts (the first captures the decode graph)
GIB = 1 << 30


def greedy_decode(backend, prompt: np.ndarray, n: int) -> tuple[list[int], float]:
    """`prompt` prefilled alone in the pool, then n greedy decode steps run ahead as the engine runs them: the n
    tokens, and the decode tok/s after WARMUP steps."""
    b = backend
    b.pool.truncate(0)
    for start in range(0, len(prompt), b.prefill_chunk):
        pos = np.arange(start, min(start + b.prefill_chunk, len(prompt)), dtype=np.int32)
        logits = b.forward(prompt[pos], pos, pos)
    p = len(prompt)
    b.decode_ahead(p, p, int(np.argmax(logits[-1][: b.spec.vocab_size])))
    out, started = [], time.perf_counter()
    for i in range(1, n):  # step i takes the token of step i - 1 on the device
        b.decode_ahead(p + i, p + i, None)
        out.append(b.next_token())
        if len(out) == WARMUP:
            started = time.perf_counter()
    out.append(b.next_token())
    return out, (n - WARMUP) / (time.perf_counter() - started)


def gpu_used_gib() -> float:
    """GPU memory in use on the device (this process's, on a machine of its own), after numba frees what it deferred."""
    from lucekv.kernels.cuda import cuda

    gc.collect()
    ctx = cuda.current_context()
    ctx.deallocations.clear()
    free, total = ctx.get_memory_info()
    return (total - free) / GIB


def run(model: str, shares: list[float], prompt_tokens: int, gen_tokens: int, spare: int | None,
        trace_path: str | None, calibration_tokens: int, llama_bench: str | None) -> dict:
    from lucekv.backends.cuda import CudaBackend
    from lucekv.backends.cuda_spark import SparkOptions
    from lucekv.bench.decode import git_commit
    from lucekv.kvflash.pager import CHUNK_TOKENS
    from lucekv.model.arch import ModelSpec
    from lucekv.model.gguf import open_gguf
    from lucekv.model.registry import resolve_model
    from lucekv.model.tokenizer import Tokenizer
    from lucekv.spark.experts import expert_bytes
    from lucekv.spark.placement import Placement, calibrated, uniform
    from lucekv.spark.trace import RoutingTrace

    path = resolve_model(model)
    g = open_gguf(path)
    spec = ModelSpec.from_gguf(g)
    sizes = expert_bytes(g)  # also refuses a dense model
    n_expert, total = spec.n_expert, sum(sizes) * spec.n_expert
    spare = max(1, n_expert // 16) if spare is None else spare
    tok = Tokenizer.from_metadata(g.metadata)

    def prompt(text: str, n: int) -> np.ndarray:
        return np.asarray(tok.encode(text * (n // 8 + 2))[:n], np.int32)

    measured = prompt(MEASURED, prompt_tokens)
    pool = -(-(max(prompt_tokens, calibration_tokens) + gen_tokens + 1) // CHUNK_TOKENS) * CHUNK_TOKENS + CHUNK_TOKENS
    result: dict = {"bench": "spark", "commit": git_commit(), "gpu": _gpu_name(), "model": Path(path).name,
                    "model_name": spec.name, "fingerprint": g.fingerprint, "n_layer": spec.n_layer,
                    "n_expert": n_expert, "top_k": spec.n_expert_used, "prompt_tokens": len(measured),
                    "gen_tokens": gen_tokens, "spare_slots_per_layer": spare, "all_experts_gib": total / GIB,
                    "expert_mib": total / n_expert / spec.n_layer / (1 << 20)}  # one expert, GGUF bytes

    started = time.perf_counter()
    backend = CudaBackend(g, spec, "f16", pool)
    result["load_s_all_gpu"] = time.perf_counter() - started
    reference, speed = greedy_decode(backend, measured, gen_tokens)
    result["all_gpu"] = {"decode_tok_s": speed, "gpu_used_gib": gpu_used_gib()}
    print(f"all experts on the GPU: {speed:.1f} tok/s, {result['all_gpu']['gpu_used_gib']:.2f} GiB in use", flush=True)
    del backend
    gpu_used_gib()  # frees it now

    everything = Placement(g.fingerprint, n_expert, tuple(tuple(range(n_expert)) for _ in range(spec.n_layer)))
    started = time.perf_counter()
    backend = CudaBackend(g, spec, "f16", pool, spark=SparkOptions(everything))
    result["load_s_spark"] = time.perf_counter() - started
    if trace_path:
        trace = RoutingTrace.load(trace_path, g.fingerprint)
        result["calibration"] = {"trace": Path(trace_path).name, "tokens": trace.tokens}
    else:  # recorded here: decoding other text than the measured prompt's
        trace = RoutingTrace.empty(g.fingerprint, spec.n_layer, n_expert, spec.n_expert_used)
        backend.spark.trace = trace
        greedy_decode(backend, prompt(CALIBRATION, prompt_tokens), calibration_tokens)
        backend.spark.trace = None
        result["calibration"] = {"recorded": "greedy decode on the GPU after a prompt of Python code",
                                 "tokens": trace.tokens}

    rows = []
    for share in shares:
        budget = int(share * total)
        cache_budget = budget - spare * sum(sizes)
        configs = {"uniform": SparkOptions(uniform(g.fingerprint, n_expert, sizes, budget)),
                   "calibrated": SparkOptions(calibrated(trace, sizes, budget))}
        if cache_budget >= sum(sizes):  # a placement keeps at least one expert per layer
            configs["calibrated+cache"] = SparkOptions(calibrated(trace, sizes, cache_budget), spare)
        for name, options in configs.items():
            backend.place_experts(options)
            tokens, speed = greedy_decode(backend, measured, gen_tokens)
            stats = backend.spark.stats
            row = {"resident_share": share, "placement": name, "decode_tok_s": speed,
                   "over_all_gpu": speed / result["all_gpu"]["decode_tok_s"],
                   "placed_experts": sum(len(h) for h in options.placement.hot), "spare": options.spare,
                   "expert_table_gib": backend.spark.table_bytes / GIB, "gpu_used_gib": gpu_used_gib(),
                   "same_tokens_as_all_gpu": tokens == reference,
                   "first_difference": next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=True))
                                             if a != b), None),
                   **{k: v for k, v in stats.to_json().items() if k.endswith("per_token")}}
            rows.append(row)
            print(f"{share:.0%} {name:<17} {speed:7.1f} tok/s ({row['over_all_gpu']:.2f}x all-GPU), "
                  f"{row['cold_per_token']:.2f} cold/token, {row['fills_per_token']:.2f} fills/token, tables "
                  f"{row['expert_table_gib']:.2f} GiB, same tokens: {row['same_tokens_as_all_gpu']}", flush=True)
    result["rows"] = rows
    del backend
    gpu_used_gib()
    if llama_bench:
        result["llama_cpp"] = [run_llama_bench(llama_bench, Path(path), gen_tokens, share, spec.n_layer)
                               for share in [1.0, *shares]]
        for r in result["llama_cpp"]:
            print(f"llama.cpp, experts of {r['n_cpu_moe']} layers on the CPU: {r.get('tg_tok_s', r.get('error'))}")
    return result


def run_long(model: str, share: float, context: int, gen_tokens: int, spare: int | None, trace_path: str | None,
             calibration_tokens: int, gpu_memory_gib: float, prefill: bool = False) -> dict:
    """See the module's docstring (`--long-context`); `prefill`: the long context is a prompt prefilled (prose
    repeated), its time to first token measured, rather than restored."""
    import lucekv
    from lucekv.backends.cuda_spark import SparkOptions
    from lucekv.bench.decode import git_commit
    from lucekv.bench.depth import NO_HOST_LIMIT, decode_run, gen_tokens_for
    from lucekv.engine.engine import gpu_weight_bytes
    from lucekv.engine.sampling import SamplingParams
    from lucekv.model.arch import ModelSpec
    from lucekv.model.gguf import open_gguf
    from lucekv.model.registry import resolve_model
    from lucekv.model.tokenizer import Tokenizer
    from lucekv.spark.experts import expert_bytes
    from lucekv.spark.placement import calibrated, uniform
    from lucekv.spark.trace import RoutingTrace

    path = resolve_model(model)
    g = open_gguf(path)
    spec = ModelSpec.from_gguf(g)
    sizes = expert_bytes(g)
    n_expert, total = spec.n_expert, sum(sizes) * spec.n_expert
    spare = max(1, n_expert // 16) if spare is None else spare
    cache_budget = int(share * total) - spare * sum(sizes)  # placed + spare slots: the share's bytes
    if cache_budget < sum(sizes):
        raise ConfigError(f"--resident {share}: {spare} spare slots per layer leave no expert placed")
    gen = gen_tokens_for(context, gen_tokens, TAU, True)
    n_ctx = -(-(context + 1 + gen) // 64) * 64
    if n_ctx > spec.n_ctx:
        raise ConfigError(f"--long-context {context} and its {gen} decoded tokens exceed the model's context "
                          f"({spec.n_ctx})")
    result: dict = {"bench": "spark-long", "commit": git_commit(), "gpu": _gpu_name(), "model": Path(path).name,
                    "model_name": spec.name, "fingerprint": g.fingerprint, "resident_share": share,
                    "spare_slots_per_layer": spare, "gpu_memory_gib": gpu_memory_gib, "n_ctx": n_ctx,
                    "all_experts_gib": total / GIB}
    with tempfile.TemporaryDirectory() as tmp, PeakGpuMemory() as peak:
        if trace_path:
            trace = RoutingTrace.load(trace_path, g.fingerprint)
            first = calibrated(trace, sizes, cache_budget)
        else:  # loaded as uniform + cache (the same table bytes), calibrated once the engine has recorded a trace
            first = uniform(g.fingerprint, n_expert, sizes, cache_budget)
        first.save(Path(tmp) / "placement.json")
        result["gpu_used_gib_before_load"] = gpu_used_gib()  # the CUDA context (made here) and anything else there
        started = time.perf_counter()
        engine = lucekv.load(path, backend="cuda", kv_pool="auto", gpu_memory_gib=gpu_memory_gib, max_batch=1,
                             n_ctx=n_ctx, kv_tau=TAU, session_memory_gib=NO_HOST_LIMIT,
                             # without --prefill only the calibration prompt is prefilled: pieces of 64 tokens, so
                             # that load compiles and captures no wider prompt graphs
                             step_tokens=None if prefill else 64,
                             spark_placement=Path(tmp) / "placement.json", spark_spare=spare)
        result["load_s"] = time.perf_counter() - started
        result["step_tokens"] = engine.scheduler.config.step_tokens  # a step's prompt piece: its scratch is sized by it
        result["gpu_used_gib_after_load"] = gpu_used_gib()
        backend, tok = engine.backend, Tokenizer.from_metadata(g.metadata)
        if trace_path:
            result["calibration"] = {"trace": Path(trace_path).name, "tokens": trace.tokens}
        else:  # the routing counted on the device as --spark-record counts it, then counted no more
            backend.count_routing()
            ids = (tok.encode(CALIBRATION) * (calibration_tokens // 8 + 1))[:calibration_tokens]
            list(engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)))
            trace = RoutingTrace(g.fingerprint, spec.n_expert_used, backend.take_routing_counts())
            backend.count_routing(False)
            backend.place_experts(SparkOptions(calibrated(trace, sizes, cache_budget), spare))
            result["calibration"] = {"recorded": "the engine's routing counted on the device (as --spark-record "
                                                 "counts it) serving a prompt of Python code, 64 tokens decoded",
                                     "tokens": trace.tokens,
                                     # what the trace must count: the prompt and every decoded token but the last
                                     "tokens_forwarded": len(ids) + 63}
        spark = backend.spark
        result["memory"] = {
            "kv_pool_tokens": engine.info.kv_pool_tokens, "kv_cache_tokens": engine.info.kv_cache_tokens,
            "kv_cache_gib": engine.info.kv_cache_tokens * engine.layout.token_bytes / GIB,
            "weights_on_gpu_gib": gpu_weight_bytes(g, SparkOptions(spark.slots.placement, spare)) / GIB,
            "expert_table_gib": spark.table_bytes / GIB, "pinned_host_experts_gib": spark.host_bytes / GIB}
        m = result["memory"]
        # what the engine took beside the weights and the pool (activations, graphs, code): the auto pool's headroom
        # (10% of what the weights leave) is meant to hold it
        m["scratch_gib_after_load"] = (result["gpu_used_gib_after_load"] - result["gpu_used_gib_before_load"]
                                       - m["weights_on_gpu_gib"] - m["kv_cache_gib"])
        print(f"within {gpu_memory_gib} GiB: KV pool {m['kv_pool_tokens']} tokens ({m['kv_cache_gib']:.2f} GiB), "
              f"weights on the GPU {m['weights_on_gpu_gib']:.2f} GiB (expert tables {m['expert_table_gib']:.2f}), "
              f"{result['gpu_used_gib_after_load']:.2f} GiB in use after load", flush=True)
        rng = np.random.default_rng(0)

        long_prompt = (tok.encode(MEASURED) * (context // 8 + 1))[:context] if prefill else None
        gen_short = gen_tokens_for(1024, gen_tokens, TAU, True)
        decode_run(engine, 256, WARMUP, rng, "spark-long")  # captures the decode graph (the placement dropped it)
        runs = [decode_measured(engine, 1024, gen_short, rng),
                decode_measured(engine, context, gen, rng, long_prompt)]
        # what counting routing (--spark-record) costs a decode step: the 1K run again with the count launches
        backend.count_routing()
        decode_run(engine, 256, WARMUP, rng, "spark-long")  # captures the decode graph with them
        runs.append(decode_measured(engine, 1024, gen_short, rng, counted=True))
        result["routing_counted"] = {"tokens": int(backend.take_routing_counts()[0].sum()) // spec.n_expert_used,
                                     "tokens_forwarded": WARMUP + runs[-1]["gen_tokens"]}  # (they must agree)
        result["runs"] = runs
        del engine, backend, spark
        gc.collect()
    result["gpu_peak_gib_nvidia_smi"] = peak.gib
    result["within_gpu_memory"] = None if peak.gib is None else peak.gib <= gpu_memory_gib
    return result


def decode_measured(engine, length: int, gen: int, rng: np.random.Generator, prompt: list[int] | None = None,
                    counted: bool = False) -> dict:
    """`gen` tokens decoded on a context of `length` tokens, restored (`bench depth`'s decode_run) or, given, `prompt`
    prefilled; with the cold selections and fills per token of those steps and the GPU memory in use after."""
    from lucekv.bench.depth import _generate, decode_run

    spark = engine.backend.spark
    before = spark.stats.to_json()
    if prompt is None:
        row = decode_run(engine, length, gen, rng, "spark-long")
    else:
        try:
            row = {"context": length, "prefilled": True, **_generate(engine, prompt, gen, "spark-long")}
        finally:
            engine.delete_session("spark-long")
    after = spark.stats.to_json()
    tokens = max(after["tokens"] - before["tokens"], 1)
    row.update({"routing_counted": counted, "cold_per_token": (after["cold"] - before["cold"]) / tokens,
                "fills_per_token": (after["fills"] - before["fills"]) / tokens, "gpu_used_gib": gpu_used_gib()})
    print(f"context {length}{' (routing counted)' * counted}: {row['decode_tok_s']:.1f} tok/s over "
          f"{row['gen_tokens']} tokens, {row['cold_per_token']:.2f} cold/token, {row['fills_per_token']:.2f} "
          f"fills/token, {row['gpu_used_gib']:.2f} GiB in use", flush=True)
    return row


TAU = 64  # the engine's default reselect interval


class PeakGpuMemory:
    """The GPU's memory in use at its highest while the block runs (GiB, the whole device's as nvidia-smi reports
    it, polled every 0.2 s); None without nvidia-smi."""

    def __init__(self):
        self.gib: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        device = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        self._cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", f"--id={device}"]

    def __enter__(self) -> PeakGpuMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            try:
                used = int(subprocess.run(self._cmd, capture_output=True, text=True, timeout=5).stdout.split()[0])
            except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
                return  # no nvidia-smi: no peak
            self.gib = max(self.gib or 0.0, used / 1024)  # MiB


def run_llama_bench(binary: str, model: Path, gen_tokens: int, share: float, n_layer: int) -> dict:
    """llama-bench's decode tok/s (tg) with the experts of the first round((1 - share) x n_layer) layers on the CPU
    (`-ncmoe`), everything else on the GPU; or the error. Never raises."""
    from lucekv.bench.depth import json_rows

    n_cpu = round((1 - share) * n_layer)
    cmd = [binary, "-m", str(model), "-p", "0", "-n", str(gen_tokens), "-ngl", "99", "-fa", "1", "-ncmoe", str(n_cpu),
           "-r", "2", "-o", "json"]
    row: dict = {"resident_share": share, "n_cpu_moe": n_cpu,
                 "command": " ".join([Path(binary).name, "-m", model.name, *cmd[3:]])}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode:
            return {**row, "error": f"exit status {proc.returncode}: {proc.stderr.strip()[-400:]}"}
        tg = next(r for r in json_rows(proc.stdout) if r.get("n_gen"))
    except (OSError, subprocess.TimeoutExpired, ValueError, StopIteration) as e:
        return {**row, "error": f"{type(e).__name__}: {e}"}
    return {**row, "tg_tok_s": float(tg["avg_ts"]), "tg_stddev": float(tg.get("stddev_ts", 0.0)),
            "build_commit": tg.get("build_commit")}


def _gpu_name() -> str:
    from lucekv.kernels.cuda import cuda

    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def main(args) -> int:
    from lucekv.bench.decode import report

    try:
        shares = [float(s) for s in args.resident.split(",")]
    except ValueError:
        raise ConfigError(f"--resident must be comma-separated shares, not {args.resident!r}") from None
    if any(not 0 < s < 1 for s in shares):
        raise ConfigError(f"--resident shares must be in (0, 1), not {args.resident!r}")
    if args.gen_tokens <= WARMUP:
        raise ConfigError(f"--gen-tokens must be more than {WARMUP}")
    if args.long_context:
        if len(shares) != 1:
            raise ConfigError("--long-context measures one --resident share")
        result = run_long(args.model, shares[0], args.long_context, args.gen_tokens, args.spare, args.trace,
                          args.calibration_tokens, args.gpu_memory_gib, args.prefill)
        result["command"] = " ".join(["lucekv bench spark", Path(args.model).name, "--resident", args.resident,
                                      "--long-context", str(args.long_context), "--gpu-memory-gib",
                                      str(args.gpu_memory_gib), "--gen-tokens", str(args.gen_tokens)]
                                     + (["--prefill"] if args.prefill else [])
                                     + (["--trace", Path(args.trace).name] if args.trace else []))
        report(result, args.json)
        return 0
    result = run(args.model, shares, args.prompt_tokens, args.gen_tokens, args.spare, args.trace,
                 args.calibration_tokens, args.llama_bench)
    result["command"] = " ".join(["lucekv bench spark", Path(args.model).name, "--resident", args.resident,
                                  "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens)]
                                 + (["--trace", Path(args.trace).name] if args.trace else [])
                                 + (["--llama-bench", "llama-bench"] if args.llama_bench else []))
    report(result, args.json)
    return 0


def add_parser(bench_sub) -> None:
    sp = bench_sub.add_parser("spark", help="CUDA: decode tok/s of an MoE with a share of its experts on the GPU "
                              "(uniform, calibrated, calibrated + cache) beside all on the GPU and llama.cpp -ncmoe")
    sp.add_argument("model", help="the MoE: registry name or GGUF path")
    sp.add_argument("--resident", default="0.3,0.5,0.7", help="shares of the experts' bytes on the GPU")
    sp.add_argument("--trace", help="calibration routing trace JSON (default: recorded on the GPU, see the doc)")
    sp.add_argument("--calibration-tokens", type=int, default=256, help="tokens decoded to record the trace")
    sp.add_argument("--spare", type=int, help="cache slots per layer of calibrated + cache (default n_expert / 16)")
    sp.add_argument("--prompt-tokens", type=int, default=128)
    sp.add_argument("--gen-tokens", type=int, default=128)
    sp.add_argument("--llama-bench", metavar="PATH", help="llama-bench binary (CUDA build): -ncmoe at the same VRAM")
    sp.add_argument("--long-context", type=int, metavar="TOKENS", help="the engine within --gpu-memory-gib at one "
                    "--resident share (calibrated + cache, auto KV pool): decode on a context of TOKENS (see the doc)")
    sp.add_argument("--gpu-memory-gib", type=float, default=16.0, help="with --long-context: the engine's GPU memory "
                    "(default 16)")
    sp.add_argument("--prefill", action="store_true", help="with --long-context: prefill the long context as a "
                    "prompt (its time to first token measured) rather than restore it")
    sp.add_argument("--json", help="also write the result here")
