"""A whole decode step (tokens through every layer, each a row of its own) as one numba call per thread.

The model's matrices live in one flat byte arena (`codes`) and one float32 arena (`scales`), described by a table
(`mats`, one row per matrix); norms and biases in a third arena (`vecs`); each layer is a row of `layers` naming
its matrices and vectors. `decode_step` runs on every thread of the step at once: each op's work (rows of a
product in chunks, attention's rows by kv head) goes to whichever thread takes it next, and a thread waits at the end of
an op only for chunks still in flight (5 ops a layer: 6 for rows of several runs, 2 more with post-norms). The
products are matvec.py's `group_rows` on the weights grouped by 16 rows (quants.group_rows): each input row
quantized once per op to int16 codes by 32-blocks, integer products with the weights' codes (intdot.py), every row
of x through a group's codes while they are in cache, or, for 16 rows or more where the CPU has VNNI, the prompt's
tile kernels (matvec._tile_rows: the same numbers, faster on many rows); each row's arithmetic is its own (its own
int16 scales, its own attention), so a row gives the same numbers in any batch: a prompt piece's, a verify block's
and decode rows' alike. Nothing here allocates per token (but the tile kernels' small buffers a chunk): scratch comes in
from the caller.

numba's on-disk cache keys a function on its own file only: after editing matvec.py, intdot.py, kv_tiles.py or
sync.py, delete lucekv/kernels/cpu/__pycache__/step.* (a fresh checkout compiles everything anew).

RoPE's cos/sin come in from the host (numpy, as the prefill path computes them). A float16 KV pool comes in as
its uint16 bits: rows are widened exactly (kv_tiles) and new K/V rounded to nearest-even (`round_to_f16`), the
same values numpy's float16 gives.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from lucekv.kernels.cpu.intdot import TILE_TOKENS, X_BLOCK, quantize_x16
from lucekv.kernels.cpu.kv_tiles import LANES, exp_weights, key_scores, value_sums
from lucekv.kernels.cpu.matvec import (
    INT_Q4,
    INT_Q8,
    INT_Q8_16,
    _f32_rows,
    _tile_rows,
    block_sums,
    float32_of,
    group_rows,
    prepare_tiles,
)
from lucekv.kernels.cpu.quants import GROUP_ROWS
from lucekv.kernels.cpu.sync import atomic_add, atomic_load, cycles, wait_at_least

# matrix table columns (`mats`)
KIND, ROWS, COLS, CODES_AT, SCALE_AT, BIAS_AT, CODE_COLS, BLOCKS, HALVES = range(9)  # HALVES: float16 scales
MAT_FIELDS = 9
KIND_Q4, KIND_Q8, KIND_F32 = 0, 1, 2
# layer table columns (`layers`): matrix ids, then offsets into `vecs` (-1: absent), then the window and RoPE row
WQ, WK, WV, WO, WGATE, WUP, WDOWN = range(7)
ATTN_NORM, FFN_NORM, Q_BIAS, K_BIAS, V_BIAS, Q_NORM, K_NORM, POST_ATTN_NORM, POST_FFN_NORM = range(7, 16)
WINDOW, ROPE = 16, 17
LAYER_FIELDS = 18
# the ops of a step's phases, as a trace names them
OP_QKV, OP_KV, OP_ATTENTION, OP_WO, OP_GATE_UP, OP_DOWN, OP_POST_NORM, OP_CAPTURE, OP_OUTPUT = range(9)
OP_NAMES = ("qkv", "kv", "attention", "wo", "gate_up", "down", "post_norm", "capture", "output")
# model dims (`dims`)
# TILES: products of TILE_TOKENS rows or more through the prompt's tile kernels (matvec.TILES), the same numbers
N_HEAD, N_KV_HEAD, HEAD_DIM, ROPE_DIM, NEOX, GELU, N_EMBD, OUTPUT, OUTPUT_NORM, N_FF, TILES = range(11)
DIM_FIELDS = 11
CHUNK_ROWS = 64  # rows of a product one thread takes at a time (a multiple of matvec.ROW_GROUP)
# rows of one run an attention task takes at most: a prompt piece's rows are several tasks (its threads share them,
# and a task's scores, rows x q heads x slots, stay small), a short verify block's one
ATTENTION_ROWS = 16
# float32 scratch rows shared by the threads (`shared`) and private to each (`private[t]`)
S_Q, S_K, S_V, S_ATTN, S_Y, S_GATE, S_UP = range(7)
SHARED_ROWS = 7
P_H, P_XS16, P_XS32, P_KBITS, P_XD, P_TILE_XP, P_TILE_XD, P_TILE_XS32, P_TILE_XS16 = range(9)  # P_TILE_*: tiles' x
PRIVATE_ROWS = 9

GELU_C = np.float32(np.sqrt(2.0 / np.pi))


@njit(cache=True, nogil=True)
def decode_step(t, work, codes, scales, mats, vecs, layers, attn_scales, dims, eps, rope_cs, k_pool, v_pool,
                attended, attended_pos, runs, pos_at, positions, slots, x, shared, private, private_q, attn_scratch,
                logits, last_q, capture_at, captured, trace):
    """Thread t's part: the rows of x (float32 [n_rows, n_embd], embedded tokens, shared) through every layer. Row r
    is the token at positions[r]: its K/V go into pool slot slots[r] of each layer, it attends over the pool slots
    attended[runs[r, 0]:runs[r, 1]] (as it sees them, at positions attended_pos[pos_at[r]:...], in the order given:
    the slots' own, or a draft tree node's view of its block); the logits of the last
    logits.shape[0] rows go into `logits`, the post-RoPE q of every row into last_q [n_layer, n_rows, n_head, hd],
    and where capture_at[layer] = i >= 0 the layer's output rows into captured[i] ([n_capture, n_rows, n_embd]).
    A row's numbers are a function of its own token, position and slots: the same in any batch of rows, whichever
    thread computes what. Any number of threads may call this at once with the same arguments but t (a distinct
    row of private/private_q/attn_scratch), `work` as work_size gives it: zeros but work[0] = the threads.
    trace (profiles; int64 [0, 1, 3]: none): [threads, step_phases + 1, 3], for each phase the cycle counts
    (sync.cycles) when thread t came to its end and when it went on, and the op (OP_*); the last row: when t began
    and ended."""
    if trace.shape[0]:
        trace[t, trace.shape[1] - 1, 0] = cycles()
    n_head, n_kv, hd = dims[N_HEAD], dims[N_KV_HEAD], dims[HEAD_DIM]
    d, n_rows = dims[N_EMBD], x.shape[0]
    group = n_head // n_kv
    mine, xq = private[t], private_q[t]
    tiles = dims[TILES] != 0 and n_rows >= TILE_TOKENS
    h = _rows(mine[P_H], n_rows, d)
    q_all, k_all = _rows(shared[S_Q], n_rows, n_head * hd), _rows(shared[S_K], n_rows, n_kv * hd)
    v_all, attn = _rows(shared[S_V], n_rows, n_kv * hd), _rows(shared[S_ATTN], n_rows, n_head * hd)
    y = _rows(shared[S_Y], n_rows, d)
    phase = 0
    for layer in range(layers.shape[0]):
        lt = layers[layer]
        # q, k, v of the attention norm of x
        n = _chunks(mats, lt[WQ]) + _chunks(mats, lt[WK]) + _chunks(mats, lt[WV])
        if _open(work, phase, n):
            _norm_and_prepare(x, vecs, lt[ATTN_NORM], h, mine, xq, eps, tiles)
            c = _claim(work, phase, n, t)
            while c < n:
                j = 0  # which of q, k, v chunk c belongs to
                while c >= _chunks(mats, lt[WQ + j]):
                    c -= _chunks(mats, lt[WQ + j])
                    j += 1
                m = lt[WQ + j]
                _product(codes, scales, mats, m, h, mine, xq, _rows(shared[S_Q + j], n_rows, mats[m, ROWS]),
                         vecs, lt[Q_BIAS + j], c * CHUNK_ROWS, tiles)
                c = _done_claim(work, phase, n, t)
        phase = _wait(work, phase, n, OP_QKV, trace, t)
        # per row and kv head: k norm, RoPE, K and V into the pool, the kv head's q heads' norm and RoPE; then attention
        # by rows sharing a run of slots and kv head. Where one task a kv head takes every row (a row alone, a verify
        # block or tree of up to ATTENTION_ROWS), each task does its rows' K/V first (no other task reads them): one
        # phase, not two
        n = _attention_tasks(runs, n_kv, -1)[0]
        one_run = n == n_kv
        if not one_run:
            c = _claim(work, phase, n_rows * n_kv, t)
            while c < n_rows * n_kv:
                _new_kv(layer, c // n_kv, c % n_kv, lt, k_all, v_all, q_all, k_pool, v_pool, slots, rope_cs, vecs,
                        dims, eps, last_q, mine[P_KBITS])
                c = _done_claim(work, phase, n_rows * n_kv, t)
            phase = _wait(work, phase, n_rows * n_kv, OP_KV, trace, t)
        c = _claim(work, phase, n, t)
        while c < n:
            r0, r1, kvh = _attention_tasks(runs, n_kv, c)
            if one_run:
                for r in range(r0, r1):
                    _new_kv(layer, r, kvh, lt, k_all, v_all, q_all, k_pool, v_pool, slots, rope_cs, vecs, dims, eps,
                            last_q, mine[P_KBITS])
            _attend_group(q_all, r0, r1, kvh, group, k_pool[layer], v_pool[layer], attended, runs, attended_pos,
                          pos_at, positions, lt[WINDOW], attn_scales[layer], attn_scratch[t], attn)
            c = _done_claim(work, phase, n, t)
        phase = _wait(work, phase, n, OP_ATTENTION, trace, t)
        # x += [post-norm of] W_o attn
        phase = _residual_product(work, phase, codes, scales, mats, lt[WO], attn, mine, xq, x, y, vecs,
                                  lt[POST_ATTN_NORM], eps, OP_WO, trace, t, tiles)
        # act(W_gate h) * (W_up h), h the FFN norm of x
        n_ff = mats[lt[WGATE], ROWS]
        gate, up = _rows(shared[S_GATE], n_rows, n_ff), _rows(shared[S_UP], n_rows, n_ff)
        n = _chunks(mats, lt[WGATE])
        if _open(work, phase, n):
            _norm_and_prepare(x, vecs, lt[FFN_NORM], h, mine, xq, eps, tiles)
            c = _claim(work, phase, n, t)
            while c < n:
                _product(codes, scales, mats, lt[WGATE], h, mine, xq, gate, vecs, -1, c * CHUNK_ROWS, tiles)
                _product(codes, scales, mats, lt[WUP], h, mine, xq, up, vecs, -1, c * CHUNK_ROWS, tiles)
                for r in range(n_rows):
                    _gated_act(gate[r], up[r], c * CHUNK_ROWS, min((c + 1) * CHUNK_ROWS, n_ff), dims[GELU])
                c = _done_claim(work, phase, n, t)
        phase = _wait(work, phase, n, OP_GATE_UP, trace, t)
        # x += [post-norm of] W_down of that
        phase = _residual_product(work, phase, codes, scales, mats, lt[WDOWN], gate, mine, xq, x, y, vecs,
                                  lt[POST_FFN_NORM], eps, OP_DOWN, trace, t, tiles)
        if capture_at[layer] >= 0:  # the layer's output, copied before the next layer's residual changes x
            c = _claim(work, phase, n_rows, t)
            while c < n_rows:
                captured[capture_at[layer], c, :] = x[c]
                c = _done_claim(work, phase, n_rows, t)
            phase = _wait(work, phase, n_rows, OP_CAPTURE, trace, t)
    # the logits of the last rows
    n = _chunks(mats, dims[OUTPUT])
    n_out = logits.shape[0]
    if _open(work, phase, n):
        h_out = _rows(mine[P_H], n_out, d)
        for r in range(n_out):
            _rmsnorm(x[n_rows - n_out + r], vecs, dims[OUTPUT_NORM], h_out[r], eps)
        tiles = dims[TILES] != 0 and n_out >= TILE_TOKENS
        _prepare(h_out, mine, xq, tiles)
        c = _claim(work, phase, n, t)
        while c < n:
            _product(codes, scales, mats, dims[OUTPUT], h_out, mine, xq, logits, vecs, -1, c * CHUNK_ROWS, tiles)
            c = _done_claim(work, phase, n, t)
    _wait(work, phase, n, OP_OUTPUT, trace, t)
    if trace.shape[0]:
        trace[t, trace.shape[1] - 1, 1] = cycles()


@njit(cache=True, nogil=True)
def embed_rows(codes, scales, mats, m, tokens, mult, out):
    """out[i] = row tokens[i] of matrix m in the arenas (the token embeddings) times mult, as quants.dequantize_rows
    expands it: per block scale * code + bias (a type without biases stores none: its -0.0 adds nothing)."""
    rows, cols, at = mats[m, ROWS], mats[m, COLS], mats[m, CODES_AT]
    if mats[m, KIND] == KIND_F32:
        w = codes[at:at + rows * cols * 4].view(np.float32).reshape(rows, cols)
        for i in range(tokens.shape[0]):
            out[i] = w[tokens[i]]
    else:
        groups, nb, q4 = (rows + GROUP_ROWS - 1) // GROUP_ROWS, mats[m, BLOCKS], mats[m, KIND] == KIND_Q4
        group_bytes = mats[m, CODE_COLS] * GROUP_ROWS
        if mats[m, HALVES]:
            _embed_grouped(codes[at:], _factors(scales, mats[m, SCALE_AT], groups, nb, True, np.uint16),
                           _factors(scales, mats[m, BIAS_AT], groups, nb, mats[m, BIAS_AT] >= 0, np.uint16),
                           group_bytes, q4, tokens, out)
        else:
            _embed_grouped(codes[at:], _factors(scales, mats[m, SCALE_AT], groups, nb, True, np.float32),
                           _factors(scales, mats[m, BIAS_AT], groups, nb, mats[m, BIAS_AT] >= 0, np.float32),
                           group_bytes, q4, tokens, out)
    if mult != 1:
        for i in range(tokens.shape[0]):
            for j in range(cols):
                out[i, j] *= mult


@njit(cache=True, nogil=True)
def _embed_grouped(codes, scale, bias, group_bytes, q4, tokens, out):
    """Rows of a grouped matrix (quants.group_rows: element pair p of a group's row j at p * GROUP_ROWS + j)."""
    cols = out.shape[1]
    nb = scale.shape[1] // GROUP_ROWS
    block = cols // nb
    for i in range(tokens.shape[0]):
        g, j = tokens[i] // GROUP_ROWS, tokens[i] % GROUP_ROWS
        base = g * group_bytes
        for e in range(cols):
            p = e // 2
            if q4:
                byte = codes[base + p * GROUP_ROWS + j]
                code = np.float32(byte & 15 if e % 2 == 0 else byte >> 4)
            else:
                code = np.float32(np.int8(codes[base + 2 * (p * GROUP_ROWS + j) + e % 2]))
            b = (e // block) * GROUP_ROWS + j
            v = float32_of(scale[g, b]) * code
            out[i, e] = v + float32_of(bias[g, b]) if bias.shape[1] else v


def step_phases(n_layer: int) -> int:
    """Phases of a decode step (see decode_step): 9 a layer at most (two of them post-norms, one a capture), then the
    output."""
    return 9 * n_layer + 1


# Work of a phase is handed out in chunks (rows of a product, attention's tasks): each thread has a region, its
# share of the phase's chunks in order, and takes them one by one; a thread whose region is done takes the next chunks
# left in the other threads' regions. So each thread mostly streams one contiguous range of a matrix (its prefetches
# run ahead into its own next chunk), and a thread that the OS has descheduled between two chunks holds nobody up:
# the others take the rest of its region. A thread waits only for chunks in flight at the end of a phase.
# `work` (int64, zeros but work[0] = the number of threads): per phase, each thread's count of chunks taken from its
# region, then the count of chunks finished, each counter on a cache line of its own (no false sharing).
LINE = 8  # int64 a cache line


def work_size(n_threads: int, n_layer: int) -> int:
    """The length of a step's `work` array."""
    return (1 + step_phases(n_layer) * (n_threads + 1)) * LINE


@njit(cache=True, nogil=True)
def _counter(work, phase, slot):
    """Index in `work` of the phase's counter `slot`: a thread's region, or (slot = threads) the finished chunks."""
    return (1 + phase * (work[0] + 1) + slot) * LINE


@njit(cache=True, nogil=True)
def _chunks(mats, m):
    return (mats[m, ROWS] + CHUNK_ROWS - 1) // CHUNK_ROWS


@njit(cache=True, nogil=True)
def _open(work, phase, n):
    """Whether chunks of the phase's n may be left (else the inputs need not be prepared)."""
    nt = work[0]
    for u in range(nt):
        if atomic_load(work, _counter(work, phase, u)) < (u + 1) * n // nt - u * n // nt:
            return True
    return False


@njit(cache=True, nogil=True)
def _claim(work, phase, n, t):
    """Thread t's next chunk of the phase's n: its own region's next, else the next left in another's; n: none."""
    nt = work[0]
    for i in range(nt):
        u = (t + i) % nt
        lo, hi = u * n // nt, (u + 1) * n // nt
        if atomic_load(work, _counter(work, phase, u)) < hi - lo:
            c = atomic_add(work, _counter(work, phase, u), 1)
            if c < hi - lo:
                return lo + c
    return n


@njit(cache=True, nogil=True)
def _done_claim(work, phase, n, t):
    """Count the chunk thread t finished, take its next."""
    atomic_add(work, _counter(work, phase, work[0]), 1)
    return _claim(work, phase, n, t)


@njit(cache=True, nogil=True)
def _wait(work, phase, n, op, trace, t):
    """Wait until the phase's n chunks are finished; the next phase's number. A trace (profiles) keeps when thread t
    came to wait and when it went on, and the op."""
    if trace.shape[0]:
        trace[t, phase, 0] = cycles()
    wait_at_least(work, _counter(work, phase, work[0]), n)
    if trace.shape[0]:
        trace[t, phase, 1] = cycles()
        trace[t, phase, 2] = op
    return phase + 1


@njit(cache=True, nogil=True)
def _rows(buf, n, cols):
    """The first n * cols floats (or codes) of a scratch row, as an [n, cols] array."""
    return buf[:n * cols].reshape(n, cols)


@njit(cache=True, nogil=True)
def _add_rows(x, y, r0):
    """x[:, r0:r0 + CHUNK_ROWS] += y[:, r0:...] (clipped to the width)."""
    for t in range(x.shape[0]):
        for r in range(r0, min(r0 + CHUNK_ROWS, x.shape[1])):
            x[t, r] += y[t, r]


@njit(cache=True, nogil=True)
def _norm_and_prepare(x, vecs, norm_at, h, mine, xq, eps, tiles):
    """h = each row of x RMS-normed by the vector at vecs[norm_at:], prepared for this thread's products."""
    for r in range(x.shape[0]):
        _rmsnorm(x[r], vecs, norm_at, h[r], eps)
    _prepare(h, mine, xq, tiles)


@njit(cache=True, nogil=True)
def _residual_product(work, phase, codes, scales, mats, m, inputs, mine, xq, x, y, vecs, post_norm, eps, op, trace,
                      t, tiles):
    """x += [post-norm of] W_m inputs, W_m's chunks of rows claimed by the threads; returns the phase after it."""
    n = _chunks(mats, m)
    if _open(work, phase, n):
        _prepare(inputs, mine, xq, tiles)
        c = _claim(work, phase, n, t)
        while c < n:
            _product(codes, scales, mats, m, inputs, mine, xq, y, vecs, -1, c * CHUNK_ROWS, tiles)
            if post_norm < 0:
                _add_rows(x, y, c * CHUNK_ROWS)
            c = _done_claim(work, phase, n, t)
    phase = _wait(work, phase, n, op, trace, t)
    return _post_norm_add(work, phase, x, y, vecs, post_norm, eps, trace, t)


@njit(cache=True, nogil=True)
def _post_norm_add(work, phase, x, y, vecs, norm_at, eps, trace, t):
    """x[r] += rmsnorm(y[r]) for every row r, by chunks of columns once y is whole (Gemma 3's post-norms); nothing
    without a norm."""
    if norm_at < 0:
        return phase
    d = x.shape[1]
    n = (d + CHUNK_ROWS - 1) // CHUNK_ROWS
    c = _claim(work, phase, n, t)
    while c < n:
        for row in range(x.shape[0]):
            ss = 0.0
            for i in range(d):
                ss += np.float64(y[row, i]) * np.float64(y[row, i])
            inv = np.float32(1.0 / np.sqrt(np.float32(ss / d) + eps))
            for r in range(c * CHUNK_ROWS, min((c + 1) * CHUNK_ROWS, d)):
                x[row, r] += y[row, r] * inv * vecs[norm_at + r]
        c = _done_claim(work, phase, n, t)
    return _wait(work, phase, n, OP_POST_NORM, trace, t)


@njit(cache=True, nogil=True)
def _rmsnorm(x, vecs, w_at, out, eps):
    """out = x / rms(x) * w, w the vector at vecs[w_at:]; out may be x."""
    n = x.shape[0]
    ss = 0.0
    for i in range(n):
        ss += np.float64(x[i]) * np.float64(x[i])
    inv = np.float32(1.0 / np.sqrt(np.float32(ss / n) + eps))
    for i in range(n):
        out[i] = x[i] * inv * vecs[w_at + i]


@njit(cache=True, nogil=True)
def _prepare(xs, mine, xq, tiles):
    """What the row kernels need of inputs xs [n, cols] besides xs, per row: 16- and 32-block sums, and the row as
    int16 codes (in xq) with their per-block scales (mine[P_XD]); with `tiles`, what the tile kernels need instead
    (matvec.prepare_tiles: the same codes, scales and sums, by groups of TILE_TOKENS rows)."""
    n, cols = xs.shape
    if tiles:
        prepare_tiles(xs, 0, -(-n // TILE_TOKENS), *_tile_x(mine, n, cols))
        return
    n_blocks = cols // X_BLOCK
    xd = _rows(mine[P_XD], n, n_blocks)
    for t in range(n):
        quantize_x16(xs[t], xq[t * cols:(t + 1) * cols], xd[t])
    if cols % 16 == 0:
        block_sums(xs, 16, _rows(mine[P_XS16], n, cols // 16))
    block_sums(xs, 32, _rows(mine[P_XS32], n, n_blocks))


@njit(cache=True, nogil=True)
def _tile_x(mine, n, cols):
    """The tile kernels' x of n rows of `cols` in this thread's scratch: xp, xd, xsum32, xsum16 (prepare_tiles)."""
    groups = -(-n // TILE_TOKENS)
    return (mine[P_TILE_XP][:groups * cols // 2 * TILE_TOKENS].view(np.int32).reshape(groups, -1),
            mine[P_TILE_XD][:groups * cols // X_BLOCK * TILE_TOKENS].reshape(groups, -1),
            mine[P_TILE_XS32][:groups * cols // 32 * TILE_TOKENS].reshape(groups, -1),
            mine[P_TILE_XS16][:groups * cols // 16 * TILE_TOKENS].reshape(groups, -1))


@njit(cache=True, nogil=True)
def _product(codes, scales, mats, m, xs, mine, xq, out, vecs, bias_at, r0, tiles):
    """Rows r0..r0 + CHUNK_ROWS (or the last) of out = xs W_m^T, xs [n, cols] and out [n, rows] (+ the bias at
    vecs[bias_at:] where bias_at >= 0); with `tiles` (x prepared for them), through the tile kernels: each row's
    numbers are the row kernels', bit for bit (intdot: lane by lane the same arithmetic)."""
    rows, cols = mats[m, ROWS], mats[m, COLS]
    n = xs.shape[0]
    r1 = min(r0 + CHUNK_ROWS, rows)
    at, cc = mats[m, CODES_AT], mats[m, CODE_COLS]
    kind = mats[m, KIND]
    if kind == KIND_F32:
        w = codes[at:at + rows * cols * 4].view(np.float32).reshape(rows, cols)
        _f32_rows(w, xs, out, r0, r1)
    else:  # grouped by GROUP_ROWS rows (quants.group_rows)
        nb = mats[m, BLOCKS]
        groups = (rows + GROUP_ROWS - 1) // GROUP_ROWS
        with_bias = mats[m, BIAS_AT] >= 0  # a type without a bias stores none
        by16 = cols // nb == 16
        args = (INT_Q4 if kind == KIND_Q4 else INT_Q8_16 if by16 else INT_Q8, with_bias,
                codes[at:at + groups * cc * GROUP_ROWS].reshape(groups, cc * GROUP_ROWS))
        x = (xs, mine, xq, by16, out, r0, r1, tiles)
        if mats[m, HALVES]:
            _grouped_product(*args, _factors(scales, mats[m, SCALE_AT], groups, nb, True, np.uint16),
                             _factors(scales, mats[m, BIAS_AT], groups, nb, with_bias, np.uint16), *x)
        else:
            _grouped_product(*args, _factors(scales, mats[m, SCALE_AT], groups, nb, True, np.float32),
                             _factors(scales, mats[m, BIAS_AT], groups, nb, with_bias, np.float32), *x)
    if bias_at >= 0:
        for t in range(n):
            for r in range(r0, r1):
                out[t, r] += vecs[bias_at + r]


@njit(cache=True, nogil=True)
def _grouped_product(layout, with_bias, codes, scale, bias, xs, mine, xq, by16, out, r0, r1, tiles):
    """Rows r0..r1 of out = xs W^T, W grouped (group_rows' form), x as _prepare left it: the row kernels, or the tile
    kernels with `tiles`."""
    n, cols = xs.shape
    if tiles:
        xp, xd, xsum32, xsum16 = _tile_x(mine, n, cols)
        _tile_rows(layout, True, codes, scale, bias, with_bias, xp, xd, xsum16 if by16 else xsum32, out, r0, r1)
    else:
        group_rows(layout, with_bias, codes, scale, bias, xq[:n * cols].view(np.int32).reshape(n, cols // 2),
                   _rows(mine[P_XD], n, cols // X_BLOCK), _rows(mine[P_XS16 if by16 else P_XS32], n,
                                                                 scale.shape[1] // GROUP_ROWS), out, r0, r1)


@njit(cache=True, nogil=True)
def _factors(scales, at, groups, nb, present, dtype):
    """A grouped matrix's scales (or biases) in the arena from scales[at], as dtype (float32, or float16 bits)
    [groups, nb * GROUP_ROWS]; absent: [groups, 0]."""
    n = groups * nb * GROUP_ROWS if present else 0
    return scales[max(at, 0):].view(dtype)[:n].reshape(groups, n // groups)


@njit(cache=True, nogil=True)
def _gated_act(gate, up, r0, r1, gelu):
    """gate[r] = act(gate[r]) * up[r] for r in r0..r1 (SiLU, or GELU's tanh form)."""
    for r in range(r0, r1):
        g = gate[r]
        if gelu:
            inner = GELU_C * (g + np.float32(0.044715) * g * g * g)
            gate[r] = np.float32(0.5) * g * (np.float32(1.0) + np.tanh(inner)) * up[r]
        else:
            gate[r] = g / (np.float32(1.0) + np.exp(-g)) * up[r]


@njit(cache=True, nogil=True)
def _rope(x, cs, rope_dim, neox):
    """Rotate one head in place; cs float32 [2, rope_dim // 2]: cos and sin of each pair's angle."""
    half = rope_dim // 2
    for i in range(half):
        c, s = cs[0, i], cs[1, i]
        if neox:
            a, b = x[i], x[i + half]
            x[i] = a * c - b * s
            x[i + half] = a * s + b * c
        else:
            a, b = x[2 * i], x[2 * i + 1]
            x[2 * i] = a * c - b * s
            x[2 * i + 1] = a * s + b * c


@njit(cache=True, nogil=True)
def _new_kv(layer, r, kvh, lt, k_all, v_all, q_all, k_pool, v_pool, slots, rope_cs, vecs, dims, eps, last_q, kbits):
    """Row r's kv head kvh: k normed and rotated, K and V into the pool at slots[r]; its q heads normed and rotated
    (and kept in last_q)."""
    hd, group = dims[HEAD_DIM], dims[N_HEAD] // dims[N_KV_HEAD]
    k = k_all[r, kvh * hd:(kvh + 1) * hd]
    if lt[K_NORM] >= 0:
        _rmsnorm(k, vecs, lt[K_NORM], k, eps)
    _rope(k, rope_cs[r, lt[ROPE]], dims[ROPE_DIM], dims[NEOX])
    _store_kv(k, k_pool[layer, slots[r], kvh], kbits)
    _store_kv(v_all[r, kvh * hd:(kvh + 1) * hd], v_pool[layer, slots[r], kvh], kbits)
    for head in range(kvh * group, (kvh + 1) * group):
        q = q_all[r, head * hd:(head + 1) * hd]
        if lt[Q_NORM] >= 0:
            _rmsnorm(q, vecs, lt[Q_NORM], q, eps)
        _rope(q, rope_cs[r, lt[ROPE]], dims[ROPE_DIM], dims[NEOX])
        last_q[layer, r, head, :] = q


@njit(cache=True, nogil=True)
def _attention_tasks(runs, n_kv, c):
    """Attention task c: (first row, row past the last, kv head) of at most ATTENTION_ROWS rows sharing a run of slots
    (consecutive rows with the same run: they read the same K and V); c < 0: (the number of tasks, 0, 0)."""
    n_rows = runs.shape[0]
    r0, total = 0, 0
    while r0 < n_rows:
        r1 = r0 + 1
        while r1 < min(n_rows, r0 + ATTENTION_ROWS) and runs[r1, 0] == runs[r0, 0] and runs[r1, 1] == runs[r0, 1]:
            r1 += 1
        if 0 <= c < n_kv:
            return r0, r1, c
        c -= n_kv
        total += n_kv
        r0 = r1
    return total, 0, 0


@njit(cache=True, nogil=True)
def _attend_group(q_all, r0, r1, kvh, group, k_pool, v_pool, attended, runs, attended_pos, pos_at, positions,
                  window, scale, scratch, out):
    """out[r, head] = softmax(scale q.k) v for rows r0..r1 (one run of slots) and the q heads of kv head kvh, over the
    run's slots visible to each row (their positions as it sees them at attended_pos[pos_at[r]:], DESIGN §4's rule).
    The scores and the sums with V are kv_tiles' (16 slots a vector, each K and V row read once for every q head of
    the row); each is summed in order, as a scalar loop would. Slots before the first or after the last that any row
    sees are left out (a table's last block past the head, a sliding window's past): they change nothing. scratch:
    this thread's, float32 [(r1 - r0) * group * (run + LANES + 1)]."""
    n_kv, hd = k_pool.shape[1], k_pool.shape[2]
    first, stop = runs[r0, 1] - runs[r0, 0], 0  # the slots of the run any row sees: first..stop
    for r in range(r0, r1):
        seen = attended_pos[pos_at[r]:pos_at[r] + runs[r0, 1] - runs[r0, 0]]
        lo = positions[r] - window if window > 0 else -1
        s = 0
        while s < first and not lo < seen[s] <= positions[r]:
            s += 1
        first = s
        s = seen.shape[0]
        while s > stop and not lo < seen[s - 1] <= positions[r]:
            s -= 1
        stop = s
    if stop <= first:
        first = stop = 0
    at, n = runs[r0, 0] + first, stop - first
    padded = (n + LANES - 1) // LANES * LANES  # key_scores fills whole vectors
    heads = (r1 - r0) * group  # (row, q head) i: row r0 + i // group, head kvh * group + i % group
    totals = scratch[:heads]
    weights = scratch[heads:heads + heads * padded]  # scores, then e^(score - max) (-1: out of view)
    k_flat, v_flat, q_flat = k_pool.reshape(-1), v_pool.reshape(-1), q_all.reshape(-1)
    for r in range(r0, r1):
        key_scores(k_flat, attended, at, n, n_kv * hd, kvh * hd, q_flat, r * q_all.shape[1] + kvh * group * hd, group,
                   hd, weights, (r - r0) * group * padded, padded)
    for i in range(heads):
        r = r0 + i // group
        seen = attended_pos[pos_at[r] + first:pos_at[r] + stop]
        totals[i] = _softmax_weights(weights, i * padded, n, seen, positions[r], window, scale)
    for r in range(r0, r1):
        value_sums(v_flat, attended, at, n, n_kv * hd, kvh * hd, weights, (r - r0) * group * padded, padded, group, hd,
                   out[r], kvh * group * hd, hd)
    for i in range(heads):
        head = kvh * group + i % group
        acc = out[r0 + i // group, head * hd:(head + 1) * hd]
        for j in range(hd):
            acc[j] /= totals[i]


@njit(cache=True, nogil=True)
def _softmax_weights(weights, at, n, slot_pos, pos, window, scale):
    """weights[at:at + n] (q.k of each slot, whose positions are slot_pos) -> e^(scale q.k - m) over the slots visible
    at `pos` (DESIGN §4; kv_tiles.exp_weights), -1 where not, m the largest visible scaled score; returns their sum,
    taken in order. weights holds the lanes up to n rounded up to 16."""
    lo = pos - window if window > 0 else -1
    scores = weights[at:at + n]
    m = np.float32(-np.inf)
    for s in range(n):
        p = slot_pos[s]
        if p < 0 or p > pos or p <= lo:
            scores[s] = -np.inf
            continue
        scores[s] *= scale
        m = max(m, scores[s])
    exp_weights(weights, at, n, m)
    total = np.float32(0.0)
    for s in range(n):
        if scores[s] >= 0:
            total += scores[s]
    return total


def _store_kv(values, dst, scratch):
    """dst (one pool row: float32, or float16 as uint16 bits) = values (float32 [hd])."""


@overload(_store_kv, jit_options={"cache": True, "nogil": True})
def _store_kv_impl(values, dst, scratch):
    if dst.dtype == types.uint16:
        def store(values, dst, scratch):
            n = values.shape[0]
            scratch[:n] = values
            round_to_f16(scratch[:n].view(np.uint32), dst)
        return store

    def store32(values, dst, scratch):
        dst[:] = values
    return store32


@njit(cache=True, nogil=True)
def round_to_f16(bits, out):
    """out (uint16) = float16 bits of the float32 values whose bits are `bits`, rounded to nearest, ties to even
    (what numpy's astype(float16) does; overflow to inf, NaN kept a NaN)."""
    for i in range(bits.shape[0]):
        b = np.int64(bits[i])
        sign = (b >> 16) & 0x8000
        e = ((b >> 23) & 0xFF) - 112  # f16 exponent field
        m = b & 0x7FFFFF
        if ((b >> 23) & 0xFF) == 0xFF:  # inf or NaN
            out[i] = sign | 0x7C00 | (0x200 if m else 0)
            continue
        if e >= 31:
            out[i] = sign | 0x7C00
            continue
        if e <= 0:  # a subnormal f16 (or zero)
            if e < -10:
                out[i] = sign
                continue
            m |= 0x800000
            shift = 14 - e
            half = m >> shift
            rem = m & ((1 << shift) - 1)
            mid = 1 << (shift - 1)
            if rem > mid or (rem == mid and half & 1):
                half += 1
            out[i] = sign | half
            continue
        half = (e << 10) | (m >> 13)
        rem = m & 0x1FFF
        if rem > 0x1000 or (rem == 0x1000 and half & 1):
            half += 1  # a carry into the exponent is right too, up to inf
        out[i] = sign | half
