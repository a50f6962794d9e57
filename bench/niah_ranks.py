"""Issue 29: where the needles' chunks rank, per case, under scoring rules computed from one whole-context read of the
prompt by a drafter (the draft policy's reader: the target itself, or a small model with its tokenizer), and whether a
pool's recallable blocks can hold them at all. No answers are generated (bench/niah_diagnose.py does that): this is the
cheap half of the diagnosis, one forward over the prompt per case.

Per case it keeps (in `--cache DIR`, so rules are compared again without the model):
  mass[L, H, n]     the attention probability each (layer, head) of the drafter's last 16 queries gives each position
                    (mean over the queries), for layers from the first third on: what the draft scorer sums;
  link[nc, nc]      per chunk pair: the attention mass the queries of the first chunk's tokens give the second's keys
                    (summed over heads of the same layers, over the chunk's tokens): which chunk reads which, for a
                    second scoring round that follows a chain (vartrack's assignments).
Then per rule and budget (recallable blocks: the pool's blocks less sink, head and protected tail), the share of the
answer's needles whose chunks are all among the best `budget` (or protected): the most the answer can get from that
selection. With --lexical there is no read: the first round is the question's links, any context, in seconds.

  PYTHONPATH=. python bench/niah_ranks.py --tasks multivalue,vartrack --cases 0-9 --json out.json
  PYTHONPATH=. python bench/niah_ranks.py --lexical --context 8192 --pools 1024,512 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

import lucekv
from lucekv.bench import ruler
from lucekv.bench.decode import git_commit, machine
from lucekv.kvflash.draft import DRAFT_QUERIES, SMOOTH, first_scored_layer
from lucekv.kvflash.links import GramIndex, line_breaks, link_round
from lucekv.kvflash.pager import CHUNK_TOKENS
from lucekv.kvflash.sequence import tail_chunks
from lucekv.model.gguf import open_gguf
from lucekv.model.registry import resolve_model
from lucekv.model.tokenizer import Tokenizer

DEPTHS = [0.1, 0.3, 0.5, 0.7, 0.9]


def read_case(engine, ids: list[int]) -> dict[str, np.ndarray]:
    """One forward over `ids` (in the backend's batches), keeping `mass` and `link` (see the module's doc)."""
    backend, spec = engine.backend, engine.spec
    n, first = len(ids), first_scored_layer(spec.n_layer)
    n_kv = spec.n_kv_head
    nc = -(-n // CHUNK_TOKENS)
    link = np.zeros((nc, nc))
    start = 0
    while start < n:
        end = min(n, start + backend.prefill_chunk)
        if n - end < DRAFT_QUERIES and end < n:  # the last DRAFT_QUERIES tokens in one forward
            end = n - DRAFT_QUERIES
        pos = np.arange(start, end, dtype=np.int32)
        backend.forward(np.asarray(ids[start:end], np.int32), pos, pos)
        rows = end - start
        for layer in range(first, spec.n_layer):
            p = _probs(backend.ops.queries[layer], backend.pool.k[layer][:end], pos, n_kv)  # [n_kv, g, rows, end]
            per_row = p.sum(axis=(0, 1))  # [rows, end]
            padded = np.zeros((rows, nc * CHUNK_TOKENS))
            padded[:, :end] = per_row
            by_chunk = padded.reshape(rows, nc, CHUNK_TOKENS).sum(-1)  # [rows, nc]
            np.add.at(link, pos // CHUNK_TOKENS, by_chunk)
        start = end
    mass = []
    for layer in range(first, spec.n_layer):
        p = _probs(backend.ops.queries[layer][-DRAFT_QUERIES:], backend.pool.k[layer][:n],
                   np.arange(n - DRAFT_QUERIES, n), n_kv)
        mass.append(p.mean(2).reshape(spec.n_head, n))
    return {"mass": np.stack(mass).astype(np.float32), "link": link.astype(np.float32)}


def _probs(q: np.ndarray, k: np.ndarray, pos: np.ndarray, n_kv: int) -> np.ndarray:
    """Causal softmax of queries [rows, n_head, d] at `pos` over keys [n, n_kv, d]: [n_kv, group, rows, n]."""
    rows, n_head, d = q.shape
    q = q.reshape(rows, n_kv, n_head // n_kv, d).transpose(1, 2, 0, 3).reshape(n_kv, -1, d)
    logits = (q @ k.astype(np.float32).transpose(1, 2, 0)).reshape(n_kv, n_head // n_kv, rows, -1) / np.sqrt(d)
    logits[..., np.arange(k.shape[0])[None, :] > pos[:, None]] = -np.inf
    logits -= logits.max(-1, keepdims=True)
    np.exp(logits, out=logits)
    logits /= logits.sum(-1, keepdims=True)
    return logits


# ---- rules: per chunk a score, higher keeps ------------------------------------------------------------------------


def _chunks(token: np.ndarray) -> np.ndarray:
    n = len(token)
    return np.add.reduceat(token, np.arange(0, n, CHUNK_TOKENS))


def _smooth(token: np.ndarray) -> np.ndarray:
    return np.convolve(token, np.ones(SMOOTH) / SMOOTH, mode="same")


def rule_draft(m: dict) -> np.ndarray:
    """Today's draft scorer: the mass summed over heads and layers, smoothed, summed per chunk."""
    return _chunks(_smooth(m["mass"].sum(axis=(0, 1), dtype=np.float64)))


