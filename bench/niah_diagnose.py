"""Issue 29's diagnosis of KVFlash recall misses on the RULER-style niah tasks (a few cases; not a benchmark).

Per case: the prompt but its 64-token tail is computed twice, once with the whole cache ("full K/V") and once through
a pool as the engine does ("pool K/V": each chunk computed beside the chunks resident as the prompt went); each is
kept as a snapshot. Then the tail and the answer run through a pooled engine from either snapshot, under a residency
chosen by:
  draft, quest          the policies;
  oracle-asked          the chunks of the needles the answer needs (the rest of the budget by recency);
  oracle-allneedles     the chunks of every needle, distractors too;
  oracle-exact          the exact attention mass the target's last 16 prompt queries, computed with the whole cache,
                        give each chunk (layers from the first third on).
A miss with the asked needle resident under full K/V but not under pool K/V is the pooled prefill's; a miss under
oracle-asked is the model's; one the oracles answer and a policy does not is the selection's. Also per case: the
needles' ranks under exact attention (all layers, the last two thirds, per-head votes).

  PYTHONPATH=. python bench/niah_diagnose.py --task multikey --cases 1,2,4 --pool 512 --json out.json
  (--no-recompute: the engine's prompt recall without computing the resident chunks again, as before it did)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial

import numpy as np

import lucekv
from lucekv.bench import ruler
from lucekv.bench.decode import git_commit, machine
from lucekv.engine.engine import PROMPT_TAIL
from lucekv.engine.sampling import SamplingParams
from lucekv.kvflash.draft import WithoutAttention
from lucekv.kvflash.pager import CHUNK_TOKENS
from lucekv.kvflash.sequence import PagedSequence
from lucekv.model.registry import resolve_model
from lucekv.snapshot.blob import Snapshot

DEPTHS = [0.1, 0.3, 0.5, 0.7, 0.9]
EXPERIMENTS = ("draft", "quest", "oracle-asked", "oracle-allneedles", "oracle-exact")


class FixedScores(WithoutAttention):
    """An oracle in the place of a session's scorer: the same chunk scores at every reselect."""

    name = "oracle"

    def __init__(self, scores: np.ndarray):
        self.fixed = np.asarray(scores, np.float64)

    def score_inputs(self, pager, queries=None):
        s = np.full(pager.n_chunks, -1e9)
        m = min(pager.n_chunks, len(self.fixed))
        s[:m] = self.fixed[:m]
        return s

    def score(self, inputs):
        return inputs

    def scores(self, pager):
        return self.score_inputs(pager)

    def truncate(self, n_tokens):
        pass


