"""CPU backend: quantized weights through numba kernels, KV in a slot pool of host arrays."""

from __future__ import annotations

import mmap
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from lucekv.backends.ahead import RunAhead
from lucekv.backends.cpu_step import DecodeStep, Workers
from lucekv.backends.slots import SlotMap
from lucekv.kernels.cpu.attention import attend_batch, attend_rows
from lucekv.kernels.cpu.kv_tiles import LANES as KV_LANES
from lucekv.kernels.cpu.matvec import PromptInput, matmul, matvec_rows, prompt_input, prompt_rows
from lucekv.kernels.cpu.moe import group_by_expert, route
from lucekv.kernels.cpu.quants import PackedMatrix, dequantize, dequantize_rows, pack_stacked, pack_tensor, split_rows
from lucekv.kvflash.host_store import HostStore
from lucekv.kvflash.pager import CHUNK_TOKENS, RECENT_QUERIES, Move, PageIn, PageOut
from lucekv.model.arch import ModelSpec
from lucekv.model.decoder import LayerWeights, MoeWeights, Weights, forward, load_weights, project_qkv
from lucekv.model.gguf import GGUFFile, TensorInfo

KV_DTYPES = {"f16": np.float16, "f32": np.float32}
GELU_C = np.float32(np.sqrt(2.0 / np.pi))
MAP_NORESERVE_LINUX = 0x4000  # mmap.MAP_NORESERVE, which Python's mmap module names only from 3.13 on


class KVPool(SlotMap):
    """K and V of every layer in `size` host slots."""

    def __init__(self, spec: ModelSpec, size: int, dtype: str):
        super().__init__(size)
        shape = (size, spec.n_kv_head, spec.head_dim)
        self.dtype = KV_DTYPES[dtype]
        # One array of every layer (the decode step reads them all); k[layer] and v[layer] are views of it.
        self.k_all = lazy_zeros((spec.n_layer, *shape), self.dtype)
        self.v_all = lazy_zeros((spec.n_layer, *shape), self.dtype)
        self.k = list(self.k_all)
        self.v = list(self.v_all)


def tree_positions(slot_pos: np.ndarray, run: np.ndarray, slots: np.ndarray, positions: np.ndarray,
                   ancestors: np.ndarray) -> np.ndarray:
    """int32 [n, len(run)]: the positions each token of a tree's verify block sees at the slots of `run` (its
    sequence's, logical order): the slot map's outside the block, the node's position at its own ancestors' slots
    (itself included), -1 (out of view) at the block's other slots. See CpuOps.begin_tree."""
    which = np.full(len(slot_pos), -1, np.int64)
    which[slots] = np.arange(len(slots))
    node = which[run]  # the block index a run entry holds, -1 outside the block
    seen = np.tile(slot_pos[run], (len(slots), 1))
    at = np.flatnonzero(node >= 0)
    bits = (np.asarray(ancestors, np.int64)[:, None] >> node[at][None, :]) & 1
    seen[:, at] = np.where(bits == 1, positions[node[at]][None, :], -1)
    return seen


def lazy_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeros whose pages are mapped as they are first touched, so a pool sized to every sequence's whole context
    costs what is used. Mapped without reserving swap: Linux's default overcommit refuses one reserved mapping
    larger than the machine's memory (a 2M-token f32 pool of qwen2.5-0.5b is 24 GiB), as np.zeros would ask."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return np.zeros(shape, dtype)
    noreserve = getattr(mmap, "MAP_NORESERVE", MAP_NORESERVE_LINUX if sys.platform == "linux" else 0)
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | noreserve)
    return np.frombuffer(mem, dtype).reshape(shape)  # the array holds the mapping


@dataclass
class CpuExperts:
    """One layer's router and experts, each expert's matrices views of the stacked tensors' packed rows."""

    router: PackedMatrix
    gate: list[PackedMatrix]
    up: list[PackedMatrix]
    down: list[PackedMatrix]


