"""GPU timing of the decode matvec at Qwen3-8B shapes (Q4_K_M: Q4_K attention / FFN, Q6_K v / down / output).

    python -m lucekv.bench.matvec_speed [--json OUT] [--replays 20] [--rows 1,2,4,8,17,32 [--shapes 8b]]

--rows: instead, products of that many tokens (verify blocks, decode rows) at the 8B's, the 1.5B's and the 0.5B's
layer shapes (--shapes 8b: only the 8B's products as its decode step runs them), each timed through every path:
`matvec` as routed, the per-token grid rows, the several-token kernels at each tokens-per-block, the tensor-core
matmul, and the integer tensor-core product (`mmq`, x in one int8 part or two: x's quantization and the product, and
the product alone, with its GB/s) (`bench_rows`).

Random GGUF blocks, packed and uploaded as the backend does (Q6_K becomes the device's q6 form). Each kernel
is timed as the decode step runs it: `LAUNCHES` launches captured as one CUDA graph and replayed (no numba
launch overhead), each launch on the next of several copies of the matrix (enough to exceed twice the L2
cache), so no launch reads weights another left in L2; the median over replays, per launch. GB/s counts the
bytes a matvec must read once (`DeviceMatrix.nbytes`: codes and scale factors); the error is against float64
numpy. Two references frame it: `stream`, a kernel that only reads the same number of bytes (16 per lane and
load), is what a kernel of that size can reach; and the device-to-device copy bandwidth (bytes read +
written) of a 1 GiB buffer.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from lucekv.bench.decode import git_commit
from lucekv.kernels.cpu.quants import PackedMatrix, dequantize_rows, pack
from lucekv.kernels.cuda import mmq
from lucekv.kernels.cuda._numba import cuda, load_u32x4
from lucekv.kernels.cuda.matvec import (
    TOKENS_PER_BLOCK,
    matvec,
    matvec_per_token,
    matvec_tokens,
    several_tokens,
    token_plan,
)
from lucekv.kernels.cuda.packed import upload

LAUNCHES = 36  # per captured graph: as many as a decode step has of the big shapes


@dataclass(frozen=True)
class Shape:
    name: str
    rows: int
    cols: int
    qtype: Q
    per_token: int  # how many such products one Qwen3-8B decode step runs


N_LAYER = 36
SHAPES = (
    Shape("attn q / o   4096x4096 Q4_K", 4096, 4096, Q.Q4_K, 2 * N_LAYER),
    Shape("attn k       1024x4096 Q4_K", 1024, 4096, Q.Q4_K, N_LAYER),
    Shape("attn v       1024x4096 Q6_K", 1024, 4096, Q.Q6_K, N_LAYER),
    Shape("ffn gate/up 12288x4096 Q4_K", 12288, 4096, Q.Q4_K, 2 * N_LAYER),
    Shape("ffn down    4096x12288 Q6_K", 4096, 12288, Q.Q6_K, N_LAYER),
    Shape("output    151936x4096 Q6_K", 151936, 4096, Q.Q6_K, 1),
)
# products of several tokens (--rows) also at Qwen2.5-Coder-1.5B's (Q4_K_M) layer shapes: its speculative verify
# blocks (17 to 20 tokens) and decode rows; not the output heads (always a matmul for n > 1: CudaOps.as_matvec_rows)
QWEN_15B = (
    Shape("1.5b q / o   1536x1536 Q4_K", 1536, 1536, Q.Q4_K, 0),
    Shape("1.5b k / v    256x1536 Q6_K", 256, 1536, Q.Q6_K, 0),
    Shape("1.5b gate/up 17920x1536 Q4_K", 17920, 1536, Q.Q4_K, 0),
    Shape("1.5b down    1536x8960 Q6_K", 1536, 8960, Q.Q6_K, 0),
    Shape("1.5b down    1536x8960 Q4_K", 1536, 8960, Q.Q4_K, 0),
)
# and Qwen2.5-Coder-0.5B's (mostly Q5_0: the device's q6 form; gate and up stacked, half the downs Q6_K)
QWEN_05B = (
    Shape("0.5b q / o    896x896 Q5_0", 896, 896, Q.Q5_0, 0),
    Shape("0.5b k / v    128x896 Q5_0", 128, 896, Q.Q5_0, 0),
    Shape("0.5b gate/up 9728x896 Q5_0", 9728, 896, Q.Q5_0, 0),
    Shape("0.5b down     896x4864 Q6_K", 896, 4864, Q.Q6_K, 0),
)
ROW_SHAPES = SHAPES[:-1] + QWEN_15B + QWEN_05B
# the 8B's products of several tokens as its decode step runs them (q and k stacked, gate and up stacked): --shapes 8b
QWEN3_8B = (
    Shape("8b q+k        5120x4096 Q4_K", 5120, 4096, Q.Q4_K, N_LAYER),
    Shape("8b v          1024x4096 Q6_K", 1024, 4096, Q.Q6_K, N_LAYER),
    Shape("8b o          4096x4096 Q4_K", 4096, 4096, Q.Q4_K, N_LAYER),
    Shape("8b gate+up   24576x4096 Q4_K", 24576, 4096, Q.Q4_K, N_LAYER),
    Shape("8b down      4096x12288 Q6_K", 4096, 12288, Q.Q6_K, N_LAYER),
)
ROW_SETS = {"all": ROW_SHAPES, "8b": QWEN3_8B}
# the f16 d (and dmin) of a block and where they start (negative: from its end)
_D_FIELDS = {Q.Q4_K: ((0.01, 0.005), 0), Q.Q6_K: ((0.01,), -2), Q.Q5_0: ((0.01,), 0)}


def random_matrix(rng: np.random.Generator, s: Shape) -> PackedMatrix:
    """Random blocks of s.qtype (random codes and sub-scales, fixed small d, dmin)."""
    block, size = GGML_QUANT_SIZES[s.qtype]
    raw = rng.integers(0, 256, (s.rows * s.cols // block, size), dtype=np.uint8)
    d, at = _D_FIELDS[s.qtype]
    fields = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    at %= size
    raw[:, at:at + fields.size] = fields
    return pack(raw, s.qtype, (s.rows, s.cols))


def _check(result):
    from cuda.bindings import driver

    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {driver.cuGetErrorName(err)[1]!r}")
    return values[0] if len(values) == 1 else values or None


def graph_us(stream, launches, replays: int) -> float:
    """Median µs per launch of `launches` (callables taking the stream), captured once and replayed."""
    from cuda.bindings import driver

    for launch in launches:  # compile and load outside the capture
        launch(stream)
    stream.synchronize()
    handle = driver.CUstream(int(stream.handle))
    _check(driver.cuStreamBeginCapture(handle, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
    try:
        for launch in launches:
            launch(stream)
    finally:
        graph = _check(driver.cuStreamEndCapture(handle))
    graph_exec = _check(driver.cuGraphInstantiate(graph, 0))
    times = []
    for _ in range(replays + 1):  # the first replay uploads the graph
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        _check(driver.cuGraphLaunch(graph_exec, handle))
        end.record(stream)
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end) * 1000 / len(launches))
    _check(driver.cuGraphExecDestroy(graph_exec))
    _check(driver.cuGraphDestroy(graph))
    return statistics.median(times[1:])


@cuda.jit
def _stream_read(words, out):
    # reads every 16-byte word once, two per lane per iteration; stores only if a value is impossible
    n = words.shape[1] // 4
    i = cuda.grid(1)
    step = cuda.gridsize(1)
    acc = np.uint32(0)
    while i < n:
        a0, a1, a2, a3 = load_u32x4(words, 0, 4 * i)
        j = min(i + step, n - 1)
        b0, b1, b2, b3 = load_u32x4(words, 0, 4 * j)
        acc ^= a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1 ^ b2 ^ b3
        i += 2 * step
    if acc == np.uint32(0x9E3779B9):
        out[0] = acc


def stream_launch(buf, out, sm_count: int):
    return lambda s: _stream_read[sm_count * 8, 256, s](buf, out)


def copy_bandwidth(stream, nbytes: int = 1 << 30, replays: int = 10) -> float:
    """GB/s of a device-to-device copy, counting bytes read + written."""
    src = cuda.device_array(nbytes // 4, np.uint32, stream=stream)
    dst = cuda.device_array(nbytes // 4, np.uint32, stream=stream)
    times = []
    for _ in range(replays + 1):
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        dst.copy_to_device(src, stream=stream)
        end.record(stream)
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    return 2 * nbytes / (statistics.median(times[1:]) * 1e6)


def bench_shape(s: Shape, rng: np.random.Generator, replays: int, l2_bytes: int, sm_count: int, stream) -> dict:
    packed = random_matrix(rng, s)
    first = upload(packed)
    n_copies = max(3, math.ceil(2 * l2_bytes / first.nbytes))
    mats = [first] + [upload(random_matrix(rng, s)) for _ in range(n_copies - 1)]
    xs = [cuda.to_device(rng.standard_normal((1, s.cols)).astype(np.float32)) for _ in mats]
    outs = [cuda.device_array((1, s.rows), np.float32) for _ in mats]
    order = [i % n_copies for i in range(max(LAUNCHES, n_copies))]
    us = graph_us(stream, [lambda st, k=k: matvec(mats[k], xs[k], outs[k], stream=st) for k in order], replays)
    got = outs[0].copy_to_host().astype(np.float64)
    ref = dequantize_rows(packed, 0, s.rows).astype(np.float64) @ xs[0].copy_to_host()[0].astype(np.float64)
    bufs = [cuda.device_array((1, first.nbytes // 4), np.uint32) for _ in range(n_copies)]
    flag = cuda.device_array(1, np.uint32)
    stream_us = graph_us(stream, [stream_launch(bufs[k], flag, sm_count) for k in order], replays)
    gb = first.nbytes / 1e9
    return {"shape": s.name, "rows": s.rows, "cols": s.cols, "qtype": s.qtype.name, "kind": first.kind,
            "bits_per_weight": 8 * first.nbytes / (s.rows * s.cols), "copies": n_copies,
            "weight_bytes": first.nbytes, "per_token": s.per_token, "us": us, "gbps": gb / (us * 1e-6),
            "stream_us": stream_us, "stream_gbps": gb / (stream_us * 1e-6),
            "max_rel_err": float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))}


def row_products(w, n: int) -> dict:
    """The products `bench_rows` times for n tokens of w: name -> product(w, x, out, stream=)."""
    from lucekv.kernels.cuda.matmul import matmul

    halves = cuda.device_array((n, w.cols // 2), np.uint32)  # the matmul's x as float16: fixed, for the graphs

    products = {"matvec": matvec, "per_token": matvec_per_token,
                "matmul": lambda m, x, y, stream: matmul(m, x, y, stream=stream, halves=halves)}
    if n > 1:
        for most in sorted({min(t, TOKENS_PER_BLOCK[w.kind]) for t in (2, 4, 8)}):
            tokens = token_plan(w, n, False, most).tokens  # (distinct cuts only: 2 tokens cut at most 4 as at 2)
            products.setdefault(f"tokens{tokens}", lambda m, x, y, stream, t=tokens: matvec_tokens(m, x, y, t, stream))
    return products


def bench_rows(s: Shape, rng: np.random.Generator, rows: list[int], replays: int, l2_bytes: int, stream) -> list:
    """Products of n tokens (decode rows, verify blocks) through the shape: µs per product of the matvec as routed
    (`matvec`: `several_tokens` or not, cut by `token_plan`), of the one-token kernel with a grid row per token
    (`per_token`: each reads the weights, all but the first from L2), of the several-token kernels at each
    tokens-per-block (`tokens2`.. : weights read once per grid row) and of the tensor-core matmul (each weight read
    once per 64 rows); `best`, the fastest matvec path. The matvec's error against float64 and whether every matvec
    path equals the per-token path bit for bit (they should)."""
    packed = random_matrix(rng, s)
    mats = [upload(packed)]
    mats += [upload(random_matrix(rng, s)) for _ in range(max(3, math.ceil(2 * l2_bytes / mats[0].nbytes)) - 1)]
    order = [i % len(mats) for i in range(max(LAUNCHES, len(mats)))]
    out = []
    for n in rows:
        xs = [cuda.to_device(rng.standard_normal((n, s.cols)).astype(np.float32)) for _ in mats]
        outs = [cuda.device_array((n, s.rows), np.float32) for _ in mats]
        plan = token_plan(mats[0], n, False) if n > 1 else None
        row = {"shape": s.name, "rows": n, "several_tokens": several_tokens(mats[0], n),
               "plan": None if plan is None else {"tokens": plan.tokens, "groups": plan.groups, "warps": plan.warps,
                                                  "rows_per_block": plan.rows_per_block}}
        results = {}
        for name, product in row_products(mats[0], n).items():
            launches = [lambda st, w=mats[k], x=xs[k], y=outs[k], f=product: f(w, x, y, stream=st) for k in order]
            row[f"{name}_us"] = graph_us(stream, launches, replays)
            results[name] = outs[0].copy_to_host()
        paths = [name for name in results if name != "matmul"]
        row["best"] = min(paths, key=lambda name: row[f"{name}_us"])
        row["matmul_over_matvec"] = row["matmul_us"] / row["matvec_us"]
        row["per_token_over_matvec"] = row["per_token_us"] / row["matvec_us"]
        ref = xs[0].copy_to_host().astype(np.float64) @ dequantize_rows(packed, 0, s.rows).astype(np.float64).T
        row["max_rel_err"] = float(np.max(np.abs(results["matvec"] - ref)) / np.max(np.abs(ref)))
        row["equals_per_token"] = all(np.array_equal(results[name], results["per_token"]) for name in paths)
        if mmq.serves(mats[0], n):
            row.update(bench_mmq(mats, order, xs, outs, ref, replays, stream))
        out.append(row)
    return out


def bench_mmq(mats: list, order: list[int], xs: list, outs: list, ref: np.ndarray, replays: int, stream) -> dict:
    """The integer tensor-core product of bench_rows' tokens, x in one int8 part and in two (`mmq1_`, `mmq2_`): µs of
    x's quantization and the product as a step runs them (up to a token tile the product's blocks quantize x
    themselves: `mmq.quantizes_itself`, else a launch before it) and of the product of x quantized before it alone
    (no quantization at all), the latter's GB/s of weights,
    its error against float64, and whether each token's outputs equal bit for bit those of the same token in products
    of two tokens (a token's sums must not depend on the others)."""
    n, cols = xs[0].shape
    sums = [mmq.partials(m, n, stream) for m in mats]  # fixed addresses for the graphs
    result = {"mmq_plan": mmq.plan(mats[0])._asdict()}
    for parts in (1, 2):
        key = f"mmq{parts}_"
        scratch = [mmq.scratch(n, cols, parts, stream) for _ in mats]
        both = [lambda st, k=k, qx=scratch[k]: mmq.product(mats[k], as_step(xs[k], qx, st), outs[k], st,
                                                            sums[k]) for k in order]
        result[key + "us"] = graph_us(stream, both, replays)
        got = outs[0].copy_to_host()
        alone = [lambda st, k=k, qx=scratch[k]: mmq.product(mats[k], qx, outs[k], st, sums[k]) for k in order]
        result[key + "product_us"] = graph_us(stream, alone, replays)
        result[key + "gbps"] = mats[0].nbytes / 1e3 / result[key + "product_us"]
        result[key + "max_rel_err"] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        pair = cuda.device_array((2, mats[0].rows), np.float32)
        equal = True
        for t in range(0, n - 1, 2):
            mmq.mmq(mats[0], xs[0][t:t + 2], pair, stream, parts)
            equal &= bool(np.array_equal(pair.copy_to_host(stream=stream), got[t:t + 2]))
        result[key + "equals_two_at_a_time"] = equal
    return result


def as_step(x, scratch: mmq.QuantizedX, stream):
    """x for a product as the backend gives it: floats that its blocks quantize (in scratch's parts), or quantized
    into scratch here."""
    return mmq.float_x(x, scratch.parts) if mmq.quantizes_itself(x.shape[0]) else mmq.quantize(x, scratch, stream)


def device_name(dev) -> str:
    """A numba device's name (bytes on some numba versions)."""
    return dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)


