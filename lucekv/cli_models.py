"""`lucekv models list` and `lucekv models pull NAME`.

Each command stores its handler as `func` in the parsed namespace; the handler returns the exit code.
"""

from __future__ import annotations

import argparse
import sys

from lucekv.errors import ModelError
from lucekv.model.registry import MODELS, TextProgress, is_pulled, model_path, pull


def add_models_commands(subparsers: argparse._SubParsersAction) -> None:
    models = subparsers.add_parser("models", help="list or download the models lucekv knows by name")
    commands = models.add_subparsers(dest="models_command", metavar="COMMAND", required=True)
    commands.add_parser("list", help="show the known models and whether they are downloaded").set_defaults(
        func=list_models
    )
    pull_parser = commands.add_parser("pull", help="download, assemble and verify a model")
    pull_parser.add_argument("name", metavar="NAME", help=f"one of: {', '.join(MODELS)}")
    pull_parser.set_defaults(func=pull_model)


def list_models(args: argparse.Namespace) -> int:
    rows = [("NAME", "ARCH", "SIZE", "PULLED", "PATH")]
    for name, entry in MODELS.items():
        size = f"{entry.size_bytes / (1 << 20):.1f} MiB"
        rows.append((name, entry.arch, size, "yes" if is_pulled(name) else "no", str(model_path(name))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def pull_model(args: argparse.Namespace) -> int:
    try:
        path = pull(args.name, TextProgress())
    except ModelError as e:
        print(f"lucekv: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
