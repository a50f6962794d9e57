"""The `lucekv` command line: run, bench, and the errors it prints."""

import json

import pytest

from lucekv.cli import main
from lucekv.model.synth import write_synthetic_gguf


def test_run_completes_the_capital_of_france(model_path, capsys):
    path = model_path("smollm2-135m")
    assert main(["run", str(path), "The capital of France is", "--max-tokens", "8", "--temperature", "0"]) == 0
    assert "Paris" in capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("cli") / "tiny.gguf", "llama", n_ctx=64)


@pytest.mark.parametrize("argv,phrase", [
    (["run", "no-such-model", "hi"], "unknown model 'no-such-model'"),
    (["run", "{tiny}", ""], "prompt: is empty"),
    (["run", "{tiny}", "hi", "--temperature", "-1"], "temperature"),
    (["run", "{tiny}", "hi", "--top-p", "3"], "top_p"),
    (["run", "{tiny}", "hi", "--max-tokens", "100000"], "exceeds the context of 64"),
    (["run", "{tiny}", "hi", "--backend", "cuda"], "no CUDA GPU"),
])
def test_bad_input_exits_non_zero_naming_the_problem(tiny, capsys, argv, phrase):
    assert main([a.format(tiny=tiny) for a in argv]) == 2
    assert phrase in capsys.readouterr().err


def test_bench_decode_writes_json(tiny, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["bench", "decode", "--model", str(tiny), "--backend", "cpu", "--prompt-tokens", "16",
            "--gen-tokens", "4", "--repeats", "1", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["prompt_tokens"] == 16 and result["backend"] == "cpu"
    assert result["decode_tok_s_median"] > 0 and result["prefill_tok_s_median"] > 0
    assert len(result["model"]["sha256"]) == 64


def test_bench_decode_runs_transformers_beside_lucekv(tiny, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "r.json"
    argv = ["bench", "decode", "--model", str(tiny), "--backend", "cpu", "--kv-dtype", "f32", "--prompt-tokens",
            "16", "--gen-tokens", "4", "--repeats", "1", "--transformers", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    hf = result["transformers"]
    assert hf["device"] == "cpu" and hf["logits"]["tokens"] == 16
    assert hf["logits"]["max_rel_err_of_lucekv"] <= 1e-3 and hf["logits"]["argmax_agree"] == 1.0
    assert hf["decode_tok_s_median"] > 0 and hf["prefill_tok_s_median"] > 0
    assert result["over_transformers"]["decode"] == result["decode_tok_s_median"] / hf["decode_tok_s_median"]


def test_bench_niah_runs_full_and_pooled(tmp_path):
    model = write_synthetic_gguf(tmp_path / "long.gguf", "llama", n_ctx=1024)
    out = tmp_path / "n.json"
    argv = ["bench", "niah", "--model", str(model), "--backend", "cpu", "--context", "600", "--depths", "0.5",
            "--cases", "1", "--residencies", "0.4,0.8", "--policies", "lru", "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert rows[0]["policy"] == "full" and rows[0]["task"] == "passkey" and rows[0]["recall"] in (0.0, 1.0)
    assert "pool" in rows[1]["error"]  # 192 tokens cannot hold the protected chunks: refused, and said so
    assert rows[2]["pool_tokens"] == 448 and rows[2]["recall"] in (0.0, 1.0)
    placed = rows[2]["cases"][0]  # where the needle's chunk stands after the prompt
    assert 1 <= len(placed["needle_chunks"]) <= 2 and 0 < placed["needle_chunks"][0] < 600 // 64
    assert len(placed["needle_resident"]) == len(placed["needle_rank"]) == len(placed["needle_chunks"])
