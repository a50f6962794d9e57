"""Sessions shared by replicas through one store (DESIGN §10): a call that uses a session holds its lease.

While a call holds the lease no other replica can serve the session. On the engine thread, before the call's
work, a copy in this replica's memory that the store has moved past (another replica served a turn meanwhile)
is dropped, so the blob is loaded instead; after the work the session is written back, fenced by the lease, so
the turn a client saw complete is in the store when the next replica picks the session up.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from lucekv.engine.engine import Engine
from lucekv.errors import LucekvError
from lucekv.snapshot.store import SnapshotStore


class LeasingStore(SnapshotStore, Protocol):
    def acquire(self, key: str) -> None: ...

    def release(self, key: str) -> None: ...

    def changed_elsewhere(self, key: str) -> bool: ...


@dataclass
class Lease:
    store: LeasingStore
    session_id: str

    def sync(self, engine: Engine) -> None:
        """Engine thread, before the work: make the engine's copy the store's."""
        if self.store.changed_elsewhere(self.session_id):
            engine.reload_from_store(self.session_id)

    def commit(self, engine: Engine) -> None:
        """Engine thread, after the work: the session as it is now into the store. A refused write (the lease
        lapsed) also drops the local copy, which no longer matches what the replicas agree on."""
        if engine.sessions.get(self.session_id) is None:
            return  # deleted, or a call that failed before it made the session
        try:
            engine.save_session(self.session_id)
        except LucekvError:
            engine.reload_from_store(self.session_id)
            raise

    def release(self) -> None:
        self.store.release(self.session_id)


def is_shared(store: SnapshotStore | None) -> bool:
    return store is not None and hasattr(store, "acquire")


async def take_lease(store: SnapshotStore | None, session_id: str) -> Lease | None:
    """The session's lease when the store is shared (LeaseError if another replica holds it), else None."""
    if not is_shared(store):
        return None
    await asyncio.to_thread(store.acquire, session_id)
    return Lease(store, session_id)
