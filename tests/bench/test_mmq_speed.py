"""bench mmq_speed's rows (no GPU): which modules and settings it times at which token counts."""

from argparse import Namespace

from lucekv.bench.mmq_speed import load_module, rows_of
from lucekv.kernels.cuda import mmq


def test_rows_run_where_their_setting_changes_the_route():
    """Another file is a module of its own; LAST_BLOCK_TILES 2 (today 1) matters at 9-16 tokens (2 token tiles) only,
    another module's quantization beyond the 8 tokens the blocks quantize themselves."""
    rows = rows_of(Namespace(module=[f"copy={mmq.__file__}"], last_block_tiles=2, quantize_from="copy"))
    at = {r.name: [n for n in (8, 16, 32) if r.runs_at(load_module(r), n)] for r in rows}
    assert at == {"mmq": [8, 16, 32], "copy": [8, 16, 32], "mmq lbt2": [16], "copy lbt2": [16], "mmq q:copy": [16, 32]}
    modules = {r.name: load_module(r) for r in rows}
    assert modules["mmq"] is mmq and modules["mmq q:copy"] is mmq and modules["copy"] is not mmq
    assert [modules[name].LAST_BLOCK_TILES for name in ("copy", "mmq lbt2", "copy lbt2")] == [1, 2, 2]
    assert mmq.LAST_BLOCK_TILES == 1