def per_head_chunks(m: dict) -> np.ndarray:
    """[L*H, nc] each head's chunk mass (smoothed as the draft scorer smooths)."""
    mass = m["mass"].reshape(-1, m["mass"].shape[-1]).astype(np.float64)
    return np.stack([_chunks(_smooth(h)) for h in mass])


def rule_votes(m: dict, top: int = 2) -> np.ndarray:
    """Each (layer, head) votes for its `top` chunks (sink chunk excluded); ties by the summed mass."""
    heads = per_head_chunks(m)
    heads[:, 0] = -1
    votes = np.zeros(heads.shape[1])
    for row in np.argsort(-heads, axis=1)[:, :top]:
        votes[row] += 1
    return votes + 1e-3 * rule_draft(m) / rule_draft(m).max()


def rule_share(m: dict) -> np.ndarray:
    """Per head the chunk's share of the head's mass over chunks (sink excluded), then the max over heads."""
    heads = per_head_chunks(m)[:, 1:]
    share = heads / heads.sum(axis=1, keepdims=True)
    return np.r_[np.inf, share.max(axis=0)]


def with_neighbours(scores: np.ndarray, m: dict, edge: int = 16) -> np.ndarray:
    """A chunk whose mass sits within `edge` tokens of a boundary lends its neighbour across it half its score (a
    needle cut by the boundary needs both)."""
    token = _smooth(m["mass"].sum(axis=(0, 1), dtype=np.float64))
    n = len(token)
    nc = len(scores)
    out = scores.copy()
    for c in range(nc):
        seg = token[c * CHUNK_TOKENS : min(n, (c + 1) * CHUNK_TOKENS)]
        if seg.sum() <= 0:
            continue
        if c > 0 and seg[:edge].sum() > 0.25 * seg.sum():
            out[c - 1] = max(out[c - 1], 0.5 * scores[c])
        if c + 1 < nc and seg[-edge:].sum() > 0.25 * seg.sum():
            out[c + 1] = max(out[c + 1], 0.5 * scores[c])
    return out


def lift(link: np.ndarray) -> np.ndarray:
    """link[c, r] (c later than r by two chunks or more; NaN elsewhere) over the median link at that distance: what
    chunk c's queries give chunk r beyond what any chunk gives one that far back (attention decays with distance)."""
    nc = len(link)
    out = np.full(link.shape, np.nan)
    for dist in range(2, nc - 1):
        c = np.arange(1 + dist, nc)
        r = c - dist  # the sink (chunk 0) left out: every chunk gives it much
        out[c, r] = link[c, r] / (np.median(link[c, r]) + 1e-9)
    return out


