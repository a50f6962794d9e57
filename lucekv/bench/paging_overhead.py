"""Host-side cost per decoded token of the KVFlash paged path, without a GPU: `python -m lucekv.bench.paging_overhead`.

A PagedSequence over a fake backend (moves cost nothing; chunk keys and queries are random float32 views) takes a
context as a restored session does (a parked pager, every full chunk sealed), recalls for its last query as the
engine does after a prompt, then decodes: per step `alloc` of one position and `after_forward(decoded=1)`. Timed
from the end of the first reselect to the end of the third, so reselects are amortized over their own interval at
that depth. What the GPU does is not counted; everything the pager, the policy and the scorer do on the host is,
split into bookkeeping per step, sealing, and reselects (scoring plus applying).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from lucekv.bench.decode import git_commit, machine
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

    def last_queries(self) -> np.ndarray:
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
    seq = PagedSequence(backend, np.full(POOL_TOKENS, -1, np.int32), n_layer=N_LAYER, n_kv_head=N_KV_HEAD,
                        head_dim=HEAD_DIM, dtype=np.dtype(np.float16), policy=policy, tau=TAU, window=0)
    p = seq.pager
    seq.pager = Pager.parked(p.pool_tokens, context, p.chunk, p.sink_chunks, p.tail_chunks, p.chunk_bytes)
    seq.pager.slot_pos = p.slot_pos
    for c in range(context // CHUNK_TOKENS):
        seq.policy.scorer.seal(seq.pager, c, backend.chunk_keys(0))
    seq.resume()
    seq.recall_for_last_query()
    return seq


def measure(policy: str, context: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    seq = restored(policy, context, rng)
    setup_s = time.perf_counter() - t0
    scorer, pol = seq.policy.scorer, seq.policy
    seal, scores, reselect = Timer(scorer.seal), Timer(scorer.scores), Timer(pol.reselect_now)
    scorer.seal, scorer.scores, pol.reselect_now = seal, scores, reselect
    pos = context
    # Warm-up: up to the first reselect. Its first seal grows the summary tables (doubling) when the context is a
    # power-of-two number of chunks: a one-off reported apart, not a per-token cost.
    while reselect.calls < 1:
        seq.alloc(pos, 1)
        seq.after_forward(decoded=1)
        pos += 1
    first_seal_ms = seal.first_ns * 1e-6
    for t in (seal, scores, reselect):
        t.ns = t.calls = 0
    start, first = time.perf_counter_ns(), pos
    while reselect.calls < RESELECTS:
        seq.alloc(pos, 1)
        seq.after_forward(decoded=1)
        pos += 1
    total = time.perf_counter_ns() - start
    steps, n_reselects = pos - first, reselect.calls
    us = 1e-3 / steps  # ns summed over the run -> us per decoded token
    return {"policy": policy, "context": context, "steps": steps, "reselects": reselect.calls, "seals": seal.calls,
            "setup_s": round(setup_s, 2), "first_seal_ms": first_seal_ms,
            "total_us": total * us, "bookkeeping_us": (total - seal.ns - reselect.ns) * us,
            "sealing_us": seal.ns * us, "reselect_us": reselect.ns * us,
            "reselect_ms_each": reselect.ns / n_reselects * 1e-6, "scoring_ms_each": scores.ns / n_reselects * 1e-6,
            "moves": seq.backend.moves}


def table(rows: list[dict]) -> str:
    head = (f"{'policy':8} {'context':>7} {'steps':>5} {'resel':>5} | {'total':>7} {'bookkp':>7} {'seal':>7} "
            f"{'resel':>7} us/tok | {'resel':>7} {'score':>7} ms each | {'1st seal':>8} ms")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['policy']:8} {r['context']:>7} {r['steps']:>5} {r['reselects']:>5} | {r['total_us']:7.1f} "
                     f"{r['bookkeeping_us']:7.1f} {r['sealing_us']:7.1f} {r['reselect_us']:7.1f}        | "
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
