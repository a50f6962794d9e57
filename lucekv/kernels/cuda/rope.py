"""Rotary position embedding, "norm" (adjacent pairs) or "neox" (halves) layout: a device function for the
kernel that stores a step's K/V (kernels.cuda.attention.rope_and_store).

Angles are position * inv_freq in float64, as on the CPU: in float32 a position near 10^5 would lose
about 0.01 rad. The per-base inverse frequencies come from the caller (one small device array per base).
"""

from __future__ import annotations

import math

import numpy as np

from lucekv.kernels.cuda._numba import cuda


def inv_freq(base: float, rope_dim: int) -> np.ndarray:
    """float64 [rope_dim // 2]: the rotation speed of each pair."""
    return 1.0 / base ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)


@cuda.jit(device=True, inline=True)
def rotated(x, t, head_at, d, position, inv, pos_scale, neox):
    """Dimension d of the head at column head_at of x[t], rotated for `position` (dimensions past the
    rotary ones, 2 * len(inv), pass through). inv: float64 [rope_dim // 2]; one thread per output value."""
    half = inv.shape[0]
    if d >= 2 * half:
        return x[t, head_at + d]
    if neox:  # pairs (i, i + half)
        i = d % half
        first = d < half
        partner = d + half if first else d - half
    else:  # adjacent pairs (2i, 2i + 1)
        i = d // 2
        first = d % 2 == 0
        partner = d + 1 if first else d - 1
    ang = np.float64(position) / pos_scale * inv[i]
    c = np.float32(math.cos(ang))
    s = np.float32(math.sin(ang))
    a = x[t, head_at + d]
    b = x[t, head_at + partner]
    return a * c - b * s if first else b * s + a * c
