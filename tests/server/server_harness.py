"""Server test helpers: a real server on its own event loop thread, and an engine wrapper to watch it."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from pathlib import Path

import lucekv
from lucekv.engine.engine import Engine
from lucekv.server.app import start_server
from lucekv.server.config import SERVE_ENGINE, ServeConfig


def load_engine(path: Path, **options) -> Engine:
    return lucekv.load(path, backend="cpu", **options)


class ProbeEngine:
    """Wraps a real engine to watch the server use it: counts the requests submitted and the tokens of the one the
    engine works on (the oldest that has not ended), can slow every step down (so a generation lasts long enough to
    cancel it), and can fail on purpose."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.step_delay = 0.0
        self.fail_after_steps: int | None = None
        self.calls = 0
        self.steps = 0  # tokens of the oldest request that has not ended
        self.steps_at_close = 0  # tokens of the latest request that ended
        self.closed = threading.Event()  # a request ended since the latest one was submitted
        self._requests: list = []  # submitted and not ended, oldest first

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def submit(self, *args, **kwargs):
        request = self._engine.submit(*args, **kwargs)
        self.calls += 1
        self.closed.clear()
        self._requests.append(request)
        self._watch()
        return request

    def step(self):
        time.sleep(self.step_delay)
        if self.fail_after_steps is not None and self.steps >= self.fail_after_steps:
            raise RuntimeError("synthetic engine failure")
        self._engine.step()
        self._watch()

    def cancel(self, request):
        self._engine.cancel(request)
        self._watch()

    def fail_all(self, error):
        self._engine.fail_all(error)
        self._watch()

    def _watch(self):
        while self._requests and self._requests[0].done:
            self.steps_at_close = self._requests.pop(0).n_out
            self.closed.set()
        for r in list(self._requests):  # ended out of order (cancelled while queued)
            if r.done:
                self._requests.remove(r)
                self.closed.set()
        self.steps = self._requests[0].n_out if self._requests else self.steps_at_close


class ServerThread:
    """A started server running on its own event loop thread, as `lucekv serve` runs it."""

    def __init__(self, engine: ProbeEngine, max_queued: int = 64, **settings):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self._thread.start()
        config = ServeConfig(host="127.0.0.1", port=0, engine=replace(SERVE_ENGINE, max_queue=max_queued), **settings)
        self.server = self._call(start_server(engine, config))
        self.address = f"127.0.0.1:{self.server.port}"

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    def stop(self) -> None:
        self._call(self.server.stop(grace=0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()
