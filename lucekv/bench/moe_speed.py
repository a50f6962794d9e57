"""GPU timing of the MoE FFN's prefill at the Qwen3-30B-A3B layer shape (128 experts, top-8, n_embd 2048, experts
768 wide), random experts built in memory: no model file.

    python -m lucekv.bench.moe_speed [--tokens 512] [--down q6,q4] [--replays 20] [--json OUT]

One layer's FFN as CudaOps.moe_ffn runs it for n > 1 tokens of normalized input (the router, the grouping by expert,
the gather, the grouped gate/up and down products, the weighted sum back), gate/up Q4_K and down Q6_K or Q4_K (a
Q4_K_M file has both): the whole FFN captured as one CUDA graph (programmatic edges, as the engine captures it) and
replayed, then captured again with an event node before every kernel (kernel_profile's LaunchRecorder) for each
kernel's time at its place. Also: the routing's spread (token-slots per expert, tiles of the grouped products), the
useful TFLOP/s, the rate at which the layer's expert bytes go by, and the FFN's error against float64 numpy on the
first REF_TOKENS tokens (the router's picks compared too). Each launch bound the grouped products are built for
(moe.GROUPED_BLOCKS_PER_SM: 2 blocks of 8 warps an SM, the default, or 3) is timed, its output checked equal.
A layer's experts (~390 MB) are far beyond L2: a replay reads them from memory as a prefill does.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from lucekv.bench.decode import git_commit
from lucekv.bench.matvec_speed import Shape, device_name, random_matrix, write_json
from lucekv.kernels.cpu.quants import PackedMatrix, dequantize_rows, interleave_rows, pack
from lucekv.kernels.cuda import matmul as mm
from lucekv.kernels.cuda import moe
from lucekv.kernels.cuda._numba import cuda
from lucekv.kernels.cuda.packed import GATE_ROWS, SILU, upload


@dataclass(frozen=True)
class MoeShape:
    n_embd: int
    n_ff: int
    n_expert: int
    k: int


A3B = MoeShape(n_embd=2048, n_ff=768, n_expert=128, k=8)
DOWN_KINDS = {"q6": Q.Q6_K, "q4": Q.Q4_K}
REF_TOKENS = 4
X_SCALE = 0.02  # inputs small enough that random Q4_K experts keep the activations far below float16's range


@dataclass
class Layer:
    """One layer's router and experts: on the device as CudaOps holds them, and packed on the host for the
    reference."""

    shape: MoeShape
    router: np.ndarray  # float32 [n_expert, n_embd]
    gate: PackedMatrix
    up: PackedMatrix
    down: PackedMatrix
    device_router: object
    gate_up: moe.ExpertTable
    device_down: moe.ExpertTable


def build_layer(rng: np.random.Generator, s: MoeShape, down_qtype: Q, gate_up: tuple | None = None) -> Layer:
    """Random experts of shape s (gate/up Q4_K, down `down_qtype`); gate_up: (gate, up, their table) of another
    layer to share."""
    # logits about N(0, 1) on inputs of X_SCALE: picks that vary by token, no near-ties at float32's rounding
    router = (rng.standard_normal((s.n_expert, s.n_embd)) / (X_SCALE * np.sqrt(s.n_embd))).astype(np.float32)
    if gate_up is None:
        gate, up = (random_matrix(rng, Shape(name, s.n_expert * s.n_ff, s.n_embd, Q.Q4_K, 0)) for name in ("g", "u"))
        # interleaving the stacks interleaves each expert's rows (CudaOps.experts)
        gate_up = gate, up, moe.resident(upload(interleave_rows(gate, up, GATE_ROWS)), s.n_expert)
    down = random_matrix(rng, Shape("down", s.n_expert * s.n_embd, s.n_ff, down_qtype, 0))
    return Layer(s, router, gate_up[0], gate_up[1], down, upload(pack(router, Q.F32, router.shape)), gate_up[2],
                 moe.resident(upload(down), s.n_expert))


@dataclass
class Buffers:
    """The FFN's device arrays for n tokens (CudaOps takes them from its pools)."""

    x: object
    h: object
    parts: object
    logits: object
    ids: object
    weights: object
    grouping: moe.Grouping
    act_out: object
    outs: object
    out: object

    @classmethod
    def allocate(cls, s: MoeShape, x: np.ndarray, stream) -> Buffers:
        n = len(x)

        def alloc(shape, dtype):
            return cuda.device_array(shape, dtype, stream=stream)

        return cls(cuda.to_device(x, stream=stream), cuda.to_device(x, stream=stream),
                   alloc(moe.router_parts(n, s.n_expert, s.n_embd), np.float32), alloc((n, s.n_expert), np.float32),
                   alloc((n, s.k), np.int32), alloc((n, s.k), np.float32),
                   moe.Grouping.allocate(alloc, n, s.k, s.n_expert, s.n_embd, s.n_ff),
                   alloc((n * s.k, s.n_ff), np.float32), alloc((n * s.k, s.n_embd), np.float32),
                   alloc((n, s.n_embd), np.float32))


