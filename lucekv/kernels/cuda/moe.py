"""Mixture-of-experts kernels: the router, the decode products of the chosen experts, and the prefill grouped by
expert.

A layer's experts are stacked matrices (DeviceMatrix of n_expert * rows rows, expert e's rows e * rows ..): a kernel
takes expert e as a view of those rows (`expert_rows`), so the dense products' bodies and tiles run on it unchanged.
- The router: `router_logits` (one block per expert row, its columns over the block's threads; the token's RMSNorm
  taken by every block), then the softmax's top-k by a launch of its own (`route`: `_top_k`, one warp a token, the
  keys in registers). Expert ids and their weights stay on the device.
- Decode (`routed_matvecs`): the dense matvec bodies over the chosen experts, the expert ids read on the device, so
  a decode step stays one captured graph; one grid row per token, blocks by (slot, row block of the expert).
- Prefill (`grouped_experts`: `group`, `gather`, `grouped_matmul`): the token-slots sorted by expert on the device
  (per block of slots a histogram and each slot's rank, then a scan and a stable placement by every block), the
  normalized inputs gathered in that order as float16 pairs (as matmul.stage_halves stages a dense product's x),
  and the tensor-core matmul tile over each expert's run of rows (a tile map of (expert, first row) per grid row;
  grid rows past the last tile return at once: the grid is sized for the worst case, so a prefill graph replays
  whatever the routing). The router of a prompt piece is `route_prefill`: a tiled product, then a top-k per token.
- `combine`: each token's expert outputs weighted and summed in rank order, plus the residual and, where the model
  has one, the shared expert scaled by the sigmoid of its gate: the weighted scatter back. A decode step's down
  products do it themselves (`routed_sum`: the chosen experts' rows of a block summed in the block, in rank order),
  a launch less per layer.

The products take a layer's experts as an `ExpertTable` (Spark, DESIGN §7): a GPU table of slots, every expert in
host memory mapped into the device's address space, and a device `remap` from expert to slot. A kernel reads
`remap[e]` and takes the expert's rows from its slot, or, COLD, straight from the mapped host copy over PCIe: no
sync, no host compute, the same launches whatever is resident, so a captured graph replays any residency (remap is
data). All experts resident is the table alone with the identity remap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lucekv.kernels.cuda import matmul as mm
from lucekv.kernels.cuda import matvec as mv
from lucekv.kernels.cuda._numba import (
    NEG_INF,
    WARP,
    await_grid,
    bits_f32,
    block_sum,
    blocks,
    cuda,
    f32_bits,
    jit_bounded,
    jit_kernel,
    warp_max,
    warp_sum,
)
from lucekv.kernels.cuda.packed import GATE_ROWS, DeviceMatrix, Quant, as_epilogue, element_decoder, epilogue, put

ID_BITS = 8  # the top-k's keys hold an expert in their low 8 bits (see _pick)
MAX_EXPERTS = 1 << ID_BITS  # the top-k holds a token's logits in registers: 8 per lane
PER_LANE = MAX_EXPERTS // WARP
PARTIALS, PRODUCT_WARPS = mv.PARTIALS, mv.MAX_WARPS  # the matvec bodies' shared arrays
# a router block takes an expert row over its threads, ROUTER_COLUMNS columns a thread held in registers, their loads
# issued together (a warp per row was latency-bound: 64 loads in turn per lane at n_embd 2048, 38 us a layer of the
# 30B-A3B shape on an H100, a quarter of its decode step; a block per row: 212 decode tok/s there, from 178, but
# still a loop of 16 loads in turn per thread). A prefill's block takes ROUTER_PREFILL_ROWS rows in turn, so that the
# token's RMSNorm, which every block takes, is not taken once per expert (prefill fell from 1659 to 975 tok/s).
ROUTER_COLUMNS = 16
ROUTER_MAX_THREADS = 1024  # rows up to ROUTER_COLUMNS x that wide
ROUTER_WARPS = ROUTER_MAX_THREADS // WARP  # a module constant: a kernel's shared array needs a literal size
ROUTER_PREFILL_ROWS = 16
ROUTER_TILE = 32  # tokens and experts per block of the prefill's router (`route_prefill`)
ROUTER_SPLIT = 256  # columns per block of it: each block makes a part of its logits
ROUTER_TILE_THREADS = 256  # a thread per 2 tokens x 2 experts
ROUTER_STRIDE = ROUTER_TILE + 1  # its shared rows, padded so that the staging's stores hit 32 banks
GROUP_SLOTS = MAX_EXPERTS  # token-slots per block of the grouping, a thread each (and a thread per expert)
THREADS = 256
TAKEN = np.int64(-1)  # the key of an expert already picked, or of none (every key of an expert is >= 0)


def unsupported(n_expert: int, n_embd: int, k: int = 1) -> str | None:
    if n_expert > MAX_EXPERTS:
        return f"{n_expert} experts (the CUDA router takes up to {MAX_EXPERTS})"
    if k > WARP:
        return f"{k} experts a token (the CUDA top-k takes up to {WARP}: a lane a pick)"
    if n_embd > ROUTER_COLUMNS * ROUTER_MAX_THREADS:
        return f"n_embd {n_embd} (the CUDA router takes up to {ROUTER_COLUMNS * ROUTER_MAX_THREADS})"
    return None


@cuda.jit(device=True, inline=True)
def expert_rows(w, e, rows):
    """Expert e of a stacked matrix of experts of `rows` rows each, as a matrix of its own (views of the arrays;
    stand-in arrays stay stand-ins: they are never read)."""
    r0 = e * rows
    return Quant(w.codes[r0:r0 + rows], w.high[r0:r0 + rows], w.scales[r0:r0 + rows], w.subs[r0:r0 + rows],
                 w.block_log2, w.group_log2, w.sub_scaled, w.has_bias)


@cuda.jit(device=True, inline=True)
def resident_rows(table, host, remap, e, rows):
    """Expert e's rows, as `expert_rows`: from its slot of the GPU table, or from the mapped host copy where the remap
    says COLD (negative)."""
    slot = remap[e]
    if slot >= 0:
        return expert_rows(table, slot, rows)
    return expert_rows(host, e, rows)


@dataclass
class ExpertTable:
    """One stacked expert matrix of a layer as the products read it: `table` holds slot s's expert at rows s * rows ..,
    `host` every expert e at rows e * rows .. (mapped pinned host memory, or `table` itself when all are resident),
    `remap` int32 [n_expert] on the device: expert e's slot, or COLD (< 0) to read it from `host`."""

    table: DeviceMatrix
    host: DeviceMatrix
    remap: object

    @property
    def kind(self) -> str:
        return self.table.kind

    @property
    def cols(self) -> int:
        return self.table.cols

    @property
    def placed(self) -> bool:
        """Whether some experts may be cold: the products then read the remap (kernels of their own: the choice
        between two matrices costs registers, and spills, that all-resident products need not pay)."""
        return self.host is not self.table

    def args(self) -> tuple:
        return self.table.quant, self.host.quant, self.remap


