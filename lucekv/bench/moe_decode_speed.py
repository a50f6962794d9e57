"""GPU timing of one MoE layer's decode kernels at the Qwen3-30B-A3B shape (128 experts, top-8, n_embd 2048, expert
FFN 768; float32 router, Q4_K gate/up, a Q4_K or a Q6_K down as the file's Q4_K_M mix alternates), random experts
built in memory (no model file).

    python -m lucekv.bench.moe_decode_speed [--json OUT] [--replays 20] [--copies 2]

Kernels run as the decode step runs them: captured as CUDA graphs with the step's programmatic edges
(backends.cuda.capture_graph) and replayed, the median over replays. `alone`: each kernel by itself, LAUNCHES
launches over --copies copies of a layer's weights, each launch with experts of its own picked at random (so that
no launch finds another's experts in L2), µs per launch and GB/s of the
weight bytes it must read (the chosen experts', the router's). `chain`: CHAIN layers one after another, each layer's
output the next one's input and its router picking its experts, µs per layer: `combine`, route -> gate/up -> down ->
combine (the step before routed_sum), `made`, route -> gate/up -> routed_sum (route: the router's logits, then a
launch that picks; the decode step's path); each also with every edge programmatic (the step keeps the edges
out of kernels that fill the GPU plain). The chains' outputs must be equal bit for bit; the first layer's output is
checked against float64 numpy (given the device's picks).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from lucekv.backends.cuda import BUSY_WARPS_PER_SM, capture_graph
from lucekv.bench.decode import git_commit
from lucekv.bench.matvec_speed import Shape, device_name, random_matrix, stream_launch, write_json
from lucekv.bench.moe_speed import replay_us
from lucekv.kernels.cpu.quants import PackedMatrix, dequantize_rows, pack
from lucekv.kernels.cuda import cuda, moe
from lucekv.kernels.cuda.matvec import GROUP
from lucekv.kernels.cuda.packed import GATE_ROWS, SILU, epilogue, upload

N_EXPERT, K, N_EMBD, N_FF = 128, 8, 2048, 768
EPS = 1e-6
LAUNCHES = 32  # per graph of one kernel alone
CHAIN = 12  # layers per graph of a layer's chain


@dataclass
class Layer:
    """One layer's weights: host copies (for the float64 check) and device ones."""

    router: PackedMatrix
    gate_up: PackedMatrix  # every expert's gate and up rows interleaved by GATE_ROWS, as the backend uploads them
    down: PackedMatrix
    norm: np.ndarray
    d_router: object
    d_gate_up: moe.ExpertTable
    d_down: moe.ExpertTable
    d_norm: object


def make_layer(rng: np.random.Generator, down: Q) -> Layer:
    router = rng.standard_normal((N_EXPERT, N_EMBD)).astype(np.float32) * np.float32(0.05)
    router = pack(router, Q.F32, router.shape)
    gate_up = random_matrix(rng, Shape("gate/up", N_EXPERT * 2 * N_FF, N_EMBD, Q.Q4_K, 0))
    down_m = random_matrix(rng, Shape("down", N_EXPERT * N_EMBD, N_FF, down, 0))
    norm = (1 + 0.1 * rng.standard_normal(N_EMBD)).astype(np.float32)
    return Layer(router, gate_up, down_m, norm, upload(router), moe.resident(upload(gate_up), N_EXPERT),
                 moe.resident(upload(down_m), N_EXPERT), cuda.to_device(norm))


class Step:
    """A layer's decode kernels on fixed device arrays (a graph's launches hold their addresses)."""

    def __init__(self, layer: Layer, x, ids=None):
        """ids [1, K]: the experts to take, or None: the router's."""
        self.layer, self.x = layer, x
        self.ids = cuda.device_array((1, K), np.int32) if ids is None else cuda.to_device(ids)
        self.weights = cuda.to_device(np.full((1, K), 1 / K, np.float32))
        self.logits = cuda.device_array((1, N_EXPERT), np.float32)
        self.routing = moe.Routing(self.ids, self.weights)
        self.act = cuda.device_array((K, N_FF), np.float32)
        self.outs = cuda.device_array((K, N_EMBD), np.float32)
        self.slot_rows = cuda.to_device(np.arange(K, dtype=np.int32).reshape(1, K))
        self.out = cuda.device_array((1, N_EMBD), np.float32)
        self.rows_per_block: dict[str, int] = {}  # kernel -> its blocks' rows, where not the kernels' own choice

    def route(self, stream) -> None:
        m = self.layer
        moe.route(m.d_router, self.x, (m.d_norm, EPS), self.logits, self.ids, self.weights, True, stream=stream)

    def router_logits(self, stream) -> None:
        moe.router_logits(self.layer.d_router, self.x, (self.layer.d_norm, EPS), self.logits, stream=stream)

    def gate_up(self, stream) -> None:
        m = self.layer
        moe.routed_matvecs(m.d_gate_up, 2 * N_FF, self.x, self.routing, epilogue((self.act,), gate=SILU),
                           x_per_slot=False, stream=stream, norm=(m.d_norm, EPS),
                           rows_per_block=self.rows_per_block.get("gate_up"))

    def down(self, stream) -> None:
        moe.routed_matvecs(self.layer.d_down, N_EMBD, self.act, self.routing, self.outs, x_per_slot=True,
                           stream=stream)

    def combine(self, stream) -> None:
        moe.combine(self.outs, self.slot_rows, self.weights, self.x, self.out, stream=stream)

    def routed_sum(self, stream) -> None:
        moe.routed_sum(self.layer.d_down, N_EMBD, self.act, self.routing, self.x, self.out, stream=stream,
                       rows_per_block=self.rows_per_block.get("routed_sum"))


