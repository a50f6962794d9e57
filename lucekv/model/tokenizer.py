"""Tokenizer built from a GGUF file's `tokenizer.*` metadata alone (no tokenizer.json).

Encoding runs on the `tokenizers` package. Decoding works on each token's raw bytes, so `decode` and the
streaming detokenizer agree byte for byte and streaming costs O(1) per token.

Two vocabulary kinds, named by `tokenizer.ggml.model` as llama.cpp writes them:
- "gpt2": byte-level BPE from tokens + merges; `tokenizer.ggml.pre` picks the pre-tokenizer split.
- "llama": SentencePiece BPE from tokens + scores; the merges are rebuilt from the vocabulary, and byte
  tokens (<0xNN>) cover characters outside it.
Control (type 3) and user-defined (type 4) tokens are matched whole in the text, as llama.cpp does.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers

from lucekv.errors import InvalidRequestError, ModelError, UnsupportedModelError


class TokenType(IntEnum):
    """llama.cpp's `tokenizer.ggml.token_type` values."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


WHOLE_MATCH_TYPES = frozenset({TokenType.CONTROL, TokenType.USER_DEFINED})
MERGEABLE_TYPES = frozenset({TokenType.NORMAL, TokenType.USER_DEFINED})

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    split: str  # regex; the text between matches is kept as pre-tokens too
    digits_first: bool = False  # split every digit off before the regex runs
    ignore_merges: bool = False  # a pre-token that is itself a token is taken whole (llama-3 vocabularies)


# `tokenizer.ggml.pre` values, grouped as llama.cpp groups them.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(GPT2_SPLIT),
    "gpt2": PreTokenizer(GPT2_SPLIT),
    "qwen2": PreTokenizer(QWEN2_SPLIT),
    "deepseek-r1-qwen": PreTokenizer(QWEN2_SPLIT),
    "llama-bpe": PreTokenizer(LLAMA3_SPLIT, ignore_merges=True),
    "llama3": PreTokenizer(LLAMA3_SPLIT, ignore_merges=True),
    "smollm": PreTokenizer(GPT2_SPLIT, digits_first=True),
    "starcoder": PreTokenizer(GPT2_SPLIT, digits_first=True),
    "refact": PreTokenizer(GPT2_SPLIT, digits_first=True),
}

# Texts llama.cpp treats as end of generation wherever they sit in a vocabulary.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<end_of_utterance>",
})

SPM_SPACE = "\u2581"  # SentencePiece writes a space as "▁"


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character map: printable Latin-1 bytes stand for themselves, the other 68
    bytes take the code points from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in mapping]
    mapping.update({b: chr(256 + i) for i, b in enumerate(others)})
    return mapping


BYTE_LEVEL_DECODE = str.maketrans({ch: chr(b) for b, ch in byte_level_alphabet().items()})


