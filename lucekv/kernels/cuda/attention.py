"""Attention of queries against the KV slot pool, position-exact in slot space (DESIGN §4).

Slot s is visible to a query at position q iff 0 <= slot_pos[s] <= q and, for a sliding window w > 0,
slot_pos[s] > q - w. Free slots hold slot_pos = -1.

Split-K ("flash decoding") over the used part of the pool only: the slots below the high-water mark
(a device int, so that a captured decode graph sees each step's value) are cut into SPLITS equal chunks
of whole TILE-slot tiles. One block per (KV head, chunk, query), one warp per query head of the KV head's
group, runs an online softmax over its chunk and writes a partial (max, sum, weighted values); a combine
kernel merges the SPLITS partials. The grid is the same at every step, its work follows the high-water
mark, not the pool's size.
Per tile the block copies the K and V rows into shared memory as raw 32-bit words, 16-byte loads issued
together into registers before any is stored (one memory latency per tile, not one per slot; rows wider
than half the buffer, float32 with head_dim > 128, take K then V), and every warp of the group reads them
there. Scores: a lane holds a few dimensions of q, multiplies them into each slot's
partial score, the warp sums it, lane i keeps slot i's. Values: each slot's weight is broadcast and every
lane accumulates its dimensions. The same kernels serve prefill (queries = tokens); a flash-style prefill
that shares K/V tiles between queries is the next step.
"""

from __future__ import annotations

import math

import numpy as np

from lucekv.kernels.cuda._numba import (
    NEG_INF,
    WARP,
    bits_f32,
    blocks,
    cuda,
    half2_floats,
    load_u32x4,
    warp_broadcast,
    warp_max,
    warp_sum,
)

SPLITS = 32  # chunks per (head, query): one per lane of the combine
TILE = WARP  # slots per tile: one per lane for the softmax
MAX_HEAD_DIM = 256
MAX_ROW_WORDS = MAX_HEAD_DIM  # a float32 row of MAX_HEAD_DIM
MAX_WORDS_PER_LANE = MAX_ROW_WORDS // WARP
TILE_WORDS = TILE * MAX_ROW_WORDS  # 32 KiB of shared memory: K and V of one tile
QUADS_IN_FLIGHT = 4  # 16-byte loads per thread and array issued before any is stored
THREADS = 128


def store_kv(k, v, slots, k_pool, v_pool, stream=0) -> None:
    """k_pool[slots[i]] = k[i] (and v), converting to the pool's dtype; k, v: [n, n_kv * head_dim]."""
    _store_kv[blocks(k.size, THREADS), THREADS, stream](k, v, slots, k_pool, v_pool)


