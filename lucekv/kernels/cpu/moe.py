"""Mixture-of-experts routing on the CPU: each token's top-k experts of a softmax router, and the tokens grouped by
expert so that a prefill runs each chosen expert's products once, over all of its tokens."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def route(logits, k, renormalise):
    """(ids int32 [n, k], weights float32 [n, k]) of router logits [n, n_expert]: the k most probable experts of each
    row's softmax, most probable first (the lower id first among equals), with their probabilities, divided by
    their sum where `renormalise`. The float32 softmax subtracts the row's maximum first."""
    n, n_expert = logits.shape
    ids = np.empty((n, k), np.int32)
    weights = np.empty((n, k), np.float32)
    probs = np.empty(n_expert, np.float32)
    taken = np.empty(n_expert, np.bool_)
    for t in range(n):
        top = logits[t, 0]
        for e in range(n_expert):
            top = max(top, logits[t, e])
        total = np.float32(0)
        for e in range(n_expert):
            probs[e] = np.exp(logits[t, e] - top)
            total += probs[e]
        taken[:] = False
        picked = np.float32(0)
        for r in range(k):
            best = -1
            for e in range(n_expert):
                if not taken[e] and (best < 0 or probs[e] > probs[best]):
                    best = e
            taken[best] = True
            ids[t, r] = best
            weights[t, r] = probs[best] / total
            picked += weights[t, r]
        if renormalise:
            for r in range(k):
                weights[t, r] /= picked
    return ids, weights


@njit(cache=True)
def group_by_expert(ids, n_expert):
    """(order, starts): the flat indices (token * k + rank) of `ids` [n, k] sorted by expert, stably, and where each
    expert's run begins (starts[e] .. starts[e + 1]): a counting sort."""
    flat = ids.reshape(-1)
    starts = np.zeros(n_expert + 1, np.int64)
    for i in range(flat.shape[0]):
        starts[flat[i] + 1] += 1
    for e in range(n_expert):
        starts[e + 1] += starts[e]
    order = np.empty(flat.shape[0], np.int64)
    filled = starts[:-1].copy()
    for i in range(flat.shape[0]):
        order[filled[flat[i]]] = i
        filled[flat[i]] += 1
    return order, starts