def write_json(path: Path | None, result: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--rows", default="", help="instead, time products of several tokens, e.g. 1,2,4,8,17,32: "
                    "every path of a product of that many token rows (see bench_rows), at the 8B's, the 1.5B's and "
                    "the 0.5B's layer shapes")
    ap.add_argument("--shapes", choices=sorted(ROW_SETS), default="all",
                    help="with --rows: those shapes, or only the 8B's products as its step runs them (faster)")
    a = ap.parse_args()
    dev = cuda.get_current_device()
    l2, sms = int(dev.L2_CACHE_SIZE), int(dev.MULTIPROCESSOR_COUNT)
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    name = device_name(dev)
    result = {"commit": git_commit(), "command": "python -m lucekv.bench.matvec_speed " + " ".join(sys.argv[1:]),
              "device": name, "sm_count": sms, "l2_bytes": l2, "replays": a.replays, "launches_per_graph": LAUNCHES}
    print(f"{name}: {sms} SMs, L2 {l2 / 2 ** 20:.0f} MiB, median of {a.replays} graph replays of {LAUNCHES}+ launches")
    if a.rows:
        counts = [int(n) for n in a.rows.split(",")]
        shapes = ROW_SETS[a.shapes]
        result["decode_rows"] = [r for s in shapes for r in bench_rows(s, rng, counts, a.replays, l2, stream)]
        for r in result["decode_rows"]:
            several = " ".join(f"{k[:-3]} {v:6.1f}" for k, v in r.items() if k.startswith("tokens") and k[-3:] == "_us")
            plan = r["plan"]
            route = f"tokens{plan['tokens']}/{plan['rows_per_block']}" if r["several_tokens"] else "per token"
            print(f"{r['shape']:32s} rows {r['rows']:3d}: matvec {r['matvec_us']:7.1f} µs ({route}), per token "
                  f"{r['per_token_us']:7.1f}, {several + ', ' if several else ''}matmul {r['matmul_us']:7.1f}; best "
                  f"{r['best']}; err {r['max_rel_err']:.1e}"
                  f"{'' if r['equals_per_token'] else ' (NOT equal to the per-token path)'}", flush=True)
            for parts in (1, 2) if "mmq_plan" in r else ():
                k = f"mmq{parts}_"
                print(f"{'':32s}          mmq, x in {parts} part{'s' * (parts > 1)}: {r[k + 'us']:7.1f} µs with x's "
                      f"quantization, of x quantized before {r[k + 'product_us']:7.1f} ({r[k + 'gbps']:.0f} GB/s, "
                      f"{r['mmq_plan']}); "
                      f"err {r[k + 'max_rel_err']:.1e}"
                      f"{'' if r[k + 'equals_two_at_a_time'] else ' (NOT equal to two tokens at a time)'}", flush=True)
        write_json(a.json, result)
        return
    rows = [bench_shape(s, rng, a.replays, l2, sms, stream) for s in SHAPES]
    result.update({"copy_gbps": copy_bandwidth(stream), "shapes": rows,
                   "ms_per_token": sum(r["us"] * r["per_token"] for r in rows) / 1000,
                   "stream_ms_per_token": sum(r["stream_us"] * r["per_token"] for r in rows) / 1000})
    print(f"copy {result['copy_gbps']:.0f} GB/s (read + write)")
    print(f"{'shape':32s} {'MB':>7s} {'matvec µs':>9s} {'GB/s':>7s} {'stream µs':>9s} {'GB/s':>7s} {'rel err':>8s}")
    for r in rows:
        print(f"{r['shape']:32s} {r['weight_bytes'] / 1e6:7.1f} {r['us']:9.2f} {r['gbps']:7.0f} "
              f"{r['stream_us']:9.2f} {r['stream_gbps']:7.0f} {r['max_rel_err']:8.1e}")
    print(f"matvec ms per Qwen3-8B token: {result['ms_per_token']:.3f} (stream {result['stream_ms_per_token']:.3f})")
    write_json(a.json, result)


if __name__ == "__main__":
    main()