_identities: dict[int, object] = {}


def resident(w: DeviceMatrix, n_expert: int, stream=0) -> ExpertTable:
    """Every expert of `w` on the GPU, slot e holding expert e."""
    if n_expert not in _identities:
        _identities[n_expert] = cuda.to_device(np.arange(n_expert, dtype=np.int32), stream=stream)
    return ExpertTable(w, w, _identities[n_expert])


# ---- the router -------------------------------------------------------------------------------------------


@dataclass
class Routing:
    """Each token's chosen experts as the routed products take them: ids [n, k] (int32) and weights [n, k] (float32),
    made before them (`route`, `route_prefill`)."""

    ids: object
    weights: object


def route(router: DeviceMatrix, x, norm: tuple | None, logits, ids, weights, renormalise: bool, stream=0) -> None:
    """ids [n, k] (int32) and weights [n, k] (float32) of each row of x [n, n_embd]: the k most probable experts of
    the softmax of router @ h, most probable first (the lower id among equals), weighted by their probabilities
    (divided by their sum where `renormalise`); h = RMSNorm(x) * norm[0] with norm = (weight, eps), or x.
    logits: float32 scratch [>= n, n_expert]. Two launches: `router_logits`, then a warp per token picks."""
    if why := unsupported(router.rows, router.cols, ids.shape[1]):
        raise ValueError(why)
    router_logits(router, x, norm, logits, stream)
    _top_k[x.shape[0], WARP, stream](logits, ids, weights, renormalise)


def router_logits(router: DeviceMatrix, x, norm: tuple | None, logits, stream=0) -> None:
    """logits[t] = router @ h[t] for each row of x [n, n_embd], h as `route` says (logits: float32 [>= n, n_expert]):
    one block per expert row, its columns over the block's threads (a prefill's block takes ROUTER_PREFILL_ROWS rows
    in turn), the token's RMSNorm taken by every block."""
    n_expert = router.rows
    if why := unsupported(n_expert, router.cols):
        raise ValueError(why)
    xnorm = (x, np.float32(0), False) if norm is None else (norm[0].reshape(1, -1), np.float32(norm[1]), True)
    n = x.shape[0]
    rows = 1 if n == 1 else ROUTER_PREFILL_ROWS
    threads = blocks(blocks(router.cols, ROUTER_COLUMNS), WARP) * WARP
    _ROUTERS[router.kind][(blocks(n_expert, rows), n), threads, stream](router.quant, x, xnorm, logits, rows)


def _make_router(kind: str):
    at = element_decoder(kind)

    @cuda.jit(device=True, inline=True)
    def load_row(w, e, cols, wv):
        """Row e of the router over this thread's columns (zeros past the end) into wv, every load in flight at once."""
        for j in range(ROUTER_COLUMNS):
            c = cuda.threadIdx.x + j * cuda.blockDim.x
            wv[j] = at(w, e, c) if c < cols else np.float32(0)

    def kernel(w, x, xnorm, logits, rows):
        sums = cuda.shared.array(ROUTER_WARPS, np.float32)
        h = cuda.local.array(ROUTER_COLUMNS, np.float32)
        wv = cuda.local.array(ROUTER_COLUMNS, np.float32)
        t = cuda.blockIdx.y
        n_expert, cols = w.codes.shape[0], x.shape[1]
        first = cuda.blockIdx.x * rows
        load_row(w, first, cols, wv)  # weights: their loads run while the kernel before finishes
        await_grid()
        for j in range(ROUTER_COLUMNS):
            c = cuda.threadIdx.x + j * cuda.blockDim.x
            h[j] = x[t, c] if c < cols else np.float32(0)
        scale_w, eps, on = xnorm
        if on:  # h = RMSNorm(x) * scale_w, the sum of squares taken by the whole block
            ss = np.float32(0)
            for j in range(ROUTER_COLUMNS):
                ss += h[j] * h[j]
            inv = np.float32(1) / math.sqrt(block_sum(ss, sums) / np.float32(cols) + eps)
            for j in range(ROUTER_COLUMNS):
                c = cuda.threadIdx.x + j * cuda.blockDim.x
                if c < cols:
                    h[j] = h[j] * inv * scale_w[0, c]
        for e in range(first, min(n_expert, first + rows)):
            if e > first:
                load_row(w, e, cols, wv)
            acc = np.float32(0)
            for j in range(ROUTER_COLUMNS):
                acc += h[j] * wv[j]
            acc = block_sum(acc, sums)
            if cuda.threadIdx.x == 0:
                logits[t, e] = acc

    kernel.__name__ = kernel.__qualname__ = f"_router_{kind}"
    return jit_kernel(kernel)


