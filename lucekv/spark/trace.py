"""Routing traces: how many tokens each layer routed to each expert, on one model.

Counts come from running text through the model (`lucekv spark trace`: the CPU backend's MoE op reports each layer's
expert ids to `RoutingTrace.observe`); a placement is computed from them and checked against another trace (held-out
text). A trace is saved with the model's fingerprint and
never mixed with another model's. Pure bookkeeping: numpy and JSON only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lucekv.errors import ConfigError

TRACE_FORMAT = "lucekv.spark.trace"
TRACE_VERSION = 1


@dataclass
class RoutingTrace:
    fingerprint: str  # of the model (lucekv.model.gguf.fingerprint)
    top_k: int  # experts each token selects per layer
    counts: np.ndarray  # int64 [n_layer, n_expert]: selections of each expert

    @classmethod
    def empty(cls, fingerprint: str, n_layer: int, n_expert: int, top_k: int) -> RoutingTrace:
        if not 0 < top_k <= n_expert:
            raise ValueError(f"top_k {top_k} must be in [1, {n_expert}]")
        return cls(fingerprint, top_k, np.zeros((n_layer, n_expert), np.int64))

    @property
    def n_layer(self) -> int:
        return self.counts.shape[0]

    @property
    def n_expert(self) -> int:
        return self.counts.shape[1]

    @property
    def tokens(self) -> int:
        """Tokens observed (every token selects top_k experts in every layer)."""
        return int(self.counts[0].sum()) // self.top_k if self.n_layer else 0

    def observe(self, layer: int, expert_ids: np.ndarray) -> None:
        """Count one layer's selections: expert_ids [n_tokens, top_k]."""
        ids = np.asarray(expert_ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_expert):
            raise ValueError(f"expert ids outside [0, {self.n_expert})")
        self.counts[layer] += np.bincount(ids, minlength=self.n_expert)

    def add(self, other: RoutingTrace) -> None:
        """Merge another trace of the same model into this one."""
        self._check_same_model(other)
        self.counts += other.counts

    def _check_same_model(self, other: RoutingTrace) -> None:
        if (other.fingerprint, other.top_k, other.counts.shape) != (self.fingerprint, self.top_k, self.counts.shape):
            raise ConfigError("routing traces of different models (or expert layouts) cannot be combined")

    # ---- files --------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"format": TRACE_FORMAT, "version": TRACE_VERSION, "fingerprint": self.fingerprint,
                "top_k": self.top_k, "tokens": self.tokens, "counts": self.counts.tolist()}

    @classmethod
    def from_json(cls, doc: dict, fingerprint: str | None = None) -> RoutingTrace:
        """Raises ConfigError for another format or version, malformed counts, or (given `fingerprint`) another
        model's trace."""
        _check_header(doc, TRACE_FORMAT, TRACE_VERSION, "routing trace")
        try:
            counts = np.asarray(doc["counts"], np.int64)
            trace = cls(str(doc["fingerprint"]), int(doc["top_k"]), counts)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ConfigError(f"routing trace is malformed: {e}") from None
        if counts.ndim != 2 or (counts < 0).any() or not 0 < trace.top_k <= counts.shape[1]:
            raise ConfigError("routing trace is malformed: counts must be [layers, experts] of non-negative "
                              "integers and top_k within the experts")
        check_fingerprint(trace.fingerprint, fingerprint, "routing trace")
        return trace

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path, fingerprint: str | None = None) -> RoutingTrace:
        return cls.from_json(read_json(path, "routing trace"), fingerprint)


def _check_header(doc: dict, fmt: str, version: int, what: str) -> None:
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise ConfigError(f"not a {what} file (format {doc.get('format') if isinstance(doc, dict) else None!r})")
    if doc.get("version") != version:
        raise ConfigError(f"{what} version {doc.get('version')!r} is not supported (this lucekv reads {version})")


def check_fingerprint(found: str, expected: str | None, what: str) -> None:
    if expected is not None and found != expected:
        raise ConfigError(f"the {what} is of another model (fingerprint {found[:12]}…, this model's "
                          f"{expected[:12]}…)")


def write_json(path: str | Path, doc: dict) -> None:
    """Written whole or not at all: a temp file, on the disk (fsync) before it is renamed into place, so that a crash
    at any moment leaves the previous file or the new one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(json.dumps(doc))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def read_json(path: str | Path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read the {what} {path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"the {what} {path} is not JSON: {e}") from None
