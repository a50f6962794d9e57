"""GPU timing of decode attention over the slot pool at Qwen3-8B heads (32 query, 8 KV, head_dim 128).

    python -m lucekv.bench.attention_speed [--depths 512,4096,16384,65536,131072] [--kv-dtype f16]
                                           [--queries 1] [--json OUT]

One query attends over `depth` used slots (every slot visible), split + combine, timed as the decode step runs
them: launches captured as one CUDA graph and replayed (`matvec_speed.graph_us`), each launch on the next of
several pools when one pool fits twice in L2, as the 36 layers of a step each read their own. GB/s counts the K
and V bytes the launch must read; ms/step is that time for the 36 layers. `--queries 1,8,20,64`: n queries of one
sequence at its last n positions (a speculative verify block, a prompt piece), each through the split kernel and
the tensor-core one (flash), timed the same way.

    python -m lucekv.bench.attention_speed --prefill 8192,32768 [--pieces 512,2048] [--shapes 4x3,8x1]
                                           [--baseline OLD_FLASH.py ...]

A long prompt's attention as the engine prefills it: the prompt cut into pieces, piece k's queries at its positions
over the slots of pieces 0..k (slots in position order, causal), every piece's launch in one captured graph; µs per
layer, ms for the 36 layers and TFLOP/s of the causal products (4 x head_dim flops per query head and visible
slot). `--shapes`: the kernel with other warps a block x resident blocks an SM (registers bounded for them) than
the backend's, `--baseline`: flash.py files of other commits (e.g. `git show REV:lucekv/kernels/cuda/flash.py`),
timed in the same run, with their outputs' relative difference from the backend's kernel's.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
from pathlib import Path

import numpy as np

from lucekv.bench.matvec_speed import LAUNCHES, N_LAYER, copy_bandwidth, device_name, graph_us, write_json
from lucekv.kernels.cuda import attention, cuda, flash

N_HEAD, N_KV_HEAD, HEAD_DIM = 32, 8, 128


def bench_depth(depth: int, dtype: np.dtype, rng: np.random.Generator, replays: int, l2_bytes: int,
                stream, n: int = 1, tensor_cores: bool = False) -> dict:
    kv_bytes = 2 * depth * N_KV_HEAD * HEAD_DIM * dtype.itemsize
    n_pools = min(N_LAYER, max(1, math.ceil(2 * l2_bytes / kv_bytes)))
    block = rng.standard_normal((min(depth, 4096), N_KV_HEAD, HEAD_DIM)).astype(dtype)
    pools = []
    for _ in range(n_pools):  # random rows, tiled: filling gigabytes from numpy's generator takes too long
        k = cuda.to_device(np.resize(block, (depth, N_KV_HEAD, HEAD_DIM)), stream=stream)
        pools.append((k, cuda.to_device(np.roll(np.resize(block, (depth, N_KV_HEAD, HEAD_DIM)), 1, 0),
                                         stream=stream)))
    slot_pos = cuda.to_device(np.arange(depth, dtype=np.int32), stream=stream)
    used = cuda.to_device(np.array([depth], np.int32), stream=stream)
    blocks = cuda.to_device(np.arange(-(-depth // attention.BLOCK), dtype=np.int32), stream=stream)
    tables = attention.identity_tables(blocks, used, cuda.to_device(np.zeros(n, np.int32), stream=stream))
    positions = cuda.to_device(np.arange(depth - n, depth, dtype=np.int32), stream=stream)
    q = cuda.to_device(rng.standard_normal((n, N_HEAD * HEAD_DIM)).astype(np.float32), stream=stream)
    parts = attention.partials(n, N_HEAD, N_KV_HEAD, HEAD_DIM, depth)
    out = cuda.device_array((n, N_HEAD * HEAD_DIM), np.float32, stream=stream)
    scale = 1 / math.sqrt(HEAD_DIM)

    def launch(s, k):
        if tensor_cores:
            flash.attend(q, pools[k][0], pools[k][1], slot_pos, tables, positions, 0, scale, out, stream=s)
        else:
            attention.attend(q, pools[k][0], pools[k][1], slot_pos, tables, positions, 0, scale, parts, out, stream=s)

    us = graph_us(stream, [lambda s, k=i % n_pools: launch(s, k) for i in range(LAUNCHES)], replays)
    return {"depth": depth, "queries": n, "kernel": "flash" if tensor_cores else "split", "pools": n_pools,
            "kv_bytes": kv_bytes, "us": us, "gbps": kv_bytes / (us * 1e3), "ms_per_token": us * N_LAYER / 1000}


def load_flash(path: Path):
    """A flash module from a file (another commit's kernel), beside this one."""
    spec = importlib.util.spec_from_file_location(f"flash_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_prefill(prompt: int, piece: int, kernels: dict, rng: np.random.Generator, replays: int, stream) -> list[dict]:
    """A `prompt`-token prefill's attention in pieces of `piece` tokens, one row per kernel (`flash.attend`s by
    name)."""
    if prompt % piece:
        raise SystemExit(f"a prompt of {prompt} tokens is not a whole number of {piece}-token pieces")
    shape = (prompt, N_KV_HEAD, HEAD_DIM)
    block = rng.standard_normal((min(prompt, 4096), N_KV_HEAD, HEAD_DIM)).astype(np.float16)
    k = cuda.to_device(np.resize(block, shape), stream=stream)
    v = cuda.to_device(np.roll(np.resize(block, shape), 1, 0), stream=stream)
    slot_pos = cuda.to_device(np.arange(prompt, dtype=np.int32), stream=stream)
    blocks = cuda.to_device(np.arange(-(-prompt // attention.BLOCK), dtype=np.int32), stream=stream)
    seq_of = cuda.to_device(np.zeros(piece, np.int32), stream=stream)
    q = cuda.to_device(rng.standard_normal((piece, N_HEAD * HEAD_DIM)).astype(np.float32), stream=stream)
    scale = 1 / math.sqrt(HEAD_DIM)
    pieces = []  # piece i: its positions and the tables of the slots written so far (the high-water mark)
    for end in range(piece, prompt + 1, piece):
        used = cuda.to_device(np.array([end], np.int32), stream=stream)
        pieces.append((cuda.to_device(np.arange(end - piece, end, dtype=np.int32), stream=stream),
                       attention.identity_tables(blocks, used, seq_of)))
    flops = 4 * HEAD_DIM * N_HEAD * prompt * (prompt + 1) / 2  # causal: the query at position p sees p + 1 slots
    rows, outs = [], {}
    for name, attend in kernels.items():
        out = cuda.device_array((piece, N_HEAD * HEAD_DIM), np.float32, stream=stream)

        def launch(s, at, attend=attend, out=out):
            attend(q, k, v, slot_pos, at[1], at[0], 0, scale, out, stream=s)

        us = graph_us(stream, [lambda s, at=at: launch(s, at) for at in pieces], replays) * len(pieces)
        outs[name] = out.copy_to_host(stream=stream)  # the last piece's
        rows.append({"prompt": prompt, "piece": piece, "kernel": name, "pieces": len(pieces), "us_per_layer": us,
                     "ms_per_prompt": us * N_LAYER / 1000, "tflops": flops / (us * 1e6)})
    first = outs[next(iter(kernels))]
    for row in rows[1:]:
        other = outs[row["kernel"]]
        row["rel_diff_vs_" + rows[0]["kernel"]] = float(np.linalg.norm(other - first) / np.linalg.norm(first))
    return rows


def main_prefill(a, name: str, stream) -> None:
    kernels = {"flash": flash.attend}
    for shape in filter(None, a.shapes.split(",")):
        warps, blocks_per_sm = map(int, shape.split("x"))
        kernels[f"flash {shape}"] = functools.partial(flash.attend, warps=warps, blocks_per_sm=blocks_per_sm)
    kernels.update({f"baseline:{path.name}": load_flash(path).attend for path in a.baseline})
    rng = np.random.default_rng(0)
    rows = [row for p in a.prefill.split(",") for c in a.pieces.split(",")
            for row in bench_prefill(int(p), int(c), kernels, rng, a.replays, stream)]
    print(f"{name}: prefill attention, {N_HEAD} heads on {N_KV_HEAD} KV heads x {HEAD_DIM}, f16 KV, causal, "
          f"{N_LAYER} layers")
    print(f"{'prompt':>7s} {'piece':>6s} {'kernel':>28s} {'µs/layer':>10s} {'ms/prompt':>10s} {'TFLOP/s':>8s}")
    for r in rows:
        print(f"{r['prompt']:7d} {r['piece']:6d} {r['kernel']:>28s} {r['us_per_layer']:10.0f} "
              f"{r['ms_per_prompt']:10.1f} {r['tflops']:8.1f}")
    write_json(a.json, {"device": name, "heads": [N_HEAD, N_KV_HEAD, HEAD_DIM], "kv_dtype": "f16",
                        "replays": a.replays, "prefill": rows})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="512,4096,16384,65536,131072")
    ap.add_argument("--kv-dtype", default="f16", choices=["f16", "f32"])
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--queries", default="1", help="queries of one sequence per launch, comma-separated")
    ap.add_argument("--prefill", help="prompt lengths: time a long prompt's prefill attention instead")
    ap.add_argument("--pieces", default="512,2048", help="with --prefill: tokens per piece, comma-separated")
    ap.add_argument("--shapes", default="", help="with --prefill: WARPSxBLOCKS_PER_SM of the flash kernel, timed "
                    f"beside the backend's {flash.WARPS}x{flash.BLOCKS_PER_SM}")
    ap.add_argument("--baseline", type=Path, nargs="*", default=[],
                    help="with --prefill: other commits' flash.py files, timed beside")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    dev = cuda.get_current_device()
    name = device_name(dev)
    stream = cuda.stream()
    if a.prefill:
        main_prefill(a, name, stream)
        return
    dtype = np.dtype(np.float16 if a.kv_dtype == "f16" else np.float32)
    rng = np.random.default_rng(0)
    l2 = int(dev.L2_CACHE_SIZE)
    rows = [bench_depth(int(d), dtype, rng, a.replays, l2, stream, int(n), tensor_cores)
            for n in a.queries.split(",") for d in a.depths.split(",")
            for tensor_cores in ((False, True) if int(n) > 1 and flash.runs(dtype, HEAD_DIM) else (False,))]
    result = {"device": name, "heads": [N_HEAD, N_KV_HEAD, HEAD_DIM], "kv_dtype": a.kv_dtype, "replays": a.replays,
              "copy_gbps": copy_bandwidth(stream), "depths": rows}
    print(f"{name}: decode attention, {N_HEAD} heads on {N_KV_HEAD} KV heads x {HEAD_DIM}, {a.kv_dtype} KV; "
          f"copy {result['copy_gbps']:.0f} GB/s (read + write)")
    print(f"{'queries':>7s} {'kernel':>6s} {'depth':>8s} {'K+V MB':>8s} {'µs/layer':>9s} {'GB/s':>7s} "
          f"{'ms/step (36 layers)':>20s}")
    for r in rows:
        print(f"{r['queries']:7d} {r['kernel']:>6s} {r['depth']:8d} {r['kv_bytes'] / 1e6:8.1f} {r['us']:9.2f} "
              f"{r['gbps']:7.0f} {r['ms_per_token']:20.3f}")
    write_json(a.json, result)


if __name__ == "__main__":
    main()
