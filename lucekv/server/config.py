"""The server's settings (DESIGN §9): one dataclass, filled from `lucekv serve` flags and `LUCEKV_*` variables.

A flag beats its variable (`--kv-pool` ↔ `LUCEKV_KV_POOL`), a variable beats the field's default; containers set
variables, people type flags. To add a setting, add a field with `setting(...)` (lucekv.settings) to ServeConfig, or
to EngineConfig (lucekv.engine.config) for an engine option: its flag, its variable, its parsing and its line in
`lucekv serve --print-config` follow from it. The engine's settings of the "engine" group are also the flags of
`lucekv run` and `lucekv bench`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, fields, replace
from pathlib import Path
from typing import Any

from lucekv.engine.config import EngineConfig
from lucekv.errors import ConfigError
from lucekv.model.registry import DEFAULT_MODEL
from lucekv.settings import flag, optional_int, optional_path, setting
from lucekv.spec.config import MODES

ENV_PREFIX = "LUCEKV_"


# a server fits each sequence's pool to the GPU by default (the library holds whole contexts unless asked)
SERVE_ENGINE = EngineConfig(kv_pool="auto")


@dataclass(frozen=True)
class ServeConfig:
    model: str = setting(DEFAULT_MODEL, "registry name (downloaded if missing) or .gguf path")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(50051, "gRPC port; 0 picks a free one", int)

    engine: EngineConfig = SERVE_ENGINE  # its settings are flags here too (lucekv.engine.config)

    spec: str = setting("auto", "speculative decoding, the mode of requests that leave it unset: auto lets a gate "
                        "turn the suffix drafter on where it pays; suffix / draft / dflash always use that drafter; "
                        "off decodes plainly. The output is the same either way", choices=MODES, group="spec")
    draft_model: str = setting("", "a small model with the target's tokenizer for --spec draft (registry name, "
                               "fetched if missing, or .gguf path), e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b",
                               group="spec", metavar="NAME|PATH")
    dflash_drafter: str = setting("", "a DFlash drafter GGUF made for the model, for --spec dflash (a synthetic one: "
                                  "python -m lucekv.model.synth dflash). It runs on the CPU; a CUDA model's dflash "
                                  "turns run without graphs for now", group="spec", metavar="PATH")

    snapshot_store: str = setting(
        "", "where sessions are kept: a directory (one server) or redis://HOST:PORT/DB (replicas share it). Idle "
        "sessions spill there past the limits, all are saved at shutdown and found again after a restart; with "
        "Redis every turn's session is written there and a lease keeps two replicas from serving one session",
        metavar="DIR|URL")
    snapshot_ttl_seconds: int = setting(7 * 86400, "Redis store: a session's blob expires this long after its "
                                        "last write or read (0 = never)", int)
    lease_seconds: float = setting(15.0, "Redis store: a replica's hold on a session lapses this long after its "
                                   "last renewal (a crashed replica's sessions free up after it)", float)

    auth_tokens: Path | None = setting(None, "file of 'PRINCIPAL TOKEN' lines: every RPC but health needs "
                                       "'authorization: Bearer TOKEN'; sessions live in the principal's namespace",
                                       optional_path, metavar="FILE")
    tls_cert: Path | None = setting(None, "PEM certificate chain: serve TLS", optional_path, metavar="FILE")
    tls_key: Path | None = setting(None, "PEM private key of --tls-cert", optional_path, metavar="FILE")
    tls_client_ca: Path | None = setting(None, "PEM CA bundle: clients must present a certificate it signed "
                                         "(mTLS)", optional_path, metavar="FILE")
    max_prompt_tokens: int = setting(0, "most prompt tokens of one Generate call (0 = the model's context)", int)
    max_blob_bytes: int = setting(0, "most bytes of one uploaded snapshot blob (0 = no limit)", int)
    max_streams: int = setting(0, "most Generate/Snapshot/Restore calls one principal may have open at once "
                               "(0 = no limit)", int)

    metrics_port: int | None = setting(None, "serve Prometheus metrics over HTTP on this port (0 picks one)",
                                       optional_int, metavar="PORT")
    drain_seconds: float = setting(30.0, "on SIGTERM: how long running calls may go on before they are ended",
                                   float)

    def check(self) -> ServeConfig:
        """Settings that cannot work together raise ConfigError, naming them."""
        self.engine.check()
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
        for name in ("max_prompt_tokens", "max_blob_bytes", "max_streams", "snapshot_ttl_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{flag(name)} must be >= 0 (got {getattr(self, name)})")
        if self.lease_seconds <= 0 or self.drain_seconds < 0:
            raise ConfigError("--lease-seconds must be > 0 and --drain-seconds >= 0")
        return self


_ENGINE = {f.name for f in fields(EngineConfig)}


def settings(group: str | None = None) -> list[Field]:
    """The fields that are settings (of `group` if given), in ServeConfig's order, the engine's in place of its
    `engine` field."""
    found = []
    for f in fields(ServeConfig):
        found += [e for e in fields(EngineConfig) if "help" in e.metadata] if f.name == "engine" else [f]
    return [f for f in found if group is None or f.metadata["group"] == group]


def setting_values(config: ServeConfig) -> dict[str, Any]:
    """Each setting's value, by name."""
    return {f.name: getattr(config.engine if f.name in _ENGINE else config, f.name) for f in settings()}


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def add_config_flags(parser: argparse.ArgumentParser, group: str | None = None) -> None:
    """One flag per setting (of `group` if given), its default the server's. A serve flag the user did not give
    leaves no attribute, so `config_from_args` can look for its variable; the engine group alone (`run`, `bench`)
    takes the defaults directly."""
    defaults = setting_values(ServeConfig())
    for f in settings(group):
        m, value = f.metadata, defaults[f.name]
        default = argparse.SUPPRESS if group is None else value
        shown = f" (default {_shown(value)}; env {env_name(f.name)})" if group is None else \
            f" (default {_shown(value)})"
        parser.add_argument("--" + flag(f.name), dest=f.name, type=_argparse_type(m["parse"]),
                            choices=m["choices"] or None, default=default, metavar=m["metavar"] or _metavar(f),
                            help=m["help"] + shown)


