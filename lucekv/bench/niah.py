"""`lucekv bench niah`: needle-in-a-haystack recall, full cache against KVFlash pools per policy.

The haystack is RULER-style repeated noise; the needle is a passphrase placed at a depth; the model
completes "The secret passphrase is '" greedily. Recall = share of (depth) cases answered exactly.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import lucekv
from lucekv.bench.decode import file_sha256, git_commit, machine, report
from lucekv.engine.sampling import SamplingParams
from lucekv.errors import ConfigError
from lucekv.kvflash.pager import CHUNK_TOKENS
from lucekv.model.registry import resolve_model

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The secret passphrase is 'blue-harbor-4721'. Remember it. "
ANSWER = "blue-harbor-4721"
QUESTION = "\nWhat is the secret passphrase mentioned in the text above? The secret passphrase is '"


def haystack_prompt(tokenize, context: int, depth: float) -> list[int]:
    noise = tokenize(NOISE)
    needle, question = tokenize(NEEDLE), tokenize(QUESTION)
    n_noise = context - len(needle) - len(question)
    hay = (noise * (n_noise // len(noise) + 1))[:n_noise]
    at = int(len(hay) * depth)
    return hay[:at] + needle + hay[at:] + question


def answer(engine: lucekv.Engine, ids: list[int]) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    return "".join(d.text for d in engine.generate(ids, params))


def run(model: str, backend: str, context: int, depths: list[float], residencies: list[float],
        policies: list[str], json_path: str | None = None) -> dict:
    """The recall table; with `json_path`, rewritten there after every configuration (a long run that is
    stopped keeps what it measured)."""
    path = resolve_model(model)
    sha256 = file_sha256(path)
    configs = [("full", None, None)] + [(p, r, int(context * r) // CHUNK_TOKENS * CHUNK_TOKENS)
                                        for p in policies for r in residencies]
    rows = []
    for policy, residency, pool in configs:
        try:
            engine = lucekv.load(path, backend=backend, kv_pool=pool, kv_policy=policy if pool else "quest")
        except ConfigError as e:
            rows.append({"policy": policy, "residency": residency, "pool_tokens": pool, "error": str(e)})
            print(f"{policy} {residency}: {e}", file=sys.stderr)
            continue
        hits, outputs, t0 = 0, [], time.perf_counter()
        for depth in depths:
            text = answer(engine, haystack_prompt(engine.tokenizer.encode, context, depth))
            hits += ANSWER in text
            outputs.append(text)
        rows.append({"policy": policy, "residency": residency, "pool_tokens": pool, "recall": hits / len(depths),
                     "outputs": outputs, "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{policy} residency {residency}: recall {hits}/{len(depths)}", file=sys.stderr)
        if json_path:
            Path(json_path).write_text(json.dumps(result(engine, path, sha256, context, depths, rows), indent=2) + "\n")
    return result(engine, path, sha256, context, depths, rows)


def result(engine: lucekv.Engine, path: Path, sha256: str, context: int, depths: list[float],
           rows: list[dict]) -> dict:
    info = engine.info
    return {"bench": "niah", "commit": git_commit(), "machine": machine(), "backend": info.backend,
            "model": {"name": info.model_name, "file": path.name, "sha256": sha256},
            "command": "lucekv " + " ".join(sys.argv[1:]), "context": context, "depths": depths, "results": rows}


def main(args) -> int:
    floats = lambda text: [float(v) for v in text.split(",")]  # noqa: E731
    report(run(args.model, args.backend, args.context, floats(args.depths), floats(args.residencies),
               args.policies.split(","), args.json), args.json)
    return 0
