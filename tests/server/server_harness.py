"""Server test helpers: a real server on its own event loop thread, and an engine wrapper to watch it."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import lucekv
from lucekv.engine.engine import Engine
from lucekv.server.app import start_server
from lucekv.server.config import ServeConfig


def load_engine(path: Path) -> Engine:
    return lucekv.load(path, backend="cpu")


class ProbeEngine:
    """Wraps a real engine to watch the server use it: counts generate() calls and the steps each one took,
    can slow every step down (so a generation lasts long enough to cancel it), and can fail on purpose."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.step_delay = 0.0
        self.fail_after_steps: int | None = None
        self.calls = 0
        self.steps = 0  # of the latest generation
        self.steps_at_close = 0  # of the latest generation that ended (the next one resets `steps`)
        self.closed = threading.Event()  # the latest generation's generator was closed or ran out

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def generate(self, prompt, params, session_id="", pin_prefix=None, speculation=None):
        self.calls += 1
        self.steps = 0
        self.closed.clear()
        inner = self._engine.generate(prompt, params, session_id, pin_prefix, speculation)
        return self._watch(inner)

    def _watch(self, inner):
        try:
            for delta in inner:
                time.sleep(self.step_delay)
                self.steps += 1
                if self.fail_after_steps is not None and self.steps > self.fail_after_steps:
                    raise RuntimeError("synthetic engine failure")
                yield delta
        finally:
            inner.close()
            self.steps_at_close = self.steps
            self.closed.set()


class ServerThread:
    """A started server running on its own event loop thread, as `lucekv serve` runs it."""

    def __init__(self, engine: ProbeEngine, max_queued: int = 64, **settings):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self._thread.start()
        config = ServeConfig(host="127.0.0.1", port=0, max_queue=max_queued, **settings)
        self.server = self._call(start_server(engine, config))
        self.address = f"127.0.0.1:{self.server.port}"

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    def stop(self) -> None:
        self._call(self.server.stop(grace=0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()
