"""A setting: a dataclass field that is also a command-line flag and a `LUCEKV_*` variable (lucekv.server.config
makes both from the field's name and metadata). EngineConfig and ServeConfig declare their fields with `setting`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Any


def setting(default: Any, help: str, parse: Callable[[str], Any] = str, choices: tuple[str, ...] = (),
            group: str = "serve", metavar: str | None = None) -> Any:
    """A field with a flag: `parse` turns a flag's or a variable's text into the value. `group`: the commands that
    have the flag: "serve" (`lucekv serve` only), "engine" (also `lucekv run` and `lucekv bench`), "spec" (the
    speculation flags of `serve` and `run`)."""
    return field(default=default, metadata={"help": help, "parse": parse, "choices": choices, "group": group,
                                            "metavar": metavar})


def optional_path(value: str) -> Path | None:
    return Path(value) if value else None


def optional_int(value: str) -> int | None:
    """A number, or "off" / "" for none (the help shows an unset value as "off")."""
    return None if value in ("off", "") else int(value)


def flag(name: str) -> str:
    """A setting's flag without its dashes: kv_pool -> kv-pool."""
    return name.replace("_", "-")