def chunks_of(spans) -> list[int]:
    return sorted({c for a, b in spans for c in range(a // CHUNK_TOKENS, (b - 1) // CHUNK_TOKENS + 1)})


def exact_mass(keys: np.ndarray, queries: np.ndarray, first_layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """keys [n_layer, n, n_kv, d] of the prefix, queries [rows, n_layer, n_head, d] of the tail: per chunk the softmax
    mass over the prefix summed over layers from first_layer and heads, mean over rows; and per (layer, head)."""
    n_layer, n, n_kv, d = keys.shape
    rows, _, n_head, _ = queries.shape
    mass, heads = np.zeros(n), []
    for layer in range(first_layer, n_layer):
        q = queries[:, layer].reshape(rows, n_kv, n_head // n_kv, d)
        logits = np.einsum("rkgd,nkd->rkgn", q, keys[layer].astype(np.float32)) / np.sqrt(d)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        mass += p.sum(axis=(1, 2)).mean(0)
        heads.append(p.mean(0).reshape(n_head, n))
    nch = n // CHUNK_TOKENS
    per_head = np.stack(heads)[:, :, : nch * CHUNK_TOKENS].reshape(len(heads), n_head, nch, CHUNK_TOKENS).sum(-1)
    return mass[: nch * CHUNK_TOKENS].reshape(nch, CHUNK_TOKENS).sum(1), per_head


def rank_of(scores: np.ndarray, chunks: list[int], protected: np.ndarray) -> list[int]:
    cand = np.flatnonzero(~protected)
    order = cand[np.argsort(-scores[cand], kind="stable")]
    rank = {int(c): i for i, c in enumerate(order)}
    return [rank.get(c, -1) for c in chunks]


def answer(engine, snap: Snapshot, case: ruler.Case, scorer=None) -> dict:
    engine.restore(snap, "e")
    if scorer is not None:
        engine.sessions.get("e").paged.policy.scorer = scorer
    t = time.time()
    text = "".join(d.text for d in engine.generate(case.ids, SamplingParams(temperature=0.0,
                                                                              max_tokens=case.max_tokens), "e"))
    pager = engine.sessions.get("e").paged.pager
    asked = chunks_of(case.needles)
    out = {"score": case.score(text), "output": text[:80], "seconds": round(time.time() - t, 1),
           "resident": pager.resident_chunks().tolist(),
           "asked_rank": rank_of(pager.scores[: pager.n_chunks].copy(), asked, pager.protected_mask())}
    out["asked_resident"] = [c in out["resident"] for c in asked]
    engine.delete_session("e")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", required=True, choices=ruler.TASKS)
    ap.add_argument("--cases", required=True, help="case indices, comma-separated")
    ap.add_argument("--pool", type=int, default=512)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--corpus", default=".data/niah-corpus.json")
    ap.add_argument("--experiments", default=",".join(EXPERIMENTS))
    ap.add_argument("--kv", default="pool,full", help="pool, full or both")
    ap.add_argument("--no-recompute", action="store_true")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    if a.no_recompute:
        PagedSequence.resident_spans = lambda self, end: []
    exps, kvs = a.experiments.split(","), a.kv.split(",")
    path = resolve_model(a.model)
    full = lucekv.load(path, backend=a.backend)
    pooled = {"draft": lucekv.load(path, backend=a.backend, kv_pool=a.pool, kv_policy="draft", kv_drafter=a.model),
              "quest": lucekv.load(path, backend=a.backend, kv_pool=a.pool, kv_policy="quest")}
    corpus = ruler.load_corpus(a.corpus)
    tokenize = partial(full.tokenizer.encode, add_special=False)
    spans: dict = {}
    assemble = ruler._assemble  # every needle's span, distractors too (a case keeps those the answer needs)
    ruler._assemble = lambda *args: spans.__setitem__("all", assemble(*args)[1]) or assemble(*args)
    head = {"command": "python " + " ".join(sys.argv), "commit": git_commit(), "machine": machine(),
            "model": a.model, "pool_tokens": a.pool, "context": a.context, "cases": []}
    for index in [int(i) for i in a.cases.split(",")]:
        case = ruler.make_case(a.task, index, a.context, corpus, tokenize, DEPTHS)
        asked, every = chunks_of(case.needles), chunks_of(spans["all"])
        prefix = case.ids[:-PROMPT_TAIL]
        row = {"task": a.task, "index": index, "kind": case.kind, "depth": case.depth, "expected": case.expected,
               "asked_chunks": asked, "needle_chunks": every}
        t = time.time()
        full.prefill(prefix, "f")
        header, chunks = full.snapshot("f")
        snaps = {"full": Snapshot(header, chunks, 0)}
        full.prefill(case.ids, "f")
        queries = full.backend.recent_queries()[-16:].copy()  # the tail's, with the whole cache
        text = "".join(d.text for d in full.generate(case.ids, SamplingParams(temperature=0.0,
                                                                               max_tokens=case.max_tokens), "f"))
        full.delete_session("f")
        row["full_cache"] = {"score": case.score(text), "output": text[:80], "seconds": round(time.time() - t, 1)}
        keys = np.concatenate([c[:, 0] for c in chunks], axis=1)
        n_chunks = keys.shape[1] // CHUNK_TOKENS
        sink = np.zeros(n_chunks, bool)
        sink[0] = True
        m_all, per_head = exact_mass(keys, queries)
        m_deep, _ = exact_mass(keys, queries, first_layer=full.spec.n_layer // 3)
        votes = np.bincount((np.argsort(-per_head[:, :, 1:], axis=-1)[:, :, :2] + 1).ravel(), minlength=n_chunks)
        row["exact_rank"] = {"all_layers": rank_of(m_all, asked, sink), "last_two_thirds": rank_of(m_deep, asked, sink),
                             "head_votes_top2": rank_of(votes + 1e-3 * m_all, asked, sink)}
        t = time.time()
        pooled["draft"].prefill(prefix, "p")
        header, chunks = pooled["draft"].snapshot("p")
        snaps["pool"] = Snapshot(header, chunks, 0)
        pooled["draft"].delete_session("p")
        row["pooled_prefill_seconds"] = round(time.time() - t, 1)
        pad = np.zeros(PROMPT_TAIL // CHUNK_TOKENS + 8)
        oracle = {"oracle-asked": np.isin(np.arange(n_chunks + len(pad)), asked).astype(float),
                  "oracle-allneedles": np.isin(np.arange(n_chunks + len(pad)), every).astype(float),
                  "oracle-exact": np.r_[m_deep, pad]}
        row["experiments"] = {}
        for kv in kvs:
            for e in exps:
                engine = pooled["draft" if e == "draft" else "quest"]
                result = answer(engine, snaps[kv], case, FixedScores(oracle[e]) if e in oracle else None)
                row["experiments"][f"{e}/{kv} K/V"] = result
                print(index, e, kv, result, file=sys.stderr, flush=True)
        head["cases"].append(row)
        with open(a.json, "w") as f:
            json.dump(head, f, indent=1)


if __name__ == "__main__":
    main()
