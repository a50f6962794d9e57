"""Host-side cost per decoded token of the KVFlash paged path, without a GPU: `python -m lucekv.bench.paging_overhead`.

A PagedSequence over a fake backend (moves cost nothing; chunk keys and queries are random float32 views) takes a
context as a restored session does (a parked pager, every full chunk sealed), recalls for its last query as the
engine does after a prompt, then decodes: per step `alloc` of one position and `after_forward(decoded=1)`. Timed
from the end of the first reselect to the end of the third, so reselects are amortized over their own interval at
that depth. What the GPU does is not counted; everything the pager, the policy and the scorer do on the host is,
split into bookkeeping per step, sealing, applying reselects, and waiting for their scoring. A reselect is scored
on a background thread while decoding goes on and applied RESELECT_LAG decoded tokens later: here the fake steps
take microseconds, so the decode thread waits for the scoring at the apply; on a GPU that wait is hidden when the
lag's decode steps outlast the scoring (reported apart, per reselect).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from lucekv.bench.decode import git_commit, machine
from lucekv.kvflash import policy as policy_module
from lucekv.kvflash.blocks import BlockPool
from lucekv.kvflash.pager import CHUNK_TOKENS, Move, Pager
from lucekv.kvflash.policy import POLICIES
from lucekv.kvflash.sequence import PagedSequence

# Qwen3-8B's shape
N_LAYER, N_HEAD, N_KV_HEAD, HEAD_DIM = 36, 32, 8, 128
CONTEXTS = (4096, 16384, 65536, 131072)
POOL_TOKENS = 4096
TAU = 64
RESELECTS = 2  # timed reselect intervals


class FakeBackend:
    """Moves nothing. Keys and queries are views at random offsets of one random buffer: distinct per call, free."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.key_shape = (N_LAYER, CHUNK_TOKENS, N_KV_HEAD, HEAD_DIM)
        self.buf = rng.standard_normal(2 * int(np.prod(self.key_shape)), np.float32)
        self.moves = 0

    def execute(self, moves: list[Move], host) -> None:
        self.moves += len(moves)

    def chunk_keys(self, block: int) -> np.ndarray:
        return self._view(self.key_shape)

    def last_queries(self, row: int = -1) -> np.ndarray:
        return self._view((N_LAYER, N_HEAD, HEAD_DIM))

    def _view(self, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        off = int(self.rng.integers(0, len(self.buf) - n))
        return self.buf[off : off + n].reshape(shape)


class Timer:
    """Wraps a bound method, adding its wall time (ns) and calls."""

    def __init__(self, fn):
        self.fn, self.ns, self.calls, self.first_ns = fn, 0, 0, 0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return self.fn(*args, **kwargs)
        finally:
            ns = time.perf_counter_ns() - t0
            self.first_ns = self.first_ns or ns
            self.ns += ns
            self.calls += 1


def restored(policy: str, context: int, rng: np.random.Generator) -> PagedSequence:
    """A sequence of `context` tokens as Engine.restore + resume + the prompt's recall leave it."""
    backend = FakeBackend(rng)
    seq = PagedSequence(backend, BlockPool(POOL_TOKENS // CHUNK_TOKENS, CHUNK_TOKENS), POOL_TOKENS,
                        n_layer=N_LAYER, n_kv_head=N_KV_HEAD, head_dim=HEAD_DIM, dtype=np.dtype(np.float16),
                        policy=policy, tau=TAU, window=0)
    p = seq.pager
    seq.pager = Pager.parked(p.pool_tokens, context, p.chunk, p.sink_chunks, p.tail_chunks, p.chunk_bytes, p.blocks)
    for c in range(context // CHUNK_TOKENS):
        seq.policy.scorer.seal(seq.pager, c, backend.chunk_keys(0))
    seq.resume()
    seq.recall_for_prompt(1)
    return seq


class TimedScoring:
    """The policy's scoring executor, with the decode thread's waits for the scores timed."""

    def __init__(self, executor):
        self.executor, self.wait = executor, Timer(None)

    def submit(self, fn, *args):
        future = self.executor.submit(fn, *args)
        self.wait.fn = future.result
        future.result = self.wait.__call__  # the instance attribute shadows the method
        return future


def measure(policy: str, context: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    seq = restored(policy, context, rng)
    setup_s = time.perf_counter() - t0
    scorer = seq.policy.scorer
    seal, score, apply = Timer(scorer.seal), Timer(scorer.score), Timer(policy_module.reselect)
    scoring = TimedScoring(policy_module._SCORING)
    scorer.seal, scorer.score = seal, score
    policy_module.reselect, policy_module._SCORING = apply, scoring
    try:
        pos = context
        # Warm-up: up to the first reselect applied. Its first seal grows the summary tables (doubling) when the
        # context is a power-of-two number of chunks: a one-off reported apart, not a per-token cost.
        while apply.calls < 1:
            seq.alloc(pos, 1)
            seq.after_forward(decoded=1)
            pos += 1
        first_seal_ms = seal.first_ns * 1e-6
        for t in (seal, score, apply, scoring.wait):
            t.ns = t.calls = 0
        start, first = time.perf_counter_ns(), pos
        while apply.calls < RESELECTS:
            seq.alloc(pos, 1)
            seq.after_forward(decoded=1)
            pos += 1
        total = time.perf_counter_ns() - start
    finally:
        policy_module.reselect, policy_module._SCORING = apply.fn, scoring.executor
    steps, wait = pos - first, scoring.wait.ns
    us = 1e-3 / steps  # ns summed over the run -> us per decoded token
    return {"policy": policy, "context": context, "steps": steps, "reselects": apply.calls, "seals": seal.calls,
            "setup_s": round(setup_s, 2), "first_seal_ms": first_seal_ms,
            "total_us": total * us, "bookkeeping_us": (total - seal.ns - apply.ns - wait) * us,
            "sealing_us": seal.ns * us, "reselect_us": apply.ns * us, "wait_us": wait * us,
            "reselect_ms_each": apply.ns / RESELECTS * 1e-6, "scoring_ms_each": score.ns / RESELECTS * 1e-6,
            "moves": seq.backend.moves}


def table(rows: list[dict]) -> str:
    head = (f"{'policy':8} {'context':>7} {'steps':>5} {'resel':>5} | {'total':>7} {'bookkp':>7} {'seal':>7} "
            f"{'apply':>7} {'wait':>7} us/tok | {'apply':>7} {'score':>7} ms each | {'1st seal':>8} ms")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['policy']:8} {r['context']:>7} {r['steps']:>5} {r['reselects']:>5} | {r['total_us']:7.1f} "
                     f"{r['bookkeeping_us']:7.1f} {r['sealing_us']:7.1f} {r['reselect_us']:7.1f} {r['wait_us']:7.1f}"
                     f"        | "
                     f"{r['reselect_ms_each']:7.2f} {r['scoring_ms_each']:7.2f}         | {r['first_seal_ms']:8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lucekv.bench.paging_overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE", help="write the result as JSON")
    args = ap.parse_args(argv)
    rows = []
    for context in args.contexts:
        for policy in args.policies:
            rows.append(measure(policy, context, args.seed))
            print(table(rows[-1:]).splitlines()[-1], file=sys.stderr)
    print(table(rows))
    if args.json:
        result = {"bench": "paging_overhead", "commit": git_commit(), "machine": machine(),
                  "settings": {"pool_tokens": POOL_TOKENS, "tau": TAU, "n_layer": N_LAYER, "n_head": N_HEAD,
                               "n_kv_head": N_KV_HEAD, "head_dim": HEAD_DIM, "seed": args.seed},
                  "rows": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
