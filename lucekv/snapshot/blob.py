"""The session snapshot blob (DESIGN §5; byte layout and rules in docs/snapshot-format.md).

    MAGIC | u32 version | u32 header_len | header (UTF-8 JSON) | chunk records | SHA-256 of all preceding bytes

A chunk record is `u32 index | u32 rows | K/V bytes`, the bytes of an array [n_layer, 2 (K, V), rows, n_kv_head,
head_dim] in the layout's little-endian dtype. All integers are little-endian.

Writing is lazy (one chunk and one piece in memory); reading is incremental and refuses a blob as soon as what it
has read is wrong: the header before any record, declared sizes before anything is allocated, and every byte
against the digest before the caller gets a Snapshot. Any input raises SnapshotError (malformed) or
SnapshotMismatchError (well-formed, but for another model or format), never another exception.

Sliding-window layers share the paged slot space of the full-attention ones, so their K/V is in the chunk records
like any layer's and there is no separate ring state.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from lucekv.errors import InvalidRequestError, LucekvError
from lucekv.snapshot.store import check_session_id

FORMAT_VERSION = 1
MAGIC = b"LUCEKVSS"
FLAG_PARTIAL = 1  # the snapshot stops before the session's end (upto_tokens)
KNOWN_FLAGS = FLAG_PARTIAL
PIECE_BYTES = 1 << 20
MAX_HEADER_BYTES = 64 << 20
HEADER_SLACK_BYTES = 16 << 20  # header room besides the token ids: pager and policy state (its query window), ...
KV_DTYPES = {"f16": np.dtype("<f2"), "f32": np.dtype("<f4")}

_PREFIX = struct.Struct("<8sII")  # magic, version, header_len
_RECORD_HEAD = struct.Struct("<II")  # chunk index, rows
_DIGEST_BYTES = hashlib.sha256().digest_size


class SnapshotError(LucekvError):
    """A malformed blob (truncated, corrupt, inconsistent): the server answers INVALID_ARGUMENT."""


class SnapshotMismatchError(SnapshotError):
    """A well-formed blob that is not for this server (another model, KV layout or format version):
    FAILED_PRECONDITION."""


@dataclass(frozen=True)
class KVLayout:
    """What a server's model holds per token; a blob restores only into a server with exactly this layout."""

    fingerprint: str
    arch: str
    n_layer: int
    n_kv_head: int
    head_dim: int
    kv_dtype: str  # "f16" or "f32"
    chunk_tokens: int = 64

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        if min(self.n_layer, self.n_kv_head, self.head_dim, self.chunk_tokens) < 1:
            raise ValueError(f"layout dimensions must be positive: {self}")

    @property
    def dtype(self) -> np.dtype:
        return KV_DTYPES[self.kv_dtype]

    @property
    def token_bytes(self) -> int:
        """K and V bytes of one token over all layers."""
        return self.n_layer * 2 * self.n_kv_head * self.head_dim * self.dtype.itemsize

    def chunk_shape(self, rows: int) -> tuple[int, ...]:
        return (self.n_layer, 2, rows, self.n_kv_head, self.head_dim)

    def record_bytes(self, rows: int) -> int:
        """A chunk record of `rows` rows: its head and its K/V bytes."""
        return _RECORD_HEAD.size + rows * self.token_bytes


