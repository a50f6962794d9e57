"""The decode step's attention kernels (lucekv.kernels.cpu.kv_tiles) against the scalar loops they replace: the same
bits, on float16 and float32 pools, scattered slots, a last vector only partly filled and slots out of view."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from lucekv.kernels.cpu.kv_tiles import LANES, key_scores, value_sums

P, N_KV, HD, GROUP, N = 300, 3, 2 * LANES, 3, 37  # N: two whole vectors and 5 slots of a third
KVH, FIRST = 1, 3  # the kv head read; the run starts at slots[FIRST]


@njit
def _scores(pool, slots, q, out, stride):
    key_scores(pool, slots, FIRST, N, N_KV * HD, KVH * HD, q, HD, GROUP, HD, out, 2, stride)


@njit
def _sums(pool, slots, w, out, stride):
    value_sums(pool, slots, FIRST, N, N_KV * HD, KVH * HD, w, 1, stride, GROUP, HD, out, 5, HD)


def _pool(dtype):
    rng = np.random.default_rng(0)
    pool = (rng.standard_normal((P, N_KV, HD)) * 4).astype(dtype)
    pool[7, KVH, 3] = 1e-6  # a float16 subnormal
    flat = pool.reshape(-1)
    return pool, flat.view(np.uint16) if dtype == np.float16 else flat, rng.permutation(P).astype(np.intp)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_key_scores_are_the_in_order_dot_products(dtype):
    pool, flat, slots = _pool(dtype)
    slots[FIRST + 4] = 7
    q = np.random.default_rng(1).standard_normal((GROUP + 1) * HD).astype(np.float32)
    stride = 48  # N rounded up to whole vectors
    out = np.full(2 + GROUP * stride, np.nan, np.float32)
    _scores(flat, slots, q, out, stride)
    k = pool[slots[FIRST:FIRST + N], KVH].astype(np.float32)
    for h in range(GROUP):
        want = np.zeros(N, np.float32)
        for j in range(HD):  # the scalar loop's order: a multiply and an add per element
            want = want + q[HD + h * HD + j] * k[:, j]
        got = out[2 + h * stride:2 + (h + 1) * stride]
        assert np.array_equal(got[:N], want)
        assert np.array_equal(got[N:], np.full(stride - N, want[-1]))  # lanes past N: the last slot again
    assert np.isnan(out[:2]).all()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_value_sums_are_the_in_order_weighted_sums_of_the_visible_slots(dtype):
    pool, flat, slots = _pool(dtype)
    slots[FIRST + 6] = 7
    stride = N + 2
    w = np.random.default_rng(2).random(1 + GROUP * stride).astype(np.float32)
    w[1 + np.arange(GROUP) * stride + 4] = -1  # slot 4 out of view of every head: its inf left out, not multiplied
    w[1 + stride + N - 1] = -1
    w[1 + 9] = 0
    pool[slots[FIRST + 4], KVH] = np.inf
    if dtype == np.float16:
        flat = pool.reshape(-1).view(np.uint16)
    out = np.full(5 + GROUP * HD + 3, np.nan, np.float32)
    _sums(flat, slots, w, out, stride)
    v = pool[slots[FIRST:FIRST + N], KVH].astype(np.float32)
    for h in range(GROUP):
        want = np.zeros(HD, np.float32)
        for s in range(N):
            e = w[1 + h * stride + s]
            if e >= 0:
                want = want + e * v[s]
        assert np.array_equal(out[5 + h * HD:5 + (h + 1) * HD], want)
    assert np.isnan(out[:5]).all() and np.isnan(out[5 + GROUP * HD:]).all()
