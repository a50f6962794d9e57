"""Issue 25 on the CUDA backend: a prompt's K/V rows and last logits against how it is cut into pieces (a reused
prefix leaves the rest of a prompt to compute from any position, as few as one token).

Read from the code (not yet measured): a piece's width picks its kernels, matvec rows up to 3 tokens, mmq's int8
parts from 4 to 64 (CudaOps.takes_mmq), the float16 tensor-core matmul past 64, and the split attention below
flash.MIN_TOKENS against the tensor-core flash attention from it; so a token's numbers depend on its piece unless
every piece takes the same kernels. Within one kernel family a token's numbers should be its own (mmq's and the
matmul's products are per token; flash's K/V tiles are aligned to the run, a fully masked tile adds nothing)."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from lucekv.kvflash.pager import CHUNK_TOKENS
from tests.kernels.cuda_sim import needs_gpu

N_TOKENS = 3 * CHUNK_TOKENS + 8


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    from lucekv.backends.cuda import CudaBackend
    from lucekv.model.arch import ModelSpec
    from lucekv.model.gguf import open_gguf
    from lucekv.model.synth import write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path_factory.mktemp("m") / "m.gguf", "qwen2", qtype=Q.Q8_0, n_embd=256,
                                n_head=8, n_kv_head=2, head_dim=32, n_ff=512, n_layer=2)
    g = open_gguf(path)
    return CudaBackend(g, ModelSpec.from_gguf(g), "f16", 8 * CHUNK_TOKENS)


def prefill(gpu, cuts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The last logits and every layer's K/V of the prompt's blocks (scattered) after pieces [cuts[i], cuts[i+1])."""
    ids = ((np.arange(N_TOKENS) * 7 + 5) % 200 + 3).astype(np.int32)
    pos = np.arange(N_TOKENS, dtype=np.int32)
    table = np.array([5, 1, 3, 0], np.int32)
    slots = table[pos // CHUNK_TOKENS] * CHUNK_TOKENS + pos % CHUNK_TOKENS
    gpu.pool.truncate(0)
    for s, e in pairwise(cuts):
        logits = gpu.forward(ids[s:e], pos[s:e], slots[s:e], tables=[table[:-(-e // CHUNK_TOKENS)]])
    kv = np.stack([gpu.pool.read_block(int(b)).copy() for b in table])
    return logits, kv


def assert_same_rows(gpu, cuts_list: list[list[int]]) -> None:
    whole = prefill(gpu, [0, N_TOKENS])
    for cuts in cuts_list:
        logits, kv = prefill(gpu, cuts)
        assert np.array_equal(kv, whole[1]), f"K/V of cuts {cuts}"
        assert np.array_equal(logits, whole[0]), f"logits of cuts {cuts}"


@pytest.mark.gpu
@needs_gpu
def test_pieces_past_64_tokens_give_the_rows_of_one_piece(gpu):
    """Every piece wider than mmq's and flash.MIN_TOKENS: the float16 matmul and the flash attention for all."""
    assert_same_rows(gpu, [[0, 100, N_TOKENS], [0, CHUNK_TOKENS + 1, N_TOKENS]])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.xfail(strict=True, reason="issue 25 on CUDA: a piece's width picks its kernels (matvec rows, mmq, the "
                   "float16 matmul; split or flash attention), so the rest of a reused prompt gets other numbers")
def test_a_prompt_gives_the_same_rows_however_it_is_cut_into_pieces(gpu):
    assert_same_rows(gpu, [[0, N_TOKENS - 1, N_TOKENS], [0, N_TOKENS - 30, N_TOKENS], [0, 1, N_TOKENS]])