@dataclass(eq=False, repr=False)  # the default repr would print the whole vocabulary
class Tokenizer:
    """Text ↔ token ids for one model. Build it with `Tokenizer.from_metadata(gguf_metadata)`."""

    backend: tokenizers.Tokenizer  # encodes; never used to decode
    pieces: list[bytes]  # token id → the bytes it stands for
    control_ids: frozenset[int]  # what skip_special leaves out
    # SentencePiece with add_space_prefix: the encoder puts a space before the text and before each run of
    # text after one of these (whole-matched) ids; the decoder takes it off again. None: no prefix.
    space_prefix_after: frozenset[int] | None
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool
    eog_ids: frozenset[int]  # end of generation: EOS and the end-of-turn tokens of the vocabulary
    chat_template: str | None
    _template: jinja2.Template | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._template = compile_chat_template(self.chat_template) if self.chat_template else None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        model = metadata.get("tokenizer.ggml.model")
        tokens = list(metadata.get("tokenizer.ggml.tokens") or ())
        if not tokens:
            raise ModelError("GGUF metadata has no tokenizer.ggml.tokens")
        types = list(metadata.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise ModelError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        space_prefix_after = None
        if model == "gpt2":
            backend = byte_level_backend(tokens, types, metadata)
            pieces = [byte_level_piece(text, kind) for text, kind in zip(tokens, types, strict=True)]
        elif model == "llama":
            add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
            backend, added_ids = sentencepiece_backend(tokens, types, metadata, add_space_prefix)
            pieces = [sentencepiece_piece(text, kind) for text, kind in zip(tokens, types, strict=True)]
            space_prefix_after = frozenset(added_ids) if add_space_prefix else None
        else:
            raise UnsupportedModelError(f"tokenizer model {model!r} is not supported (only gpt2, llama)")
        bos_id = special_id(metadata, "bos", len(tokens))
        eos_id = special_id(metadata, "eos", len(tokens))
        # As llama.cpp: BOS goes before SentencePiece text unless the file says no, before gpt2 only if asked.
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", model == "llama"))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        if (add_bos and bos_id is None) or (add_eos and eos_id is None):
            raise ModelError("the tokenizer asks to add BOS/EOS but the GGUF names no such token id")
        return cls(
            backend=backend, pieces=pieces,
            control_ids=frozenset(i for i, kind in enumerate(types) if kind == TokenType.CONTROL),
            space_prefix_after=space_prefix_after, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos,
            add_eos=add_eos, eog_ids=eog_ids(tokens, metadata, eos_id),
            chat_template=metadata.get("tokenizer.chat_template"))

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; control and user-defined token texts in it become those tokens.
        add_special: add BOS (and EOS) where the model's tokenizer asks for them."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos:
            ids.insert(0, self.bos_id)
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for; control and user-defined tokens stand for their text."""
        if not 0 <= token_id < len(self.pieces):
            raise InvalidRequestError("token_ids", f"{token_id} is outside the vocabulary "
                                                   f"(size {len(self.pieces)})")
        return self.pieces[token_id]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD. skip_special leaves out control tokens (BOS, EOS)."""
        stream = self.stream(skip_special=skip_special)
        return "".join([stream.add(i) for i in ids]) + stream.flush()

    def stream(self, after: int | None = None, skip_special: bool = False) -> StreamDetokenizer:
        """An incremental decoder: what it returns, joined, equals `decode(ids)` of the ids it was given.

        Control tokens (EOS too) come out as their text unless skip_special, as in decode().
        after: the token the streamed ids continue (the prompt's last token), or None when they start a text.
        It matters only to SentencePiece vocabularies with a space prefix, whose decoder drops the space
        the encoder put at the start of a text: a continuation keeps its leading space."""
        prefix_after = self.space_prefix_after
        at_prefix = prefix_after is not None and (after is None or after in prefix_after)
        return StreamDetokenizer(self.token_bytes, self.control_ids if skip_special else frozenset(),
                                 prefix_after or frozenset(), at_prefix)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise InvalidRequestError("messages", "this model has no chat template; send a plain prompt")
        validate_messages(messages)
        try:
            return self._template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self.bos_id), eos_token=self._token_text(self.eos_id))
        except jinja2.TemplateError as e:  # raise_exception() in the template, or a sandbox violation
            raise InvalidRequestError("messages", f"the chat template refused them: {e}") from e

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.pieces[token_id].decode(errors="replace")


class StreamDetokenizer:
    """Turns ids into text one at a time; holds back the bytes of an unfinished UTF-8 character (<= 3)."""

    def __init__(self, token_bytes: Callable[[int], bytes], skip_ids: frozenset[int],
                 space_prefix_after: frozenset[int], at_prefix: bool):
        self._token_bytes = token_bytes
        self._skip_ids = skip_ids
        self._space_prefix_after = space_prefix_after
        self._at_prefix = at_prefix  # the next text token carries the encoder's space prefix
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """The text this token completes (often "" in the middle of a character)."""
        piece = self._token_bytes(token_id)
        opens_text_run = token_id in self._space_prefix_after
        if self._at_prefix and not opens_text_run and piece.startswith(b" "):
            piece = piece[1:]
        self._at_prefix = opens_text_run
        return "" if token_id in self._skip_ids else self._utf8.decode(piece)

    def flush(self) -> str:
        """Whatever is still held back; an unfinished character becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)


def special_id(metadata: Mapping[str, Any], name: str, vocab_size: int) -> int | None:
    token_id = metadata.get(f"tokenizer.ggml.{name}_token_id")
    if token_id is None:
        return None
    if not 0 <= token_id < vocab_size:
        raise ModelError(f"tokenizer.ggml.{name}_token_id {token_id} is outside the vocabulary "
                         f"(size {vocab_size})")
    return int(token_id)


def eog_ids(tokens: Sequence[str], metadata: Mapping[str, Any], eos_id: int | None) -> frozenset[int]:
    ids = {i for i, text in enumerate(tokens) if text in EOG_TEXTS}
    ids.update(i for key in ("eot", "eom") if (i := special_id(metadata, key, len(tokens))) is not None)
    if eos_id is not None:
        ids.add(eos_id)
    return frozenset(ids)


def whole_match_tokens(tokens: Sequence[str], types: Sequence[int], ids: Sequence[int]) -> list[AddedToken]:
    """Added tokens: found in the raw text before anything else runs, never cut up by BPE."""
    return [AddedToken(tokens[i], special=types[i] == TokenType.CONTROL, normalized=False) for i in ids]


def byte_level_backend(tokens: list[str], types: list[int],
                       metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    name = metadata.get("tokenizer.ggml.pre") or "default"  # files older than the key use GPT-2's split
    if name not in PRE_TOKENIZERS:
        raise UnsupportedModelError(f"pre-tokenizer {name!r} (tokenizer.ggml.pre) is not supported; "
                                    f"supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    pre = PRE_TOKENIZERS[name]
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or ()]
    backend = tokenizers.Tokenizer(models.BPE(
        vocab={text: i for i, text in enumerate(tokens)}, merges=merges, ignore_merges=pre.ignore_merges))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if pre.digits_first else []
    steps += [pre_tokenizers.Split(Regex(pre.split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    whole_match_ids = [i for i, kind in enumerate(types) if kind in WHOLE_MATCH_TYPES]
    backend.add_tokens(whole_match_tokens(tokens, types, whole_match_ids))
    return backend


def byte_level_piece(text: str, kind: int) -> bytes:
    """Normal tokens are spelled in GPT-2's byte alphabet; the others are plain text."""
    if kind != TokenType.NORMAL:
        return text.encode()
    try:
        return text.translate(BYTE_LEVEL_DECODE).encode("latin-1")
    except UnicodeEncodeError:  # not spelled in the byte alphabet after all: take it as plain text
        return text.encode()


