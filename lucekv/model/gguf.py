"""Memory-mapped GGUF reading: metadata, tensor table, fingerprint, and errors that name the problem."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from lucekv.errors import ModelError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: outermost first, e.g. (rows, cols) for a matrix
    data: np.ndarray  # raw view into the memory map (uint8 bytes for block quants)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    fingerprint: str  # sha256 of header + metadata + tensor infos (everything before the tensor data)

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelError(f"{self.path.name}: tensor {name!r} is missing") from None


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value pairs as plain Python values (str, int, float, bool, lists of those)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def open_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"model file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelError(f"{path.name} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors on damaged headers
        raise ModelError(f"{path.name} is truncated or corrupt: {type(e).__name__}: {e}") from e
    file_size = path.stat().st_size
    tensors: dict[str, TensorInfo] = {}
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > file_size:
            raise ModelError(f"{path.name} is truncated: tensor {t.name!r} ends at byte {end}, "
                             f"file has {file_size}")
        qtype = GGMLQuantizationType(int(t.tensor_type))
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = TensorInfo(t.name, qtype, shape, t.data)
    with path.open("rb") as f:
        header = f.read(int(reader.data_offset))
    return GGUFFile(path, read_metadata(reader), tensors, hashlib.sha256(header).hexdigest())
