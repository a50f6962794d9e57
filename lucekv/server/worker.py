"""The engine's own thread: it runs the engine's steps while requests are in flight, many Generate calls sharing
each step (continuous batching, lucekv.engine.scheduler).

Between two steps it takes new Generate calls into the engine (which queues them first in, first out, up to
`max_queued` waiting), stops those whose call ended (cancelled, deadline, client gone: within one step), runs short
engine calls (snapshot, restore, delete a session), which must not run inside a step because they move K/V in and
out of the same pool, and hands each call the deltas its request produced.

A job on a session shared by replicas holds the session's lease (lucekv.server.leases): before the engine takes it
the session is synced with the store, after it the session is written back. The session is marked idle and the lease
released before the caller hears the work is done (a generation's last delta waits for that), so the caller's next
call never finds the session busy.

The event loop never runs model code, so health checks and new calls are answered during a generation.
Deltas cross back to the loop through `call_soon_threadsafe`; the worker does not wait for slow readers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from lucekv.engine.engine import Engine
from lucekv.engine.request import Request
from lucekv.engine.sampling import SamplingParams
from lucekv.engine.types import GenerationDelta
from lucekv.errors import ConfigError, LucekvError
from lucekv.server.leases import Lease

logger = logging.getLogger(__name__)

_END = object()  # the job's last item: the generation is over


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
        self._loop = asyncio.get_running_loop()
        self._items: deque[object] = deque()  # delivered and not read yet
        self._arrived: asyncio.Future[None] | None = None  # what the reader awaits while there are none

    def deliver(self, item: object) -> bool:
        """Called on the worker thread; False when the server's loop is gone and nobody is listening."""
        return deliver_all([(self, item)])

    async def _take_items(self) -> list[object]:
        """Every item delivered since the last call, in order (waiting for one). A deque and a future: lighter on the
        loop than an asyncio.Queue (the loop's time is taken from the engine thread's: the GIL), and what piled up
        while the reader was busy comes at once."""
        while not self._items:
            self._arrived = self._loop.create_future()
            await self._arrived
        items = list(self._items)
        self._items.clear()
        return items

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


def deliver_all(items: list[tuple[Job, object]]) -> bool:
    """Called on the worker thread: each (job, item) onto its job's queue, in order, in one callback on the server's
    loop (every job's); False when that loop is gone and nobody is listening."""
    try:
        items[0][0]._loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:
        return False
    return True


def _put_all(items: list[tuple[Job, object]]) -> None:
    for job, item in items:
        job._items.append(item)
        if job._arrived is not None and not job._arrived.done():
            job._arrived.set_result(None)


