"""The engine's own thread: jobs run there one at a time, first in first out, from a bounded queue.

Jobs are Generate calls and short engine calls (snapshot, restore, delete a session), which must not run
beside a generation because they move K/V in and out of the same pool.

The event loop never runs model code, so health checks and new calls are answered during a generation.
Deltas cross back to the loop through `call_soon_threadsafe`; the worker does not wait for slow readers.
A job's `cancelled` flag is checked after every step, so a cancelled call costs at most one more step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from lucekv.engine.engine import Engine
from lucekv.engine.sampling import SamplingParams
from lucekv.engine.types import GenerationDelta
from lucekv.errors import ConfigError, LucekvError, ResourceLimitError
from lucekv.server.leases import Lease

logger = logging.getLogger(__name__)

_END = object()  # the job's last item: the generation is over


class QueueFullError(ResourceLimitError):
    """Every place in the request queue is taken."""


class ServerStoppingError(LucekvError):
    """The server is shutting down: it takes no new jobs and ends the ones it has."""


class Job:
    """A unit of work for the engine thread: its cancel flag and the channel its output comes back on."""

    session_id = ""  # the session the job keeps busy while queued or running

    def __init__(self, request_id: str, lease: Lease | None = None):
        self.request_id = request_id
        self.lease = lease  # held for the job (replicas sharing a store) until `release_lease`
        self.cancelled = threading.Event()
        self.submitted_at = time.perf_counter()
        self.started_at: float | None = None
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue[object] = asyncio.Queue()

    @property
    def queue_time_s(self) -> float:
        return (self.started_at or time.perf_counter()) - self.submitted_at

    def deliver(self, item: object) -> bool:
        """Called on the worker thread; False when the server's loop is gone and nobody is listening."""
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:
            return False
        return True

    def run(self, engine: Engine) -> None:
        raise NotImplementedError

    def release_lease(self) -> None:
        """Give the session's lease back (once): before the caller hears the work is done, so that its next call
        may go to another replica at once; else when the job leaves the queue."""
        lease, self.lease = self.lease, None
        if lease is None:
            return
        try:
            lease.release()
        except LucekvError as e:  # the lease then lapses by itself
            logger.warning("request %s: releasing the lease of session %s: %s", self.request_id, lease.session_id, e)


