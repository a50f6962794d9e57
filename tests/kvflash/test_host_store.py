from __future__ import annotations

import numpy as np
import pytest

from lucekv.kvflash.host_store import MemoryHostStore


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_round_trip_is_bit_exact_for_every_bit_pattern(dtype):
    rng = np.random.default_rng(1)
    n_layers, shape = 3, (64, 2, 8)
    store = MemoryHostStore(n_layers, *shape, dtype)
    bits = np.uint16 if dtype == np.float16 else np.uint32
    info = np.iinfo(bits)
    # Raw random bits: NaNs with payloads, infinities, subnormals and negative zeros included.
    rows = {(c, layer): [rng.integers(0, info.max, shape, bits, endpoint=True).view(dtype) for _ in "kv"]
            for c in (5, 9) for layer in range(n_layers)}
    assert any(np.isnan(k).any() for k, _ in rows.values())
    expected = {key: (k.tobytes(), v.tobytes()) for key, (k, v) in rows.items()}
    for (c, layer), (k, v) in rows.items():
        store.store(c, layer, k, v)
        k[:] = 0  # the store holds copies, not the caller's buffers
    for key, (k_bytes, v_bytes) in expected.items():
        got_k, got_v = store.load(*key)
        assert (got_k.tobytes(), got_v.tobytes()) == (k_bytes, v_bytes)
        assert not got_k.flags.writeable
    assert 5 in store and 7 not in store
    assert store.nbytes == 2 * store.chunk_bytes == 2 * n_layers * 2 * 64 * 2 * 8 * np.dtype(dtype).itemsize
    store.discard(5)
    assert 5 not in store and store.nbytes == store.chunk_bytes


def test_rows_of_the_wrong_dtype_or_shape_are_refused():
    store = MemoryHostStore(1, 64, 2, 8, np.float16)
    with pytest.raises(ValueError, match="do not match"):
        store.store(0, 0, np.zeros((64, 2, 8), np.float32), np.zeros((64, 2, 8), np.float32))
    with pytest.raises(ValueError, match="do not match"):
        store.store(0, 0, np.zeros((32, 2, 8), np.float16), np.zeros((32, 2, 8), np.float16))
