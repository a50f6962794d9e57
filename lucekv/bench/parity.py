"""CUDA backend against the CPU backend on one model: logits and greedy tokens (a check, run on a GPU).

    python -m lucekv.bench.parity MODEL [--tokens 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import lucekv
from lucekv.engine.sampling import SamplingParams

PROSE = ("The history of the Roman Empire spans more than a thousand years. Its roads, laws and languages "
         "shaped Europe. def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")


def greedy(engine: lucekv.Engine, ids: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [d.token_ids[0] for d in engine.generate(ids, params)]


def compare(model: str, n_tokens: int, kv_dtype: str) -> dict:
    cpu = lucekv.load(model, backend="cpu", kv_dtype=kv_dtype)
    gpu = lucekv.load(model, backend="cuda", kv_dtype=kv_dtype)
    ids = cpu.tokenizer.encode(PROSE * 4)[:64]
    a, b = cpu.score(ids), gpu.score(ids)
    rel = float(np.abs(a - b).max() / np.abs(a).max())
    ta, tb = greedy(cpu, ids, n_tokens), greedy(gpu, ids, n_tokens)
    differ = [i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y]
    agree = float((a.argmax(-1) == b.argmax(-1)).mean())
    return {"kv_dtype": kv_dtype, "max_rel_logit_err": rel, "argmax_agree": agree,
            "greedy_tokens": n_tokens, "first_differing_position": differ[0] if differ else None,
            "differing_positions": len(differ)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    result = {"model": Path(args.model).name,
              "runs": [compare(args.model, args.tokens, dtype) for dtype in ("f32", "f16")]}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if all(r["max_rel_logit_err"] <= 1e-2 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