PATHS = {"combine": ("route", "gate_up", "down", "combine"), "made": ("route", "gate_up", "routed_sum")}
# rows per block tried besides the kernels' own choice (whole register buffers: GROUP rows of q4 4, q6 2; gate/up:
# 16 rows, 8 of gate and their 8 of up)
SWEEP = {"gate_up": (16, 32, 64), "routed_sum": (4, 8, 16, 32)}


def graph_us(stream, launches: list, replays: int, busy_warps: float = BUSY_WARPS_PER_SM) -> float:
    """Median µs of one replay of `launches` (callables taking the stream) captured as the decode step's graphs are
    (busy_warps: see backends.cuda.overlap_kernel_launches)."""
    for launch in launches:  # compile and load outside the capture
        launch(stream)
    stream.synchronize()
    graph, _ = capture_graph(stream, lambda: [launch(stream) for launch in launches], busy_warps)
    return replay_us(graph, stream, replays)


def weight_bytes(layer: Layer) -> dict[str, int]:
    """Bytes each kernel must read of the weights: the router's, the chosen experts' (K of N_EXPERT)."""
    gate_up = layer.d_gate_up.table.nbytes * K // N_EXPERT
    down = layer.d_down.table.nbytes * K // N_EXPERT
    return {"route": layer.d_router.nbytes, "router_logits": layer.d_router.nbytes, "gate_up": gate_up,
            "down": down, "combine": 0, "routed_sum": down}


