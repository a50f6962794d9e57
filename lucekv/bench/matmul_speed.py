"""GPU timing of the prefill matmul at Qwen3-8B shapes (Q4_K_M), every block tile, by prompt length, against last
session's kernel.

    python -m lucekv.bench.matmul_speed [--json OUT] [--tokens 64,128,256,512,2048] [--replays 10]

For each shape and token count: µs per product (x rounded to float16 by `stage_halves`, then the product: both
launches) of the 64-token tile (`tile`), of the 128-token tiles (`long_tile`, 16 warps, and `wide_tile`, 8 warps
of 64 rows, two blocks per SM; `pick_tile` takes them from LONG_PROMPT tokens on where their blocks fill the GPU),
and of the tile rounding x itself as last session's did, routed as it was (`before`: `matmul(staged=False)`, short
or long tile, grid over the row tiles first; it shares this session's leaner address math in the loads, so that
last session's JSON is the reference for that); TFLOP/s (2 rows cols n per product), which tile `matmul` routes
to, the speedup as routed (before / routed), and the largest difference between the variants' outputs relative to
the largest output (0: every tile sums an output's products in the same order, and `before` stages the same
operands). Per shape, every variant's error against float64 numpy over the first REF_ROWS rows at one token
count. Timing as matvec_speed's: launches captured as one CUDA graph and replayed, over enough copies of the
matrix that no launch reads weights another left in L2; the median over replays, per product.
The q/k and v products, which CudaOps launches together (`matmuls`), are timed so too (`pairs`: µs per pair,
against the two as routed one after the other), and a layer's products as routed count them so.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from lucekv.bench.decode import git_commit
from lucekv.bench.matvec_speed import Shape, device_name, graph_us, random_matrix, write_json
from lucekv.kernels.cpu.quants import dequantize_rows
from lucekv.kernels.cuda._numba import cuda
from lucekv.kernels.cuda.matmul import (
    LONG_PROMPT,
    LONG_TILE,
    SHORT_TILE,
    WIDE_TILE,
    Tile,
    matmul,
    matmuls,
    pick_tile,
    x_order,
)
from lucekv.kernels.cuda.packed import upload

SHAPES = (  # one Qwen3-8B layer's products as CudaOps runs them (k and v stacked with q by kind)
    Shape("ffn gate/up 24576x4096 Q4_K", 24576, 4096, Q.Q4_K, 1),
    Shape("ffn down     4096x12288 Q6_K", 4096, 12288, Q.Q6_K, 1),
    Shape("attn qk      5120x4096 Q4_K", 5120, 4096, Q.Q4_K, 1),
    Shape("attn o       4096x4096 Q4_K", 4096, 4096, Q.Q4_K, 1),
    Shape("attn v       1024x4096 Q6_K", 1024, 4096, Q.Q6_K, 1),
)
PAIR = (SHAPES[2], SHAPES[4])  # q/k and v: one launch (CudaOps -> matmuls)
TILE_NAMES = {SHORT_TILE: "tile", LONG_TILE: "long_tile", WIDE_TILE: "wide_tile"}
VARIANTS = (*TILE_NAMES.values(), "before")
REF_ROWS = 512  # rows of the float64 reference
REF_TOKENS = 128  # token count of the float64 reference (or the largest asked below it)
MIN_LAUNCHES = 8  # per captured graph


def before_tile(rows: int, n: int) -> Tile:
    """The tile last session's kernel took: the long one where a long tile is taken now (it had no wide one)."""
    return SHORT_TILE if pick_tile(rows, n) == SHORT_TILE else LONG_TILE


