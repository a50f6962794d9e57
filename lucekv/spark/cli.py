"""`lucekv spark calibrate` and `lucekv spark validate`: placements from routing traces, checked on held-out ones."""

from __future__ import annotations

import argparse
import json
import re

from lucekv.errors import UnsupportedModelError
from lucekv.model.gguf import GGUFFile, open_gguf
from lucekv.spark.placement import Placement, calibrated, cold_per_token, uniform
from lucekv.spark.trace import RoutingTrace

GIB = 1 << 30
_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_\w+_exps\.weight")


def expert_bytes(g: GGUFFile) -> list[int]:
    """One expert's bytes in each layer: its slices of the layer's stacked `ffn_*_exps` tensors."""
    n_expert = int(g.metadata.get(f"{g.arch}.expert_count", 0))
    if n_expert <= 0:
        raise UnsupportedModelError(f"{g.path.name} is not a mixture of experts ({g.arch}.expert_count is missing)")
    per_layer: dict[int, int] = {}
    for name, t in g.tensors.items():
        if m := _EXPERT_TENSOR.fullmatch(name):
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + t.data.nbytes // n_expert
    return [per_layer[layer] for layer in sorted(per_layer)]


def add_spark_commands(subparsers: argparse._SubParsersAction) -> None:
    spark = subparsers.add_parser("spark", help="MoE expert placement from routing traces")
    commands = spark.add_subparsers(dest="spark_command", metavar="COMMAND", required=True)
    cal = commands.add_parser("calibrate", help="place experts under a GPU byte budget from a routing trace")
    cal.add_argument("model", help="the MoE GGUF the trace was recorded on")
    cal.add_argument("trace", help="routing trace JSON")
    cal.add_argument("--expert-vram", type=float, required=True, metavar="GIB", help="GPU memory for experts, GiB")
    cal.add_argument("--min-per-layer", type=int, default=1, help="experts every layer keeps (default 1)")
    cal.add_argument("-o", "--output", required=True, help="placement JSON to write")
    cal.set_defaults(func=cmd_calibrate)
    val = commands.add_parser("validate", help="cold expert selections per token of a placement on held-out "
                              "traffic, beside a uniform placement of the same bytes")
    val.add_argument("model")
    val.add_argument("placement", help="placement JSON")
    val.add_argument("trace", help="routing trace JSON of held-out traffic")
    val.set_defaults(func=cmd_validate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    g = open_gguf(args.model)
    trace = RoutingTrace.load(args.trace, g.fingerprint)
    sizes = expert_bytes(g)
    placement = calibrated(trace, sizes, int(args.expert_vram * GIB), args.min_per_layer)
    placement.save(args.output)
    total = sum(sizes) * trace.n_expert
    print(f"{sum(len(h) for h in placement.hot)} of {trace.n_expert * trace.n_layer} experts resident, "
          f"{placement.bytes(sizes) / GIB:.2f} of {total / GIB:.2f} GiB; trace of {trace.tokens} tokens: "
          f"{cold_per_token(placement, trace):.2f} cold selections per token")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    g = open_gguf(args.model)
    placement = Placement.load(args.placement, g.fingerprint)
    held_out = RoutingTrace.load(args.trace, g.fingerprint)
    sizes = expert_bytes(g)
    budget = placement.bytes(sizes)
    naive = uniform(g.fingerprint, placement.n_expert, sizes, budget)
    print(json.dumps({"tokens": held_out.tokens, "placement_bytes": budget,
                      "cold_per_token": cold_per_token(placement, held_out),
                      "uniform_cold_per_token": cold_per_token(naive, held_out),
                      "selections_per_token": held_out.top_k * held_out.n_layer}, indent=1))
    return 0
