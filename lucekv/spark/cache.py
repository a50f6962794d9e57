"""The GPU's expert slots: the placement's experts pinned, a few spare slots per layer caching cold ones (LRU, behind
a frequency gate).

Pure bookkeeping, like the KVFlash pager: it decides which expert goes to which slot; the backend copies the
bytes (asynchronously, on a stream of its own) and keeps a device mirror of `remap`, which the decode step's
MoE product reads, so that the step stays one captured graph whatever is resident.

The gate (TinyLFU's idea): a cold expert takes a free spare at once, but evicts a cached one only when the layer
selected it more often lately than its victim. A step reads a cold expert over PCIe anyway; a fill reads it again
(a copy of the same bytes), so filling every miss doubles the PCIe traffic of experts used once. On i.i.d. Zipf
routing (s = 1, as the 30B-A3B speed model's router), 8 layers x 128 experts, top-8, the 56 most used of a calibration
trace placed + 8 spare, 1000 steps through this class: 10.42 cold selections and 0.83 fills per step; plain LRU
10.91 cold and 10.91 fills; the 64 most used placed and no cache 10.59 cold. (Traffic with locality, real text's,
is where a cache can beat the same bytes placed.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from lucekv.spark.placement import Placement, Swap

COLD = -1  # remap entry of an expert no slot holds
DECAY_STEPS = 128  # a layer's selection counts halve every this many steps: the gate weighs recent traffic


@dataclass(frozen=True)
class Fill:
    """Copy `expert`'s weights of `layer` into `slot`; `evicted` is the expert that held it (COLD if none)."""

    layer: int
    expert: int
    slot: int
    evicted: int


class ExpertSlots:
    """Per layer, slots 0 .. len(hot) - 1 hold the placement's experts for good and `spare` slots after them hold
    cold experts on demand. `remap[layer, expert]` is the expert's slot or COLD; `epoch` counts its changes."""

    def __init__(self, placement: Placement, spare: int):
        if spare < 0:
            raise ValueError(f"spare slots must be >= 0, not {spare}")
        self.placement = placement
        self.spare = spare
        self.remap = np.full((placement.n_layer, placement.n_expert), COLD, np.int32)
        for layer, ids in enumerate(placement.hot):
            self.remap[layer, list(ids)] = np.arange(len(ids), dtype=np.int32)
        self._cached = [OrderedDict[int, int]() for _ in placement.hot]  # expert -> spare slot, least recent first
        self._free = [list(range(len(ids), len(ids) + spare)) for ids in placement.hot]
        self._recent = np.zeros((placement.n_layer, placement.n_expert), np.float32)  # decayed selection counts
        self._steps = np.zeros(placement.n_layer, np.int64)
        self.epoch = 0

    def slots(self, layer: int) -> int:
        """Slots the layer's table has on the GPU."""
        return len(self.placement.hot[layer]) + self.spare

    def admit(self, layer: int, experts: Iterable[int]) -> list[Fill]:
        """Make a step's selected experts of `layer` resident where a spare slot allows: each cold one takes a free
        spare, or the least recently used spare of an expert not selected now if the layer selected the cold one
        more often lately (the gate). The others stay cold (served by the cold path). Cached experts selected now
        become the most recent. Returns the copies to make."""
        cached, free = self._cached[layer], self._free[layer]
        selected = list(dict.fromkeys(int(e) for e in experts))
        recent = self._recent[layer]
        recent[selected] += 1
        self._steps[layer] += 1
        if self._steps[layer] % DECAY_STEPS == 0:
            recent *= 0.5
        for e in selected:
            if e in cached:
                cached.move_to_end(e)
        fills = []
        for e in selected:
            if self.remap[layer, e] != COLD:
                continue
            if free:
                slot, evicted = free.pop(0), COLD
            else:
                evicted = next((old for old in cached if old not in selected), COLD)
                if evicted == COLD:
                    break  # every spare holds an expert this step needs
                if recent[e] <= recent[evicted]:
                    continue  # the gate: not busier than what it would evict
                slot = cached.pop(evicted)
                self.remap[layer, evicted] = COLD
            cached[e] = slot
            self.remap[layer, e] = slot
            fills.append(Fill(layer, e, slot, evicted))
        if fills:
            self.epoch += 1
        return fills

    def promote(self, swaps: Iterable[Swap]) -> list[Fill]:
        """Promotions (placement.promotions) on the live slots: each promoted expert takes its demoted one's placed
        slot, and the placement changes with it; a promoted expert a spare slot was caching frees that slot. Returns
        the copies to make, as `admit` does."""
        hot = [list(ids) for ids in self.placement.hot]
        fills = []
        for s in swaps:
            slot = int(self.remap[s.layer, s.demoted])
            if s.demoted not in hot[s.layer] or s.promoted in hot[s.layer]:
                raise ValueError(f"layer {s.layer}: {s.demoted} is not placed or {s.promoted} already is")
            if s.promoted in self._cached[s.layer]:
                self._free[s.layer].append(self._cached[s.layer].pop(s.promoted))
            self.remap[s.layer, s.demoted] = COLD
            self.remap[s.layer, s.promoted] = slot
            hot[s.layer][hot[s.layer].index(s.demoted)] = s.promoted
            fills.append(Fill(s.layer, s.promoted, slot, s.demoted))
        if fills:
            self.placement = Placement(self.placement.fingerprint, self.placement.n_expert, tuple(map(tuple, hot)))
            self.epoch += 1
        return fills

    def visible(self, pending: Iterable[Fill]) -> np.ndarray:
        """The remap a device step may read while the `pending` fills' copies are on their way: their experts still
        COLD. A filled slot shows only once its copy has completed (the next step boundary's remap); an evicted
        expert is COLD at once, so no step enqueued after this remap reads the slot being overwritten."""
        remap = self.remap.copy()
        for f in pending:
            remap[f.layer, f.expert] = COLD
        return remap

    def cold(self, layer: int, experts: Iterable[int]) -> list[int]:
        """The experts among `experts` no slot holds."""
        return [int(e) for e in experts if self.remap[layer, int(e)] == COLD]
