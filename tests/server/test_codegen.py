"""The committed generated code must be what `python -m lucekv.server.codegen` makes from today's proto."""

from __future__ import annotations

import ast
import re
from importlib import metadata
from pathlib import Path

import pytest

from lucekv.server.codegen import GEN_DIR, generate

REGENERATE = "stale generated code: run `python -m lucekv.server.codegen` and commit lucekv/server/gen/"


def _serialized_descriptor(pb2: Path) -> bytes:
    literal = re.search(r"AddSerializedFile\((b'.*?')\)\n", pb2.read_text()).group(1)
    return ast.literal_eval(literal)


def _stamped_grpc_version(grpc_module: Path) -> str:
    return re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", grpc_module.read_text()).group(1)


def test_committed_descriptor_matches_the_proto(tmp_path):
    """Holds whatever grpcio-tools version regenerates: the descriptor is the proto's whole content."""
    generate(tmp_path)
    assert _serialized_descriptor(tmp_path / "lucekv_pb2.py") == _serialized_descriptor(
        GEN_DIR / "lucekv_pb2.py"
    ), REGENERATE


def test_committed_files_are_byte_identical_to_a_fresh_generation(tmp_path):
    committed_with = _stamped_grpc_version(GEN_DIR / "lucekv_pb2_grpc.py")
    if metadata.version("grpcio-tools") != committed_with:
        pytest.skip(f"made by grpcio-tools {committed_with}; the descriptor test covers other versions")
    fresh = generate(tmp_path)
    assert sorted(p.name for p in fresh) == sorted(p.name for p in GEN_DIR.glob("*.py*"))
    for path in fresh:
        assert path.read_text() == (GEN_DIR / path.name).read_text(), f"{path.name}: {REGENERATE}"