_ROUTERS = {kind: _make_router(kind) for kind in ("q4", "q6", "q8", "f32")}


@cuda.jit(device=True, inline=True)
def _pick(logits, t, k, renormalise):
    """Token t's top-k of the softmax of logits[t] (n_expert wide), as `route` says, by one warp: lane r < k gets
    pick r's (expert, weight). Lane l holds experts l, l + 32, .. as keys, a probability's bits above ID_BITS bits of
    MAX_EXPERTS - 1 - its expert (probabilities are >= 0: their bits order as they do), so that one warp maximum a
    pick finds the most probable, the lower expert among equals; the keys stay in registers (loops unrolled, no
    index by a variable). The probabilities, their sum and the weights are the float32 operations of the CPU
    backend's route, in the same order within a lane."""
    n_expert = logits.shape[1]
    lane = cuda.threadIdx.x % WARP
    p = cuda.local.array(PER_LANE, np.float32)
    keys = cuda.local.array(PER_LANE, np.int64)
    top = NEG_INF
    for j in range(PER_LANE):
        p[j] = logits[t, lane + WARP * j] if lane + WARP * j < n_expert else NEG_INF
        top = max(top, p[j])
    top = warp_max(top)
    total = np.float32(0)
    for j in range(PER_LANE):
        keys[j] = TAKEN
        if lane + WARP * j < n_expert:
            p[j] = math.exp(p[j] - top)
            total += p[j]
            keys[j] = (np.int64(f32_bits(p[j])) << ID_BITS) | (MAX_EXPERTS - 1 - lane - WARP * j)
    total = warp_sum(total)
    expert, weight, picked = -1, np.float32(0), np.float32(0)
    for r in range(k):
        best = keys[0]
        for j in range(1, PER_LANE):
            best = max(best, keys[j])
        best = warp_max(best)
        for j in range(PER_LANE):
            if keys[j] == best:  # (this lane's, alone: keys are distinct)
                keys[j] = TAKEN
        w = bits_f32(best >> ID_BITS) / total
        picked += w
        if lane == r:
            expert, weight = MAX_EXPERTS - 1 - (best & (MAX_EXPERTS - 1)), w
    if renormalise:
        weight /= picked
    return expert, weight


@cuda.jit(device=True, inline=True)
def _pick_row(logits, t, ids, weights, renormalise):
    """Token t's picks (`_pick`, the calling warp) into ids[t] and weights[t]."""
    k = ids.shape[1]
    expert, weight = _pick(logits, t, k, renormalise)
    lane = cuda.threadIdx.x % WARP
    if lane < k:
        ids[t, lane] = expert
        weights[t, lane] = weight


@jit_kernel
def _top_k(logits, ids, weights, renormalise):
    """Token blockIdx.x's picks, by one warp."""
    await_grid()
    _pick_row(logits, cuda.blockIdx.x, ids, weights, renormalise)


# ---- decode: the chosen experts' products ---------------------------------------------------------------------


def routed_matvecs(experts: ExpertTable, rows_per_expert: int, x, routing: Routing, out, x_per_slot: bool,
                   stream=0, norm: tuple | None = None, rows_per_block: int | None = None) -> None:
    """out[t * k + s] = expert ids[t, s] of the experts (rows rows_per_expert) times x[t] (x[t * k + s] where
    `x_per_slot`), for each token t of the routing's ids [n, k]; out: a device array or an Epilogue (a gated one for
    interleaved gate/up experts). norm: (weight, eps) to normalize x first (`matvec.fuses_norm`). rows_per_block: a
    block's rows instead of the matvec's choice (`block_rows`; benchmarks compare)."""
    n, k = routing.ids.shape
    ep = as_epilogue(out)
    w = experts.table
    if w.kind == "f32":
        if ep.gate or norm is not None:
            raise ValueError("float experts take plain products of normalized inputs")
        grid = (k * blocks(rows_per_expert, mv.F32_ROWS_PER_BLOCK), n)
        _routed_f32[grid, mv.F32_ROWS_PER_BLOCK * WARP, stream](w.codes, experts.host.codes, experts.remap,
                                                                rows_per_expert, x, routing.ids, x_per_slot, ep)
        return
    if norm is not None and not mv.fuses_norm(w):
        raise ValueError(f"no fused RMSNorm for a {w.kind} matrix of {w.cols} columns")
    xnorm = (x, np.float32(0), False) if norm is None else (norm[0].reshape(1, -1), np.float32(norm[1]), True)
    segments = blocks(w.cols, mv.SEGMENT)
    n_pass = blocks(segments, mv.MAX_WARPS)
    n_warps = blocks(segments, n_pass)
    rows = block_rows(w, k * rows_per_expert, bool(ep.gate), n_warps, rows_per_block)
    per_expert = blocks(rows_per_expert, rows)
    _ROUTED[w.kind, experts.placed][(k * per_expert, n), n_warps * WARP, stream](
        *experts.args(), rows_per_expert, x, xnorm, ep, n_pass, rows, per_expert, routing.ids, x_per_slot)


