"""A mixture-of-experts GGUF's experts: how many a layer has, and one expert's bytes in each layer (what placing it on
the GPU costs). Read from the file's metadata and tensor table only."""

from __future__ import annotations

import re

from lucekv.errors import UnsupportedModelError
from lucekv.model.gguf import GGUFFile

_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_\w+_exps\.weight")


def expert_count(g: GGUFFile) -> int:
    """Experts per layer; a dense model is refused."""
    n_expert = int(g.metadata.get(f"{g.arch}.expert_count", 0))
    if n_expert <= 0:
        raise UnsupportedModelError(f"{g.path.name} is not a mixture of experts ({g.arch}.expert_count is missing)")
    return n_expert


def expert_bytes(g: GGUFFile) -> list[int]:
    """One expert's bytes in each layer: its slices of the layer's stacked `ffn_*_exps` tensors."""
    n_expert = expert_count(g)
    per_layer: dict[int, int] = {}
    for name, t in g.tensors.items():
        if m := _EXPERT_TENSOR.fullmatch(name):
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + t.data.nbytes // n_expert
    return [per_layer[layer] for layer in sorted(per_layer)]
