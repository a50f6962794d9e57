import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from lucekv.cli import main
from lucekv.model.gguf import open_gguf
from lucekv.spark.experts import expert_bytes
from lucekv.spark.placement import Placement
from lucekv.spark.trace import RoutingTrace
from tests.spark.test_placement import zipf_trace

EXPERT_BYTES = 3 * 32 * 34  # gate, up and down of one expert: 32 rows of one Q8_0 block (34 bytes) each


@pytest.fixture
def moe_file(tmp_path):
    """Just the expert tensors of a 4-layer, 16-expert model (the commands read their sizes, not the model)."""
    w = GGUFWriter(tmp_path / "moe.gguf", "qwen3moe")
    w.add_uint32("qwen3moe.expert_count", 16)
    for layer in range(4):
        for part in ("gate", "up", "down"):
            w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", np.zeros((16, 32, 34), np.uint8),
                         raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tmp_path / "moe.gguf"


def test_an_expert_is_its_slice_of_every_stacked_tensor(moe_file):
    assert expert_bytes(open_gguf(moe_file)) == [EXPERT_BYTES] * 4


def test_calibrate_then_validate_on_held_out_traffic(moe_file, tmp_path, capsys):
    fingerprint = open_gguf(moe_file).fingerprint
    for name, samples in (("cal", 1), ("held", 2)):
        zipf_trace(samples=samples, fingerprint=fingerprint).save(tmp_path / f"{name}.json")
    budget_gib = 32 * EXPERT_BYTES / 2**30  # half of the 64 experts
    assert main(["spark", "calibrate", str(moe_file), str(tmp_path / "cal.json"), "--expert-vram", str(budget_gib),
                 "-o", str(tmp_path / "p.json")]) == 0
    placement = Placement.load(tmp_path / "p.json", fingerprint)
    assert sum(len(h) for h in placement.hot) == 32
    capsys.readouterr()
    assert main(["spark", "validate", str(moe_file), str(tmp_path / "p.json"), str(tmp_path / "held.json")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["placement_bytes"] == 32 * EXPERT_BYTES
    assert report["cold_per_token"] < 0.6 * report["uniform_cold_per_token"]


def test_a_trace_of_another_model_is_refused(moe_file, tmp_path, capsys):
    RoutingTrace.empty("another-model", 4, 16, 2).save(tmp_path / "t.json")
    assert main(["spark", "calibrate", str(moe_file), str(tmp_path / "t.json"), "--expert-vram", "1",
                 "-o", str(tmp_path / "p.json")]) == 2
    assert "another model" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_sweep_compares_calibrated_uniform_and_the_best_placement_at_each_budget(moe_file, tmp_path, capsys):
    fingerprint = open_gguf(moe_file).fingerprint
    for name, samples in (("cal", 1), ("held", 2)):
        zipf_trace(samples=samples, fingerprint=fingerprint).save(tmp_path / f"{name}.json")
    assert main(["spark", "sweep", str(moe_file), str(tmp_path / "cal.json"), str(tmp_path / "held.json"),
                 str(tmp_path / "cal.json"), "--budgets", "0.25,0.5", "-o", str(tmp_path / "s.json")]) == 0
    doc = json.loads((tmp_path / "s.json").read_text())
    assert [(r["budget_share"], r["held_out"]) for r in doc["rows"]] == [
        (0.25, "held"), (0.25, "cal"), (0.5, "held"), (0.5, "cal")]
    held = RoutingTrace.load(tmp_path / "held.json")
    for r in doc["rows"]:
        assert r["bytes"] == int(r["budget_share"] * 64) * EXPERT_BYTES  # whole experts: 4 or 8 of 16 per layer
        assert r["oracle"] <= r["calibrated"] < 0.8 * r["uniform"]
    assert all(r["calibrated"] == r["oracle"] for r in doc["rows"] if r["held_out"] == "cal")  # fitted to itself
    uniform_half = Placement(fingerprint, 16, tuple(tuple(range(8)) for _ in range(4)))
    assert doc["rows"][2]["uniform"] == pytest.approx(
        held.counts[~uniform_half.mask()].sum() / held.tokens)
    assert doc["routing"]["cal"]["mutual_information_bits"] == 0.0  # a trace routes like itself
    assert "held" in capsys.readouterr().out
    assert main(["spark", "sweep", str(moe_file), str(tmp_path / "cal.json"), str(tmp_path / "held.json"),
                 "--budgets", "0.5,2", "-o", str(tmp_path / "t.json")]) == 2
    assert "--budgets" in capsys.readouterr().err and not (tmp_path / "t.json").exists()
