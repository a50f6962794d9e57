"""Snapshot blobs in Redis, shared by the replicas of one model, with a lease per session (DESIGN §10).

Keys, all under `lucekv:<first 16 hex chars of the model fingerprint>:` so a blob never loads into another model:

    blob:<session>    a hash: the blob in pieces "0", "1", ... (about 1 MiB each: no value nears Redis' 512 MB
                      limit), "pieces", "size", and "version" (the fencing token of the lease it was written under)
    lease:<session>   "<owner> <token>", set if absent with an expiry; renewed while held
    fence:<session>   the counter the tokens come from
    upload:<session>:<random>   a blob being written; renamed over blob:<session> when whole

A put streams its pieces into an upload key and renames it over the blob in one script that first checks that
this process still holds the session's lease: a replica whose lease lapsed (it stalled, another took over) can
never overwrite the newer blob. Readers see the old blob or the new one, whole.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterable, Iterator
from urllib.parse import urlparse

import redis

from lucekv.errors import ConfigError, LucekvError, PreconditionError
from lucekv.snapshot.store import FINGERPRINT_DIR_CHARS, check_session_id, slices

logger = logging.getLogger(__name__)

UPLOAD_TTL_MS = 3600_000  # a writer killed mid-put leaves an upload key that expires by itself

_ACQUIRE = """
local held = redis.call('GET', KEYS[1])
if held then
  local owner, token = string.match(held, '^(%S+) (%d+)$')
  if owner == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(token)
  end
  return -1
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. token, 'PX', ARGV[2])
if tonumber(ARGV[3]) > 0 then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end
return token
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_COMMIT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  redis.call('DEL', KEYS[2])
  return 0
end
redis.call('HSET', KEYS[2], 'version', ARGV[2])
redis.call('RENAME', KEYS[2], KEYS[3])
if tonumber(ARGV[3]) > 0 then redis.call('PEXPIRE', KEYS[3], ARGV[3]) else redis.call('PERSIST', KEYS[3]) end
return 1
"""
_DELETE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
redis.call('DEL', KEYS[3])
return redis.call('DEL', KEYS[2])
"""


