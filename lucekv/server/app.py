"""Build and run the gRPC server: the LuceKV service, grpc.health.v1, reflection, and the engine's worker."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lucekv.engine.engine import Engine
from lucekv.errors import ConfigError
from lucekv.server.gen import lucekv_pb2_grpc
from lucekv.server.service import SERVICE_NAME, LuceKVServicer
from lucekv.server.worker import EngineWorker

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051

_GRPC_OPTIONS = [
    # A long prefill or a wait in the queue sends no data; clients may ping meanwhile without being cut off
    # for "too many pings" (gRPC's server default allows one ping per 5 minutes without data).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # gRPC binds with SO_REUSEPORT by default: a second server on a taken port would start and share it.
    ("grpc.so_reuseport", 0),
]


@dataclass
class ServerOptions:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0 picks a free port; LucekvServer.port tells which
    max_queued: int = 64  # Generate calls that may wait behind the running one; more get RESOURCE_EXHAUSTED


class LucekvServer:
    """A started server. `stop` turns health to NOT_SERVING, drains calls for `grace` s, stops the engine and
    writes the sessions to the snapshot store if there is one."""

    def __init__(
        self,
        server: grpc.aio.Server,
        worker: EngineWorker,
        health_servicer: health.aio.HealthServicer,
        port: int,
    ):
        self.port = port
        self._server = server
        self._worker = worker
        self._health = health_servicer

    async def stop(self, grace: float = 5.0) -> None:
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.stop(grace)
        await asyncio.to_thread(self._worker.stop)
        await asyncio.to_thread(self._worker.save_sessions)


async def start_server(engine: Engine, options: ServerOptions) -> LucekvServer:
    """Serve `engine` from the running event loop. Raises ConfigError if the address cannot be bound."""
    worker = EngineWorker(engine, options.max_queued)
    server = grpc.aio.server(options=_GRPC_OPTIONS)
    lucekv_pb2_grpc.add_LuceKVServicer_to_server(LuceKVServicer(worker), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{options.host}:{options.port}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:  # grpc's way of saying the address cannot be bound
        raise ConfigError(f"cannot serve on {address}: {e}") from e
    worker.start()
    await server.start()
    for service in ("", SERVICE_NAME):  # "" = the process is alive, SERVICE_NAME = ready for requests
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return LucekvServer(server, worker, health_servicer, port)


def serve(engine: Engine, options: ServerOptions, on_started: Callable[[LucekvServer], None]) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully."""

    async def run() -> None:
        server = await start_server(engine, options)
        stop_requested = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop_requested.set)
        on_started(server)
        await stop_requested.wait()
        await server.stop()

    asyncio.run(run())
