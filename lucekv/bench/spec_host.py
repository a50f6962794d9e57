"""`python -m lucekv.bench.spec_host`: the engine's host time per plain decode token and per speculative round, with
a backend whose forwards cost nothing (no GPU needed).

The model's tokenizer and shape come from a real GGUF (its weights are never read); the backend (`InstantBackend`)
keeps the real slot map and block pool but answers every forward at once with a scripted continuation: the
greedy token after position p is `reference[p + 1]`. So what is timed is everything a step does besides the
device's work: the scheduler, the pager's allocations, the drafter, the verify rule, the output stream
(detokenizer, stops), the gate. Two workloads of `bench spec`'s shape: edit (the answer copies a standard-library
file of the prompt: long suffix matches) and novel (the answer is another file: drafts rarely match).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

import lucekv.engine.engine as engine_module
from lucekv.backends.slots import SlotMap
from lucekv.engine.config import EngineConfig
from lucekv.engine.sampling import SamplingParams
from lucekv.kvflash.pager import CHUNK_TOKENS
from lucekv.spec.config import SpecConfig


class InstantBackend:
    """The backend interface (lucekv.backends.cpu.CpuBackend's) with the slot map's bookkeeping and no compute: the
    greedy token after position p is reference[p + 1] (p past its end: token 0)."""

    name = "instant"
    prefill_chunk = 512

    def __init__(self, vocab_size: int, n_slots: int):
        self.vocab_size = vocab_size
        self.pool = SlotMap(n_slots)
        self.pool.dtype = np.float16
        self.reference = np.zeros(0, np.int32)
        self._ahead: deque[int] = deque()
        self._last_ahead = 0

    def _next(self, positions: np.ndarray) -> np.ndarray:
        p = np.asarray(positions, np.int64) + 1
        return np.where(p < len(self.reference), self.reference[np.minimum(p, len(self.reference) - 1)], 0
                        ).astype(np.int32)

    def forward(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, all_logits: bool = False,
                tables: Sequence[np.ndarray] | None = None) -> np.ndarray:
        self.pool.assign(slots, positions)
        rows = positions if all_logits or (tables is not None and len(tables) == len(tokens)) else positions[-1:]
        logits = np.zeros((len(rows), self.vocab_size), np.float32)
        logits[np.arange(len(rows)), self._next(rows)] = 1.0
        return logits

    def forward_argmax(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                       tables: Sequence[np.ndarray] | None = None) -> np.ndarray:
        self.pool.assign(slots, positions)
        return self._next(positions)

    def verify_width(self, n: int) -> int:
        return n

    def decode_rows(self, tokens, positions, slots, tables, sampled):
        self.pool.assign(slots, positions)
        return self._next(positions), np.zeros((len(sampled), self.vocab_size), np.float32)

    def decode_ahead(self, position: int, slot: int, token: int | None = None, table: np.ndarray | None = None
                     ) -> None:
        self.pool.assign(np.array([slot], np.int32), np.array([position], np.int32))
        self._ahead.append(int(self._next(np.array([position]))[0]))

    def next_token(self) -> int:
        return self._ahead.popleft()

    def discard_ahead(self) -> None:
        self._ahead.clear()

    def prepare(self, step_tokens: int, verify_width: int) -> None:
        pass

    def execute(self, moves, host) -> None:
        if moves:
            raise RuntimeError("the instant backend holds whole contexts: nothing pages")


def instant_engine(model: Path, n_ctx: int, mode_default: str = "off", sequences: int = 2,
                   backend: Callable[[int, int], InstantBackend] = InstantBackend) -> engine_module.Engine:
    """An Engine of `model`'s tokenizer and shape on an InstantBackend (or a subclass), its pool room for `sequences`
    whole contexts."""
    original = engine_module._make_backend

    def make(name, g, spec, kv_dtype, n_ctx_, *_options):  # (the pool, batch and backend options: none apply)
        return backend(spec.vocab_size, (-(-n_ctx_ // CHUNK_TOKENS) + 1) * CHUNK_TOKENS * sequences), None

    engine_module._make_backend = make
    try:
        config = EngineConfig(n_ctx=n_ctx, speculation=SpecConfig(mode_default, shared_outputs=False))
        return engine_module.Engine(model, config)
    finally:
        engine_module._make_backend = original


def workload_texts(kind: str) -> tuple[list[dict], str]:
    """(chat prompt, the answer the scripted model gives): edit copies the prompt's file with one rename; novel
    answers with a file the prompt does not hold."""
    from lucekv.bench.spec import edit_prompts

    prompts = edit_prompts(2)
    text = prompts[0][0]["content"]
    body = text.split("```python\n", 1)[1].split("```", 1)[0]
    if kind == "edit":
        return prompts[0], "```python\n" + body
    other = prompts[1][0]["content"].split("```python\n", 1)[1].split("```", 1)[0]
    return prompts[0], other


def measure(engine, kind: str, mode: str, max_tokens: int, repeats: int) -> dict:
    """Host seconds per generated token and per round (thread CPU time and wall), best of `repeats`."""
    chat, answer = workload_texts(kind)
    ids = engine.prepare(chat, SamplingParams(max_tokens=1))
    engine.backend.reference = np.array(ids + engine.tokenizer.encode(answer, add_special=False), np.int32)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    best = None
    for _ in range(repeats):
        t_wall, t_cpu = time.perf_counter(), time.thread_time()
        out = list(engine.generate(ids, params, speculation=mode))
        wall, cpu = time.perf_counter() - t_wall, time.thread_time() - t_cpu
        if best is None or cpu < best[1]:
            best = (wall, cpu, out)
    wall, cpu, out = best
    tokens = sum(len(d.token_ids) for d in out)
    spec = out[-1].usage.speculation
    rounds = spec.rounds if spec else 0
    steps = rounds + (spec.plain_steps if spec else tokens)
    return {"tokens": tokens, "steps": steps, "rounds": rounds,
            "tau": round((rounds + spec.accepted) / rounds, 2) if rounds else None,
            "us_per_token_cpu": round(1e6 * cpu / tokens, 1), "us_per_step_cpu": round(1e6 * cpu / steps, 1),
            "us_per_step_wall": round(1e6 * wall / steps, 1)}


# where a step's host time goes: (label, module path suffix, function), each counted with what it calls
PARTS = [
    ("engine step (all of it)", "engine/engine.py", "step"),
    ("scheduler", "engine/scheduler.py", "schedule"),
    ("drafter propose", "spec/suffix.py", "propose"),
    ("drafter accept (index the tokens)", "spec/suffix.py", "accept"),
    ("verify rule", "spec/verify.py", "accept_greedy"),
    ("gate", "spec/gate.py", "real_round"),
    ("gate (plain steps, shadow)", "spec/speculator.py", "plain"),
    ("output (detokenize, stops, delta)", "engine/request.py", "emit"),
    ("pager alloc", "kvflash/sequence.py", "alloc"),
    ("pager after_forward", "kvflash/sequence.py", "after_forward"),
    ("block table", "kvflash/sequence.py", "table"),
    ("backend call (slot map only here)", "bench/spec_host.py", "forward_argmax"),
    ("backend call (slot map only here)", "bench/spec_host.py", "decode_ahead"),
]


def breakdown(engine, kind: str, mode: str, max_tokens: int) -> dict:
    """cProfile (thread CPU time) of one call: each part's cumulative microseconds per step (round or plain token).
    cProfile slows Python down, so the parts read as shares of `engine step`, whose unprofiled time `measure`
    gives."""
    chat, answer = workload_texts(kind)
    ids = engine.prepare(chat, SamplingParams(max_tokens=1))
    engine.backend.reference = np.array(ids + engine.tokenizer.encode(answer, add_special=False), np.int32)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prof = cProfile.Profile(time.thread_time)  # CPU time: the machine may be busy
    prof.enable()
    out = list(engine.generate(ids, params, speculation=mode))
    prof.disable()
    spec = out[-1].usage.speculation
    steps = spec.rounds + spec.plain_steps if spec else sum(len(d.token_ids) for d in out)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive, tottime, cumtime, callers)
    parts: dict[str, float] = {}
    for label, path, name in PARTS:
        cum = sum(v[3] for (f, _, fn), v in stats.items() if fn == name and f.endswith(path))
        if cum:
            parts[label] = round(parts.get(label, 0.0) + 1e6 * cum / steps, 1)
    return {"steps": steps, "us_per_step_profiled": parts}


def main(argv: list[str] | None = None) -> int:
    from lucekv.model.registry import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the result here")
    a = ap.parse_args(argv)
    from lucekv.bench.decode import git_commit, machine

    engine = instant_engine(resolve_model(a.model), n_ctx=8192)
    # the machine's load: the figures are thread CPU time, but a busy machine's caches and clocks still shift them
    result = {"bench": "spec_host", "commit": git_commit(), "machine": machine(),
              "load_avg_1_5_15_min_at_start": list(os.getloadavg()),
              "command": " ".join(["python -m lucekv.bench.spec_host", *sys.argv[1:]]),
              "model": engine.info.model_name, "max_tokens": a.max_tokens, "repeats": a.repeats, "runs": {}}
    for kind in ("edit", "novel"):
        for mode in ("off", "suffix", "auto"):
            r = measure(engine, kind, mode, a.max_tokens, a.repeats)
            result["runs"][f"{kind}/{mode}"] = r
            print(f"{kind:6s} {mode:7s} {json.dumps(r)}", file=sys.stderr)
    for kind, mode in (("edit", "off"), ("edit", "suffix"), ("novel", "suffix")):
        r = breakdown(engine, kind, mode, a.max_tokens)
        result["breakdown"] = {**result.get("breakdown", {}), f"{kind}/{mode}": r}
        print(f"{kind:6s} {mode:7s} per step, profiled: {json.dumps(r)}", file=sys.stderr)
    result["load_avg_1_5_15_min_at_end"] = list(os.getloadavg())
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
