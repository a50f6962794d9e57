import json

import numpy as np
import pytest

from lucekv.errors import ConfigError
from lucekv.spark.trace import RoutingTrace


def test_observe_counts_selections_and_tokens():
    t = RoutingTrace.empty("fp", n_layer=2, n_expert=4, top_k=2)
    t.observe(0, np.array([[0, 1], [1, 3], [1, 2]]))
    t.observe(1, np.array([[2, 3], [2, 3], [0, 2]]))
    assert t.counts.tolist() == [[1, 3, 1, 1], [1, 0, 3, 2]]
    assert t.tokens == 3
    with pytest.raises(ValueError, match="outside"):
        t.observe(0, np.array([[0, 4]]))


def test_traces_of_one_model_merge_and_of_another_are_refused():
    a, b = (RoutingTrace.empty("fp", 1, 4, 1) for _ in range(2))
    a.observe(0, np.array([[1]]))
    b.observe(0, np.array([[1], [2]]))
    a.add(b)
    assert a.counts.tolist() == [[0, 2, 1, 0]] and a.tokens == 3
    with pytest.raises(ConfigError, match="different models"):
        a.add(RoutingTrace.empty("other", 1, 4, 1))


def test_a_saved_trace_loads_back_and_only_for_its_model(tmp_path):
    t = RoutingTrace.empty("fp-a", 3, 8, 2)
    rng = np.random.default_rng(0)
    for layer in range(3):
        t.observe(layer, rng.integers(0, 8, size=(50, 2)))
    t.save(tmp_path / "t.json")
    back = RoutingTrace.load(tmp_path / "t.json", fingerprint="fp-a")
    assert np.array_equal(back.counts, t.counts) and back.top_k == 2 and back.tokens == 50
    with pytest.raises(ConfigError, match="another model"):
        RoutingTrace.load(tmp_path / "t.json", fingerprint="fp-b")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(format="lucekv.spark.placement"), "not a routing trace"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d.update(counts=[[1, -2]]), "malformed"),
    (lambda d: d.update(counts=[1, 2]), "malformed"),
    (lambda d: d.update(top_k=5), "malformed"),
    (lambda d: d.pop("fingerprint"), "malformed"),
])
def test_a_damaged_trace_file_is_refused(tmp_path, edit, message):
    doc = RoutingTrace.empty("fp", 1, 2, 1).to_json()
    edit(doc)
    (tmp_path / "t.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=message):
        RoutingTrace.load(tmp_path / "t.json")