def _store_errors(method):
    """Redis' errors (connection lost, timeouts) as StoreError: the server answers UNAVAILABLE."""

    @functools.wraps(method)
    def call(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except redis.RedisError as e:
            raise StoreError(f"Redis: {e}") from e

    return call


class LeaseError(PreconditionError):
    """Another replica holds the session, or this one's hold on it lapsed."""


class StoreError(LucekvError):
    """The store cannot be reached or answered something unexpected."""


class RedisSnapshotStore:
    """A SnapshotStore over Redis whose writes and deletes need the session's lease (`acquire`).

    Leases are counted per process (two calls of this process on one session share one lease) and renewed by
    a background thread every third of `lease_seconds`. `changed_elsewhere` tells whether the blob differs from
    the one this process last wrote or read, so a replica never continues from a stale copy in its memory."""

    def __init__(self, url: str, fingerprint: str, ttl_seconds: int = 0, lease_seconds: float = 15.0,
                 owner: str | None = None):
        parsed = urlparse(url)
        if parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
            raise ConfigError(f"snapshot store {url!r}: expected redis://HOST:PORT/DB")
        self._redis = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
        try:
            self._redis.ping()
        except redis.RedisError as e:
            raise ConfigError(f"snapshot store {url}: cannot reach Redis: {e}") from e
        self.prefix = f"lucekv:{fingerprint[:FINGERPRINT_DIR_CHARS].lower()}:"
        self.ttl_ms = int(ttl_seconds * 1000)
        self.lease_ms = max(int(lease_seconds * 1000), 1)
        self.owner = owner or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._acquire, self._renew, self._release, self._commit, self._delete = (
            self._redis.register_script(s) for s in (_ACQUIRE, _RENEW, _RELEASE, _COMMIT, _DELETE))
        self._lock = threading.Lock()
        self._held: dict[str, tuple[str, int]] = {}  # session -> (lease value, holders in this process)
        self._seen: dict[str, int] = {}  # session -> version of the blob this process last wrote or read
        self._closed = threading.Event()
        self._renewer = threading.Thread(target=self._renew_held, name="lucekv-lease-renewal", daemon=True)
        self._renewer.start()

    # ---- leases -----------------------------------------------------------------------------------

    @_store_errors
    def acquire(self, key: str) -> None:
        """Hold the session's lease (again, if this process holds it already); LeaseError if another does."""
        check_session_id(key)
        with self._lock:
            if key in self._held:
                value, count = self._held[key]
                self._held[key] = (value, count + 1)
                return
            token = self._call(self._acquire, [self._key("lease", key), self._key("fence", key)],
                               [self.owner, self.lease_ms, self.ttl_ms])
            if token < 0:
                raise LeaseError(f"session {key!r} is being served by another replica; retry later")
            self._held[key] = (f"{self.owner} {token}", 1)

    @_store_errors
    def release(self, key: str) -> None:
        with self._lock:
            value, count = self._held.pop(key, (None, 0))
            if count > 1:
                self._held[key] = (value, count - 1)
            elif value is not None:
                self._call(self._release, [self._key("lease", key)], [value])

    @_store_errors
    def changed_elsewhere(self, key: str) -> bool:
        """Whether the store's blob (or its absence) may not be the one this process last wrote or read: also
        true of a session this process never wrote or read (a copy it listed may have expired since)."""
        version = self._redis.hget(self._key("blob", key), "version")
        with self._lock:
            return key not in self._seen or version is None or int(version) != self._seen[key]

    # ---- SnapshotStore ------------------------------------------------------------------------------

    @_store_errors
    def put(self, key: str, pieces: Iterable[bytes]) -> int:
        value = self._lease_value(key)
        upload = self._key("upload", f"{key}:{uuid.uuid4().hex}")
        nbytes = n = 0
        try:
            for piece in (part for whole in pieces for part in slices(whole)):
                pipe = self._redis.pipeline(transaction=False)
                pipe.hset(upload, str(n), piece)
                pipe.pexpire(upload, UPLOAD_TTL_MS)
                pipe.execute()
                nbytes, n = nbytes + len(piece), n + 1
            self._redis.hset(upload, mapping={"pieces": n, "size": nbytes})
        except BaseException:
            self._redis.delete(upload)
            raise
        token = int(value.rsplit(" ", 1)[1])
        if not self._call(self._commit, [self._key("lease", key), upload, self._key("blob", key)],
                          [value, token, self.ttl_ms]):
            self._lost(key)
        with self._lock:
            self._seen[key] = token
        return nbytes

    @_store_errors
    def open(self, key: str) -> Iterator[bytes]:
        blob = self._key("blob", key)
        n, version = self._redis.hmget(blob, ["pieces", "version"])
        if n is None:
            raise KeyError(key)
        if self.ttl_ms:
            self._redis.pexpire(blob, self.ttl_ms)
        with self._lock:
            self._seen[key] = int(version)
        return self._pieces(blob, int(n), version)

    def _pieces(self, blob: str, n: int, version: bytes) -> Iterator[bytes]:
        for i in range(n):
            try:
                piece, now = self._redis.hmget(blob, [str(i), "version"])
            except redis.RedisError as e:
                raise StoreError(f"Redis: {e}") from e
            if now != version or piece is None:
                raise StoreError(f"{blob} was replaced or expired while it was read")
            yield piece

    @_store_errors
    def delete(self, key: str) -> bool:
        deleted = self._call(self._delete, [self._key("lease", key), self._key("blob", key), self._key("fence", key)],
                             [self._lease_value(key)])
        if deleted < 0:
            self._lost(key)
        with self._lock:
            self._seen.pop(key, None)
        return bool(deleted)

    @_store_errors
    def keys(self) -> list[str]:
        start = len(self._key("blob", ""))
        return sorted(k.decode()[start:] for k in self._redis.scan_iter(match=self._key("blob", "*"), count=1000))

    @_store_errors
    def size(self, key: str) -> int:
        size = self._redis.hget(self._key("blob", key), "size")
        if size is None:
            raise KeyError(key)
        return int(size)

    @_store_errors
    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and bool(self._redis.exists(self._key("blob", key)))

    def close(self) -> None:
        self._closed.set()
        self._renewer.join(timeout=5)
        with self._lock:
            held, self._held = self._held, {}
        for key, (value, _) in held.items():
            try:
                self._call(self._release, [self._key("lease", key)], [value])
            except StoreError as e:  # the lease then lapses by itself
                logger.warning("releasing session %s's lease: %s", key, e)
        self._redis.close()

    # ---- internals ----------------------------------------------------------------------------------

    def _key(self, kind: str, key: str) -> str:
        return f"{self.prefix}{kind}:{key}"

    def _lease_value(self, key: str) -> str:
        with self._lock:
            held = self._held.get(key)
        if held is None:
            raise LeaseError(f"this replica does not hold session {key!r}'s lease: it cannot write it")
        return held[0]

    def _lost(self, key: str) -> None:
        with self._lock:
            self._held.pop(key, None)
        raise LeaseError(f"session {key!r}: this replica's lease lapsed and another replica took the session over; "
                         "the change was not saved")

    def _call(self, script, keys: list[str], args: list) -> int:
        try:
            return int(script(keys=keys, args=args))
        except redis.RedisError as e:
            raise StoreError(f"Redis: {e}") from e

    def _renew_held(self) -> None:
        while not self._closed.wait(self.lease_ms / 3000):
            with self._lock:
                held = [(k, v) for k, (v, _) in self._held.items()]
            for key, value in held:
                try:
                    renewed = self._call(self._renew, [self._key("lease", key)], [value, self.lease_ms])
                except StoreError as e:
                    logger.warning("renewing session %s's lease: %s", key, e)
                    continue
                if not renewed:
                    logger.error("session %s: lease lost (expired and taken by another replica)", key)