def _metavar(f: Any) -> str | None:
    """The unit a field's name ends with (SECONDS, TOKENS, ...), else N for a count; None: argparse's own."""
    unit = f.name.rsplit("_", 1)[-1]
    if unit in ("seconds", "tokens", "bytes", "gib", "port"):
        return unit.upper()
    return "N" if f.metadata["parse"] is int else None


_EXPECTED = {int: "an integer", float: "a number", optional_int: "an integer or 'off'"}


def _parse(parse: Callable[[str], Any], text: str) -> Any:
    """ValueError with a message a user can act on."""
    try:
        return parse(text)
    except ValueError as e:
        raise ValueError(f"expected {_EXPECTED[parse]}, not {text!r}" if parse in _EXPECTED else str(e)) from None


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return _parse(parse, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__  # argparse names the type in its "invalid ... value" message
    return convert


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None,
                     ) -> tuple[ServeConfig, dict[str, str]]:
    """The configuration and, per field, where its value came from ("--flag", "LUCEKV_VAR" or "default")."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for f in settings():
        if hasattr(args, f.name):
            values[f.name], sources[f.name] = getattr(args, f.name), "--" + flag(f.name)
        elif (text := environ.get(env_name(f.name))) is not None:
            values[f.name], sources[f.name] = _from_env(f, text), env_name(f.name)
        else:
            sources[f.name] = "default"
    engine = replace(SERVE_ENGINE, **{name: values.pop(name) for name in _ENGINE & values.keys()})
    return ServeConfig(engine=engine, **values).check(), sources


def _from_env(f: Any, text: str) -> Any:
    choices = f.metadata["choices"]
    if choices and text not in choices:
        raise ConfigError(f"{env_name(f.name)}={text!r}: choose one of {', '.join(choices)}")
    try:
        return _parse(f.metadata["parse"], text)
    except ValueError as e:
        raise ConfigError(f"{env_name(f.name)}={text!r}: {e}") from None


def format_config(config: ServeConfig, sources: Mapping[str, str]) -> str:
    """One `name = value  # source` line per setting, as --print-config shows it."""
    values = setting_values(config)
    width = max(len(f"{name} = {_shown(v)}") for name, v in values.items())
    return "\n".join(f"{f'{name} = {_shown(v)}':<{width}}  # {sources.get(name, 'default')}"
                     for name, v in values.items())


def _shown(value: Any) -> str:
    if value is None:
        return "off"
    return str(value) if not isinstance(value, str) or value else "''"
