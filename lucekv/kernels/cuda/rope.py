"""Rotary position embedding, "norm" (adjacent pairs) or "neox" (halves) layout: device functions for the
kernels that rotate a step's q and k (kernels.cuda.attention.rope_and_store, and the one-token q/k/v product's
epilogue, kernels.cuda.packed.AttentionInputs).

Angles are position * inv_freq in float64, as on the CPU: in float32 a position near 10^5 would lose
about 0.01 rad. The inverse frequencies, any RoPE scaling folded in, come from the caller
(`ModelSpec.layer_rope`: one small device array per distinct set).
Weights may hold a neox model's q and k rows in "paired" order (`pair_order`): each rotary pair on adjacent
rows, as the norm style has them, so that one thread of a product's epilogue holds both values of a pair.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from lucekv.kernels.cuda._numba import cuda


class Rotary(NamedTuple):
    """How a layer rotates q and k, passed to kernels as one tuple argument."""

    inv: object  # float64 device array [rope_dim // 2]: the layer's radians per position of each pair
    neox: bool
    paired: bool  # q and k hold a neox model's pairs on adjacent columns (see `pair_order`)


def pair_order(n_heads: int, head_dim: int, rope_dim: int) -> np.ndarray:
    """The rows of n_heads neox heads in paired order: entry j is the natural row that goes to row j, so that
    pair i (dimensions i and i + rope_dim // 2) lands on rows 2i and 2i + 1; dimensions past rope_dim stay."""
    half = rope_dim // 2
    within = np.arange(head_dim)
    within[:rope_dim] = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    return (np.arange(n_heads)[:, None] * head_dim + within).reshape(-1)


@cuda.jit(device=True, inline=True)
def cos_sin(position, inv, i):
    """float32 cos and sin of pair i's angle at `position`."""
    ang = np.float64(position) * inv[i]
    return np.float32(math.cos(ang)), np.float32(math.sin(ang))


@cuda.jit(device=True, inline=True)
def pair_dims(i, half, neox):
    """The natural dimensions of rotary pair i: (i, i + half) in the neox style, (2i, 2i + 1) in the norm style."""
    return (i, i + half) if neox else (2 * i, 2 * i + 1)


@cuda.jit(device=True, inline=True)
def rotated(x, t, head_at, d, position, rope, norm):
    """Dimension d of the head at column head_at of x[t], rotated for `position` by `rope` (a Rotary; dimensions
    past the rotary ones, 2 * len(rope.inv), pass through); one thread per output value. norm: (weight [head_dim],
    inv, on): where on, the head is normalized first, x * inv * weight (a per-head RMSNorm, inv its 1 / rms; heads in
    natural order, not paired)."""
    neox = rope.neox
    half = rope.inv.shape[0]
    if d >= 2 * half:
        return _normalized(x, t, head_at, d, norm)
    i = d % half if neox else d // 2
    first = d == pair_dims(i, half, neox)[0]
    lo, hi = pair_dims(i, half, neox and not rope.paired)  # where x holds the pair
    c, s = cos_sin(position, rope.inv, i)
    a = _normalized(x, t, head_at, lo, norm)
    b = _normalized(x, t, head_at, hi, norm)
    return a * c - b * s if first else a * s + b * c


@cuda.jit(device=True, inline=True)
def _normalized(x, t, head_at, d, norm):
    w, inv, on = norm
    return x[t, head_at + d] * inv * w[d] if on else x[t, head_at + d]
