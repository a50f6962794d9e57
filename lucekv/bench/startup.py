"""`lucekv bench startup`: an engine started in a fresh process twice over one kernel cache directory, cold (empty)
then warm (what the first process compiled): each start's time, the kernels it loaded from the disk cache and those it
compiled, then in each process prompts of --prompt-tokens tokens (time to first token, prefill and decode tok/s) and
the kernels compiled while they ran (none where the warm-up at engine start, CudaBackend.prepare, is complete). Both
processes' greedy tokens must agree (the kernels loaded from disk compute what the compiled ones did): exit 1 if not.

The cache directory is numba's (NUMBA_CACHE_DIR, which the children get): a fresh temporary one unless --cache-dir
names one."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lucekv.bench.decode import file_sha256, git_commit, machine, prompt_ids, report

CHILD_FLAG = "--startup-child"


def add_parser(bench_sub: argparse._SubParsersAction, default_model: str) -> None:
    from lucekv.cli_server import add_engine_flags

    p = bench_sub.add_parser("startup", help="engine start time in a fresh process, cold then warm kernel cache, and "
                             "the first long prompts after it (kernels compiled mid-request)")
    p.add_argument("--model", default=default_model)
    p.add_argument("--prompt-tokens", type=int, default=8192, help="each prompt's tokens (default 8192)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per process, one after the other (default 2)")
    p.add_argument("--gen-tokens", type=int, default=16, help="tokens each prompt decodes (default 16)")
    p.add_argument("--cache-dir", type=Path, help="numba's cache directory (default: a fresh temporary one)")
    p.add_argument("--json", help="also write the result here")
    p.add_argument(CHILD_FLAG, type=float, metavar="LAUNCHED", help=argparse.SUPPRESS)  # time.time() at launch
    add_engine_flags(p)


def main(args) -> int:
    launched = getattr(args, CHILD_FLAG.lstrip("-").replace("-", "_"))
    if launched is not None:
        print(json.dumps(child(args, launched)))
        return 0
    with tempfile.TemporaryDirectory(prefix="lucekv-kernels-") as fresh:
        cache = args.cache_dir or Path(fresh)
        env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
        starts = []
        for name in ("cold", "warm"):  # (cold: unless --cache-dir held kernels already; files_before says)
            files_before = sum(1 for _ in cache.rglob("*.nbc")) if cache.exists() else 0
            t = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "lucekv.cli", *sys.argv[1:], CHILD_FLAG, str(time.time())],
                                 env=env, stdout=subprocess.PIPE, text=True)
            if out.returncode:
                raise SystemExit(f"the {name} process failed (exit {out.returncode})")
            starts.append({"cache": name, "cache_files_before": files_before, "process_s": time.perf_counter() - t,
                           **json.loads(out.stdout.strip().splitlines()[-1])})
            print(f"{name}: {starts[-1]}", file=sys.stderr)
    path = Path(starts[0]["model_path"])
    # the kernels loaded from disk compute what the compiled ones did: the same greedy tokens
    same = [p["output"] for p in starts[0]["prompts"]] == [p["output"] for p in starts[1]["prompts"]]
    report({"bench": "startup", "commit": git_commit(), "machine": machine(),
            "model": {"file": path.name, "sha256": file_sha256(path)},
            "command": "lucekv " + " ".join(Path(a).name if "/" in a else a for a in sys.argv[1:]),
            "gpu": starts[0].get("gpu"), "same_output_cold_and_warm": same, "starts": starts}, args.json)
    return 0 if same else 1


def child(args, launched: float) -> dict:
    """In the child process: start the engine, run the prompts; times (ready_s: from the process's launch, its
    interpreter and imports included) and kernel counts."""
    import lucekv
    from lucekv.cli_server import engine_options
    from lucekv.engine.sampling import SamplingParams
    from lucekv.model.registry import resolve_model

    path = resolve_model(args.model)
    t = time.perf_counter()
    engine = lucekv.load(path, **engine_options(args))
    result: dict = {"model_path": str(path), "backend": engine.info.backend, "ready_s": time.time() - launched,
                    "engine_start_s": time.perf_counter() - t}
    counts = None
    if engine.info.backend == "cuda":
        from lucekv.kernels.cuda import cuda
        from lucekv.kernels.cuda._numba import kernel_cache_counts

        name = cuda.get_current_device().name
        result["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
        counts = kernel_cache_counts
        result["kernels_at_start"] = dict(zip(("loaded", "compiled"), counts(), strict=True))
    params = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True)
    result["prompts"] = []
    for run in range(args.prompts):
        ids = prompt_ids(engine.tokenizer.encode, args.prompt_tokens, run)
        before = counts() if counts else None
        deltas = list(engine.generate(ids, params))
        u = deltas[-1].usage
        prompt = {"tokens": len(ids), "time_to_first_token_s": u.time_to_first_token_s,
                  "prefill_tok_s": len(ids) / u.time_to_first_token_s, "decode_tok_s": u.decode_tokens_per_s,
                  "output": [t for d in deltas for t in d.token_ids]}
        if counts:
            prompt["kernels_compiled"] = counts()[1] - before[1]
        result["prompts"].append(prompt)
        print(f"prompt {run}: {prompt}", file=sys.stderr)
    return result