def _make_routed(kind: str, placed: bool):
    body = mv._BODIES[kind, "rows"]

    def kernel(table, host, remap, rows_per_expert, x, xnorm, ep, n_pass, rows_per_block, per_expert, ids, x_per_slot):
        await_grid()  # the expert ids are the router's output: no weight can be loaded before
        part = cuda.shared.array(PARTIALS, np.float32)
        sums = cuda.shared.array(PRODUCT_WARPS, np.float32)
        t = cuda.blockIdx.y
        slot = cuda.blockIdx.x // per_expert
        row = t * ids.shape[1] + slot
        if placed:  # a constant: the other branch is compiled out
            w = resident_rows(table, host, remap, ids[t, slot], rows_per_expert)
        else:
            w = expert_rows(table, ids[t, slot], rows_per_expert)
        body(w, x, row if x_per_slot else t, xnorm, ep, row, n_pass, rows_per_block, cuda.blockIdx.x % per_expert,
             part, sums)

    kernel.__name__ = kernel.__qualname__ = f"_routed_{kind}" + ("_placed" if placed else "")
    return mv._bounded(kernel)


_ROUTED = {(kind, placed): _make_routed(kind, placed) for kind in ("q4", "q6", "q8") for placed in (False, True)}


@jit_kernel
def _routed_f32(table, host, remap, rows_per_expert, x, ids, x_per_slot, ep):
    # one warp per row, as matvec's f32 kernel: float experts are for tests and tiny models
    await_grid()
    t = cuda.blockIdx.y
    per_expert = (rows_per_expert + mv.F32_ROWS_PER_BLOCK - 1) // mv.F32_ROWS_PER_BLOCK
    slot = cuda.blockIdx.x // per_expert
    r = (cuda.blockIdx.x % per_expert) * mv.F32_ROWS_PER_BLOCK + cuda.threadIdx.x // WARP
    lane = cuda.threadIdx.x % WARP
    row = t * ids.shape[1] + slot
    tx = row if x_per_slot else t
    e = ids[t, slot]
    at = remap[e]
    w = table if at >= 0 else host
    base = (at if at >= 0 else e) * rows_per_expert
    acc = np.float32(0)
    for c in range(lane, x.shape[1] if r < rows_per_expert else 0, WARP):
        acc += w[base + r, c] * x[tx, c]
    acc = warp_sum(acc)
    if lane == 0 and r < rows_per_expert:
        put(ep, row, r, acc)


# ---- decode: the down products summed back in the same launch --------------------------------------------------


def sums_routed(experts: ExpertTable, k: int) -> bool:
    """Whether `routed_sum` takes these experts for k chosen a token: quantized, a warp for each of the k (MAX_WARPS
    a block)."""
    return experts.kind != "f32" and k <= mv.MAX_WARPS


def block_rows(w: DeviceMatrix, rows: int, gated: bool, warps: int, given: int | None = None) -> int:
    """Rows per block of the routed products of `rows` rows in all (of blocks of `warps` warps): the dense matvec's
    choice (one wave of resident blocks), or `given`, checked: whole register buffers (and gate/up groups)."""
    if given is None:
        return mv._rows_per_block([(rows, w.kind, gated)], warps)[0]
    step = max(2 * mv.GROUP[w.kind], 2 * GATE_ROWS if gated else 0)
    if given % step or given > mv.MAX_ROWS_PER_BLOCK:
        raise ValueError(f"{given} rows a block: a multiple of {step} up to {mv.MAX_ROWS_PER_BLOCK}")
    return given