@dataclass(frozen=True)
class SnapshotHeader:
    layout: KVLayout
    token_ids: tuple[int, ...]  # the tokens whose K/V the blob holds (positions 0..n-1)
    session_id: str
    sampler: dict  # JSON-safe: the sampling settings of the session's last request
    flags: int = 0
    created_unix: float = 0.0
    pager: dict | None = None  # JSON-safe residency and policy state of a paged session (kvflash); None: none
    # a session holding a compressed prompt (lucekv.pflash): the prompt as the client sent it, and the length of the
    # prefix of token_ids it stands for; None: none
    prompt_alias: tuple[tuple[int, ...], int] | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def n_chunks(self) -> int:
        return -(-self.n_tokens // self.layout.chunk_tokens)


@dataclass
class Snapshot:
    header: SnapshotHeader
    chunks: list[np.ndarray]  # chunk c: [n_layer, 2, rows_c, n_kv_head, head_dim], layout dtype
    nbytes: int  # blob size


def chunk_rows(n_tokens: int, chunk: int, c: int) -> int:
    """Rows of chunk c of an n_tokens sequence (the last one may be partial)."""
    if not 0 <= c * chunk < n_tokens:
        raise ValueError(f"chunk {c} is outside a sequence of {n_tokens} tokens in chunks of {chunk}")
    return min(chunk, n_tokens - c * chunk)


# ---- writing --------------------------------------------------------------------------------------------------


def write_snapshot(header: SnapshotHeader, chunk_kv: Callable[[int], np.ndarray],
                   piece_bytes: int = PIECE_BYTES) -> Iterator[bytes]:
    """The blob as pieces of exactly piece_bytes (the last may be shorter). chunk_kv(c) returns chunk c's K/V,
    [n_layer, 2, rows, n_kv_head, head_dim] in the layout's dtype with at least chunk_rows(...) rows (only those
    are written); it is called once per chunk, in order, as the pieces are consumed."""
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
    return _pieces(_hashed(_blob_parts(header, chunk_kv)), piece_bytes)


def blob_size(header: SnapshotHeader) -> int:
    """Bytes of the blob write_snapshot produces for `header`."""
    records = sum(header.layout.record_bytes(chunk_rows(header.n_tokens, header.layout.chunk_tokens, c))
                  for c in range(header.n_chunks))
    return _PREFIX.size + len(_encode_header(header)) + records + _DIGEST_BYTES


def _blob_parts(header: SnapshotHeader, chunk_kv: Callable[[int], np.ndarray]) -> Iterator[bytes | memoryview]:
    header_json = _encode_header(header)
    yield _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_json))
    yield header_json
    for c in range(header.n_chunks):
        rows = chunk_rows(header.n_tokens, header.layout.chunk_tokens, c)
        yield _RECORD_HEAD.pack(c, rows)
        yield _as_bytes(_record_array(header.layout, chunk_kv(c), c, rows))


def _encode_header(header: SnapshotHeader) -> bytes:
    """Deterministic, so blob_size agrees with the bytes written."""
    doc = {
        "layout": {name: getattr(header.layout, name) for name in _LAYOUT_FIELDS},
        "n_tokens": header.n_tokens,
        "n_chunks": header.n_chunks,
        "token_ids": [int(t) for t in header.token_ids],
        "session_id": header.session_id,
        "sampler": header.sampler,
        "flags": header.flags,
        "created_unix": header.created_unix,
        "pager": header.pager,
    }
    if header.prompt_alias is not None:  # optional: a blob without one reads as before
        client, held = header.prompt_alias
        doc["prompt_alias"] = {"client": [int(t) for t in client], "held": held}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _record_array(layout: KVLayout, kv: np.ndarray, c: int, rows: int) -> np.ndarray:
    want = layout.chunk_shape(rows)
    if kv.ndim != 5 or kv.shape[:2] + kv.shape[3:] != want[:2] + want[3:] or kv.shape[2] < rows \
            or kv.dtype.newbyteorder("<") != layout.dtype:
        raise ValueError(f"chunk {c}: K/V {kv.dtype}{kv.shape} does not fit the layout's {layout.dtype}{want}")
    return np.ascontiguousarray(kv[:, :, :rows], dtype=layout.dtype)


def _hashed(parts: Iterator[bytes | memoryview]) -> Iterator[bytes | memoryview]:
    """The parts, then the SHA-256 digest of all of them."""
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(part)
        yield part
    yield hasher.digest()


def _pieces(parts: Iterator[bytes | memoryview], piece_bytes: int) -> Iterator[bytes]:
    """Re-cut a byte stream into pieces of piece_bytes, copying each byte once."""
    pending = bytearray()
    for part in parts:
        view = memoryview(part)
        if pending:
            take = piece_bytes - len(pending)
            pending += view[:take]
            view = view[take:]
            if len(pending) < piece_bytes:
                continue
            yield bytes(pending)
            pending = bytearray()
        while len(view) >= piece_bytes:
            yield bytes(view[:piece_bytes])
            view = view[piece_bytes:]
        pending += view
    if pending:
        yield bytes(pending)


def _as_bytes(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1).view(np.uint8))


# ---- reading --------------------------------------------------------------------------------------------------


def read_snapshot(pieces: Iterable[bytes], expect: KVLayout, *, max_tokens: int, vocab_size: int) -> Snapshot:
    """Parse and validate a whole blob arriving in pieces of any size, for a server with layout `expect`, a
    context of max_tokens and vocab_size tokens. Raises SnapshotError / SnapshotMismatchError naming the
    problem, and nothing else whatever the bytes."""
    stream = _Stream(pieces)
    header = _read_header(stream, expect, max_tokens, vocab_size)
    chunks = [_read_record(stream, header, c) for c in range(header.n_chunks)]
    _check_digest(stream)
    stream.check_end()
    return Snapshot(header, chunks, stream.offset)


