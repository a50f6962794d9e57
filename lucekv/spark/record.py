"""`--spark-record FILE`: the routing trace of served traffic, in the format of `lucekv spark trace`, so that
`lucekv spark calibrate` places experts by what the server's clients actually route to.

The backend counts (on the device for CUDA, without a readback per step); the engine hands the counts over here at
request boundaries and the file is rewritten every `every` requests and at shutdown, whole or not at all (a temp
file renamed into place). A file already there (a restarted server) is continued, not overwritten; another model's
is refused. Pure bookkeeping: numpy and JSON only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lucekv.errors import ConfigError
from lucekv.spark.trace import RoutingTrace


class TraceRecorder:
    def __init__(self, path: str | Path, fingerprint: str, n_layer: int, n_expert: int, top_k: int, every: int):
        if every < 1:
            raise ConfigError(f"--spark-record-every must be >= 1 (got {every})")
        self.path = Path(path)
        self.every = every
        self.trace = RoutingTrace.empty(fingerprint, n_layer, n_expert, top_k)
        if self.path.exists():
            self.trace.add(RoutingTrace.load(self.path, fingerprint))  # refuses another model's trace
        elif not self.path.parent.is_dir():
            raise ConfigError(f"--spark-record {self.path}: the directory {self.path.parent} does not exist")
        self.requests = 0  # ended since this recorder started

    def add(self, counts: np.ndarray) -> None:
        """Selections counted by the backend since the last add: int [n_layer, n_expert]."""
        self.trace.counts += counts

    def request_ended(self) -> bool:
        """Count a request's end; True when the file is due to be written (every `every` requests)."""
        self.requests += 1
        return self.requests % self.every == 0

    def save(self) -> None:
        """Raises OSError if the file cannot be written (the previous one stays whole)."""
        self.trace.save(self.path)