class CpuOps:
    """The decoder's ops on numpy arrays [n_tokens, width] (see lucekv.model.decoder.Ops).

    A forward is one sequence's tokens, or one token of each of several sequences (decode rows); `begin_step` says
    which slots each token attends over (its sequence's blocks in logical order). Rows go through `matvec_rows` and
    each row's attention is a loop of its own, so a row's numbers do not depend on the others in its batch."""

    def __init__(self, spec: ModelSpec, pool: KVPool, workers: Workers | None = None):
        self.spec = spec
        self.pool = pool
        self.workers = workers or Workers()  # the threads its products split rows among
        # a prompt's products through the int16 tile kernels (matvec.prompt_input); an MoE model's stay float32: its
        # routers' top-k picks flip on near ties when their input moves by x's rounding (~1e-4), an O(1) change
        self.tile_prompts = spec.n_expert == 0
        self._layer_rope = [spec.layer_rope(i) for i in range(spec.n_layer)]
        self._slots = np.zeros(0, np.intp)  # the slots the forward's tokens attend over, one run per sequence
        self._offsets: np.ndarray | None = None  # decode rows: token t reads run offsets[t] .. offsets[t + 1]
        self.runs = np.zeros((0, 2), np.int64)  # [n_tokens, 2]: token t reads _slots[runs[t, 0]:runs[t, 1]]
        self._attended_pos: np.ndarray | None = None  # positions of _slots as seen, where not slot_pos's (a tree)
        # post-RoPE queries [n_tokens, n_head, head_dim] of each layer's latest forward, for relevance scorers (a decode
        # row's, or a prompt's last RECENT_QUERIES)
        self.queries = [np.zeros((1, spec.n_head, spec.head_dim), np.float32) for _ in range(spec.n_layer)]
        # called with (layer, expert ids [n_tokens, n_expert_used]) by every MoE layer of every forward (`lucekv spark
        # trace` counts them); None: nothing is observed
        self.routing_observer: Callable[[int, np.ndarray], None] | None = None
        # called with (layer, normalized FFN input [n_tokens, n_embd]) by every MoE layer of every forward (the
        # k-means router of lucekv.model.synth clusters them); None: nothing is observed
        self.ffn_input_observer: Callable[[int, np.ndarray], None] | None = None

    def begin_step(self, n_tokens: int, tables: Sequence[np.ndarray] | None) -> None:
        """tables: the blocks of each sequence of the forward, in logical order: one (all tokens are its), or one per
        token; None: the whole pool below its high-water mark, in slot order (a sequence alone in the pool)."""
        if tables is None:
            runs = [np.arange(self.pool.high_water)]
        else:
            runs = [(np.asarray(t, np.intp)[:, None] * CHUNK_TOKENS + np.arange(CHUNK_TOKENS)).ravel() for t in tables]
        if len(runs) not in (1, n_tokens):
            raise ValueError(f"a forward of {n_tokens} tokens over {len(runs)} sequences: one sequence's tokens, or "
                             "one token of each")
        if len(runs) == 1:  # every token reads the one run (few numpy calls: each is slow on caches a step left cold)
            self._slots = runs[0]
            self._offsets = np.array([0, len(self._slots)]) if n_tokens == 1 else None
            self.runs = np.array([[0, len(self._slots)]] * n_tokens, np.int64)
        else:
            self._slots = np.concatenate(runs).astype(np.intp)
            self._offsets = np.cumsum([0] + [len(r) for r in runs])
            self.runs = np.stack([self._offsets[:-1], self._offsets[1:]], axis=1)
        self._attended_pos = None

    def begin_tree(self, table: np.ndarray, slots: np.ndarray, positions: np.ndarray, ancestors: np.ndarray) -> None:
        """A draft tree's verify block (lucekv.spec.tree): token j, at `positions[j]` (the root's plus its depth) and
        written to slots[j], attends to its sequence's slots (table: its blocks in logical order) outside the block
        and to the block's slots whose bits ancestors[j] sets, at their tokens' positions. Every token reads the
        sequence's slots in logical order, as a plain step reads them, with the positions it sees there
        (`attended_pos`, [n_tokens, slots])."""
        self.begin_step(len(slots), [table])
        self._attended_pos = tree_positions(self.pool.slot_pos, self._slots, slots, positions, ancestors)

    @property
    def attended(self) -> np.ndarray:
        """The slots the forward's tokens attend over, in logical order (one sequence's; see begin_step)."""
        return self._slots

    @property
    def attended_pos(self) -> np.ndarray | None:
        """The positions of `attended` as each token sees them ([n_tokens, slots]) where they are not the slot map's
        (a tree's block)."""
        return self._attended_pos

    def matrix(self, t: TensorInfo) -> PackedMatrix:
        return pack_tensor(t)

    def projections(self, ws: Sequence[TensorInfo], biases: Sequence[TensorInfo | None]
                    ) -> list[tuple[PackedMatrix, np.ndarray | None]]:
        return [(self.matrix(w), None if b is None else self.vector(b)) for w, b in zip(ws, biases, strict=True)]

    def gated(self, gate: TensorInfo, up: TensorInfo) -> tuple[PackedMatrix, PackedMatrix]:
        return self.matrix(gate), self.matrix(up)

    def experts(self, router: TensorInfo, gate: TensorInfo, up: TensorInfo, down: TensorInfo) -> CpuExperts:
        n = router.shape[0]
        return CpuExperts(self.matrix(router), *(split_rows(pack_stacked(t), n) for t in (gate, up, down)))

    def vector(self, t: TensorInfo) -> np.ndarray:
        return dequantize(t.data, t.qtype, t.shape).reshape(-1)

    def embed(self, table: PackedMatrix, tokens: np.ndarray, scale: float) -> np.ndarray:
        x = np.concatenate([dequantize_rows(table, int(t), int(t) + 1) for t in tokens])
        return x * np.float32(scale) if scale != 1.0 else x

    def project(self, x: np.ndarray, p: list[tuple[PackedMatrix, np.ndarray | None]], norm: np.ndarray
                ) -> list[np.ndarray]:
        h = self.rmsnorm(x, norm)
        if self._offsets is None and len(h) > 1:  # a prompt's tokens: h prepared once for the projections
            prepared = self._prompt_input(h)
            return [self._matmul(w, prepared) if b is None else self._matmul(w, prepared) + b for w, b in p]
        return [self.linear(w, h) if b is None else self.linear(w, h) + b for w, b in p]

    def linear(self, w: PackedMatrix, x: np.ndarray, norm: np.ndarray | None = None,
               residual: np.ndarray | None = None) -> np.ndarray:
        if norm is not None:
            x = self.rmsnorm(x, norm)
        if self._offsets is not None:
            y = matvec_rows(w, x)
        elif len(x) == 1:  # one token of a model the decode step does not take (MoE): the matvec
            y = matmul(w, x)
        else:
            y = self._matmul(w, x)
        return y if residual is None else residual + y

    def _matmul(self, w: PackedMatrix, x: np.ndarray | PromptInput) -> np.ndarray:
        """X @ W.T with W's rows split among the backend's threads (matvec.prompt_rows)."""
        x = x if isinstance(x, PromptInput) else self._prompt_input(x)
        out = np.empty((len(x.xs), w.rows), np.float32)
        self._split(w.rows, lambda r0, r1: prompt_rows(w, x, out, r0, r1))
        return out

    def _prompt_input(self, x: np.ndarray) -> PromptInput:
        return prompt_input(x, self._split, self.tile_prompts)

    def _split(self, n_items: int, part) -> None:
        """part(i0, i1) for a share of range(n_items) on each of the backend's threads (numba's thread count); a
        thread whose share is empty (fewer items than threads: gemma3's one kv head) does nothing."""
        n = numba.get_num_threads()

        def share(t: int) -> None:
            i0, i1 = t * n_items // n, (t + 1) * n_items // n
            if i0 < i1:
                part(i0, i1)
        self.workers.run(n, share)

    def rmsnorm(self, x: np.ndarray, w: np.ndarray, groups: int = 1) -> np.ndarray:
        xs = x.reshape(len(x), groups, -1)
        ms = np.mean(xs * xs, axis=-1, keepdims=True, dtype=np.float32)
        return (xs / np.sqrt(ms + np.float32(self.spec.rms_eps)) * w).reshape(x.shape).astype(np.float32, copy=False)

    def rope(self, x: np.ndarray, n_heads: int, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
        """x [n, n_heads * head_dim] rotated at `positions` (the spec's RoPE style)."""
        spec = self.spec
        rd = spec.rope_dim
        ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [n, rd/2]
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        xh = x.reshape(len(x), n_heads, spec.head_dim).copy()
        if spec.arch.rope_style == "neox":
            a, b = xh[..., : rd // 2].copy(), xh[..., rd // 2 : rd].copy()
            xh[..., : rd // 2] = a * cos - b * sin
            xh[..., rd // 2 : rd] = a * sin + b * cos
        else:
            a, b = xh[..., 0:rd:2].copy(), xh[..., 1:rd:2].copy()
            xh[..., 0:rd:2] = a * cos - b * sin
            xh[..., 1:rd:2] = a * sin + b * cos
        return xh.reshape(x.shape)

    def attention(self, layer: int, x: np.ndarray, lw: LayerWeights, positions: np.ndarray, slots: np.ndarray,
                  window: int) -> np.ndarray:
        spec, pool, rope = self.spec, self.pool, self._layer_rope[layer]
        q, k, v = project_qkv(spec, self, x, lw)
        q = self.rope(q, spec.n_head, positions, rope.inv_freq)
        k = self.rope(k, spec.n_kv_head, positions, rope.inv_freq)
        kp, vp = pool.k[layer], pool.v[layer]
        kp[slots] = k.reshape(len(k), spec.n_kv_head, spec.head_dim)
        vp[slots] = v.reshape(len(v), spec.n_kv_head, spec.head_dim)
        qh = q.reshape(len(q), spec.n_head, spec.head_dim)
        self.queries[layer] = qh
        # numba's CPU target has no float16: the slots read are gathered and widened here (numpy uses F16C for it)
        k, v = kp[self._slots].astype(np.float32), vp[self._slots].astype(np.float32)
        sp = pool.slot_pos[self._slots] if self._attended_pos is None else self._attended_pos
        if self._offsets is not None:
            out = attend_rows(qh, k, v, sp, self._offsets, positions, window, rope.attn_scale)
        else:  # the kv heads (and their groups of q heads) split among the threads
            out = np.empty(qh.shape, np.float32)
            group = spec.n_head // spec.n_kv_head

            def heads(k0: int, k1: int) -> None:
                out[:, k0 * group:k1 * group] = attend_batch(qh[:, k0 * group:k1 * group], k[:, k0:k1], v[:, k0:k1],
                                                             sp, sp.shape[-1], positions, window, rope.attn_scale)
            self._split(spec.n_kv_head, heads)
        return out.reshape(len(q), -1)

    def attend_all(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
        """Attention without a mask (a DFlash block, lucekv.spec.dflash): every query [n, n_head * hd] sees every
        key and value [m, n_kv_head * hd]; grouped heads as the spec has them."""
        spec = self.spec
        group, hd = spec.n_head // spec.n_kv_head, spec.head_dim
        qh = q.reshape(len(q), spec.n_kv_head, group, hd)
        kh, vh = k.reshape(len(k), spec.n_kv_head, hd), v.reshape(len(v), spec.n_kv_head, hd)
        scores = np.einsum("qhgd,khd->hgqk", qh, kh) * np.float32(scale)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out = np.einsum("hgqk,khd->qhgd", scores / scores.sum(axis=-1, keepdims=True), vh)
        return np.ascontiguousarray(out.reshape(len(q), -1), np.float32)

    def gated_linear(self, x: np.ndarray, g: tuple[PackedMatrix, PackedMatrix], norm: np.ndarray) -> np.ndarray:
        return self._gated(self.rmsnorm(x, norm), *g)

    def _gated(self, h: np.ndarray, gate: PackedMatrix, up: PackedMatrix) -> np.ndarray:
        if len(h) == 1 or self._offsets is not None:  # one token, or decode rows (matvec_rows)
            return self._gated_act(self.linear(gate, h), self.linear(up, h))
        x = self._prompt_input(h)
        out = np.empty((len(h), gate.rows), np.float32)
        up_out = np.empty_like(out)

        def rows(r0: int, r1: int) -> None:  # each thread: its rows of both products, then their activation
            prompt_rows(gate, x, out, r0, r1)
            prompt_rows(up, x, up_out, r0, r1)
            out[:, r0:r1] = self._gated_act(out[:, r0:r1], up_out[:, r0:r1])
        self._split(gate.rows, rows)
        return out

    def moe_ffn(self, x: np.ndarray, m: MoeWeights, norm: np.ndarray) -> np.ndarray:
        """Tokens grouped by expert: each chosen expert's products run once, over all the tokens routed to it. Every
        token's k expert outputs are kept and summed in rank order, as a one-token step sums them."""
        spec, e = self.spec, m.experts
        h = self.rmsnorm(x, norm)
        if self.ffn_input_observer is not None:
            self.ffn_input_observer(m.layer, h)
        k = spec.n_expert_used
        ids, weights = route(self.linear(e.router, h), k, spec.arch.norm_topk)
        if self.routing_observer is not None:
            self.routing_observer(m.layer, ids)
        order, starts = group_by_expert(ids, spec.n_expert)
        outs = np.empty((len(h) * k, spec.n_embd), np.float32)  # row token * k + rank
        for expert in np.flatnonzero(np.diff(starts)):
            rows = order[starts[expert]:starts[expert + 1]]
            outs[rows] = self.linear(e.down[expert], self._gated(h[rows // k], e.gate[expert], e.up[expert]))
        y = (outs.reshape(len(h), k, -1) * weights[:, :, None]).sum(axis=1)
        if m.shared is not None:
            s = m.shared
            shared = self.linear(s.down, self._gated(h, *s.gate_up))
            y += shared * (np.float32(1) / (np.float32(1) + np.exp(-self.linear(s.gate, h))))
        return x + y

    def _gated_act(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        if self.spec.arch.activation == "silu":
            return gate / (1.0 + np.exp(-gate)) * up
        g = gate
        return 0.5 * g * (1.0 + np.tanh(GELU_C * (g + np.float32(0.044715) * g * g * g))) * up

    def add(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return x + y

    def rows(self, x: np.ndarray, idx: slice) -> np.ndarray:
        return x[idx]


class CpuDraftOps(CpuOps):
    """The ops of a DFlash drafter's forward (lucekv.spec.dflash): every product a prompt's (matvec.prompt_rows), one
    context row too (the parallel matvec's launch costs more than a drafter's small products: 4 ms against 50 us
    for a 64x128 Q8_0 matrix on a busy 2-core machine)."""

    def linear(self, w: PackedMatrix, x: np.ndarray, norm: np.ndarray | None = None,
               residual: np.ndarray | None = None) -> np.ndarray:
        y = self._matmul(w, x if norm is None else self.rmsnorm(x, norm))
        return y if residual is None else residual + y


class CpuBackend(RunAhead):
    name = "cpu"
    prefill_chunk = 256  # tokens per prefill forward: bounds the scratch of its rows (DecodeStep)
    max_tree_block = 63  # a draft tree's verify block: its ancestor masks are int64 (bits 0 .. 62)

    def __init__(self, g: GGUFFile, spec: ModelSpec, kv_dtype: str = "f16", pool_size: int | None = None):
        # The backend's own threads split every product (Workers): BLAS runs single-threaded in each. (BLAS
        # threads spinning beside numba's starved both: prefill 16 tok/s with 2 BLAS threads, 250 with 1.)
        threadpool_limits(limits=1, user_api="blas")
        super().__init__()
        self.spec = spec
        self.pool = KVPool(spec, pool_size or spec.n_ctx, kv_dtype)
        self.workers = Workers()
        self.ops = CpuOps(spec, self.pool, self.workers)
        self.weights: Weights = load_weights(g, spec, self.ops)
        # decode as one numba call per thread, for dense models (an MoE layer's one-token step goes op by op) whose
        # heads are whole vectors of the step's attention (kv_tiles)
        dense = all(lw.moe is None for lw in self.weights.layers)
        self.decode_step = DecodeStep(spec, self.weights, self.pool, self.workers) if (
            dense and spec.head_dim % KV_LANES == 0) else None
        # target features for a DFlash drafter (lucekv.spec.dflash): while `capture_layers` names layers, each forward
        # leaves their outputs in `captured` [n_tokens, len(capture_layers) * n_embd] (in that order); () costs nothing
        self.capture_layers: tuple[int, ...] = ()
        self.captured: np.ndarray | None = None

    def forward(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, all_logits: bool = False,
                tables: Sequence[np.ndarray] | None = None) -> np.ndarray:
        """Logits [1 or n, vocab] float32 for `tokens` at `positions`, their K/V written to `slots`. tables: each
        sequence's blocks in logical order, one for all the tokens or one per token (decode rows: the logits of
        every row); None: a sequence alone in the pool (see CpuOps.begin_step).

        Every forward takes the decode step where the model has one (dense): each token a row whose numbers are a
        function of its own token, position and the K/V it attends to, whatever else the forward holds. So a prompt's
        K/V do not depend on how it was cut into pieces (a reused prefix leaves the rest to compute from any
        position), a decoded token's K/V are those a prompt holding it gets, and decode rows, verify blocks and
        prompt pieces give the same logits bit for bit (issue 25). The op-by-op path (an MoE model's) computes a
        piece's tokens together: its BLAS products and attention blocks vary in the last bits with the piece."""
        self.pool.assign(slots, positions)
        self.ops.begin_step(len(tokens), tables)
        every = all_logits or (tables is not None and len(tables) == len(tokens))  # decode rows: every row's logits
        if self.decode_step is not None:
            return self._step(tokens, positions, slots, len(tokens) if every else 1)
        return self._op_forward(tokens, positions, slots, every)

    def _step(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, n_logits: int) -> np.ndarray:
        """The decode step over the ops' slots (begin_step or begin_tree), the features of `capture_layers` kept."""
        capture = self.capture_layers
        captured = capture_at = None
        if capture:
            captured = np.empty((len(capture), len(tokens), self.spec.n_embd), np.float32)
            capture_at = np.full(self.spec.n_layer, -1, np.int64)
            capture_at[list(capture)] = np.arange(len(capture))
        logits, queries = self.decode_step(np.asarray(tokens), positions, slots, self.ops.attended, self.ops.runs,
                                           n_logits, capture_at, captured, self.ops.attended_pos)
        self.ops.queries = list(queries)
        if capture:
            self.captured = np.concatenate(list(captured), axis=1)
        return logits

    def _op_forward(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, all_logits: bool
                    ) -> np.ndarray:
        """The decoder op by op, the features of `capture_layers` kept."""
        capture = self.capture_layers
        states: dict[int, np.ndarray] = {}  # (the CPU's ops make new arrays: x is never changed in place)
        logits = forward(self.spec, self.weights, self.ops, np.asarray(tokens), positions, slots, all_logits,
                         states.__setitem__ if capture else None)
        if capture:
            self.captured = np.concatenate([states[i] for i in capture], axis=1)
        return logits

    def forward_argmax(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                       tables: Sequence[np.ndarray] | None = None) -> np.ndarray:
        """The greedy token after each of `tokens` (int32 [n]) of one sequence (tables: see `forward`): a speculative
        round's verify forward."""
        logits = self.forward(tokens, positions, slots, all_logits=True, tables=tables)
        return np.argmax(logits[:, : self.spec.vocab_size], axis=1).astype(np.int32)

    def verify_width(self, n: int) -> int:
        """The width a verify block of n tokens runs as: n (no padding here; lucekv.spec.fill)."""
        return n

    def forward_tree(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, ancestors: np.ndarray,
                     table: np.ndarray, greedy: bool = False) -> np.ndarray:
        """Logits [n, vocab] (with `greedy`: each row's argmax, int32 [n]) of a draft tree's verify block of one
        sequence (lucekv.spec.tree): token j at
        positions[j] (the root's, positions[0], plus its depth), its K/V written to slots[j], which the slot map
        gives position positions[0] + j (a rejected node then falls out of view by position, as a chain's
        draft); it attends to the sequence's slots before the block and to the block's whose bits ancestors[j]
        (int64) sets. A node's numbers are those of the same token at the same position in plain decoding of
        its path: its row reads the same slots in the same order (table: the sequence's blocks)."""
        self.pool.assign(slots, positions[0] + np.arange(len(slots), dtype=np.int32))
        self.ops.begin_tree(table, slots, positions, ancestors)
        if self.decode_step is not None:
            logits = self._step(tokens, positions, slots, len(tokens))
        else:
            logits = self._op_forward(tokens, positions, slots, True)
        return np.argmax(logits[:, : self.spec.vocab_size], axis=1).astype(np.int32) if greedy else logits

    def copy_kv(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Every layer's K and V of slots `src` into slots `dst` (an accepted tree path to its positions' slots; the
        slot map already gives dst their positions)."""
        self.pool.k_all[:, dst] = self.pool.k_all[:, src]
        self.pool.v_all[:, dst] = self.pool.v_all[:, src]

    def prepare(self, step_tokens: int, verify_width: int) -> None:
        """Nothing to prepare at engine start here (the CUDA backend compiles its kernels and captures graphs)."""

    def count_routing(self, on: bool = True) -> None:
        """From now on (or, `on` False, no longer) count the experts each MoE layer routes every forward's tokens to
        (`take_routing_counts`)."""
        self._routed = np.zeros((self.spec.n_layer, max(self.spec.n_expert, 1)), np.int64)
        self.ops.routing_observer = self._count_routed if on else None

    def _count_routed(self, layer: int, ids: np.ndarray) -> None:
        self._routed[layer] += np.bincount(ids.reshape(-1), minlength=self._routed.shape[1])

    def take_routing_counts(self) -> np.ndarray:
        """int64 [n_layer, n_expert]: the tokens each MoE layer routed to each expert since the last take."""
        if self.ops.routing_observer != self._count_routed:
            raise ValueError("routing is not counted (count_routing)")
        counts, self._routed = self._routed, np.zeros_like(self._routed)
        return counts

    def decode_rows(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, tables: Sequence[np.ndarray],
                    sampled: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """One token of each of several sequences (tables: each one's blocks in logical order): the greedy token of
        every row, int32 [n], and the logits [len(sampled), vocab] of the rows listed in `sampled`."""
        logits = self.forward(tokens, positions, slots, all_logits=True, tables=tables)
        return np.argmax(logits[:, : self.spec.vocab_size], axis=1).astype(np.int32), logits[list(sampled)]

    # ---- KVFlash: the pager decides, the backend moves bytes (lucekv.kvflash.sequence.PoolBackend) ----

    def execute(self, moves: list[Move], host: HostStore) -> None:
        for m in moves:
            rows = slice(m.block * CHUNK_TOKENS, (m.block + 1) * CHUNK_TOKENS)
            for layer, (k, v) in enumerate(zip(self.pool.k, self.pool.v, strict=True)):
                if isinstance(m, PageOut):
                    if m.write_back:
                        host.store(m.chunk, layer, k[rows], v[rows])
                else:
                    k[rows], v[rows] = host.load(m.chunk, layer)
            if isinstance(m, PageIn):
                self.pool.cover(rows.stop)

    def chunk_keys(self, block: int) -> np.ndarray:
        rows = slice(block * CHUNK_TOKENS, (block + 1) * CHUNK_TOKENS)
        return np.stack([k[rows] for k in self.pool.k]).astype(np.float32)

    def last_queries(self, row: int = -1) -> np.ndarray:
        return np.stack([q[row] for q in self.ops.queries])

    def recent_queries(self) -> np.ndarray:
        return np.stack([q[-RECENT_QUERIES:] for q in self.ops.queries], axis=1)