class _Stream:
    """Exact reads over pieces of any size, hashing what it reads, with byte counts for the messages."""

    def __init__(self, pieces: Iterable[bytes]):
        self._pieces = iter(pieces)
        self._piece = memoryview(b"")
        self._pos = 0
        self.offset = 0
        self.hasher = hashlib.sha256()

    def read(self, n: int, what: str, hashed: bool = True) -> bytes:
        out = bytearray(n)
        self.readinto(memoryview(out), what, hashed)
        return bytes(out)

    def readinto(self, out: memoryview, what: str, hashed: bool = True) -> None:
        filled = 0
        while filled < len(out):
            if self._pos == len(self._piece):
                self._next_piece(what, filled, len(out))
            n = min(len(out) - filled, len(self._piece) - self._pos)
            out[filled : filled + n] = self._piece[self._pos : self._pos + n]
            filled += n
            self._pos += n
        self.offset += len(out)
        if hashed:
            self.hasher.update(out)

    def check_end(self) -> None:
        if self._pos < len(self._piece) or any(len(p) for p in self._pieces):
            raise SnapshotError(f"trailing bytes after the digest (the blob should end at byte {self.offset})")

    def _next_piece(self, what: str, filled: int, want: int) -> None:
        piece = next(self._pieces, None)
        if piece is None:
            if self.offset + filled == 0:
                raise SnapshotError("truncated: the blob is empty")
            raise SnapshotError(f"truncated: the blob ends inside {what} (read {filled} of {want} bytes; "
                                f"it stops after {self.offset + filled} bytes)")
        self._piece, self._pos = memoryview(piece).cast("B"), 0


def _read_header(stream: _Stream, expect: KVLayout, max_tokens: int, vocab_size: int) -> SnapshotHeader:
    magic, version, header_len = _PREFIX.unpack(stream.read(_PREFIX.size, "the blob's prefix (magic, version, "
                                                                           "header length)"))
    if magic != MAGIC:
        raise SnapshotError(f"not a lucekv snapshot: the blob starts with {magic!r}, not {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise SnapshotMismatchError(f"snapshot format version {version} is not supported: this server reads "
                                    f"version {FORMAT_VERSION}")
    limit = _max_header_bytes(max_tokens, vocab_size)
    if header_len > limit:
        raise SnapshotError(f"header_len {header_len} is more than the {limit} bytes a header can take on this "
                            f"server (context of {max_tokens} tokens)")
    doc = _parse_json(stream.read(header_len, "the header"))
    return _header_from(doc, expect, max_tokens, vocab_size)


def _max_header_bytes(max_tokens: int, vocab_size: int) -> int:
    """The largest header a blob for this server can have: the token ids as JSON, plus slack."""
    per_token = len(str(max(vocab_size - 1, 0))) + 1  # digits and a comma
    return min(MAX_HEADER_BYTES, HEADER_SLACK_BYTES + max_tokens * per_token)


