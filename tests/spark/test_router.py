"""Calibration routers (numpy): k-means rows route each cluster of directions to its own expert; Zipf norms give the
popularity they were fitted for; the mutual information of routing tables."""

from __future__ import annotations

import numpy as np
import pytest

from lucekv.spark.router import (
    MAX_PICK_RATE,
    kmeans_router,
    mutual_information,
    simulated_popularity,
    zipf_popularity,
    zipf_row_norms,
)


def test_kmeans_router_sends_each_cluster_to_an_expert_of_its_own_whatever_the_norm():
    rng = np.random.default_rng(1)
    directions = rng.standard_normal((3, 32))
    labels = np.repeat(np.arange(3), 200)
    # directions 0.35 apart in noise per coordinate, norms spread over a factor of 4: clusters are directions
    h = (directions[labels] + 0.35 * rng.standard_normal((600, 32))) * rng.uniform(0.5, 2.0, (600, 1))
    h[:, 5] *= 50.0  # an outlier coordinate, as hidden states have: scaled away, it decides nothing
    rows = kmeans_router(h, 3, seed=0)
    norms = np.linalg.norm(rows * h.std(axis=0), axis=1)
    np.testing.assert_allclose(norms, norms[0], rtol=1e-5)  # one norm in z = h / sd: no bias needed
    top1 = np.argmax(h @ rows.T, axis=1)
    mapping = {int(c): int(np.bincount(top1[labels == c]).argmax()) for c in range(3)}
    assert sorted(mapping.values()) == [0, 1, 2]
    assert np.mean(top1 == np.array([mapping[c] for c in labels])) == 1.0
    assert 2.0 < np.median(np.max(h @ rows.T, axis=1)) < 4.0 + 1e-5  # 4 x cos: the temperature the docstring says


def test_kmeans_router_refuses_fewer_points_than_experts():
    with pytest.raises(ValueError, match="cannot make 4 clusters"):
        kmeans_router(np.ones((3, 8)), 4)


def test_zipf_popularity_keeps_zipf_ratios_below_the_cap():
    share = zipf_popularity(16, 4, 1.0)
    assert share.sum() == pytest.approx(1.0)
    rate = share * 4  # tokens picking each expert, per token
    assert rate.max() == pytest.approx(MAX_PICK_RATE)
    free = rate < MAX_PICK_RATE - 1e-12
    ranks = np.flatnonzero(free) + 1.0
    np.testing.assert_allclose(rate[free] * ranks, rate[free][0] * ranks[0])  # p ~ 1 / rank
    assert np.all(np.diff(rate) <= 1e-12)


def test_zipf_row_norms_give_the_popularity_on_fresh_isotropic_logits():
    norms = zipf_row_norms(8, 2, 1.0)
    z = np.random.default_rng(123).standard_normal((40_000, 8))
    got, want = simulated_popularity(z * norms, 2), zipf_popularity(8, 2, 1.0)
    np.testing.assert_allclose(got, want, rtol=0.1)
    assert got[0] > 2.5 * got[-1]


def test_mutual_information_is_zero_for_alike_routing_and_one_bit_for_disjoint():
    assert mutual_information(np.array([[5, 3, 2], [10, 6, 4]])) == pytest.approx(0.0, abs=1e-12)
    assert mutual_information(np.array([[7, 0], [0, 7]])) == pytest.approx(1.0)
    assert 0.0 < mutual_information(np.array([[6, 4], [4, 6]])) < 0.1
