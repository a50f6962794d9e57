"""EngineConfig: every option of an Engine, defined once: its default, and for those a command line sets, its flag
(`lucekv serve`, and `run` and `bench` for the "engine" group), its `LUCEKV_*` variable and its help (see
lucekv.settings). `lucekv.load(model, **options)` takes the fields by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from lucekv.errors import ConfigError
from lucekv.pflash.compressor import DEFAULT_THRESHOLD
from lucekv.pflash.selection import check_keep_ratio
from lucekv.settings import flag, optional_int, optional_path, setting
from lucekv.spec.config import SpecConfig


def kv_pool_value(value: str) -> int | str | None:
    """--kv-pool: a number of tokens, "auto", or "off" (None: the whole context)."""
    if value in ("auto", "off"):
        return None if value == "off" else value
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"expected a number of tokens, 'auto' or 'off', not {value!r}") from None


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


@dataclass(frozen=True)
class EngineConfig:
    """The defaults are the library's; a server's differ in kv_pool only (lucekv.server.config.SERVE_ENGINE)."""

    backend: str = setting("auto", "compute backend", choices=("auto", "cpu", "cuda"), group="engine")
    kv_dtype: str = setting("f16", "KV cache storage", choices=("f16", "f32"), group="engine")
    # each sequence's residency budget on the device; None ("off") holds its whole context
    kv_pool: int | str | None = setting(
        None, "KV slots kept on the device, in tokens (a multiple of 64); colder chunks page to host RAM. 'off' "
        "holds the whole context; 'auto': on CUDA the whole context if it fits in 90%% of the GPU memory free "
        "(or --gpu-memory-gib) after the weights, else the largest pool that does; on the CPU backend 'off'",
        kv_pool_value, group="engine", metavar="TOKENS|auto|off")
    kv_policy: str = setting("auto", "which paged-out chunks come back (draft: a small model's attention, with "
                             "--kv-drafter; auto: draft with a --kv-drafter, else quest)",
                             choices=("auto", "lru", "quest", "meankey", "draft"), group="engine")
    kv_tau: int = setting(64, "decoded tokens between reselects", int, group="engine")
    kv_drafter: str | Path = setting("", "the draft policy's model: same tokenizer, e.g. qwen2.5-coder-0.5b for the "
                                     "1.5b", group="engine", metavar="MODEL")
    kv_cache: int | None = setting(
        None, "the one KV pool every sequence borrows its blocks from, in tokens (a multiple of 64); off: room for "
        "--max-batch sequences at their --kv-pool budget (on CUDA within 90%% of the GPU memory free after the "
        "weights)", optional_int, group="engine", metavar="TOKENS")
    max_batch: int = setting(64, "sequences that decode together in one step", int, group="engine")
    gpu_memory_gib: float = setting(
        0.0, "CUDA: keep the GPU's memory in use (the CUDA context's and whatever else is on the device at load "
        "included) under this: --kv-pool auto and the default --kv-cache are sized within it, after the weights as "
        "held on the GPU (with --spark-placement the placed experts and spare slots only); 0: within the memory free",
        float, group="engine")
    spark_placement: Path | None = setting(
        None, "CUDA, MoE models: an expert placement JSON (`lucekv spark calibrate`) of this model: its experts stay "
        "on the GPU, the others in pinned host memory, read over PCIe; refused for another model", optional_path,
        group="engine", metavar="FILE")
    spark_spare: int = setting(0, "with --spark-placement: spare GPU slots per MoE layer caching cold experts (LRU)",
                               int, group="engine")
    spark_promote: int = setting(0, "with --spark-placement: at each request's end, swap at most N placed experts for "
                                 "cold ones the traffic since selected more", int, group="engine")
    mmq_tokens: int = setting(64, "CUDA: products of 4..N tokens (decode rows, verify blocks, short prompt pieces; N "
                              "up to 64) on the integer tensor cores, x in 16 bits; 0: none (the several-token "
                              "matvecs and the float16 tensor-core matmul)", int, group="engine", metavar="N")
    step_tokens: int | None = setting(
        None, "tokens per step: the running streams' decode tokens and pieces of new prompts (a long prompt is "
        "prefilled in pieces beside the running streams); off: the backend's prefill batch (256 CPU, 512 CUDA)",
        optional_int, group="engine", metavar="TOKENS")
    prefill_compression: float | None = setting(
        None, "PFlash: a drafter reads prompts longer than --prefill-threshold and the model prefills only the "
        "spans it selects, this share of them (requests may choose their own ratio, 1 for none); off: requests "
        "are compressed only when they ask", keep_ratio_value, group="engine", metavar="KEEP|off")
    prefill_threshold: int = setting(DEFAULT_THRESHOLD, "prompts (their part not reused from the session) no longer "
                                     "than this are never compressed", int, group="engine", metavar="TOKENS")
    prefill_drafter: str | Path = setting("", "the model that selects what compressed prompts keep (same tokenizer, "
                                          "e.g. qwen2.5-coder-0.5b for the 1.5b); default --kv-drafter. With it, "
                                          "--prefill-compression or the draft policy's drafter, requests may ask "
                                          "for compression", group="engine", metavar="MODEL")
    prefill_drafter_layers: int = setting(0, "the prompt compressor's drafter reads with its first N layers only, "
                                          "scoring those past the first third of them (0: all layers)", int,
                                          group="engine")
    # the flags of `lucekv serve` alone; past max_sessions or session_memory_gib, idle sessions spill to the engine's
    # snapshot store (least recently used first), or, without one, new sessions are refused
    max_queue: int = setting(64, "Generate calls that may wait for a place in the batch; more get RESOURCE_EXHAUSTED",
                             int)
    max_sessions: int = setting(64, "sessions held in memory", int)
    session_memory_gib: float = setting(16.0, "host RAM for the K/V of sessions held in memory", float)
    spark_record: Path | None = setting(
        None, "MoE models: record the experts each layer routes the served tokens to (prompts and decoding, any "
        "backend) into this routing trace JSON, as `lucekv spark trace` writes one (for `lucekv spark calibrate`); "
        "written every --spark-record-every requests and at shutdown; a trace of this model already there is "
        "continued", optional_path, metavar="FILE")
    spark_record_every: int = setting(64, "with --spark-record: rewrite the trace every N requests", int)

    # the library's alone (no flag)
    n_ctx: int | None = None  # the context, at most the model's (None: the model's)
    # the default speculation mode and the drafters (the flags --spec, --draft-model and --dflash-drafter make it)
    speculation: SpecConfig = field(default_factory=SpecConfig)
    # compute only the model's first `layers` layers: a drafter that reads for a scorer, whose keys and queries are
    # the whole model's but whose logits are not (None: all of them)
    layers: int | None = None

    def check(self) -> EngineConfig:
        """Values that cannot work raise ConfigError naming their flag; what needs the model or the backend (a pool's
        size, a drafter's tokenizer, a placement's model) the Engine checks."""
        for name, least in (("max_batch", 1), ("max_queue", 0), ("max_sessions", 1), ("session_memory_gib", 0),
                            ("prefill_threshold", 0), ("spark_spare", 0), ("spark_promote", 0), ("mmq_tokens", 0),
                            ("spark_record_every", 1), ("gpu_memory_gib", 0)):
            if getattr(self, name) < least:
                raise ConfigError(f"--{flag(name)} must be >= {least} (got {getattr(self, name)})")
        if self.prefill_compression is not None:
            try:
                check_keep_ratio(self.prefill_compression)
            except ValueError as e:
                raise ConfigError(f"--prefill-compression: {e}") from None
            if not (self.prefill_drafter or self.kv_drafter):
                raise ConfigError("--prefill-compression needs a drafter: --prefill-drafter (or --kv-drafter) MODEL")
        if self.spark_placement is None and (self.spark_spare or self.spark_promote):
            raise ConfigError("--spark-spare and --spark-promote need --spark-placement")
        self.speculation.check()
        return self


def engine_config(config: EngineConfig | None = None, **options: Any) -> EngineConfig:
    """`config` (default EngineConfig()) with `options` (its fields by name) replaced. An unknown name is a TypeError
    naming it."""
    names = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"unknown engine option{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}; the "
                        f"options are EngineConfig's fields: {', '.join(sorted(names))}")
    return replace(config or EngineConfig(), **options)
