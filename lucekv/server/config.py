"""The server's settings (DESIGN §9): one dataclass, filled from `lucekv serve` flags and `LUCEKV_*` variables.

A flag beats its variable (`--kv-pool` ↔ `LUCEKV_KV_POOL`), a variable beats the field's default; containers set
variables, people type flags. To add a setting, add a field with `setting(...)`: its flag, its variable, its
parsing and its line in `lucekv serve --print-config` follow from it. Fields of the "engine" group are also the
flags of `lucekv run` and `lucekv bench`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from lucekv.errors import ConfigError
from lucekv.model.registry import DEFAULT_MODEL
from lucekv.spec.config import MODES

ENV_PREFIX = "LUCEKV_"


def kv_pool_value(value: str) -> int | str | None:
    """--kv-pool: a number of tokens, "auto", or "off" (None: the whole context)."""
    if value in ("auto", "off"):
        return None if value == "off" else value
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"expected a number of tokens, 'auto' or 'off', not {value!r}") from None


def optional_path(value: str) -> Path | None:
    return Path(value) if value else None


def optional_int(value: str) -> int | None:
    return int(value) if value else None


def keep_ratio_value(value: str) -> float | None:
    """--prefill-compression: a keep ratio in (0, 1], or "off" (None)."""
    if value in ("off", ""):
        return None
    try:
        keep = float(value)
    except ValueError:
        raise ValueError(f"expected a keep ratio in (0, 1] or 'off', not {value!r}") from None
    if not 0 < keep <= 1:
        raise ValueError(f"expected a keep ratio in (0, 1] or 'off', not {value!r}")
    return keep


def setting(default: Any, help: str, parse: Callable[[str], Any] = str, choices: tuple[str, ...] = (),
            group: str = "serve", metavar: str | None = None) -> Any:
    """A field of ServeConfig: `parse` turns a flag's or a variable's text into the value."""
    return field(default=default, metadata={"help": help, "parse": parse, "choices": choices, "group": group,
                                            "metavar": metavar})


@dataclass(frozen=True)
class ServeConfig:
    model: str = setting(DEFAULT_MODEL, "registry name (downloaded if missing) or .gguf path")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(50051, "gRPC port; 0 picks a free one", int)

    backend: str = setting("auto", "compute backend", choices=("auto", "cpu", "cuda"), group="engine")
    kv_dtype: str = setting("f16", "KV cache storage", choices=("f16", "f32"), group="engine")
    kv_pool: int | str | None = setting(
        "auto", "KV slots kept on the device, in tokens (a multiple of 64); colder chunks page to host RAM. 'off' "
        "holds the whole context; 'auto': on CUDA the whole context if it fits in 90%% of the GPU memory free "
        "after the weights, else the largest pool that does; on the CPU backend 'off'", kv_pool_value,
        group="engine", metavar="TOKENS|auto|off")
    kv_policy: str = setting("auto", "which paged-out chunks come back (draft: a small model's attention, with "
                             "--kv-drafter; auto: draft with a --kv-drafter, else quest)",
                             choices=("auto", "lru", "quest", "meankey", "draft"), group="engine")
    kv_tau: int = setting(64, "decoded tokens between reselects", int, group="engine")
    kv_drafter: str = setting("", "the draft policy's model: same tokenizer, e.g. qwen2.5-coder-0.5b for the 1.5b",
                              group="engine", metavar="MODEL")
    kv_cache: int | None = setting(
        None, "the one KV pool every sequence borrows its blocks from, in tokens (a multiple of 64); off: room for "
        "--max-batch sequences at their --kv-pool budget (on CUDA within 90%% of the GPU memory free after the "
        "weights)", optional_int, group="engine", metavar="TOKENS")
    max_batch: int = setting(64, "sequences that decode together in one step", int, group="engine")
    spark_placement: Path | None = setting(
        None, "CUDA, MoE models: an expert placement JSON (`lucekv spark calibrate`) of this model: its experts stay "
        "on the GPU, the others in pinned host memory, read over PCIe; refused for another model", optional_path,
        group="engine", metavar="FILE")
    spark_spare: int = setting(0, "with --spark-placement: spare GPU slots per MoE layer caching cold experts (LRU)",
                               int, group="engine")
    spark_promote: int = setting(0, "with --spark-placement: at each request's end, swap at most N placed experts for "
                                 "cold ones the traffic since selected more", int, group="engine")
    step_tokens: int | None = setting(
        None, "tokens per step: the running streams' decode tokens and pieces of new prompts (a long prompt is "
        "prefilled in pieces beside the running streams); off: the backend's prefill batch (256 CPU, 512 CUDA)",
        optional_int, group="engine", metavar="TOKENS")
    prefill_compression: float | None = setting(
        None, "PFlash: a drafter reads prompts longer than --prefill-threshold and the model prefills only the "
        "spans it selects, this share of them (requests may choose their own ratio, 1 for none); off: requests "
        "are compressed only when they ask", keep_ratio_value, group="engine", metavar="KEEP|off")
    prefill_threshold: int = setting(2048, "prompts (their part not reused from the session) no longer than this "
                                     "are never compressed", int, group="engine", metavar="TOKENS")
    prefill_drafter: str = setting("", "the model that selects what compressed prompts keep (same tokenizer, e.g. "
                                   "qwen2.5-coder-0.5b for the 1.5b); default --kv-drafter. With it, "
                                   "--prefill-compression or the draft policy's drafter, requests may ask for "
                                   "compression", group="engine", metavar="MODEL")
    prefill_drafter_layers: int = setting(0, "the prompt compressor's drafter reads with its first N layers only, "
                                          "scoring those past the first third of them (0: all layers)", int,
                                          group="engine")

    spec: str = setting("auto", "speculative decoding, the mode of requests that leave it unset: auto lets a gate "
                        "turn the suffix drafter on where it pays; suffix / draft / dflash always use that drafter; "
                        "off decodes plainly. The output is the same either way", choices=MODES, group="spec")
    draft_model: str = setting("", "a small model with the target's tokenizer for --spec draft (registry name, "
                               "fetched if missing, or .gguf path), e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b",
                               group="spec", metavar="NAME|PATH")
    dflash_drafter: str = setting("", "a DFlash drafter GGUF made for the model, for --spec dflash (a synthetic one: "
                                  "python -m lucekv.model.synth dflash). It runs on the CPU; a CUDA model's dflash "
                                  "turns run without graphs for now", group="spec", metavar="PATH")

    max_queue: int = setting(64, "Generate calls that may wait for a place in the batch; more get RESOURCE_EXHAUSTED",
                             int)
    snapshot_store: str = setting(
        "", "where sessions are kept: a directory (one server) or redis://HOST:PORT/DB (replicas share it). Idle "
        "sessions spill there past the limits, all are saved at shutdown and found again after a restart; with "
        "Redis every turn's session is written there and a lease keeps two replicas from serving one session",
        metavar="DIR|URL")
    snapshot_ttl_seconds: int = setting(7 * 86400, "Redis store: a session's blob expires this long after its "
                                        "last write or read (0 = never)", int)
    lease_seconds: float = setting(15.0, "Redis store: a replica's hold on a session lapses this long after its "
                                   "last renewal (a crashed replica's sessions free up after it)", float)
    max_sessions: int = setting(64, "sessions held in memory", int)
    session_memory_gib: float = setting(16.0, "host RAM for the K/V of sessions held in memory", float)

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

    def engine_options(self) -> dict[str, Any]:
        """lucekv.load keyword arguments of the engine settings."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata["group"] == "engine"}

    def check(self) -> ServeConfig:
        """Settings that cannot work together raise ConfigError, naming them."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
        for name in ("max_prompt_tokens", "max_blob_bytes", "max_streams", "snapshot_ttl_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{_flag(name)} must be >= 0 (got {getattr(self, name)})")
        if self.lease_seconds <= 0 or self.drain_seconds < 0:
            raise ConfigError("--lease-seconds must be > 0 and --drain-seconds >= 0")
        return self


def _flag(name: str) -> str:
    return name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def add_config_flags(parser: argparse.ArgumentParser, group: str | None = None) -> None:
    """One flag per ServeConfig field (of `group` if given). A serve flag the user did not give leaves no
    attribute, so `config_from_args` can look for its variable; the engine group alone (`run`, `bench`) takes the
    fields' defaults directly."""
    for f in fields(ServeConfig):
        if group is not None and f.metadata["group"] != group:
            continue
        m = f.metadata
        default = argparse.SUPPRESS if group is None else f.default
        shown = f" (default {_shown(f.default)}; env {env_name(f.name)})" if group is None else \
            f" (default {_shown(f.default)})"
        parser.add_argument("--" + _flag(f.name), dest=f.name, type=_argparse_type(m["parse"]),
                            choices=m["choices"] or None, default=default, metavar=m["metavar"] or _metavar(f),
                            help=m["help"] + shown)


def _metavar(f: Any) -> str | None:
    """The unit a field's name ends with (SECONDS, TOKENS, ...), else N for a count; None: argparse's own."""
    unit = f.name.rsplit("_", 1)[-1]
    if unit in ("seconds", "tokens", "bytes", "gib", "port"):
        return unit.upper()
    return "N" if f.metadata["parse"] is int else None


_EXPECTED = {int: "an integer", float: "a number", optional_int: "an integer"}


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
    for f in fields(ServeConfig):
        if hasattr(args, f.name):
            values[f.name], sources[f.name] = getattr(args, f.name), "--" + _flag(f.name)
        elif (text := environ.get(env_name(f.name))) is not None:
            values[f.name], sources[f.name] = _from_env(f, text), env_name(f.name)
        else:
            sources[f.name] = "default"
    return ServeConfig(**values).check(), sources


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
    values = asdict(config)
    width = max(len(f"{name} = {_shown(v)}") for name, v in values.items())
    return "\n".join(f"{f'{name} = {_shown(v)}':<{width}}  # {sources.get(name, 'default')}"
                     for name, v in values.items())


def _shown(value: Any) -> str:
    if value is None:
        return "off"
    return str(value) if not isinstance(value, str) or value else "''"
