import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from lucekv.cli import main
from lucekv.model.gguf import open_gguf
from lucekv.spark.cli import expert_bytes
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
