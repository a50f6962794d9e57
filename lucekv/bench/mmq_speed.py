"""GPU timing of the integer tensor-core products (kernels/cuda/mmq.py) as a Qwen3-8B-shaped step of n tokens runs a
layer's, for this tree's mmq.py and other commits' copies of it, in one process (issue 25's 16-32-token loss).

    python -m lucekv.bench.mmq_speed [--tokens 8,16,32] [--module NAME=FILE ...] [--last-block-tiles T]
                                     [--quantize-from NAME] [--replays 20] [--json OUT]

A layer as the backend routes it (`CudaOps._products`): x RMSNorm'd and quantized once for q+k and v, then o's x,
gate+up's (RMSNorm'd, gated epilogue) and down's, each quantized by a launch before its products or, where a module's
blocks quantize x themselves (`quantizes_itself`), by the products; partial sums pooled per (splits, tokens, rows) as
the backend pools them. Per row (a module, a setting) and n: µs of the layer, and of each product with its x's
quantization and alone (x quantized before; none where the blocks quantize it), each launch on the next copy of its
matrix (`matvec_speed`: no launch reads weights another left in L2).

Rows: `mmq` (this tree's) and each --module file (e.g. `git show e74b59c:lucekv/kernels/cuda/mmq.py >
.anchors/mmq_before.py`), each loaded as its own module; --last-block-tiles T: also every module that has
LAST_BLOCK_TILES with it set to T (`NAME lbtT`, at the n whose token tiles that changes); --quantize-from NAME: also
every other module's products of x quantized by NAME's launch (`NAME q:OTHER`, at the n its blocks do not quantize).
Checks: each row's outputs against the first row's at the same n (`same_as_first`: bit for bit, else the largest
relative difference), and a token's outputs against the same row's at the smallest n (`same_at_fewer_tokens`: they
must be equal). The kernels are first compiled in parallel processes (one per row, n and weight kind) into the disk
cache (`_numba.KernelCache`), then loaded here: numba takes a minute or more for each.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lucekv.bench.decode import git_commit
from lucekv.bench.matvec_speed import LAUNCHES, QWEN3_8B, Shape, device_name, graph_us, random_matrix, write_json
from lucekv.kernels.cuda import cuda
from lucekv.kernels.cuda import mmq as this_mmq
from lucekv.kernels.cuda.packed import NO_GATE, SILU, epilogue, upload

ROLES = ("q+k", "v", "o", "gate+up", "down")  # QWEN3_8B's products, in a layer's order
NORMED = {"q+k": "attn", "v": "attn", "gate+up": "ffn"}  # the products of RMSNorm'd x: its norm (q+k and v: one x)
LAYERS = 4  # layers of a timed graph (each on the next copy of every matrix)
WARM_ROWS = 256  # rows of the matrices the compiling processes multiply (two row tiles: split columns)
EPS = 1e-6


@dataclass(frozen=True)
class Row:
    """A module (file None: this tree's) under a name; with LAST_BLOCK_TILES changed where `last_block_tiles` (its
    value, the row's) says so; x quantized by `quantizer`'s launch (a row's name; None: its own) beyond its blocks'
    quantization."""

    name: str
    file: str | None
    last_block_tiles: tuple[int, int] | None = None
    quantizer: str | None = None

    def runs_at(self, m, n: int) -> bool:
        """Whether the row has anything of its own at n: a changed LAST_BLOCK_TILES only where it changes the route,
        another module's quantization only where the blocks do not quantize x."""
        if self.last_block_tiles is not None:
            tiles = m.padded(n) // m.TOKEN_TILE
            return min(self.last_block_tiles) < tiles <= max(self.last_block_tiles)
        return self.quantizer is None or not quantizes_itself(m, n)


def quantizes_itself(m, n: int) -> bool:
    """Whether module m's product blocks quantize x of n tokens (commits before mmq3's never do)."""
    return hasattr(m, "quantizes_itself") and m.quantizes_itself(n)


def load_module(row: Row):
    """The row's mmq module (`module`)."""
    return module(row.file, row.last_block_tiles)


@functools.cache
def module(file: str | None, last_block_tiles: tuple[int, int] | None):
    """This tree's mmq as imported, else the file loaded as a module named after it (the disk cache keys kernels by
    that name: the same in every process), LAST_BLOCK_TILES changed before any kernel is made."""
    if file is None and last_block_tiles is None:
        return this_mmq
    path = Path(file or this_mmq.__file__)
    name = "mmq_" + "".join(c if c.isalnum() else "_" for c in path.stem)
    if last_block_tiles is not None:
        name += f"_lbt{last_block_tiles[1]}"
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = sys.modules[name] = importlib.util.module_from_spec(spec)  # (as an import: for whatever looks it up)
    spec.loader.exec_module(loaded)
    if last_block_tiles is not None:
        loaded.LAST_BLOCK_TILES = last_block_tiles[1]
    return loaded


@dataclass
class Layer:
    """One row's products of n tokens: inputs, outputs and scratch at fixed addresses (graphs replay them)."""

    m: object  # the products' module
    q: object  # the quantizing module
    n: int
    xs: dict  # input name -> x [n, cols] (prefixes of the bench's)
    norms: dict  # "attn" / "ffn" -> (weight, eps)
    outs: dict = field(default_factory=dict)  # role -> [n, rows] (gate+up: rows // 2)
    scratch: dict = field(default_factory=dict)  # cols -> QuantizedX (shared by q+k and v, as the backend's)
    sums: dict = field(default_factory=dict)  # (splits, n_pad, rows) -> partial sums

    def self_quantizing(self) -> bool:
        return self.q is self.m and quantizes_itself(self.m, self.n)

    def x_of(self, role: str, stream):
        """x of a role's product, quantized by the launch or as floats its blocks quantize."""
        x = self.xs[NORMED.get(role, role)]
        norm = self.norms.get(NORMED.get(role))
        if self.self_quantizing():
            return self.m.float_x(x, self.m.PARTS, norm)
        cols = x.shape[1]
        if cols not in self.scratch:
            self.scratch[cols] = self.q.scratch(self.n, cols, self.m.PARTS, stream)
        return self.q.quantize(x, self.scratch[cols], stream, norm=norm)

    def product(self, role: str, w, qx, stream) -> None:
        if role not in self.outs:
            self.outs[role] = cuda.device_array((self.n, w.rows // 2 if role == "gate+up" else w.rows), np.float32)
        ep = epilogue((self.outs[role],), gate=SILU if role == "gate+up" else NO_GATE)
        p = self.m.plan(w)
        key = (p.splits, self.m.padded(self.n), w.rows)
        if p.splits > 1 and key not in self.sums:
            self.sums[key] = self.m.partials(w, self.n, stream)
        self.m.product(w, qx, ep, stream, self.sums.get(key))

    def run(self, mats: dict, k: int, stream, roles=ROLES) -> None:
        """The layer's products on copy k of each matrix (q+k and v: one x)."""
        shared = None
        for role in roles:
            ws = mats[role]
            qx = shared if role == "v" and shared is not None else self.x_of(role, stream)
            shared = qx if role == "q+k" else None
            self.product(role, ws[k % len(ws)], qx, stream)


def inputs(n: int, rng: np.random.Generator, shapes=QWEN3_8B) -> tuple[dict, dict]:
    """x of n tokens for each product's input (q+k and v: "attn", gate+up: "ffn", o, down) and the norms' weights."""
    cols = {NORMED.get(role, role): s.cols for role, s in zip(ROLES, shapes, strict=True)}
    xs = {name: cuda.to_device(rng.standard_normal((n, c)).astype(np.float32)) for name, c in cols.items()}
    norms = {name: (cuda.to_device((1 + 0.1 * rng.standard_normal(cols[name])).astype(np.float32)), EPS)
             for name in set(NORMED.values())}
    return xs, norms


def rows_of(args) -> list[Row]:
    modules = [Row("mmq", None)] + [Row(*spec.split("=", 1)) for spec in args.module]
    rows = list(modules)
    if args.last_block_tiles is not None:
        for r in modules:
            was = getattr(load_module(r), "LAST_BLOCK_TILES", None)
            if was is not None and was != args.last_block_tiles:
                rows.append(Row(f"{r.name} lbt{args.last_block_tiles}", r.file, (was, args.last_block_tiles)))
    if args.quantize_from:
        rows += [Row(f"{r.name} q:{args.quantize_from}", r.file, None, args.quantize_from) for r in modules
                 if r.name != args.quantize_from]
    return rows


def _warm(rows: list[Row], name: str, n: int, kind: str) -> float:
    """In a process of its own: compile (into the disk cache) the kernels of row `name`'s products of n tokens of one
    weight kind, on small matrices of the layer's shapes. Seconds taken."""
    start = time.perf_counter()
    by_name = {r.name: r for r in rows}
    row = by_name[name]
    m = load_module(row)
    q = m if row.quantizer is None else load_module(by_name[row.quantizer])
    rng = np.random.default_rng(1)
    mats = {role: [upload(random_matrix(rng, Shape(s.name, WARM_ROWS, s.cols, s.qtype, 0)))]
            for role, s in zip(ROLES, QWEN3_8B, strict=True)}
    xs, norms = inputs(n, rng)
    layer = Layer(m, q, n, xs, norms)
    stream = cuda.stream()
    roles = [role for role in ROLES if mats[role][0].kind == kind]
    layer.run(mats, 0, stream, roles)
    stream.synchronize()
    return time.perf_counter() - start


def warm(rows: list[Row], tokens: list[int]) -> float:
    """Every row's kernels compiled in parallel processes (spawned: each its own CUDA context). Seconds taken."""
    start = time.perf_counter()
    jobs = [(rows, row.name, n, kind) for row in rows if row.quantizer is None for n in tokens
            if row.runs_at(load_module(row), n) for kind in ("q4", "q6")]
    with ProcessPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1)),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        done = {pool.submit(_warm, *job): job for job in jobs}
        for future, job in done.items():
            try:  # a failure here leaves the compiling to the timing process
                print(f"  compiled {job[1]} n={job[2]} {job[3]}: {future.result():.0f} s", flush=True)
            except Exception as e:
                print(f"  compiling {job[1]} n={job[2]} {job[3]} failed: {type(e).__name__}: {e}", flush=True)
    return time.perf_counter() - start


def bench(rows: list[Row], tokens: list[int], replays: int, l2_bytes: int, stream) -> list[dict]:
    rng = np.random.default_rng(0)
    mats = {}
    for role, s in zip(ROLES, QWEN3_8B, strict=True):
        first = upload(random_matrix(rng, s))
        copies = max(3, math.ceil(2 * l2_bytes / first.nbytes))
        mats[role] = [first] + [upload(random_matrix(rng, s)) for _ in range(copies - 1)]
    xs, norms = inputs(max(tokens), rng)
    modules = {r.name: load_module(r) for r in rows}  # (a row's settings: the same instance's)
    results, outputs = [], {}
    for n in tokens:
        for row in rows:
            m = modules[row.name]
            if not row.runs_at(m, n):
                continue
            layer = Layer(m, modules[row.quantizer or row.name], n, {k: v[:n] for k, v in xs.items()}, norms)
            r = {"row": row.name, "tokens": n, "self_quantizing": layer.self_quantizing(),
                 **timed(layer, mats, replays, stream)}
            layer.run(mats, 0, stream)
            stream.synchronize()
            outputs[row.name, n] = {role: out.copy_to_host() for role, out in layer.outs.items()}
            compare(r, outputs, rows, tokens)
            print(line(r), flush=True)
            results.append(r)
    return results


def timed(layer: Layer, mats: dict, replays: int, stream) -> dict:
    """µs of the layer, and of each product with its x's quantization and alone (where x is quantized before)."""
    r = {"layer_us": graph_us(stream, [lambda st, k=k: layer.run(mats, k, st) for k in range(LAYERS)], replays)}
    for role in ROLES:
        order = [i % len(mats[role]) for i in range(max(LAUNCHES, len(mats[role])))]
        r[f"{role}_us"] = graph_us(stream, [lambda st, k=k, role=role: layer.product(
            role, mats[role][k], layer.x_of(role, st), st) for k in order], replays)
        if not layer.self_quantizing():
            qx = layer.x_of(role, stream)
            r[f"{role}_alone_us"] = graph_us(stream, [lambda st, k=k, role=role, qx=qx: layer.product(
                role, mats[role][k], qx, st) for k in order], replays)
    return r


def compare(r: dict, outputs: dict, rows: list[Row], tokens: list[int]) -> None:
    """r's checks against the first row at its n and against itself at the smallest n it ran (its module's row there
    where it ran at none)."""
    n, got = r["tokens"], outputs[r["row"], r["tokens"]]
    first = outputs.get((rows[0].name, n))
    if first is not None:
        r["same_as_first"] = max(_difference(got[role], first[role]) for role in ROLES)
    fewer = next((outputs[key] for t in tokens if t < n for key in ((r["row"], t), (r["row"].split(" ")[0], t))
                  if key in outputs), None)
    if fewer is not None:
        r["same_at_fewer_tokens"] = all(np.array_equal(got[role][:len(fewer[role])], fewer[role]) for role in ROLES)


def _difference(a: np.ndarray, b: np.ndarray) -> float:
    """0 where equal bit for bit, else the largest difference relative to b's largest value."""
    return 0.0 if np.array_equal(a, b) else float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def line(r: dict) -> str:
    products = "  ".join(f"{role} {r[role + '_us']:5.1f}" + (f" ({r[role + '_alone_us']:5.1f})"
                                                             if role + "_alone_us" in r else "")
                         for role in ROLES)
    checks = ""
    if "same_as_first" in r:
        checks += " same bits as the first row" if r["same_as_first"] == 0 else f" differs {r['same_as_first']:.1e}"
    if "same_at_fewer_tokens" in r:
        checks += "" if r["same_at_fewer_tokens"] else "; NOT the same outputs as with fewer tokens"
    return f"{r['tokens']:3d} {r['row']:22s} layer {r['layer_us']:6.1f} µs | {products} |{checks}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8,16,32")
    ap.add_argument("--module", action="append", default=[], help="NAME=FILE: another mmq.py (another commit's)")
    ap.add_argument("--last-block-tiles", type=int, help="also every module with LAST_BLOCK_TILES set to this")
    ap.add_argument("--quantize-from", help="also every other module's products of x quantized by this module's")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    tokens = sorted(int(t) for t in a.tokens.split(","))
    rows = rows_of(a)
    dev = cuda.get_current_device()
    name = device_name(dev)
    result = {"commit": git_commit(), "command": "python -m lucekv.bench.mmq_speed " + " ".join(sys.argv[1:]),
              "device": name, "sm_count": int(dev.MULTIPROCESSOR_COUNT), "replays": a.replays, "layers": LAYERS,
              "rows": [r.__dict__ for r in rows]}
    print(f"{name}: compiling in parallel", flush=True)
    result["compile_s"] = warm(rows, tokens)
    print(f"{name}: µs of an 8B layer's products (and each: with its x's quantization (alone)), median of "
          f"{a.replays} graph replays", flush=True)
    result["results"] = bench(rows, tokens, a.replays, int(dev.L2_CACHE_SIZE), cuda.stream())
    write_json(a.json, result)


if __name__ == "__main__":
    main()
