"""Routing counts (Spark's `--spark-record`, DESIGN §7): how many tokens a MoE layer routed to each expert, counted
on the device by the step itself, so that recording served traffic adds one small launch per MoE layer (a node of
the captured graph) and no readback to a step; the host takes the counts between requests (`take_counts`)."""

from __future__ import annotations

import numpy as np

from lucekv.kernels.cuda._numba import SIMULATOR, WARP, await_grid, blocks, cuda, jit_kernel

THREADS = WARP if SIMULATOR else 128


def count_experts(ids, positions, counts, stream=0) -> None:
    """counts[e] += the tokens t with positions[t] >= 0 among whose ids[t] is e; ids int32 [n, k] (a token's k
    experts), positions int32 [n] (a padding row, at -1, is not a token), counts int32 [n_expert]."""
    n, k = ids.shape
    _count[blocks(n * k, THREADS), THREADS, stream](ids, positions, counts)


@jit_kernel
def _count(ids, positions, counts):
    await_grid()
    i = cuda.grid(1)
    k = ids.shape[1]
    if i < ids.shape[0] * k and positions[i // k] >= 0:
        cuda.atomic.add(counts, ids[i // k, i % k], 1)


def take_counts(counts, stream) -> np.ndarray:
    """int64 [n_layer, n_expert]: the device counts as every step enqueued so far left them, which start again from
    zero for the steps enqueued after (the copy and the clearing in stream order). Waits for the stream."""
    out = counts.copy_to_host(stream=stream)
    flat = counts.reshape(-1)
    _clear[blocks(flat.shape[0], THREADS), THREADS, stream](flat)
    stream.synchronize()
    return out.astype(np.int64)


@jit_kernel
def _clear(counts):
    await_grid()
    i = cuda.grid(1)
    if i < counts.shape[0]:
        counts[i] = 0
