"""Attention of queries against the KV slot pool, position-exact in slot space (DESIGN §4).

Slot s is visible to a query at position q iff 0 <= slot_pos[s] <= q and, for a sliding window w > 0,
slot_pos[s] > q - w. Free slots hold slot_pos = -1.

Split-K ("flash decoding"): the slots are cut into SPLIT-slot chunks; one warp per (head, chunk, query)
runs an online softmax over its chunk, 32 slots at a time (one slot per lane for the scores, one head
dimension per lane for the values), and writes a partial (max, sum, weighted values). A combine kernel
merges the chunks. The same kernels serve prefill (queries = tokens); a flash-style prefill that shares
K/V tiles between queries is the next step.
"""

from __future__ import annotations

import math

import numpy as np

from lucekv.kernels.cuda._numba import NEG_INF, WARP, blocks, cuda, warp_max, warp_sum

SPLIT = 256  # slots per block
MAX_HEAD_DIM = 256
DIMS_PER_LANE = MAX_HEAD_DIM // WARP
THREADS = 128


def store_kv(k, v, slots, k_pool, v_pool, stream=0) -> None:
    """k_pool[slots[i]] = k[i] (and v), converting to the pool's dtype; k, v: [n, n_kv * head_dim]."""
    _store_kv[blocks(k.size, THREADS), THREADS, stream](k, v, slots, k_pool, v_pool)


def n_splits(n_slots: int) -> int:
    return max(blocks(n_slots, SPLIT), 1)


def attend(q, k_pool, v_pool, slot_pos, n_slots, max_slots: int, positions, window: int, scale: float, parts,
           out, stream=0) -> None:
    """out[n, n_head * head_dim] for queries q [n, n_head * head_dim] at `positions` (int32 [n]).

    Reads the slots below n_slots[0] (a device int32 [1], so that a captured graph sees each step's
    value); max_slots >= n_slots[0] sizes the grid. parts: `partials(n, ..., n_splits(max_slots))`.
    """
    n = q.shape[0]
    head_dim = k_pool.shape[2]
    n_head = q.shape[1] // head_dim
    splits = n_splits(max_slots)
    part_m, part_l, part_acc = parts
    _attend_split[(n_head, splits, n), WARP, stream](q, k_pool, v_pool, slot_pos, n_slots, positions, window,
                                                    np.float32(scale), part_m, part_l, part_acc)
    _combine[(n_head, n), WARP, stream](part_m, part_l, part_acc, splits, head_dim, out)


def partials(n: int, n_head: int, head_dim: int, max_splits: int):
    """Device scratch for `attend`: per (query, head, chunk) max, sum and weighted values."""
    return (cuda.device_array((n, n_head, max_splits), np.float32),
            cuda.device_array((n, n_head, max_splits), np.float32),
            cuda.device_array((n, n_head, max_splits, head_dim), np.float32))


@cuda.jit
def _store_kv(k, v, slots, k_pool, v_pool):
    i = cuda.grid(1)
    width = k.shape[1]
    if i >= k.shape[0] * width:
        return
    t = i // width
    j = i % width
    head_dim = k_pool.shape[2]
    s = slots[t]
    k_pool[s, j // head_dim, j % head_dim] = k[t, j]
    v_pool[s, j // head_dim, j % head_dim] = v[t, j]


@cuda.jit
def _attend_split(q, k_pool, v_pool, slot_pos, n_slots, positions, window, scale, part_m, part_l, part_acc):
    h = cuda.blockIdx.x
    split = cuda.blockIdx.y
    t = cuda.blockIdx.z
    lane = cuda.threadIdx.x
    head_dim = k_pool.shape[2]
    kvh = h // (q.shape[1] // head_dim // k_pool.shape[1])
    pos = positions[t]
    q_sh = cuda.shared.array(MAX_HEAD_DIM, np.float32)
    p_sh = cuda.shared.array(WARP, np.float32)
    for d in range(lane, head_dim, WARP):
        q_sh[d] = q[t, h * head_dim + d] * scale
    cuda.syncthreads()
    acc = cuda.local.array(DIMS_PER_LANE, np.float32)
    for j in range(DIMS_PER_LANE):
        acc[j] = np.float32(0)
    m = NEG_INF
    total = np.float32(0)
    start = split * SPLIT
    end = min(start + SPLIT, n_slots[0])  # chunks past the end loop zero times and report nothing
    for base in range(start, end, WARP):
        s = base + lane
        score = NEG_INF
        if s < end:
            p = slot_pos[s]
            if p >= 0 and p <= pos and (window <= 0 or p > pos - window):
                score = np.float32(0)
                for d in range(head_dim):
                    score += q_sh[d] * np.float32(k_pool[s, kvh, d])
        m_new = max(m, warp_max(score))
        if m_new == NEG_INF:  # nothing visible yet: uniform across the warp
            continue
        e = math.exp(score - m_new) if score != NEG_INF else np.float32(0)
        corr = math.exp(m - m_new) if m != NEG_INF else np.float32(0)
        total = total * corr + warp_sum(e)
        p_sh[lane] = e
        cuda.syncthreads()
        for j in range(DIMS_PER_LANE):
            d = lane + j * WARP
            if d < head_dim:
                a = acc[j] * corr
                for i in range(min(WARP, end - base)):
                    a += p_sh[i] * np.float32(v_pool[base + i, kvh, d])
                acc[j] = a
        cuda.syncthreads()
        m = m_new
    if lane == 0:
        part_m[t, h, split] = m
        part_l[t, h, split] = total
    for j in range(DIMS_PER_LANE):
        d = lane + j * WARP
        if d < head_dim:
            part_acc[t, h, split, d] = acc[j]


@cuda.jit
def _combine(part_m, part_l, part_acc, splits, head_dim, out):
    h = cuda.blockIdx.x
    t = cuda.blockIdx.y
    lane = cuda.threadIdx.x
    m = NEG_INF
    for c in range(splits):
        m = max(m, part_m[t, h, c])
    total = np.float32(0)
    for c in range(splits):
        if part_m[t, h, c] != NEG_INF:
            total += part_l[t, h, c] * math.exp(part_m[t, h, c] - m)
    inv = np.float32(1) / total if total > np.float32(0) else np.float32(0)  # no visible slot: zeros
    for d in range(lane, head_dim, WARP):
        a = np.float32(0)
        for c in range(splits):
            if part_m[t, h, c] != NEG_INF:
                a += part_acc[t, h, c, d] * math.exp(part_m[t, h, c] - m)
        out[t, h * head_dim + d] = a * inv


def set_slot_pos(slot_pos, slots, positions, stream=0) -> None:
    """slot_pos[slots[i]] = positions[i] on the device (the pool's slot -> position map)."""
    _set_slot_pos[blocks(slots.shape[0], THREADS), THREADS, stream](slot_pos, slots, positions)


@cuda.jit
def _set_slot_pos(slot_pos, slots, positions):
    i = cuda.grid(1)
    if i < slots.shape[0]:
        slot_pos[slots[i]] = positions[i]
