"""`lucekv bench depth`: decode speed versus context on a restored random context, and its llama-bench anchor."""

import json
import math
import stat

import numpy as np
import pytest

from lucekv.bench.depth import (
    RandomChunks,
    fit_context,
    gen_tokens_for,
    parse_llama_bench,
    plot,
    run_llama_bench,
    tau_eff,
)
from lucekv.cli import main
from lucekv.kvflash.policy import RESELECT_LAG, reselect_lag
from lucekv.model.synth import write_synthetic_gguf
from lucekv.snapshot.blob import KVLayout

CONTEXTS, POOL, GEN = (1024, 2048), 768, 16
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def llama_row(n_prompt: int, n_gen: int, n_depth: int, avg_ts: float) -> dict:
    """One result as llama-bench's `-o json` writes it (fields of tools/llama-bench/README.md)."""
    return {"build_commit": "8cf427ff", "build_number": 5163, "cpu_info": "AMD EPYC 9654", "gpu_info": "NVIDIA H100",
            "backends": "CUDA", "model_filename": "/tmp/qwen3-8b-shape.gguf", "model_type": "llama 8B Q4_K - Medium",
            "model_size": 4677120000, "model_n_params": 8190735360, "n_batch": 2048, "n_ubatch": 512,
            "n_threads": 16, "type_k": "f16", "type_v": "f16", "n_gpu_layers": 99, "flash_attn": 1,
            "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": n_depth, "test_time": "2025-04-24T11:59:33Z",
            "avg_ns": int(n_gen / avg_ts * 1e9) if n_gen else 70497220, "stddev_ns": 883196, "avg_ts": avg_ts,
            "stddev_ts": 0.7, "samples_ns": [1066331700, 1064864900], "samples_ts": [avg_ts + 0.1, avg_ts - 0.1]}


LLAMA_SAMPLE = [llama_row(512, 0, 0, 7263.6), llama_row(0, 128, 4096, 118.8), llama_row(0, 128, 131072, 41.2)]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """One end-to-end run through the command line on a tiny model (CPU)."""
    d = tmp_path_factory.mktemp("depth")
    model = write_synthetic_gguf(d / "tiny.gguf", "llama", n_ctx=4096, vocab=512)
    argv = ["bench", "depth", "--model", str(model), "--backend", "cpu", "--contexts", ",".join(map(str, CONTEXTS)),
            "--pool", str(POOL), "--gen-tokens", str(GEN), "--llama-bench", str(d / "no-such-llama-bench"),
            "--json", str(d / "depth.json")]
    assert main(argv) == 0
    return json.loads((d / "depth.json").read_text())


def runs(result: dict, cache: str) -> list[dict]:
    return [r for r in result["runs"] if r["cache"] == cache]


def test_every_run_decodes_on_the_whole_restored_context(result):
    assert [r["context"] for r in result["runs"]] == [*CONTEXTS, *CONTEXTS]
    for r in result["runs"]:
        assert "error" not in r
        assert r["cached_tokens"] == r["context"]
        assert r["decode_tok_s"] > 0 and r["decode_wall_tok_s"] > 0 and r["wall_s"] > 0
    assert "random" in result["context_note"] and "Restore" in result["context_note"]


def test_pooled_runs_reselect_while_decoding_and_stay_within_the_pool(result):
    kv = result["kv"]["pooled"]
    for r in runs(result, "pooled"):
        lag = reselect_lag(r["context"] + 1, 64)
        assert r["gen_tokens"] >= math.ceil(1.1 * (r["tau_eff"] + lag)) and r["gen_tokens"] >= GEN
        assert r["pager"]["during_decode"]["page_ins"] > 0
        assert r["pager"]["at_end"]["resident_chunks"] <= POOL // 64
        assert r["resident_kv_bytes"] == POOL * kv["token_bytes"] == kv["pool_bytes"]
        cost = r["paging_cost"]
        assert cost["chunks"] > 0 and cost["chunk_bytes"] == kv["chunk_bytes"]
        assert cost["page_out_ms_per_chunk"] > 0 and cost["page_in_gb_s"] > 0


def test_full_cache_runs_do_not_page_and_hold_the_whole_context(result):
    token_bytes = result["kv"]["full"]["token_bytes"]
    for r in runs(result, "full"):
        assert "pager" not in r and "paging_cost" not in r
        assert r["gen_tokens"] == GEN
        assert r["resident_kv_bytes"] == (r["context"] + GEN) * token_bytes
    assert runs(result, "full")[-1]["resident_kv_bytes"] > result["kv"]["pooled"]["pool_bytes"]


