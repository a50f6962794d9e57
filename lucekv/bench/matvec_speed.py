"""GPU timing of the decode matvec at Qwen3-8B shapes (Q4_K_M: q4 attention / FFN, Q6_K -> q8 16-blocks).

    python -m lucekv.bench.matvec_speed [--json OUT] [--runs 30]

Random codes, scales and biases, uploaded as DeviceMatrix directly. Each kernel is timed alone with CUDA
events after warm-up; the median of `runs` launches, each on the next of several copies of the matrix
(enough copies to exceed twice the L2 cache, at least 3), so no run reads weights another left in L2.
GB/s counts the bytes of codes + scales (+ biases, Q4_K only) read once per launch, for both kernels.
The kernel this one replaced (one warp per row, one 4-byte word per lane) is kept below as `_old_matvec`,
for comparison only; the outputs of both are compared too. The new kernel's one launch-shape knob,
matvec.WARPS_PER_SM_TARGET (rows per block follow from it), is swept as well.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lucekv.kernels.cuda import matvec as matvec_module
from lucekv.kernels.cuda._numba import WARP, blocks, cuda, warp_sum
from lucekv.kernels.cuda.matvec import matvec
from lucekv.kernels.cuda.packed import DeviceMatrix


@dataclass(frozen=True)
class Shape:
    name: str
    rows: int
    cols: int
    kind: str
    block: int
    per_token: int  # how many such products one Qwen3-8B decode step runs

    @property
    def has_bias(self) -> bool:
        return self.kind == "q4"


N_LAYER = 36
WARPS_PER_SM_SWEEP = (4, 8, 16, 32)
SHAPES = (
    Shape("attn q / o   4096x4096 q4", 4096, 4096, "q4", 32, 2 * N_LAYER),
    Shape("attn k / v   1024x4096 q4", 1024, 4096, "q4", 32, 2 * N_LAYER),
    Shape("ffn gate/up 12288x4096 q4", 12288, 4096, "q4", 32, 2 * N_LAYER),
    Shape("ffn down    4096x12288 q8/16", 4096, 12288, "q8", 16, N_LAYER),
    Shape("output    151936x4096 q8/16", 151936, 4096, "q8", 16, 1),
)


def random_matrix(rng: np.random.Generator, s: Shape) -> DeviceMatrix:
    code_bytes = s.rows * s.cols // (2 if s.kind == "q4" else 1)
    codes = np.frombuffer(rng.bytes(code_bytes), np.uint32).reshape(s.rows, -1)
    scale = (rng.random((s.rows, s.cols // s.block), np.float32) * 0.01).astype(np.float32)
    # Q4_K has biases (its mins), Q6_K none
    bias = (rng.random((s.rows, s.cols // s.block), np.float32) * -0.01).astype(np.float32) * s.has_bias
    return DeviceMatrix(s.kind, s.rows, s.cols, s.block.bit_length() - 1, cuda.to_device(codes),
                        cuda.to_device(scale), cuda.to_device(bias), s.has_bias)


def weight_bytes(w: DeviceMatrix) -> int:
    """The bytes the new kernel reads (the old one also reads the biases of types without any)."""
    return w.codes.nbytes + w.scale.nbytes + (w.bias.nbytes if w.has_bias else 0)


def time_kernel(fn, mats, xs, outs, runs: int) -> float:
    """Median µs of `runs` launches, cycling through the copies."""
    for i in range(len(mats)):  # warm-up: compiles, and touches every copy once
        fn(mats[i], xs[i], outs[i])
    cuda.synchronize()
    times = []
    for i in range(runs):
        k = i % len(mats)
        start, end = cuda.event(), cuda.event()
        start.record()
        fn(mats[k], xs[k], outs[k])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return float(np.median(times))


def bench_shape(s: Shape, rng: np.random.Generator, runs: int, l2_bytes: int) -> dict:
    first = random_matrix(rng, s)
    n_copies = max(3, math.ceil(2 * l2_bytes / weight_bytes(first)))
    mats = [first] + [random_matrix(rng, s) for _ in range(n_copies - 1)]
    xs = [cuda.to_device(rng.standard_normal((1, s.cols)).astype(np.float32)) for _ in mats]
    outs = [cuda.device_array((1, s.rows), np.float32) for _ in mats]
    default = matvec_module.WARPS_PER_SM_TARGET
    sweep = {}
    for target in WARPS_PER_SM_SWEEP:
        matvec_module.WARPS_PER_SM_TARGET = target
        sweep[target] = time_kernel(matvec, mats, xs, outs, runs)
    matvec_module.WARPS_PER_SM_TARGET = default
    new = time_kernel(matvec, mats, xs, outs, runs)
    got = outs[0].copy_to_host()
    old = time_kernel(_old_matvec, mats, xs, outs, runs)
    ref = outs[0].copy_to_host().astype(np.float64)
    gb = weight_bytes(first) / 1e9
    return {"shape": s.name, "rows": s.rows, "cols": s.cols, "kind": s.kind, "block": s.block,
            "copies": n_copies, "weight_bytes": weight_bytes(first), "per_token": s.per_token,
            "new_us": new, "new_gbps": gb / (new * 1e-6), "old_us": old, "old_gbps": gb / (old * 1e-6),
            "max_rel_diff_vs_old": float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))),
            "new_us_by_warps_per_sm": sweep}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--runs", type=int, default=30)
    a = ap.parse_args()
    dev = cuda.get_current_device()
    l2 = int(dev.L2_CACHE_SIZE)
    rng = np.random.default_rng(0)
    rows = []
    for s in SHAPES:
        rows.append(bench_shape(s, rng, a.runs, l2))
    result = {"device": dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name),
              "sm_count": dev.MULTIPROCESSOR_COUNT, "l2_bytes": l2, "runs": a.runs, "shapes": rows}
    for key in ("new", "old"):  # the matvec share of one Qwen3-8B decode step (k / v, down as listed)
        result[f"{key}_ms_per_token"] = sum(r[f"{key}_us"] * r["per_token"] for r in rows) / 1000
    print(f"{result['device']}: {result['sm_count']} SMs, L2 {l2 / 2 ** 20:.0f} MiB, median of {a.runs}")
    print(f"{'shape':32s} {'MB':>7s} {'new µs':>9s} {'GB/s':>7s} {'old µs':>9s} {'GB/s':>7s} "
          f"{'speedup':>7s} {'rel diff':>9s}")
    for r in rows:
        print(f"{r['shape']:32s} {r['weight_bytes'] / 1e6:7.1f} {r['new_us']:9.1f} {r['new_gbps']:7.0f} "
              f"{r['old_us']:9.1f} {r['old_gbps']:7.0f} {r['old_us'] / r['new_us']:7.2f} "
              f"{r['max_rel_diff_vs_old']:9.1e}")
    print(f"matvec ms per Qwen3-8B token: new {result['new_ms_per_token']:.2f}, "
          f"old {result['old_ms_per_token']:.2f}")
    print(f"new µs by WARPS_PER_SM_TARGET (default {matvec_module.WARPS_PER_SM_TARGET}):")
    for r in rows:
        print(f"  {r['shape']:32s} " + "  ".join(f"{k}: {v:8.1f}" for k, v in r["new_us_by_warps_per_sm"].items()))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2) + "\n")


# ---- the previous kernel, for comparison only -------------------------------------------------------------

_OLD_ROWS_PER_BLOCK = 4


def _old_matvec(w: DeviceMatrix, x, out) -> None:
    grid = (blocks(w.rows, _OLD_ROWS_PER_BLOCK), x.shape[0])
    threads = _OLD_ROWS_PER_BLOCK * WARP
    if w.kind == "q4":
        _old_matvec_q4[grid, threads](w.codes, w.scale, w.bias, x, out)
    else:
        _old_matvec_q8[grid, threads](w.codes, w.scale, w.bias, w.block_log2 - 2, x, out)


@cuda.jit(device=True, inline=True)
def _old_warp_row():
    return cuda.blockIdx.x * _OLD_ROWS_PER_BLOCK + cuda.threadIdx.x // WARP, cuda.threadIdx.x % WARP


@cuda.jit
def _old_matvec_q4(words, scale, bias, x, out):
    r, lane = _old_warp_row()
    t = cuda.blockIdx.y
    n_words = words.shape[1] if r < words.shape[0] else 0
    acc = np.float32(0)
    for i in range(lane, n_words, WARP):
        b = i >> 2
        e = b * 32 + (i & 3) * 4
        word = words[r, i]
        dot = np.float32(0)
        xs = np.float32(0)
        for j in range(4):
            byte = (word >> np.uint32(8 * j)) & np.uint32(0xFF)
            xl = x[t, e + j]
            xh = x[t, e + 16 + j]
            dot += np.float32(byte & np.uint32(15)) * xl + np.float32(byte >> np.uint32(4)) * xh
            xs += xl + xh
        acc += scale[r, b] * dot + bias[r, b] * xs
    acc = warp_sum(acc)
    if lane == 0 and r < words.shape[0]:
        out[t, r] = acc


@cuda.jit
def _old_matvec_q8(words, scale, bias, words_per_block_log2, x, out):
    r, lane = _old_warp_row()
    t = cuda.blockIdx.y
    n_words = words.shape[1] if r < words.shape[0] else 0
    acc = np.float32(0)
    for i in range(lane, n_words, WARP):
        b = i >> words_per_block_log2
        e = i * 4
        word = words[r, i]
        dot = np.float32(0)
        xs = np.float32(0)
        for j in range(4):
            byte = np.int32((word >> np.uint32(8 * j)) & np.uint32(0xFF))
            xv = x[t, e + j]
            dot += np.float32(byte - ((byte & 0x80) << 1)) * xv
            xs += xv
        acc += scale[r, b] * dot + bias[r, b] * xs
    acc = warp_sum(acc)
    if lane == 0 and r < words.shape[0]:
        out[t, r] = acc


if __name__ == "__main__":
    main()
