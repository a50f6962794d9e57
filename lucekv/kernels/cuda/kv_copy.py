"""KVFlash paging copies: one pool block's rows of every layer, K and V, to or from one contiguous staging
buffer, so that a page-out or a page-in is one kernel launch and one host copy, not 2 x n_layer small copies.

Pool: kv [n_layer, 2 (K, V), slots, n_kv_head, head_dim]. Staging: [2 (K, V), n_layer, rows, n_kv_head,
head_dim], the K of every layer first (a caller that needs only keys copies that half to the host).
The kernels copy 32-bit words whatever the dtype (a row of f16 is an even number of halves): raw bits, so a
round trip is bit-exact, NaN payloads included. A scorer's read of a block's keys (`gather_keys_f32`) converts
them to float32 on the device: numpy takes ~4 ms to convert a chunk of an 8B model's float16 keys, time in which
the GPU would wait.
"""

from __future__ import annotations

import numpy as np

from lucekv.kernels.cuda._numba import SIMULATOR, WARP, await_grid, blocks, cuda, jit_kernel

# The simulator runs each thread as a Python thread: there one warp per plane loops over the words.
THREADS = WARP if SIMULATOR else 256


def gather_rows(kv, first_slot: int, staging, stream=0) -> None:
    """staging[w, l] = kv[l, w, first_slot : first_slot + rows] for every layer l and w in (K, V)."""
    flat_kv, flat_staging = _flat(kv, staging)
    _gather[_grid(flat_staging), THREADS, stream](flat_kv, first_slot * _row_words(kv), flat_staging)


def scatter_rows(staging, kv, first_slot: int, stream=0) -> None:
    """kv[l, w, first_slot : first_slot + rows] = staging[w, l]: the inverse of `gather_rows`."""
    flat_kv, flat_staging = _flat(kv, staging)
    _scatter[_grid(flat_staging), THREADS, stream](flat_staging, flat_kv, first_slot * _row_words(kv))


def gather_keys_f32(kv, first_slot: int, out, stream=0) -> None:
    """out[l] = kv[l, 0, first_slot : first_slot + rows] as float32 for every layer l; out [n_layer, rows,
    n_kv_head, head_dim]."""
    n_layer, halves, slots = kv.shape[:3]
    width = kv.shape[3] * kv.shape[4]
    flat_out = out.reshape(n_layer, out.shape[1] * width)
    x = 1 if SIMULATOR else blocks(flat_out.shape[1], THREADS)
    _gather_keys_f32[(x, n_layer), THREADS, stream](kv.reshape(n_layer, halves, slots * width), first_slot * width,
                                                     flat_out)


def copy_slots(kv, moves, stream=0) -> None:
    """kv[l, w, moves[1, i]] = kv[l, w, moves[0, i]] for every layer l and w in (K, V), the moves (device int32 [2,
    m]) made in order: a move reads what the moves before it left (a draft tree's accepted path to its positions:
    node slots after the ones written, so each is read before any move writes it)."""
    n_layer, halves, slots = kv.shape[:3]
    words = _row_words(kv)
    flat = kv.reshape(n_layer, halves, slots * kv.shape[3] * kv.shape[4]).view(np.uint32)
    x = 1 if SIMULATOR else blocks(words, THREADS)
    _copy_slots[(x, n_layer, halves), THREADS, stream](flat, words, moves)


def _row_words(kv) -> int:
    """32-bit words in one slot's row (every KV head of one layer and half)."""
    return kv.shape[3] * kv.shape[4] * kv.dtype.itemsize // 4


def _flat(kv, staging):
    """Both arrays as uint32 [planes..., words]: a block's rows of one layer and half are contiguous in either."""
    n_layer, halves, slots = kv.shape[:3]
    width = kv.shape[3] * kv.shape[4]
    return (kv.reshape(n_layer, halves, slots * width).view(np.uint32),
            staging.reshape(halves, n_layer, staging.shape[2] * width).view(np.uint32))


def _grid(flat_staging) -> tuple[int, int, int]:
    """x: a plane's words (grid-stride loops); y: layers; z: K and V."""
    x = 1 if SIMULATOR else blocks(flat_staging.shape[2], THREADS)
    return x, flat_staging.shape[1], flat_staging.shape[0]


@jit_kernel
def _gather(kv, offset, staging):
    await_grid()
    layer, half = cuda.blockIdx.y, cuda.blockIdx.z
    for i in range(cuda.grid(1), staging.shape[2], cuda.gridDim.x * cuda.blockDim.x):
        staging[half, layer, i] = kv[layer, half, offset + i]


@jit_kernel
def _scatter(staging, kv, offset):
    await_grid()
    layer, half = cuda.blockIdx.y, cuda.blockIdx.z
    for i in range(cuda.grid(1), staging.shape[2], cuda.gridDim.x * cuda.blockDim.x):
        kv[layer, half, offset + i] = staging[half, layer, i]


@jit_kernel
def _gather_keys_f32(kv, offset, out):
    await_grid()
    layer = cuda.blockIdx.y
    for i in range(cuda.grid(1), out.shape[1], cuda.gridDim.x * cuda.blockDim.x):
        out[layer, i] = np.float32(kv[layer, 0, offset + i])


@jit_kernel
def _copy_slots(kv, words, moves):
    await_grid()
    layer, half = cuda.blockIdx.y, cuda.blockIdx.z
    for c in range(cuda.grid(1), words, cuda.gridDim.x * cuda.blockDim.x):  # one word of a row, every move in order
        for i in range(moves.shape[1]):
            kv[layer, half, moves[1, i] * words + c] = kv[layer, half, moves[0, i] * words + c]
