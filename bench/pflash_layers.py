"""PFlash's selection against the drafter's depth (issue 27; a diagnosis, not a benchmark): would a drafter cut to its
first L layers select the needles as the whole one does?

The drafter's time bounds PFlash's gain: it reads the whole prompt. Its first L layers compute the same keys and
queries whether or not the layers after them run, so one reading by the whole drafter gives, per case, the spans a
drafter of L layers would select (scoring its layers from L // 3 on, as lucekv.kvflash.draft does for any depth).
Per case, keep ratio and depth: the share of each needle's tokens kept. Nothing but the drafter runs.

  PYTHONPATH=. python bench/pflash_layers.py --drafter qwen2.5-coder-0.5b --context 4096 --tasks multikey \
      --cases 2 --corpus .data/niah-corpus.json --keeps 0.1,0.25 --layers 8,12,16,24 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial

import lucekv
from lucekv.bench import ruler
from lucekv.bench.decode import git_commit, machine
from lucekv.kvflash.draft import DraftReader, token_scores
from lucekv.pflash.selection import select_spans

DEPTHS = [0.1, 0.3, 0.5, 0.7, 0.9]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tasks", default="multikey,multivalue,vartrack")
    ap.add_argument("--cases", type=int, default=2)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--keeps", default="0.1,0.25")
    ap.add_argument("--layers", default="8,12,16,24", help="drafter depths to select with (at most its layers)")
    ap.add_argument("--json")
    args = ap.parse_args()
    engine = lucekv.load(args.drafter, backend=args.backend, max_batch=1)
    reader = DraftReader(engine)
    corpus = ruler.load_corpus(args.corpus)
    tokenize = partial(engine.tokenizer.encode, add_special=False)
    keeps = [float(k) for k in args.keeps.split(",")]
    depths = [min(int(n), engine.spec.n_layer) for n in args.layers.split(",")]
    rows = []
    result = {"bench": "pflash-layers", "commit": git_commit(), "machine": machine(), "backend": engine.info.backend,
              "drafter": engine.info.model_name, "command": "python bench/pflash_layers.py " + " ".join(sys.argv[1:]),
              "corpus_sha256": ruler.corpus_sha256(args.corpus), "context": args.context, "rows": rows}
    for task in args.tasks.split(","):
        for i in range(args.cases):
            case = ruler.make_case(task, i, args.context, corpus, tokenize, DEPTHS)
            t0 = time.perf_counter()
            reader.read(object(), case.ids, [len(case.ids)])
            read_s = time.perf_counter() - t0
            queries, sealed, rest = reader.inputs()
            kept = {}
            for n in depths:
                scores = token_scores(queries[:, :n], sealed[:n], rest[:n])
                for keep in keeps:
                    positions = set(select_spans(scores, case.ids, 0, keep).positions().tolist())
                    kept[f"L{n}-keep{keep}"] = [round(sum(p in positions for p in range(a, b)) / (b - a), 3)
                                               for a, b in case.needles]
            rows.append({"task": task, "index": i, "kind": case.kind, "depth": case.depth, "read_s": round(read_s, 1),
                         "needle_kept": kept})
            print(task, i, case.kind, f"read {read_s:.1f}s", kept, file=sys.stderr, flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1)
    result["summary"] = {name: round(sum(sum(r["needle_kept"][name]) / len(r["needle_kept"][name]) for r in rows)
                                     / len(rows), 3) for name in rows[0]["needle_kept"]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
