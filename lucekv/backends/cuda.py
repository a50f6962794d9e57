"""CUDA backend: weights uploaded once and kept quantized, the KV slot pool on the GPU, numba.cuda kernels.

Activations are device arrays [n_tokens, width] float32; only the step's tokens / positions / slots go
up, and the logits come down (a greedy step enqueued ahead: only its token id, the argmax taken in the graph).
Everything runs on one stream (products of one input side by side on a second stream were measured slower:
8B-shape step 3.80 vs 3.73 ms). On a GPU the one-token decode step is captured once as a CUDA graph
(`DecodeGraph`) and replayed: numba pays 24-53 us per kernel launch, a replayed graph about 0.5 us
(shared/GPU.md). A decode step reads its inputs from fixed one-token device buffers and attends over the
slots below the pool's high-water mark, read on the device, with a grid that does not depend on it, so the
eager and the replayed step run the same kernels on the same addresses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from lucekv.backends.ahead import RunAhead
from lucekv.backends.cpu import KV_DTYPES
from lucekv.backends.cuda_spark import SparkOptions, SparkStore
from lucekv.backends.slots import SlotMap
from lucekv.errors import UnsupportedModelError
from lucekv.kernels.cpu.quants import (
    PackedMatrix,
    dequantize,
    interleave_rows,
    pack_stacked,
    pack_tensor,
    permute_rows,
    stack_rows,
)
from lucekv.kernels.cuda import SIMULATOR, act, attention, cuda, expert_counts, flash, kv_copy, mmq, moe, norm, sample
from lucekv.kernels.cuda._numba import device_zeros, ordering_event, overlapped_launches
from lucekv.kernels.cuda.embed import embed
from lucekv.kernels.cuda.matmul import matmuls
from lucekv.kernels.cuda.matvec import fuses_norm, matvecs, weight_reads
from lucekv.kernels.cuda.packed import (
    GATE_ROWS,
    GELU,
    NO_GATE,
    SILU,
    AttentionInputs,
    DeviceMatrix,
    Epilogue,
    attention_inputs,
    epilogue,
    upload,
)
from lucekv.kernels.cuda.rope import Rotary, pair_order
from lucekv.kvflash.host_store import HostStore
from lucekv.kvflash.pager import CHUNK_TOKENS, RECENT_QUERIES, Move, PageOut
from lucekv.model.arch import ModelSpec
from lucekv.model.decoder import LayerWeights, MoeWeights, Weights, forward, load_weights
from lucekv.model.gguf import GGUFFile, TensorInfo


class CudaKVPool(SlotMap):
    """The slot map on the host and mirrored on the GPU, with K/V of every layer. Its last block is kept out of the
    block pool: the rows of a batch's padding write their K/V there, and no sequence reads it."""

    def __init__(self, spec: ModelSpec, size: int, dtype: str, stream, max_rows: int = 1):
        super().__init__(size, reserved=1)
        self.dtype = KV_DTYPES[dtype]
        self._stream = stream
        self.scratch_slot = size - CHUNK_TOKENS
        # K and V of every layer in one array, so that one kernel gathers a block's rows of all of them
        self.kv = device_zeros((spec.n_layer, 2, size, spec.n_kv_head, spec.head_dim), self.dtype, stream)
        self.k = [self.kv[layer, 0] for layer in range(spec.n_layer)]
        self.v = [self.kv[layer, 1] for layer in range(spec.n_layer)]
        self.d_slot_pos = cuda.to_device(self.slot_pos, stream=stream)
        # post-RoPE queries of each layer's latest forward, for KVFlash scorers: a prompt's last token, or each of a
        # batch's decode rows (written by CudaOps.attention, and by a replayed graph)
        self.last_q = cuda.to_device(np.zeros((max_rows, spec.n_layer, spec.n_head * spec.head_dim), np.float32),
                                     stream=stream)
        # and of the last RECENT_QUERIES tokens of the latest forward of several tokens of one sequence (a prompt's
        # tail); recent_rows: how many it holds, 0 after a forward of one token or of decode rows (last_q has those),
        # the first recent_padding of them a padded verify block's padding rows
        self.recent_q = device_zeros((spec.n_layer, RECENT_QUERIES, spec.n_head * spec.head_dim), np.float32, stream)
        self.recent_rows = 0
        self.recent_padding = 0

    def padded_by(self, real: int) -> None:
        """The latest forward's rows (CudaOps.set_tables) were padding but for the last `real` (a padded verify
        block): recent_queries gives the real ones only."""
        self.recent_padding = max(0, self.recent_rows - real)

    def truncate(self, n: int) -> None:
        super().truncate(n)
        self.upload_slot_pos()

    def assign(self, slots: np.ndarray, positions: np.ndarray) -> None:
        """The host map as KVPool keeps it; CudaOps.begin_step writes these slots on the device. The blocks whose
        slots changed otherwise since (blocks that changed hands, a cut) are uploaded first (`upload_changed`)."""
        super().assign(slots, positions)
        self.upload_changed()

    def upload_changed(self) -> None:
        """The slots of the block pool's changed blocks into the device map, one copy per run of consecutive blocks
        (usually a block or two a step; the whole map is megabytes at a large pool)."""
        blocks = sorted(self.blocks.dirty)
        self.blocks.dirty.clear()
        start = 0
        for i in range(1, len(blocks) + 1):
            if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
                lo, hi = blocks[start] * CHUNK_TOKENS, (blocks[i - 1] + 1) * CHUNK_TOKENS
                copy_to_device_async(self.d_slot_pos, self.slot_pos[lo:hi], self._stream, at=lo)
                start = i

    def upload_slot_pos(self) -> None:
        """The whole host map into the same device array (a captured decode graph reads it by address)."""
        self.d_slot_pos.copy_to_device(self.slot_pos, stream=self._stream)
        self.blocks.dirty.clear()

    def read_block(self, block: int) -> np.ndarray:
        """Block's rows of every layer in pinned host memory, [2 (K, V), n_layer, CHUNK_TOKENS, n_kv_head,
        head_dim]: a buffer the next read or write reuses. One gather launch and one device-to-host copy."""
        device, host = self._staging
        kv_copy.gather_rows(self.kv, block * CHUNK_TOKENS, device, stream=self._stream)
        device.copy_to_host(host, stream=self._stream)
        self._stream.synchronize()
        return host

    def read_keys(self, block: int) -> np.ndarray:
        """Block's keys of every layer as float32 [n_layer, CHUNK_TOKENS, n_kv_head, head_dim] in pinned host
        memory, converted on the device: a buffer the next read_keys reuses."""
        device, host = self._key_staging
        kv_copy.gather_keys_f32(self.kv, block * CHUNK_TOKENS, device, stream=self._stream)
        device.copy_to_host(host, stream=self._stream)
        self._stream.synchronize()
        return host

    def write_block(self, block: int, rows: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
        """Block's rows from (K, V) [CHUNK_TOKENS, n_kv_head, head_dim] of each layer in turn. One host-to-device
        copy and one scatter launch, left running on the stream."""
        device, host = self._staging
        self._stream.synchronize()  # the previous write's copy may still be reading the pinned buffer
        for layer, (k, v) in enumerate(rows):
            host[0, layer], host[1, layer] = k, v
        device.copy_to_device(host, stream=self._stream)
        kv_copy.scatter_rows(device, self.kv, block * CHUNK_TOKENS, stream=self._stream)

    def compile_paging(self) -> None:
        """Run the paging kernels once, block 0 out and back in (bit-exact) and its keys read: numba compiles a
        kernel at its first launch (a tenth of a second or so), which would otherwise land in a session's decode."""
        rows = self.read_block(0)
        self.read_keys(0)
        self.write_block(0, zip(rows[0], rows[1], strict=True))
        self._stream.synchronize()

    @functools.cached_property
    def _staging(self) -> tuple:
        """(device, pinned host) buffers of one block's K and V rows of every layer, made on first use."""
        return self._buffer_pair((2, *self._block_shape), self.dtype)

    @functools.cached_property
    def _key_staging(self) -> tuple:
        """The same for one block's keys as float32."""
        return self._buffer_pair(self._block_shape, np.float32)

    @property
    def _block_shape(self) -> tuple[int, ...]:
        n_layer, _, _, n_kv_head, head_dim = self.kv.shape
        return n_layer, CHUNK_TOKENS, n_kv_head, head_dim

    def _buffer_pair(self, shape: tuple[int, ...], dtype) -> tuple:
        return cuda.device_array(shape, dtype, stream=self._stream), cuda.pinned_array(shape, dtype)


MAX_STACK = 3  # matrices one product fills (an Epilogue's outputs)
# prompt pieces (one sequence, last logits) shorter than prefill_chunk replay the graph of the first of these widths
# that holds them, padded: powers of two up to 128, where a product reads its weights once whatever the rows (padding
# nearly free), then steps of half the width (a piece pays at most 1.5x its rows); each width kept costs its
# activations (CudaOps' pools), all of them together ~2x those of a full chunk
PREFILL_WIDTHS = (16, 32, 64, 128, 192, 256, 384)
MAX_VERIFY = 65  # widths of verify forwards that replay a captured graph (speculative rounds' drafts + 1)
VERIFY_STEP = 4  # verify blocks are padded to a multiple of this: graphs of widths 4, 8, .., 68 replay them
# products of n > 1 tokens whose weight reads x rows are up to this run as matvec rows (CudaOps.as_matvec_rows):
# estimated from the kernels' shapes (a matmul step ~0.5 us, matvec rows at ~2 TB/s, ~0.6 bytes a weight: they break
# even near 50K). Quantized matrices are read once per grid row of up to 8 tokens where the several-token kernels
# take them (matvec.weight_reads), else (small ones, f32) once per token
MATVEC_TOKEN_ROWS = 32768
# products of MMQ_MIN_TOKENS to MMQ_TOKENS tokens of a matrix that kernels.cuda.mmq serves run on the integer tensor
# cores, x in mmq.PARTS int8 parts (CudaOps.takes_mmq; EngineConfig.mmq_tokens sets the upper end). Measured on an
# H100, 8B shape (bench/results/h100-matvec-rows-8b-mmq.json, h100-steps-qwen3-8b-shape-mmq*.json): from 8 tokens mmq
# wins every product (gate+up 85 vs 113 us at 8, 168 vs 426 at 32), at 4 the step as a whole (9.1 vs 11.2 ms), at 2
# it loses (its tiles hold 8 tokens: 8.8 vs 6.5 ms), so 2 and 3 tokens stay matvec rows
MMQ_MIN_TOKENS = 4
MMQ_TOKENS = 64
# a grid with this many warps per SM or more fills the GPU (an 8B model's products and attention hold 9.7 to 15.5,
# the 0.5B's 1.7 to 8.5): see overlap_kernel_launches
BUSY_WARPS_PER_SM = 9


@dataclass
class Stacked:
    """Matrices of one input (q, k, v; gate, up) stacked into one DeviceMatrix: one product, one weight stream,
    fills their separate outputs (`widths` rows each) and adds their biases (`bias`: all rows, or None).
    `gated`: gate and up rows interleaved (kernels.cpu.quants.interleave_rows), one output of act(gate) * up."""

    matrix: DeviceMatrix
    widths: list[int]
    bias: object | None
    gated: bool = False


@dataclass
class CudaExperts:
    """One layer's router and experts, stacked (expert e's rows e * rows ..): gate and up interleaved into one matrix
    whose products apply the activation (`gate_up`), or, for float experts, apart; each an ExpertTable (all on the
    GPU, or Spark's slots and mapped host copy). `routed`: where a one-token step leaves its expert ids under Spark
    (the cache reads them after the step), else None."""

    router: DeviceMatrix
    gate_up: moe.ExpertTable | None
    gate: moe.ExpertTable | None
    up: moe.ExpertTable | None
    down: moe.ExpertTable
    n_ff: int
    routed: object | None = None


class CudaOps:
    """The decoder's ops on device arrays (see lucekv.model.decoder.Ops).

    The host tokens / positions / slots the decoder passes are ignored: `begin_step` uploaded them.
    Activations come from pools kept between forwards: numba allocates device memory synchronously and frees it
    with a device-wide wait, which left a 512-token prefill's GPU idle between launches (measured on an H200, 8B
    shape: ~30 ms of 140). A forward is cut into segments at each layer's attention; a segment reads only its own
    arrays and the previous segment's, so layers of one parity share a pool (the embedding has its own): two
    layers' activations stay allocated, not a whole forward's. A forward of another token count empties the
    pools, but those of the token counts captured graphs run (`keep_pools`): a graph's kernels hold their arrays'
    addresses, and the same forward run eagerly takes the same arrays, in the same order."""

    def __init__(self, spec: ModelSpec, pool: CudaKVPool, stream, max_tokens: int = 1, max_rows: int = 1):
        """max_tokens: the most tokens of one sequence a forward takes (the prefill batch); max_rows: the most
        sequences a forward's decode rows hold."""
        self.spec = spec
        self.pool = pool
        self.stream = stream
        self._layer_rope = [spec.layer_rope(i) for i in range(spec.n_layer)]
        inv_freqs = {lr.inv_freq.tobytes(): lr.inv_freq for lr in self._layer_rope}  # few distinct: local, global
        self._inv_freq = {key: cuda.to_device(inv, stream=stream) for key, inv in inv_freqs.items()}
        # Where no per-head norm comes between, a one-token step's q/k/v product rotates q and k and stores k and v
        # itself (AttentionInputs: one launch less per layer); a neox model's q and k weights then hold each rotary
        # pair on adjacent rows (rope.pair_order), and so do its prefill's q and k activations
        self._rotates_in_product = not spec.arch.qk_norm
        self._paired = self._rotates_in_product and spec.arch.rope_style == "neox"
        # one-token steps: token, position, slot in one fixed device buffer, filled by one copy from pinned memory
        # (two turns of it: a step may be queued while the one before it runs); a decode graph's argmax writes the
        # token, so that a step enqueued ahead takes its input from the step before it
        self._one_host = cuda.pinned_array((2, 3), np.int32)
        self._one_turn = 0
        self._one_dev = cuda.to_device(np.zeros(3, np.int32), stream=stream)
        self._one = {name: self._one_dev[i:i + 1] for i, name in enumerate(("tokens", "positions", "slots"))}
        self.tokens = self.positions = self.slots = None
        self.marks = self.tree = None  # the positions the slots take, and a draft tree's masks (see begin_step)
        self._kept: set[int] = set()  # token counts whose pools and input buffers stay (see keep_pools)
        # token count > 1 in _kept -> its inputs' buffers, pinned [3, n] and device [3, n], and the device rows' views
        # (tokens, positions, slots): made once, as a numba view costs tens of microseconds of host time
        self._inputs: dict[int, tuple] = {}
        self._pools_by_tokens: dict[int, dict] = {}  # token count -> segment -> (shape, dtype) -> arrays
        self._pools: dict[object, dict[tuple, list]] = {}  # the current token count's
        self._pool: dict[tuple, list] = {}  # the current segment's
        self._taken: dict[tuple, int] = {}  # arrays of each (shape, dtype) the current segment has taken
        self._pooled_tokens = 0  # the token count the pools' arrays are shaped for
        self.spark: SparkStore | None = None  # where the experts live when not all on the GPU
        # per MoE layer, the device counts [n_expert] its routing adds each token's experts to (see count_routing)
        self.routing_counts: list | None = None
        self._slot_row_maps: dict[tuple[int, int], object] = {}
        # block tables (attention.BlockTables) in one fixed device buffer, [start (max_rows), used (max_rows), flat
        # blocks], filled from pinned memory in two turns like the one-token inputs, and only when they changed
        self._max_rows = max_rows
        width = 2 * max_rows + pool.size // CHUNK_TOKENS
        self._tables_host = cuda.pinned_array((2, width), np.int32)
        self._tables_dev = cuda.to_device(np.zeros(width, np.int32), stream=stream)
        self._tables_turn = 0
        self._tables_sent = np.zeros(0, np.int32)  # what the device buffer holds (its used prefix)
        self._seq_of_one = cuda.to_device(np.zeros(max(max_tokens, max_rows), np.int32), stream=stream)
        self._seq_of_rows = cuda.to_device(np.arange(max_rows, dtype=np.int32), stream=stream)
        d = self._tables_dev
        self._table_views = d[2 * max_rows :], d[:max_rows], d[max_rows : 2 * max_rows]  # flat, start, used
        self._block_tables: dict[tuple[int, bool], attention.BlockTables] = {}  # (tokens, one sequence) -> views
        self.tables: attention.BlockTables | None = None
        self.one_sequence = True  # the latest forward's tokens are one sequence's (else decode rows)
        self.kept_rows = 1  # rows of the latest forward whose queries pool.last_q keeps
        self.matvec_token_rows = MATVEC_TOKEN_ROWS  # see as_matvec_rows (0: every product of n > 1 tokens a matmul)
        self.mmq_tokens = MMQ_TOKENS  # see takes_mmq (0: none)

    def begin_step(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, mark: bool = True,
                   tables: Sequence[np.ndarray] | None = None, marks: np.ndarray | None = None,
                   tree: np.ndarray | None = None) -> None:
        """Upload the step's inputs (those of a one-token step or of a kept token count into fixed buffers) and block
        tables (see `set_tables`) and, with `mark`, mark their slots (a replayed graph marks them itself).
        A draft tree's verify block (CudaBackend.forward_tree): `marks`, the positions its slots take in the slot map
        (None: `positions`), and `tree`, its ancestor rows (attention.tree_rows); a kept width below the tensor-core
        attention's (the verify graphs') holds both in its fixed buffers, a chain's with no tree."""
        n = len(tokens)
        self.set_tables(n, tables)
        if n != self._pooled_tokens:
            self._pools_by_tokens = {c: p for c, p in self._pools_by_tokens.items() if c in self._kept}
            self._pools, self._pooled_tokens = self._pools_by_tokens.setdefault(n, {}), n
        self.rewind()
        inputs = {"tokens": tokens, "positions": positions, "slots": slots}
        marks = positions if marks is None else marks
        if n == 1:
            if tree is not None:
                raise ValueError("a draft tree's verify block holds its root and a node at least")
            self.upload_one(*(int(np.asarray(v).reshape(-1)[0]) for v in inputs.values()))
            for name in inputs:
                setattr(self, name, self._one[name])
            self.marks, self.tree = self.positions, None
        elif n in self._kept:  # a graph's inputs: fixed buffers, filled by one copy
            if n not in self._inputs:
                device = cuda.device_array((7, n), np.int32, stream=self.stream)
                self._inputs[n] = (cuda.pinned_array((7, n), np.int32), device,
                                   (device[0], device[1], device[2], device[3], device[4:7]))
            host, device, views = self._inputs[n]
            host[0], host[1], host[2], host[3] = tokens, positions, slots, marks  # (the forward before has finished)
            if tree is None:
                host[4], host[5:7] = attention.NOT_IN_TREE, 0
            else:
                host[4:7] = tree
            copy_to_device_async(device, host, self.stream)
            self.tokens, self.positions, self.slots, self.marks, self.tree = views
            if flash.MIN_TOKENS <= n:  # a prompt piece (or a chain's wide verify block): the tensor-core attention
                if tree is not None:
                    raise ValueError(f"a draft tree's verify block of {n} tokens is wider than a tree's")
                self.tree = None
        else:
            for name, host in inputs.items():
                setattr(self, name, cuda.to_device(np.ascontiguousarray(host, np.int32), stream=self.stream))
            self.marks = cuda.to_device(np.ascontiguousarray(marks, np.int32), stream=self.stream)
            self.tree = None if tree is None else cuda.to_device(np.ascontiguousarray(tree), stream=self.stream)
        if mark:
            self.mark_slots()

    def set_tables(self, n: int, tables: Sequence[np.ndarray] | None) -> None:
        """The slots an n-token forward attends over: the blocks of each of its sequences in logical order (numpy
        int32), one table for all the tokens or one per token (decode rows); None: a sequence alone in the pool,
        whose slots are those below the high-water mark, in slot order."""
        if tables is None:
            tables, used = [np.arange(-(-self.pool.high_water // CHUNK_TOKENS), dtype=np.int32)], [self.pool.high_water]
        else:
            used = [len(t) * CHUNK_TOKENS for t in tables]
        rows = len(tables)
        if rows not in (1, n) or rows > self._max_rows:
            raise ValueError(f"a forward of {n} tokens over {rows} sequences: one sequence's tokens, or one token of "
                             f"each of at most {self._max_rows}")
        m = self._max_rows
        lengths = [len(t) for t in tables]
        sent = np.zeros(2 * m + sum(lengths), np.int32)
        sent[1:rows] = np.cumsum(lengths[:-1])
        sent[m : m + rows] = used
        np.concatenate(tables, out=sent[2 * m :], casting="unsafe")
        if not np.array_equal(sent, self._tables_sent):  # (a sequence's table changes as it takes a block)
            self._tables_turn ^= 1
            host = self._tables_host[self._tables_turn, : len(sent)]
            host[:] = sent
            copy_to_device_async(self._tables_dev, host, self.stream)
            self._tables_sent = sent
        self.tables = self._block_tables.get((n, rows == 1)) or self._tables_of(n, rows == 1)
        self.one_sequence = rows == 1
        self.kept_rows = 1 if self.one_sequence else n
        self.pool.recent_rows = min(n, RECENT_QUERIES) if self.one_sequence and n > 1 else 0
        self.pool.recent_padding = 0

    def _tables_of(self, n: int, one_sequence: bool) -> attention.BlockTables:
        """The BlockTables of n-token forwards (of one sequence, or decode rows) over the fixed tables buffer, kept."""
        if one_sequence and n > len(self._seq_of_one):  # longer than any graph's forward: a buffer of its own
            return attention.BlockTables(*self._table_views, cuda.to_device(np.zeros(n, np.int32), stream=self.stream))
        seq_of = self._seq_of_one[:n] if one_sequence else self._seq_of_rows[:n]
        tables = self._block_tables[n, one_sequence] = attention.BlockTables(*self._table_views, seq_of)
        return tables

    def pool_bytes(self) -> dict[int, int]:
        """Device bytes of the activation pools held now, by token count (the kept ones', and the latest forward's)."""
        return {n: sum(a.nbytes for segment in pools.values() for arrays in segment.values() for a in arrays)
                for n, pools in self._pools_by_tokens.items()}

    def keep_pools(self, n: int) -> None:
        """Keep the activation pools (and, for n > 1, fixed input buffers) of n-token forwards from now on."""
        self._kept.add(n)

    def rewind(self) -> None:
        """Allocations from here on take the pools' arrays from the first: a forward's start (a graph's capture
        records the forward just run on the same arrays)."""
        self._use_pool("embed")

    def upload_one(self, token: int | None, position: int, slot: int) -> None:
        """A one-token step's inputs into the fixed buffers; token None keeps the device's (a graph's argmax)."""
        self._one_turn ^= 1
        host = self._one_host[self._one_turn]
        host[:] = (token or 0, position, slot)
        first = 0 if token is not None else 1
        copy_to_device_async(self._one_dev[first:], host[first:], self.stream)

    @property
    def next_token_buffer(self):
        """The device int32 [1] a one-token step reads its token from."""
        return self._one_dev[0:1]

    def mark_slots(self) -> None:
        """The step's slots hold their positions (`marks`) in the device slot map."""
        attention.set_slot_pos(self.pool.d_slot_pos, self.slots, self.marks, stream=self.stream)

    def _empty(self, n: int, width: int):
        return self._alloc((n, width), np.float32)

    def _alloc(self, shape: tuple[int, ...], dtype):
        key = (shape, np.dtype(dtype))
        arrays = self._pool.setdefault(key, [])
        i = self._taken.get(key, 0)
        self._taken[key] = i + 1
        if i == len(arrays):
            arrays.append(cuda.device_array(shape, dtype, stream=self.stream))
        return arrays[i]

    def _use_pool(self, segment) -> None:
        """Allocations from here on take the arrays of `segment`'s pool, from its first."""
        self._pool = self._pools.setdefault(segment, {})
        self._taken = {}

    def matrix(self, t: TensorInfo) -> DeviceMatrix:
        return upload(pack_tensor(t), stream=self.stream)

    def projections(self, ws: Sequence[TensorInfo], biases: Sequence[TensorInfo | None]) -> list[Stacked]:
        """q, k, v: consecutive matrices of one layout (kind, block, group, width) stacked (by 3 at most), the rest
        alone; q and k rows (and biases) in paired order where the model's are (see __init__)."""
        spec = self.spec
        ms = [pack_tensor(w) for w in ws]
        bs = [None if b is None else self._host_vector(b) for b in biases]
        if self._paired:
            for i, heads in enumerate((spec.n_head, spec.n_kv_head)):
                order = pair_order(heads, spec.head_dim, spec.rope_dim)
                ms[i] = permute_rows(ms[i], order)
                bs[i] = None if bs[i] is None else bs[i][order]
        return [self._stack(g) for g in _groups(list(zip(ms, bs, strict=True)))]

    def _stack(self, group: list[tuple]) -> Stacked:
        """(matrix, host bias or None) pairs as one Stacked."""
        ms = [m for m, _ in group]
        bias = None
        if any(b is not None for _, b in group):
            bias = np.concatenate([np.zeros(m.rows, np.float32) if b is None else b for m, b in group])
            bias = cuda.to_device(bias, stream=self.stream)
        return Stacked(upload(stack_rows(ms), stream=self.stream), [m.rows for m in ms], bias)

    def gated(self, gate: TensorInfo, up: TensorInfo) -> list[Stacked]:
        """Gate and up interleaved into one quantized matrix that applies the activation itself; where the two
        differ in kind (or are float32), stacked as any projections, with a separate activation."""
        g, u = pack_tensor(gate), pack_tensor(up)
        if _interleavable(g, u):
            return [Stacked(upload(interleave_rows(g, u, GATE_ROWS), stream=self.stream), [g.rows], None, True)]
        return [self._stack(group) for group in _groups([(g, None), (u, None)])]

    def experts(self, router: TensorInfo, gate: TensorInfo, up: TensorInfo, down: TensorInfo) -> CudaExperts:
        g, u = pack_stacked(gate), pack_stacked(up)
        n_expert, n_ff, n_embd = gate.shape
        if self.spark is None:
            def put(m: PackedMatrix, _rows: int) -> moe.ExpertTable:
                return moe.resident(upload(m, stream=self.stream), n_expert, stream=self.stream)
            routed = None
        else:
            layer = int(router.name.split(".")[1])  # blk.N.ffn_gate_inp.weight (load_weights goes layer by layer)
            put = functools.partial(self.spark.experts, layer)
            routed = self.spark.routed_rows[layer]
        # interleaving the whole stacks interleaves each expert's rows: its gate/up groups never cross an expert
        paired = _interleavable(g, u) and n_ff % GATE_ROWS == 0
        return CudaExperts(upload(pack_tensor(router), stream=self.stream),
                           put(interleave_rows(g, u, GATE_ROWS), 2 * n_ff) if paired else None,
                           None if paired else put(g, n_ff), None if paired else put(u, n_ff),
                           put(pack_stacked(down), n_embd), n_ff, routed)

    def moe_ffn(self, x, m: MoeWeights, norm):
        """One token (or float experts): the chosen experts' products as matvecs, experts picked on the device, the
        down products summing themselves back (`moe.routed_sum`). More: tokens grouped by expert on the device, each
        expert's run through the tensor-core tile."""
        spec, e, s = self.spec, m.experts, self.stream
        n, k, n_embd = x.shape[0], spec.n_expert_used, spec.n_embd
        if n == 1 and e.routed is not None:
            ids = e.routed
        elif self.spark is not None and not self.one_sequence:  # decode rows: the cache reads their experts too
            ids = self.spark.rows_ids(m.layer, n)
        else:
            ids = self._alloc((n, k), np.int32)
        weights = self._empty(n, k)
        logits = self._empty(n, spec.n_expert)
        gate = GELU if spec.arch.activation == "gelu_tanh" else SILU
        sums_back = n == 1 and e.gate_up is not None and moe.sums_routed(e.down, k)
        fused = (norm, spec.rms_eps) if sums_back and fuses_norm(e.gate_up.table) else None  # the kernels' RMSNorm
        h = x if fused else self.rmsnorm(x, norm)
        if n == 1:
            moe.route(e.router, h, fused, logits, ids, weights, spec.arch.norm_topk, stream=s)
        else:
            parts = self._alloc(moe.router_parts(n, spec.n_expert, n_embd), np.float32)
            moe.route_prefill(e.router, h, parts, logits, ids, weights, spec.arch.norm_topk, stream=s)
        if self.routing_counts is not None:
            expert_counts.count_experts(ids, self.positions, self.routing_counts[m.layer], stream=s)
        routing = moe.Routing(ids, weights)
        act_out = self._empty(n * k, e.n_ff)
        if sums_back:
            # the down products sum themselves back into the residual (no combine launch), the shared expert's
            # products before them
            shared = self._shared_expert(x, m, norm)
            moe.routed_matvecs(e.gate_up, 2 * e.n_ff, h, routing, epilogue((act_out,), gate=gate), x_per_slot=False,
                               stream=s, norm=fused)
            out = self._empty(n, n_embd)
            moe.routed_sum(e.down, n_embd, act_out, routing, x, out, shared, stream=s)
            return out
        outs = self._empty(n * k, n_embd)
        if e.gate_up is None:  # float experts
            parts = [self._empty(n * k, e.n_ff) for _ in range(2)]
            for w, part in zip((e.gate, e.up), parts, strict=True):
                moe.routed_matvecs(w, e.n_ff, h, routing, part, x_per_slot=False, stream=s)
            act.gated_act(*parts, gate == GELU, act_out, stream=s)
            moe.routed_matvecs(e.down, n_embd, act_out, routing, outs, x_per_slot=True, stream=s)
            pos = self._slot_rows(n, k)
        else:
            grouping = moe.Grouping.allocate(self._alloc, n, k, spec.n_expert, n_embd, e.n_ff)
            moe.grouped_experts(e.gate_up, e.down, e.n_ff, h, ids, spec.n_expert, gate, grouping, act_out, outs,
                                stream=s)
            pos = grouping.pos
        shared = self._shared_expert(x, m, norm)
        out = self._empty(n, n_embd)
        moe.combine(outs, pos, weights, x, out, shared, stream=s)
        return out

    def _shared_expert(self, x, m: MoeWeights, norm) -> tuple | None:
        """(gate logits [n, 1], output [n, n_embd]) of the layer's shared expert of norm(x), or None (see combine)."""
        if m.shared is None:
            return None
        sh = m.shared
        return self.linear(sh.gate, x, norm=norm), self.linear(sh.down, self.gated_linear(x, sh.gate_up, norm))

    def _slot_rows(self, n: int, k: int):
        """[n, k] int32: token t's slot s at row t * k + s (the routed products' order), made once per shape."""
        if (n, k) not in self._slot_row_maps:
            rows = np.arange(n * k, dtype=np.int32).reshape(n, k)
            self._slot_row_maps[n, k] = cuda.to_device(rows, stream=self.stream)
        return self._slot_row_maps[n, k]

    def vector(self, t: TensorInfo):
        return cuda.to_device(self._host_vector(t), stream=self.stream)

    @staticmethod
    def _host_vector(t: TensorInfo) -> np.ndarray:
        return dequantize(t.data, t.qtype, t.shape).reshape(-1)

    def embed(self, table: DeviceMatrix, tokens: np.ndarray, scale: float):
        out = self._empty(len(tokens), table.cols)
        embed(table, self.tokens, scale, out, stream=self.stream)
        return out

    def project(self, x, p: list[Stacked], norm):
        x, norm = self._norm_for(x, p, norm)
        outs, products = [], []
        gate = GELU if self.spec.arch.activation == "gelu_tanh" else SILU
        for s in p:
            parts = [self._empty(x.shape[0], width) for width in s.widths]
            products.append((s.matrix, epilogue(parts, bias=s.bias, gate=gate if s.gated else NO_GATE)))
            outs += parts
        self._products(products, x, norm)
        return outs

    def _norm_for(self, x, p: list[Stacked], norm):
        """(x, norm) for the products of p: the norm left to them where they all fuse it, or x normalized here."""
        if not all(self._fuses_norm(s.matrix, x.shape[0]) for s in p):
            return self.rmsnorm(x, norm), None
        return x, norm

    def _fuses_norm(self, w: DeviceMatrix, n: int) -> bool:
        """Whether a product of n tokens of w normalizes x itself: a matvec (one token, or rows of a few: each token's
        x normalized as its one-token product normalizes it) that `fuses_norm`, or an integer tensor-core product
        (`takes_mmq`: x's quantization normalizes it); a matmul takes x normalized."""
        if n > 1 and self.takes_mmq(w, n):
            return True
        return fuses_norm(w) and (n == 1 or self.as_matvec_rows(w, n))

    def gated_linear(self, x, g: list[Stacked], norm):
        outs = self.project(x, g, norm)
        if len(outs) == 1:  # the product applied the activation
            return outs[0]
        out = self._empty(*outs[0].shape)
        act.gated_act(*outs, self.spec.arch.activation == "gelu_tanh", out, stream=self.stream)
        return out

    def linear(self, w: DeviceMatrix, x, norm=None, residual=None):
        if norm is not None and not self._fuses_norm(w, x.shape[0]):
            x, norm = self.rmsnorm(x, norm), None
        out = self._empty(x.shape[0], w.rows)
        self._products([(w, epilogue((out,), residual=residual))], x, norm)
        return out

    def _products(self, products: list[tuple[DeviceMatrix, Epilogue | AttentionInputs]], x, norm) -> None:
        """Each (W, destination) of x: for one token the decode matvecs (two matrices to a launch), normalizing x
        themselves when `norm` is given (`_fuses_norm`); for more, MMQ_MIN_TOKENS to `mmq_tokens` tokens the integer
        tensor-core products of the matrices mmq serves (`takes_mmq`: x quantized, and normalized, once for all of
        them, or up to a token tile by each product's blocks themselves: `mmq.quantizes_itself`), else tensor-core
        matmuls (the caller has normalized x), but for a few tokens of a matrix small enough the matvecs
        (`as_matvec_rows`), which normalize x as for one."""
        n = x.shape[0]
        rows = [(w, ep) for w, ep in products if n == 1 or self.as_matvec_rows(w, n)]
        if rows:
            matvecs(rows, x, self.stream, norm=None if norm is None else (norm, self.spec.rms_eps))
        if n == 1:
            return
        integer = [(w, ep) for w, ep in products if self.takes_mmq(w, n)]
        if integer:
            by_norm = None if norm is None else (norm, self.spec.rms_eps)
            qx = (mmq.float_x(x, mmq.PARTS, by_norm) if mmq.quantizes_itself(n)
                  else mmq.quantize(x, self._mmq_x(n, x.shape[1]), self.stream, norm=by_norm))
            for w, ep in integer:
                mmq.product(w, qx, ep, self.stream, self._mmq_sums(w, n))
        matmuls([(w, ep) for w, ep in products if not self.as_matvec_rows(w, n) and not self.takes_mmq(w, n)], x,
                self.stream, halves=lambda order: self._halves(n, x.shape[1], order))

    def takes_mmq(self, w: DeviceMatrix, n: int) -> bool:
        """Whether a product of n > 1 tokens of w runs on the integer tensor cores: MMQ_MIN_TOKENS to `mmq_tokens`
        tokens of a matrix that mmq serves. It reads the weights once and, x in two int8 parts, its rows agree with
        each token's one-token matvec within x's 16 bits (q4 / q6: to float32 rounding)."""
        return MMQ_MIN_TOKENS <= n <= self.mmq_tokens and mmq.serves(w, n)

    def _mmq_x(self, n: int, cols: int) -> mmq.QuantizedX:
        """x of n tokens quantized for mmq: scratch per shape and token count, shared by the products of a forward
        (as `_halves`)."""
        pool = self._pools.setdefault("mmq_x", {})
        if (n, cols) not in pool:
            pool[n, cols] = list(mmq.scratch(n, cols, mmq.PARTS, self.stream)[:2])
        words, scales = pool[n, cols]
        return mmq.QuantizedX(words, scales, n)

    def _mmq_sums(self, w: DeviceMatrix, n: int):
        """The partial sums of an mmq product whose columns its plan splits (None where it does not)."""
        splits = mmq.plan(w).splits
        if splits == 1:
            return None
        pool = self._pools.setdefault("mmq_sums", {})
        key = (splits, mmq.padded(n), w.rows)
        if key not in pool:  # its arrays, as every pool holds (pool_bytes counts them)
            pool[key] = list(mmq.partials(w, n, self.stream))
        return mmq.Partials(*pool[key])

    def _halves(self, n: int, cols: int, order: tuple[int, int]):
        """A matmul's scratch for its x as float16 pairs in a staged `order` (matmul.stage_halves): one per shape,
        order and token count, shared by the products of a forward (they run one after another on the stream)."""
        pool = self._pools.setdefault("halves", {})
        key = ((n, cols // 2), order)
        if key not in pool:
            pool[key] = [cuda.device_array(key[0], np.uint32, stream=self.stream)]
        return pool[key][0]

    def as_matvec_rows(self, w: DeviceMatrix, n: int) -> bool:
        """Whether a product of n > 1 tokens runs as matvec rows (weight reads x rows within `matvec_token_rows`). A
        tensor-core matmul block computes 128 rows x 64 tokens walking every column, so a product of few tokens and
        few rows is a fraction of a wave of blocks whose time is that walk's, whatever n (qwen2.5-0.5b's down
        projection: 7 blocks of 152 steps, for 2 tokens as for 64); the matvec spreads one token's rows over
        a wave of small blocks and reads the weights once per grid row of several tokens, or once per token
        (`matvec.weight_reads`: the weights of the rows after the first from L2), so its time grows with those
        reads x rows. An output head (150K rows) stays a matmul: it reads its weights once. Products that `takes_mmq`
        are not matvec rows."""
        return not self.takes_mmq(w, n) and weight_reads(w, n) * w.rows <= self.matvec_token_rows

    def rmsnorm(self, x, w, groups: int = 1):
        out = self._empty(*x.shape)
        norm.rmsnorm(x, w, self.spec.rms_eps, groups, out, stream=self.stream)
        return out

    def attention(self, layer: int, x, lw: LayerWeights, positions: np.ndarray, slots: np.ndarray, window: int):
        spec, pool, s = self.spec, self.pool, self.stream
        n = x.shape[0]
        layer_rope = self._layer_rope[layer]
        rotary = Rotary(self._inv_freq[layer_rope.inv_freq.tobytes()], spec.arch.rope_style == "neox", self._paired)
        # KVFlash scorers read the rotated queries from pool.last_q (a replayed graph writes them too)
        if n == 1 and self._rotates_in_product and all(st.matrix.kind != "f32" for st in lw.qkv):
            x, norm = self._norm_for(x, lw.qkv, lw.attn_norm)
            q = pool.last_q[0, layer:layer + 1]
            n_q, n_k = spec.n_head * spec.head_dim, spec.n_kv_head * spec.head_dim
            row0s = np.cumsum([0] + [st.matrix.rows for st in lw.qkv[:-1]]).tolist()  # each stack's first row
            self._products([(st.matrix, attention_inputs(q, pool.k[layer], pool.v[layer], self.positions, self.slots,
                                                         rotary, n_q, n_k, row0, st.bias))
                            for st, row0 in zip(lw.qkv, row0s, strict=True)], x, norm)
            self._use_pool(layer % 2)  # a new segment: it overwrites the arrays of two layers back
        else:
            q, k, v = self.project(x, lw.qkv, lw.attn_norm)  # (project_qkv's q/k norms: rope_and_store's)
            self._use_pool(layer % 2)
            q_rot = self._empty(n, q.shape[1])
            qk_norm = None if lw.q_norm is None else (lw.q_norm, lw.k_norm, spec.rms_eps)
            attention.rope_and_store(q, k, v, self.positions, self.slots, rotary, pool.k[layer], pool.v[layer],
                                     q_rot, pool.last_q[: self.kept_rows, layer], qk_norm, stream=s)
            q = q_rot
            if pool.recent_rows:
                pool.recent_q[layer, : pool.recent_rows].copy_to_device(q[n - pool.recent_rows :], stream=s)
        parts = attention.partials(n, spec.n_head, spec.n_kv_head, spec.head_dim, pool.size, self._alloc)
        out = self._empty(n, spec.n_head * spec.head_dim)
        attention.attend(q, pool.k[layer], pool.v[layer], pool.d_slot_pos, self.tables, self.positions, window,
                         layer_rope.attn_scale, parts, out, stream=s, one_sequence=self.one_sequence, tree=self.tree)
        return out

    def add(self, x, y):
        out = self._empty(*x.shape)
        act.add(x, y, out, stream=self.stream)
        return out

    def rows(self, x, idx: slice):
        start, stop, _ = idx.indices(x.shape[0])
        return x[start:stop]


def _groups(pairs: list[tuple[PackedMatrix, TensorInfo | None]]) -> list[list[tuple]]:
    """Consecutive (matrix, bias) pairs of one layout together, by MAX_STACK at most."""
    groups: list[list[tuple]] = []
    for m, b in pairs:
        last = groups[-1][-1][0] if groups else None
        if last is not None and last.layout == m.layout and len(groups[-1]) < MAX_STACK:
            groups[-1].append((m, b))
        else:
            groups.append([(m, b)])
    return groups


def _interleavable(g: PackedMatrix, u: PackedMatrix) -> bool:
    return g.kind != "f32" and (g.layout, g.rows) == (u.layout, u.rows) and g.rows % GATE_ROWS == 0


class CudaBackend(RunAhead):
    name = "cuda"
    prefill_chunk = 512  # tokens per prefill forward: each reads every weight once (no score matrix here)
    # a draft tree's verify block: its graph's width (a multiple of VERIFY_STEP) stays below the tensor-core
    # attention's queries, which take no tree masks
    max_tree_block = (flash.MIN_TOKENS - 1) // VERIFY_STEP * VERIFY_STEP

    def __init__(self, g: GGUFFile, spec: ModelSpec, kv_dtype: str = "f16", pool_size: int | None = None,
                 use_graph: bool | None = None, max_rows: int = 1, spark: SparkOptions | None = None):
        """pool_size: KV slots (one block of them the backend's scratch); max_rows: the most sequences whose decode
        tokens share a forward (`decode_rows`). use_graph: replay decode steps, decode rows (one graph per batch
        size bucket: 2, 4, 8...) and prompt pieces (one graph per width bucket) from CUDA graphs; default: on a GPU
        (the simulator has none). spark: an MoE's experts placed and cached (cuda_spark), not all on the GPU; a
        placement of another model is refused."""
        if why := attention.unsupported(spec.n_head, spec.n_kv_head, spec.head_dim):
            raise UnsupportedModelError(f"the CUDA backend cannot run {spec.name}: {why}")
        if spec.n_expert and (why := moe.unsupported(spec.n_expert, spec.n_embd, spec.n_expert_used)):
            raise UnsupportedModelError(f"the CUDA backend cannot run {spec.name}: {why}")
        super().__init__()
        self.spec = spec
        self.stream = cuda.stream()
        self._chained = False  # the device's step token is the argmax of the latest step (a graph replay's)
        self.max_rows = row_bucket(max_rows)
        pool_size = pool_size or (-(-spec.n_ctx // CHUNK_TOKENS) + 1) * CHUNK_TOKENS  # the context and the scratch
        self.pool = CudaKVPool(spec, pool_size, kv_dtype, self.stream, self.max_rows)
        self.pool.compile_paging()  # sequences page (idle ones too): the kernels compile now, not in a session's step
        self.ops = CudaOps(spec, self.pool, self.stream, self.prefill_chunk, self.max_rows)
        if spark is not None:
            if not spec.n_expert:
                raise UnsupportedModelError(f"{spec.name} has no experts to place (--spark-placement)")
            self.ops.spark = SparkStore(spark, spec, g.fingerprint, self.stream, self.max_rows)
        self.spark = self.ops.spark
        self.weights: Weights = load_weights(g, spec, self.ops)
        self._graphs = not SIMULATOR if use_graph is None else use_graph
        self.graph = DecodeGraph(self) if self._graphs else None
        # prompt pieces replay graphs too, by width (prefill_bucket: full chunks, and shorter pieces padded): as ~200
        # launches, numba's host time per launch made a small model's prefill host-bound (0.5B shape, H200: ~180 us
        # per launch, 36 of 42 ms); made on first use, or at engine start by `prepare_prefill`
        self.prefill_graphs: dict[int, ForwardGraph] | None = {} if self._graphs else None
        # speculative verify forwards up to MAX_VERIFY tokens, by bucket (verify_bucket; prepare_verify captures them)
        self.verify_graphs: dict[int, RowsGraph] | None = {} if self._graphs else None
        self._argmax_scratch: dict[int, tuple] = {}  # eager verify forwards' argmax buffers, by width
        # batch size bucket -> its decode rows' graph, made on first use, or at engine start by `prepare_decode`
        self.row_graphs: dict[int, RowsGraph] = {}
        # target features for a DFlash drafter (lucekv.spec.dflash), as the CPU backend's: while `capture_layers`
        # names layers, a forward runs without graphs and leaves their outputs, copied to the host as each layer
        # makes them, in `captured` [n_tokens, len(capture_layers) * n_embd]
        self.capture_layers: tuple[int, ...] = ()
        self.captured: np.ndarray | None = None

    def forward(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, all_logits: bool = False,
                tables: Sequence[np.ndarray] | None = None) -> np.ndarray:
        """Logits [1 or n, vocab] float32 on the host for `tokens` at `positions`, K/V written to `slots`. tables: each
        sequence's blocks in logical order, one for all the tokens or one per token (decode rows: the logits of every
        row); None: a sequence alone in the pool (see CudaOps.set_tables)."""
        tokens = np.asarray(tokens)
        rows = tables is not None and len(tables) == len(tokens) > 1
        graph = None if rows or self.capture_layers else self._graph_for(len(tokens), all_logits)
        return self._forward(graph, tokens, positions, slots, all_logits, rows, tables)

    def _forward(self, graph: ForwardGraph | None, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                 all_logits: bool, rows: bool, tables: Sequence[np.ndarray] | None) -> np.ndarray:
        """`forward` through `graph` (None: eagerly), padded to its width (`_padded`, padding first: one sequence's
        verify block or prompt piece, whose last row stays the last) and captured at its first use."""
        n = len(tokens)
        self._chained = False
        self.pool.assign(slots, positions)
        if graph is not None and graph.n_tokens > n:
            tokens, positions, slots = self._padded(graph.n_tokens, tokens, positions, slots, first=True)
        replay = graph is not None and graph.ready
        self.ops.begin_step(tokens, positions, slots, mark=not replay, tables=tables)
        self.pool.padded_by(n)
        if replay:
            out = graph.replay(n)
        else:
            logits = self._forward_eager(tokens, positions, slots, all_logits or rows)
            if graph is not None:  # kernels are compiled and loaded now: capture the same forward for the next ones
                graph.capture(tokens, positions, slots)
            out = logits.copy_to_host(stream=self.stream)
            self.stream.synchronize()
            out = out[len(out) - n :] if all_logits else out
        if self.spark is not None and n == 1 and not rows:
            self.spark.observe_now()  # a one-token step: its experts feed the cache
        elif self.spark is not None and rows:
            self.spark.observe_rows(n)  # decode rows: so do theirs
        return out

    def _graph_for(self, n: int, all_logits: bool) -> ForwardGraph | None:
        """The graph that runs an n-token forward of one sequence, if any (one token's logits are all its logits)."""
        if n == 1:
            return self.graph
        if all_logits:
            return self._verify_graph(n)
        return self._prefill_graph(n)

    def _prefill_graph(self, n: int) -> ForwardGraph | None:
        """The graph of prompt pieces of n tokens (last logits): that of their bucket (`prefill_bucket`), made on first
        use."""
        if self.prefill_graphs is None or n > self.prefill_chunk:
            return None
        b = prefill_bucket(n, self.prefill_chunk)
        if b not in self.prefill_graphs:
            self.prefill_graphs[b] = ForwardGraph(self, b)
        return self.prefill_graphs[b]

    def prepare_prefill(self, width: int) -> None:
        """Capture the graphs of prompt pieces of up to `width` tokens now (the engine's: its step's tokens), each from
        a forward of padding rows only (`_padded`: they see nothing and write the scratch block), so that no prompt
        waits for a capture (an eager forward and its recording: tens of milliseconds of launches) or for the
        kernels of its width to compile (the long matmul tile's from 256 tokens: minutes at the 8B shape, seconds
        from the disk cache)."""
        if self.prefill_graphs is None:
            return
        none = np.zeros(0, np.int32)
        widths = (*PREFILL_WIDTHS, self.prefill_chunk)
        for b in sorted({prefill_bucket(min(w, width, self.prefill_chunk), self.prefill_chunk) for w in widths}):
            graph = self._prefill_graph(b)
            if not graph.ready:
                self._forward(graph, none, none, none, False, False, tables=[none])

    def _verify_graph(self, n: int) -> RowsGraph | None:
        """The graph of verify blocks of n tokens: that of their bucket (`verify_bucket`), made on first use."""
        if self.verify_graphs is None or not 1 < n <= MAX_VERIFY:
            return None
        b = verify_bucket(n)
        if b not in self.verify_graphs:
            self.verify_graphs[b] = RowsGraph(self, b)
        return self.verify_graphs[b]

    def _padded(self, width: int, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, first: bool = False
                ) -> tuple:
        """The inputs padded to `width` rows, the padding rows after the real ones (decode rows) or, `first`, before
        them (one sequence's verify block or prompt piece: its last row stays the last, whose query pool.last_q
        keeps). A padding row, at position -1, sees no slot and writes the pool's scratch block, which keeps -1 (free,
        on the host as on the device): whoever reads it sees nothing there. A row's numbers never depend on the other
        rows'; the width picks kernels (attention's splits, the tensor-core attention from flash.MIN_TOKENS, matvec
        rows or matmul), so the real rows get what they get unpadded within rounding."""
        pad = width - len(tokens)
        padding = (np.zeros(pad, np.int32), np.full(pad, -1, np.int32),
                   self.pool.scratch_slot + np.arange(pad, dtype=np.int32) % CHUNK_TOKENS)
        return tuple(np.concatenate([p, np.asarray(x, np.int32)] if first else [np.asarray(x, np.int32), p])
                     for x, p in zip((tokens, positions, slots), padding, strict=True))

    def forward_argmax(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                       tables: Sequence[np.ndarray] | None = None) -> np.ndarray:
        """The greedy token after each of `tokens` (int32 [n]) of one sequence (tables: its blocks, see `forward`),
        each row's argmax taken on the device: a speculative round's verify forward, of which only n token ids come
        back. Widths up to MAX_VERIFY replay the graph of their bucket, padded to its width (captured at its first
        use); one token is a plain decode step."""
        n = len(tokens)
        if n == 1 and not self.capture_layers:
            self.decode_ahead(int(positions[0]), int(slots[0]), int(tokens[0]), None if tables is None else tables[0])
            return np.array([self.next_token()], np.int32)
        self._chained = False
        graph = None if self.capture_layers else self._verify_graph(n)
        if graph is None:
            return self._eager_argmax(tokens, positions, slots, tables)
        return self._verify_rows(graph, tokens, positions, slots, tables)

    def verify_width(self, n: int) -> int:
        """The width a verify block of n tokens runs as (`graph_width`; without graphs n). Drafts fill it
        (lucekv.spec.fill)."""
        return graph_width(n) if self.verify_graphs is not None else n

    def _verify_rows(self, graph: RowsGraph, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                     tables: Sequence[np.ndarray] | None) -> np.ndarray:
        """forward_argmax through the graph of its bucket, padded to its width (`_padded`, padding first)."""
        n, width = len(tokens), graph.n_tokens
        self.pool.assign(slots, positions)
        tokens, positions, slots = self._padded(width, tokens, positions, slots, first=True)
        self.ops.begin_step(tokens, positions, slots, mark=not graph.ready, tables=tables)
        self.pool.padded_by(n)
        if not graph.ready:
            with cuda.defer_cleanup():
                forward(self.spec, self.weights, self.ops, tokens, positions, slots, all_logits=True)
            graph.capture(tokens, positions, slots)  # and from now on replayed, this first time too
        return graph.replay_rows(n, [], first=width - n)[0]

    def forward_tree(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, ancestors: np.ndarray,
                     table: np.ndarray, greedy: bool = False) -> np.ndarray:
        """A draft tree's verify block of one sequence, as the CPU backend's `forward_tree` (which see): the logits
        [n, vocab] on the host, or with `greedy` each row's argmax (int32 [n], taken on the device). The verify graph
        of its width's bucket replays it (padding first, as `forward_argmax`'s), its masks in the graph's fixed
        buffers (CudaOps.begin_step); without graphs it runs eagerly."""
        n = len(tokens)
        if not 1 < n <= self.max_tree_block:
            raise ValueError(f"a draft tree's verify block of {n} tokens (2 to {self.max_tree_block})")
        marks = positions[0] + np.arange(n, dtype=np.int32)
        tree = attention.tree_rows(int(positions[0]), ancestors)
        self._chained = False
        self.pool.assign(slots, marks)
        graph = None if self.capture_layers else self._verify_graph(n)
        if graph is None:  # (capturing a dflash turn's features: eagerly, `_forward_eager` copies them out)
            self.ops.begin_step(tokens, positions, slots, tables=[table], marks=marks, tree=tree)
            logits = self._forward_eager(tokens, positions, slots, all_logits=True)
            if greedy:
                return self._argmax_rows(logits, n)
            out = logits.copy_to_host(stream=self.stream)
            self.stream.synchronize()
            return out
        width = graph.n_tokens
        pad = width - n
        tokens, positions, slots = self._padded(width, tokens, positions, slots, first=True)
        marks = np.concatenate([np.full(pad, -1, np.int32), marks])
        padding = attention.tree_rows(attention.NOT_IN_TREE, np.zeros(pad, np.int64))
        self.ops.begin_step(tokens, positions, slots, mark=not graph.ready, tables=[table], marks=marks,
                            tree=np.concatenate([padding, tree], axis=1))
        self.pool.padded_by(n)
        if not graph.ready:
            with cuda.defer_cleanup():
                forward(self.spec, self.weights, self.ops, tokens, positions, slots, all_logits=True)
            graph.capture(tokens, positions, slots)
        greedy_tokens, logits = graph.replay_rows(n, [] if greedy else range(pad, width), first=pad)
        return greedy_tokens if greedy else logits

    def copy_kv(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Every layer's K and V of slots `src` into slots `dst` (see CpuBackend.copy_kv): one launch."""
        kv_copy.copy_slots(self.pool.kv, cuda.to_device(np.stack([src, dst]).astype(np.int32), stream=self.stream),
                           stream=self.stream)

    def prepare(self, step_tokens: int, verify_width: int) -> None:
        """At engine start: every forward the engine's steps may run, its kernels compiled (or loaded from the disk
        cache, kernels.cuda._numba) and its graph captured: prompt pieces of up to `step_tokens`, verify blocks of up
        to `verify_width`, one-token steps and decode rows up to max_rows. Without graphs (the simulator) nothing."""
        self.prepare_verify(verify_width)
        self.prepare_prefill(step_tokens)
        self.prepare_decode()

    def prepare_verify(self, width: int) -> None:
        """Capture the graphs of verify blocks of up to `width` tokens now, each from a forward of padding rows only
        (`_padded`: they see nothing and write the scratch block), so that no speculative round pays a capture
        (tens of milliseconds of launches) and the gate only ever times replays."""
        if self.verify_graphs is None:
            return
        none = np.zeros(0, np.int32)
        for b in sorted({verify_bucket(w) for w in range(2, min(width, MAX_VERIFY) + 1)}):
            graph = self._verify_graph(b)
            if not graph.ready:
                self._chained = False
                self._verify_rows(graph, none, none, none, tables=[none])

    def _eager_argmax(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                      tables: Sequence[np.ndarray] | None) -> np.ndarray:
        """forward_argmax without a graph (the simulator, wider than MAX_VERIFY, or capturing features)."""
        n = len(tokens)
        self.pool.assign(slots, positions)
        self.ops.begin_step(tokens, positions, slots, tables=tables)
        return self._argmax_rows(self._forward_eager(tokens, positions, slots, all_logits=True), n)

    def _argmax_rows(self, logits, n: int) -> np.ndarray:
        """Each row's argmax of device logits [n, vocab], on the host."""
        if n not in self._argmax_scratch:
            self._argmax_scratch[n] = (cuda.device_array(n, np.int32, stream=self.stream),
                                       sample.argmax_scratch(n, stream=self.stream))
        out, scratch = self._argmax_scratch[n]
        sample.argmax(logits, self.spec.vocab_size, out, scratch, stream=self.stream)
        tokens_out = out.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return tokens_out

    def _forward_eager(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, all_logits: bool):
        """The decoder's forward, launch by launch (logits on the device), and the outputs of `capture_layers`
        copied to the host as they are made (the activation buffers are reused two layers on)."""
        states: dict[int, np.ndarray] = {}

        def keep(layer: int, x) -> None:
            if layer in self.capture_layers:
                states[layer] = x.copy_to_host(stream=self.stream)
        with cuda.defer_cleanup():  # numba frees device memory synchronously: not between a forward's launches
            capture = {"capture": keep} if self.capture_layers else {}
            logits = forward(self.spec, self.weights, self.ops, tokens, positions, slots, all_logits, **capture)
        if self.capture_layers:
            self.stream.synchronize()
            self.captured = np.concatenate([states[i] for i in self.capture_layers], axis=1)
        return logits

    def decode_rows(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, tables: Sequence[np.ndarray],
                    sampled: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """One token of each of several sequences in one forward (tables: each one's blocks in logical order): the
        greedy token of every row, int32 [n] (the argmax taken on the device), and the logits [len(sampled), vocab]
        of the rows listed in `sampled`. The products read each weight once for all rows. With graphs, the rows are
        padded to a bucket (a power of two) whose captured graph replays them (`_padded`: each padding row a
        sequence of no blocks)."""
        n = len(tokens)
        if n == 1 or not self._graphs:
            logits = self.forward(tokens, positions, slots, tables=tables)
            return np.argmax(logits[:, : self.spec.vocab_size], axis=1).astype(np.int32), logits[list(sampled)]
        return self._decode_rows(row_bucket(n), tokens, positions, slots, tables, sampled)

    def _decode_rows(self, b: int, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                     tables: Sequence[np.ndarray], sampled: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """`decode_rows` through the graph of b rows (captured at its first use), the rows padded to b."""
        n = len(tokens)
        self._chained = False
        self.pool.assign(slots, positions)
        tokens, positions, slots = self._padded(b, tokens, positions, slots)
        tables = [*tables, *(np.zeros(0, np.int32) for _ in range(b - n))]
        graph = self.row_graphs.get(b) or self.row_graphs.setdefault(b, RowsGraph(self, b))
        self.ops.begin_step(tokens, positions, slots, mark=not graph.ready, tables=tables)
        if not graph.ready:
            with cuda.defer_cleanup():
                forward(self.spec, self.weights, self.ops, tokens, positions, slots, True)
            graph.capture(tokens, positions, slots)  # and from now on replayed, this first time too
        out = graph.replay_rows(n, sampled)
        if self.spark is not None and n:  # (none: a capture of padding rows only)
            self.spark.observe_rows(n)  # the rows' experts feed the cache
        return out

    def prepare_decode(self) -> None:
        """Capture the one-token step's graph and the decode rows' graph of every batch size bucket up to max_rows
        now, each from padding rows only (as `prepare_prefill`), so that neither a stream's first token nor a batch
        of a size not met before waits for kernels to compile and a graph to be captured."""
        if not self._graphs:
            return
        none = np.zeros(0, np.int32)
        if not self.graph.ready:
            self._forward(self.graph, none, none, none, False, False, tables=[none])
        b = 2
        while b <= self.max_rows:
            if b not in self.row_graphs or not self.row_graphs[b].ready:
                self._decode_rows(b, none, none, none, [], [])
            b *= 2

    def place_experts(self, options: SparkOptions) -> None:
        """Another expert placement and cache size (Spark) on the loaded model: new GPU tables, filled from the host
        copy; the captured graphs, which hold the old tables' addresses, are captured again at their next use."""
        if self.spark is None:
            raise ValueError("this backend was loaded with every expert on the GPU (no SparkOptions)")
        self.discard_ahead()
        synchronize(self.stream)
        self.spark.place(options)
        self._forget_graphs()

    def _forget_graphs(self) -> None:
        """The captured graphs are captured again at their next use (what a step launches changed)."""
        if self._graphs:
            self.graph = DecodeGraph(self)
            self.prefill_graphs, self.verify_graphs, self.row_graphs = {}, {}, {}

    def count_routing(self, on: bool = True) -> None:
        """From now on (or, `on` False, no longer) count the experts each MoE layer routes every forward's tokens to
        (padding rows not), on the device: a launch per MoE layer, in the captured graphs too (those captured before
        are captured again). `take_routing_counts` reads the counts."""
        if (self.ops.routing_counts is not None) == on:
            return
        if self._ahead:
            raise ValueError("routing counts start or stop between steps: steps are running ahead")
        synchronize(self.stream)
        if on:
            self._routing = device_zeros((self.spec.n_layer, max(self.spec.n_expert, 1)), np.int32, self.stream)
            self.ops.routing_counts = [self._routing[layer] for layer in range(self.spec.n_layer)]  # views made once
        else:
            self.ops.routing_counts = None
        self._forget_graphs()

    def take_routing_counts(self) -> np.ndarray:
        """int64 [n_layer, n_expert]: the tokens each MoE layer routed to each expert in the forwards enqueued since
        the last take (the steps still running ahead included: the read waits for them, as a request's end does)."""
        if self.ops.routing_counts is None:
            raise ValueError("routing is not counted (count_routing)")
        return expert_counts.take_counts(self._routing, self.stream)

    def decode_ahead(self, position: int, slot: int, token: int | None = None, table: np.ndarray | None = None
                     ) -> None:
        """RunAhead's step as a graph replay left running: inputs copied in, the replay and the copy out of its
        argmax queued on the stream, nothing waited for. Without a captured graph, the plain synchronous step."""
        if token is None and not self._chained:  # the latest step ran eagerly: its token is on the host
            token = self._ahead_last
        if self.graph is None or not self.graph.ready:
            super().decode_ahead(position, slot, token, table)
            return
        self.pool.assign(np.array([slot], np.int32), np.array([position], np.int32))
        self.ops.set_tables(1, None if table is None else [table])
        self.ops.upload_one(token, position, slot)
        self._ahead.append(self.graph.launch_ahead())
        self._chained = True

    def next_token(self) -> int:
        entry = self._ahead.popleft()
        return entry if isinstance(entry, int) else self.graph.token(entry)

    def discard_ahead(self) -> None:
        super().discard_ahead()
        self._chained = False

    # ---- KVFlash: the pager decides, the backend moves bytes (lucekv.kvflash.sequence.PoolBackend) ----

    def execute(self, moves: list[Move], host: HostStore) -> None:
        """Run the moves in order, then mirror the pager's slot map (it changed with the residency) on the device.
        A written-back page-out is one gather launch and one device-to-host copy; a page-in one host-to-device
        copy and one scatter launch."""
        for m in moves:
            if isinstance(m, PageOut):
                if m.write_back:
                    kv = self.pool.read_block(m.block)
                    for layer in range(self.spec.n_layer):
                        host.store(m.chunk, layer, kv[0, layer], kv[1, layer])
            else:
                self.pool.write_block(m.block, (host.load(m.chunk, layer) for layer in range(self.spec.n_layer)))
                self.pool.cover((m.block + 1) * CHUNK_TOKENS)  # the next forward's assign uploads the mark
        if moves:
            self.pool.upload_changed()

    def chunk_keys(self, block: int) -> np.ndarray:
        """The block's keys as float32 [n_layer, CHUNK_TOKENS, n_kv_head, head_dim]: a buffer the next call reuses."""
        return self.pool.read_keys(block)

    def last_queries(self, row: int = -1) -> np.ndarray:
        """The rotated query of a row of the latest forward: of decode rows, the row's; of one sequence's tokens,
        the last one's (the only one kept)."""
        q = self.pool.last_q[row % self.ops.kept_rows].copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return q.reshape(self.spec.n_layer, self.spec.n_head, self.spec.head_dim)

    def recent_queries(self) -> np.ndarray:
        """[rows, n_layer, n_head, head_dim]: the last RECENT_QUERIES rows of the latest forward, as the CPU backend's
        (of one token, or of decode rows: the rows last_q keeps; a one-token product writes no others; of a padded
        verify block, its real rows')."""
        rows = self.pool.recent_rows
        if rows:
            q = self.pool.recent_q.copy_to_host(stream=self.stream)[:, self.pool.recent_padding : rows]
            q = q.transpose(1, 0, 2)
        else:
            q = self.pool.last_q[: self.ops.kept_rows].copy_to_host(stream=self.stream)[-RECENT_QUERIES:]
        self.stream.synchronize()
        return q.reshape(len(q), self.spec.n_layer, self.spec.n_head, self.spec.head_dim)


class TokenReadback(NamedTuple):
    """A run-ahead step's token, on its way to the host: the pinned slot and event of `DecodeGraph.launch_ahead`."""

    turn: int


class ForwardGraph:
    """An n-token forward (last-token logits, or all) captured once as a CUDA graph on the backend's stream, and
    replayed: numba pays 24-53 us of host time per kernel launch (more with many arguments), a replayed graph
    about 0.5 us.

    Capture records the launches of the forward just run eagerly (its kernels compiled and loaded), on the same
    activation arrays: CudaOps keeps the pools of n-token forwards for the graph's lifetime, and their inputs in
    fixed buffers. Relaxed capture mode: no allocation should happen while recording, but one would be allowed."""

    def __init__(self, backend: CudaBackend, n_tokens: int, all_logits: bool = False):
        self.backend = backend
        self.n_tokens = n_tokens
        self.all_logits = all_logits
        self.logits = None
        self._host_logits: np.ndarray | None = None
        self._exec = None
        self.overlapped_edges = 0  # kernel-to-kernel edges of the captured forward made programmatic
        backend.ops.keep_pools(n_tokens)

    @property
    def ready(self) -> bool:
        return self._exec is not None

    def capture(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        b = self.backend

        def record() -> None:
            b.ops.rewind()
            b.ops.mark_slots()
            self.logits = forward(b.spec, b.weights, b.ops, tokens, positions, slots, self.all_logits)
            self._record_after()

        self._exec, self.overlapped_edges = capture_graph(b.stream, record)
        self._host_logits = cuda.pinned_array(self.logits.shape, np.float32)

    def _record_after(self) -> None:
        """Launches the graph makes after the forward's (none)."""

    def launch(self) -> None:
        """Enqueue the captured forward (inputs already in the fixed buffers) on the backend's stream."""
        launch_graph(self._exec, self.backend.stream)

    def replay(self, n: int) -> np.ndarray:
        """Run the captured forward; its logits on the host (with all the rows' logits, of the last n: a padded
        verify block's real rows), through pinned memory (a pageable copy of a 150K-token vocabulary's logits costs
        more than the copy out of it)."""
        self.launch()
        stream = self.backend.stream
        copy_to_host_async(self._host_logits, self.logits, stream)
        synchronize(stream)
        return self._host_logits[len(self._host_logits) - n :].copy() if self.all_logits else self._host_logits.copy()


class DecodeGraph(ForwardGraph):
    """The one-token step, ending with the argmax of its logits written to the step's token buffer: a replay left
    running (`launch_ahead`) feeds the next one without the host."""

    def __init__(self, backend: CudaBackend):
        super().__init__(backend, 1)
        self._tokens_host = cuda.pinned_array(2, np.int32)  # two turns, as the step inputs (CudaOps.upload_one)
        self._token_ready = [ordering_event() for _ in range(2)]
        self._turn = 0
        self._argmax_scratch = sample.argmax_scratch(1, stream=backend.stream)
        # compiled now: a capture only records launches (the forward's kernels compile in the eager step before it)
        sample.argmax(cuda.device_array((1, 4), np.float32), 4, cuda.device_array(1, np.int32), self._argmax_scratch,
                      stream=backend.stream)

    def _record_after(self) -> None:
        b = self.backend
        sample.argmax(self.logits, b.spec.vocab_size, b.ops.next_token_buffer, self._argmax_scratch, stream=b.stream)

    def launch_ahead(self) -> TokenReadback:
        """Enqueue the captured step and the copy of its argmax to the host; wait for it with `token`. At most one
        launch may be left untaken when the next is made (two turns of pinned slots and events)."""
        from cuda.bindings import driver

        b = self.backend
        self.launch()
        self._turn ^= 1
        t = self._turn
        _check(driver.cuMemcpyDtoHAsync(self._tokens_host[t:].ctypes.data, _device_pointer(b.ops.next_token_buffer), 4,
                                        driver.CUstream(int(b.stream.handle))))
        if b.spark is not None:
            b.spark.enqueue_readback(t)  # the step's expert ids, for the cache
        self._token_ready[t].record(b.stream)
        return TokenReadback(t)

    def token(self, r: TokenReadback) -> int:
        self._token_ready[r.turn].synchronize()
        if self.backend.spark is not None:
            self.backend.spark.step_done(r.turn)
        return int(self._tokens_host[r.turn])


class RowsGraph(ForwardGraph):
    """A forward of `rows` tokens with every row's logits, ending with the argmax of every row: decode rows, one token
    of each of `rows` sequences (their block tables in CudaOps' fixed buffers; one graph per batch size bucket), or a
    speculative round's verify block of one sequence (one graph per bucket of widths, padded). `replay` brings all
    the logits to the host, `replay_rows` the tokens and the logits of the rows asked for."""

    def __init__(self, backend: CudaBackend, rows: int):
        super().__init__(backend, rows, all_logits=True)
        self._tokens_dev = cuda.device_array(rows, np.int32, stream=backend.stream)
        self._tokens_host = cuda.pinned_array(rows, np.int32)
        self._argmax_scratch = sample.argmax_scratch(rows, stream=backend.stream)
        self._row_logits: list = []  # each row's logits on the device (see capture)
        # compiled now: a capture only records launches
        sample.argmax(cuda.device_array((rows, 4), np.float32), 4, self._tokens_dev, self._argmax_scratch,
                      stream=backend.stream)

    def capture(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        super().capture(tokens, positions, slots)
        self._row_logits = [self.logits[i] for i in range(self.n_tokens)]  # views made once (numba's are slow)

    def _record_after(self) -> None:
        b = self.backend
        sample.argmax(self.logits, b.spec.vocab_size, self._tokens_dev, self._argmax_scratch, stream=b.stream)

    def replay_rows(self, n: int, sampled: Sequence[int], first: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Run the rows: the greedy tokens of n rows from row `first`, and the logits of the rows in `sampled`
        (only those rows cross to the host)."""
        self.launch()
        stream = self.backend.stream
        copy_to_host_async(self._tokens_host, self._tokens_dev, stream)
        for i in sampled:
            copy_to_host_async(self._host_logits[i], self._row_logits[i], stream)
        synchronize(stream)
        return self._tokens_host[first : first + n].copy(), self._host_logits[list(sampled)].copy()


def row_bucket(rows: int) -> int:
    """The batch size a decode rows' graph is captured for: rows rounded up to a power of two."""
    return 1 << (rows - 1).bit_length()


def prefill_bucket(n: int, chunk: int) -> int:
    """The width a prompt piece of n <= chunk tokens replays the graph of: the first of PREFILL_WIDTHS below the
    chunk that holds it, else the chunk's."""
    return next((w for w in PREFILL_WIDTHS if n <= w < chunk), chunk)


def verify_bucket(width: int) -> int:
    """The width a verify block's graph is captured for: rounded up to a multiple of VERIFY_STEP (a few graphs
    for every draft length, and a padding row costs little: CudaOps.as_matvec_rows)."""
    return -(-width // VERIFY_STEP) * VERIFY_STEP


def graph_width(n: int) -> int:
    """The width a verify block of n tokens runs as with graphs: its bucket's (`verify_bucket`, padded), else n (one
    token: a decode step; wider than MAX_VERIFY: eager)."""
    return verify_bucket(n) if 1 < n <= MAX_VERIFY else n


def capture_graph(stream, record: Callable[[], None], busy_warps: float = BUSY_WARPS_PER_SM) -> tuple[object, int]:
    """The launches `record()` makes on `stream`, captured (relaxed mode) as an executable CUDA graph with its
    kernel-to-kernel edges made programmatic where they may be (`overlap_kernel_launches`); returns the graph and
    the number of such edges. Nothing runs: replay it with `launch_graph`."""
    from cuda.bindings import driver

    handle = driver.CUstream(int(stream.handle))
    with cuda.defer_cleanup():
        _check(driver.cuStreamBeginCapture(handle, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
        try:
            record()
        finally:
            graph = _check(driver.cuStreamEndCapture(handle))
        try:
            overlapped = overlap_kernel_launches(graph, busy_warps)
            return _check(driver.cuGraphInstantiate(graph, 0)), overlapped
        finally:
            _check(driver.cuGraphDestroy(graph))  # the executable graph is independent of it


def launch_graph(executable, stream) -> None:
    """Enqueue a graph from `capture_graph` on `stream`."""
    from cuda.bindings import driver

    _check(driver.cuGraphLaunch(executable, driver.CUstream(int(stream.handle))))


def overlap_kernel_launches(graph, busy_warps: float = BUSY_WARPS_PER_SM) -> int:
    """Make the captured graph's kernel-to-kernel edges programmatic (sm_90+): the next kernel is launched once
    every block of this one is past its own `await_grid`, and its blocks wait in theirs until this one has
    finished, instead of being launched after it. Most of a decode step's kernels run for a few microseconds, so
    the launch latency saved at each of its ~300 boundaries is a good part of the step.

    An edge out of a kernel that fills the GPU (BUSY_WARPS_PER_SM warps per SM or more: an 8B model's products and
    attention, one wave of blocks by design) stays a plain one: launched while such a kernel runs, the next one's
    blocks land on whichever SMs have room first, unevenly. Measured on an H200, decode step of the 8B shape: every
    edge programmatic 5.1% slower, all but those out of the big kernels 0.8% faster (3.637 -> 3.607 ms); 0.5B shape
    (its kernels a fraction of a wave, every edge programmatic) 4.8% faster (1.226 -> 1.168 ms). busy_warps: that
    threshold (benchmarks compare; inf: every edge programmatic). Returns the edges changed."""
    if not overlapped_launches():
        return 0
    from cuda.bindings import driver

    _, _, _, n = _check(driver.cuGraphGetEdges(graph, 0))
    src, dst, data, n = _check(driver.cuGraphGetEdges(graph, n))
    busy = {int(node): _busy(node, busy_warps) for node in (*src[:n], *dst[:n])}  # None: not a kernel node
    edges = [(a, b, d) for a, b, d in zip(src[:n], dst[:n], data[:n], strict=True)
             if busy[int(a)] is False and busy[int(b)] is not None]
    if not edges:
        return 0
    src, dst, data = (list(x) for x in zip(*edges, strict=True))
    programmatic = driver.CUgraphEdgeData()
    programmatic.type = driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    programmatic.from_port = driver.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
    _check(driver.cuGraphRemoveDependencies(graph, src, dst, data, len(src)))
    try:
        _check(driver.cuGraphAddDependencies(graph, src, dst, [programmatic] * len(src), len(src)))
    except RuntimeError:  # a driver without programmatic edges in graphs (before CUDA 12.3): the plain ones back
        _check(driver.cuGraphAddDependencies(graph, src, dst, data, len(src)))
        return 0
    return len(src)


def _busy(node, busy_warps: float) -> bool | None:
    """Whether a kernel node's grid has busy_warps warps per SM or more; None for other nodes."""
    from cuda.bindings import driver

    if _check(driver.cuGraphNodeGetType(node)) != driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
        return None
    p = _check(driver.cuGraphKernelNodeGetParams(node))
    warps = p.gridDimX * p.gridDimY * p.gridDimZ * -(-p.blockDimX * p.blockDimY * p.blockDimZ // 32)
    return warps >= busy_warps * cuda.get_current_device().MULTIPROCESSOR_COUNT


def copy_to_device_async(dst, src: np.ndarray, stream, at: int = 0) -> None:
    """Host array src into device array dst's rows from `at` (len(src) of them), enqueued on `stream` by one driver
    call: numba's copy_to_device and its slicing of dst spend ~0.2 ms of Python per call (measured on the H200
    machine: most of a decode step's host time). A pinned src must stay unchanged until the stream has run the copy
    (every forward ends synchronized); a pageable one is staged before the call returns."""
    if SIMULATOR:  # no driver there
        dst[at : at + len(src)].copy_to_device(src, stream=stream)
        return
    from cuda.bindings import driver

    _check(driver.cuMemcpyHtoDAsync(driver.CUdeviceptr(_address(dst) + at * dst.strides[0]), src.ctypes.data,
                                    src.nbytes, driver.CUstream(int(stream.handle))))


def copy_to_host_async(dst: np.ndarray, src, stream) -> None:
    """Device array src into pinned host array dst (contiguous, of src's size), enqueued on `stream` by one driver
    call; read dst after `synchronize(stream)`."""
    if SIMULATOR:
        src.copy_to_host(dst, stream=stream)
        return
    from cuda.bindings import driver

    _check(driver.cuMemcpyDtoHAsync(dst.ctypes.data, _device_pointer(src), dst.nbytes,
                                    driver.CUstream(int(stream.handle))))


def synchronize(stream) -> None:
    """Wait for everything enqueued on `stream` (one driver call: numba's synchronize costs more host time)."""
    if SIMULATOR:
        stream.synchronize()
        return
    from cuda.bindings import driver

    _check(driver.cuStreamSynchronize(driver.CUstream(int(stream.handle))))


def _device_pointer(a):
    from cuda.bindings import driver

    return driver.CUdeviceptr(_address(a))


def _address(a) -> int:
    return a.__cuda_array_interface__["data"][0]


def _check(result):
    """cuda.bindings calls return (CUresult, *values): raise on an error, return the value(s)."""
    from cuda.bindings import driver

    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {driver.cuGetErrorName(err)[1]!r}")
    return values[0] if len(values) == 1 else values or None
