"""Rotary position embedding in place, "norm" (adjacent pairs) or "neox" (halves) layout.

Angles are position * inv_freq in float64, as on the CPU: in float32 a position near 10^5 would lose
about 0.01 rad. The per-base inverse frequencies come from the caller (one small device array per base).
"""

from __future__ import annotations

import math

import numpy as np

from lucekv.kernels.cuda._numba import blocks, cuda

THREADS = 128


def inv_freq(base: float, rope_dim: int) -> np.ndarray:
    """float64 [rope_dim // 2]: the rotation speed of each pair."""
    return 1.0 / base ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)


def rope(x, n_heads: int, head_dim: int, positions, inv, pos_scale: float, neox: bool, stream=0) -> None:
    """Rotate x [n, n_heads * head_dim] in place; positions int32 [n]; inv float64 [rope_dim // 2]."""
    n_pairs = x.shape[0] * n_heads * inv.shape[0]
    _rope[blocks(n_pairs, THREADS), THREADS, stream](x, n_heads, head_dim, positions, inv,
                                                     np.float64(pos_scale), neox)


@cuda.jit
def _rope(x, n_heads, head_dim, positions, inv, pos_scale, neox):
    half = inv.shape[0]
    p = cuda.grid(1)
    if p >= x.shape[0] * n_heads * half:
        return
    i = p % half
    h = (p // half) % n_heads
    t = p // (half * n_heads)
    ang = np.float64(positions[t]) / pos_scale * inv[i]
    c = np.float32(math.cos(ang))
    s = np.float32(math.sin(ang))
    base = h * head_dim
    a_at = base + i if neox else base + 2 * i
    b_at = a_at + half if neox else a_at + 1
    a = x[t, a_at]
    b = x[t, b_at]
    x[t, a_at] = a * c - b * s
    x[t, b_at] = a * s + b * c
