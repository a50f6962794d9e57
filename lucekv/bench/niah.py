"""`lucekv bench niah`: long-context recall, the full cache against KVFlash pools per policy and residency.

Tasks: "passkey", the sanity case (one passphrase in repeated filler sentences, which any key-statistics scorer
spots), and the RULER-style tasks of `lucekv.bench.ruler` over real haystacks (multikey, multivalue, vartrack),
generated from a corpus file (`lucekv bench niah-corpus`). Greedy completions, exact scoring: a case scores the
share of its expected strings in the completion; a configuration's recall is the mean over its cases.

With `--prefill-compression KEEP`, a "pflash" configuration runs beside the full cache on the same cases: its prompts
compressed (lucekv.pflash, the drafter --kv-drafter), each case's time to first token beside the full prefill's (both
engines hold one sequence, max_batch 1) and the share of each needle's tokens kept (`needle_kept`), and the summary
gives the medians and their ratio.

Per case the JSON also says, for a pooled run, where the chunks holding the needles the answer needs stand after
the answer: resident or not (and when its first token was sampled: `needle_resident_at_answer`), and their rank among
the evictable chunks in the policy's last scores (0 = best): a miss with the needle resident is the model's, a miss
with it paged out is the selection's.
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

import lucekv
from lucekv.bench import ruler
from lucekv.bench.decode import file_sha256, git_commit, machine, report
from lucekv.engine.engine import PROMPT_TAIL
from lucekv.engine.sampling import SamplingParams
from lucekv.errors import ConfigError
from lucekv.kvflash.pager import CHUNK_TOKENS
from lucekv.model.registry import resolve_model
from lucekv.pflash.compressor import DEFAULT_THRESHOLD
from lucekv.snapshot.blob import Snapshot

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The secret passphrase is 'blue-harbor-4721'. Remember it. "
ANSWER = "blue-harbor-4721"
QUESTION = "\nWhat is the secret passphrase mentioned in the text above? The secret passphrase is '"
TASKS = ("passkey", *ruler.TASKS)


def haystack_prompt(tokenize, context: int, depth: float) -> list[int]:
    noise = tokenize(NOISE)
    needle, question = tokenize(NEEDLE), tokenize(QUESTION)
    n_noise = context - len(needle) - len(question)
    hay = (noise * (n_noise // len(noise) + 1))[:n_noise]
    at = int(len(hay) * depth)
    return hay[:at] + needle + hay[at:] + question


def passkey_case(index: int, context: int, tokenize, depths: list[float]) -> ruler.Case:
    depth = depths[index % len(depths)]
    ids = haystack_prompt(tokenize, context, depth)
    needle = len(tokenize(NEEDLE))
    at = int((context - needle - len(tokenize(QUESTION))) * depth)
    return ruler.Case("passkey", index, "filler", depth, ids, [ANSWER], [(at, at + needle)], 12)


def cases_for(task: str, context: int, n_cases: int, corpus: dict | None, tokenize, depths: list[float]
              ) -> list[ruler.Case]:
    if task == "passkey":
        return [passkey_case(i, context, tokenize, depths) for i in range(n_cases)]
    if corpus is None:
        raise ConfigError(f"task {task} needs a corpus: --corpus FILE (write one with `lucekv bench niah-corpus`)")
    return [ruler.make_case(task, i, context, corpus, tokenize, depths) for i in range(n_cases)]


def run_case(engine: lucekv.Engine, case: ruler.Case, session_id: str = "") -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=case.max_tokens)
    pieces, at_answer = [], None
    for d in engine.generate(case.ids, params, session_id):
        if at_answer is None and engine.paged is not None:  # the residency the answer's first token saw
            at_answer = engine.paged.pager.block_of[: engine.paged.pager.n_chunks] >= 0
        pieces.append(d.text)
    text, usage = "".join(pieces), d.usage
    row = {"index": case.index, "kind": case.kind, "depth": case.depth, "score": case.score(text), "output": text,
           "ttft_s": round(usage.time_to_first_token_s, 4), "prompt_tokens": usage.prompt_tokens,
           "prefilled_tokens": usage.prefilled_tokens}
    if usage.compression is not None:
        row["kept_tokens"], row["score_s"] = usage.compression.kept_tokens, round(usage.compression.score_s, 4)
        row["needle_kept"] = needles_kept(engine, case, usage)
    if engine.paged is not None:
        row.update(needle_placement(engine, case))
        row["needle_resident_at_answer"] = [bool(at_answer[c]) for c in row["needle_chunks"]]
    return row


def needles_kept(engine: lucekv.Engine, case: ruler.Case, usage) -> list[float]:
    """Per needle the answer needs, the share of its tokens a compressed prompt kept: a miss with the needle kept is
    the model's, a miss with it dropped the selection's. The selection is made again (the drafter still holds the
    prompt: only the scores are computed again, to the same spans)."""
    kept = set(engine.compressor.select(case.ids, usage.cached_tokens, usage.compression.keep_ratio)
               .positions().tolist())
    return [round(sum(p in kept for p in range(a, b)) / (b - a), 3) for a, b in case.needles]


def needle_placement(engine: lucekv.Engine, case: ruler.Case) -> dict:
    """Per chunk holding a needle the answer needs (a needle may straddle two): whether it is resident now, and its
    rank among the evictable chunks by the pager's scores (what the last reselect decided; ties broken as
    `reselect` does; -1: protected)."""
    pager = engine.paged.pager
    n = pager.n_chunks
    cand = np.flatnonzero(~pager.protected_mask())
    scores = pager.scores[:n]
    order = cand[np.lexsort((pager.last_use[cand], pager.block_of[cand] >= 0, scores[cand]))[::-1]]
    rank = {int(c): r for r, c in enumerate(order)}
    chunks = sorted({c for a, b in case.needles for c in range(a // CHUNK_TOKENS, (b - 1) // CHUNK_TOKENS + 1)})
    return {"needle_chunks": chunks, "needle_resident": [bool(pager.block_of[c] >= 0) for c in chunks],
            "needle_rank": [rank.get(c, -1) for c in chunks], "evictable_chunks": len(cand),
            "recallable_blocks": pager.n_blocks - int(pager.protected_mask().sum())}


def run(model: str, backend: str, contexts: list[int], tasks: list[str], n_cases: int, depths: list[float],
        residencies: list[float], policies: list[str], corpus_path: str | None, json_path: str | None = None,
        plot_path: str | None = None, drafter: str | None = None, keep: float | None = None,
        threshold: int = DEFAULT_THRESHOLD, drafter_layers: int = 0) -> dict:
    """The recall table; with `json_path`, rewritten there after every configuration (a long run that is
    stopped keeps what it measured).

    A pooled prompt is computed alike under every policy up to its tail (victims by recency: nothing is scored
    before the tail ranks the chunks), so per case and pool that part is computed once, by the first policy's
    engine, and the others take it over as a snapshot: each policy then ranks, recalls, recomputes the tail and
    answers.

    keep: besides the full cache, a "pflash" engine compressing prompts longer than `threshold` to this keep ratio
    (drafter: `drafter`, read with its first `drafter_layers` layers, 0: all)."""
    path = resolve_model(model)
    corpus = ruler.load_corpus(corpus_path) if corpus_path else None
    head = {"bench": "niah", "commit": git_commit(), "machine": machine(), "backend": backend,
            "model": {"file": path.name, "sha256": file_sha256(path)}, "command": "lucekv " + " ".join(sys.argv[1:]),
            "corpus": {"file": Path(corpus_path).name, "sha256": ruler.corpus_sha256(corpus_path)} if corpus_path
            else None, "drafter": drafter, "prefill_keep_ratio": keep, "prefill_threshold": threshold if keep else None,
            "prefill_drafter_layers": drafter_layers if keep else None,
            "contexts": contexts, "tasks": tasks, "cases": n_cases, "depths": depths,
            "results": []}
    rows = head["results"]
    for context in contexts:
        cases = None
        for residency in [None, *residencies]:
            pool = None if residency is None else int(context * residency) // CHUNK_TOKENS * CHUNK_TOKENS
            engines, errors = {}, {}
            for policy in (["full", *(["pflash"] if keep else [])]) if pool is None else policies:
                # beside a pflash engine, each holds one sequence's pool (on a GPU both fit)
                alone = {"max_batch": 1} if keep and pool is None else {}
                compress = {"prefill_compression": keep, "prefill_threshold": threshold, "prefill_drafter": drafter,
                            "prefill_drafter_layers": drafter_layers} if policy == "pflash" else {}
                try:
                    engines[policy] = lucekv.load(path, backend=backend, kv_pool=pool,
                                                  kv_policy=policy if pool else "quest",
                                                  kv_drafter=drafter if policy == "draft" else None, **alone,
                                                  **compress)
                except ConfigError as e:
                    errors[policy] = str(e)
                    rows.append({"context": context, "policy": policy, "residency": residency, "pool_tokens": pool,
                                 "error": str(e)})
                    _progress(f"{context} {policy} {residency}: {e}")
            if not engines:
                continue
            first = next(iter(engines.values()))
            head["backend"], head["model"]["name"] = first.info.backend, first.info.model_name
            if cases is None:
                tokenize = partial(first.tokenizer.encode, add_special=False)
                cases = {t: cases_for(t, context, n_cases, corpus, tokenize, depths) for t in tasks}
            for task in tasks:
                done: dict[str, list[dict]] = {p: [] for p in engines}
                t0 = time.perf_counter()
                for case in cases[task]:
                    for policy, row in run_policies(engines, case).items():
                        done[policy].append(row)
                for policy, cases_done in done.items():
                    recall = sum(c["score"] for c in cases_done) / len(cases_done)
                    rows.append({"context": context, "policy": policy, "residency": residency, "pool_tokens": pool,
                                 "task": task, "recall": recall, "cases": cases_done,
                                 "seconds_all_policies": round(time.perf_counter() - t0, 1)})
                    _progress(f"{context} {task} {policy} {residency}: recall {recall:.2f} over {len(cases_done)}")
                if json_path:
                    Path(json_path).write_text(json.dumps(head, indent=1) + "\n")
    head["summary"] = summary(rows)
    if plot_path:
        try_plot(head, plot_path)
    return head


def run_policies(engines: dict[str, lucekv.Engine], case: ruler.Case) -> dict[str, dict]:
    """The case through each engine (one per policy, one pool); the prompt but its tail computed once."""
    session = "niah"
    first = next(iter(engines.values()))
    out = {}
    if first.paged is not None:
        first.prefill(case.ids[:-PROMPT_TAIL], session)
        header, chunks = first.snapshot(session)
        for engine in list(engines.values())[1:]:
            engine.restore(Snapshot(header, chunks, 0), session)
    for policy, engine in engines.items():
        out[policy] = run_case(engine, case, session)
        engine.delete_session(session)
    return out


def summary(rows: list[dict]) -> list[dict]:
    """Per context, task and pooled configuration: recall and its share of the full cache's; for pflash also the
    median time to first token, the full prefill's, and their ratio."""
    full = {(r["context"], r["task"]): r for r in rows if r["policy"] == "full" and "recall" in r}
    out = []
    for r in rows:
        if "recall" not in r:
            continue
        base = full.get((r["context"], r["task"]))
        line = {"context": r["context"], "task": r["task"], "policy": r["policy"], "residency": r["residency"],
                "recall": round(r["recall"], 3),
                "of_full": round(r["recall"] / base["recall"], 3) if base and base["recall"] else None}
        if r["policy"] == "pflash":
            ttft = float(np.median([c["ttft_s"] for c in r["cases"]]))
            full_ttft = float(np.median([c["ttft_s"] for c in base["cases"]])) if base else None
            kept = sum(c.get("kept_tokens", c["prefilled_tokens"]) for c in r["cases"])
            line.update(kept_share=round(kept / sum(c["prompt_tokens"] for c in r["cases"]), 4),
                        ttft_median_s=round(ttft, 4), full_ttft_median_s=full_ttft and round(full_ttft, 4),
                        ttft_speedup=full_ttft and round(full_ttft / ttft, 2))
        out.append(line)
    return out



