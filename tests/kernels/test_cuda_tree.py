"""Draft tree verify on CUDA (lucekv.spec.tree): the split attention kernel with ancestor masks against a float64
reference, and the K/V moves of an accepted path (kv_copy.copy_slots) against numpy's moves in order.

Without a GPU, `test_in_simulator` runs this file under numba's CUDA simulator (tiny shapes)."""

from __future__ import annotations

import numpy as np
import pytest

from lucekv.kernels.cuda import available, cuda
from lucekv.spec.tree import DraftTree
from tests.kernels.cuda_sim import needs_kernels, run_in_simulator
from tests.kernels.test_cuda_kernels import rel_err


@pytest.mark.skipif(available(), reason="runs directly in this process")
def test_in_simulator():
    run_in_simulator(__file__)


def tree_attention(tree: DraftTree | None, kv_dtype, seed=0):
    """Queries of a verify block at position `root` over one sequence in blocks [1, 0] of a 2-block pool: context
    below root, the block's slots marked root + j, stale drafts of an older round past it, free slots. A tree's
    queries at root + depth with its masks; None: a chain of the same width, no masks. (out, float64 reference)"""
    from lucekv.kernels.cuda.attention import BLOCK, BlockTables, attend, partials, tree_rows

    n_head, n_kv, d, root = 2, 1, 16, 90
    width = 1 + len(tree) if tree is not None else 4
    rng = np.random.default_rng(seed)
    slot_of = lambda pos: (1 if pos < BLOCK else 0) * BLOCK + pos % BLOCK  # noqa: E731  (blocks [1, 0])
    slot_pos = np.full(2 * BLOCK, -1, np.int32)
    for pos in [*range(root + width), root + width + 3, root + width + 5]:  # and two stale drafts
        slot_pos[slot_of(pos)] = pos
    slot_pos[slot_of(17)] = -1  # a free slot among the context's
    k_pool = (rng.standard_normal((2 * BLOCK, n_kv, d)) * 0.5).astype(kv_dtype)
    v_pool = rng.standard_normal((2 * BLOCK, n_kv, d)).astype(kv_dtype)
    q = rng.standard_normal((width, n_head * d)).astype(np.float32)
    depths = tree.depths() if tree is not None else np.arange(width)
    ancestors = tree.ancestors() if tree is not None else (1 << np.arange(1, width + 1)) - 1
    positions = (root + depths).astype(np.int32)
    tables = BlockTables(cuda.to_device(np.array([1, 0], np.int32)), cuda.to_device(np.zeros(1, np.int32)),
                         cuda.to_device(np.array([2 * BLOCK], np.int32)), cuda.to_device(np.zeros(width, np.int32)))
    out = cuda.device_array((width, n_head * d), np.float32)
    rows = None if tree is None else cuda.to_device(tree_rows(root, ancestors))
    attend(cuda.to_device(q), cuda.to_device(k_pool), cuda.to_device(v_pool), cuda.to_device(slot_pos), tables,
           cuda.to_device(positions), 0, 1 / np.sqrt(d), partials(width, n_head, n_kv, d, 2 * BLOCK), out,
           one_sequence=True, tree=rows)
    ref = np.zeros((width, n_head, d))
    for t in range(width):
        j = slot_pos - root
        in_block = (j >= 0) & (j < width)
        seen = (slot_pos >= 0) & (slot_pos < root) | in_block & ((ancestors[t] >> np.clip(j, 0, 62)) & 1 == 1)
        for h in range(n_head):
            kvh = h // (n_head // n_kv)
            s = k_pool[seen, kvh].astype(np.float64) @ q[t, h * d:(h + 1) * d] / np.sqrt(d)
            p = np.exp(s - s.max())
            ref[t, h] = p @ v_pool[seen, kvh].astype(np.float64) / p.sum()
    return out.copy_to_host(), ref.reshape(width, -1)


@needs_kernels
def test_split_attention_sees_the_context_and_each_nodes_ancestors_only():
    got, ref = tree_attention(DraftTree([5, 6, 7, 8, 9], [0, 0, 1, 2, 3]), np.float32)
    assert rel_err(got, ref) <= 1e-4


@needs_kernels
def test_a_chain_through_the_masks_equals_the_position_rule():
    got, ref = tree_attention(DraftTree.chain(range(3)), np.float32)
    plain, _ = tree_attention(None, np.float32)
    np.testing.assert_array_equal(got, plain)
    assert rel_err(got, ref) <= 1e-4


@needs_kernels
def test_copy_slots_moves_an_accepted_path_in_order():
    from lucekv.kernels.cuda.kv_copy import copy_slots

    rng = np.random.default_rng(1)
    kv = rng.standard_normal((2, 2, 64, 2, 8)).astype(np.float16)
    # a path [0, 2, 5, 6] of a block at slots 40..: slot 42 is read (into 41) before 42 is written (from 45)
    moves = np.array([[42, 45, 46], [41, 42, 43]], np.int32)
    dev = cuda.to_device(kv)
    copy_slots(dev, cuda.to_device(moves))
    want = kv.copy()
    for src, dst in moves.T:
        want[:, :, dst] = want[:, :, src]
    np.testing.assert_array_equal(dev.copy_to_host(), want)
