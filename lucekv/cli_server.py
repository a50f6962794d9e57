"""`lucekv serve`, and the client commands `lucekv generate` and `lucekv info` that talk to a server.

Each command stores its handler as `func` in the parsed namespace; the handler returns the exit code.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import grpc

import lucekv
from lucekv.client import DEFAULT_ADDRESS, FINISH_REASON_NAMES, Client, SamplingOptions
from lucekv.errors import LucekvError
from lucekv.model.registry import DEFAULT_MODEL, MODELS, TextProgress, is_pulled, pull, resolve_model
from lucekv.server.app import DEFAULT_HOST, DEFAULT_PORT, LucekvServer, ServerOptions, serve

# (field, type, help) for the sampling flags of `generate` and `run`; --max-tokens sets max_tokens, etc.
# Unset flags stay None and take the server's (SamplingParams') defaults.
_SAMPLING_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("max_tokens", int, "most tokens to generate (server default 256)"),
    ("min_tokens", int, "generate at least this many tokens"),
    ("temperature", float, "0 = greedy (server default 1.0)"),
    ("top_p", float, "nucleus sampling mass"),
    ("top_k", int, "sample among the k most likely tokens (0 = off)"),
    ("min_p", float, "drop tokens below min_p times the top probability"),
    ("repetition_penalty", float, "1 = off"),
    ("presence_penalty", float, "0 = off"),
    ("frequency_penalty", float, "0 = off"),
    ("seed", int, "same seed and request give the same output"),
)


def add_server_commands(subparsers: argparse._SubParsersAction) -> None:
    server = subparsers.add_parser("serve", help="start the gRPC server")
    server.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"registry name (downloaded if missing) or .gguf path (default {DEFAULT_MODEL})",
    )
    server.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    server.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"0 picks a free port (default {DEFAULT_PORT})"
    )
    add_engine_flags(server)
    server.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="Generate calls that may wait for the engine; more get RESOURCE_EXHAUSTED (default 64)",
    )
    server.set_defaults(func=run_serve)

    generate = subparsers.add_parser("generate", help="stream a completion from a running server to stdout")
    generate.add_argument("prompt", metavar="PROMPT")
    generate.add_argument(
        "--server", default=DEFAULT_ADDRESS, help=f"server address (default {DEFAULT_ADDRESS})"
    )
    add_sampling_flags(generate)
    generate.set_defaults(func=run_generate)

    info = subparsers.add_parser("info", help="show the model and settings of a running server")
    info.add_argument("--server", default=DEFAULT_ADDRESS, help=f"server address (default {DEFAULT_ADDRESS})")
    info.set_defaults(func=run_info)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--kv-dtype", default="f16", choices=("f16", "f32"), help="KV cache storage (default f16)")
    parser.add_argument("--kv-pool", default="auto", type=_kv_pool,
                        help="KV slots kept on the device, in tokens (a multiple of 64); colder chunks page to host "
                             "RAM. 'off' holds the whole context; 'auto' (default) is 'off' on the CPU backend")
    parser.add_argument("--kv-policy", default="quest", choices=("lru", "quest", "meankey"),
                        help="which paged-out chunks come back (default quest)")
    parser.add_argument("--kv-tau", type=int, default=64, help="decoded tokens between reselects (default 64)")


def engine_options(args: argparse.Namespace) -> dict:
    """lucekv.load keyword arguments from the engine flags."""
    return {"backend": args.backend, "kv_dtype": args.kv_dtype, "kv_pool": args.kv_pool,
            "kv_policy": args.kv_policy, "kv_tau": args.kv_tau}


def _kv_pool(value: str) -> int | str | None:
    if value in ("auto", "off"):
        return None if value == "off" else value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, 'auto' or 'off', not {value!r}") from None


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chat", action="store_true", help="send PROMPT as a user message through the model's chat template"
    )
    for name, kind, help_text in _SAMPLING_FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), type=kind, help=help_text)
    parser.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    parser.add_argument(
        "--ignore-eos", action="store_true", default=None, help="keep generating past end-of-generation tokens"
    )


def sampling_values(args: argparse.Namespace) -> dict:
    """The sampling flags the user set, by SamplingParams/SamplingOptions field name."""
    values = {name: getattr(args, name) for name, _, _ in _SAMPLING_FLAGS}
    values.update(stop=args.stop or [], ignore_eos=args.ignore_eos)
    return {k: v for k, v in values.items() if v is not None}


def chat_or_text(args: argparse.Namespace):
    return [{"role": "user", "content": args.prompt}] if args.chat else args.prompt


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = lucekv.load(_model_file(args.model), **engine_options(args))
    except LucekvError as e:
        print(f"lucekv: error: {e}", file=sys.stderr)
        return 1

    def announce(server: LucekvServer) -> None:
        info = engine.info
        print(
            f"lucekv: serving {info.model_name} ({info.arch}, {info.backend} backend) on "
            f"{args.host}:{server.port}",
            file=sys.stderr,
            flush=True,
        )

    try:
        serve(engine, ServerOptions(args.host, args.port, args.max_queue), announce)
    except LucekvError as e:
        print(f"lucekv: error: {e}", file=sys.stderr)
        return 1
    return 0


def _model_file(model: str) -> Path:
    if model in MODELS and not is_pulled(model):
        pull(model, TextProgress())  # shows download progress; resolve_model alone would fetch silently
    return resolve_model(model)


def run_generate(args: argparse.Namespace) -> int:
    sampling = SamplingOptions(**sampling_values(args))
    prompt = chat_or_text(args)
    wrote = False
    try:
        with Client(args.server) as client:
            for chunk in client.generate(prompt, sampling):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                wrote = wrote or bool(chunk.text)
    except grpc.RpcError as e:
        if wrote:
            _end_terminal_line()
        print(f"lucekv: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    _end_terminal_line()
    u = chunk.usage
    print(
        f"[{FINISH_REASON_NAMES[chunk.finish_reason]}: {u.prompt_tokens} prompt + {u.completion_tokens} "
        f"completion tokens, first token {u.time_to_first_token_ms:.0f} ms, "
        f"{u.decode_tokens_per_second:.1f} tok/s]",
        file=sys.stderr,
    )
    return 0


def _end_terminal_line() -> None:
    """On a terminal, end the streamed text's line so what follows starts on its own; pipes get the text as is."""
    if sys.stdout.isatty():
        sys.stdout.write("\n")
        sys.stdout.flush()


def run_info(args: argparse.Namespace) -> int:
    try:
        with Client(args.server) as client:
            info = client.server_info(timeout=10)
    except grpc.RpcError as e:
        print(f"lucekv: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    rows = [
        ("server", args.server),
        ("model", info.model_name),
        ("arch", info.arch),
        ("fingerprint", info.fingerprint),
        ("context", str(info.context_length)),
        ("vocab", str(info.vocab_size)),
        ("layers", str(info.n_layer)),
        ("embedding", str(info.n_embd)),
        ("backend", info.backend),
        ("kv pool", f"{info.kv_pool_tokens} tokens, {info.kv_policy}" if info.kv_pool_tokens else "whole context"),
        ("features", ", ".join(info.features)),
        ("max queue", str(info.max_queued_requests)),
        ("version", info.version),
    ]
    for key, value in rows:
        print(f"{key + ':':<13}{value}")
    return 0