def plot(result: dict, png: str | Path) -> None:
    """Recall against residency, one panel per (context, task): a line per policy, the full cache dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["results"] if "recall" in r]
    contexts, tasks = result["contexts"], result["tasks"]
    fig, axes = plt.subplots(len(contexts), len(tasks), figsize=(3.2 * len(tasks), 2.8 * len(contexts)),
                             squeeze=False, sharey=True)
    for i, context in enumerate(contexts):
        for j, task in enumerate(tasks):
            ax = axes[i][j]
            mine = [r for r in rows if r["context"] == context and r["task"] == task]
            for r in mine:
                if r["policy"] == "full":
                    ax.axhline(r["recall"], color="k", ls="--", lw=1, label="full cache")
            for policy in dict.fromkeys(r["policy"] for r in mine if r["policy"] != "full"):
                pts = sorted((r["residency"], r["recall"]) for r in mine if r["policy"] == policy)
                ax.plot(*zip(*pts, strict=True), "o-", label=policy)
            ax.set_title(f"{task}, {context // 1024}K", fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.05, 1.05)
            if i == len(contexts) - 1:
                ax.set_xlabel("residency (pool / context)")
            if j == 0:
                ax.set_ylabel("recall")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{result['model'].get('name', result['model']['file'])}, {result['backend']}, "
                 f"{result['cases']} cases per task", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def try_plot(result: dict, png: str | Path) -> None:
    """After the JSON is written: a missing matplotlib must not lose a GPU run (`lucekv bench niah-plot` redraws)."""
    try:
        plot(result, png)
    except ImportError as e:
        _progress(f"no plot ({e}): install matplotlib and run `lucekv bench niah-plot RESULT.json -o {png}`")


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(args) -> int:
    floats = lambda text: [float(v) for v in text.split(",") if v]  # noqa: E731
    tasks = args.tasks.split(",")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ConfigError(f"unknown niah task(s) {', '.join(unknown)} (choose {', '.join(TASKS)})")
    report(run(args.model, args.backend, [int(c) for c in args.contexts.split(",")], tasks, args.cases,
               floats(args.depths), floats(args.residencies), args.policies.split(","), args.corpus, args.json,
               args.plot, args.kv_drafter, args.prefill_compression, args.prefill_threshold,
               args.prefill_drafter_layers), args.json)
    return 0



def main_corpus(args) -> int:
    print(json.dumps(ruler.build_corpus(args.output), indent=1))
    return 0
