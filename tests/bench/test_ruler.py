from __future__ import annotations

import json

import pytest

from lucekv.bench import ruler
from lucekv.errors import ConfigError

DEPTHS = [0.1, 0.5, 0.9]


def tokenize(text: str) -> list[int]:
    """One id per byte: positions in the prompt are offsets in its bytes."""
    return list(text.encode())


def detokenize(ids: list[int]) -> str:
    return bytes(ids).decode()


@pytest.fixture(scope="module")
def corpus() -> dict[str, list[str]]:
    line = "def f{i}(x):\n    return x + {i}  # plain haystack text\n"
    return {kind: ["".join(line.format(i=f"{kind}{d}_{j}") for j in range(40)) for d in range(30)]
            for kind in ruler.KINDS}


@pytest.mark.parametrize("task", ruler.TASKS)
def test_cases_have_the_exact_length_and_hold_their_answers_where_they_say(task, corpus):
    for index in range(4):
        case = ruler.make_case(task, index, 3000, corpus, tokenize, DEPTHS)
        assert len(case.ids) == 3000
        text = detokenize(case.ids)
        assert all(e in text for e in case.expected)
        assert len(case.needles) == (1 if task == "multikey" else len(case.expected))
        for (start, end), expected in zip(case.needles, case.expected, strict=False):
            needle = detokenize(case.ids[start:end])
            assert needle.startswith("\n") and needle.endswith(".\n") and expected in needle
        assert case.score(" ".join(case.expected)) == 1.0 and case.score("") == 0.0


def test_cases_are_deterministic_and_vary_with_the_index(corpus):
    a = ruler.make_case("multikey", 3, 2000, corpus, tokenize, DEPTHS)
    assert a == ruler.make_case("multikey", 3, 2000, corpus, tokenize, DEPTHS)
    b = ruler.make_case("multikey", 4, 2000, corpus, tokenize, DEPTHS)
    assert a.ids != b.ids and a.kind != b.kind  # kinds cycle over cases
    depths = [ruler.make_case("multikey", i, 2000, corpus, tokenize, DEPTHS).depth for i in range(9)]
    assert sorted(set(depths)) == DEPTHS


def test_the_asked_needle_sits_at_its_depth_and_the_distractors_have_similar_keys(corpus):
    case = ruler.make_case("multikey", 6, 4000, corpus, tokenize, DEPTHS)
    intro, question = len(ruler.INTRO), len(case.ids) - detokenize(case.ids).rindex("\n\nWhat")
    share = (case.needles[0][0] - intro) / (4000 - intro - question)
    assert case.depth == 0.9 and abs(share - 0.9) < 0.06  # the other needles shift it a little
    text = detokenize(case.ids)
    keys = [line.split(" for ")[1].split(" is:")[0] for line in text.splitlines() if line.startswith("One of")]
    asked = text.rsplit("special magic number for ", 1)[1].split(" ")[0]
    assert len(keys) == 4 and asked in keys
    assert all(set(k.split("-")) & set(asked.split("-")) for k in keys)


def test_vartrack_chain_follows_its_order(corpus):
    case = ruler.make_case("vartrack", 1, 3000, corpus, tokenize, DEPTHS)
    text = detokenize(case.ids)
    first, *rest = case.expected
    assert f"VAR {first} = " in text
    for a, b in zip(case.expected, rest, strict=False):
        assert text.index(f"VAR {b} = VAR {a}.") > text.index(f"VAR {a} = ")


def test_bad_requests_are_refused(corpus, tmp_path):
    with pytest.raises(ConfigError, match="unknown niah task"):
        ruler.make_case("nope", 0, 3000, corpus, tokenize, DEPTHS)
    with pytest.raises(ConfigError, match="too short"):
        ruler.make_case("vartrack", 0, 100, corpus, tokenize, DEPTHS)
    (tmp_path / "old.json").write_text(json.dumps({"version": 0, "kinds": {}}))
    with pytest.raises(ConfigError, match="version"):
        ruler.load_corpus(tmp_path / "old.json")


def test_a_cut_json_array_yields_its_complete_items():
    assert list(ruler._json_array_items('[{"a": 1}, {"b": [2, 3]},\n {"c": "cut sho')) == [{"a": 1}, {"b": [2, 3]}]


@pytest.mark.parametrize(("pool", "resident"), [(1152, True), (256, False)])
def test_a_pooled_case_says_whether_its_needle_was_resident_when_the_answer_began(pool, resident, tmp_path):
    from functools import partial

    import lucekv
    from lucekv.bench import niah
    from lucekv.model.synth import write_synthetic_gguf

    model = write_synthetic_gguf(tmp_path / "tiny.gguf", "llama", n_ctx=2048, vocab=512)
    engine = lucekv.load(model, backend="cpu", kv_pool=pool, kv_policy="lru")  # lru recalls nothing for a prompt
    case = niah.passkey_case(0, 1024, partial(engine.tokenizer.encode, add_special=False), [0.5])
    row = niah.run_case(engine, case)
    assert row["needle_chunks"] == [case.needles[0][0] // 64] and row["needle_resident_at_answer"] == [resident]
