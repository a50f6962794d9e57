"""RoPE as a GGUF asks for it: each rotary pair's speed with the model's scaling folded in, and the magnitude
some scalings give the rotated q and k. Pure numpy; both backends rotate with these numbers.

- linear: positions divided by `factor`, i.e. every speed divided by it.
- Llama 3.x (`rope_freqs.weight`): pair i's speed divided by its own factor, as llama.cpp's converter
  computes them from the model's llama3 rope_scaling (low/high frequency bands around the original context).
- YaRN (Qwen2.5 long context): pairs that turn many times within the original context keep their speed,
  slow ones are interpolated by `factor`, a linear ramp between the two by pair index (bounds from
  beta_fast / beta_slow rotations over the original context); cos and sin are scaled by 1 + 0.1 ln(factor).
- `rope.scaling.attn_factor` scales cos and sin whatever the scaling type (llama.cpp's `attn_factor`).

A magnitude m on cos and sin scales both q and k by m, so q.k by m^2: the backends fold it into the softmax
scale instead of multiplying every rotated value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

SCALING_KINDS = ("none", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    kind: Literal["none", "linear", "yarn"] = "none"
    factor: float = 1.0  # context extension factor (linear, yarn)
    original_context: int = 0  # yarn: the context length the model was trained at
    beta_fast: float = 32.0  # yarn: pairs making more rotations than this over the original context keep their speed
    beta_slow: float = 1.0  # yarn: pairs making fewer than this are fully interpolated
    attn_factor: float = 1.0  # multiplies cos and sin
    freq_factors: tuple[float, ...] | None = None  # Llama 3.x rope_freqs: divides each pair's speed


@dataclass(frozen=True)
class LayerRope:
    """How one layer rotates q and k, and the softmax scale that goes with it."""

    inv_freq: np.ndarray  # float64 [rope_dim // 2]: radians per position of each rotary pair
    attn_scale: float  # multiplies q.k before the softmax (1/sqrt(head_dim) times the squared magnitude)


def frequencies(base: float, rope_dim: int, scaling: RopeScaling) -> np.ndarray:
    """float64 [rope_dim // 2]: radians per position of each rotary pair."""
    inv = 1.0 / base ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    if scaling.freq_factors is not None:
        inv = inv / np.asarray(scaling.freq_factors, np.float64)
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "yarn":
        low, high = _yarn_band(base, rope_dim, scaling)
        keep = 1.0 - np.clip((np.arange(rope_dim // 2) - low) / max(high - low, 0.001), 0.0, 1.0)
        return inv / scaling.factor * (1.0 - keep) + inv * keep
    return inv


def magnitude(scaling: RopeScaling) -> float:
    """The factor on cos and sin."""
    yarn = 1.0 + 0.1 * math.log(scaling.factor) if scaling.kind == "yarn" and scaling.factor > 1.0 else 1.0
    return scaling.attn_factor * yarn


def _yarn_band(base: float, rope_dim: int, s: RopeScaling) -> tuple[float, float]:
    """The pair indices where YaRN's ramp from kept to interpolated speeds starts and ends."""

    def pair_turning(rotations: float) -> float:  # the pair that makes `rotations` turns over the original context
        return rope_dim * math.log(s.original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair_turning(s.beta_fast)), 0)
    high = min(math.ceil(pair_turning(s.beta_slow)), rope_dim - 1)
    return low, high
