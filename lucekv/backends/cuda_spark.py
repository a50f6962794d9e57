"""Spark storage on the CUDA backend (DESIGN §7): per MoE layer, a GPU table of len(hot) + spare expert slots; every
expert in pinned host memory mapped into the device's address space; a device remap [layer, expert] -> slot or COLD,
which the MoE kernels read (lucekv.kernels.cuda.moe.ExpertTable). lucekv.spark.cache.ExpertSlots decides; this
moves the bytes.

The cold path: a COLD expert is read by the same kernels straight from the mapped host copy, over PCIe (zero copy,
~50 GB/s against HBM's ~3 TB/s). lucebox instead syncs the host at every MoE layer and runs cold experts on the CPU:
that cuts the step into a piece per layer, each paying launches and a round trip (a numba launch costs 24-53 us, a
replayed graph's 0.5 us: shared/GPU.md), while reading an expert over PCIe costs what copying it costs, with no sync.
So the decode step stays ONE captured graph whatever is resident; prefill's grouped matmul reads cold experts
through the mapping too (a tile of 64 tokens per read of the expert).

The cache: after each one-token step the host reads the step's expert ids (n_layer x k int32, copied with its
token), and after each step of decode rows (several sequences' tokens, synchronous) every row's, `ExpertSlots.admit`
picks fills from the step's experts, and their copies run on a stream of their own. The device remap changes only
between steps, on the compute stream (so never under a replay that reads it): an evicted expert turns COLD at once,
and the fills' copies wait until every step enqueued before that remap has finished (the last ones that may read
the evicted experts' slots); a filled expert shows in the remap of the next step boundary, which waits for its copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lucekv.errors import ConfigError
from lucekv.kernels.cpu.quants import PackedMatrix
from lucekv.kernels.cuda import SIMULATOR, cuda
from lucekv.kernels.cuda._numba import device_zeros, ordering_event
from lucekv.kernels.cuda.moe import ExpertTable
from lucekv.kernels.cuda.packed import DeviceMatrix, upload
from lucekv.model.arch import ModelSpec
from lucekv.spark.cache import COLD, ExpertSlots, Fill
from lucekv.spark.placement import Placement, Swap, promotions
from lucekv.spark.trace import RoutingTrace, check_fingerprint

SYNC_TURN = 2  # the readback buffer of steps that ran synchronously (two turns are run-ahead steps')


@dataclass(frozen=True)
class SparkOptions:
    """Which experts live on the GPU (`placement`), how many spare slots per layer cache cold ones, and how many placed
    experts may be swapped for busier cold ones at each request's end (`promote`, see SparkStore.promote)."""

    placement: Placement
    spare: int = 0
    promote: int = 0


@dataclass
class SparkStats:
    """Decode steps seen (one-token steps and steps of decode rows) and their tokens (a row each), their expert
    selections, those a step read cold (over PCIe), copies into spare slots."""

    steps: int = 0
    tokens: int = 0
    selections: int = 0
    cold: int = 0
    fills: int = 0
    promotions: int = 0

    def to_json(self) -> dict:
        return {"steps": self.steps, "tokens": self.tokens, "selections": self.selections, "cold": self.cold,
                "fills": self.fills, "promotions": self.promotions,
                "cold_per_token": self.cold / self.tokens if self.tokens else 0.0,
                "fills_per_token": self.fills / self.tokens if self.tokens else 0.0}


