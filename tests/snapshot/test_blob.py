"""The snapshot blob: bit-exact round trips, and every malformed or foreign input refused with a SnapshotError."""

from __future__ import annotations

import hashlib
import json
import struct
import tracemalloc
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lucekv.snapshot.blob import (
    FLAG_PARTIAL,
    FORMAT_VERSION,
    MAGIC,
    KVLayout,
    SnapshotError,
    SnapshotHeader,
    SnapshotMismatchError,
    blob_size,
    chunk_rows,
    read_snapshot,
    write_snapshot,
)

FINGERPRINT = "0123456789abcdef" * 4
LAYOUT = KVLayout(FINGERPRINT, "llama", n_layer=2, n_kv_head=3, head_dim=4, kv_dtype="f16")
VOCAB = 1000
MAX_TOKENS = 4096
PREFIX = struct.Struct("<8sII")


def random_chunks(layout: KVLayout, n_tokens: int, seed: int = 0) -> list[np.ndarray]:
    """Random bit patterns (NaNs and infinities included), so equality below means bit-exact."""
    rng = np.random.default_rng(seed)
    uint = np.dtype(f"<u{layout.dtype.itemsize}")
    return [rng.integers(0, np.iinfo(uint).max, layout.chunk_shape(chunk_rows(n_tokens, layout.chunk_tokens, c)),
                         dtype=uint, endpoint=True).view(layout.dtype)
            for c in range(-(-n_tokens // layout.chunk_tokens))]


def make_header(n_tokens: int, layout: KVLayout = LAYOUT, flags: int = 0) -> SnapshotHeader:
    return SnapshotHeader(layout, tuple(i * 7 % VOCAB for i in range(n_tokens)), "chat-1",
                          {"temperature": 0.7, "seed": 2**64 + 1, "stop": ["\n\n", "é"]}, flags, 1.7e9)


def make_blob(n_tokens: int, layout: KVLayout = LAYOUT, flags: int = 0) -> bytes:
    header = make_header(n_tokens, layout, flags)
    return b"".join(write_snapshot(header, random_chunks(layout, n_tokens).__getitem__))


def read(pieces, layout: KVLayout = LAYOUT):
    return read_snapshot(pieces, layout, max_tokens=MAX_TOKENS, vocab_size=VOCAB)


def reheader(blob: bytes, edit: Callable[[dict], None] | None = None, raw: bytes | None = None) -> bytes:
    """The blob with its header JSON edited (or replaced by raw bytes) and its digest recomputed."""
    magic, version, n = PREFIX.unpack_from(blob)
    if raw is None:
        doc = json.loads(blob[PREFIX.size : PREFIX.size + n])
        edit(doc)
        raw = json.dumps(doc).encode()
    body = PREFIX.pack(magic, version, len(raw)) + raw + blob[PREFIX.size + n : -32]
    return body + hashlib.sha256(body).digest()


def redigest(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


def header_end(blob: bytes) -> int:
    return PREFIX.size + PREFIX.unpack_from(blob)[2]


def split_at(blob: bytes, cuts) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(blob)]
    return [blob[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def refused(pieces, cls: type[SnapshotError] | None = SnapshotError) -> str:
    """The message of the SnapshotError reading `pieces` raises: exactly of class `cls`, or of any when None."""
    with pytest.raises(SnapshotError) as e:
        read(pieces)
    assert cls is None or type(e.value) is cls, repr(e.value)
    return str(e.value)


# ---- round trips ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["f16", "f32"])
@pytest.mark.parametrize("n_tokens", [0, 1, 63, 64, 65, 200])
def test_round_trip_is_bit_exact(n_tokens: int, kv_dtype: str) -> None:
    layout = KVLayout(FINGERPRINT, "llama", 2, 3, 4, kv_dtype)
    header, chunks = make_header(n_tokens, layout), random_chunks(layout, n_tokens)
    pieces = list(write_snapshot(header, chunks.__getitem__, piece_bytes=1000))

    assert all(len(p) == 1000 for p in pieces[:-1]) and 0 < len(pieces[-1]) <= 1000
    snap = read(pieces, layout)
    assert snap.header == header
    assert snap.nbytes == sum(map(len, pieces)) == blob_size(header)
    assert [c.tobytes() for c in snap.chunks] == [c.tobytes() for c in chunks]
    assert all(c.dtype == layout.dtype and c.flags.c_contiguous for c in snap.chunks)


def test_chunk_kv_is_called_lazily_once_per_chunk_in_order_and_may_return_whole_chunks() -> None:
    n_tokens = 200  # the last chunk has 8 rows; chunk_kv returns all 64 of each
    full = random_chunks(LAYOUT, 256)
    calls: list[int] = []

    def chunk_kv(c: int) -> np.ndarray:
        calls.append(c)
        return full[c]

    pieces = write_snapshot(make_header(n_tokens), chunk_kv, piece_bytes=PREFIX.size)
    first = next(pieces)  # the prefix: no chunk asked for yet
    assert calls == []
    snap = read([first, *pieces])
    assert calls == [0, 1, 2, 3]
    assert [c.tobytes() for c in snap.chunks] == [full[c][:, :, : chunk_rows(n_tokens, 64, c)].tobytes()
                                                  for c in range(4)]


def test_pieces_of_any_size_parse() -> None:
    blob = make_blob(70)
    assert read([bytes([b]) for b in blob]).nbytes == len(blob)
    rng = np.random.default_rng(1)
    for _ in range(20):
        cuts = rng.integers(0, len(blob), rng.integers(0, 30))
        assert read(split_at(blob, cuts)).nbytes == len(blob)  # duplicate cuts give empty pieces


def test_partial_snapshot_round_trips_with_its_flag() -> None:
    snap = read([make_blob(128, flags=FLAG_PARTIAL)])
    assert snap.header.flags == FLAG_PARTIAL and snap.header.n_tokens == 128


def test_pager_state_round_trips() -> None:
    header = SnapshotHeader(LAYOUT, (1, 2, 3), "s", {}, pager={"version": 1, "scores": [0.5, None]})
    pieces = write_snapshot(header, random_chunks(LAYOUT, 3).__getitem__)
    assert read(pieces).header == header


def test_write_refuses_chunks_that_do_not_fit_the_layout() -> None:
    header = make_header(10)
    for kv in (np.zeros(LAYOUT.chunk_shape(10), np.float32), np.zeros(LAYOUT.chunk_shape(9), np.float16),
               np.zeros((2, 2, 10, 4, 4), np.float16)):
        with pytest.raises(ValueError, match="does not fit"):
            b"".join(write_snapshot(header, lambda c, kv=kv: kv))


# ---- malformed blobs: SnapshotError -------------------------------------------------------------------------


def test_truncation_anywhere_says_truncated() -> None:
    blob = make_blob(130)
    cuts = {0, 1, PREFIX.size - 1, PREFIX.size, header_end(blob) - 1, header_end(blob), header_end(blob) + 5,
            len(blob) - 32, len(blob) - 1}
    cuts |= set(np.random.default_rng(2).integers(1, len(blob), 32 - len(cuts)).tolist())
    assert len(cuts) == 32
    for cut in sorted(cuts):
        assert "truncated" in refused(split_at(blob[:cut], [cut // 3])), cut


def test_truncated_message_names_the_record_and_the_counts() -> None:
    blob = make_blob(130)
    record0 = header_end(blob) + LAYOUT.record_bytes(64)
    message = refused([blob[: record0 + 8 + 100]])
    assert f"chunk record 1 (read 100 of {64 * LAYOUT.token_bytes} bytes" in message, message


def test_empty_input_and_a_stream_that_stops_midway() -> None:
    assert "empty" in refused([])
    assert "empty" in refused([b"", b""])
    pieces = list(write_snapshot(make_header(200), random_chunks(LAYOUT, 200).__getitem__, piece_bytes=512))

    def stops_early() -> Iterator[bytes]:
        yield from pieces[: len(pieces) // 2]

    assert "truncated" in refused(stops_early())


def test_bit_flips_anywhere_are_refused() -> None:
    blob = make_blob(130)
    rng = np.random.default_rng(3)
    positions = [*rng.integers(0, len(blob), 300).tolist(), *range(header_end(blob) - 40, header_end(blob) + 20),
                 *range(len(blob) - 40, len(blob))]
    for pos in positions:
        flipped = bytearray(blob)
        flipped[pos] ^= 1 << int(rng.integers(8))
        refused([bytes(flipped)], cls=None)  # a flip in the version or the layout is a mismatch


def test_flips_in_the_kv_bytes_or_the_digest_are_digest_mismatches() -> None:
    blob = make_blob(130)
    for pos in (header_end(blob) + 8, len(blob) - 40, len(blob) - 1):
        flipped = bytearray(blob)
        flipped[pos] ^= 0x10
        assert "digest mismatch" in refused([bytes(flipped)])


def test_trailing_bytes_are_refused_but_empty_trailing_pieces_are_not() -> None:
    blob = make_blob(65)
    assert "trailing bytes after the digest" in refused([blob, b"", b"x"])
    assert read([blob, b"", b""]).nbytes == len(blob)


def test_not_a_snapshot() -> None:
    assert "not a lucekv snapshot" in refused([b"GGUF" + bytes(100)])


@pytest.mark.parametrize(("edit", "words"), [
    (lambda d: d.update(token_ids=[*d["token_ids"][:-1], VOCAB]), "token id 1000 at position 69"),
    (lambda d: d.update(token_ids=[-1, *d["token_ids"][1:]]), "token id -1 at position 0"),
    (lambda d: d.update(token_ids=[1.0, *d["token_ids"][1:]]), "token id 1.0"),
    (lambda d: d.update(token_ids=[True, *d["token_ids"][1:]]), "token id True"),
    (lambda d: d.update(token_ids=d["token_ids"][:-1]), "69 token ids for its 70 tokens"),
    (lambda d: d.update(n_chunks=3), "3 chunks for 70 tokens"),
    (lambda d: d.update(n_tokens=-1), "negative"),
    (lambda d: d.update(flags=True), "'flags' must be int, got bool"),
    (lambda d: d.update(flags=4), "unknown flags 0x4"),
    (lambda d: d.update(flags=FLAG_PARTIAL), "chunk boundary"),
    (lambda d: d.update(created_unix=10**400), "created_unix"),
    (lambda d: d.update(created_unix="now"), "'created_unix' must be int or float, got str"),
    (lambda d: d.update(session_id="../x"), "session_id"),
    (lambda d: d.update(sampler=[]), "'sampler' must be dict"),
    (lambda d: d.update(pager=[]), "'pager' must be dict or NoneType, got list"),
    (lambda d: d.update(rings=[]), "unknown fields ['rings']"),
    (lambda d: d.pop("session_id"), "no field 'session_id'"),
    (lambda d: d["layout"].pop("arch"), "no field 'arch'"),
    (lambda d: d["layout"].update(n_layer="2"), "'n_layer' must be int, got str"),
])
def test_header_fields_are_validated(edit, words: str) -> None:
    message = refused([reheader(make_blob(70), edit)])
    assert words in message, message


@pytest.mark.parametrize(("raw", "words"), [
    (b"[]", "not an object"),
    (b"\xff\xfe{}", "not valid UTF-8 JSON"),
    (b"{\"n_tokens\": NaN}", "not valid UTF-8 JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid UTF-8 JSON"),  # recursion
    (b"{\"n_tokens\": 1" + b"0" * 5000 + b"}", "not valid UTF-8 JSON"),  # int beyond Python's digit limit
])
def test_headers_that_are_not_json_objects_are_refused(raw: bytes, words: str) -> None:
    message = refused([reheader(make_blob(1), raw=raw)])
    assert words in message, message


def test_record_heads_must_match_the_expected_index_and_rows() -> None:
    blob = make_blob(70)
    at = header_end(blob) + LAYOUT.record_bytes(64)  # chunk record 1: 6 rows
    for index, rows in ((0, 6), (2, 6), (1, 64), (1, 65), (1, 2**32 - 1)):
        patched = redigest(blob[:at] + struct.pack("<II", index, rows) + blob[at + 8 : -32])
        assert "expected chunk 1 of 6 rows" in refused([patched])


def endless_after(blob_start: bytes, consumed: list[int]) -> Iterator[bytes]:
    """The start of a blob, then an endless body of 1 MiB pieces, counting the pieces taken."""
    yield blob_start
    zeros = bytes(1 << 20)
    while True:
        consumed.append(1)
        yield zeros


def assert_refused_small(pieces: Iterator[bytes], words: str, cls: type[SnapshotError] = SnapshotError) -> None:
    tracemalloc.start()
    try:
        message = refused(pieces, cls)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert words in message, message
    assert peak < 8 << 20, f"refusing took {peak} bytes"


def test_absurd_sizes_are_refused_before_reading_or_allocating() -> None:
    blob = make_blob(70)
    consumed: list[int] = []
    huge_header = PREFIX.pack(MAGIC, FORMAT_VERSION, 2**31)
    assert_refused_small(endless_after(huge_header, consumed), "header_len 2147483648")
    huge_tokens = reheader(blob, lambda d: d.update(n_tokens=10**12))
    assert_refused_small(endless_after(huge_tokens[: header_end(huge_tokens)], consumed),
                         "declares 1000000000000 tokens, more than this server's context of 4096")
    at = header_end(blob)
    huge_rows = blob[:at] + struct.pack("<II", 0, 2**32 - 1)
    assert_refused_small(endless_after(huge_rows, consumed), "expected chunk 0 of 64 rows")
    assert consumed == []


# ---- foreign blobs: SnapshotMismatchError --------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value", "words"), [
    ("fingerprint", "f" * 64, "model fingerprint ffffffffffffffff.. does not match this server's 0123456789abcdef.."),
    ("arch", "qwen2", "arch qwen2 does not match this server's llama"),
    ("n_layer", 3, "n_layer 3 does not match this server's 2"),
    ("n_kv_head", 4, "n_kv_head 4 does not match this server's 3"),
    ("head_dim", 8, "head_dim 8 does not match this server's 4"),
    ("kv_dtype", "f32", "kv_dtype f32 does not match this server's f16"),
    ("chunk_tokens", 32, "chunk_tokens 32 does not match this server's 64"),
])
def test_blob_for_another_layout_is_a_mismatch(field: str, value: object, words: str) -> None:
    other = KVLayout(**{**vars(LAYOUT), field: value})
    assert words in refused([make_blob(70, other)], SnapshotMismatchError)


def test_mismatch_names_every_differing_field_and_reads_only_the_header() -> None:
    other = KVLayout(**{**vars(LAYOUT), "fingerprint": "e" * 64, "n_kv_head": 1})
    blob = make_blob(70, other)
    consumed: list[int] = []
    message = refused(endless_after(blob[: header_end(blob)], consumed), SnapshotMismatchError)
    assert "model fingerprint" in message and "n_kv_head 1" in message and consumed == []


def test_other_format_version_is_a_mismatch_naming_both() -> None:
    blob = make_blob(1)
    message = refused([redigest(blob[:8] + struct.pack("<I", 2) + blob[12:-32])], SnapshotMismatchError)
    assert "version 2" in message and f"version {FORMAT_VERSION}" in message


# ---- fuzz -----------------------------------------------------------------------------------------------------

TINY = KVLayout(FINGERPRINT, "llama", n_layer=1, n_kv_head=1, head_dim=2, kv_dtype="f16")
TINY_BLOB = make_blob(70, TINY)

mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, len(TINY_BLOB) - 1), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, len(TINY_BLOB))),
    st.tuples(st.just("insert"), st.integers(0, len(TINY_BLOB)), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("overwrite"), st.integers(0, len(TINY_BLOB) - 1), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0, len(TINY_BLOB) - 1), st.integers(1, 16)),
)


def mutate(blob: bytes, op: tuple) -> bytes:
    kind, at, *arg = op
    at = min(at, len(blob))
    if kind == "flip":
        return blob if at == len(blob) else blob[:at] + bytes([blob[at] ^ (1 << arg[0])]) + blob[at + 1 :]
    if kind == "truncate":
        return blob[:at]
    if kind == "insert":
        return blob[:at] + arg[0] + blob[at:]
    if kind == "overwrite":
        return blob[:at] + arg[0] + blob[at + len(arg[0]) :]
    return blob[:at] + blob[at + arg[0] :]


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(mutation, max_size=4), cuts=st.lists(st.integers(0, len(TINY_BLOB) + 64), max_size=8))
def test_fuzz_mutated_blobs_raise_only_snapshot_errors(ops: list[tuple], cuts: list[int]) -> None:
    blob = TINY_BLOB
    for op in ops:
        blob = mutate(blob, op)
    pieces = split_at(blob, [min(c, len(blob)) for c in cuts])
    if blob == TINY_BLOB:
        assert read(pieces, TINY).nbytes == len(blob)
    else:
        with pytest.raises(SnapshotError):
            read(pieces, TINY)