class GenerationJob(Job):
    """One Generate call."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str, session_id: str = "",
                 pin_prefix: int | None = None, lease: Lease | None = None,
                 speculation: str | None = None):
        super().__init__(request_id, lease)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.session_id = session_id
        self.pin_prefix = pin_prefix
        self.speculation = speculation

    async def deltas(self) -> AsyncIterator[GenerationDelta]:
        """The generation's output; re-raises on the loop whatever the engine raised."""
        while (item := await self._items.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item

    def run(self, engine: Engine) -> None:
        """With a lease, the last delta waits until the session is in the store: a turn the client saw end
        survives this replica."""
        if self.lease:
            self.lease.sync(engine)
        steps = engine.generate(self.prompt_ids, self.params, self.session_id, self.pin_prefix,
                                self.speculation)
        last = None
        try:
            for delta in steps:
                if self.cancelled.is_set():
                    logger.info("request %s stopped: its call ended", self.request_id)
                    break
                if delta.finish_reason and self.lease:
                    last = delta
                elif not self.deliver(delta):
                    logger.info("request %s stopped: its call ended", self.request_id)
                    break
        finally:
            steps.close()  # frees what the generation held, also when it was cut short
        if self.lease:
            self.lease.commit(engine)
            self.release_lease()
        if last is not None:
            self.deliver(last)
        self.deliver(_END)


class EngineCall(Job):
    """A short engine operation, `fn(engine)`, run in queue order; its result comes back as one item."""

    def __init__(self, fn: Callable[[Engine], Any], name: str, lease: Lease | None = None):
        super().__init__(name, lease)
        self.fn = fn

    def run(self, engine: Engine) -> None:
        if self.lease:
            self.lease.sync(engine)
        result = self.fn(engine)
        if self.lease:
            self.lease.commit(engine)
            self.release_lease()
        self.deliver(result)

    async def result(self) -> Any:
        item = await self._items.get()
        if isinstance(item, BaseException):
            raise item
        return item


class EngineWorker:
    def __init__(self, engine: Engine, max_queued: int):
        if max_queued < 0:
            raise ConfigError(f"the request queue needs a size >= 0 (got {max_queued})")
        self.engine = engine
        self.max_queued = max_queued
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._wakeup = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="lucekv-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._wakeup:
            if self._stopping:
                raise ServerStoppingError("the server is shutting down")
            idle = self._running is None and not self._waiting
            if len(self._waiting) >= self.max_queued and not idle:
                raise QueueFullError(
                    f"all {self.max_queued} places in the request queue are taken; retry later"
                )
            self._waiting.append(job)
            if job.session_id:
                self.engine.sessions.begin_request(job.session_id)
            self._wakeup.notify()

    def submit_or_release(self, job: Job) -> None:
        """submit; a job the queue refuses gives its lease back."""
        try:
            self.submit(job)
        except BaseException:
            job.release_lease()
            raise

    @property
    def queued(self) -> int:
        """Jobs waiting for the engine (not counting the running one)."""
        return len(self._waiting)

    def cancel(self, job: Job) -> None:
        """Frees the job's place at once if it is waiting; a running job stops after its current step."""
        job.cancelled.set()
        with self._wakeup:
            if job in self._waiting:
                self._waiting.remove(job)
                self._release(job)

    def stop(self, timeout: float = 5.0) -> None:
        """Ends the waiting and running jobs with ServerStoppingError and lets the thread finish."""
        with self._wakeup:
            self._stopping = True
            waiting = list(self._waiting)
            ended = [*waiting, *([self._running] if self._running else [])]
            self._waiting.clear()
            self._wakeup.notify()
        for job in waiting:
            self._release(job)
        for job in ended:
            job.cancelled.set()
            job.deliver(ServerStoppingError("the server is shutting down"))
        self._thread.join(timeout)

    def save_sessions(self) -> None:
        """After `stop`: the sessions to the engine's snapshot store (skipped if the engine thread still runs)."""
        if self._thread.is_alive():
            logger.error("the engine thread did not stop: sessions are not saved")
            return
        try:
            saved = self.engine.save_sessions()
        except LucekvError as e:
            logger.error("saving the sessions: %s", e)
            return
        if saved:
            logger.info("saved %d sessions to the snapshot store", saved)

    def _run(self) -> None:
        while job := self._next_job():
            self._execute(job)
            with self._wakeup:
                self._running = None

    def _next_job(self) -> Job | None:
        with self._wakeup:
            while not self._waiting and not self._stopping:
                self._wakeup.wait()
            if self._stopping:
                return None
            self._running = self._waiting.popleft()
            return self._running

    async def call(self, fn: Callable[[Engine], Any], name: str, lease: Lease | None = None) -> Any:
        """Run `fn(engine)` on the engine thread after the jobs queued before it; its result or its exception.
        The lease, if any, is the job's from here on (released when it leaves the queue)."""
        job = EngineCall(fn, name, lease)
        self.submit_or_release(job)
        try:
            return await job.result()
        finally:
            self.cancel(job)

    def _execute(self, job: Job) -> None:
        try:
            if job.cancelled.is_set():  # cancelled between leaving the queue and starting
                return
            job.started_at = time.perf_counter()
            job.run(self.engine)
        except Exception as e:  # the handler maps it to a status code; the worker keeps serving
            if not job.deliver(e):
                logger.error("request %s failed after its caller left", job.request_id, exc_info=e)
        finally:
            self._release(job)

    def _release(self, job: Job) -> None:
        """The job left the queue for good: its session may be restored over or deleted again, its lease goes."""
        if job.session_id:
            self.engine.sessions.end_request(job.session_id)
        job.release_lease()
