"""Which experts live on the GPU: placement under a byte budget, from a routing trace (DESIGN §7).

`calibrated` is a greedy knapsack across layers: each layer first gets its `min_per_layer` most used experts,
then the budget goes, one expert at a time, to the expert with the most selections per byte (ties: the most
selections). One expert's bytes are the same within a layer, so within a layer the value falls with the rank
and the layers can be merged by a heap of their next candidates.
`uniform` is the naive placement a trace-free server would make: the same share of every layer.
A placement is checked on held-out traffic by its cold selections per token, and between requests its
weakest resident experts can be swapped for cold ones that live traffic uses more (`promotions`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lucekv.errors import ConfigError
from lucekv.spark.trace import RoutingTrace, _check_header, check_fingerprint, read_json, write_json

PLACEMENT_FORMAT = "lucekv.spark.placement"
PLACEMENT_VERSION = 1


@dataclass(frozen=True)
class Placement:
    fingerprint: str
    n_expert: int
    hot: tuple[tuple[int, ...], ...]  # per layer: the resident experts, most used first

    @property
    def n_layer(self) -> int:
        return len(self.hot)

    def mask(self) -> np.ndarray:
        """bool [n_layer, n_expert]: resident or not."""
        m = np.zeros((self.n_layer, self.n_expert), bool)
        for layer, ids in enumerate(self.hot):
            m[layer, list(ids)] = True
        return m

    def bytes(self, expert_bytes: Sequence[int]) -> int:
        return sum(len(ids) * b for ids, b in zip(self.hot, expert_bytes, strict=True))

    def table_bytes(self, expert_bytes: Sequence[int], spare: int) -> int:
        """GPU bytes of the expert tables that hold the placement and `spare` cache slots per layer (a table has one
        slot at least: backends/cuda_spark)."""
        return sum(max(len(ids) + spare, 1) * b for ids, b in zip(self.hot, expert_bytes, strict=True))

    def to_json(self) -> dict:
        return {"format": PLACEMENT_FORMAT, "version": PLACEMENT_VERSION, "fingerprint": self.fingerprint,
                "n_expert": self.n_expert, "hot": [list(ids) for ids in self.hot]}

    @classmethod
    def from_json(cls, doc: dict, fingerprint: str | None = None) -> Placement:
        """Raises ConfigError for another format or version, malformed contents, or another model's placement."""
        _check_header(doc, PLACEMENT_FORMAT, PLACEMENT_VERSION, "expert placement")
        try:
            placement = cls(str(doc["fingerprint"]), int(doc["n_expert"]),
                            tuple(tuple(int(e) for e in ids) for ids in doc["hot"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"expert placement is malformed: {e}") from None
        for layer, ids in enumerate(placement.hot):
            if len(set(ids)) != len(ids) or any(not 0 <= e < placement.n_expert for e in ids):
                raise ConfigError(f"expert placement is malformed: layer {layer} lists experts twice or outside "
                                  f"[0, {placement.n_expert})")
        check_fingerprint(placement.fingerprint, fingerprint, "expert placement")
        return placement

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path, fingerprint: str | None = None) -> Placement:
        return cls.from_json(read_json(path, "expert placement"), fingerprint)


def calibrated(trace: RoutingTrace, expert_bytes: Sequence[int], budget: int, min_per_layer: int = 1) -> Placement:
    """The experts to keep resident under `budget` bytes, `expert_bytes[layer]` being one expert's bytes there."""
    _check_sizes(trace.n_layer, trace.n_expert, expert_bytes, min_per_layer)
    ranked = [np.argsort(-trace.counts[layer], kind="stable") for layer in range(trace.n_layer)]
    taken = [min_per_layer] * trace.n_layer
    left = budget - sum(min_per_layer * b for b in expert_bytes)
    if left < 0:
        raise ConfigError(f"an expert budget of {budget} bytes holds less than {min_per_layer} expert(s) per layer "
                          f"({budget - left} bytes)")

    def candidate(layer: int) -> tuple | None:  # the layer's next expert, as a heap entry (best first)
        if taken[layer] == trace.n_expert:
            return None
        count = int(trace.counts[layer, ranked[layer][taken[layer]]])
        return -count / expert_bytes[layer], -count, layer

    heap = [c for layer in range(trace.n_layer) if (c := candidate(layer)) is not None]
    heapq.heapify(heap)
    while heap:
        _, _, layer = heapq.heappop(heap)
        if expert_bytes[layer] > left:
            continue  # nor will any later expert of this layer (same size) fit
        left -= expert_bytes[layer]
        taken[layer] += 1
        if (c := candidate(layer)) is not None:
            heapq.heappush(heap, c)
    hot = tuple(tuple(int(e) for e in ranked[layer][:n]) for layer, n in enumerate(taken))
    return Placement(trace.fingerprint, trace.n_expert, hot)


def uniform(fingerprint: str, n_expert: int, expert_bytes: Sequence[int], budget: int) -> Placement:
    """The naive placement without traces: the same number of experts in every layer (the lowest ids)."""
    per_layer = min(n_expert, budget // max(sum(expert_bytes), 1))
    return Placement(fingerprint, n_expert, tuple(tuple(range(per_layer)) for _ in expert_bytes))


def cold_per_token(placement: Placement, trace: RoutingTrace) -> float:
    """Selections of non-resident experts per token of `trace` (all layers): what the cold path must serve."""
    check_fingerprint(trace.fingerprint, placement.fingerprint, "routing trace")
    if trace.counts.shape != (placement.n_layer, placement.n_expert):
        raise ConfigError("the routing trace and the placement have different expert layouts")
    cold = int(trace.counts[~placement.mask()].sum())
    return cold / trace.tokens if trace.tokens else 0.0


@dataclass(frozen=True)
class Swap:
    layer: int
    demoted: int  # leaves the GPU
    promoted: int  # takes its place
    gain: int  # live selections of `promoted` minus those of `demoted`


def promotions(placement: Placement, live: RoutingTrace, max_swaps: int, min_gain: int = 1
               ) -> tuple[Placement, list[Swap]]:
    """At most `max_swaps` swaps, largest gain first, each trading a layer's least used resident expert (by the
    live counts) for its most used cold one when that one has at least `min_gain` more selections."""
    check_fingerprint(live.fingerprint, placement.fingerprint, "routing trace")
    hot = [list(ids) for ids in placement.hot]
    mask = placement.mask()
    swaps = []
    for layer, ids in enumerate(hot):
        cold = np.flatnonzero(~mask[layer])
        if not ids or not len(cold):
            continue
        counts = live.counts[layer]
        weakest = min(ids, key=lambda e: (counts[e], -e))
        best = int(cold[np.argmax(counts[cold])])
        gain = int(counts[best] - counts[weakest])
        if gain >= min_gain:
            swaps.append(Swap(layer, weakest, best, gain))
    swaps = sorted(swaps, key=lambda s: (-s.gain, s.layer))[:max_swaps]
    for s in swaps:
        hot[s.layer][hot[s.layer].index(s.demoted)] = s.promoted
    return Placement(placement.fingerprint, placement.n_expert, tuple(map(tuple, hot))), swaps


def _check_sizes(n_layer: int, n_expert: int, expert_bytes: Sequence[int], min_per_layer: int) -> None:
    if len(expert_bytes) != n_layer:
        raise ValueError(f"{len(expert_bytes)} expert sizes for {n_layer} layers")
    if not 0 <= min_per_layer <= n_expert:
        raise ValueError(f"min_per_layer {min_per_layer} must be in [0, {n_expert}]")
    if any(b <= 0 for b in expert_bytes):
        raise ValueError("expert sizes must be positive")
