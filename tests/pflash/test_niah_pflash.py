"""`lucekv bench niah --prefill-compression KEEP`: a pflash row beside the full cache's, on the same cases, with
each case's time to first token and what was kept, and the summary's ratio of the two."""

from __future__ import annotations

import json

import pytest

from lucekv.cli import main
from lucekv.model.synth import write_synthetic_gguf


def test_niah_runs_pflash_beside_the_full_cache(tmp_path):
    model = write_synthetic_gguf(tmp_path / "long.gguf", "llama", n_ctx=1024)
    out = tmp_path / "n.json"
    argv = ["bench", "niah", "--model", str(model), "--backend", "cpu", "--context", "800", "--depths", "0.5",
            "--cases", "2", "--residencies", "", "--kv-drafter", str(model), "--prefill-compression", "0.5",
            "--prefill-threshold", "256", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    full, pflash = result["results"]
    assert (full["policy"], pflash["policy"], result["prefill_keep_ratio"]) == ("full", "pflash", 0.5)
    assert [c["index"] for c in full["cases"]] == [c["index"] for c in pflash["cases"]] == [0, 1]
    for case in pflash["cases"]:
        assert case["prompt_tokens"] == 800 and case["kept_tokens"] == case["prefilled_tokens"] == 13 * 32
        assert case["ttft_s"] > case["score_s"] > 0
        assert len(case["needle_kept"]) == 1 and 0 <= case["needle_kept"][0] <= 1
    assert all(c["prefilled_tokens"] == 800 and "kept_tokens" not in c for c in full["cases"])
    line = result["summary"][1]
    assert line["policy"] == "pflash" and line["kept_share"] == 0.52
    # (the speedup is of the unrounded medians: the summary's 4-decimal medians agree within its rounding)
    assert line["ttft_speedup"] == pytest.approx(line["full_ttft_median_s"] / line["ttft_median_s"], abs=0.015)
