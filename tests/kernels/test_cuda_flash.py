"""The tensor-core prefill attention (`kernels.cuda.flash`) against float64 numpy, on the shapes that exercise
its layout: blocks of rows that cross tokens and hold padding, tiles cut short or hidden, GQA groups of 1 to 4
(see test_cuda_kernels.py for how the simulator runs these without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from lucekv.kernels.cuda import available
from tests.kernels.cuda_sim import needs_gpu, needs_kernels, run_in_simulator
from tests.kernels.test_cuda_kernels import check_attention, check_table_attention


@pytest.mark.skipif(available(), reason="kernels run directly in this process")
def test_flash_in_simulator():
    run_in_simulator(__file__)


@needs_kernels
@pytest.mark.parametrize(("n_head", "n_kv", "d", "window"), [
    (4, 2, 16, 0),  # 20 tokens x 2 heads = 40 rows: one block, its last 24 rows padding
    (6, 2, 32, 20),  # groups of 3: 60 rows, a block's rows end inside a token; two k16 slices; a window
    (4, 4, 16, 0),  # no GQA
], ids=lambda v: str(v))
def test_flash_attention(n_head, n_kv, d, window):
    # 143 slots used of 150 in shuffled positions: three tiles, the last partial
    check_attention(150, n_head, n_kv, d, np.arange(100, 120, dtype=np.int32), window, np.float16, flash=True)


@needs_kernels
def test_flash_attention_skips_hidden_tiles_and_launches_again():
    # slots in position order, queries at 180..199 with a 30-position window: the first two tiles are hidden
    check_attention(260, 8, 2, 16, np.arange(180, 200, dtype=np.int32), 30, np.float16, ordered=True, launches=2,
                    flash=True)


@needs_kernels
@pytest.mark.parametrize("window", [0, 120])
def test_flash_attention_prompt_piece_over_whole_tiles(window):
    # a prompt piece as the engine runs it: slots in position order, none free, the piece's 48 tokens (2 blocks of
    # rows) the sequence's last; tiles every row of a block sees whole take no masks (tile 0 for both blocks without
    # a window, tile 1 for the second), the others do (the diagonal; the window's edge)
    check_attention(167, 2, 1, 16, np.arange(112, 160, dtype=np.int32), window, np.float16, ordered=True, free=0,
                    flash=True)


@needs_kernels
def test_flash_attention_reads_a_sequence_in_scattered_blocks():
    # one sequence's 20 queries over its blocks 3, 0, 2 of the pool (block 1 is another sequence's)
    check_table_attention([((3, 0, 2), p) for p in range(150, 170)], 4, 2, 16, window=0, flash=True)


def test_flash_serves_float16_prefills_of_supported_heads():
    from lucekv.kernels.cuda.flash import serves

    assert serves(512, np.float16, 128)
    assert not serves(1, np.float16, 128)  # a decode step: the split kernel
    assert not serves(512, np.float32, 128)
    assert not serves(512, np.float16, 256)
    assert not serves(512, np.float16, 72)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("n_head", "n_kv", "d"), [(32, 8, 128), (14, 2, 64), (9, 3, 64)],
                         ids=["qwen3-8b", "qwen2.5-0.5b", "smollm2"])
def test_flash_attention_model_shapes_gpu(n_head, n_kv, d):
    check_attention(1100, n_head, n_kv, d, np.arange(500, 1012, dtype=np.int32), 0, np.float16, flash=True)


@pytest.mark.gpu
@needs_gpu
def test_flash_attention_long_prompt_piece_gpu():
    # the 8B's heads, a prompt piece of 256 tokens after 1792 (slots in position order, none free): 28 tiles every
    # row sees whole (no masks, pipelined copies), the diagonal's masked
    check_attention(2055, 32, 8, 128, np.arange(1792, 2048, dtype=np.int32), 0, np.float16, ordered=True, free=0,
                    flash=True)
