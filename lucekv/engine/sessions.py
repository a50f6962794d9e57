"""Sessions: named token histories whose K/V outlive a request (DESIGN §5).

A session is *live* while it holds blocks of the backend's pool (running, or idle with its chunks still there: the
pool takes them back when another sequence needs them), *parked* when all its chunks are in host RAM (its host
store), or *stored*: spilled as a snapshot blob to a snapshot store, loaded again when used.
The table here is bookkeeping only; moving K/V between pool, host and store is the engine's part. Its lock
makes listing safe from the server's event loop while the engine thread changes sessions.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from lucekv.errors import NotFoundError, PreconditionError
from lucekv.kvflash.sequence import PagedSequence
from lucekv.pflash import PromptAlias

SessionState = Literal["live", "parked", "stored"]


@dataclass(eq=False)
class Session:
    id: str  # "" for a request without a session: never listed or stored
    paged: PagedSequence | None  # its sequence: blocks in the pool, host store, policy (None while stored)
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V the session holds, positions 0..n-1
    sampler: dict = field(default_factory=dict)  # the sampling settings of its last request
    created_unix: float = field(default_factory=time.time)
    last_used_unix: float = field(default_factory=time.time)
    stored_bytes: int = 0  # > 0: the session is only in the snapshot store, as a blob of this size
    in_store: bool = False  # the snapshot store holds it as it is here (spilling it writes nothing)
    request: object | None = None  # the engine's request using it (one at a time)
    drafters: dict = field(default_factory=dict)  # speculation's drafters by kind, kept across turns (lucekv.spec)
    prompt_alias: PromptAlias | None = None  # its latest compressed prompt as the client sent it (lucekv.pflash)

    @property
    def host_bytes(self) -> int:
        """Host RAM its chunks take (those paged out, or the whole parked context)."""
        return self.paged.host.nbytes if self.paged is not None else 0


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    state: SessionState
    n_tokens: int  # -1: stored by an earlier run and not read yet
    host_bytes: int
    stored_bytes: int
    created_unix: float
    last_used_unix: float
    generating: bool


class SessionTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._stored_tokens: dict[str, int] = {}  # token counts of sessions spilled by this process
        self._pending: dict[str, int] = {}  # Generate calls queued or running, per session id

    def get(self, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.get(session_id)

    def require(self, session_id: str) -> Session:
        s = self.get(session_id)
        if s is None:
            raise NotFoundError(f"session {session_id!r} does not exist")
        return s

    def put(self, s: Session) -> None:
        with self._lock:
            self._sessions[s.id] = s

    def remove(self, session_id: str) -> Session | None:
        with self._lock:
            self._stored_tokens.pop(session_id, None)
            return self._sessions.pop(session_id, None)

    def mark_stored(self, s: Session, nbytes: int) -> None:
        """The session's K/V now lives only in the snapshot store."""
        with self._lock:
            self._stored_tokens[s.id] = len(s.tokens)
            s.tokens, s.paged, s.drafters, s.stored_bytes = [], None, {}, nbytes
            s.prompt_alias = None  # the blob keeps it

    def in_memory(self) -> list[Session]:
        with self._lock:
            return [s for s in self._sessions.values() if not s.stored_bytes]

    def idle_by_age(self) -> list[Session]:
        """In-memory sessions no request is using, least recently used first (candidates to spill)."""
        return sorted((s for s in self.in_memory() if not self.busy(s.id)), key=lambda s: s.last_used_unix)

    def host_bytes(self) -> int:
        return sum(s.host_bytes for s in self.in_memory())

    def begin_request(self, session_id: str) -> None:
        """A Generate call on the session is queued: until `end_request` it may not be restored over or deleted."""
        with self._lock:
            self._pending[session_id] = self._pending.get(session_id, 0) + 1

    def end_request(self, session_id: str) -> None:
        with self._lock:
            left = self._pending.pop(session_id) - 1
            if left:
                self._pending[session_id] = left

    def busy(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._pending

    def check_idle(self, session_id: str, action: str) -> None:
        if self.busy(session_id):
            raise PreconditionError(f"cannot {action} session {session_id!r}: a Generate call is using it")

    def info(self, s: Session) -> SessionInfo:
        with self._lock:
            live = s.paged is not None and s.paged.held_blocks > 0
            state: SessionState = "stored" if s.stored_bytes else "live" if live else "parked"
            n = self._stored_tokens.get(s.id, -1) if s.stored_bytes else len(s.tokens)
            return SessionInfo(s.id, state, n, s.host_bytes, s.stored_bytes, s.created_unix, s.last_used_unix,
                               s.id in self._pending)

    def infos(self) -> list[SessionInfo]:
        with self._lock:
            sessions = sorted(self._sessions.values(), key=lambda s: s.id)
        return [self.info(s) for s in sessions]
