"""`lucekv serve`, and the client commands that talk to a server: `generate`, `info`, `sessions`, `snapshot`,
`restore`.

Each command stores its handler as `func` in the parsed namespace; the handler returns the exit code.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import grpc

import lucekv
from lucekv.client import DEFAULT_ADDRESS, FINISH_REASON_NAMES, Client, SamplingOptions, TlsOptions
from lucekv.errors import LucekvError
from lucekv.model.registry import MODELS, TextProgress, is_pulled, pull, resolve_model
from lucekv.server.app import LucekvServer, serve
from lucekv.server.config import add_config_flags, config_from_args, format_config, settings
from lucekv.snapshot.store import open_snapshot_store
from lucekv.spec.config import MODES, SpecConfig

PIECE_BYTES = 1 << 20  # restore uploads the file in pieces of this size

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
    server = subparsers.add_parser(
        "serve", help="start the gRPC server",
        description="Every flag has a LUCEKV_* environment variable (--kv-pool: LUCEKV_KV_POOL); a flag beats its "
                    "variable.")
    add_config_flags(server)
    server.add_argument("--print-config", action="store_true",
                        help="print the settings (from flags, variables and defaults) and exit")
    server.set_defaults(func=run_serve)

    generate = subparsers.add_parser("generate", help="stream a completion from a running server to stdout")
    generate.add_argument("prompt", metavar="PROMPT")
    _add_server_flag(generate)
    generate.add_argument("--session", default="", metavar="ID",
                          help="continue (or start) this session: send the whole conversation as PROMPT")
    generate.add_argument("--spec", choices=MODES, help="speculative decoding mode (default: the server's)")
    add_sampling_flags(generate)
    generate.set_defaults(func=run_generate)

    info = subparsers.add_parser("info", help="show the model and settings of a running server")
    _add_server_flag(info)
    info.set_defaults(func=run_info)

    sessions = subparsers.add_parser("sessions", help="list a server's sessions, or delete one")
    sessions.add_argument("--delete", metavar="ID", help="delete this session")
    _add_server_flag(sessions)
    sessions.set_defaults(func=run_sessions)

    snapshot = subparsers.add_parser("snapshot", help="download a session's state to a file")
    snapshot.add_argument("session", metavar="SESSION")
    snapshot.add_argument("-o", "--output", type=Path, required=True, metavar="FILE")
    snapshot.add_argument("--upto", type=int, metavar="TOKENS",
                          help="only the first TOKENS tokens, rounded down to a 64-token chunk")
    _add_server_flag(snapshot)
    snapshot.set_defaults(func=run_snapshot)

    restore = subparsers.add_parser("restore", help="upload a snapshot file as a session")
    restore.add_argument("file", type=Path, metavar="FILE")
    restore.add_argument("--session", default="", metavar="NEW_ID", help="restore under this id (default: the "
                         "id recorded in the file)")
    _add_server_flag(restore)
    restore.set_defaults(func=run_restore)


def _add_server_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=DEFAULT_ADDRESS, help=f"server address (default {DEFAULT_ADDRESS})")
    parser.add_argument("--token-file", type=Path, metavar="FILE", help="send the bearer token in FILE")
    parser.add_argument("--tls-ca", type=Path, metavar="FILE", help="connect with TLS; FILE: the PEM CA that signed "
                        "the server's certificate")
    parser.add_argument("--tls-cert", type=Path, metavar="FILE", help="mTLS: this client's PEM certificate chain")
    parser.add_argument("--tls-key", type=Path, metavar="FILE", help="mTLS: this client's PEM private key")


def _connect(args: argparse.Namespace) -> Client:
    """A client for the --server, --token-file and --tls-* flags."""
    token = args.token_file.read_text().strip() if args.token_file else None
    tls = None
    if args.tls_ca or args.tls_cert:
        tls = TlsOptions(*(path.read_bytes() if path else None for path in (args.tls_ca, args.tls_cert, args.tls_key)))
    return Client(args.server, token=token, tls=tls)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, "engine")


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, "spec")


def engine_options(args: argparse.Namespace) -> dict:
    """lucekv.load keyword arguments from the engine flags (and the speculation flags, where the command has them)."""
    options = {f.name: getattr(args, f.name) for f in settings("engine")}
    if hasattr(args, "spec"):
        options["speculation"] = spec_config(args.spec, args.draft_model, args.dflash_drafter)
    return options


def spec_config(mode: str, draft_model: str, dflash_drafter: str = "") -> SpecConfig:
    return SpecConfig(mode=mode, draft_model=_model_file(draft_model) if draft_model else None,
                      dflash_drafter=Path(dflash_drafter) if dflash_drafter else None)


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
    try:
        config, sources = config_from_args(args)
    except LucekvError as e:
        print(f"lucekv: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(format_config(config, sources))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        path = _model_file(config.model)
        store = None
        if config.snapshot_store:
            from lucekv.model.gguf import open_gguf

            store = open_snapshot_store(config.snapshot_store, open_gguf(path).fingerprint,
                                        config.snapshot_ttl_seconds, config.lease_seconds)
        speculation = spec_config(config.spec, config.draft_model, config.dflash_drafter)
        engine = lucekv.load(path, config.engine, speculation=speculation, snapshot_store=store)
    except LucekvError as e:
        print(f"lucekv: error: {e}", file=sys.stderr)
        return 1

    def announce(server: LucekvServer) -> None:
        info = engine.info
        metrics = f", metrics on port {server.metrics_port}" if server.metrics_port is not None else ""
        print(
            f"lucekv: serving {info.model_name} ({info.arch}, {info.backend} backend) on "
            f"{config.host}:{server.port}{metrics}",
            file=sys.stderr,
            flush=True,
        )

    try:
        serve(engine, config, announce)
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
        with _connect(args) as client:
            for chunk in client.generate(prompt, sampling, session_id=args.session, speculation=args.spec):
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
    reused = f", {u.cached_tokens} prompt tokens reused" if u.cached_tokens else ""
    spec = ""
    if u.HasField("speculation"):
        s = u.speculation
        spec = f", {s.mode}: {s.accepted_tokens}/{s.drafted_tokens} drafts accepted in {s.rounds} rounds"
    print(
        f"[{FINISH_REASON_NAMES[chunk.finish_reason]}: {u.prompt_tokens} prompt + {u.completion_tokens} "
        f"completion tokens, first token {u.time_to_first_token_ms:.0f} ms, "
        f"{u.decode_tokens_per_second:.1f} tok/s{reused}{spec}]",
        file=sys.stderr,
    )
    return 0


def _end_terminal_line() -> None:
    """On a terminal, end the streamed text's line so what follows starts on its own; pipes get the text as is."""
    if sys.stdout.isatty():
        sys.stdout.write("\n")
        sys.stdout.flush()


