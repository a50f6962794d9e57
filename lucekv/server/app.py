"""Build and run the gRPC server: the LuceKV service, grpc.health.v1, reflection, the engine's worker, and around
them authentication, TLS, metrics and the drain on shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lucekv.engine.engine import Engine
from lucekv.errors import ConfigError
from lucekv.server.auth import Authenticator, AuthInterceptor
from lucekv.server.config import ServeConfig
from lucekv.server.gen import lucekv_pb2_grpc
from lucekv.server.metrics import Metrics
from lucekv.server.service import SERVICE_NAME, LuceKVServicer
from lucekv.server.worker import EngineWorker

logger = logging.getLogger(__name__)

_GRPC_OPTIONS = [
    # A long prefill or a wait in the queue sends no data; clients may ping meanwhile without being cut off
    # for "too many pings" (gRPC's server default allows one ping per 5 minutes without data).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # gRPC binds with SO_REUSEPORT by default: a second server on a taken port would start and share it.
    ("grpc.so_reuseport", 0),
]


class LucekvServer:
    """A started server. `stop` turns health to NOT_SERVING, refuses new calls, lets running ones finish for up to
    `config.drain_seconds`, stops the engine and writes the sessions to the snapshot store if there is one."""

    def __init__(self, server: grpc.aio.Server, worker: EngineWorker, health_servicer: health.aio.HealthServicer,
                 port: int, metrics: Metrics, config: ServeConfig):
        self.port = port
        self.metrics_port = metrics.port
        self.metrics = metrics
        self.config = config
        self._server = server
        self._worker = worker
        self._health = health_servicer

    async def stop(self, grace: float | None = None) -> None:
        grace = self.config.drain_seconds if grace is None else grace
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.stop(grace)
        await asyncio.to_thread(self._worker.stop)
        await asyncio.to_thread(self._worker.save_sessions)
        self.metrics.close()
        if close_store := getattr(self._worker.engine.store, "close", None):
            await asyncio.to_thread(close_store)  # releases the leases it still holds


async def start_server(engine: Engine, config: ServeConfig) -> LucekvServer:
    """Serve `engine` from the running event loop. Raises ConfigError if the address cannot be bound or a TLS or
    token file cannot be read."""
    worker = EngineWorker(engine, config.engine.max_queue)
    auth = Authenticator.from_file(config.auth_tokens)
    metrics = Metrics(lambda: worker.queued, engine.sessions.infos, engine.info.kv_pool_tokens,
                      lambda: len(engine.scheduler.running))
    interceptors = [AuthInterceptor(auth, lambda method: metrics.requests.labels(
        method.rsplit("/", 1)[-1], grpc.StatusCode.UNAUTHENTICATED.name).inc())] if auth.enabled else []
    server = grpc.aio.server(options=_GRPC_OPTIONS, interceptors=interceptors)
    lucekv_pb2_grpc.add_LuceKVServicer_to_server(LuceKVServicer(worker, config, auth, metrics), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    try:
        credentials = _server_credentials(config)
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as e:  # grpc's way of saying the address cannot be bound
        raise ConfigError(f"cannot serve on {address}: {e}") from e
    if config.metrics_port is not None:
        try:
            metrics.serve(config.host, config.metrics_port)
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {config.host}:{config.metrics_port}: {e}") from e
    worker.start()
    await server.start()
    for service in ("", SERVICE_NAME):  # "" = the process is alive, SERVICE_NAME = ready for requests
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return LucekvServer(server, worker, health_servicer, port, metrics, config)


def _server_credentials(config: ServeConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert:
        return None
    try:
        key, chain = config.tls_key.read_bytes(), config.tls_cert.read_bytes()
        ca = config.tls_client_ca.read_bytes() if config.tls_client_ca else None
    except OSError as e:
        raise ConfigError(f"TLS: {e}") from e
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca, require_client_auth=ca is not None)


# The engine thread lets the GIL go at every device wait and wants it back as soon as the device is done; CPython lets
# the loop's thread keep it for up to the switch interval (5 ms by default) first. H100, smollm2, 4 streams: TPOT
# p50 3.9 -> 3.4 ms and 825 -> 934 tok/s at 0.2 ms (bench/results/h100-serve-smollm2-135m-c1-4-16*.json).
SWITCH_INTERVAL_S = 0.0002


def serve(engine: Engine, config: ServeConfig, on_started: Callable[[LucekvServer], None]) -> None:
    """Serve until SIGINT or SIGTERM, then drain and shut down gracefully."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)

    async def run() -> None:
        server = await start_server(engine, config)
        stop_requested = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop_requested.set)
        on_started(server)
        await stop_requested.wait()
        logger.info("stopping: new calls are refused, running ones have %.0f s to finish", config.drain_seconds)
        await server.stop()
        logger.info("stopped")

    asyncio.run(run())