class SparkStore:
    """The expert tables, the mapped host copy, the device remap and the cache's copies of one CUDA backend."""

    def __init__(self, options: SparkOptions, spec: ModelSpec, fingerprint: str, stream, max_rows: int = 1):
        """max_rows: the most decode rows a step holds (CudaBackend.max_rows, a bucket of graphs)."""
        self.fingerprint = fingerprint
        p = options.placement
        self.slots = self._checked(options, spec.n_layer, spec.n_expert)
        self.stream = stream
        self.copies = cuda.stream()
        n_layer, k = spec.n_layer, spec.n_expert_used
        self._visible = self.slots.remap.copy()  # what the device remap holds (replaced, never changed in place)
        self.remap = cuda.to_device(self._visible, stream=stream)
        self.remap_rows = [self.remap[layer] for layer in range(n_layer)]  # views made once (numba's are slow)
        # the expert ids of the latest one-token step, per layer (CudaOps.moe_ffn writes them there)
        self.routed = device_zeros((n_layer, 1, k), np.int32, stream)
        self.routed_rows = [self.routed[layer] for layer in range(n_layer)]
        self._routed_host = cuda.pinned_array((3, n_layer, 1, k), np.int32)  # two run-ahead turns and SYNC_TURN
        # the expert ids of the latest step of decode rows, per layer and row (CudaOps.moe_ffn writes `rows_ids`)
        self.routed_rows_of_step = device_zeros((n_layer, max_rows, k), np.int32, stream) if max_rows > 1 else None
        self._rows_views: dict[tuple[int, int], object] = {}
        self._rows_host = cuda.pinned_array((n_layer, max_rows, k), np.int32)
        self._step_remap = [self._visible] * 3  # the remap each turn's step read
        self._remap_host = cuda.pinned_array((2, n_layer, p.n_expert), np.int32)
        self._remap_sent: list = [None, None]  # per turn: the event after its upload, once made
        self._remap_turn = 0
        self._copies_done = None  # event after the latest boundary's fill copies
        self._pending: list[Fill] = []  # fills whose experts the device remap does not show yet
        self._tables: list[list[tuple[ExpertTable, int]]] = [[] for _ in range(n_layer)]
        self.table_bytes = 0  # GPU bytes of the expert tables
        self.host_bytes = 0  # pinned host bytes of the experts' copy
        self.stats = SparkStats()
        self.trace: RoutingTrace | None = None  # where set, one-token steps' selections are counted in it
        self.max_swaps = options.promote
        self.live = RoutingTrace.empty(fingerprint, n_layer, p.n_expert, k)  # selections since the last promotion

    def _checked(self, options: SparkOptions, n_layer: int, n_expert: int) -> ExpertSlots:
        """The slots of a placement of this model (another model's, or another layout, is refused)."""
        p = options.placement
        check_fingerprint(p.fingerprint, self.fingerprint, "expert placement")
        if (p.n_layer, p.n_expert) != (n_layer, n_expert):
            raise ConfigError(f"the expert placement has {p.n_layer} layers x {p.n_expert} experts, the model "
                              f"{n_layer} x {n_expert}")
        return ExpertSlots(p, options.spare)

    def place(self, options: SparkOptions) -> None:
        """Another placement and cache size on the live store: new tables (the placed experts copied in from the host
        copy), the remap and the counts from scratch. The caller has drained the streams and drops its captured
        graphs (they hold the old tables' addresses)."""
        self.slots = self._checked(options, len(self._tables), self.slots.placement.n_expert)
        self.table_bytes = 0
        for layer, tables in enumerate(self._tables):
            for t, rows in tables:
                t.table = self._table(layer, t.host, rows)
                self.table_bytes += t.table.nbytes
        self._visible = self.slots.remap.copy()
        self.remap.copy_to_device(self._visible, stream=self.stream)
        self._step_remap = [self._visible] * 3
        self._pending, self._copies_done = [], None
        self.stats = SparkStats()
        self.max_swaps = options.promote
        self.live.counts[:] = 0
        self.stream.synchronize()

    def experts(self, layer: int, m: PackedMatrix, rows_per_expert: int) -> ExpertTable:
        """One stacked expert matrix of `layer`: all of it into mapped host memory, the placement's experts into the
        first slots of a GPU table of `slots(layer)` experts."""
        host = upload(m, place=_mapped)
        t = ExpertTable(self._table(layer, host, rows_per_expert), host, self.remap_rows[layer])
        self._tables[layer].append((t, rows_per_expert))
        self.table_bytes += t.table.nbytes
        self.host_bytes += host.nbytes
        return t

    def _table(self, layer: int, host: DeviceMatrix, rows_per_expert: int) -> DeviceMatrix:
        """The GPU table of `layer`'s slots for the host copy's matrix, the placed experts copied into the first."""
        rows = max(self.slots.slots(layer), 1) * rows_per_expert

        def table_array(a):
            if a.shape[0] == host.rows:
                return cuda.device_array((rows, *a.shape[1:]), a.dtype, stream=self.stream)
            return cuda.to_device(np.zeros(a.shape, a.dtype), stream=self.stream)  # a stand-in, never read

        table = DeviceMatrix(host.kind, rows, host.cols, host.block_log2, host.group_log2,
                             *(table_array(a) for a in (host.codes, host.high, host.scales, host.subs)),
                             host.sub_scaled, host.has_bias, host.half_scale)
        for slot, e in enumerate(self.slots.placement.hot[layer]):
            _copy_expert(table, host, rows_per_expert, e, slot, self.stream)
        return table

    # ---- step boundaries ----

    def enqueue_readback(self, turn: int) -> None:
        """After a one-token step was enqueued: the copy of its expert ids to the host, on the same stream."""
        _copy_to_host(self._routed_host[turn], self.routed, self.stream)
        self._step_remap[turn] = self._visible

    def step_done(self, turn: int) -> None:
        """The step of `turn` has finished (its readback arrived): see `_step_done`."""
        self._step_done(self._routed_host[turn].reshape(len(self._tables), -1), self._step_remap[turn], 1)

    def rows_ids(self, layer: int, rows: int):
        """Where a step of `rows` decode rows leaves `layer`'s expert ids [rows, k] (a view made once per shape)."""
        view = self._rows_views.get((layer, rows))
        if view is None:
            view = self._rows_views[layer, rows] = self.routed_rows_of_step[layer, :rows]
        return view

    def observe_rows(self, rows: int) -> None:
        """A step of decode rows whose first `rows` rows are sequences' tokens (the rest padding) has been enqueued:
        its expert ids read now (the stream drained) and its step boundary, as `step_done`'s."""
        _copy_to_host(self._rows_host, self.routed_rows_of_step, self.stream)
        self.stream.synchronize()
        self._step_done(self._rows_host[:, :rows].reshape(len(self._tables), -1), self._visible, rows)

    def _step_done(self, ids: np.ndarray, remap: np.ndarray, tokens: int) -> None:
        """A decode step of `tokens` tokens has finished, its expert ids [n_layer, tokens * k] on the host, `remap` the
        one it read: count its cold selections, and with spare slots admit its cold experts (the step's experts of
        every row alike) and publish the next remap (see the module's docstring)."""
        self.stats.steps += 1
        self.stats.tokens += tokens
        self.stats.selections += ids.size
        layers = np.broadcast_to(np.arange(len(ids))[:, None], ids.shape)
        self.stats.cold += int(np.count_nonzero(remap[layers, ids] == COLD))
        for trace in (self.trace, self.live if self.max_swaps else None):
            if trace is not None:
                np.add.at(trace.counts, (layers, ids), 1)  # rows may select the same expert
        if not self.slots.spare:
            if self._pending:  # a promotion's copies
                self._publish([])
            return
        fills = [f for layer in range(len(ids)) for f in self.slots.admit(layer, ids[layer])]
        self.stats.fills += len(fills)
        if fills or self._pending:
            self._publish(fills)

    def promote(self) -> list[Swap]:
        """Between requests: at most `max_swaps` placed experts swapped for cold ones the one-token steps since the
        last call selected more (placement.promotions, largest gain first); their copies go as the cache's fills do,
        shown from the next step boundary on. Returns the swaps."""
        if not self.max_swaps or not self.live.tokens:
            return []
        _, swaps = promotions(self.slots.placement, self.live, self.max_swaps)
        fills = self.slots.promote(swaps)
        if fills:
            self._publish(fills)
        self.stats.promotions += len(swaps)
        self.live.counts[:] = 0
        return swaps

    def observe_now(self) -> None:
        """A one-token step that ran synchronously (its stream drained): its readback and boundary now."""
        self.enqueue_readback(SYNC_TURN)
        self.stream.synchronize()
        self.step_done(SYNC_TURN)

    def _publish(self, fills: list[Fill]) -> None:
        visible = self.slots.visible(fills)
        if self._copies_done is not None:  # the previous boundary's fills show now: their copies first
            self._copies_done.wait(self.stream)
        self._remap_turn ^= 1
        turn = self._remap_turn
        if self._remap_sent[turn] is not None:
            self._remap_sent[turn].synchronize()  # the upload that last read this pinned buffer
        host = self._remap_host[turn]
        host[:] = visible
        _copy_to_device(self.remap, host, self.stream)
        sent = self._remap_sent[turn] = ordering_event()
        sent.record(self.stream)
        self._visible = visible
        self._copies_done = None
        if fills:
            sent.wait(self.copies)  # every step enqueued before this remap has finished: evicted slots are free
            for f in fills:
                for t, rows in self._tables[f.layer]:
                    _copy_expert(t.table, t.host, rows, f.expert, f.slot, self.copies)
            self._copies_done = ordering_event()
            self._copies_done.record(self.copies)
        self._pending = fills