def _reports_rpc_errors(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A failed call is reported on stderr with the server's status and message, and exits 1."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except grpc.RpcError as e:
            print(f"lucekv: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1

    return run


@_reports_rpc_errors
def run_sessions(args: argparse.Namespace) -> int:
    if args.delete:
        with _connect(args) as client:
            client.delete_session(args.delete, timeout=60)
        print(f"deleted session {args.delete}", file=sys.stderr)
        return 0
    print(f"{'session':<24}{'state':<8}{'tokens':>8}{'host MiB':>10}{'stored MiB':>12}  generating")
    with _connect(args) as client:
        sessions = client.list_sessions(timeout=10)
    for s in sessions:
        print(f"{s.session_id:<24}{s.state:<8}{s.n_tokens:>8}{s.host_bytes / 2**20:>10.1f}"
              f"{s.stored_bytes / 2**20:>12.1f}  {'yes' if s.generating else 'no'}")
    return 0


@_reports_rpc_errors
def run_snapshot(args: argparse.Namespace) -> int:
    """Written to a temp file beside FILE and renamed when complete: a failure leaves FILE as it was."""
    tmp = args.output.with_name(f".{args.output.name}.{os.getpid()}.tmp")
    try:
        with _connect(args) as client, open(tmp, "wb") as f:
            for piece in client.snapshot(args.session, args.upto):
                f.write(piece)
            size = f.tell()
        os.replace(tmp, args.output)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"session {args.session}: {size} bytes to {args.output}", file=sys.stderr)
    return 0


@_reports_rpc_errors
def run_restore(args: argparse.Namespace) -> int:
    if not args.file.is_file():
        print(f"lucekv: error: {args.file} is not a file", file=sys.stderr)
        return 1

    def pieces():
        with open(args.file, "rb") as f:
            while piece := f.read(PIECE_BYTES):
                yield piece

    with _connect(args) as client:
        r = client.restore(pieces(), args.session)
    print(f"restored session {r.session.session_id}: {r.session.n_tokens} tokens from {r.bytes} bytes",
          file=sys.stderr)
    return 0


@_reports_rpc_errors
def run_info(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        info = client.server_info(timeout=10)
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
        ("speculation", f"{', '.join(info.speculation_modes)} (default {info.speculation_default})"),
        ("features", ", ".join(info.features)),
        ("max queue", str(info.max_queued_requests)),
        ("version", info.version),
    ]
    for key, value in rows:
        print(f"{key + ':':<13}{value}")
    return 0