def attention_round(scores: np.ndarray, m: dict, protected: np.ndarray, backward_only: bool = False) -> np.ndarray:
    """A second round by the drafter's own chunk-to-chunk attention (needs a second whole-context pass: a diagnosis,
    not a scorer): the first round's best stays first, then the chunks most linked with it by `lift`, either way (a
    later chunk reading it, or it reading an earlier chunk; with `backward_only` the latter alone, which needs only
    the best chunk's own queries)."""
    best = _select(scores, protected, 1)
    f = lift(m["link"].astype(np.float64))
    gain = np.nan_to_num(f[best, :], nan=0).max(0)
    if not backward_only:
        gain = np.maximum(gain, np.nan_to_num(f[:, best], nan=0).max(1))
    out = gain + 1e-3 * (scores - scores.min()) / (np.ptp(scores) + 1e-300)
    out[best] = np.inf
    return out


RULES = {"draft": rule_draft, "votes2": rule_votes, "share-max": rule_share,
         "draft+neighbours": lambda m: with_neighbours(rule_draft(m), m)}


def ranked(m: dict, index: GramIndex, protected: np.ndarray, budget: int) -> dict[str, np.ndarray]:
    """Every rule's scores, and the second rounds of the draft rule: lexical (the draft policy's, kvflash.links, on
    the case's `index`) and by attention."""
    out = {name: rule(m) for name, rule in RULES.items()}
    cand = np.flatnonzero(~protected)
    for name in ("draft", "share-max"):
        out[f"{name}+links"] = link_round(out[name], cand, index, DRAFT_QUERIES, budget)
    out["draft+attention-round"] = attention_round(out["draft"], m, protected)
    out["draft+attention-round/backward"] = attention_round(out["draft"], m, protected, backward_only=True)
    return out


def _select(scores: np.ndarray, protected: np.ndarray, budget: int) -> np.ndarray:
    cand = np.flatnonzero(~protected)
    return cand[np.argsort(-scores[cand], kind="stable")[:budget]]


def coverage(selected: set[int], needle_chunks: list[list[int]]) -> float:
    """Share of the answer's needles whose chunks are all selected."""
    return sum(all(c in selected for c in cs) for cs in needle_chunks) / len(needle_chunks)


def best_possible(needle_chunks: list[list[int]], budget: int) -> float:
    """The most needles `budget` blocks can cover (needles of fewest chunks first: they share none here)."""
    held: set[int] = set()
    for cs in sorted(needle_chunks, key=len):
        if len(held | set(cs)) <= budget:
            held |= set(cs)
    return coverage(held, needle_chunks)


def protected_mask(nc: int, tail: int) -> np.ndarray:
    mask = np.zeros(nc, bool)
    mask[0] = True
    mask[max(0, nc - 1 - tail) :] = True
    return mask


def lexical_ranked(index: GramIndex, protected: np.ndarray, budget: int) -> dict[str, np.ndarray]:
    """Without the drafter's read: the question's links alone as the first round, and the second round after it."""
    first = index.strength(index.n_tokens - DRAFT_QUERIES, index.n_tokens)
    return {"question": first,
            "question+links": link_round(first, np.flatnonzero(~protected), index, DRAFT_QUERIES, budget)}