def attend(q, k_pool, v_pool, slot_pos, n_slots, positions, window: int, scale: float, parts, out,
           stream=0) -> None:
    """out[n, n_head * head_dim] for queries q [n, n_head * head_dim] at `positions` (int32 [n]).

    Reads the slots below n_slots[0] (a device int32 [1]); parts: `partials(n, n_head, head_dim)`.
    Pools: float16 or float32 [slots, n_kv, head_dim], rows a multiple of 16 bytes, head_dim <= MAX_HEAD_DIM.
    """
    n = q.shape[0]
    size, n_kv, head_dim = k_pool.shape
    group = q.shape[1] // head_dim // n_kv
    part_m, part_l, part_acc = parts
    k_words = k_pool.view(np.uint32).reshape(size * n_kv, -1)  # row s * n_kv + h: slot s, KV head h
    v_words = v_pool.view(np.uint32).reshape(size * n_kv, -1)
    kernel = _attend_split_f16 if k_pool.dtype == np.float16 else _attend_split_f32
    kernel[(n_kv, SPLITS, n), group * WARP, stream](q, k_words, v_words, head_dim, slot_pos, n_slots, positions,
                                                   window, np.float32(scale), part_m, part_l, part_acc)
    _combine[(q.shape[1] // head_dim, n), blocks(head_dim, WARP) * WARP, stream](part_m, part_l, part_acc, out)


def partials(n: int, n_head: int, head_dim: int):
    """Device scratch for `attend`: per (query, head, chunk) max, sum and weighted values."""
    return (cuda.device_array((n, n_head, SPLITS), np.float32),
            cuda.device_array((n, n_head, SPLITS), np.float32),
            cuda.device_array((n, n_head, SPLITS, head_dim), np.float32))


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


@cuda.jit(device=True, inline=True)
def _load_tiles(k_words, v_words, both, base, n_in, n_kv, kvh, tile, v_at):
    """Rows base .. base + n_in - 1 of KV head kvh, K into tile[i * row_words + c] and, if `both`, V at
    v_at + ...; 16 bytes per load, a round's loads of both issued before any is stored."""
    row_words = k_words.shape[1]
    quads = row_words // 4
    staged = cuda.local.array((2, QUADS_IN_FLIGHT, 4), np.uint32)
    for e0 in range(0, n_in * quads, QUADS_IN_FLIGHT * cuda.blockDim.x):
        for j in range(QUADS_IN_FLIGHT):
            e = e0 + j * cuda.blockDim.x + cuda.threadIdx.x
            if e < n_in * quads:
                i = e // quads
                r = (base + i) * n_kv + kvh
                c = 4 * (e - i * quads)
                staged[0, j, 0], staged[0, j, 1], staged[0, j, 2], staged[0, j, 3] = load_u32x4(k_words, r, c)
                if both:
                    staged[1, j, 0], staged[1, j, 1], staged[1, j, 2], staged[1, j, 3] = load_u32x4(v_words, r, c)
        for j in range(QUADS_IN_FLIGHT):
            e = e0 + j * cuda.blockDim.x + cuda.threadIdx.x
            if e < n_in * quads:
                i = e // quads
                o = i * row_words + 4 * (e - i * quads)
                for c in range(4):
                    tile[o + c] = staged[0, j, c]
                    if both:
                        tile[v_at + o + c] = staged[1, j, c]


def _make_attend_split(dims_per_word: int):
    """The split kernel for a pool of 2 (float16) or 1 (float32) values per 32-bit word."""
    lane_dims = MAX_WORDS_PER_LANE * dims_per_word

    @cuda.jit(device=True, inline=True)
    def dot_word(word, qr, k):
        if dims_per_word == 2:
            a, b = half2_floats(word)
            return qr[2 * k] * a + qr[2 * k + 1] * b
        return qr[k] * bits_f32(word)

    @cuda.jit(device=True, inline=True)
    def add_word(word, w, acc, k):
        if dims_per_word == 2:
            a, b = half2_floats(word)
            acc[2 * k] += w * a
            acc[2 * k + 1] += w * b
        else:
            acc[k] += w * bits_f32(word)

    def kernel(q, k_words, v_words, head_dim, slot_pos, n_slots, positions, window, scale, part_m, part_l,
               part_acc):
        kvh = cuda.blockIdx.x
        split = cuda.blockIdx.y
        t = cuda.blockIdx.z
        lane = cuda.threadIdx.x % WARP
        n_kv = cuda.gridDim.x
        h = kvh * (cuda.blockDim.x // WARP) + cuda.threadIdx.x // WARP
        row_words = k_words.shape[1]
        per_lane = (row_words + WARP - 1) // WARP
        w0 = lane * per_lane
        mine = min(max(row_words - w0, 0), per_lane)  # this lane's words: w0 .. w0 + mine - 1
        tile = cuda.shared.array(TILE_WORDS, np.uint32)
        qr = cuda.local.array(lane_dims, np.float32)
        acc = cuda.local.array(lane_dims, np.float32)
        for j in range(lane_dims):
            d = w0 * dims_per_word + j
            qr[j] = q[t, h * head_dim + d] * scale if j < mine * dims_per_word else np.float32(0)
            acc[j] = np.float32(0)
        pos = positions[t]
        used = n_slots[0]
        chunk = ((used + SPLITS - 1) // SPLITS + TILE - 1) // TILE * TILE
        start = split * chunk
        end = min(start + chunk, used)  # chunks past the end loop zero times and report nothing
        both = row_words <= MAX_ROW_WORDS // 2  # K and V of a tile fit the buffer together
        v_at = TILE_WORDS // 2 if both else 0
        m = NEG_INF
        total = np.float32(0)  # this lane's share of the softmax denominator
        for base in range(start, end, TILE):
            n_in = min(TILE, end - base)
            cuda.syncthreads()  # every warp is done with the previous tile
            _load_tiles(k_words, v_words, both, base, n_in, n_kv, kvh, tile, v_at)
            cuda.syncthreads()
            score = NEG_INF
            for i in range(TILE):
                p = np.float32(0)
                if i < n_in:
                    for k in range(MAX_WORDS_PER_LANE):
                        if k < mine:
                            p += dot_word(tile[i * row_words + w0 + k], qr, k)
                p = warp_sum(p)
                if lane == i:
                    score = p
            s = base + lane
            visible = False
            if lane < n_in:
                sp = slot_pos[s]
                visible = sp >= 0 and sp <= pos and (window <= 0 or sp > pos - window)
            score = score if visible else NEG_INF
            m_new = max(m, warp_max(score))
            e = math.exp(score - m_new) if visible else np.float32(0)
            corr = math.exp(m - m_new) if m != NEG_INF else np.float32(0)
            if not both:
                cuda.syncthreads()  # every warp has read the K tile
                _load_tiles(v_words, k_words, False, base, n_in, n_kv, kvh, tile, 0)
                cuda.syncthreads()
            # with nothing visible yet m, m_new are -inf, corr and e 0: acc and total stay 0
            total = total * corr + e
            for j in range(lane_dims):
                acc[j] *= corr
            for i in range(TILE):
                w = warp_broadcast(e, i)
                if i < n_in:
                    for k in range(MAX_WORDS_PER_LANE):
                        if k < mine:
                            add_word(tile[v_at + i * row_words + w0 + k], w, acc, k)
            m = m_new
        total = warp_sum(total)
        if lane == 0:
            part_m[t, h, split] = m
            part_l[t, h, split] = total
        for j in range(lane_dims):
            if j < mine * dims_per_word:
                part_acc[t, h, split, w0 * dims_per_word + j] = acc[j]

    kernel.__name__ = kernel.__qualname__ = f"_attend_split_{'f16' if dims_per_word == 2 else 'f32'}"
    return cuda.jit(kernel)


_attend_split_f16 = _make_attend_split(2)
_attend_split_f32 = _make_attend_split(1)


@cuda.jit
def _combine(part_m, part_l, part_acc, out):
    # One block per (head, query), one thread per dimension. Lane c of every warp weighs chunk c (warp 0's
    # results are kept: all warps run the warp sums, as the simulator needs); the sum over chunks stops
    # after the last one with something visible.
    h = cuda.blockIdx.x
    t = cuda.blockIdx.y
    d = cuda.threadIdx.x
    lane = d % WARP
    head_dim = part_acc.shape[3]
    weight = cuda.shared.array(SPLITS, np.float32)
    n_used = cuda.shared.array(1, np.int32)
    mc = part_m[t, h, lane]
    m = warp_max(mc)
    w = math.exp(mc - m) if mc != NEG_INF else np.float32(0)
    total = warp_sum(part_l[t, h, lane] * w)
    last = warp_max(np.float32(lane) if w > np.float32(0) else np.float32(-1))
    if d < WARP:
        weight[d] = w / total if total > np.float32(0) else np.float32(0)  # no visible slot: zeros
        if d == 0:
            n_used[0] = np.int32(last) + 1
    cuda.syncthreads()
    if d < head_dim:
        a = np.float32(0)
        for c in range(n_used[0]):
            a += part_acc[t, h, c, d] * weight[c]
        out[t, h * head_dim + d] = a


def set_slot_pos(slot_pos, slots, positions, stream=0) -> None:
    """slot_pos[slots[i]] = positions[i] on the device (the pool's slot -> position map)."""
    _set_slot_pos[blocks(slots.shape[0], THREADS), THREADS, stream](slot_pos, slots, positions)


@cuda.jit
def _set_slot_pos(slot_pos, slots, positions):
    i = cuda.grid(1)
    if i < slots.shape[0]:
        slot_pos[slots[i]] = positions[i]