def routed_sum(experts: ExpertTable, rows_per_expert: int, x, routing: Routing, residual, out, shared=None,
               stream=0, rows_per_block: int | None = None) -> None:
    """out[t] = residual[t] + the sum over s, in rank order, of weights[t, s] * (expert ids[t, s] times x[t * k + s]),
    plus the shared expert as `combine` adds it: `routed_matvecs` and `combine` in one launch (where `sums_routed`).
    A block takes a few rows of every chosen expert, a warp (or a few) per slot over the columns, as the dense matvec's
    warps own column segments, and sums its rows itself in rank order: no atomics, bit-stable, and bit for bit the
    two launches' sums where a slot's warps cover its columns in one pass (k x segments <= MAX_WARPS).
    rows_per_block: as `routed_matvecs`'.
    The kernel reads ids, and loads its first rows of weights, before it waits for the kernel before it (overlapped
    launches, see _numba): ids must come from an earlier launch than that one (the router's, before the gate/up
    product)."""
    ids, weights = routing.ids, routing.weights
    n, k = ids.shape
    w = experts.table
    if not sums_routed(experts, k):
        raise ValueError(f"routed_sum: {k} {w.kind} experts a token (quantized, up to {mv.MAX_WARPS})")
    segments = blocks(w.cols, mv.SEGMENT)
    warps = min(segments, mv.MAX_WARPS // k)  # per slot
    n_pass = blocks(segments, warps)
    rows = block_rows(w, rows_per_expert, False, k * warps, rows_per_block)
    gate, values = (weights, residual) if shared is None else shared
    _ROUTED_SUM[w.kind, experts.placed][(blocks(rows_per_expert, rows), n), k * warps * WARP, stream](
        *experts.args(), rows_per_expert, x, (x, np.float32(0), False), ids, weights, residual, gate, values,
        shared is not None, out, warps, n_pass, rows)


def _make_routed_sum(kind: str, placed: bool):
    stream_rows = mv.STREAMS[kind]

    def kernel(table, host, remap, rows_per_expert, x, xnorm, ids, weights, residual, gate, shared, has_shared, out,
               warps, n_pass, rows_per_block):
        part = cuda.shared.array(PARTIALS, np.float32)
        sums = cuda.shared.array(PRODUCT_WARPS, np.float32)
        t = cuda.blockIdx.y
        k = ids.shape[1]
        warp = cuda.threadIdx.x // WARP
        slot = warp // warps
        e = ids[t, slot]  # before the wait: the router wrote it two launches back (see routed_sum)
        if placed:  # a constant: the other branch is compiled out
            w = resident_rows(table, host, remap, e, rows_per_expert)
        else:
            w = expert_rows(table, e, rows_per_expert)
        first_row = cuda.blockIdx.x * rows_per_block
        mv._clear_partials(part)
        stream_rows(w, x, t * k + slot, xnorm, out, t, n_pass, first_row, rows_per_block, warp % warps, warps, part,
                    sums)
        cuda.syncthreads()
        for i in range(cuda.threadIdx.x, rows_per_block, cuda.blockDim.x):
            r = first_row + i
            if r < rows_per_expert:
                acc = np.float32(0)
                for s in range(k):
                    value = np.float32(0)  # slot s's row: its warps' partials in order, as `matvec` sums them
                    for j in range(s * warps, (s + 1) * warps):
                        value += part[j * mv.MAX_ROWS_PER_BLOCK + i]
                    acc += value * weights[t, s]
                out[t, r] = _sum_back(acc, t, r, residual, gate, shared, has_shared)

    kernel.__name__ = kernel.__qualname__ = f"_routed_sum_{kind}" + ("_placed" if placed else "")
    return mv._bounded(kernel)


_ROUTED_SUM = {(kind, placed): _make_routed_sum(kind, placed) for kind in mv.TOKEN_KINDS for placed in (False, True)}


# ---- prefill: grouped by expert -------------------------------------------------------------------------------


def router_parts(n: int, n_expert: int, cols: int) -> tuple[int, int, int]:
    """The shape of `route_prefill`'s partial logits: a part per ROUTER_SPLIT columns, of each token and expert."""
    return blocks(cols, ROUTER_SPLIT), n, n_expert


def route_prefill(router: DeviceMatrix, h, parts, logits, ids, weights, renormalise: bool, stream=0) -> None:
    """`route` for n > 1 tokens of normalized input h [n, n_embd]: the logits as a tiled product over column splits
    (parts: float32 scratch of `router_parts`' shape; a 512-token prompt of 128 experts at n_embd 2048 is 512 blocks
    of 32 tokens x 32 experts x 256 columns), then per token one warp sums the parts in split order (no atomics: a
    replayed graph gives the eager logits bit for bit) into logits (scratch [>= n, n_expert]) and takes the top-k.
    (`router_logits`' blocks, each token's rows in turn, are for one token.)"""
    n, cols = h.shape
    n_expert = router.rows
    if why := unsupported(n_expert, cols, ids.shape[1]):
        raise ValueError(why)
    splits = blocks(cols, ROUTER_SPLIT)
    if parts.shape[0] < splits or parts.shape[1] < n or parts.shape[2] != n_expert:
        raise ValueError(f"route_prefill: parts {parts.shape} for {router_parts(n, n_expert, cols)}")
    grid = (blocks(n_expert, ROUTER_TILE), blocks(n, ROUTER_TILE), splits)
    _ROUTER_PARTS[router.kind][grid, ROUTER_TILE_THREADS, stream](router.quant, h, parts)
    _sum_top_k[n, WARP, stream](parts, splits, logits, ids, weights, renormalise)


def _make_router_parts(kind: str):
    at = element_decoder(kind)

    def kernel(w, x, parts):
        await_grid()
        xs = cuda.shared.array((ROUTER_TILE, ROUTER_STRIDE), np.float32)  # [column, token]
        ws = cuda.shared.array((ROUTER_TILE, ROUTER_STRIDE), np.float32)  # [column, expert]
        tid = cuda.threadIdx.x
        n, cols, n_expert = x.shape[0], x.shape[1], w.codes.shape[0]
        e0, t0 = cuda.blockIdx.x * ROUTER_TILE, cuda.blockIdx.y * ROUTER_TILE
        c_begin = cuda.blockIdx.z * ROUTER_SPLIT
        c_end = min(cols, c_begin + ROUTER_SPLIT)
        te, tt = 2 * (tid % 16), 2 * (tid // 16)  # this thread's experts te, te + 1 and tokens tt, tt + 1
        sc, sr = tid % ROUTER_TILE, tid // ROUTER_TILE  # staging: column sc of rows sr, sr + 8, ..
        a00, a01, a10, a11 = np.float32(0), np.float32(0), np.float32(0), np.float32(0)
        for c0 in range(c_begin, c_end, ROUTER_TILE):
            c = c0 + sc
            for i in range(ROUTER_TILE * ROUTER_TILE // ROUTER_TILE_THREADS):
                r = sr + i * (ROUTER_TILE_THREADS // ROUTER_TILE)
                xs[sc, r] = x[t0 + r, c] if t0 + r < n and c < c_end else np.float32(0)
                ws[sc, r] = at(w, e0 + r, c) if e0 + r < n_expert and c < c_end else np.float32(0)
            cuda.syncthreads()
            for kk in range(ROUTER_TILE):
                x0, x1, w0, w1 = xs[kk, tt], xs[kk, tt + 1], ws[kk, te], ws[kk, te + 1]
                a00 += x0 * w0
                a01 += x0 * w1
                a10 += x1 * w0
                a11 += x1 * w1
            cuda.syncthreads()
        z, t, e = cuda.blockIdx.z, t0 + tt, e0 + te
        _put_part(parts, z, t, e, a00)
        _put_part(parts, z, t, e + 1, a01)
        _put_part(parts, z, t + 1, e, a10)
        _put_part(parts, z, t + 1, e + 1, a11)

    kernel.__name__ = kernel.__qualname__ = f"_router_parts_{kind}"
    return jit_kernel(kernel)


_ROUTER_PARTS = {kind: _make_router_parts(kind) for kind in ("q4", "q6", "q8", "f32")}


@cuda.jit(device=True, inline=True)
def _put_part(parts, z, t, e, v):
    if t < parts.shape[1] and e < parts.shape[2]:
        parts[z, t, e] = v


@jit_kernel
def _sum_top_k(parts, splits, logits, ids, weights, renormalise):
    """Token blockIdx.x's logits, its parts summed in split order, then its top-k (one warp: lane l's experts are
    l, l + 32, .., those `_pick` reads back)."""
    await_grid()
    t = cuda.blockIdx.x
    n_expert = parts.shape[2]
    for e in range(cuda.threadIdx.x, n_expert, WARP):
        v = np.float32(0)
        for z in range(splits):
            v += parts[z, t, e]
        logits[t, e] = v
    _pick_row(logits, t, ids, weights, renormalise)


@dataclass
class Grouping:
    """A prefill's token-slots grouped by expert on the device (see `group`: runs, rows, tokens, tile map, the
    per-block counts) and the grouped products' inputs in that order, as float16 pairs (`gather`): the normalized
    inputs (`gathered`) and the activations between gate/up and down (`act_halves`)."""

    starts: object
    pos: object
    src: object
    tiles: object
    counts: object
    gathered: object
    act_halves: object

    @classmethod
    def allocate(cls, alloc, n: int, k: int, n_expert: int, n_embd: int, n_ff: int) -> Grouping:
        """The arrays of n tokens' top-k of n_expert experts; alloc(shape, dtype) gives a device array."""
        return cls(alloc((n_expert + 1,), np.int32), alloc((n, k), np.int32), alloc((n * k,), np.int32),
                   alloc((max_tiles(n * k, n_expert), 2), np.int32),
                   alloc((group_blocks(n * k), n_expert), np.int32), alloc((n * k, n_embd // 2), np.uint32),
                   alloc((n * k, n_ff // 2), np.uint32))


def grouped_experts(gate_up: ExpertTable, down: ExpertTable, n_ff: int, h, ids, n_expert: int, gate: int,
                    g: Grouping, act_out, outs, stream=0, blocks_per_sm: int = mm.BLOCKS_PER_SM) -> None:
    """outs[g.pos[t, s]] = the FFN of expert ids[t, s] on h[t] (gate and up interleaved, their activation `gate`
    applied by the product's epilogue into act_out [n * k, n_ff], then down), each expert's run of token-slots
    through the tensor-core tiles: the prefill's experts (CudaOps.moe_ffn, and bench.moe_speed times it).
    blocks_per_sm: see `grouped_matmul`."""
    group(ids, n_expert, g.starts, g.pos, g.src, g.tiles, g.counts, stream)
    gather(h, g.src, g.gathered, gate_up.kind, stream)
    grouped_matmul(gate_up, 2 * n_ff, g.gathered, g.starts, g.tiles, epilogue((act_out,), gate=gate), stream,
                   blocks_per_sm)
    mm.stage_halves(down.kind, act_out, g.act_halves, stream)
    grouped_matmul(down, h.shape[1], g.act_halves, g.starts, g.tiles, outs, stream, blocks_per_sm)


def max_tiles(n_rows: int, n_expert: int) -> int:
    """Tiles of mm.TOKENS rows that n_rows token-slots, grouped by expert, can need at most."""
    return blocks(n_rows, mm.TOKENS) + min(n_expert, n_rows)


def group_blocks(n_rows: int) -> int:
    """Blocks of the grouping of n_rows token-slots (the rows of `group`'s per-block counts)."""
    return blocks(n_rows, GROUP_SLOTS)


def group(ids, n_expert: int, starts, pos, src, tiles, counts, stream=0) -> None:
    """The n * k token-slots of ids [n, k] sorted by expert, stably (by token, then rank): expert e's run is rows
    starts[e] .. starts[e + 1] (starts: int32 [n_expert + 1]), slot (t, s) goes to row pos[t, s] ([n, k]), row p
    holds token src[p] ([n * k]); tiles [max_tiles, 2]: per tile of mm.TOKENS rows its expert and first row, expert
    -1 past the last. counts: int32 scratch [>= group_blocks(n * k), n_expert].

    Two launches over blocks of GROUP_SLOTS consecutive slots, a thread each: the first counts its block's slots per
    expert and ranks each slot among the block's earlier slots of its expert; the second places them: a slot's row is
    its expert's first row (the scan of all blocks' counts), plus its expert's count in the blocks before, plus its
    rank. (One block used to do it all, each thread walking all n * k slots for its experts: 4096 dependent steps a
    layer at the 30B-A3B shape's 512-token prefill.)"""
    n, k = ids.shape
    if n_expert > GROUP_SLOTS:
        raise ValueError(f"grouping {n_expert} experts: at most {GROUP_SLOTS}")
    grid = group_blocks(n * k)
    if counts.shape[0] < grid or counts.shape[1] < n_expert:
        raise ValueError(f"group: counts {counts.shape} for {grid} blocks of {n_expert} experts")
    _count[grid, GROUP_SLOTS, stream](ids, n_expert, pos, counts)
    _place[grid, GROUP_SLOTS, stream](ids, n_expert, counts, starts, pos, src, tiles)


@jit_kernel
def _count(ids, n_expert, rank, counts):
    """counts[b, e]: block b's slots of expert e; rank[t, s]: slot (t, s)'s place among its block's slots of its
    expert."""
    await_grid()
    experts = cuda.shared.array(GROUP_SLOTS, np.int32)
    hist = cuda.shared.array(GROUP_SLOTS, np.int32)
    tid = cuda.threadIdx.x
    n, k = ids.shape
    i = cuda.blockIdx.x * GROUP_SLOTS + tid
    hist[tid] = 0
    e = ids[i // k, i % k] if i < n * k else -1
    experts[tid] = e
    cuda.syncthreads()
    if e >= 0:
        cuda.atomic.add(hist, e, 1)
        before = 0
        for j in range(tid):
            if experts[j] == e:
                before += 1
        rank[i // k, i % k] = before
    cuda.syncthreads()
    if tid < n_expert:
        counts[cuda.blockIdx.x, tid] = hist[tid]


@jit_kernel
def _place(ids, n_expert, counts, starts, pos, src, tiles):
    await_grid()
    rows = cuda.shared.array(GROUP_SLOTS, np.int32)  # per expert: its rows, then the inclusive scan of them
    n_tiles = cuda.shared.array(GROUP_SLOTS, np.int32)  # per expert: its tiles, then their inclusive scan
    earlier = cuda.shared.array(GROUP_SLOTS, np.int32)  # per expert: its slots in the blocks before this one
    tid, b = cuda.threadIdx.x, cuda.blockIdx.x
    n, k = ids.shape
    before, total = 0, 0
    if tid < n_expert:
        for c in range(cuda.gridDim.x):
            count = counts[c, tid]
            total += count
            if c < b:
                before += count
    rows[tid], n_tiles[tid], earlier[tid] = total, (total + mm.TOKENS - 1) // mm.TOKENS, before
    cuda.syncthreads()
    step = 1
    while step < GROUP_SLOTS:  # the inclusive scans, Hillis-Steele
        row_sum = rows[tid - step] if tid >= step else 0
        tile_sum = n_tiles[tid - step] if tid >= step else 0
        cuda.syncthreads()
        rows[tid] += row_sum
        n_tiles[tid] += tile_sum
        cuda.syncthreads()
        step *= 2
    i = b * GROUP_SLOTS + tid
    if i < n * k:
        t, s = i // k, i % k
        e = ids[t, s]
        p = (rows[e - 1] if e > 0 else 0) + earlier[e] + pos[t, s]
        pos[t, s] = p
        src[p] = t
    if b == 0:  # the expert runs and the tile map
        if tid == 0:
            starts[n_expert] = rows[n_expert - 1]
        if tid < n_expert:
            first_row, first_tile = (rows[tid - 1], n_tiles[tid - 1]) if tid > 0 else (0, 0)
            starts[tid] = first_row
            for j in range(n_tiles[tid] - first_tile):
                tiles[first_tile + j, 0] = tid
                tiles[first_tile + j, 1] = first_row + j * mm.TOKENS
        for j in range(n_tiles[n_expert - 1] + tid, tiles.shape[0], GROUP_SLOTS):
            tiles[j, 0] = -1
            tiles[j, 1] = 0


def gather(x, src, out, kind: str, stream=0) -> None:
    """out[p] = x[src[p]] (x: float32 [n, cols]) as float16 pairs in the order a `kind` product's tile stages them
    (out: uint32 [n * k, cols // 2]; see matmul.stage_halves): the normalized inputs in expert order, rounded once
    for the grouped gate/up product, which then copies 16 bytes of them a thread and step (half float32's)."""
    cols = x.shape[1]
    if out.shape[1] * 2 != cols or cols % mm.K_STEP:
        raise ValueError(f"gather: x {x.shape} into {out.shape}: need [rows, cols // 2], cols a multiple of "
                         f"{mm.K_STEP}")
    _gather[blocks(out.size // 4, THREADS), THREADS, stream](x, src, *mm.x_order(kind), out)


@jit_kernel
def _gather(x, src, span, gap, out):
    await_grid()
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    parts = out.shape[1] >> 2
    if i < out.shape[0] * parts:
        p = i // parts
        mm.stage_words(x, src[p], span, gap, out, p, i % parts)


def grouped_matmul(experts: ExpertTable, rows_per_expert: int, x, starts, tiles, out, stream=0,
                   blocks_per_sm: int = mm.BLOCKS_PER_SM) -> None:
    """out[p] = expert e of the experts times x[p] for each row p of expert e's run (see `group`), on tensor cores
    (a cold expert's tiles read it through the host mapping); x: the rows' float16 pairs in the experts' staged order
    (`gather`, matmul.stage_halves); out: a device array or an Epilogue (a gated one for interleaved gate/up
    experts). blocks_per_sm: the launch bound the kernel is compiled for (GROUPED_BLOCKS_PER_SM, for the benchmark's
    comparison: at ~32 token-slots an expert the tile waits on loads and barriers more than it computes, and 3
    blocks of 8 warps fit an SM at 80 registers a thread, 16 to 48 bytes spilled by ptxas, against 2 at 128)."""
    w = experts.table
    if w.kind == "f32" or w.cols % mm.K_STEP or 2 * x.shape[1] != w.cols:
        raise ValueError(f"grouped matmul: {w.kind} experts of {w.cols} columns (quantized, a multiple of "
                         f"{mm.K_STEP}) times x {x.shape} (float16 pairs: half the columns)")
    kernel = _GROUPED[w.kind, 1 << w.block_log2, experts.placed, blocks_per_sm]
    kernel[(blocks(rows_per_expert, mm.ROWS), tiles.shape[0]), mm.THREADS, stream](
        *experts.args(), rows_per_expert, np.float32(w.half_scale), x, starts, tiles, as_epilogue(out))


def _make_grouped(kind: str, block: int, placed: bool, blocks_per_sm: int):
    tile = mm._make_tile(kind, block, mm.SHORT_TILE, halves=True)
    shared_tiles = mm.SHARED_TILES[mm.TOKENS]

    def kernel(table, host, remap, rows_per_expert, half_scale, x, starts, tiles, ep):
        await_grid()
        a_tile, x_tile = shared_tiles()
        e = tiles[cuda.blockIdx.y, 0]
        if e >= 0:  # the same for the whole block
            if placed:  # a constant: the other branch is compiled out
                w = resident_rows(table, host, remap, e, rows_per_expert)
            else:
                w = expert_rows(table, e, rows_per_expert)
            tile(w, rows_per_expert, half_scale, x, starts[e + 1], ep, cuda.blockIdx.x * mm.ROWS,
                 tiles[cuda.blockIdx.y, 1], a_tile, x_tile)

    kernel.__name__ = kernel.__qualname__ = (f"_grouped_{kind}_{block}" + ("_placed" if placed else "")
                                             + ("" if blocks_per_sm == mm.BLOCKS_PER_SM else f"_sm{blocks_per_sm}"))
    return jit_bounded(kernel, mm.THREADS, blocks_per_sm)


GROUPED_BLOCKS_PER_SM = (mm.BLOCKS_PER_SM, 3)  # launch bounds the grouped products are built for (see grouped_matmul)
_GROUPED = {(*key, placed, bound): _make_grouped(*key, placed, bound) for key in mm.TILES for placed in (False, True)
            for bound in GROUPED_BLOCKS_PER_SM}


# ---- the weighted sum back ------------------------------------------------------------------------------------


def combine(outs, pos, weights, residual, out, shared=None, stream=0) -> None:
    """out[t] = residual[t] + sum over s of weights[t, s] * outs[pos[t, s]], in rank order, plus shared[1][t] *
    sigmoid(shared[0][t, 0]) where `shared` = (gate logits [n, 1], shared expert output [n, n_embd])."""
    gate, values = (weights, residual) if shared is None else shared
    _combine[(blocks(out.shape[1], THREADS), out.shape[0]), THREADS, stream](outs, pos, weights, residual, gate,
                                                                             values, shared is not None, out)


@jit_kernel
def _combine(outs, pos, weights, residual, gate, shared, has_shared, out):
    await_grid()
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t = cuda.blockIdx.y
    if j < out.shape[1]:
        acc = np.float32(0)
        for s in range(pos.shape[1]):
            acc += outs[pos[t, s], j] * weights[t, s]
        out[t, j] = _sum_back(acc, t, j, residual, gate, shared, has_shared)


@cuda.jit(device=True, inline=True)
def _sum_back(acc, t, j, residual, gate, shared, has_shared):
    """Column j of token t's output: the residual plus acc, its experts' weighted sum, plus the shared expert's value
    scaled by the sigmoid of its gate where the model has one."""
    if has_shared:
        acc += shared[t, j] * (np.float32(1) / (np.float32(1) + math.exp(-gate[t, 0])))
    return residual[t, j] + acc
