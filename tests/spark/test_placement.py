import numpy as np
import pytest

from lucekv.errors import ConfigError
from lucekv.spark.placement import Placement, calibrated, cold_per_token, promotions, uniform
from lucekv.spark.trace import RoutingTrace


def zipf_trace(n_layer=4, n_expert=16, top_k=2, tokens=2000, popularity=0, samples=0, fingerprint="fp"
               ) -> RoutingTrace:
    """Skewed popularity, a different expert order per layer: what real routers look like, and random ones do not.
    Traces of one `popularity` and other `samples` stand for calibration and held-out traffic."""
    weights = 1.0 / np.arange(1, n_expert + 1) ** 1.1
    orders = np.random.default_rng(popularity)
    rng = np.random.default_rng(1000 + samples)
    t = RoutingTrace.empty(fingerprint, n_layer, n_expert, top_k)
    for layer in range(n_layer):
        p = orders.permutation(weights) / weights.sum()
        t.observe(layer, np.stack([rng.choice(n_expert, top_k, replace=False, p=p) for _ in range(tokens)]))
    return t


def test_with_equal_expert_sizes_the_budget_goes_to_the_most_used_experts_anywhere():
    t = zipf_trace()
    p = calibrated(t, [100] * 4, budget=2000, min_per_layer=1)
    assert sum(len(ids) for ids in p.hot) == 20
    chosen = p.mask()
    # every resident expert is used at least as much as every cold one, except the per-layer minimum
    minimum = {(layer, ids[0]) for layer, ids in enumerate(p.hot)}
    resident = [t.counts[i, e] for i, e in zip(*np.nonzero(chosen), strict=True) if (i, e) not in minimum]
    assert min(resident) >= t.counts[~chosen].max()
    assert all(t.counts[layer, ids[0]] == t.counts[layer].max() for layer, ids in enumerate(p.hot))


def test_an_expert_twice_the_size_needs_twice_the_selections():
    t = RoutingTrace.empty("fp", 2, 2, 1)
    t.counts[:] = [[10, 10], [19, 19]]  # layer 1's experts are 2x the bytes: 9.5 selections per byte < 10
    assert calibrated(t, [1, 2], budget=2, min_per_layer=0).hot == ((0, 1), ())
    t.counts[1] = 21
    assert calibrated(t, [1, 2], budget=2, min_per_layer=0).hot == ((), (0,))


def test_the_budget_and_the_per_layer_minimum_hold():
    t = zipf_trace(n_layer=3)
    sizes = [30, 50, 70]
    for budget in (150, 400, 1000, 10_000):
        p = calibrated(t, sizes, budget, min_per_layer=1)
        assert p.bytes(sizes) <= budget and all(len(ids) >= 1 for ids in p.hot)
        assert budget - p.bytes(sizes) < min(sizes) or all(len(ids) == 16 for ids in p.hot)  # nothing else fits
    with pytest.raises(ConfigError, match="less than 1 expert"):
        calibrated(t, sizes, budget=149, min_per_layer=1)


def test_calibrated_placement_leaves_fewer_cold_selections_than_uniform_on_held_out_traffic():
    calibration, held_out = zipf_trace(samples=1), zipf_trace(samples=2, tokens=500)  # one popularity
    sizes = [100] * 4
    budget = 100 * 4 * 8  # half the experts
    naive = cold_per_token(uniform("fp", 16, sizes, budget), held_out)
    tuned = cold_per_token(calibrated(calibration, sizes, budget), held_out)
    best = cold_per_token(calibrated(held_out, sizes, budget), held_out)  # placed knowing the held-out traffic
    assert tuned <= 1.05 * best
    assert tuned < 0.6 * naive


def test_cold_selections_per_token_are_counted_exactly():
    t = RoutingTrace.empty("fp", 2, 4, 2)
    t.observe(0, np.array([[0, 1], [0, 2]]))
    t.observe(1, np.array([[3, 1], [3, 2]]))
    p = Placement("fp", 4, ((0,), (3, 2)))
    assert cold_per_token(p, t) == (2 + 1) / 2


def test_promotions_swap_the_weakest_resident_for_a_busier_cold_expert():
    p = Placement("fp", 4, ((0, 1), (2, 3)))
    live = RoutingTrace.empty("fp", 2, 4, 1)
    live.counts[:] = [[5, 1, 9, 0], [0, 0, 4, 3]]
    new, swaps = promotions(p, live, max_swaps=4)
    assert [(s.layer, s.demoted, s.promoted, s.gain) for s in swaps] == [(0, 1, 2, 8)]  # layer 1: nothing cold used
    assert new.hot == ((0, 2), (2, 3))
    assert promotions(p, live, max_swaps=0)[0] == p
    assert promotions(p, live, max_swaps=4, min_gain=9)[1] == []


def test_a_placement_file_loads_back_and_is_refused_for_another_model(tmp_path):
    p = calibrated(zipf_trace(), [10] * 4, budget=200)
    p.save(tmp_path / "p.json")
    assert Placement.load(tmp_path / "p.json", fingerprint="fp") == p
    with pytest.raises(ConfigError, match="another model"):
        Placement.load(tmp_path / "p.json", fingerprint="someone-else")
    doc = p.to_json()
    doc["hot"][0] = [1, 1]
    with pytest.raises(ConfigError, match="twice"):
        Placement.from_json(doc)
    with pytest.raises(ConfigError, match="another model"):
        cold_per_token(p, zipf_trace(fingerprint="someone-else"))
