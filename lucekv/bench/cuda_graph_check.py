"""GPU check and timing of the CUDA decode graph: replayed steps must equal eager steps bit for bit.

    python -m lucekv.bench.cuda_graph_check [--n-embd 1024 --n-layer 8 --steps 64 --out result.json]

Random weights (lucekv.model.synth); prints JSON with both decode rates and the CPU-backend agreement of
the first logits.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from lucekv.backends.cpu import CpuBackend
from lucekv.backends.cuda import CudaBackend
from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import open_gguf
from lucekv.model.synth import write_synthetic_gguf


def decode(backend, first: np.ndarray, n_prompt: int, steps: int) -> tuple[list[np.ndarray], float]:
    """Greedy steps after the prompt; the logits of each step and the decode rate (tokens / s)."""
    logits, out = first, []
    start = time.perf_counter()
    for i in range(steps):
        p = np.array([n_prompt + i], np.int32)
        logits = backend.forward(np.array([np.argmax(logits[-1])], np.int32), p, p)
        out.append(logits)
    return out, steps / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    shape = dict(n_embd=a.n_embd, n_layer=a.n_layer, n_head=a.n_embd // 64, n_kv_head=max(a.n_embd // 512, 1),
                 head_dim=64, n_ff=4 * a.n_embd, n_ctx=4096)
    path = write_synthetic_gguf(Path(tempfile.mkdtemp()) / "m.gguf", "qwen2", qtype=GGMLQuantizationType.Q4_0,
                                **shape)
    g = open_gguf(path)
    spec = ModelSpec.from_gguf(g)
    prompt = np.arange(3, 35, dtype=np.int32)
    pos = np.arange(len(prompt), dtype=np.int32)
    result = {"model": f"random weights, qwen2 {shape}, Q4_0", "steps": a.steps}
    runs = {}
    for name, use_graph in (("eager", False), ("graph", True)):
        b = CudaBackend(g, spec, "f16", 1024, use_graph=use_graph)
        first = b.forward(prompt, pos, pos)
        decode(b, first, len(prompt), 2)  # compile (and capture) outside the timing
        b.pool.clear()
        first = b.forward(prompt, pos, pos)
        runs[name], result[f"{name}_tok_s"] = decode(b, first, len(prompt), a.steps)
    cpu_first = CpuBackend(g, spec, "f16", 1024).forward(prompt, pos, pos)
    result["prefill_rel_err_vs_cpu"] = float(np.abs(first - cpu_first).max() / np.abs(cpu_first).max())
    result["graph_equals_eager"] = all(np.array_equal(x, y) for x, y in zip(runs["eager"], runs["graph"], strict=True))
    print(json.dumps(result, indent=1))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    if not result["graph_equals_eager"]:
        raise SystemExit("graph replay differs from the eager step")


if __name__ == "__main__":
    main()