def stream_us(nbytes: int, replays: int, stream) -> float:
    """µs of a kernel that only reads nbytes, contiguous (matvec_speed's `stream` reference: what a kernel of that
    size can reach), a buffer of its own per launch."""
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    bufs = [cuda.device_array((1, nbytes // 4), np.uint32) for _ in range(LAUNCHES)]
    flag = cuda.device_array(1, np.uint32)
    return graph_us(stream, [stream_launch(b, flag, sms) for b in bufs], replays) / LAUNCHES


def bench_alone(layers: list[Layer], rng: np.random.Generator, replays: int, stream) -> dict:
    """µs and GB/s of each kernel by itself, each launch on experts of its own; the products' bytes read by the
    `stream` reference."""
    steps = []
    for j in range(LAUNCHES):
        x = cuda.to_device(rng.standard_normal((1, N_EMBD)).astype(np.float32))
        step = Step(layers[j % len(layers)], x, rng.permutation(N_EXPERT)[:K].astype(np.int32).reshape(1, K))
        step.act.copy_to_device(rng.standard_normal((K, N_FF)).astype(np.float32))
        steps.append(step)
    result = {}
    # (the routers last: they rewrite the picks)
    for kernel in ("gate_up", "down", "combine", "routed_sum", "route", "router_logits"):
        nbytes = weight_bytes(layers[0])[kernel]
        us = graph_us(stream, [getattr(s, kernel) for s in steps], replays) / LAUNCHES
        result[kernel] = {"us": us, "gbps": nbytes / (us * 1e3) if nbytes else None, "weight_bytes": nbytes}
        if kernel in ("gate_up", "routed_sum"):
            result[kernel]["stream_us"] = stream_us(nbytes, replays, stream)
        for rows in SWEEP.get(kernel, ()):
            matrix = layers[0].d_gate_up if kernel == "gate_up" else layers[0].d_down
            if rows % (2 * GROUP[matrix.kind]):  # whole pairs of register buffers
                continue
            for s in steps:
                s.rows_per_block = {kernel: rows}
            result[kernel][f"us_at_{rows}_rows_per_block"] = graph_us(
                stream, [getattr(s, kernel) for s in steps], replays) / LAUNCHES
        for s in steps:
            s.rows_per_block = {}
    return result


def chain(layers: list[Layer], x0: np.ndarray, path: str) -> tuple[list[Step], list]:
    """CHAIN layers' steps of `path`, layer i + 1 reading layer i's output, and their launches in order."""
    steps, x = [], cuda.to_device(x0)
    for i in range(CHAIN):
        steps.append(Step(layers[i % len(layers)], x))
        x = steps[-1].out
    return steps, [getattr(s, kernel) for s in steps for kernel in PATHS[path]]


def reference(layer: Layer, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The layer's output in float64 given the picks (ids, weights [K])."""
    x64 = x.astype(np.float64)
    h = x64 / np.sqrt(np.mean(x64 * x64) + EPS) * layer.norm
    y = x64.copy()
    for e, w in zip(ids, weights, strict=True):
        gu = dequantize_rows(layer.gate_up, e * 2 * N_FF, (e + 1) * 2 * N_FF).astype(np.float64)
        gu = gu.reshape(-1, 2, GATE_ROWS, N_EMBD)  # groups of GATE_ROWS gate rows, then as many up rows
        gate, up = gu[:, 0].reshape(N_FF, N_EMBD) @ h, gu[:, 1].reshape(N_FF, N_EMBD) @ h
        down = dequantize_rows(layer.down, e * N_EMBD, (e + 1) * N_EMBD).astype(np.float64)
        y += w * (down @ (gate / (1 + np.exp(-gate)) * up))
    return y


def bench_chains(layers: list[Layer], rng: np.random.Generator, replays: int, stream) -> dict:
    x0 = rng.standard_normal((1, N_EMBD)).astype(np.float32)
    result, outs = {}, {}
    for path in PATHS:
        steps, launches = chain(layers, x0, path)
        result[f"{path}_us_per_layer"] = graph_us(stream, launches, replays) / CHAIN
        # every edge programmatic, those out of kernels that fill the GPU too (the step keeps those plain)
        result[f"{path}_us_per_layer_all_edges_programmatic"] = graph_us(stream, launches, replays, math.inf) / CHAIN
        result[f"{path}_kernels_per_layer"] = len(PATHS[path])
        outs[path] = steps[-1].out.copy_to_host()  # (every replay runs the chain from x0)
        first = steps[0]
        if path == "made":
            ref = reference(first.layer, x0[0], first.ids.copy_to_host()[0], first.weights.copy_to_host()[0])
            got = first.out.copy_to_host()[0].astype(np.float64)
            result["max_rel_err_vs_float64"] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref - x0[0])))
            # routed_sum's rows per block also decide whether it fills the GPU (then its edge out stays plain)
            for rows in SWEEP["routed_sum"]:
                if rows % (2 * GROUP[layers[0].d_down.kind]) == 0:
                    for st in steps:
                        st.rows_per_block = {"routed_sum": rows}
                    at = graph_us(stream, launches, replays) / CHAIN
                    result[f"made_us_per_layer_at_{rows}_rows_per_block"] = at
                    outs[f"made at {rows} rows per block"] = steps[-1].out.copy_to_host()
    result["outputs_equal"] = all(np.array_equal(out, outs["combine"]) for out in outs.values())
    result["speedup"] = result["combine_us_per_layer"] / result["made_us_per_layer"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--copies", type=int, default=2, help="copies of a layer's weights (~0.4 GB each)")
    a = ap.parse_args()
    dev = cuda.get_current_device()
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    result = {"commit": git_commit(), "command": "python -m lucekv.bench.moe_decode_speed " + " ".join(sys.argv[1:]),
              "device": device_name(dev), "shape": {"n_expert": N_EXPERT, "top_k": K, "n_embd": N_EMBD, "n_ff": N_FF},
              "replays": a.replays, "copies": a.copies, "launches_alone": LAUNCHES, "chain_layers": CHAIN,
              "downs": {}}
    print(f"{result['device']}: one MoE layer's decode kernels, Qwen3-30B-A3B shape, random experts")
    for down in (Q.Q4_K, Q.Q6_K):
        layers = [make_layer(rng, down) for _ in range(a.copies)]
        alone = bench_alone(layers, rng, a.replays, stream)
        chains = bench_chains(layers, rng, a.replays, stream)
        result["downs"][down.name] = {"alone": alone, "chain": chains}
        print(f"down {down.name}: " + ", ".join(
            f"{k} {v['us']:.1f} µs" + (f" ({v['gbps']:.0f} GB/s)" if v["gbps"] else "") for k, v in alone.items())
              + f"; reading their bytes alone: gate/up {alone['gate_up']['stream_us']:.1f}, down "
              f"{alone['routed_sum']['stream_us']:.1f} µs")
        for kernel, v in alone.items():
            sweep = {k.split("_")[2]: us for k, us in v.items() if k.startswith("us_at_")}
            if sweep:
                print(f"  {kernel} by rows per block: " + ", ".join(f"{r} {us:.1f} µs" for r, us in sweep.items()))
        print("  a layer: " + ", ".join(f"{path} ({', '.join(PATHS[path])}) {chains[f'{path}_us_per_layer']:.1f} µs"
                                        for path in PATHS)
              + f"; made {chains['speedup']:.2f}x combine; outputs equal: {chains['outputs_equal']}, error vs "
              f"float64 {chains['max_rel_err_vs_float64']:.1e}; every edge programmatic: " + ", ".join(
                  f"{path} {chains[f'{path}_us_per_layer_all_edges_programmatic']:.1f}" for path in PATHS) + " µs",
              flush=True)
        at = {k.split("_")[5]: us for k, us in chains.items() if k.startswith("made_us_per_layer_at_")}
        print("  a layer made, by routed_sum's rows per block: "
              + ", ".join(f"{r} {us:.1f} µs" for r, us in at.items()))
        del layers
    write_json(a.json, result)


if __name__ == "__main__":
    main()
