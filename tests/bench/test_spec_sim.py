"""`lucekv bench spec-sim`: the cost table by the width a block runs as, and replays whose every token and
millisecond are accounted for."""

import json

import pytest

from lucekv.backends.cuda import graph_width
from lucekv.bench.spec_sim import cost_table, replay
from lucekv.cli import main
from lucekv.spec.gate import StepClock

# bench/results/h100-spec-qwen2.5-coder-1.5b-draft-0.5b-code-edit-mmq.json, verify_forward_ms.as_run
H100 = {1: 1.841, 2: 4.063, 4: 4.026, 8: 4.24, 16: 5.648, 17: 7.022}
COSTS = {"step_ms": 1.685, "host_ms_per_round": 0.111}


def test_the_cost_table_is_by_the_width_run_and_interpolates_the_unmeasured():
    # (CUDA's graphs: one token is a decode step, blocks up to 65 replay a multiple of 4, wider ones run as they are)
    assert [graph_width(n) for n in (1, 2, 4, 5, 17, 65, 66)] == [1, 4, 4, 8, 20, 68, 66]
    assert cost_table(H100, graph_width, 17) == {1: 1.841, 4: 4.026, 8: 4.24, 12: 4.944, 16: 5.648, 20: 7.022}
    with pytest.raises(ValueError):
        cost_table(H100, graph_width, 21)  # 24: past every measured width


def copying():
    """A prompt that holds a text and an output that copies it: suffix matches grow as it goes."""
    text = [(7 * i * i + 3 * i) % 97 + 10 for i in range(150)]
    return text + [1, 2, 3] + text[:5], text[5:120]


@pytest.mark.parametrize("mode", ["suffix", "auto"])
def test_every_token_and_millisecond_of_a_replay_is_accounted_for(mode):
    prompt, out = copying()
    verify_ms = cost_table(H100, graph_width, 17)
    costs = {**COSTS, "verify_ms": verify_ms}
    timed = StepClock()  # as an engine's whose auto turns ran rounds of every width
    for width, ms in verify_ms.items():
        timed.observe_round(0, width, (ms + COSTS["host_ms_per_round"]) / 1e3)
    r = {rule: replay(prompt, out, rule, mode, clock, costs, graph_width, 16)
         for rule, clock in (("old", StepClock()), ("fill", StepClock()), ("new", timed))}
    for x in r.values():
        assert x["rounds"] + x["accepted"] + x["plain_steps"] + 1 == len(out)
        if mode == "suffix":  # each round: its width's forward and the host's part
            assert x["plain_steps"] == 0 and x["seconds"] > x["rounds"] * (COSTS["host_ms_per_round"] + 1.841) / 1e3
    # a copied text: every draft stands; filled blocks take no more time, and the timed rule less (16 drafts at 20
    # cost more than 15 at 16 pay)
    assert r["new"]["seconds"] < r["fill"]["seconds"] <= r["old"]["seconds"]


def test_the_bench_runs_on_recorded_sequences(tmp_path):
    prompt, out = copying()
    (tmp_path / "seq.json").write_text(json.dumps({"model": "m", "workloads": {"code": [{"prompt": prompt,
                                                                                         "output": out}]}}))
    cost = {"device": "H100", "commit": "x", "model": {"file": "m.gguf"}, "verify_forward_ms": {"as_run": H100},
            "workloads": {"code": {"off": {"step_ms": 1.685}, "suffix": {"host_ms_per_round": 0.111, "speedup": 1.4}}}}
    (tmp_path / "cost.json").write_text(json.dumps(cost))
    assert main(["bench", "spec-sim", "--sequences", str(tmp_path / "seq.json"), "--costs", str(tmp_path / "cost.json"),
                 "--workloads", "code", "--json", str(tmp_path / "r.json")]) == 0
    w = json.loads((tmp_path / "r.json").read_text())["workloads"]["code"]
    assert {"suffix-old", "suffix-fill", "suffix-new", "auto-old", "auto-fill", "auto-new"} <= set(w)
    assert w["suffix-new"]["speedup"] > w["suffix-old"]["speedup"] > 1 and w["measured"]["suffix"]["speedup"] == 1.4
