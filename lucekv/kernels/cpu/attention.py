"""Attention over the KV slot pool on the CPU, position-exact in slot space (DESIGN §4).

A slot s is visible to a query at position q iff 0 <= slot_pos[s] <= q, and for a sliding-window layer
also slot_pos[s] > q - window. Free slots hold slot_pos = -1 and are never read as keys.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

QUERY_CHUNK = 64  # queries a pass of attend_batch: 64 queries x 7 heads x 4096 slots of scores is 7 MB


def visible(slot_pos: np.ndarray, positions: np.ndarray, window: int) -> np.ndarray:
    """Mask [n_queries, n_slots]: which slots each query position may attend to. slot_pos [n_slots], or per query
    [n_queries, n_slots] (a draft tree's nodes, each seeing its own ancestors in the block)."""
    sp = slot_pos if slot_pos.ndim == 2 else slot_pos[None, :]
    q = positions[:, None]
    mask = (sp >= 0) & (sp <= q)
    if window > 0:
        mask &= sp > q - window
    return mask


@njit(parallel=True, cache=True)
def _decode_rows(q, k, v, slot_pos, offsets, positions, window, scale, out):
    n, n_head, head_dim = q.shape
    group = n_head // k.shape[1]
    for task in prange(n * n_head):
        t = task // n_head
        h = task % n_head
        kvh = h // group
        pos = positions[t]
        lo = pos - window if window > 0 else -1
        s0 = offsets[t]
        scores = np.empty(offsets[t + 1] - s0, dtype=np.float32)
        m = np.float32(-np.inf)
        for i in range(scores.shape[0]):
            p = slot_pos[s0 + i]
            if p < 0 or p > pos or p <= lo:
                scores[i] = -np.inf
                continue
            acc = np.float32(0.0)
            for j in range(head_dim):
                acc += q[t, h, j] * k[s0 + i, kvh, j]
            acc *= scale
            scores[i] = acc
            m = max(m, acc)
        total = np.float32(0.0)
        for j in range(head_dim):
            out[t, h, j] = 0.0
        for i in range(scores.shape[0]):
            if scores[i] == -np.inf:
                continue
            e = np.float32(np.exp(scores[i] - m))
            total += e
            for j in range(head_dim):
                out[t, h, j] += e * v[s0 + i, kvh, j]
        for j in range(head_dim):
            out[t, h, j] /= total


def attend_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, slot_pos: np.ndarray, offsets: np.ndarray,
                positions: np.ndarray, window: int, scale: float) -> np.ndarray:
    """Queries [n, n_head, head_dim], each over its own run of slots: query t reads rows offsets[t] .. offsets[t+1]
    - 1 of k, v [slots, n_kv_head, head_dim] (float32: a sequence's slots gathered in logical order) and their
    positions `slot_pos`. Each query's result is a sequential loop over its own slots: the same whatever else the
    batch holds."""
    out = np.empty(q.shape, dtype=np.float32)
    _decode_rows(np.ascontiguousarray(q, np.float32), k, v, slot_pos, offsets, positions, window, np.float32(scale),
                 out)
    return out


def attend_batch(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, slot_pos: np.ndarray,
                 n_slots: int, positions: np.ndarray, window: int, scale: float) -> np.ndarray:
    """Many queries [n, n_head, head_dim] (prefill) with BLAS matmuls, grouped by KV head, QUERY_CHUNK queries at a
    time over the slots any of them sees (a causal prompt's chunk: the slots up to its last token), so a chunk's
    scores stay in cache and the slots nobody in it sees cost nothing."""
    n, n_head, d = q.shape
    out = np.empty((n, n_head, d), np.float32)
    for q0 in range(0, n, QUERY_CHUNK):
        q1 = min(q0 + QUERY_CHUNK, n)
        sp = slot_pos[..., :n_slots] if slot_pos.ndim == 1 else slot_pos[q0:q1, :n_slots]
        mask = visible(sp, positions[q0:q1], window)
        seen = np.flatnonzero(mask.any(axis=0))
        if len(seen) == 0:  # no slot visible to any of them: softmax over nothing
            out[q0:q1] = np.nan
            continue
        cols = slice(seen[0], seen[-1] + 1) if seen[-1] - seen[0] + 1 == len(seen) else seen
        out[q0:q1] = _attend_chunk(q[q0:q1], k_pool[cols], v_pool[cols], mask[:, cols], scale)
    return out


def _attend_chunk(q: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray, mask: np.ndarray, scale: float
                  ) -> np.ndarray:
    """softmax(scale q k^T, masked) v for queries [n, n_head, d] over rows [m, n_kv, d] of K and V, mask [n, m]
    (every row visible to at least one query)."""
    n, n_head, d = q.shape
    m, n_kv = k_rows.shape[:2]
    g = n_head // n_kv
    k = k_rows.astype(np.float32).transpose(1, 2, 0)  # [kv, d, m]
    v = v_rows.astype(np.float32).transpose(1, 0, 2)  # [kv, m, d]
    qg = q.reshape(n, n_kv, g, d).transpose(1, 0, 2, 3).reshape(n_kv, n * g, d)
    scores = (qg @ k).reshape(n_kv, n, g, m)
    scores *= np.float32(scale)
    np.putmask(scores, np.broadcast_to(~mask[None, :, None, :], scores.shape), np.float32(-np.inf))
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores.reshape(n_kv, n * g, m) @ v  # [kv, n*g, d]
    return out.reshape(n_kv, n, g, d).transpose(1, 0, 2, 3).reshape(n, n_head, d)
