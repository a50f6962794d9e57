"""Prometheus metrics of one server (`--metrics-port`), in a registry of its own, served over HTTP.

Names follow Prometheus practice (base units, `_total` counters) and vLLM's vocabulary where one exists; no
label carries a session, principal or request id (unbounded cardinality).
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from lucekv.engine.sessions import SessionInfo
from lucekv.engine.types import Usage

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
SESSION_STATES = ("live", "parked", "stored")


class Metrics:
    def __init__(self, queue_depth: Callable[[], int], sessions: Callable[[], list[SessionInfo]],
                 kv_pool_tokens: int, running: Callable[[], int] = lambda: 0):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lucekv_requests", "finished RPCs by method and status code", ["rpc", "code"],
                                registry=r)
        self.ttft = Histogram("lucekv_time_to_first_token_seconds", "Generate: from the start of the engine's work "
                              "to the first token (queue time excluded)", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("lucekv_queue_time_seconds", "Generate: time waiting for a place in the batch",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("lucekv_time_per_output_token_seconds", "Generate: decode time per token after the "
                              "first", buckets=_TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("lucekv_prompt_tokens", "prompt tokens of finished Generate calls", registry=r)
        self.cached_tokens = Counter("lucekv_cached_prompt_tokens", "prompt tokens whose K/V a session held",
                                     registry=r)
        self.generation_tokens = Counter("lucekv_generation_tokens", "tokens generated", registry=r)
        self.tokens_per_second = Gauge("lucekv_decode_tokens_per_second", "decode speed of the latest finished "
                                       "Generate call", registry=r)
        self.kv_resident_chunks = Gauge("lucekv_kv_resident_chunks", "64-token K/V chunks in the device pool at the "
                                        "end of the latest Generate call (bounded pools)", registry=r)
        self.kv_paged_bytes = Counter("lucekv_kv_paged_bytes", "K/V bytes moved between the device pool and host "
                                      "RAM", registry=r)
        self.snapshot_bytes = Counter("lucekv_snapshot_bytes", "snapshot blob bytes sent (Snapshot) and received "
                                      "(Restore)", ["direction"], registry=r)
        Gauge("lucekv_kv_pool_tokens", "K/V slots of the device pool (0: the whole context)",
              registry=r).set(kv_pool_tokens)
        Gauge("lucekv_num_requests_waiting", "calls queued for the engine", registry=r).set_function(queue_depth)
        Gauge("lucekv_num_requests_running", "calls in the engine's batch", registry=r).set_function(running)
        r.register(_SessionStates(sessions))
        self.port: int | None = None
        self._http = None

    def observe_generation(self, usage: Usage) -> None:
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.ttft.observe(usage.time_to_first_token_s)
        self.queue_time.observe(usage.queue_time_s)
        if usage.completion_tokens > 1 and usage.decode_tokens_per_s > 0:
            self.tpot.observe(1.0 / usage.decode_tokens_per_s)
            self.tokens_per_second.set(usage.decode_tokens_per_s)
        self.kv_resident_chunks.set(usage.kv_resident_chunks)
        self.kv_paged_bytes.inc(usage.kv_bytes_moved)

    def serve(self, host: str, port: int) -> int:
        self._http, _ = start_http_server(port, host, self.registry)
        self.port = self._http.server_port
        return self.port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


class _SessionStates(Collector):
    """lucekv_sessions{state}: counted when scraped."""

    def __init__(self, sessions: Callable[[], list[SessionInfo]]):
        self._sessions = sessions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("lucekv_sessions", "sessions by state", labels=["state"])
        counts = Tally(info.state for info in self._sessions())
        for state in SESSION_STATES:
            family.add_metric([state], counts[state])
        yield family
