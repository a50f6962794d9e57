"""`lucekv bench steps`' call timer: wraps an instance's method and a class's function, counts, puts them back."""

from __future__ import annotations

import time

from lucekv.bench.steps import CallTimes


class Graph:
    def replay(self, ms: float) -> str:
        time.sleep(ms / 1e3)
        return "replayed"


class Ops:
    def begin(self, x: int) -> int:
        return x + 1


def test_call_times_time_instance_and_class_calls_and_put_them_back():
    ops, graph = Ops(), Graph()
    class_replay = Graph.__dict__["replay"]
    timer = CallTimes({"begin": (ops, "begin"), "replay": (Graph, "replay"), "absent": (ops, "missing")})
    assert set(timer.seconds) == {"begin", "replay"}  # what the object lacks is left out
    with timer:
        assert ops.begin(1) == 2 and ops.begin(2) == 3
        assert graph.replay(20) == "replayed"
    assert timer.calls == {"begin": 2, "replay": 1}
    assert timer.seconds["replay"] >= 0.02 > timer.seconds["begin"]
    assert "begin" not in ops.__dict__ and Graph.__dict__["replay"] is class_replay
    ops.begin(3)
    assert timer.calls["begin"] == 2  # no longer timed
