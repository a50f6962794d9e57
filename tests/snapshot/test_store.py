"""Snapshot stores: the in-memory LRU, and the directory store's atomic, crash-safe writes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lucekv.errors import InvalidRequestError, ResourceLimitError
from lucekv.snapshot.blob import KVLayout, read_snapshot
from lucekv.snapshot.store import DirectorySnapshotStore, MemorySnapshotStore, check_session_id

FP_A = "a1" * 32
FP_B = "b2" * 32
BAD_IDS = ["", "../x", "a/b", ".hidden", "x" * 129, "sp ace", "nul\x00", "é"]


def blob(size: int, fill: int = 1) -> list[bytes]:
    return [bytes([fill]) * (size // 2), bytes([fill]) * (size - size // 2)]


def read_all(store, key: str) -> bytes:
    return b"".join(store.open(key))


def failing_midway() -> Iterator[bytes]:
    yield b"new bytes that never land"
    raise OSError("the stream broke")


def temp_files(store: DirectorySnapshotStore) -> list[str]:
    return [p.name for p in store.directory.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("session_id", ["chat-1", "a:b.c_d-E9", "x" * 128, "0"])
def test_good_session_ids(session_id: str) -> None:
    assert check_session_id(session_id) == session_id


@pytest.mark.parametrize("session_id", [*BAD_IDS, None, 7])
def test_bad_session_ids(session_id) -> None:
    with pytest.raises(InvalidRequestError, match="session_id"):
        check_session_id(session_id)


# ---- memory ---------------------------------------------------------------------------------------------------


def test_memory_store_evicts_least_recently_used_past_its_byte_limit() -> None:
    store = MemorySnapshotStore(max_bytes=300)
    for key in "abc":
        assert store.put(key, blob(100)) == 100
    read_all(store, "a")  # refreshes a: b is now the least recently used
    store.put("d", blob(100))
    assert store.keys() == ["c", "a", "d"] and "b" not in store
    store.put("c", blob(150))  # replacing refreshes too; 350 bytes: a goes
    assert store.keys() == ["d", "c"] and store.nbytes == 250
    store.put("e", blob(300))
    assert store.keys() == ["e"] and store.size("e") == 300


def test_memory_store_basics() -> None:
    store = MemorySnapshotStore(max_bytes=10 << 20)
    data = bytes(range(256)) * 10_000
    store.put("s", [data[:5], data[5:]])
    assert read_all(store, "s") == data and store.size("s") == len(data)
    assert max(map(len, store.open("s"))) == 1 << 20
    with pytest.raises(KeyError):
        store.open("missing")
    with pytest.raises(ResourceLimitError, match="does not fit"):
        store.put("s", blob(11 << 20))
    with pytest.raises(OSError):
        store.put("s", failing_midway())
    assert read_all(store, "s") == data
    assert store.delete("s") and not store.delete("s") and store.keys() == []
    for bad in BAD_IDS:
        with pytest.raises(InvalidRequestError):
            store.put(bad, [b"x"])


# ---- directory ------------------------------------------------------------------------------------------------


def test_directory_store_put_open_delete_keys(tmp_path: Path) -> None:
    store = DirectorySnapshotStore(tmp_path, FP_A)
    assert store.directory == tmp_path / FP_A[:16] and store.keys() == []
    data = os.urandom(3 << 20)
    assert store.put("s1", [data[:100], data[100:]]) == len(data)
    store.put("s0", [b"zero"])
    assert store.keys() == ["s0", "s1"] and "s1" in store and "s2" not in store
    assert read_all(store, "s1") == data and store.size("s1") == len(data)
    assert max(map(len, store.open("s1"))) == 1 << 20
    store.put("s1", [b"replaced"])
    assert read_all(store, "s1") == b"replaced"
    assert store.delete("s1") and not store.delete("s1") and store.keys() == ["s0"]
    for missing in (store.open, store.size):
        with pytest.raises(KeyError):
            missing("s1")
    assert sorted(p.name for p in store.directory.iterdir()) == ["s0.lkvs"]


def test_a_reader_keeps_the_blob_it_opened_across_a_replace(tmp_path: Path) -> None:
    store = DirectorySnapshotStore(tmp_path, FP_A)
    store.put("s", blob(3 << 20, fill=1))
    pieces = store.open("s")
    store.put("s", blob(10, fill=2))
    assert b"".join(pieces) == bytes([1]) * (3 << 20)


def test_two_models_side_by_side_in_one_root(tmp_path: Path) -> None:
    a, b = DirectorySnapshotStore(tmp_path, FP_A), DirectorySnapshotStore(tmp_path, FP_B.upper())
    a.put("s", [b"model a"])
    b.put("s", [b"model b"])
    b.put("only-b", [b"b"])
    assert read_all(a, "s") == b"model a" and read_all(b, "s") == b"model b"
    assert a.keys() == ["s"] and b.keys() == ["only-b", "s"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [FP_A[:16], FP_B[:16]]


def test_a_failed_put_keeps_the_old_value_and_leaves_no_temp_file(tmp_path: Path) -> None:
    store = DirectorySnapshotStore(tmp_path, FP_A)
    store.put("s", [b"old"])
    with pytest.raises(OSError, match="the stream broke"):
        store.put("s", failing_midway())
    with pytest.raises(OSError):
        store.put("fresh", failing_midway())
    assert read_all(store, "s") == b"old" and store.keys() == ["s"] and temp_files(store) == []


def test_leftover_temp_files_are_removed_and_never_listed(tmp_path: Path) -> None:
    store = DirectorySnapshotStore(tmp_path, FP_A)
    store.put("s", [b"x"])
    (store.directory / ".s.k1lled.tmp").write_bytes(b"half a blob")
    (store.directory / "README").write_text("not a blob")
    assert store.keys() == ["s"]
    store = DirectorySnapshotStore(tmp_path, FP_A)
    assert temp_files(store) == [] and store.keys() == ["s"]


def test_directory_store_rejects_bad_keys_and_fingerprints(tmp_path: Path) -> None:
    store = DirectorySnapshotStore(tmp_path / "root", FP_A)
    for bad in BAD_IDS:
        for call in (lambda k: store.put(k, [b"x"]), store.open, store.size, store.delete):
            with pytest.raises(InvalidRequestError):
                call(bad)
        assert bad not in store
    assert list(tmp_path.iterdir()) == [tmp_path / "root"] and store.keys() == []
    for fingerprint in ("", "abc", "../../etc/passwd", "g" * 64):
        with pytest.raises(ValueError, match="fingerprint"):
            DirectorySnapshotStore(tmp_path, fingerprint)


# ---- SIGKILL --------------------------------------------------------------------------------------------------

LAYOUT = KVLayout(FP_A, "llama", n_layer=4, n_kv_head=4, head_dim=64, kv_dtype="f16")  # 4 KiB a token
WRITER = f"""
import sys
import time
from pathlib import Path
import numpy as np
from lucekv.snapshot.blob import KVLayout, SnapshotHeader, write_snapshot
from lucekv.snapshot.store import DirectorySnapshotStore