def ffn(layer: Layer, b: Buffers, stream, stage=lambda name: None, blocks_per_sm: int = mm.BLOCKS_PER_SM) -> None:
    """out = x + the MoE FFN of h, as CudaOps.moe_ffn's n > 1 path (qwen3moe: top-k renormalised, SiLU, no shared
    expert); stage(name) is called before each stage's launches; blocks_per_sm: the grouped products' launch bound."""
    s = layer.shape
    stage("route")
    moe.route_prefill(layer.device_router, b.h, b.parts, b.logits, b.ids, b.weights, True, stream=stream)
    stage("experts")
    moe.grouped_experts(layer.gate_up, layer.device_down, s.n_ff, b.h, b.ids, s.n_expert, SILU, b.grouping,
                        b.act_out, b.outs, stream=stream, blocks_per_sm=blocks_per_sm)
    stage("combine")
    moe.combine(b.outs, b.grouping.pos, b.weights, b.x, b.out, stream=stream)


def reference(layer: Layer, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, the FFN's output without the residual) of tokens x [t, n_embd] in float64 (top-k renormalised)."""
    s, h = layer.shape, x.astype(np.float64)
    logits = h @ layer.router.astype(np.float64).T
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    ids = np.argsort(-p, axis=1, kind="stable")[:, : s.k]
    w = np.take_along_axis(p, ids, axis=1)
    w /= w.sum(axis=1, keepdims=True)
    out = np.zeros_like(h)
    for t in range(len(h)):
        for r, e in enumerate(ids[t]):
            gate, up, down = (dequantize_rows(m, e * rows, (e + 1) * rows).astype(np.float64)
                              for m, rows in ((layer.gate, s.n_ff), (layer.up, s.n_ff), (layer.down, s.n_embd)))
            g = gate @ h[t]
            out[t] += w[t, r] * (down @ (g / (1 + np.exp(-g)) * (up @ h[t])))
    return ids, out


def check(layer: Layer, b: Buffers, x: np.ndarray) -> dict:
    """The FFN's error on the first REF_TOKENS tokens against float64, and whether the router picked the same."""
    ids, want = reference(layer, x[:REF_TOKENS])
    got = b.out.copy_to_host()[:REF_TOKENS].astype(np.float64) - x[:REF_TOKENS]
    return {"ref_tokens": REF_TOKENS, "max_rel_err": float(np.abs(got - want).max() / np.abs(want).max()),
            "same_experts": bool((np.sort(b.ids.copy_to_host()[:REF_TOKENS], axis=1) == np.sort(ids, axis=1)).all())}


def routing(s: MoeShape, b: Buffers) -> dict:
    """How the token-slots spread over the experts, and the tiles the grouped products run."""
    per_expert = np.bincount(b.ids.copy_to_host().reshape(-1), minlength=s.n_expert)
    tiles = int((-(-per_expert // mm.TOKENS)).sum())
    return {"slots_per_expert_min": int(per_expert.min()), "slots_per_expert_median": float(np.median(per_expert)),
            "slots_per_expert_max": int(per_expert.max()), "experts_used": int((per_expert > 0).sum()),
            "tiles": tiles, "tile_rows_filled": float(per_expert.sum() / (tiles * mm.TOKENS)),
            "grid_tiles": moe.max_tiles(int(per_expert.sum()), s.n_expert)}


def replay_us(executable, stream, replays: int) -> float:
    """Median µs of a replay of a captured graph."""
    from lucekv.backends.cuda import launch_graph

    times = []
    for _ in range(replays + 1):  # the first replay uploads the graph
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        launch_graph(executable, stream)
        end.record(stream)
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end) * 1000)
    return statistics.median(times[1:])


def kernel_us(layer: Layer, b: Buffers, stream, replays: int, blocks_per_sm: int) -> list[dict]:
    """Each kernel's median µs inside the FFN's graph captured with an event node before every launch."""
    from lucekv.backends.cuda import capture_graph, launch_graph
    from lucekv.bench.kernel_profile import LaunchRecorder

    recorder = LaunchRecorder(stream)

    def stage(name: str) -> None:
        recorder.op = name

    def record() -> None:
        ffn(layer, b, stream, stage, blocks_per_sm)
        recorder.mark("end", "", 0)

    with recorder.patched():
        recorder.active = True
        try:
            executable, _ = capture_graph(stream, record)
        finally:
            recorder.active = False
    per_launch: list[list[float]] = [[] for _ in recorder.marks[:-1]]
    for _ in range(replays + 1):
        launch_graph(executable, stream)
        stream.synchronize()
        for i, times in enumerate(per_launch):
            times.append(cuda.event_elapsed_time(recorder.events[i], recorder.events[i + 1]) * 1000)
    return [{"stage": op, "kernel": kernel, "us": statistics.median(times[1:])}
            for (op, kernel, _), times in zip(recorder.marks[:-1], per_launch, strict=True)]


def bench_layer(layer: Layer, n: int, replays: int, rng: np.random.Generator) -> dict:
    from lucekv.backends.cuda import capture_graph

    s, stream = layer.shape, cuda.stream()
    x = (X_SCALE * rng.standard_normal((n, s.n_embd))).astype(np.float32)
    b = Buffers.allocate(s, x, stream)
    ffn(layer, b, stream)  # compiles and loads every kernel outside the captures
    stream.synchronize()
    first = b.out.copy_to_host()
    result = {"tokens": n, "down": layer.down.kind, **check(layer, b, x), **routing(s, b), "variants": []}
    expert_bytes = sum(t.table.nbytes for t in (layer.gate_up, layer.device_down))
    flops = 2 * n * s.k * 3 * s.n_ff * s.n_embd
    for bound in moe.GROUPED_BLOCKS_PER_SM:  # the same code under another launch bound: the same output
        ffn(layer, b, stream, blocks_per_sm=bound)
        stream.synchronize()
        executable, edges = capture_graph(stream, lambda bound=bound: ffn(layer, b, stream, blocks_per_sm=bound))
        us = replay_us(executable, stream, replays)
        result["variants"].append({
            "blocks_per_sm": bound, "same_output": bool((b.out.copy_to_host() == first).all()), "ffn_us": us,
            "programmatic_edges": edges, "useful_tflops": flops / us / 1e6, "expert_mb": expert_bytes / 1e6,
            "expert_gbps": expert_bytes / us / 1e3, "kernels": kernel_us(layer, b, stream, replays, bound)})
    return result


def print_result(r: dict) -> None:
    print(f"{r['tokens']} tokens, down {r['down']}: error {r['max_rel_err']:.2e}, same experts {r['same_experts']}; "
          f"slots per expert {r['slots_per_expert_min']}..{r['slots_per_expert_max']} (median "
          f"{r['slots_per_expert_median']:.0f}), {r['tiles']} tiles ({r['tile_rows_filled']:.0%} filled) of a grid of "
          f"{r['grid_tiles']}")
    for v in r["variants"]:
        print(f" grouped products at {v['blocks_per_sm']} blocks per SM: FFN {v['ffn_us']:.1f} us "
              f"({v['useful_tflops']:.1f} useful TFLOP/s, {v['expert_mb']:.0f} MB of experts at "
              f"{v['expert_gbps']:.0f} GB/s), output as the first: {v['same_output']}")
        total = sum(k["us"] for k in v["kernels"])
        for k in v["kernels"]:
            print(f"  {k['stage']:8s} {k['kernel']:26s} {k['us']:9.1f} us {k['us'] / total:6.1%}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512", help="prompt lengths, e.g. 128,512")
    ap.add_argument("--down", default="q6,q4", help="the down experts' kinds (q6: Q6_K, q4: Q4_K)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    gate_up, results = None, []
    for kind in a.down.split(","):
        layer = build_layer(rng, A3B, DOWN_KINDS[kind], gate_up)
        gate_up = layer.gate, layer.up, layer.gate_up
        for n in (int(t) for t in a.tokens.split(",")):
            results.append(bench_layer(layer, n, a.replays, rng))
            print_result(results[-1])
    write_json(a.json, {"bench": "moe_speed", "commit": git_commit(), "device": device_name(cuda.get_current_device()),
                        "model": "random weights, one Qwen3-30B-A3B-shaped MoE layer (gate/up Q4_K)",
                        "shape": A3B.__dict__, "command": "python -m lucekv.bench.moe_speed --tokens "
                        f"{a.tokens} --down {a.down} --replays {a.replays}", "results": results})


if __name__ == "__main__":
    main()
