"""Where snapshot blobs are kept, by session id: in memory (LRU) or in a directory (atomic, crash-safe writes).

Stores move bytes only; read_snapshot validates a blob when it is loaded.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from lucekv.errors import InvalidRequestError, ResourceLimitError

READ_PIECE_BYTES = 1 << 20
BLOB_SUFFIX = ".lkvs"
TEMP_SUFFIX = ".tmp"
FINGERPRINT_DIR_CHARS = 16
_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def check_session_id(session_id: str) -> str:
    """The session id, if it is 1..128 characters of [A-Za-z0-9._:-] not starting with "." (a file name in any
    directory store, never a path or a hidden/temporary file)."""
    if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id) or session_id.startswith("."):
        shown = repr(session_id) if len(repr(session_id)) <= 40 else repr(session_id)[:40] + ".."
        raise InvalidRequestError("session_id", f"must be 1 to 128 characters of A-Z a-z 0-9 . _ : - not starting "
                                                f"with '.' (got {shown})")
    return session_id


class SnapshotStore(Protocol):
    def put(self, key: str, pieces: Iterable[bytes]) -> int:
        """Store the blob; bytes stored. Replaces an existing key atomically: a failure keeps the old value."""

    def open(self, key: str) -> Iterator[bytes]:
        """The blob in pieces of about 1 MiB; KeyError (at the call) if absent."""

    def delete(self, key: str) -> bool:
        """True if it existed."""

    def keys(self) -> list[str]: ...

    def size(self, key: str) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class MemorySnapshotStore:
    """Blobs in memory. put and open refresh a key; past max_bytes in all, least recently used keys go."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be non-negative, got {max_bytes}")
        self.max_bytes = max_bytes
        self._blobs: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(map(len, self._blobs.values()))

    def put(self, key: str, pieces: Iterable[bytes]) -> int:
        check_session_id(key)
        blob = b"".join(pieces)
        if len(blob) > self.max_bytes:
            raise ResourceLimitError(f"a snapshot of {len(blob)} bytes does not fit the in-memory snapshot store "
                                     f"of {self.max_bytes} bytes")
        with self._lock:
            self._blobs[key] = blob
            self._blobs.move_to_end(key)
            self._evict()
        return len(blob)

    def open(self, key: str) -> Iterator[bytes]:
        with self._lock:
            blob = self._blobs[key]
            self._blobs.move_to_end(key)
        return slices(blob)

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._blobs.pop(key, None) is not None

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._blobs)

    def size(self, key: str) -> int:
        with self._lock:
            return len(self._blobs[key])

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._blobs

    def _evict(self) -> None:
        total = sum(map(len, self._blobs.values()))
        while total > self.max_bytes:
            _, blob = self._blobs.popitem(last=False)
            total -= len(blob)


class DirectorySnapshotStore:
    """Blobs as files root/<first 16 hex chars of the model fingerprint>/<key>.lkvs, so one root can serve
    several models and a blob never loads into the wrong one. A put writes a hidden temp file beside the final
    name, fsyncs it, renames it over the final name and fsyncs the directory: a reader or a crash sees the old
    blob or the new one, whole. One server process owns a model's directory at a time."""

    def __init__(self, root: Path, fingerprint: str):
        if not re.fullmatch(rf"[0-9a-fA-F]{{{FINGERPRINT_DIR_CHARS},}}", fingerprint):
            raise ValueError(f"model fingerprint {fingerprint!r} is not a hex string of at least "
                             f"{FINGERPRINT_DIR_CHARS} characters")
        self.directory = Path(root) / fingerprint[:FINGERPRINT_DIR_CHARS].lower()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_temp_files()

    def put(self, key: str, pieces: Iterable[bytes]) -> int:
        path = self._path(key)
        fd, temp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.", suffix=TEMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                nbytes = sum(f.write(piece) for piece in pieces)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        except BaseException:  # a failing or interrupted writer leaves the old value and no temp file
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        self._sync_directory()
        return nbytes

    def open(self, key: str) -> Iterator[bytes]:
        try:
            f = open(self._path(key), "rb")  # opened now: KeyError at the call, and a later put cannot swap it
        except FileNotFoundError:
            raise KeyError(key) from None
        return _read_pieces(f)

    def delete(self, key: str) -> bool:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            return False
        self._sync_directory()
        return True

    def keys(self) -> list[str]:
        return sorted(p.name[: -len(BLOB_SUFFIX)] for p in self.directory.iterdir()
                      if p.name.endswith(BLOB_SUFFIX) and _is_session_id(p.name[: -len(BLOB_SUFFIX)]))

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise KeyError(key) from None

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and _is_session_id(key) and self._path(key).is_file()

    def _path(self, key: str) -> Path:
        return self.directory / f"{check_session_id(key)}{BLOB_SUFFIX}"

    def _remove_temp_files(self) -> None:
        """Leftovers of a writer killed before its rename; keys never start with "." so these are never blobs."""
        for p in self.directory.glob(f".*{TEMP_SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def _sync_directory(self) -> None:
        """Make the rename (or unlink) itself durable."""
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _is_session_id(name: str) -> bool:
    try:
        check_session_id(name)
    except InvalidRequestError:
        return False
    return True


def slices(blob: bytes) -> Iterator[bytes]:
    for start in range(0, len(blob), READ_PIECE_BYTES):
        yield blob[start : start + READ_PIECE_BYTES]


def _read_pieces(f: BinaryIO) -> Iterator[bytes]:
    with f:
        while piece := f.read(READ_PIECE_BYTES):
            yield piece


def open_snapshot_store(where: str, fingerprint: str, ttl_seconds: int = 0, lease_seconds: float = 15.0,
                        ) -> SnapshotStore:
    """`redis://HOST:PORT/DB`: a RedisSnapshotStore shared by replicas; anything else: a directory."""
    if where.startswith(("redis://", "rediss://")):
        from lucekv.snapshot.redis_store import RedisSnapshotStore

        return RedisSnapshotStore(where, fingerprint, ttl_seconds, lease_seconds)
    return DirectorySnapshotStore(Path(where), fingerprint)
