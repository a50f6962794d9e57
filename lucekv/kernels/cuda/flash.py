"""Prefill attention on tensor cores (flash-style): many queries share each K/V tile.

`attention.attend` runs one block per query, each reading every K/V tile its query sees and scoring it on the
float32 cores: fine for a decode step, but a prefill of n tokens reads the pool n times over. Here a block takes
ROWS (token, query head) rows of one KV head, rows in token-major order (row r = token r // group, head r % group
of the KV head's group), so a block's rows are consecutive tokens that see nearly the same slots. Per tile of
TILE slots it copies K and V once into shared memory, and each of its 4 warps computes its 16 rows' scores
S = Q K^T and then O += P V with `mma.m16n8k16` (float16 operands, float32 accumulators), an online softmax in
between (FlashAttention-2's order: scores never leave registers; a row's max and sum are kept per thread and
shared across the 4 lanes that hold the row by two shuffles).
- Fragments (PTX ISA layout, lane = 4 g + c): a thread holds rows g and g + 8 of its warp's 16, columns 2c, 2c + 1
  (+ 8) of each 8-wide tile. The query is rounded to float16 once, times the softmax scale and log2(e), so that
  the softmax's exponentials are exp2 (one special-function instruction each). A score tile's C fragment is,
  rounded, the A fragment of P for the next product. B fragments come from shared memory by ldmatrix, four 8 x 8
  matrices a lane-wide instruction: K's rows (slots) are B's columns as stored (two score tiles' k16 slice per
  load); V's columns (dimensions) are not, so V's come transposed (`load_matrix_x4_trans`: two output tiles' k16
  slice of P V per load).
- Slot s is visible to a row at position p iff 0 <= slot_pos[s] <= p (and slot_pos[s] > p - window with a
  window): position-exact in slot space, as `attention`. Against the lowest and highest position of the block's
  rows, one slot a thread: a tile no row sees is skipped whole, and a tile every row sees whole (a long prompt's
  tiles before the diagonal) is scored without masks.
- Pipelined copies (cp.async, two groups in flight): once every warp has scored a tile, the next visible tile's K
  is copied over its K (landing during this tile's softmax and P V), and once every warp is done with P V, the
  next tile's V over its V (landing during the next tile's scores). Rows are staged padded to `words + 4` words:
  the 8 rows an ldmatrix matrix reads at one word offset fall in 8 different bank quads.
Float16 pools and head_dim a multiple of 16 up to MAX_HEAD_DIM only (`serves`); the others keep `attention`.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from lucekv.kernels.cuda._numba import (
    ALIGN_16,
    NEG_INF,
    WARP,
    await_grid,
    blocks,
    copy_async16,
    copy_async_commit,
    copy_async_wait_all,
    copy_async_wait_one,
    cuda,
    exp2_approx,
    jit_bounded,
    load_matrix_x4,
    load_matrix_x4_trans,
    mma_f16_16816,
    pack_half2,
    warp_shfl_xor,
)

WARPS = 4  # warps a block: 16 (token, head) rows each (an m16 tile), ROWS a block
ROWS = 16 * WARPS
TILE = 64  # slots per K/V tile
MAX_HEAD_DIM = 128  # the output accumulators: head_dim / 2 float32 registers per thread
# Fewer queries: the split kernel is faster. A block here walks every tile of its rows' sequence, and few queries
# make few blocks (n_kv x rows / ROWS): H100, 8B heads, 20 queries take 42 / 276 / 1994 us split against
# 114 / 763 / 5999 us here at 512 / 4K / 32K slots; at 64 queries the two meet (111 / 765 against 106 / 654 us)
# (bench/results/h100-attention-queries.json). So verify blocks and decode rows take the split kernel.
MIN_TOKENS = 64
# resident blocks an SM the registers are bounded for: a 512-token piece (the engine's) of the 8B shape makes 256
# blocks, two an SM on an H100's 132, and the smaller models' fewer; a third block's bound (168 registers) spilled
BLOCKS_PER_SM = 2
LOG2E = 1 / math.log(2)  # folded into the query's scale: the softmax's exponentials are exp2


def serves(n_tokens: int, pool_dtype, head_dim: int) -> bool:
    """Whether `attend` takes these queries (else `attention.attend` does)."""
    return n_tokens >= MIN_TOKENS and runs(pool_dtype, head_dim)


def runs(pool_dtype, head_dim: int) -> bool:
    """Whether `attend` can take queries over this pool at all."""
    return np.dtype(pool_dtype) == np.float16 and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM


def attend(q, k_pool, v_pool, slot_pos, tables, positions, window: int, scale: float, out, stream=0,
           warps: int = WARPS, blocks_per_sm: int = BLOCKS_PER_SM) -> None:
    """out[n, n_head * head_dim] for queries q [n, n_head * head_dim] at `positions`, all of one sequence (`tables`,
    an attention.BlockTables of that one sequence: its blocks from flat[0]), of the float16 pools [slots, n_kv,
    head_dim] (the contract of `attention.attend`, where `serves`). A tile is one block of the sequence. `warps`
    a block and the resident blocks an SM its registers are bounded for: the backend takes the defaults;
    attention_speed times others beside them (8 warps: each staged tile serves twice the rows)."""
    size, n_kv, head_dim = k_pool.shape
    group = q.shape[1] // head_dim // n_kv
    k_words = k_pool.view(np.uint32).reshape(size * n_kv, -1)  # row s * n_kv + h: slot s, KV head h
    v_words = v_pool.view(np.uint32).reshape(size * n_kv, -1)
    grid = (n_kv, blocks(q.shape[0] * group, 16 * warps))
    kernel = _kernel(head_dim, warps, blocks_per_sm)
    kernel[grid, warps * WARP, stream](q, k_words, v_words, slot_pos, tables, positions, window,
                                       np.float32(scale * LOG2E), out)


@cuda.jit(device=True, inline=True)
def slot_visible(sp, pos, window):
    """Whether a slot holding position sp (-1: free) is visible to a query at `pos` (both attention kernels)."""
    return sp >= 0 and sp <= pos and (window <= 0 or sp > pos - window)


@cuda.jit(device=True, inline=True)
def _quad_max(v):
    """Max over the 4 lanes that hold one row (lanes 4g .. 4g + 3)."""
    v = max(v, warp_shfl_xor(v, 1))
    return max(v, warp_shfl_xor(v, 2))


@cuda.jit(device=True, inline=True)
def _quad_sum(v):
    v += warp_shfl_xor(v, 1)
    return v + warp_shfl_xor(v, 2)


@functools.cache
def _kernel(head_dim: int, warps: int = WARPS, blocks_per_sm: int = BLOCKS_PER_SM):
    words = head_dim // 2  # float16 pairs per row
    stride = words + 4  # padded staged rows (see the module's notes)
    quads = words // 4  # 16-byte copies per row
    k_steps = head_dim // 16  # k16 slices of a query row
    d_tiles = head_dim // 8  # n8 tiles of an output row
    s_tiles = TILE // 8  # n8 tiles of a score row
    rows = 16 * warps  # a block's
    threads = warps * WARP
    copy_rows = threads // quads  # rows a pass of the block's 16-byte copies stages
    copy_passes = -(-TILE // copy_rows)

    @cuda.jit(device=True, inline=True)
    def query_value(q, row, n_rows, group, kvh, col, scale):
        if row >= n_rows:
            return np.float32(0)
        t = row // group
        return q[t, (kvh * group + row - t * group) * head_dim + col] * scale

    @cuda.jit(device=True, inline=True)
    def row_position(positions, row, n_rows, group):
        return positions[row // group] if row < n_rows else np.int32(-1)

    @cuda.jit(device=True, inline=True)
    def slot_position(slot_pos, tables, used, t):
        """The position slot cuda.threadIdx.x of tile t holds (-1: free, past the used slots or no such slot)."""
        i = cuda.threadIdx.x
        if i < TILE and t * TILE + i < used:
            return slot_pos[tables.flat[t] * TILE + i]
        return np.int32(-1)

    @cuda.jit(device=True, inline=True)
    def next_tile(t, sp, slot_pos, tables, used, tile_pos, lo, hi, window):
        """The first tile from t that some row of the block may see (past the last: none), its slots' positions in
        tile_pos, and whether a row sees only part of it (its scores take masks). sp: this thread's slot position
        in tile t, loaded ahead. Against the block's rows' lowest and highest positions, one slot a thread;
        block-uniform (two barriers a tile it looks at)."""
        n_tiles = (used + TILE - 1) // TILE
        while t < n_tiles:
            if cuda.threadIdx.x < TILE:
                tile_pos[cuda.threadIdx.x] = sp
            seen = sp >= 0 and sp <= hi and (window <= 0 or sp > lo - window)
            every = cuda.threadIdx.x >= TILE or (sp >= 0 and sp <= lo and (window <= 0 or sp > hi - window))
            if cuda.syncthreads_or(np.int32(seen)) != 0:
                return t, cuda.syncthreads_and(np.int32(every)) == 0
            t += 1
            sp = slot_position(slot_pos, tables, used, t)
        return t, False

    @cuda.jit(device=True, inline=True)
    def stage(kv, which, words_of, tables, t, used, n_kv, kvh, row, w):
        """Start copying tile t's K (which 0) or V (1) rows of KV head kvh into kv[which], as one group (empty past
        the last tile, so that the groups in flight stay two): this thread's words w .. w + 3 of rows row,
        row + copy_rows..."""
        if t * TILE < used:
            block_at = tables.flat[t] * TILE  # the tile's block in the pool
            last = used - 1 - t * TILE
            for p in range(copy_passes):  # (a constant count: unrolled)
                i = row + p * copy_rows
                if row < copy_rows and i < TILE:
                    r = (block_at + min(i, last)) * n_kv + kvh  # past the used slots: a used row (P is 0 there)
                    copy_async16(kv, (which * TILE + i) * stride + w, words_of, r, w)
        copy_async_commit()

    @cuda.jit(device=True, inline=True)
    def store_row(out, o, row, n_rows, group, kvh, c, upper, total):
        if row < n_rows:
            inv = np.float32(1) / total if total > np.float32(0) else np.float32(0)  # nothing visible: 0
            t = row // group
            base = (kvh * group + row - t * group) * head_dim + 2 * c
            for j in range(d_tiles):
                out[t, base + 8 * j] = o[j, 2 * upper] * inv
                out[t, base + 8 * j + 1] = o[j, 2 * upper + 1] * inv

    def kernel(q, k_words, v_words, slot_pos, tables, positions, window, scale, out):
        await_grid()
        kvh = cuda.blockIdx.x
        n_kv = cuda.gridDim.x
        group = q.shape[1] // head_dim // n_kv
        n_rows = q.shape[0] * group
        tid = cuda.threadIdx.x
        lane = tid & (WARP - 1)
        g, c = lane >> 2, lane & 3
        first_row = cuda.blockIdx.y * rows
        row_a = first_row + (tid // WARP) * 16 + g
        row_b = row_a + 8
        pos_a = row_position(positions, row_a, n_rows, group)
        pos_b = row_position(positions, row_b, n_rows, group)
        lo = np.int32(0x7FFFFFFF)  # the block's rows' lowest and highest positions
        hi = np.int32(-1)
        for t in range(first_row // group, min(q.shape[0], (first_row + rows - 1) // group + 1)):
            lo = min(lo, positions[t])
            hi = max(hi, positions[t])
        copy_row = tid // quads  # this thread's 16-byte copy of each staged row it copies (see stage)
        copy_word = 4 * (tid - copy_row * quads)
        kv = cuda.shared.array((2, TILE, stride), np.uint32, alignment=ALIGN_16)  # the tile's K rows, its V rows
        tile_pos = cuda.shared.array((2, TILE), np.int32)  # slot positions of this tile and the next
        qf = cuda.local.array((k_steps, 4), np.uint32)  # this thread's A fragments of the query rows
        for kk in range(k_steps):
            col = 16 * kk + 2 * c
            qf[kk, 0] = pack_half2(query_value(q, row_a, n_rows, group, kvh, col, scale),
                                   query_value(q, row_a, n_rows, group, kvh, col + 1, scale))
            qf[kk, 1] = pack_half2(query_value(q, row_b, n_rows, group, kvh, col, scale),
                                   query_value(q, row_b, n_rows, group, kvh, col + 1, scale))
            qf[kk, 2] = pack_half2(query_value(q, row_a, n_rows, group, kvh, col + 8, scale),
                                   query_value(q, row_a, n_rows, group, kvh, col + 9, scale))
            qf[kk, 3] = pack_half2(query_value(q, row_b, n_rows, group, kvh, col + 8, scale),
                                   query_value(q, row_b, n_rows, group, kvh, col + 9, scale))
        # this lane's ldmatrix rows (see the module's notes): K's slot 16 jj + k_row, word 8 kk + k_word; V's slot
        # 16 kk + v_row, word 4 j + v_word
        k_row = (lane & 7) + ((lane >> 4) << 3)
        k_word = ((lane >> 3) & 1) << 2
        v_row = (lane & 7) + (((lane >> 3) & 1) << 3)
        v_word = (lane >> 4) << 2
        o = cuda.local.array((d_tiles, 4), np.float32)
        for j in range(d_tiles):
            for e in range(4):
                o[j, e] = np.float32(0)
        s = cuda.local.array((s_tiles, 4), np.float32)
        m_a = NEG_INF  # row a's running max, in log2 units (the query is scaled by log2(e))
        m_b = NEG_INF
        l_a = np.float32(0)  # this thread's share of row a's softmax sum
        l_b = np.float32(0)
        # one sequence: its blocks from flat[0] (read through `start`, the kernel took 241 registers, not 168).
        # Pipelined: tile t's K lands while tile t - 1's P V runs, its V while its own scores do (the two buffers
        # are free by then: see the barriers)
        used = tables.used[0]
        t, masked = next_tile(0, slot_position(slot_pos, tables, used, 0), slot_pos, tables, used, tile_pos[0], lo,
                              hi, window)
        stage(kv, 0, k_words, tables, t, used, n_kv, kvh, copy_row, copy_word)
        stage(kv, 1, v_words, tables, t, used, n_kv, kvh, copy_row, copy_word)
        turn = 0  # tile_pos[turn]: this tile's slot positions
        while t * TILE < used:
            sp_next = slot_position(slot_pos, tables, used, t + 1)  # (its latency hidden behind the scores)
            copy_async_wait_one()  # this tile's K (its V may still be on its way)
            cuda.syncthreads()
            # scores of this thread's two rows and columns 2c, 2c + 1 of each n8 tile (score tiles 2jj, 2jj + 1
            # from one ldmatrix of K per k16 slice)
            for jj in range(s_tiles // 2):
                c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = np.float32(0)
                for kk in range(k_steps):
                    b0, b1, b2, b3 = load_matrix_x4(kv, 0, 16 * jj + k_row, 8 * kk + k_word)
                    c0, c1, c2, c3 = mma_f16_16816(qf[kk, 0], qf[kk, 1], qf[kk, 2], qf[kk, 3], b0, b1, c0, c1, c2, c3)
                    c4, c5, c6, c7 = mma_f16_16816(qf[kk, 0], qf[kk, 1], qf[kk, 2], qf[kk, 3], b2, b3, c4, c5, c6, c7)
                s[2 * jj, 0], s[2 * jj, 1], s[2 * jj, 2], s[2 * jj, 3] = c0, c1, c2, c3
                s[2 * jj + 1, 0], s[2 * jj + 1, 1], s[2 * jj + 1, 2], s[2 * jj + 1, 3] = c4, c5, c6, c7
            # the next tile some row sees: its barriers also tell that every warp is done with this tile's K
            t_next, masked_next = next_tile(t + 1, sp_next, slot_pos, tables, used, tile_pos[turn ^ 1], lo, hi,
                                            window)
            stage(kv, 0, k_words, tables, t_next, used, n_kv, kvh, copy_row, copy_word)
            if masked:  # (block-uniform) a tile on the diagonal, a window's edge, free slots
                for j in range(s_tiles):
                    sp0 = tile_pos[turn, 8 * j + 2 * c]
                    sp1 = tile_pos[turn, 8 * j + 2 * c + 1]
                    s[j, 0] = s[j, 0] if slot_visible(sp0, pos_a, window) else NEG_INF
                    s[j, 1] = s[j, 1] if slot_visible(sp1, pos_a, window) else NEG_INF
                    s[j, 2] = s[j, 2] if slot_visible(sp0, pos_b, window) else NEG_INF
                    s[j, 3] = s[j, 3] if slot_visible(sp1, pos_b, window) else NEG_INF
            mx_a = NEG_INF
            mx_b = NEG_INF
            for j in range(s_tiles):
                mx_a = max(mx_a, max(s[j, 0], s[j, 1]))
                mx_b = max(mx_b, max(s[j, 2], s[j, 3]))
            new_a = max(m_a, _quad_max(mx_a))
            new_b = max(m_b, _quad_max(mx_b))
            # a row that has seen nothing yet keeps -inf: its exps are 0, not exp2(-inf + inf)
            ref_a = new_a if new_a != NEG_INF else np.float32(0)
            ref_b = new_b if new_b != NEG_INF else np.float32(0)
            corr_a = exp2_approx(m_a - ref_a)
            corr_b = exp2_approx(m_b - ref_b)
            m_a = new_a
            m_b = new_b
            for j in range(s_tiles):
                s[j, 0] = exp2_approx(s[j, 0] - ref_a)
                s[j, 1] = exp2_approx(s[j, 1] - ref_a)
                s[j, 2] = exp2_approx(s[j, 2] - ref_b)
                s[j, 3] = exp2_approx(s[j, 3] - ref_b)
            l_a *= corr_a
            l_b *= corr_b
            for j in range(s_tiles):
                l_a += s[j, 0] + s[j, 1]
                l_b += s[j, 2] + s[j, 3]
            for j in range(d_tiles):
                o[j, 0] *= corr_a
                o[j, 1] *= corr_a
                o[j, 2] *= corr_b
                o[j, 3] *= corr_b
            copy_async_wait_one()  # this tile's V (the next tile's K may still be on its way)
            cuda.syncthreads()
            for kk in range(TILE // 16):  # P's k16 slice kk: score tiles 2kk and 2kk + 1
                a0 = pack_half2(s[2 * kk, 0], s[2 * kk, 1])
                a1 = pack_half2(s[2 * kk, 2], s[2 * kk, 3])
                a2 = pack_half2(s[2 * kk + 1, 0], s[2 * kk + 1, 1])
                a3 = pack_half2(s[2 * kk + 1, 2], s[2 * kk + 1, 3])
                for j in range(0, d_tiles, 2):  # output tiles j, j + 1 from one transposed ldmatrix of V
                    b0, b1, b2, b3 = load_matrix_x4_trans(kv, 1, 16 * kk + v_row, 4 * j + v_word)
                    o[j, 0], o[j, 1], o[j, 2], o[j, 3] = mma_f16_16816(a0, a1, a2, a3, b0, b1,
                                                                       o[j, 0], o[j, 1], o[j, 2], o[j, 3])
                    o[j + 1, 0], o[j + 1, 1], o[j + 1, 2], o[j + 1, 3] = mma_f16_16816(
                        a0, a1, a2, a3, b2, b3, o[j + 1, 0], o[j + 1, 1], o[j + 1, 2], o[j + 1, 3])
            cuda.syncthreads()  # every warp is done with this tile's V before the next tile's is copied over it
            stage(kv, 1, v_words, tables, t_next, used, n_kv, kvh, copy_row, copy_word)
            t, masked, turn = t_next, masked_next, turn ^ 1
        copy_async_wait_all()  # (two empty groups)
        store_row(out, o, row_a, n_rows, group, kvh, c, 0, _quad_sum(l_a))
        store_row(out, o, row_b, n_rows, group, kvh, c, 1, _quad_sum(l_b))

    shape = "" if (warps, blocks_per_sm) == (WARPS, BLOCKS_PER_SM) else f"_{warps}x{blocks_per_sm}"
    kernel.__name__ = kernel.__qualname__ = f"_attend_flash_{head_dim}{shape}"
    # ptxas, sm_90, head_dim 128: 4 x 2 228 registers, no spills; 4 x 3 168, 104 bytes of spill stores (~40 reloads a
    # tile, most of them staging addresses); 8 x 1 220, none. head_dim 64, 4 x 3: 163, none
    return jit_bounded(kernel, threads, blocks_per_sm)