def _parse_json(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise SnapshotError(f"the header is not valid UTF-8 JSON: {_clip(str(e))}") from None
    if not isinstance(doc, dict):
        raise SnapshotError(f"the header is a JSON {type(doc).__name__}, not an object")
    return doc


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number a header may hold")


_LAYOUT_FIELDS = ("fingerprint", "arch", "n_layer", "n_kv_head", "head_dim", "kv_dtype", "chunk_tokens")
_HEADER_FIELDS = ("layout", "n_tokens", "n_chunks", "token_ids", "session_id", "sampler", "flags", "created_unix",
                  "pager")
_TYPES: dict[str, tuple[type, ...]] = {
    "fingerprint": (str,), "arch": (str,), "kv_dtype": (str,), "session_id": (str,),
    "n_layer": (int,), "n_kv_head": (int,), "head_dim": (int,), "chunk_tokens": (int,), "n_tokens": (int,),
    "n_chunks": (int,), "flags": (int,), "created_unix": (int, float), "layout": (dict,), "sampler": (dict,),
    "token_ids": (list,), "pager": (dict, type(None)), "client": (list,), "held": (int,),
}


def _header_from(doc: dict[str, Any], expect: KVLayout, max_tokens: int, vocab_size: int) -> SnapshotHeader:
    alias = doc.pop("prompt_alias", None)
    _check_fields(doc, _HEADER_FIELDS, "header")
    _check_fields(doc["layout"], _LAYOUT_FIELDS, "header layout")
    _check_layout(doc["layout"], expect)
    n_tokens, chunk = doc["n_tokens"], expect.chunk_tokens
    if n_tokens < 0:
        raise SnapshotError(f"the header declares a negative number of tokens ({n_tokens})")
    if n_tokens > max_tokens:
        raise SnapshotError(f"the header declares {n_tokens} tokens, more than this server's context of "
                            f"{max_tokens}")
    if doc["n_chunks"] != -(-n_tokens // chunk):
        raise SnapshotError(f"the header declares {doc['n_chunks']} chunks for {n_tokens} tokens, not "
                            f"{-(-n_tokens // chunk)} of {chunk}")
    token_ids = _token_ids(doc["token_ids"], n_tokens, vocab_size)
    flags = doc["flags"]
    if flags & ~KNOWN_FLAGS:  # negative flags have unknown (high) bits too
        raise SnapshotError(f"the header has unknown flags {flags:#x}")
    if flags & FLAG_PARTIAL and n_tokens % chunk:
        raise SnapshotError(f"a partial snapshot must end at a chunk boundary; it has {n_tokens} tokens")
    return SnapshotHeader(expect, token_ids, _session_id(doc["session_id"]), doc["sampler"], flags,
                          _unix_time(doc["created_unix"]), doc["pager"],
                          None if alias is None else _prompt_alias(alias, n_tokens, max_tokens, vocab_size))


def _prompt_alias(alias: Any, n_tokens: int, max_tokens: int, vocab_size: int) -> tuple[tuple[int, ...], int]:
    if not isinstance(alias, dict):
        raise SnapshotError(f"header field 'prompt_alias' must be an object, got {type(alias).__name__}")
    _check_fields(alias, ("client", "held"), "header prompt_alias")
    held = alias["held"]
    if not 0 < held <= n_tokens:
        raise SnapshotError(f"the prompt alias stands for {held} tokens; the blob holds {n_tokens}")
    if len(alias["client"]) > max_tokens:
        raise SnapshotError(f"the prompt alias's client prompt has {len(alias['client'])} tokens, more than this "
                            f"server's context of {max_tokens}")
    return _token_ids(alias["client"], len(alias["client"]), vocab_size), held


def _check_fields(obj: dict[str, Any], names: tuple[str, ...], where: str) -> None:
    """Exactly these fields, each of its type (bool is not an int here, though Python says it is)."""
    extra = sorted(set(obj) - set(names))
    if extra:
        raise SnapshotError(f"the {where} has unknown fields {_clip(str(extra))}")
    for name in names:
        if name not in obj:
            raise SnapshotError(f"the {where} has no field {name!r}")
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, _TYPES[name]):
            raise SnapshotError(f"{where} field {name!r} must be {' or '.join(t.__name__ for t in _TYPES[name])}, "
                                f"got {type(value).__name__}")


def _check_layout(got: dict[str, Any], expect: KVLayout) -> None:
    wrong = [f"{_LAYOUT_NAMES.get(name, name)} {_clip(str(got[name]), 16)} does not match this server's "
             f"{_clip(str(getattr(expect, name)), 16)}"
             for name in _LAYOUT_FIELDS if got[name] != getattr(expect, name)]
    if wrong:
        raise SnapshotMismatchError("; ".join(wrong))


_LAYOUT_NAMES = {"fingerprint": "model fingerprint"}


def _token_ids(ids: list[Any], n_tokens: int, vocab_size: int) -> tuple[int, ...]:
    if len(ids) != n_tokens:
        raise SnapshotError(f"the header lists {len(ids)} token ids for its {n_tokens} tokens")
    for i, t in enumerate(ids):
        if type(t) is not int or not 0 <= t < vocab_size:
            raise SnapshotError(f"token id {_clip(repr(t))} at position {i} is not in [0, {vocab_size})")
    return tuple(ids)


def _unix_time(value: float) -> float:
    try:
        t = float(value)
    except OverflowError:  # an int beyond float range
        t = math.inf
    if not math.isfinite(t):
        raise SnapshotError(f"created_unix {_clip(str(value))} is not a finite time")
    return t


def _session_id(session_id: str) -> str:
    if session_id == "":
        return session_id
    try:
        return check_session_id(session_id)
    except InvalidRequestError as e:
        raise SnapshotError(f"the header's {e}") from None


def _read_record(stream: _Stream, header: SnapshotHeader, c: int) -> np.ndarray:
    layout = header.layout
    rows = chunk_rows(header.n_tokens, layout.chunk_tokens, c)
    index, got_rows = _RECORD_HEAD.unpack(stream.read(_RECORD_HEAD.size, f"the head of chunk record {c}"))
    if index != c or got_rows != rows:
        raise SnapshotError(f"chunk record {c} says it is chunk {index} of {got_rows} rows; expected chunk {c} of "
                            f"{rows} rows")
    kv = np.empty(layout.chunk_shape(rows), layout.dtype)
    stream.readinto(_as_bytes(kv), f"chunk record {c}")
    return kv


def _check_digest(stream: _Stream) -> None:
    computed = stream.hasher.digest()
    if stream.read(_DIGEST_BYTES, "the digest", hashed=False) != computed:
        raise SnapshotError("digest mismatch: the blob is corrupt")


def _clip(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n] + ".."
