"""Tokenizer from GGUF metadata: tiny synthetic vocabularies (no file) for the logic, and the real models
against transformers' own GGUF tokenizer as the reference."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lucekv.errors import InvalidRequestError, ModelError, UnsupportedModelError
from lucekv.model.gguf import open_gguf
from lucekv.model.tokenizer import Tokenizer, byte_level_alphabet

# ---------------------------------------------------------------- synthetic byte-level BPE ("gpt2")

BYTE_CHARS = [byte_level_alphabet()[b] for b in range(256)]  # token id b is the single byte b
GPT2_MERGED = ["Ġt", "he", "Ġthe", "Ġc", "at", "Ġcat"]
GPT2_SPECIALS = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool>", 4)]
ENDOFTEXT, IM_START, IM_END, TOOL = range(256 + len(GPT2_MERGED), 256 + len(GPT2_MERGED) + 4)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def gpt2_metadata(**extra) -> dict:
    tokens = BYTE_CHARS + GPT2_MERGED + [text for text, _ in GPT2_SPECIALS]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (256 + len(GPT2_MERGED)) + [kind for _, kind in GPT2_SPECIALS],
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he", "Ġ c", "a t", "Ġc at"],
        "tokenizer.ggml.bos_token_id": ENDOFTEXT,
        "tokenizer.ggml.eos_token_id": ENDOFTEXT,
        "tokenizer.chat_template": CHATML,
        **extra,
    }


def token_id(tokens: list[str], text: str) -> int:
    return tokens.index(text)


def test_gpt2_encodes_with_merges_and_whole_special_tokens():
    md = gpt2_metadata()
    tok = Tokenizer.from_metadata(md)
    tokens = md["tokenizer.ggml.tokens"]
    # "the" has no "Ġ" so "Ġt he" cannot apply: t + he. " cat": Ġ c a t → Ġc + at → Ġcat.
    assert tok.encode("the cat") == [ord("t"), token_id(tokens, "he"), token_id(tokens, "Ġcat")]
    assert tok.encode(" the") == [token_id(tokens, "Ġthe")]
    assert tok.encode("<|im_start|>a<tool>b<|im_end|>") == [IM_START, ord("a"), TOOL, ord("b"), IM_END]
    assert tok.vocab_size == len(tokens)


def test_gpt2_defaults_bos_off_and_reads_the_keys():
    tok = Tokenizer.from_metadata(gpt2_metadata())
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (ENDOFTEXT, ENDOFTEXT, False)
    assert tok.encode("a") == [ord("a")]
    tok = Tokenizer.from_metadata(gpt2_metadata(**{"tokenizer.ggml.add_bos_token": True,
                                                   "tokenizer.ggml.add_eos_token": True}))
    assert tok.encode("a") == [ENDOFTEXT, ord("a"), ENDOFTEXT]
    assert tok.encode("a", add_special=False) == [ord("a")]


def test_gpt2_token_bytes_undo_the_byte_alphabet():
    md = gpt2_metadata()
    tok = Tokenizer.from_metadata(md)
    assert [tok.token_bytes(b) for b in range(256)] == [bytes([b]) for b in range(256)]
    assert tok.token_bytes(token_id(md["tokenizer.ggml.tokens"], "Ġcat")) == b" cat"
    assert tok.token_bytes(IM_END) == b"<|im_end|>"
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        tok.token_bytes(tok.vocab_size)


def test_eog_ids_are_eos_plus_end_of_turn_texts_and_eot_key():
    assert Tokenizer.from_metadata(gpt2_metadata()).eog_ids == {ENDOFTEXT, IM_END}
    tok = Tokenizer.from_metadata(gpt2_metadata(**{"tokenizer.ggml.eot_token_id": TOOL}))
    assert tok.eog_ids == {ENDOFTEXT, IM_END, TOOL}


def test_unknown_pre_tokenizer_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="'tekken-9000'"):
        Tokenizer.from_metadata(gpt2_metadata(**{"tokenizer.ggml.pre": "tekken-9000"}))
    with pytest.raises(UnsupportedModelError, match="'rwkv'"):
        Tokenizer.from_metadata(gpt2_metadata(**{"tokenizer.ggml.model": "rwkv"}))


def test_broken_vocabularies_are_model_errors():
    with pytest.raises(ModelError, match="token_type"):
        Tokenizer.from_metadata(gpt2_metadata(**{"tokenizer.ggml.token_type": [1, 1]}))
    with pytest.raises(ModelError, match="eos_token_id"):
        Tokenizer.from_metadata(gpt2_metadata(**{"tokenizer.ggml.eos_token_id": 10**6}))


@pytest.mark.parametrize(("pre", "text", "pieces"), [
    ("smollm", "x 2024", [b"x", b" ", b"2", b"0", b"2", b"4"]),  # digits one by one, space on its own
    ("gpt2", "x 2024", [b"x", b" 2024"]),
    ("llama-bpe", "x 2024", [b"x", b" ", b"202", b"4"]),  # up to 3 digits, no space before them
    ("qwen2", "x 2024", [b"x", b" ", b"2", b"0", b"2", b"4"]),
    ("qwen2", "x\n\n  y", [b"x", b"\n\n", b" ", b" y"]),
])
def test_pre_tokenizer_splits(pre, text, pieces):
    # Merges that build each expected multi-byte pre-token into one token: a wrong split shows as a
    # different cut.
    md = gpt2_metadata(**{"tokenizer.ggml.pre": pre})
    alphabet = byte_level_alphabet()
    spelled = ["".join(alphabet[b] for b in piece) for piece in pieces]
    merges, tokens = [], list(md["tokenizer.ggml.tokens"])
    for word in spelled:
        for k in range(2, len(word) + 1):
            if word[:k] not in tokens:
                merges.append(f"{word[:k - 1]} {word[k - 1]}")
                tokens.append(word[:k])
    md.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
               "tokenizer.ggml.token_type": md["tokenizer.ggml.token_type"] + [1] * (len(tokens) - len(
                   md["tokenizer.ggml.token_type"]))})
    tok = Tokenizer.from_metadata(md)
    assert [tok.token_bytes(i) for i in tok.encode(text)] == pieces


@pytest.mark.parametrize(("pre", "expected"), [("llama-bpe", [b"ab"]), ("gpt2", [b"a", b"b"])])
def test_llama3_takes_a_pre_token_that_is_a_token_whole(pre, expected):
    md = gpt2_metadata(**{"tokenizer.ggml.pre": pre})
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"] + ["ab"]  # a token, but no "a b" merge
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"] + [1]
    tok = Tokenizer.from_metadata(md)
    assert [tok.token_bytes(i) for i in tok.encode("ab")] == expected


# ---------------------------------------------------------------- synthetic SentencePiece ("llama")

def spm_metadata(pieces: list[tuple[str, float, int]], **extra) -> dict:
    """<unk> <s> </s>, the 256 byte tokens, then `pieces` as (text, score, type)."""
    head = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    head += [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    rows = head + pieces
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [r[0] for r in rows],
        "tokenizer.ggml.scores": [r[1] for r in rows],
        "tokenizer.ggml.token_type": [r[2] for r in rows],
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        **extra,
    }


SPM_WORDS = [(text, -float(i), 1) for i, text in enumerate(
    ["▁", "t", "h", "e", "c", "a", "b", "▁t", "he", "▁the", "at", "▁c", "▁cat", "▁b"])]
BOS, EOS = 1, 2


def spm(**extra) -> tuple[Tokenizer, list[str]]:
    md = spm_metadata(SPM_WORDS, **extra)
    return Tokenizer.from_metadata(md), md["tokenizer.ggml.tokens"]


def test_spm_adds_bos_and_space_prefix_by_default():
    tok, tokens = spm()
    assert tok.add_bos and tok.bos_id == BOS and tok.eos_id == EOS and tok.eog_ids == {EOS}
    assert tok.encode("the cat") == [BOS, token_id(tokens, "▁the"), token_id(tokens, "▁cat")]
    # A leading space is kept: the prefix comes on top of it, and decode takes only the prefix off.
    ids = tok.encode(" the", add_special=False)
    assert ids == [token_id(tokens, "▁"), token_id(tokens, "▁the")]
    assert tok.decode(ids) == " the"


def test_spm_without_space_prefix_and_bos():
    tok, tokens = spm(**{"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False})
    assert tok.encode("the cat") == [token_id(tokens, "t"), token_id(tokens, "he"), token_id(tokens, "▁cat")]
    assert tok.decode(tok.encode("the cat")) == "the cat"


def test_spm_byte_fallback_for_characters_outside_the_vocabulary():
    tok, _ = spm(**{"tokenizer.ggml.add_space_prefix": False})
    ids = tok.encode("é🙂", add_special=False)
    assert ids == [3 + b for b in "é🙂".encode()]  # <0xNN> tokens sit at 3 + NN
    assert tok.token_bytes(ids[0]) == b"\xc3"


def test_spm_merges_follow_scores():
    def pieces(score_ab: float, score_bc: float) -> list[tuple[str, float, int]]:
        return [("a", -1.0, 1), ("b", -2.0, 1), ("c", -3.0, 1), ("ab", score_ab, 1), ("bc", score_bc, 1)]

    no_prefix = {"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False}
    for score_ab, score_bc, expected in [(-10.0, -5.0, [b"a", b"bc"]), (-5.0, -10.0, [b"ab", b"c"])]:
        tok = Tokenizer.from_metadata(spm_metadata(pieces(score_ab, score_bc), **no_prefix))
        assert [tok.token_bytes(i) for i in tok.encode("abc")] == expected


def test_spm_user_defined_space_runs_win_over_better_scored_merges():
    # gemma stores runs of spaces as user-defined tokens with real spaces and score -1000.
    md = spm_metadata([("  ", -1000.0, 4), ("\n", -1000.0, 4)] + SPM_WORDS,
                      **{"tokenizer.ggml.add_space_prefix": False})
    tok = Tokenizer.from_metadata(md)
    tokens = md["tokenizer.ggml.tokens"]
    ids = tok.encode("b  b\nb", add_special=False)
    assert ids == [token_id(tokens, text) for text in ["b", "  ", "b", "\n", "b"]]
    assert tok.decode(ids) == "b  b\nb"


def test_spm_space_prefix_follows_each_special_token_and_decode_removes_it():
    tok, tokens = spm()
    ids = tok.encode("the</s>cat", add_special=False)
    assert ids == [token_id(tokens, "▁the"), EOS, token_id(tokens, "▁cat")]  # llama.cpp's segments
    assert tok.decode(ids) == "the</s>cat"
    assert tok.decode([BOS, *ids], skip_special=True) == "thecat"
    assert tok.decode(tok.encode("the cat")) == "<s>the cat"


def test_spm_stream_continuing_a_prompt_keeps_the_leading_space():
    tok, tokens = spm()
    prompt = tok.encode("the")
    generated = [token_id(tokens, "▁cat"), token_id(tokens, "▁the")]
    stream = tok.stream(after=prompt[-1])
    assert "".join(stream.add(i) for i in generated) + stream.flush() == " cat the"
    assert tok.decode(prompt + generated)[len(tok.decode(prompt)):] == " cat the"
    stream = tok.stream()
    assert "".join(stream.add(i) for i in generated) + stream.flush() == tok.decode(generated) == "cat the"


def test_spm_needs_scores():
    md = spm_metadata(SPM_WORDS)
    del md["tokenizer.ggml.scores"]
    with pytest.raises(ModelError, match="scores"):
        Tokenizer.from_metadata(md)


# Literal "▁" is the one character SentencePiece cannot give back: it reads as a space.
ROUND_TRIP_TEXT = st.text(st.characters(blacklist_characters="\u2581", blacklist_categories=("Cs",)))


@settings(max_examples=200, deadline=None)
@given(text=ROUND_TRIP_TEXT)
def test_synthetic_round_trips(text):
    for tok in (Tokenizer.from_metadata(gpt2_metadata()), spm()[0]):
        assert tok.decode(tok.encode(text, add_special=False)) == text


# ---------------------------------------------------------------- streaming

def streamed(tok: Tokenizer, ids: list[int], **kwargs) -> list[str]:
    stream = tok.stream(**kwargs)
    return [stream.add(i) for i in ids] + [stream.flush()]


@pytest.mark.parametrize("make", [lambda: Tokenizer.from_metadata(gpt2_metadata()), lambda: spm()[0]])
def test_stream_matches_decode_on_random_ids(make):
    tok = make()
    rng = random.Random(7)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        for skip in (False, True):
            assert "".join(streamed(tok, ids, skip_special=skip)) == tok.decode(ids, skip_special=skip)


def test_stream_holds_back_split_characters():
    tok, _ = spm(**{"tokenizer.ggml.add_space_prefix": False})
    ids = tok.encode("a🙂b東", add_special=False)
    assert len(ids) == 1 + 4 + 1 + 3  # the emoji and the CJK character go byte by byte
    assert streamed(tok, ids) == ["a", "", "", "", "🙂", "b", "", "", "東", ""]
    # An unfinished character at the end comes out as U+FFFD, as decode() shows it.
    assert streamed(tok, ids[:3]) == ["a", "", "", "\ufffd"]
    assert tok.decode(ids[:3]) == "a\ufffd"


def test_stream_emits_control_tokens_unless_skipped():
    tok = Tokenizer.from_metadata(gpt2_metadata())
    ids = tok.encode("hi<|im_end|>")
    assert "".join(streamed(tok, ids)) == "hi<|im_end|>"
    assert "".join(streamed(tok, ids, skip_special=True)) == "hi"


# ---------------------------------------------------------------- chat templates

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]


def test_chat_template_renders_with_generation_prompt():
    tok = Tokenizer.from_metadata(gpt2_metadata())
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n"
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(MESSAGES) == expected + "<|im_start|>assistant\n"


def test_chat_template_sees_bos_eos_and_raise_exception():
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
                "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}")
    tok, _ = spm(**{"tokenizer.chat_template": template})
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x</s>"
    with pytest.raises(InvalidRequestError, match="first must be user") as e:
        tok.apply_chat_template(MESSAGES)
    assert e.value.field == "messages"


def test_chat_template_runs_sandboxed():
    tok = Tokenizer.from_metadata(gpt2_metadata(**{"tokenizer.chat_template": "{{ messages.append(1) }}"}))
    with pytest.raises(InvalidRequestError, match="messages"):
        tok.apply_chat_template(MESSAGES)


def test_model_without_chat_template_refuses_messages():
    tok, _ = spm()
    assert tok.chat_template is None
    with pytest.raises(InvalidRequestError, match="has no chat template") as e:
        tok.apply_chat_template(MESSAGES)
    assert e.value.field == "messages"


def test_broken_chat_template_is_a_model_error():
    with pytest.raises(ModelError, match="chat_template"):
        Tokenizer.from_metadata(gpt2_metadata(**{"tokenizer.chat_template": "{% for %}"}))


@pytest.mark.parametrize(("messages", "field"), [
    ([], "messages"),
    ("hello", "messages"),
    (["hello"], "messages[0]"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": "a"}, {"role": 3, "content": "b"}], "messages[1].role"),
    ([{"role": "", "content": "b"}], "messages[0].role"),
])
def test_chat_messages_are_validated(messages, field):
    tok = Tokenizer.from_metadata(gpt2_metadata())
    with pytest.raises(InvalidRequestError) as e:
        tok.apply_chat_template(messages)
    assert e.value.field == field


# ---------------------------------------------------------------- real models vs transformers

SAMPLES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! déjà vu — naïve café, Straße, ÆØÅ.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i * 42); }",
    "3.14159 2024-01-01 1,000,000 0x1F 12345678901234567890",
    "          1\n\t\t2  3",
    "emoji 🙂👍🏽 👩‍👩‍👧‍👦 🇫🇷 family",
    "中文混合English日本語のテキスト한국어 テスト",
    "  leading, trailing   \n\n\n\ttabs\t\tand\r\nCRLF \n ",
    "<|im_start|>system\nBe helpful.<|im_end|>\n<|im_start|>user\nhi!<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "don't you'll I'M we've",
    " " * 40 + "x" + "\n" * 5,
]
MODELS = [
    "smollm2-135m",
    pytest.param("gemma3-270m", marks=pytest.mark.slow),
    pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow),
]
EOG = {"smollm2-135m": {0, 2}, "gemma3-270m": {1, 106}, "qwen2.5-coder-0.5b": {151643, 151645}}


@pytest.fixture(scope="module")
def real(model_path):
    """name -> Tokenizer of that real model, built once per module."""
    cache: dict[str, Tokenizer] = {}

    def load(name: str) -> Tokenizer:
        if name not in cache:
            cache[name] = Tokenizer.from_metadata(open_gguf(model_path(name)).metadata)
        return cache[name]

    return load


@pytest.fixture(scope="module")
def reference(model_path):
    cache = {}

    def load(name: str):
        if name not in cache:
            cache[name] = reference_tokenizer(model_path(name))
        return cache[name]

    return load


def reference_tokenizer(path: Path):
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if open_gguf(path).metadata.get("tokenizer.ggml.pre") == "smollm":
        # transformers drops SmolLM2's digit split (its tokenizer.json and llama.cpp's "smollm" both split
        # digits one by one before the GPT-2 regex); it shows on a run of spaces before a digit.
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tok


@pytest.mark.parametrize("name", MODELS)
def test_ids_match_transformers(name, real, reference):
    tok = real(name)
    ref = reference(name)
    for text in SAMPLES:
        assert tok.encode(text) == ref(text)["input_ids"], text
    assert tok.vocab_size == len(ref)
    assert tok.eog_ids == EOG[name]


@pytest.mark.parametrize("name", MODELS)
def test_real_round_trips_and_stream(name, real):
    tok = real(name)
    for text in SAMPLES:
        ids = tok.encode(text, add_special=False)
        assert tok.decode(ids) == text
        assert "".join(streamed(tok, ids)) == text
        assert all("\ufffd" not in piece for piece in streamed(tok, ids))
    bos = tok.encode("")
    assert bos == ([tok.bos_id] if tok.add_bos else [])
    assert tok.decode(tok.encode("hi"), skip_special=True) == "hi"


@pytest.mark.parametrize("name", MODELS)
def test_real_stream_matches_decode_on_random_ids(name, real):
    tok = real(name)
    rng = random.Random(name)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(200)]
        assert "".join(streamed(tok, ids)) == tok.decode(ids)


@pytest.mark.parametrize("name", MODELS)
def test_real_multibyte_characters_span_tokens(name, real):
    tok = real(name)
    text = "🦜🪸 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ 齉龘"
    ids = tok.encode(text, add_special=False)
    broken = [i for i in ids if not is_utf8(tok.token_bytes(i))]
    assert broken, "the sample should split characters across tokens"
    assert "".join(streamed(tok, ids)) == text


def is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_smollm2_chat_template_matches_transformers(real, reference):
    tok = real("smollm2-135m")
    ref = reference("smollm2-135m")
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "Thanks"}]
    rendered = tok.apply_chat_template(messages)
    assert rendered == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode(rendered).count(1) == 5  # each <|im_start|> stays one token


@pytest.mark.slow
def test_qwen_chat_template_matches_transformers(real, reference):
    tok = real("qwen2.5-coder-0.5b")
    ref = reference("qwen2.5-coder-0.5b")
    messages = [{"role": "system", "content": "Code only."}, {"role": "user", "content": "sum a list"}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.slow
def test_gemma_base_has_no_chat_template(real):
    tok = real("gemma3-270m")
    with pytest.raises(InvalidRequestError, match="has no chat template"):
        tok.apply_chat_template(MESSAGES)