def sentencepiece_backend(tokens: list[str], types: list[int], metadata: Mapping[str, Any],
                          add_space_prefix: bool) -> tuple[tokenizers.Tokenizer, list[int]]:
    """The BPE tokenizer and the ids it matches whole (its added tokens)."""
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelError("a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token")
    # The text's spaces become "▁" before BPE runs, so a token stored with real spaces (gemma's runs of
    # spaces) must be spelled with "▁" to be reachable.
    keys = [text.replace(" ", SPM_SPACE) for text in tokens]
    unk_id = special_id(metadata, "unknown", len(tokens))
    backend = tokenizers.Tokenizer(models.BPE(
        vocab={key: i for i, key in enumerate(keys)}, merges=sentencepiece_merges(keys, types, scores),
        unk_token=keys[unk_id] if unk_id is not None else None, fuse_unk=True, byte_fallback=True))
    space = normalizers.Replace(" ", SPM_SPACE)
    # Normalizers run on each run of text between added tokens: the prefix goes before each, as in llama.cpp.
    prefix = [normalizers.Prepend(SPM_SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, space])
    # A token holding spaces is left to the merges: its text never survives normalization.
    added_ids = [i for i, kind in enumerate(types) if kind in WHOLE_MATCH_TYPES and " " not in tokens[i]]
    backend.add_tokens(whole_match_tokens(tokens, types, added_ids))
    return backend, added_ids


def sentencepiece_merges(keys: Sequence[str], types: Sequence[int],
                         scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best token first.

    SentencePiece merges the adjacent pair whose union scores best. User-defined pieces it matches whole
    before merging, so they rank first whatever their score (gemma's runs of spaces score -1000). Equal
    scores keep file order (files converted from a tokenizer.json score every piece 0). The splits of one
    token go longest left part first, as transformers orders them.
    """
    candidates = [i for i, kind in enumerate(types) if kind in MERGEABLE_TYPES]
    mergeable = {keys[i] for i in candidates}
    # sorted() is stable: file order breaks ties.
    candidates.sort(key=lambda i: (types[i] != TokenType.USER_DEFINED, -scores[i]))
    merges = []
    for i in candidates:
        key = keys[i]
        for k in range(len(key) - 1, 0, -1):
            left = key[:k]
            if left in mergeable and (right := key[k:]) in mergeable:
                merges.append((left, right))
    return merges


def sentencepiece_piece(text: str, kind: int) -> bytes:
    if kind == TokenType.BYTE:
        if not (len(text) == 6 and text.startswith("<0x") and text.endswith(">")):
            raise ModelError(f"byte token {text!r} is not of the form <0xNN>")
        return bytes([int(text[3:5], 16)])
    if kind == TokenType.NORMAL:
        return text.replace(SPM_SPACE, " ").encode()
    return text.encode()


def validate_messages(messages: Sequence[Mapping[str, str]]) -> None:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {role, content} messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}]", "must be a mapping with 'role' and 'content'")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidRequestError(f"messages[{i}].{key}", "must be a string")
        if not message["role"]:
            raise InvalidRequestError(f"messages[{i}].role", "must not be empty")


def raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compiled as transformers compiles it, in a sandbox since it comes from a downloaded file."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelError(f"tokenizer.chat_template does not compile: {e}") from e