def evaluate(m: dict | None, ids: list[int], needle_spans: list[tuple[int, int]], pools: list[int],
             breaks: np.ndarray) -> dict:
    """Per pool and protected tail (today's, and none): the recallable blocks, the chunks the needles take (those
    protected are held anyway), and per rule the needles covered and each needle chunk's rank among the evictable
    chunks (0 = best; -1: protected). Without the drafter's read `m`, the lexical rules (`lexical_ranked`)."""
    nc = m["link"].shape[0] if m is not None else -(-len(ids) // CHUNK_TOKENS)
    needles = [list(range(a // CHUNK_TOKENS, (b - 1) // CHUNK_TOKENS + 1)) for a, b in needle_spans]
    out = {}
    index = GramIndex(breaks)
    index.extend(ids)
    for pool in pools:
        blocks = pool // CHUNK_TOKENS
        for tail in sorted({tail_chunks(blocks), 0}):
            protected = protected_mask(nc, tail)
            budget = blocks - int(protected.sum())
            if budget <= 0:
                continue
            held = set(np.flatnonzero(protected).tolist())
            to_recall = [[c for c in cs if c not in held] for cs in needles]
            row = {"recallable_blocks": budget, "needle_chunks": len({c for cs in to_recall for c in cs}),
                   "best_possible": best_possible(to_recall, budget)}
            cand = np.flatnonzero(~protected)
            rules = ranked(m, index, protected, budget) if m is not None else lexical_ranked(index, protected, budget)
            for name, scores in rules.items():
                order = cand[np.argsort(-scores[cand], kind="stable")]
                rank = {int(c): i for i, c in enumerate(order)}
                row[name] = {"covered": coverage(held | set(order[:budget].tolist()), needles),
                             "ranks": [[rank.get(c, -1) for c in cs] for cs in needles]}
            out[f"pool{pool}/tail{tail}"] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="multikey,multivalue,vartrack")
    ap.add_argument("--cases", default="0-9", help="a range a-b or indices, comma-separated")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--pools", default="512,256")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="the drafter (here also the target)")
    ap.add_argument("--corpus", default=".data/niah-corpus.json")
    ap.add_argument("--cache", default=".data/niah-ranks")
    ap.add_argument("--cached-only", action="store_true", help="rank the cases already read (no model)")
    ap.add_argument("--lexical", action="store_true", help="no drafter's read: the question's links as the first "
                    "round (no model, any context)")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    cases = (list(range(int(a.cases.split("-")[0]), int(a.cases.split("-")[1]) + 1)) if "-" in a.cases
             else [int(i) for i in a.cases.split(",")])
    pools = [int(p) for p in a.pools.split(",")]
    path = resolve_model(a.model)
    tokenizer = Tokenizer.from_metadata(open_gguf(path).metadata)
    tokenize, breaks = partial(tokenizer.encode, add_special=False), line_breaks(tokenizer.pieces)
    engine = None
    corpus = ruler.load_corpus(a.corpus)
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    head = {"command": "python " + " ".join(sys.argv), "commit": git_commit(), "machine": machine(),
            "model": a.model, "context": a.context, "pools": pools, "cases": []}
    for task in a.tasks.split(","):
        for index in cases:
            f = cache / f"{a.model}-{a.context}-{task}-{index}.npz"
            t = time.time()
            case = ruler.make_case(task, index, a.context, corpus, tokenize, DEPTHS)
            if a.lexical:
                m = None
            elif f.exists():
                m = dict(np.load(f))
            elif a.cached_only:
                continue
            else:
                if engine is None:
                    engine = lucekv.load(path, backend="cpu", n_ctx=a.context + 64)
                m = read_case(engine, case.ids)
                np.savez(f, **m)
            info = {"task": task, "index": index, "kind": case.kind, "depth": case.depth, "needles": case.needles,
                    "n_chunks": -(-len(case.ids) // CHUNK_TOKENS), "seconds": round(time.time() - t, 1)}
            info["rules"] = evaluate(m, case.ids, case.needles, pools, breaks)
            head["cases"].append(info)
            brief = {k: {r: v[r]["covered"] for r in v if isinstance(v[r], dict)} for k, v in info["rules"].items()}
            print(task, index, info["seconds"], json.dumps(brief), file=sys.stderr, flush=True)
            Path(a.json).write_text(json.dumps(head, indent=1))
    summary = {}
    for c in head["cases"]:
        for key, row in c["rules"].items():
            for r, v in row.items():
                value = v["covered"] if isinstance(v, dict) else v
                summary.setdefault(c["task"], {}).setdefault(key, {}).setdefault(r, []).append(value)
    head["summary"] = {t: {k: {"cases": len(rows["best_possible"]),
                               **{r: round(float(np.mean(v)), 3) for r, v in rows.items()}}
                           for k, rows in ks.items()} for t, ks in summary.items()}
    Path(a.json).write_text(json.dumps(head, indent=1))
    print(json.dumps(head["summary"], indent=1))


if __name__ == "__main__":
    main()
