"""`lucekv bench decode`: prefill and decode tokens per second through the public generate path; with
`--transformers`, Hugging Face transformers on the same GGUF, prompts and device in the same run (speed, and the
relative error of lucekv's logits against its float32 ones); with `--threads 1,2` once per CPU thread count, and
with `--llama-bench PATH` llama.cpp's llama-bench (pp of the same prompt length, tg of the same token count, as many
threads) on the same file right after each of lucekv's runs, the load average beside each figure."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numba

import lucekv
from lucekv.engine.sampling import SamplingParams

FILLER = ("The quick brown fox jumps over the lazy dog while the committee reviews the budget for next "
          "year. def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")


def machine() -> dict:
    info = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
        info["cpu"] = name
    except (OSError, StopIteration):
        pass
    import os

    info["cores"] = os.cpu_count()
    return info


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def prompt_ids(tokenize, n: int, run: int) -> list[int]:
    """A prompt of n tokens whose first token differs from run to run, so no run reuses another's KV."""
    ids = tokenize(FILLER * (n // 20 + 2))[:n]
    firsts = sorted(set(ids))
    return [firsts[run % len(firsts)], *ids[1:]]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def measure(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[float], list[float]]:
    """Prefill and decode tok/s of each prompt but the first, which warms up numba's caches and is not counted."""
    prefill, decode = [], []
    for i, ids in enumerate(prompts):
        t0 = time.perf_counter()
        last = list(engine.generate(ids, params))[-1]
        if last.usage.cached_tokens:
            raise RuntimeError("a benchmark run reused cached KV: its prefill figure would be wrong")
        if i == 0:
            print(f"warm-up done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            continue
        prefill.append(len(ids) / last.usage.time_to_first_token_s)
        decode.append(last.usage.decode_tokens_per_s)
        print(f"run {i}: prefill {prefill[-1]:.1f} tok/s, decode {decode[-1]:.1f} tok/s", file=sys.stderr)
    return prefill, decode


def run(model: str, prompt_tokens: int, gen_tokens: int, repeats: int, engine_options: dict,
        transformers: bool = False, threads: list[int] | None = None, llama_bench: str | None = None) -> dict:
    from lucekv.model.registry import resolve_model

    path = resolve_model(model)
    engine = lucekv.load(path, **engine_options)
    params = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    prompts = [prompt_ids(engine.tokenizer.encode, prompt_tokens, i) for i in range(repeats + 1)]
    ids = prompts[-1]
    by_threads = []
    for n in threads or []:  # each thread count: lucekv, then llama.cpp on the same file, side by side
        numba.set_num_threads(n)
        row: dict = {"threads": n, "load_avg_before": os.getloadavg()}
        row["prefill_tok_s"], row["decode_tok_s"] = measure(engine, prompts, params)
        row["prefill_tok_s_median"] = statistics.median(row["prefill_tok_s"])
        row["decode_tok_s_median"] = statistics.median(row["decode_tok_s"])
        if llama_bench:
            row["llama_cpp"] = run_llama_bench(llama_bench, path, len(ids), gen_tokens, n, repeats)
            if "error" not in row["llama_cpp"]:
                row["prefill_over_llama_cpp"] = row["prefill_tok_s_median"] / row["llama_cpp"]["pp_tok_s"]
                row["decode_over_llama_cpp"] = row["decode_tok_s_median"] / row["llama_cpp"]["tg_tok_s"]
        row["load_avg_after"] = os.getloadavg()
        print(f"{n} threads: {json.dumps({k: v for k, v in row.items() if 'over' in k or 'median' in k})}",
              file=sys.stderr)
        by_threads.append(row)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    prefill, decode = measure(engine, prompts, params) if not by_threads else (
        by_threads[-1]["prefill_tok_s"], by_threads[-1]["decode_tok_s"])
    result = {
        "bench": "decode",
        "commit": git_commit(),
        "machine": machine(),
        "model": {"name": engine.info.model_name, "arch": engine.info.arch, "file": path.name,
                  "sha256": file_sha256(path), "fingerprint": engine.info.fingerprint},
        "backend": engine.info.backend,
        "engine_options": engine_options,
        "command": "lucekv " + " ".join(Path(a).name if "/" in a else a for a in sys.argv[1:]),  # no machine paths
        "prompt_tokens": len(ids),
        "gen_tokens": gen_tokens,
        "repeats": repeats,
        "prefill_tok_s_median": statistics.median(prefill),
        "decode_tok_s_median": statistics.median(decode),
        "prefill_tok_s": prefill,
        "decode_tok_s": decode,
        "load_avg": os.getloadavg(),
    }
    if by_threads:
        result["by_threads"] = by_threads
    if transformers:
        from lucekv.bench import hf_anchor

        ours = engine.score(prompts[0][:hf_anchor.LOGIT_TOKENS])
        del engine  # its GPU memory goes before transformers loads
        hf = hf_anchor.anchor(path, prompts, gen_tokens, ours)
        result["transformers"] = hf
        result["over_transformers"] = {k: result[f"{k}_tok_s_median"] / hf[f"{k}_tok_s_median"]
                                       for k in ("prefill", "decode")}
    return result


def run_llama_bench(binary: str, model: Path, prompt_tokens: int, gen_tokens: int, threads: int, reps: int,
                    timeout_s: float = 900) -> dict:
    """llama-bench's pp and tg tok/s on `threads` CPU threads (no GPU layers), or the error; never raises."""
    from lucekv.bench.depth import json_rows

    cmd = [binary, "-m", str(model), "-p", str(prompt_tokens), "-n", str(gen_tokens), "-t", str(threads),
           "-ngl", "0", "-r", str(reps), "-o", "json"]
    result: dict = {"command": " ".join([Path(binary).name, *cmd[1:2], model.name, *cmd[3:]])}
    if shutil.which(binary) is None:
        return {**result, "error": f"{binary}: not found or not executable"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        if proc.returncode:
            return {**result, "error": f"exit status {proc.returncode}: {proc.stderr.strip()[-500:]}"}
        rows = json_rows(proc.stdout)
        pp = next(r for r in rows if r.get("n_prompt") and not r.get("n_gen"))
        tg = next(r for r in rows if r.get("n_gen") and not r.get("n_prompt"))
    except (OSError, subprocess.TimeoutExpired, ValueError, StopIteration) as e:
        return {**result, "error": f"{type(e).__name__}: {e}"}
    return {**result, "pp_tok_s": float(pp["avg_ts"]), "pp_stddev": float(pp.get("stddev_ts", 0.0)),
            "tg_tok_s": float(tg["avg_ts"]), "tg_stddev": float(tg.get("stddev_ts", 0.0)),
            "build_commit": pp.get("build_commit"), "cpu_info": pp.get("cpu_info"), "type_k": pp.get("type_k")}


def main(args) -> int:
    from lucekv.cli_server import engine_options

    threads = [int(n) for n in args.threads.split(",")] if args.threads else None
    if args.llama_bench and not threads:
        threads = [numba.get_num_threads()]
    report(run(args.model, args.prompt_tokens, args.gen_tokens, args.repeats, engine_options(args),
               args.transformers, threads, args.llama_bench), args.json)
    return 0


def report(result: dict, json_path: str | None) -> None:
    """Print a benchmark's result and, when asked, write it as JSON."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(text + "\n")
