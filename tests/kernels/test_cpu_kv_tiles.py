"""The decode step's attention kernels (lucekv.kernels.cpu.kv_tiles) against the scalar loops they replace: the same
bits, on float16 and float32 pools, scattered slots, a last vector only partly filled, slots out of view, and head
sizes of 2 and 5 vectors (value_sums: CHAINS blocks at once, and the rest one by one)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from lucekv.kernels.cpu.kv_tiles import LANES, exp_weights, key_scores, value_sums

P, N_KV, GROUP, N = 300, 3, 3, 37  # N: two whole vectors and 5 slots of a third
KVH, FIRST = 1, 3  # the kv head read; the run starts at slots[FIRST]


HEADS = [2 * LANES, 5 * LANES]


@njit
def _scores(pool, slots, q, out, stride, hd):
    key_scores(pool, slots, FIRST, N, N_KV * hd, KVH * hd, q, hd, GROUP, hd, out, 2, stride)


@njit
def _sums(pool, slots, w, out, stride, hd):
    value_sums(pool, slots, FIRST, N, N_KV * hd, KVH * hd, w, 1, stride, GROUP, hd, out, 5, hd)


def _pool(dtype, hd):
    rng = np.random.default_rng(0)
    pool = (rng.standard_normal((P, N_KV, hd)) * 4).astype(dtype)
    pool[7, KVH, 3] = 1e-6  # a float16 subnormal
    flat = pool.reshape(-1)
    return pool, flat.view(np.uint16) if dtype == np.float16 else flat, rng.permutation(P).astype(np.intp)


@pytest.mark.parametrize("hd", HEADS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_key_scores_are_the_in_order_dot_products(dtype, hd):
    pool, flat, slots = _pool(dtype, hd)
    slots[FIRST + 4] = 7
    q = np.random.default_rng(1).standard_normal((GROUP + 1) * hd).astype(np.float32)
    stride = 48  # N rounded up to whole vectors
    out = np.full(2 + GROUP * stride, np.nan, np.float32)
    _scores(flat, slots, q, out, stride, hd)
    k = pool[slots[FIRST:FIRST + N], KVH].astype(np.float32)
    for h in range(GROUP):
        want = np.zeros(N, np.float32)
        for j in range(hd):  # the scalar loop's order: a multiply and an add per element
            want = want + q[hd + h * hd + j] * k[:, j]
        got = out[2 + h * stride:2 + (h + 1) * stride]
        assert np.array_equal(got[:N], want)
        assert np.array_equal(got[N:], np.full(stride - N, want[-1]))  # lanes past N: the last slot again
    assert np.isnan(out[:2]).all()


@pytest.mark.parametrize("hd", HEADS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_value_sums_are_the_in_order_weighted_sums_of_the_visible_slots(dtype, hd):
    pool, flat, slots = _pool(dtype, hd)
    slots[FIRST + 6] = 7
    stride = N + 2
    w = np.random.default_rng(2).random(1 + GROUP * stride).astype(np.float32)
    w[1 + np.arange(GROUP) * stride + 4] = -1  # slot 4 out of view of every head: its inf left out, not multiplied
    w[1 + stride + N - 1] = -1
    w[1 + 9] = 0
    pool[slots[FIRST + 4], KVH] = np.inf
    if dtype == np.float16:
        flat = pool.reshape(-1).view(np.uint16)
    out = np.full(5 + GROUP * hd + 3, np.nan, np.float32)
    _sums(flat, slots, w, out, stride, hd)
    v = pool[slots[FIRST:FIRST + N], KVH].astype(np.float32)
    for h in range(GROUP):
        want = np.zeros(hd, np.float32)
        for s in range(N):
            e = w[1 + h * stride + s]
            if e >= 0:
                want = want + e * v[s]
        assert np.array_equal(out[5 + h * hd:5 + (h + 1) * hd], want)
    assert np.isnan(out[:5]).all() and np.isnan(out[5 + GROUP * hd:]).all()


@njit
def _exps(buf, at, n, top):
    exp_weights(buf, at, n, top)


def test_exp_weights_are_within_an_ulp_of_e_to_the_x_and_mark_the_slots_out_of_view():
    rng = np.random.default_rng(3)
    x = np.concatenate([-rng.exponential(3, 4000), -np.linspace(0, 87, 3000), [0, -1e-7, -1e-30]]).astype(np.float32)
    top = np.float32(2.5)
    buf = np.full(3 + len(x) + LANES, 7, np.float32)
    buf[3:3 + len(x)] = x + top
    buf[3 + 5] = -np.inf
    _exps(buf, 3, len(x), top)
    got, want = buf[3:3 + len(x)].astype(np.float64), np.exp(((x + top) - top).astype(np.float64))  # float32 x - top
    want[5] = -1
    ulp = np.abs(np.spacing(want.astype(np.float32))).astype(np.float64)
    assert np.all(np.abs(got - want) <= ulp) and got[5] == -1
    assert np.all(buf[:3] == 7)
