"""`lucekv bench links`: the cost of the draft policy's lexical second round (kvflash.links) per reselect, on this
machine's CPU, at long contexts (issue 29). It runs on the scoring thread, beside the decode loop's host work.

At each context a RULER-style case (lucekv.bench.ruler: real text of the niah corpus, the model's tokenizer) is read
as a sequence decoding its last `reselects` reselect intervals (tau_eff tokens each, the policy's schedule): at each
reselect the round takes the tokens since the last one and ranks the chunks for a pool of `residency` of the context
(the protected sink and tail as the engine's; a random first round: the second round's cost is in its index and the
chunks it visits). The first reselect indexes the whole context so far (a restored session's first); the others are
the steady state. Times are wall clock and the thread's CPU time (this machine's cores may be shared: the load
average is recorded).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from lucekv.bench import ruler
from lucekv.bench.decode import git_commit, machine, report
from lucekv.kvflash.draft import DRAFT_QUERIES
from lucekv.kvflash.links import SequenceLinks, line_breaks
from lucekv.kvflash.pager import CHUNK_TOKENS
from lucekv.kvflash.policy import tau_eff
from lucekv.kvflash.sequence import tail_chunks
from lucekv.model.gguf import open_gguf
from lucekv.model.registry import resolve_model
from lucekv.model.tokenizer import Tokenizer

# a reselect's round: (tokens so far, first-round scores, evictable chunks, their budget) -> second-round scores
Round = Callable[[int, np.ndarray, np.ndarray, int], np.ndarray]


def linked_round(history: Sequence[int], breaks: np.ndarray) -> Round:
    """The draft policy's round (Policy._scoring's, without the scorer)."""
    links = SequenceLinks(lambda: history, breaks)
    return lambda n_tokens, scores, candidates, budget: links.round(links.take(n_tokens), scores, candidates,
                                                                    DRAFT_QUERIES, budget)


def measure(ids: list[int], pool_tokens: int, reselects: int, make_round: Callable[[Sequence[int]], Round],
            seed: int = 0) -> dict:
    """Per reselect of `ids` read as decoded in its last `reselects` intervals (see the module's doc): ms, wall and
    thread CPU, of `make_round(history)`'s rounds; the first (the whole context indexed) apart."""
    steps = [len(ids)]
    for _ in range(reselects):
        steps.insert(0, steps[0] - tau_eff(steps[0], 64))
    history: list[int] = list(ids[: steps[0]])
    round_ = make_round(history)
    rng = np.random.default_rng(seed)
    blocks = pool_tokens // CHUNK_TOKENS
    wall, cpu, budgets = [], [], []
    for n in steps:
        history.extend(ids[len(history) : n])
        n_chunks = -(-n // CHUNK_TOKENS)
        protected = np.zeros(n_chunks, bool)
        protected[0] = True  # the sink
        protected[max(0, n_chunks - 1 - tail_chunks(blocks)) :] = True  # the head chunk and the tail before it
        budget = blocks - int(protected.sum())
        scores = rng.random(n_chunks)
        t, c = time.perf_counter(), time.thread_time()
        round_(n, scores, np.flatnonzero(~protected), budget)
        wall.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.thread_time() - c) * 1e3)
        budgets.append(budget)

    def spread(ms: list[float]) -> dict:
        return {"min": round(min(ms), 3), "median": round(statistics.median(ms), 3), "max": round(max(ms), 3)}

    return {"context": len(ids), "reselect_tokens": tau_eff(len(ids), 64), "recallable_blocks": budgets[-1],
            "first_ms": {"wall": round(wall[0], 3), "cpu": round(cpu[0], 3), "tokens": steps[0]},
            "reselect_ms": {"wall": spread(wall[1:]), "cpu": spread(cpu[1:]), "reselects": reselects}}


def run(model: str, contexts: list[int], residency: float, reselects: int, task: str, corpus_path: str,
        make_round: Callable[[Sequence[int], np.ndarray], Round] = linked_round) -> dict:
    tokenizer = Tokenizer.from_metadata(open_gguf(resolve_model(model)).metadata)
    tokenize, breaks = partial(tokenizer.encode, add_special=False), line_breaks(tokenizer.pieces)
    corpus = ruler.load_corpus(corpus_path)
    rows = []
    for context in contexts:
        case = ruler.make_case(task, 0, context, corpus, tokenize, [0.5])
        pool = int(context * residency) // CHUNK_TOKENS * CHUNK_TOKENS
        rows.append(measure(case.ids, pool, reselects, partial(make_round, breaks=breaks)))
        print(f"{context}: first {rows[-1]['first_ms']['wall']:.1f} ms, then per reselect "
              f"{rows[-1]['reselect_ms']['wall']['median']:.2f} ms (median wall)", file=sys.stderr, flush=True)
    return {"bench": "links", "command": " ".join(["lucekv", *sys.argv[1:]]), "commit": git_commit(),
            "machine": {**machine(), "load_average_1m": round(os.getloadavg()[0], 1)}, "model": model, "task": task,
            "residency": residency, "corpus_sha256": ruler.corpus_sha256(corpus_path), "contexts": rows}


def main(args) -> int:
    report(run(args.model, [int(c) for c in args.contexts.split(",")], args.residency, args.reselects, args.task,
               args.corpus), args.json)
    return 0
