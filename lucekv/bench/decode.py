"""`lucekv bench decode`: prefill and decode tokens per second through the public generate path; with
`--transformers`, Hugging Face transformers on the same GGUF, prompts and device in the same run (speed, and the
relative error of lucekv's logits against its float32 ones)."""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

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


def run(model: str, prompt_tokens: int, gen_tokens: int, repeats: int, engine_options: dict,
        transformers: bool = False) -> dict:
    from lucekv.model.registry import resolve_model

    path = resolve_model(model)
    engine = lucekv.load(path, **engine_options)
    params = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    prefill, decode = [], []
    prompts = [prompt_ids(engine.tokenizer.encode, prompt_tokens, i) for i in range(repeats + 1)]
    for i, ids in enumerate(prompts):  # the first run warms up numba's caches and is not counted
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
    result = {
        "bench": "decode",
        "commit": git_commit(),
        "machine": machine(),
        "model": {"name": engine.info.model_name, "arch": engine.info.arch, "file": path.name,
                  "sha256": file_sha256(path), "fingerprint": engine.info.fingerprint},
        "backend": engine.info.backend,
        "engine_options": engine_options,
        "command": "lucekv " + " ".join(sys.argv[1:]),
        "prompt_tokens": len(ids),
        "gen_tokens": gen_tokens,
        "repeats": repeats,
        "prefill_tok_s_median": statistics.median(prefill),
        "decode_tok_s_median": statistics.median(decode),
        "prefill_tok_s": prefill,
        "decode_tok_s": decode,
    }
    if transformers:
        from lucekv.bench import hf_anchor

        ours = engine.score(prompts[0][:hf_anchor.LOGIT_TOKENS])
        del engine  # its GPU memory goes before transformers loads
        hf = hf_anchor.anchor(path, prompts, gen_tokens, ours)
        result["transformers"] = hf
        result["over_transformers"] = {k: result[f"{k}_tok_s_median"] / hf[f"{k}_tok_s_median"]
                                       for k in ("prefill", "decode")}
    return result


def main(args) -> int:
    from lucekv.cli_server import engine_options

    report(run(args.model, args.prompt_tokens, args.gen_tokens, args.repeats, engine_options(args),
               args.transformers), args.json)
    return 0


def report(result: dict, json_path: str | None) -> None:
    """Print a benchmark's result and, when asked, write it as JSON."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(text + "\n")
