"""`lucekv bench sessions`: what a session saves on the second turn, and what its snapshots cost.

A conversation of `--context` tokens is generated in a session; the second turn (the history plus a short
new message) is timed to its first token with the session (only the new tokens are computed) and without
(a fresh engine prefills everything). The session is then snapshotted and restored in memory: MB/s of
each, blob bytes per token.
"""

from __future__ import annotations

import statistics
import sys
import time

import lucekv
from lucekv.bench.decode import FILLER, file_sha256, git_commit, machine, report
from lucekv.engine.sampling import SamplingParams
from lucekv.model.registry import resolve_model
from lucekv.snapshot.blob import read_snapshot, write_snapshot

NEW_MESSAGE = "\nUser: question {} - and what does that mean for next year?\nAssistant:"


def first_token_s(engine: lucekv.Engine, ids: list[int], session_id: str = "") -> tuple[float, int]:
    """Time to the first token, and how many prompt tokens were reused."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    usage = list(engine.generate(ids, params, session_id))[-1].usage
    return usage.time_to_first_token_s, usage.cached_tokens


def run(model: str, context: int, repeats: int, engine_options: dict) -> dict:
    path = resolve_model(model)
    engine, baseline = lucekv.load(path, **engine_options), lucekv.load(path, **engine_options)
    tokenize = engine.tokenizer.encode
    history = tokenize(FILLER * (context // 20 + 2))[: context - 64]
    first_token_s(baseline, history[:128])  # warm-up: compiles the kernels
    first_token_s(engine, history, "bench")
    reuse, fresh = [], []
    for i in range(repeats):
        second = history + tokenize(NEW_MESSAGE.format(i), add_special=False)
        t, cached = first_token_s(engine, second, "bench")
        # the baseline's first token differs per run, so it never reuses the previous run's K/V
        t_fresh, cached_fresh = first_token_s(baseline, [history[1 + i], *second[1:]])
        if cached < len(history) or cached_fresh:
            raise RuntimeError(f"unexpected reuse: {cached} tokens with the session, {cached_fresh} without")
        reuse.append(t)
        fresh.append(t_fresh)
        print(f"run {i}: first token {t * 1e3:.0f} ms with the session, {t_fresh * 1e3:.0f} ms re-prefilling "
              f"{len(second)} tokens", file=sys.stderr)
    t0 = time.perf_counter()
    header, chunks = engine.snapshot("bench")
    blob = b"".join(write_snapshot(header, chunks.__getitem__))
    t_snapshot = time.perf_counter() - t0
    t0 = time.perf_counter()
    snap = read_snapshot([blob], engine.layout, max_tokens=engine.n_ctx, vocab_size=engine.spec.vocab_size)
    engine.restore(snap, "restored")
    t_restore = time.perf_counter() - t0
    mb = len(blob) / 1e6
    return {
        "bench": "sessions",
        "commit": git_commit(),
        "machine": machine(),
        "model": {"name": engine.info.model_name, "file": path.name, "sha256": file_sha256(path)},
        "backend": engine.info.backend,
        "engine_options": engine_options,
        "command": "lucekv " + " ".join(sys.argv[1:]),
        "history_tokens": len(history),
        "second_turn_tokens": len(second),
        "first_token_median_ms": {"with_session": statistics.median(reuse) * 1e3,
                                  "reprefill": statistics.median(fresh) * 1e3},
        "first_token_s_with_session": reuse,
        "first_token_s_reprefill": fresh,
        "speedup_median": statistics.median(fresh) / statistics.median(reuse),
        "blob_bytes": len(blob),
        "blob_bytes_per_token": len(blob) / header.n_tokens,
        "snapshot_mb_s": mb / t_snapshot,
        "restore_mb_s": mb / t_restore,
        "note": "snapshot = copy out of the pool + serialize + SHA-256; restore = parse + validate + install, in "
                "memory (no gRPC, no disk)",
    }


def main(args) -> int:
    from lucekv.cli_server import engine_options

    report(run(args.model, args.context, args.repeats, engine_options(args)), args.json)
    return 0