def _mapped(a: np.ndarray):
    """`a` in pinned host memory mapped into the device's address space (the simulator: a device array)."""
    m = cuda.mapped_array(a.shape, a.dtype)
    if SIMULATOR:
        m.copy_to_device(a)
    else:
        np.copyto(m, a)
    return m


def _copy_expert(table: DeviceMatrix, host: DeviceMatrix, rows: int, expert: int, slot: int, stream) -> None:
    """Expert `expert`'s rows of every array of the host copy into slot `slot` of the table, enqueued on `stream`."""
    for dst, src in zip((table.codes, table.high, table.scales, table.subs),
                        (host.codes, host.high, host.scales, host.subs), strict=True):
        if dst.shape[0] != table.rows:
            continue  # a stand-in
        if SIMULATOR:
            dst[slot * rows:(slot + 1) * rows].copy_to_device(src[expert * rows:(expert + 1) * rows], stream=stream)
            continue
        from cuda.bindings import driver

        from lucekv.backends.cuda import _address, _check

        row = src.strides[0]
        _check(driver.cuMemcpyHtoDAsync(driver.CUdeviceptr(_address(dst) + slot * rows * row),
                                        src.ctypes.data + expert * rows * row, rows * row,
                                        driver.CUstream(int(stream.handle))))


def _copy_to_host(dst: np.ndarray, src, stream) -> None:
    from lucekv.backends.cuda import copy_to_host_async

    copy_to_host_async(dst, src, stream)


def _copy_to_device(dst, src: np.ndarray, stream) -> None:
    from lucekv.backends.cuda import copy_to_device_async

    copy_to_device_async(dst, src, stream)
