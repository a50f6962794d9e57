"""Attention of queries against the KV slot pool, position-exact in slot space (DESIGN §4).

Slot s is visible to a query at position q iff 0 <= slot_pos[s] <= q and, for a sliding window w > 0,
slot_pos[s] > q - w. Free slots hold slot_pos = -1. A draft tree's verify block (lucekv.spec.tree) adds masks
(`tree_rows`): its node j sits in the slot of position root + j, and a node's query sees the slots below the root and
its ancestors' in the block (the split kernel; a tree's block is narrower than the tensor-core kernel's queries).

Each query reads its own sequence's slots (`BlockTables`): the pool's 64-slot blocks a sequence holds, in logical
order, so that queries of several sequences share a launch (decode rows) and a query's sums run in the same order
wherever its blocks are. A sequence alone in the pool reads it whole in slot order (`identity_tables`).

Split-K ("flash decoding") over the used part of the sequence only: its slots below `used` (a device int, so that
a captured decode graph sees each step's value) are cut into equal chunks of
whole TILE-slot tiles, as many as `splits` gives (128 for a decode step: enough blocks to keep every SM
busy at 4K slots as at 128K; a prefill's queries fill the GPU with fewer). One block per (KV head,
chunk, query), one warp per query head of the KV head's group, runs an online softmax over its chunk and
writes a partial (max, sum, weighted values); a combine kernel merges the partials. With one chunk (a
prefill's many queries fill the GPU without a split) the block writes the output itself, and tiles with no
slot visible to the query (a prefill's later positions, under the causal mask) are skipped whole. The grid is the same
at every step, its work follows the high-water mark, not the pool's size.
Per tile the block copies the K and V rows into shared memory as raw 32-bit words with asynchronous 16-byte
copies (rows wider than half the buffer, head_dim > 128 in float32, take K then V), and every warp of the group
reads them there. Where two tile buffers fit (rows up to 64 words: float16 up to head_dim 128) the next tile's
copies are started before this tile is scored, and the slot positions are read two tiles ahead, so a block of a
few tiles waits for memory about once, not three times per tile. Scores: lane i computes slot i's whole dot
product, reading its K row 16 bytes at a time (rows staged 4 words longer, so the lanes' reads fall in different
banks) against the warp's query in shared memory (one address for all lanes: a broadcast); no cross-lane sums.
Values: each slot's weight is broadcast and lane l accumulates the dimensions of words l, l + 32, ...
(consecutive lanes, consecutive banks). A prefill of float16 K/V (MIN_TOKENS queries or more, head_dim a multiple
of 16 up to 128) goes to `flash` instead, which shares each K/V tile between a block's queries on tensor cores; the
others run here too (queries = tokens).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from lucekv.kernels.cuda import flash
from lucekv.kernels.cuda._numba import (
    ALIGN_16,
    NEG_INF,
    SIMULATOR,
    WARP,
    await_grid,
    bits_f32,
    blocks,
    copy_async16,
    copy_async_commit,
    copy_async_wait_all,
    copy_async_wait_one,
    cuda,
    half2_floats,
    jit_kernel,
    load1,
    load4,
    load_f32x4,
    warp_broadcast,
    warp_max,
    warp_sum,
)
from lucekv.kernels.cuda.flash import slot_visible
from lucekv.kernels.cuda.rope import Rotary, rotated

MAX_SPLITS = 128  # chunks per (KV head, query)
TARGET_BLOCKS = 1024  # split blocks per launch worth having: several per SM
MIN_CHUNK = 2 * WARP  # slots per chunk of a full pool at least: below that the partials cost more than the split
# saves (measured, H200, 4096 slots: 27 us per layer with 64-slot chunks, 36 with 32); a pool used only in part is
# cut into fewer, down to one tile per chunk (512 of 4096 used: 11.6 us with 32-slot chunks, 15.1 with 64)
TILE = WARP  # slots per tile: one per lane for the scores and the softmax
MAX_HEAD_DIM = 256
HEAD_WARPS = MAX_HEAD_DIM // WARP  # warps of a rope_and_store block at most (a kernel's shared array: a literal size)
MAX_GROUP = 8  # query heads per KV head: one warp each
MAX_ROW_WORDS = MAX_HEAD_DIM  # a float32 row of MAX_HEAD_DIM
# K rows are staged 4 words longer than they are (lane i reads row i, 16 bytes at a time: a quarter-warp's
# reads fall in different banks); V rows are read along the row and need no padding
TILE_WORDS = TILE * (MAX_ROW_WORDS + 4)  # 32.5 KiB: K and V of one tile when rows are <= half of the widest
SHARED_BYTES = 48 * 1024  # static shared memory a block may have
THREADS = 128
# chunks summed side by side: at 4K slots 64 chunks, 8 loads in flight per lane (the simulator pays per thread)
COMBINE_WARPS = 2 if SIMULATOR else 8
COMBINE_QUADS = MAX_HEAD_DIM // (4 * WARP)  # 16-byte pieces of a row per lane
COMBINE_LANE_DIMS = 4 * COMBINE_QUADS
BLOCK = 64  # slots per pool block (a KVFlash chunk): a sequence's slots are whole blocks
assert BLOCK % TILE == 0 and flash.TILE == BLOCK  # a tile lies in one block


class BlockTables(NamedTuple):
    """Which pool slots each query reads, as device int32 arrays (one kernel argument): query t is of sequence
    s = seq_of[t], whose logical slot j < used[s] is pool slot flat[start[s] + j // BLOCK] * BLOCK + j % BLOCK."""

    flat: object  # the blocks of every sequence of the forward, each sequence's in logical order
    start: object  # [sequences]: where each one's blocks begin in flat
    used: object  # [sequences]: its logical slots (whole blocks; or a sequence alone: the pool's high-water mark)
    seq_of: object  # [queries]


def identity_tables(blocks, used, seq_of) -> BlockTables:
    """One sequence that holds the whole pool: blocks [0, 1, ...] (device), its slots below used[0]; seq_of: zeros
    [queries] (device)."""
    return BlockTables(blocks, seq_of[:1], used, seq_of)


@cuda.jit(device=True, inline=True)
def pool_slot(tables, first, j):
    """The pool slot of logical slot j of the sequence whose blocks begin at tables.flat[first]."""
    return tables.flat[first + j // BLOCK] * BLOCK + j % BLOCK


def rope_and_store(q, k, v, positions, slots, rope: Rotary, k_pool, v_pool, q_out, last_q, qk_norm: tuple | None = None,
                   stream=0) -> None:
    """A step's attention inputs, one launch: q_out = RoPE(q); k_pool[slots[t]] = RoPE(k[t]) and
    v_pool[slots[t]] = v[t], in the pool's dtype; last_q [kept, n_head * head_dim] = the last `kept` rows of q_out
    (what KVFlash scorers read: a prompt's last token, or every row of a batch's decode rows). qk_norm: (q_norm,
    k_norm [head_dim], eps): each head of q and k RMS-normalized first (qwen3's, gemma3's q/k norms: two launches
    less).
    q, q_out: [n, n_head * head_dim]; k, v: [n, n_kv * head_dim]; q_out and the pool in natural order."""
    head_dim = k_pool.shape[2]
    if qk_norm is None:
        qk_norm = (_no_norm(), _no_norm(), np.float32(0), False)
    elif rope.paired:
        raise ValueError("q/k norms take heads in natural order, not paired")
    else:
        qk_norm = (qk_norm[0], qk_norm[1], np.float32(qk_norm[2]), True)
    heads = (q.shape[1] + 2 * k.shape[1]) // head_dim
    _rope_and_store[(q.shape[0], heads), blocks(head_dim, WARP) * WARP, stream](
        q, k, v, positions, slots, rope, k_pool, v_pool, q_out, last_q, qk_norm)


_no_norms: list = []


def _no_norm():
    """A float32 vector standing in for the q/k norms' weights (never read), made once."""
    if not _no_norms:
        _no_norms.append(cuda.to_device(np.zeros(1, np.float32)))
    return _no_norms[0]


def attend(q, k_pool, v_pool, slot_pos, tables: BlockTables, positions, window: int, scale: float, parts, out,
           stream=0, one_sequence: bool = False, tree=None) -> None:
    """out[n, n_head * head_dim] for queries q [n, n_head * head_dim] at `positions` (int32 [n]), each over its
    sequence's slots (`tables`); parts: `partials(n, n_head, n_kv, head_dim, slots)`. `one_sequence`: every query is
    of one sequence (a prompt's), which the tensor-core kernel may then take.
    `tree` (device int32 [3, n], or None: `no_tree`): a draft tree's ancestor masks (`tree_rows`), whose queries the
    split kernel takes (the tensor-core kernel's MIN_TOKENS queries are more than a tree's block holds).
    Pools: float16 or float32 [slots, n_kv, head_dim], rows a multiple of 16 bytes (see `unsupported`).
    """
    n = q.shape[0]
    size, n_kv, head_dim = k_pool.shape
    if one_sequence and tree is None and flash.serves(n, k_pool.dtype, head_dim):
        flash.attend(q, k_pool, v_pool, slot_pos, tables, positions, window, scale, out, stream)
        return
    group = q.shape[1] // head_dim // n_kv
    part_m, part_l, part_acc = parts
    k_words = k_pool.view(np.uint32).reshape(size * n_kv, -1)  # row s * n_kv + h: slot s, KV head h
    v_words = v_pool.view(np.uint32).reshape(size * n_kv, -1)
    kernel = _split_kernel(4 // k_pool.dtype.itemsize, k_words.shape[1])
    tree = no_tree(n) if tree is None else tree
    kernel[(n_kv, part_m.shape[2], n), group * WARP, stream](q, k_words, v_words, slot_pos, tables, positions, tree,
                                                            window, np.float32(scale), part_m, part_l, part_acc,
                                                            out)
    if part_m.shape[2] > 1:
        _combine[(q.shape[1] // head_dim, n), COMBINE_WARPS * WARP, stream](part_m, part_l,
                                                                            part_acc.reshape(-1, head_dim), out)


NOT_IN_TREE = np.iinfo(np.int32).max  # a query's tree base when it is no draft tree's: every slot below it
_no_trees: dict[int, object] = {}


def tree_rows(base: int, ancestors: np.ndarray) -> np.ndarray:
    """Host int32 [3, n] for `attend`'s `tree`: a draft tree's verify block whose root is at position `base`, node j's
    K/V in the slot whose slot_pos is base + j, seeing nodes whose bits ancestors[j] (int64, < 2^63) sets and
    the slots below base; rows (base, low 32 bits, high 32 bits)."""
    a = np.asarray(ancestors, np.int64)
    return np.stack([np.full(len(a), base, np.int64), a & 0xFFFFFFFF, a >> 32]).astype(np.uint32).view(np.int32)


def no_tree(n: int):
    """Device int32 [3, n] of queries that are no tree's (kept: a captured graph may hold its address)."""
    if n not in _no_trees:
        rows = np.zeros((3, n), np.int32)
        rows[0] = NOT_IN_TREE
        _no_trees[n] = cuda.to_device(rows)
    return _no_trees[n]


@cuda.jit(device=True, inline=True)
def tree_visible(sp, pos, window, tree, t):
    """slot_visible, and for a draft tree's query (tree[0, t] its root's position): a slot of the tree's block (slot
    position root + j) only if bit j of its ancestor mask (tree[1, t] low, tree[2, t] high 32 bits) is set."""
    base = tree[0, t]
    if sp < base:
        return slot_visible(sp, pos, window)
    j = sp - base
    if j < 32:
        return (tree[1, t] >> j) & 1 != 0
    return j < 64 and (tree[2, t] >> (j - 32)) & 1 != 0


def unsupported(n_head: int, n_kv_head: int, head_dim: int) -> str | None:
    """Why `attend` cannot serve these heads, or None."""
    if head_dim > MAX_HEAD_DIM or head_dim % 8:
        return f"head_dim {head_dim} (the CUDA attention takes multiples of 8 up to {MAX_HEAD_DIM})"
    if n_head % n_kv_head or n_head // n_kv_head > MAX_GROUP:
        return f"{n_head} query heads on {n_kv_head} KV heads (at most {MAX_GROUP} per KV head)"
    return None


def splits(n: int, n_kv: int, slots: int) -> int:
    """Chunks the used slots are cut into for n queries: enough blocks to fill the GPU a few times over (a
    decode step needs them all from the split; a prefill has its queries), and no more than a pool of `slots`
    can fill with MIN_CHUNK slots each."""
    return max(1, min(MAX_SPLITS, TARGET_BLOCKS // (n * n_kv), -(-slots // MIN_CHUNK)))


def partials(n: int, n_head: int, n_kv: int, head_dim: int, slots: int, alloc=cuda.device_array):
    """Device scratch for `attend` over a pool of `slots`: per (query, head, chunk) max, sum and weighted values;
    alloc(shape, dtype) makes each array."""
    s = splits(n, n_kv, slots)
    return alloc((n, n_head, s), np.float32), alloc((n, n_head, s), np.float32), alloc((n, n_head, s, head_dim),
                                                                                        np.float32)


@jit_kernel
def _rope_and_store(q, k, v, positions, slots, rope, k_pool, v_pool, q_out, last_q, qk_norm):
    # a block per (token, head of its q, then k, then v row), a thread per dimension (whole warps: the norm's sums)
    await_grid()
    sums = cuda.shared.array(HEAD_WARPS, np.float32)
    t, h, d = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    head_dim = k_pool.shape[2]
    n_qh, n_kh = q.shape[1] // head_dim, k.shape[1] // head_dim
    if h >= n_qh + n_kh:
        if d < head_dim:
            v_pool[slots[t], h - n_qh - n_kh, d] = v[t, (h - n_qh - n_kh) * head_dim + d]
        return
    is_q = h < n_qh
    x = q if is_q else k
    at = (h if is_q else h - n_qh) * head_dim
    q_w, k_w, eps, on = qk_norm
    inv = np.float32(1)
    if on:  # the block's branch: its sums stay block-wide
        value = x[t, at + d] if d < head_dim else np.float32(0)
        ss = warp_sum(value * value)
        if d % WARP == 0:
            sums[d // WARP] = ss
        cuda.syncthreads()
        total = np.float32(0)
        for j in range(cuda.blockDim.x // WARP):
            total += sums[j]
        inv = np.float32(1) / math.sqrt(total / np.float32(head_dim) + eps)
    if d >= head_dim:
        return
    value = rotated(x, t, at, d, positions[t], rope, (q_w if is_q else k_w, inv, on))
    if is_q:
        q_out[t, at + d] = value
        kept = t - (q.shape[0] - last_q.shape[0])
        if kept >= 0:
            last_q[kept, at + d] = value
    else:
        k_pool[slots[t], h - n_qh, d] = value


@functools.cache
def _split_kernel(dims_per_word: int, row_words: int):
    """The split kernel for pool rows of `row_words` 32-bit words holding 2 (float16) or 1 (float32) values.
    The row width is a compile-time constant, so the loops over a row unroll into shared-memory accesses at
    immediate offsets (load4 / store4 / load1: no wraparound arithmetic)."""
    head_dim = row_words * dims_per_word
    k_stride = row_words + 4  # padded K rows: 16-byte aligned, and lane i's reads of row i hit other banks
    both = TILE * (k_stride + row_words) <= TILE_WORDS  # K and V of a tile fit the buffer together
    v_at = TILE * k_stride if both else 0
    # shared memory sized to these rows, not the widest: it bounds the blocks an SM holds
    tile_words = TILE * k_stride + (TILE * row_words if both else 0)
    query_words = MAX_GROUP * head_dim
    # two tile buffers where they fit: the next tile's copies run while this one is scored (float16 x 128: 37 KiB)
    stages = 2 if 4 * (2 * tile_words + query_words) <= SHARED_BYTES else 1
    buffer_words = stages * tile_words
    words_per_lane = (row_words + WARP - 1) // WARP
    lane_dims = words_per_lane * dims_per_word
    quads = row_words // 4

    @cuda.jit(device=True, inline=True)
    def copy_rows(src, base, n_in, n_kv, kvh, tile, at, stride):
        # start copying rows base .. base + n_in - 1 of KV head kvh of src to tile[at + i * stride + c]
        for e in range(cuda.threadIdx.x, n_in * quads, cuda.blockDim.x):
            i = e // quads
            c = 4 * (e - i * quads)
            copy_async16(tile, at + i * stride + c, src, (base + i) * n_kv + kvh, c)

    @cuda.jit(device=True, inline=True)
    def copy_tile(k_words, v_words, base, n_in, n_kv, kvh, tile, at):
        # one group: the tile's K rows (padded) and, when both fit, its V rows
        copy_rows(k_words, base, n_in, n_kv, kvh, tile, at, k_stride)
        if both:
            copy_rows(v_words, base, n_in, n_kv, kvh, tile, at + v_at, row_words)
        copy_async_commit()

    @cuda.jit(device=True, inline=True)
    def slot_position(slot_pos, tables, first, s, end):
        return slot_pos[pool_slot(tables, first, s)] if s < end else np.int32(-1)

    @cuda.jit(device=True, inline=True)
    def dot_quad(tile, at, qs, q_at):
        # the 4 words at tile[at] (2 or 1 values each) against the query's matching values at qs[q_at]
        w0, w1, w2, w3 = load4(tile, at)
        if dims_per_word == 2:
            q0, q1, q2, q3 = load4(qs, q_at)
            q4, q5, q6, q7 = load4(qs, q_at + 4)
            a0, a1 = half2_floats(w0)
            a2, a3 = half2_floats(w1)
            a4, a5 = half2_floats(w2)
            a6, a7 = half2_floats(w3)
            return (q0 * a0 + q1 * a1 + q2 * a2 + q3 * a3) + (q4 * a4 + q5 * a5 + q6 * a6 + q7 * a7)
        q0, q1, q2, q3 = load4(qs, q_at)
        return (q0 * bits_f32(w0) + q1 * bits_f32(w1)) + (q2 * bits_f32(w2) + q3 * bits_f32(w3))

    @cuda.jit(device=True, inline=True)
    def add_word(word, w, acc, k):
        if dims_per_word == 2:
            a, b = half2_floats(word)
            acc[2 * k] += w * a
            acc[2 * k + 1] += w * b
        else:
            acc[k] += w * bits_f32(word)

    def kernel(q, k_words, v_words, slot_pos, tables, positions, tree, window, scale, part_m, part_l, part_acc,
               out):
        await_grid()
        kvh = cuda.blockIdx.x
        split = cuda.blockIdx.y
        t = cuda.blockIdx.z
        lane = cuda.threadIdx.x & (WARP - 1)  # not %: the compiler then knows lane < WARP
        warp = cuda.threadIdx.x // WARP
        n_kv = cuda.gridDim.x
        h = kvh * (cuda.blockDim.x // WARP) + warp
        tile = cuda.shared.array(buffer_words, np.uint32, alignment=ALIGN_16)
        qs = cuda.shared.array(query_words, np.float32, alignment=ALIGN_16)  # each warp's query, scaled
        q_at = warp * head_dim
        acc = cuda.local.array(lane_dims, np.float32)  # dims of words lane, lane + WARP, ...
        pos = positions[t]
        seq = tables.seq_of[t]
        first = tables.start[seq]
        used = tables.used[seq]
        n_splits = cuda.gridDim.y
        # whole tiles; down to one when few slots are used (the grid was sized by MIN_CHUNK for a full pool)
        chunk = ((used + n_splits - 1) // n_splits + TILE - 1) // TILE * TILE
        start = split * chunk
        end = min(start + chunk, used)  # chunks past the end loop zero times and report nothing
        # the first two tiles' slot positions and the query are read together (one memory latency, not three);
        # visibility: lane i's slot of a tile, the same for every warp of the block (measured on an H200: copying
        # the first tile before its visibility is known was 4% slower)
        sp_next = slot_position(slot_pos, tables, first, start + TILE + lane, end)
        visible = tree_visible(slot_position(slot_pos, tables, first, start + lane, end), pos, window, tree, t)
        for d in range(lane, head_dim, WARP):
            qs[q_at + d] = q[t, h * head_dim + d] * scale
        for j in range(lane_dims):
            acc[j] = np.float32(0)
        any_visible = cuda.syncthreads_or(np.int32(visible))  # (and every warp has written its query)
        if any_visible:  # a tile is copied when part of it is visible, and then scored (its slots are consecutive)
            copy_tile(k_words, v_words, pool_slot(tables, first, start), min(TILE, end - start), n_kv, kvh, tile, 0)
        at = 0  # this tile's buffer
        m = NEG_INF
        total = np.float32(0)  # this lane's share of the softmax denominator
        for base in range(start, end, TILE):
            n_in = min(TILE, end - base)
            nxt = base + TILE
            visible_next = tree_visible(sp_next, pos, window, tree, t)
            sp_next = slot_position(slot_pos, tables, first, nxt + TILE + lane, end)  # two tiles ahead
            # every warp is done with the previous tile (its buffer is copied into next); nothing visible in the
            # next tile: it is not copied
            any_next = cuda.syncthreads_or(np.int32(visible_next))
            ahead = stages == 2 and any_next != 0
            if ahead:
                copy_tile(k_words, v_words, pool_slot(tables, first, nxt), min(TILE, end - nxt), n_kv, kvh, tile,
                          tile_words - at)
            if any_visible:
                if ahead:
                    copy_async_wait_one()
                else:
                    copy_async_wait_all()
                cuda.syncthreads()  # every thread's copies of this tile have landed
                # lane i scores slot base + i against the whole query: no cross-lane sums
                score = NEG_INF
                if visible:
                    p0 = np.float32(0)  # two sums: two dependency chains
                    p1 = np.float32(0)
                    row = at + lane * k_stride
                    for c in range(0, quads, 2):
                        p0 += dot_quad(tile, row + 4 * c, qs, q_at + 4 * dims_per_word * c)
                        if c + 1 < quads:
                            p1 += dot_quad(tile, row + 4 * c + 4, qs, q_at + 4 * dims_per_word * (c + 1))
                    score = p0 + p1
                m_new = max(m, warp_max(score))
                e = math.exp(score - m_new) if visible else np.float32(0)
                corr = math.exp(m - m_new) if m != NEG_INF else np.float32(0)
                if not both:  # V over the K rows, once every warp has scored them
                    cuda.syncthreads()
                    copy_rows(v_words, pool_slot(tables, first, base), n_in, n_kv, kvh, tile, at, row_words)
                    copy_async_commit()
                    copy_async_wait_all()
                    cuda.syncthreads()
                # with nothing visible yet m, m_new are -inf, corr and e 0: acc and total stay 0
                total = total * corr + e
                for j in range(lane_dims):
                    acc[j] *= corr
                for i in range(TILE):
                    w = warp_broadcast(e, i)
                    if i < n_in:
                        for k in range(words_per_lane):
                            word = lane + WARP * k
                            if word < row_words:
                                add_word(load1(tile, at + v_at + i * row_words + word), w, acc, k)
                m = m_new
            if stages == 1 and any_next:
                cuda.syncthreads()  # every warp is done with the one buffer
                copy_tile(k_words, v_words, pool_slot(tables, first, nxt), min(TILE, end - nxt), n_kv, kvh, tile, 0)
            if stages == 2:
                at = tile_words - at
            visible = visible_next
            any_visible = any_next
        total = warp_sum(total)
        if n_splits == 1:  # the whole output: normalized here, no combine
            inv = np.float32(1) / total if total > np.float32(0) else np.float32(0)  # nothing visible: 0
            for k in range(words_per_lane):
                word = lane + WARP * k
                if word < row_words:
                    for u in range(dims_per_word):
                        out[t, h * head_dim + word * dims_per_word + u] = acc[k * dims_per_word + u] * inv
            return
        if lane == 0:
            part_m[t, h, split] = m
            part_l[t, h, split] = total
        for k in range(words_per_lane):
            word = lane + WARP * k
            if word < row_words:
                for u in range(dims_per_word):
                    part_acc[t, h, split, word * dims_per_word + u] = acc[k * dims_per_word + u]

    kernel.__name__ = kernel.__qualname__ = f"_attend_split_{'f16' if dims_per_word == 2 else 'f32'}_{head_dim}"
    return jit_kernel(kernel)


@jit_kernel
def _combine(part_m, part_l, part_rows, out):
    # One block per (head, query). Every warp weighs the chunks (lane c: chunks c, c + 32, ...; warp 0 keeps the
    # weights, all run the warp reductions, as the simulator needs); the sum over chunks stops after the last one
    # with something visible (chunks past the used slots are empty). Then warp w sums chunks w, w + COMBINE_WARPS,
    # ..., 16 bytes of the row per lane, independent loads in flight together, and the warps' sums are added
    # through shared memory. part_rows: part_acc as rows [(query, head, chunk), head_dim].
    await_grid()
    h = cuda.blockIdx.x
    t = cuda.blockIdx.y
    lane = cuda.threadIdx.x & (WARP - 1)
    warp = cuda.threadIdx.x // WARP
    n_splits = part_m.shape[2]
    head_dim = part_rows.shape[1]
    weight = cuda.shared.array(MAX_SPLITS, np.float32)
    sums = cuda.shared.array((COMBINE_WARPS, MAX_HEAD_DIM), np.float32)
    m = NEG_INF
    for c in range(lane, n_splits, WARP):
        m = max(m, part_m[t, h, c])
    m = warp_max(m)
    total = np.float32(0)
    last = np.float32(-1)
    for c in range(lane, n_splits, WARP):
        mc = part_m[t, h, c]
        w = math.exp(mc - m) if mc != NEG_INF else np.float32(0)
        total += part_l[t, h, c] * w
        if w > np.float32(0):
            last = np.float32(c)
        if warp == 0:
            weight[c] = w
    total = warp_sum(total)
    n_used = np.int32(warp_max(last)) + 1
    cuda.syncthreads()
    acc = cuda.local.array(COMBINE_LANE_DIMS, np.float32)  # dims 4 (lane + WARP k) .. + 3 of this warp's chunks
    for j in range(COMBINE_LANE_DIMS):
        acc[j] = np.float32(0)
    row0 = (t * part_m.shape[1] + h) * n_splits
    for c in range(warp, n_used, COMBINE_WARPS):
        w = weight[c]
        for k in range(COMBINE_QUADS):
            d = 4 * (lane + WARP * k)
            if d < head_dim:
                a0, a1, a2, a3 = load_f32x4(part_rows, row0 + c, d)
                acc[4 * k] += a0 * w
                acc[4 * k + 1] += a1 * w
                acc[4 * k + 2] += a2 * w
                acc[4 * k + 3] += a3 * w
    for k in range(COMBINE_QUADS):
        d = 4 * (lane + WARP * k)
        if d < head_dim:
            for u in range(4):
                sums[warp, d + u] = acc[4 * k + u]
    cuda.syncthreads()
    for d in range(cuda.threadIdx.x, head_dim, cuda.blockDim.x):
        a = np.float32(0)
        for w in range(COMBINE_WARPS):
            a += sums[w, d]
        out[t, h * head_dim + d] = a / total if total > np.float32(0) else np.float32(0)  # nothing visible: 0


def set_slot_pos(slot_pos, slots, positions, stream=0) -> None:
    """slot_pos[slots[i]] = positions[i] on the device (the pool's slot -> position map)."""
    _set_slot_pos[blocks(slots.shape[0], THREADS), THREADS, stream](slot_pos, slots, positions)


@jit_kernel
def _set_slot_pos(slot_pos, slots, positions):
    await_grid()
    i = cuda.grid(1)
    if i < slots.shape[0]:
        slot_pos[slots[i]] = positions[i]
