"""Regenerate lucekv/server/gen/ from protos/: `python -m lucekv.server.codegen [--out DIR]`.

protoc names the output after the proto's package path (lucekv/v1/...), which would shadow the real `lucekv`
package on import; so the files are generated into a scratch directory, moved flat into gen/, and the one
cross-import in the gRPC stubs is made relative. The descriptor keeps the canonical name
"lucekv/v1/lucekv.proto", which is what reflection shows to clients.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
PROTO = "lucekv/v1/lucekv.proto"
GEN_DIR = Path(__file__).resolve().parent / "gen"
GENERATED = ("lucekv_pb2.py", "lucekv_pb2.pyi", "lucekv_pb2_grpc.py")
_ABSOLUTE_IMPORT = "from lucekv.v1 import lucekv_pb2 as"
_RELATIVE_IMPORT = "from . import lucekv_pb2 as"
_INIT = (
    '"""Generated from protos/lucekv/v1/lucekv.proto by `python -m lucekv.server.codegen`; do not edit."""\n'
)


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules (and an __init__.py) into out_dir; return their paths."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as scratch:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{_well_known_protos()}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            str(PROTO_ROOT / PROTO),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_ROOT / PROTO}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = [out_dir / "__init__.py"]
        written[0].write_text(_INIT)
        for name in GENERATED:
            text = (Path(scratch) / "lucekv" / "v1" / name).read_text()
            (out_dir / name).write_text(text.replace(_ABSOLUTE_IMPORT, _RELATIVE_IMPORT))
            written.append(out_dir / name)
    return written


def _well_known_protos() -> Path:
    import grpc_tools

    return Path(grpc_tools.__file__).parent / "_proto"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=GEN_DIR, help=f"output directory (default {GEN_DIR})")
    args = parser.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)  # drop modules of messages that no longer exist
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