def bench_shape(s: Shape, counts: list[int], rng: np.random.Generator, replays: int, l2_bytes: int, stream) -> list:
    packed = random_matrix(rng, s)
    mats = [upload(packed)]
    mats += [upload(random_matrix(rng, s)) for _ in range(max(2, math.ceil(2 * l2_bytes / mats[0].nbytes)) - 1)]
    order = [i % len(mats) for i in range(max(MIN_LAUNCHES, len(mats)))]
    ref_n = max([n for n in counts if n <= REF_TOKENS] or [min(counts)])
    rows = []
    for n in counts:
        xs = [cuda.to_device(rng.standard_normal((n, s.cols)).astype(np.float32)) for _ in mats]
        halves = [cuda.device_array((n, s.cols // 2), np.uint32) for _ in mats]
        outs = [cuda.device_array((n, s.rows), np.float32) for _ in mats]
        routed = TILE_NAMES[pick_tile(s.rows, n)]
        row = {"shape": s.name, "rows": s.rows, "cols": s.cols, "qtype": s.qtype.name, "tokens": n,
               "routed_to": routed}
        results = {}
        for name in VARIANTS:
            tile = {v: k for k, v in TILE_NAMES.items()}.get(name, before_tile(s.rows, n))
            launches = [lambda st, w=mats[k], x=xs[k], h=halves[k], y=outs[k], t=tile, staged=name != "before":
                        matmul(w, x, y, stream=st, tile=t, halves=h, staged=staged) for k in order]
            us = graph_us(stream, launches, replays)
            row[f"{name}_us"], row[f"{name}_tflops"] = us, 2 * s.rows * s.cols * n / (us * 1e6)
            results[name] = outs[0].copy_to_host().astype(np.float64)
        row["long_over_tile"] = row["long_tile_us"] / row["tile_us"]
        row["wide_over_long"] = row["wide_tile_us"] / row["long_tile_us"]
        row["speedup_as_routed"] = row["before_us"] / row[f"{routed}_us"]
        top = np.max(np.abs(results["tile"]))
        row["tiles_max_rel_diff"] = float(max(np.max(np.abs(results[name] - results["tile"]))
                                              for name in ("long_tile", "wide_tile")) / top)
        row["routed_vs_before_max_rel_diff"] = float(np.max(np.abs(results[routed] - results["before"])) / top)
        if n == ref_n:
            ref_rows = min(REF_ROWS, s.rows)
            ref = xs[0].copy_to_host().astype(np.float64) @ dequantize_rows(packed, 0, ref_rows).astype(np.float64).T
            for name, got in results.items():
                row[f"{name}_max_rel_err"] = float(np.max(np.abs(got[:, :ref_rows] - ref)) / np.max(np.abs(ref)))
        rows.append(row)
        print(f"{s.name:30s} n {n:5d}: tile {row['tile_us']:8.1f} µs {row['tile_tflops']:6.1f} TFLOP/s, long tile "
              f"{row['long_tile_us']:8.1f} µs {row['long_tile_tflops']:6.1f} TFLOP/s, wide tile "
              f"{row['wide_tile_us']:8.1f} µs {row['wide_tile_tflops']:6.1f} TFLOP/s, before "
              f"({TILE_NAMES[before_tile(s.rows, n)]}) "
              f"{row['before_us']:8.1f} µs: {row['speedup_as_routed']:.2f}x as routed; tiles differ "
              f"{row['tiles_max_rel_diff']:.1e}, routed vs before {row['routed_vs_before_max_rel_diff']:.1e}"
              + ("; vs float64 " + " / ".join(f"{row[name + '_max_rel_err']:.1e}" for name in VARIANTS)
                 if n == ref_n else ""), flush=True)
    return rows


def bench_pair(pair: tuple[Shape, Shape], counts: list[int], rng: np.random.Generator, replays: int, l2_bytes: int,
               stream) -> dict[int, dict]:
    """µs per launch of both products by `matmuls`, and the largest difference of its outputs from each product's
    own launch with the same tile (0: the same sums)."""
    first = [upload(random_matrix(rng, s)) for s in pair]
    copies = max(2, math.ceil(2 * l2_bytes / sum(m.nbytes for m in first)))
    mats = [first] + [[upload(random_matrix(rng, s)) for s in pair] for _ in range(copies - 1)]
    order = [i % len(mats) for i in range(max(MIN_LAUNCHES, len(mats)))]
    cols = pair[0].cols
    result = {}
    for n in counts:
        xs = [cuda.to_device(rng.standard_normal((n, cols)).astype(np.float32)) for _ in mats]
        scratch = [{x_order(w.kind): cuda.device_array((n, cols // 2), np.uint32) for w in ws} for ws in mats]
        outs = [[cuda.device_array((n, s.rows), np.float32) for s in pair] for _ in mats]
        launches = [lambda st, ws=mats[k], x=xs[k], o=outs[k], h=scratch[k]:
                    matmuls(list(zip(ws, o, strict=True)), x, st, halves=h.__getitem__) for k in order]
        us = graph_us(stream, launches, replays)
        tile = pick_tile(sum(s.rows for s in pair), n)
        diff = 0.0
        for w, out in zip(mats[0], outs[0], strict=True):
            alone = cuda.device_array(out.shape, np.float32)
            matmul(w, xs[0], alone, tile=tile)
            got, ref = out.copy_to_host(), alone.copy_to_host()
            diff = max(diff, float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))))
        result[n] = {"us": us, "tile": TILE_NAMES[tile], "vs_alone_max_rel_diff": diff}
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tokens", default="64,128,256,512,2048", help="token counts (prompt lengths)")
    ap.add_argument("--replays", type=int, default=10)
    a = ap.parse_args()
    counts = [int(n) for n in a.tokens.split(",")]
    dev = cuda.get_current_device()
    l2 = int(dev.L2_CACHE_SIZE)
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    print(f"{device_name(dev)}: tiles {', '.join(f'{v} {k}' for k, v in TILE_NAMES.items())}; long tiles from "
          f"{LONG_PROMPT} tokens; median of {a.replays} graph replays")
    products = [r for s in SHAPES for r in bench_shape(s, counts, rng, a.replays, l2, stream)]
    pairs = bench_pair(PAIR, counts, rng, a.replays, l2, stream)
    paired = {s.name for s in PAIR}
    for n, p in pairs.items():
        apart = sum(r[f"{r['routed_to']}_us"] for r in products if r["tokens"] == n and r["shape"] in paired)
        p["apart_us"] = apart
        print(f"n {n:5d}: q/k + v in one launch {p['us']:8.1f} µs, one after the other {apart:8.1f} µs "
              f"({apart / p['us']:.2f}x); outputs vs alone {p['vs_alone_max_rel_diff']:.1e}")
    layer_us = {n: pairs[n]["us"] + sum(r[f"{r['routed_to']}_us"] for r in products
                                        if r["tokens"] == n and r["shape"] not in paired) for n in counts}
    before_us = {n: sum(r["before_us"] for r in products if r["tokens"] == n) for n in counts}
    for n, us in layer_us.items():
        print(f"n {n:5d}: one 8B layer's products {us:8.1f} µs as routed ({36 * us / 1000:.1f} ms for 36 layers), "
              f"before {before_us[n]:8.1f} µs ({before_us[n] / us:.2f}x)")
    write_json(a.json, {"bench": "matmul_speed", "commit": git_commit(), "device": device_name(dev),
                        "command": "python -m lucekv.bench.matmul_speed --tokens " + a.tokens,
                        "model": "random weights, qwen3-8b shapes", "replays": a.replays,
                        "tiles": {v: k._asdict() for k, v in TILE_NAMES.items()}, "long_prompt": LONG_PROMPT,
                        "products": products,
                        "pairs": {"shapes": sorted(paired), "by_tokens": pairs},
                        "layer_us_as_routed": layer_us, "layer_us_before": before_us})


if __name__ == "__main__":
    main()