def test_summary_lines_up_the_contexts_and_records_a_missing_llama_bench(result):
    s = result["summary"]
    assert s["contexts"] == list(CONTEXTS)
    assert all(s["pooled_tok_s"]) and all(s["full_tok_s"]) and s["llama_cpp_tok_s"] == [None, None]
    assert s["pooled_largest_over_smallest"] == pytest.approx(s["pooled_tok_s"][1] / s["pooled_tok_s"][0])
    assert s["goals"]["pooled_over_llama_cpp_at_largest_ge_3"] is None
    assert "not found" in result["llama_cpp"]["error"]
    assert result["model"]["synthetic"] and result["model"]["shape"]["n_ctx"] == 4096


def test_a_context_past_the_model_leaves_room_for_the_pooled_decode():
    assert fit_context(4096, 131072, 128, 64) == 4096
    deepest = fit_context(131072, 131072, 128, 64)
    assert deepest == 131072 - 1 - math.ceil(1.1 * (131072 // 45 + RESELECT_LAG))
    assert deepest + 1 + gen_tokens_for(deepest, 128, 64, pooled=True) <= 131072
    assert tau_eff(deepest + 1, 64) == (deepest + 1) // 45
    assert gen_tokens_for(deepest, 128, 64, pooled=False) == 128


def test_random_chunks_have_the_layout_and_distinct_keys():
    layout = KVLayout("fp", "llama", 2, 2, 16, "f16")
    chunks = RandomChunks(layout, 64 * 3 + 10, np.random.default_rng(0))
    assert len(chunks) == 4 and chunks[3].shape == layout.chunk_shape(10) and chunks[0].dtype == np.float16
    keys = [chunks[c][:, 0] for c in range(2)]
    assert not np.array_equal(keys[0], keys[1])
    assert np.all(np.isfinite(keys[0])) and 1 <= np.abs(keys[0]).min() and np.abs(keys[0]).max() < 2
    with pytest.raises(IndexError):
        chunks[4]


def test_llama_bench_json_and_json_lines_give_tg_per_depth():
    tg = parse_llama_bench(json.dumps(LLAMA_SAMPLE, indent=2))
    assert sorted(tg) == [4096, 131072]  # the pp row is not a generation figure
    assert tg[131072]["tok_s"] == 41.2 and tg[4096]["n_gen"] == 128 and tg[4096]["gpu_info"] == "NVIDIA H100"
    assert parse_llama_bench("\n".join(json.dumps(r) for r in LLAMA_SAMPLE)) == tg
    for bad in ("", "main: error: failed to load model", json.dumps([llama_row(512, 0, 0, 1.0)]), "{}"):
        with pytest.raises(ValueError):
            parse_llama_bench(bad)


def fake_llama_bench(path, stdout: str, status: int = 0):
    path.write_text(f"#!/bin/sh\necho 'llama-bench: benchmark 1/2: depth run 1/2' >&2\ncat <<'EOF'\n{stdout}\nEOF\n"
                    f"exit {status}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_run_llama_bench_reads_its_output_and_records_failures(tmp_path):
    good = fake_llama_bench(tmp_path / "good", json.dumps(LLAMA_SAMPLE))
    result = run_llama_bench(good, tmp_path / "m.gguf", [4096, 131072], 2, timeout_s=30)
    assert "-d 4096,131072" in result["command"] and "-fa 1" in result["command"] and "-p 0" in result["command"]
    assert result["tg"]["131072"]["tok_s"] == 41.2 and "error" not in result
    failing = fake_llama_bench(tmp_path / "bad", "", status=1)
    assert "exit status 1" in run_llama_bench(failing, tmp_path / "m.gguf", [4096], 2, timeout_s=30)["error"]
    garbled = fake_llama_bench(tmp_path / "garbled", "| model | size |")
    assert "unreadable" in run_llama_bench(garbled, tmp_path / "m.gguf", [4096], 2, timeout_s=30)["error"]


def test_the_plot_is_a_png_and_can_be_redrawn_from_the_json(result, tmp_path):
    pytest.importorskip("matplotlib")
    result = json.loads(json.dumps(result))
    result["llama_cpp"] = {"tg": {"1024": {"tok_s": 50.0}, "2048": {"tok_s": 40.0}}}
    result["summary"]["llama_cpp_tok_s"] = [50.0, 40.0]
    plot(result, tmp_path / "direct.png")
    (tmp_path / "depth.json").write_text(json.dumps(result))
    assert main(["bench", "depth-plot", str(tmp_path / "depth.json"), "-o", str(tmp_path / "replot.png")]) == 0
    for name in ("direct.png", "replot.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