class GenerationJob(Job):
    """One Generate call; `request` is its request in the engine once the engine thread took it."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str, session_id: str = "",
                 pin_prefix: int | None = None, lease: Lease | None = None,
                 speculation: str | None = None, prefill_keep: float | None = None):
        super().__init__(request_id, lease)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.session_id = session_id
        self.pin_prefix = pin_prefix
        self.speculation = speculation
        self.prefill_keep = prefill_keep
        self.request: Request | None = None
        self.held: GenerationDelta | None = None  # the last delta, until the session is idle (and written back)

    async def deltas(self) -> AsyncIterator[GenerationDelta]:
        """The generation's output; re-raises on the loop whatever the engine raised. The deltas that arrived since
        the caller last asked come as one (`joined`): a caller behind the engine catches up in one message."""
        while True:
            items = await self._take_items()
            end = next((i for i, item in enumerate(items) if item is _END or isinstance(item, BaseException)), None)
            if deltas := items[:end]:
                yield joined(deltas)
            if end is not None:
                if isinstance(items[end], BaseException):
                    raise items[end]
                return


class EngineCall(Job):
    """A short engine operation, `fn(engine)`, run between steps; its result comes back as one item."""

    def __init__(self, fn: Callable[[Engine], Any], name: str, lease: Lease | None = None):
        super().__init__(name, lease)
        self.fn = fn

    async def result(self) -> Any:
        item = (await self._take_items())[0]
        if isinstance(item, BaseException):
            raise item
        return item


def joined(deltas: list[GenerationDelta]) -> GenerationDelta:
    """Consecutive deltas of one generation as one: their tokens, text and logprobs in order, the last one's finish
    reason and usage (only the last delta has them)."""
    if len(deltas) == 1:
        return deltas[0]
    logprobs = [lp for d in deltas for lp in d.logprobs or ()] if any(d.logprobs for d in deltas) else None
    last = deltas[-1]
    return GenerationDelta([t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), logprobs,
                           last.finish_reason, last.usage)


class EngineWorker:
    def __init__(self, engine: Engine, max_queued: int):
        if max_queued < 0:
            raise ConfigError(f"the request queue needs a size >= 0 (got {max_queued})")
        config = dataclasses.replace(engine.scheduler.config, max_queue=max_queued)
        config.check()
        engine.scheduler.config = config
        self.engine = engine
        self.max_queued = max_queued
        self._inbox: deque[Job] = deque()  # jobs the engine thread has not taken yet
        self._running: list[GenerationJob] = []  # generations in the engine
        self._wakeup = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="lucekv-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._wakeup:
            if self._stopping:
                raise ServerStoppingError("the server is shutting down")
            self._inbox.append(job)
            if job.session_id:
                self.engine.sessions.begin_request(job.session_id)
            self._wakeup.notify()

    def submit_or_release(self, job: Job) -> None:
        """submit; a job the worker refuses gives its lease back."""
        try:
            self.submit(job)
        except BaseException:
            job.release_lease()
            raise

    @property
    def queued(self) -> int:
        """Calls waiting for a place in the batch (read from the event loop: a gauge's estimate)."""
        return len(self._inbox) + len(self.engine.scheduler.waiting)

    def cancel(self, job: Job) -> None:
        """Frees the job's place at once if the engine has not taken it; else it stops after the current step."""
        job.cancelled.set()
        with self._wakeup:
            if job in self._inbox:
                self._inbox.remove(job)
                self._release(job)
            self._wakeup.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """Ends the waiting and running jobs with ServerStoppingError and lets the thread finish."""
        with self._wakeup:
            self._stopping = True
            waiting = list(self._inbox)
            ended = [*waiting, *self._running]
            self._inbox.clear()
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

    async def call(self, fn: Callable[[Engine], Any], name: str, lease: Lease | None = None) -> Any:
        """Run `fn(engine)` on the engine thread between two steps; its result or its exception. The lease, if any,
        is the job's from here on (released when it leaves the queue)."""
        job = EngineCall(fn, name, lease)
        self.submit_or_release(job)
        try:
            return await job.result()
        finally:
            self.cancel(job)

    # ---- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        finally:  # stopping: the generations left end here (their calls were told already)
            for job in self._running:
                self.engine.cancel(job.request)
                self._release(job)
            self._save_routing_trace()

    def _save_routing_trace(self) -> None:
        """--spark-record: the routing trace's last write, on the engine's thread (its backend's)."""
        try:
            self.engine.save_routing_trace()
        except Exception:
            logger.exception("writing the routing trace (--spark-record)")

    def _serve(self) -> None:
        while (jobs := self._next_jobs()) is not None:
            for job in jobs:
                self._take(job)
            for job in self._running:
                if job.cancelled.is_set():
                    self.engine.cancel(job.request)
            if self.engine.has_work:
                try:
                    self.engine.step()
                except Exception as e:  # the engine failed outside its own handling: its requests get the error
                    logger.exception("an engine step failed")
                    self.engine.fail_all(e)
            self._hand_out()

    def _next_jobs(self) -> list[Job] | None:
        """The jobs that arrived since the last step (waiting for one while the engine is idle); None to stop."""
        with self._wakeup:
            while not self._inbox and not self._stopping and not self.engine.has_work and not any(
                    job.cancelled.is_set() and not job.request.done for job in self._running):
                self._wakeup.wait()
            if self._stopping:
                return None
            jobs = list(self._inbox)
            self._inbox.clear()
            return jobs

    def _take(self, job: Job) -> None:
        """A new job into the engine: a generation is submitted, an engine call runs now."""
        if job.cancelled.is_set():  # cancelled between leaving the inbox and here
            self._release(job)
            return
        try:
            if job.lease:
                job.lease.sync(self.engine)
            if isinstance(job, EngineCall):
                result = job.fn(self.engine)
                if job.lease:
                    job.lease.commit(self.engine)
                    job.release_lease()
                self._release(job)
                job.deliver(result)
                return
            job.request = self.engine.submit(job.prompt_ids, job.params, job.session_id, job.pin_prefix,
                                             job.speculation, arrived=job.submitted_at, prefill_keep=job.prefill_keep)
        except Exception as e:  # the handler maps it to a status code; the worker keeps serving
            self._release(job)
            job.deliver(e)
            return
        self._running.append(job)

    def _hand_out(self) -> None:
        """Every generation's new deltas to its call, in one wake-up of the server's loop (one per delta would wake it
        once per row of a step, each wake-up taking the GIL from this thread); those that ended leave (their last
        delta waits for `_finish`)."""
        deltas: list[tuple[Job, object]] = []
        for job in self._running:
            while job.request.out:
                delta = job.request.out.popleft()
                if delta.finish_reason:
                    job.held = delta
                else:
                    deltas.append((job, delta))
        if deltas and not deliver_all(deltas):
            for job in {id(job): job for job, _ in deltas}.values():
                logger.info("request %s stopped: its call ended", job.request_id)
                self.engine.cancel(job.request)
        for job in [job for job in self._running if job.request.done]:
            self._running.remove(job)
            self._finish(job)

    def _finish(self, job: GenerationJob) -> None:
        """The generation ended: a leased session is written back, then the session is idle and the lease given back,
        and only then does the call hear its last delta (or error), so that its next call can never find the session
        busy or leased."""
        error = job.request.error
        try:
            if error is None and job.lease:
                job.lease.commit(self.engine)
        except Exception as e:
            error = e
        finally:
            self._release(job)
        if error is not None:
            if not job.deliver(error):
                logger.error("request %s failed after its caller left", job.request_id, exc_info=error)
            return
        if job.held is not None:
            job.deliver(job.held)
        job.deliver(_END)

    def _release(self, job: Job) -> None:
        """The job left for good: its session may be restored over or deleted again, its lease goes."""
        if job.session_id:
            self.engine.sessions.end_request(job.session_id)
        job.release_lease()