layout = KVLayout(**{vars(LAYOUT)!r})
store = DirectorySnapshotStore(Path(sys.argv[1]), layout.fingerprint)
kv = np.random.default_rng(int(sys.argv[2])).standard_normal(layout.chunk_shape(64)).astype(np.float16)


def chunk_kv(c):
    time.sleep(0.001)  # a put takes 8 to 16 ms, so most kills land inside one
    return kv


for i in range(1000):
    n_tokens = 512 + 64 * (i % 8)  # 2 to 4 MiB
    key = f"s{{i % 6}}"
    store.put(key, write_snapshot(SnapshotHeader(layout, tuple(range(n_tokens)), key, {{}}), chunk_kv))
    print(key, flush=True)
"""


def test_sigkill_mid_write_leaves_only_whole_blobs(tmp_path: Path) -> None:
    """A writer killed at any moment: every key it reported is listed and every listed blob reads back whole."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    reported: set[str] = set()
    killed_mid_write = 0
    for round_, puts_before_kill in enumerate((1, 2, 4, 7, 3, 5)):
        child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(round_)], env=env,
                                 stdout=subprocess.PIPE, text=True)
        for _ in range(puts_before_kill):
            reported.add(child.stdout.readline().strip())
        time.sleep(0.003 * round_)  # land the kill at different points of the next put
        child.send_signal(signal.SIGKILL)
        reported |= {line.strip() for line in child.stdout}
        child.wait()
        assert child.returncode == -signal.SIGKILL
        killed_mid_write += bool(list((tmp_path / FP_A[:16]).glob(".*.tmp")))

        store = DirectorySnapshotStore(tmp_path, FP_A)
        assert reported <= set(store.keys()) and temp_files(store) == []
        for key in store.keys():
            snap = read_snapshot(store.open(key), LAYOUT, max_tokens=4096, vocab_size=4096)
            assert snap.header.session_id == key
    assert killed_mid_write, "no kill landed inside a put: the test did not exercise a torn write"
