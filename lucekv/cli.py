"""The `lucekv` command line."""

from __future__ import annotations

import argparse
import sys

from lucekv.errors import LucekvError


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")


def sampling_from_args(args: argparse.Namespace):
    from lucekv.engine.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed,
                          max_tokens=args.max_tokens, stop=args.stop)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--kv-dtype", default="f16", choices=["f16", "f32"])


def cmd_run(args: argparse.Namespace) -> int:
    import lucekv

    engine = lucekv.load(args.model, backend=args.backend, kv_dtype=args.kv_dtype)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    for delta in engine.generate(prompt, sampling_from_args(args)):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from lucekv.bench import decode

    return decode.main(args)


def build_parser() -> argparse.ArgumentParser:
    from lucekv.cli_models import add_models_commands
    from lucekv.cli_server import add_server_commands
    from lucekv.model.registry import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="lucekv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate a completion locally (no server)")
    run.add_argument("model", help="registry name (see `lucekv models list`) or GGUF path")
    run.add_argument("prompt")
    add_sampling_flags(run)
    add_engine_flags(run)
    run.set_defaults(func=cmd_run)

    bench = sub.add_parser("bench", help="benchmarks (write JSON)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    dec = bench_sub.add_parser("decode", help="prefill and decode tokens/s")
    dec.add_argument("--model", default=DEFAULT_MODEL)
    dec.add_argument("--prompt-tokens", type=int, default=128)
    dec.add_argument("--gen-tokens", type=int, default=64)
    dec.add_argument("--repeats", type=int, default=3)
    dec.add_argument("--json", help="also write the result here")
    add_engine_flags(dec)
    dec.set_defaults(func=cmd_bench)

    add_models_commands(sub)
    add_server_commands(sub)
    return parser


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
