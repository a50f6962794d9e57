"""RedisSnapshotStore against a real redis-server: blobs in pieces under the model's fingerprint, TTL, leases
fenced by their token."""

from __future__ import annotations

import time

import pytest
import redis

from lucekv.snapshot.redis_store import LeaseError, RedisSnapshotStore
from lucekv.snapshot.store import READ_PIECE_BYTES

FINGERPRINT = "ab" * 32
OTHER_MODEL = "cd" * 32


@pytest.fixture
def stores(redis_url):
    """Two replicas' stores on one Redis (owners 'a' and 'b'), closed after the test."""
    made = []

    def make(owner: str, fingerprint: str = FINGERPRINT, **options) -> RedisSnapshotStore:
        made.append(RedisSnapshotStore(redis_url, fingerprint, owner=owner, **options))
        return made[-1]

    yield make
    for store in made:
        store.close()


def blob(n: int, seed: int = 0) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


def test_a_blob_larger_than_a_piece_round_trips_in_pieces_under_the_models_key(stores, redis_url):
    a = stores("a")
    data = blob(3 * READ_PIECE_BYTES + 12345)
    a.acquire("chat-1")
    assert a.put("chat-1", [data[:10], data[10:]]) == len(data)  # a piece over 1 MiB is cut into pieces
    assert b"".join(a.open("chat-1")) == data
    assert (a.keys(), a.size("chat-1"), "chat-1" in a, "nope" in a) == (["chat-1"], len(data), True, False)
    raw = redis.Redis.from_url(redis_url)
    key = f"lucekv:{FINGERPRINT[:16]}:blob:chat-1"
    assert raw.hlen(key) == 5 + 3  # pieces 0..4 (10 bytes, then 3 MiB + 12335 cut), pieces, size, version
    assert max(raw.hstrlen(key, str(i)) for i in range(5)) == READ_PIECE_BYTES
    other_model = stores("c", OTHER_MODEL)
    assert other_model.keys() == [] and "chat-1" not in other_model
    assert a.delete("chat-1") and a.keys() == [] and not a.delete("chat-1")
    a.release("chat-1")
    assert raw.keys() == []  # no blob, lease, fence or upload left behind
    with pytest.raises(KeyError):
        a.open("chat-1")


def test_writes_need_the_lease_and_only_one_replica_holds_it(stores):
    a, b = stores("a"), stores("b")
    with pytest.raises(LeaseError, match="does not hold"):
        a.put("s", [b"x"])
    a.acquire("s")
    a.acquire("s")  # a second call of the same replica shares the lease
    with pytest.raises(LeaseError, match="another replica"):
        b.acquire("s")
    a.release("s")
    with pytest.raises(LeaseError):
        b.acquire("s")  # still held by a's first call
    a.release("s")
    b.acquire("s")
    b.put("s", [b"from b"])
    with pytest.raises(LeaseError):
        a.delete("s")


def test_a_lapsed_lease_is_fenced_out_its_write_changes_nothing(stores, redis_url):
    a, b = stores("a"), stores("b")
    a.acquire("s")
    a.put("s", [b"first"])
    # a stalls past its lease (here: the lease key vanishes as on expiry) and b takes the session over
    redis.Redis.from_url(redis_url).delete(f"lucekv:{FINGERPRINT[:16]}:lease:s")
    b.acquire("s")
    b.put("s", [b"second"])
    with pytest.raises(LeaseError, match="lapsed"):
        a.put("s", [b"stale"])
    assert b"".join(b.open("s")) == b"second"
    assert not any(k.startswith(b"lucekv:" + FINGERPRINT[:16].encode() + b":upload")
                   for k in redis.Redis.from_url(redis_url).keys())


def test_a_crashed_replicas_lease_expires_and_is_renewed_while_held(stores):
    a, b = stores("a", lease_seconds=0.6), stores("b", lease_seconds=0.6)
    a.acquire("held")
    time.sleep(1.2)  # two lease periods: the renewal keeps it
    with pytest.raises(LeaseError):
        b.acquire("held")
    a._closed.set()  # a's process dies: no more renewals
    a._renewer.join()
    deadline = time.monotonic() + 3
    while True:
        try:
            b.acquire("held")
            break
        except LeaseError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_ttl_and_version_tracking(stores, redis_url):
    a, b = stores("a", ttl_seconds=100), stores("b", ttl_seconds=100)
    assert a.changed_elsewhere("s")  # never seen here: whatever this process may hold of it is suspect
    a.acquire("s")
    a.put("s", [b"one"])
    assert 0 < redis.Redis.from_url(redis_url).pttl(f"lucekv:{FINGERPRINT[:16]}:blob:s") <= 100_000
    assert not a.changed_elsewhere("s") and b.changed_elsewhere("s")
    a.release("s")
    b.acquire("s")
    assert b"".join(b.open("s")) == b"one" and not b.changed_elsewhere("s")
    b.put("s", [b"two"])
    assert a.changed_elsewhere("s")


def test_a_failing_writer_keeps_the_old_blob_and_leaves_no_upload(stores, redis_url):
    a = stores("a")
    a.acquire("s")
    a.put("s", [b"old"])

    def broken():
        yield b"new"
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError):
        a.put("s", broken())
    assert b"".join(a.open("s")) == b"old"
    assert [k for k in redis.Redis.from_url(redis_url).keys() if b":upload:" in k] == []
