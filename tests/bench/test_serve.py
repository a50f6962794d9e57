"""`lucekv bench serve`: ShareGPT requests against a server process at several concurrencies."""

from __future__ import annotations

import json

import pytest

from lucekv.bench.serve import BenchRequest, Timing, drive, figures, load_conversations, sample_requests
from lucekv.cli import main
from lucekv.model.synth import write_synthetic_gguf

CONVERSATIONS = [{"conversations": [{"from": "human", "value": f"question {i} " * (i + 3)},
                                    {"from": "gpt", "value": f"answer {i} " * (i + 4)}]} for i in range(8)]


def test_a_dataset_cut_inside_a_record_is_read_up_to_the_cut(tmp_path):
    text = json.dumps(CONVERSATIONS + [{"conversations": [{"from": "system", "value": "no human turn"}]}])
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index("answer 7")])  # the last whole record is the 7th
    assert len(load_conversations(cut)) == 7
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    assert [c.prompt for c in load_conversations(whole)] == [c["conversations"][0]["value"] for c in CONVERSATIONS]


def test_requests_pass_the_length_filters_and_take_the_reply_as_the_output_length(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(CONVERSATIONS))
    words = str.split  # a tokenizer of words
    requests, used = sample_requests(load_conversations(path), words, 3, seed=1, max_prompt=12)
    assert len(requests) == len(used) == 3
    for r, c in zip(requests, used, strict=True):
        assert 4 <= len(r.prompt_ids) <= 12 and r.output_tokens == len(c.reply.split())
    with pytest.raises(RuntimeError, match="only"):
        sample_requests(load_conversations(path), words, 9, seed=1)


def test_drive_keeps_the_concurrency_and_figures_add_up():
    running, most = 0, 0

    def send(r: BenchRequest) -> Timing:
        nonlocal running, most
        running += 1
        most = max(most, running)
        running -= 1
        return Timing(0.01, 0.01 + 0.002 * (r.output_tokens - 1), r.output_tokens)

    timings, wall = drive([BenchRequest([1] * 5, n) for n in (4, 6, 8, 10)], 2, send)
    f = figures(timings, wall)
    assert f["requests"] == 4 and f["output_tokens"] == 28 and most <= 2
    assert f["tpot_ms_p50"] == pytest.approx(2.0) and f["ttft_ms_p99"] == pytest.approx(10.0)


def test_bench_serve_writes_a_row_per_concurrency(tmp_path):
    model = write_synthetic_gguf(tmp_path / "tiny.gguf", "llama", n_ctx=512)
    dataset = tmp_path / "d.json"
    dataset.write_text(json.dumps(CONVERSATIONS))
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", str(model), "--backend", "cpu", "--concurrency", "1,3",
            "--num-requests", "4", "--dataset", str(dataset), "--max-output-tokens", "5", "--json", str(out),
            "--save-dataset", str(tmp_path / "used.json")]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows = result["lucekv"]
    assert [r["concurrency"] for r in rows] == [1, 3]
    expected = sum(r["output_tokens"] for r in result["requests"])
    assert all(r["requests"] == 4 and r["output_tokens"] == expected for r in rows)
    assert set(result["speedup_over_one_stream"]) == {"1", "3"}
    assert len(json.loads((tmp_path / "used.json").read_text())) == 4
