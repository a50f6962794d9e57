"""CPU backend: quantized weights through numba kernels, KV in a slot pool of host arrays."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from lucekv.backends.ahead import RunAhead
from lucekv.backends.slots import SlotMap
from lucekv.kernels.cpu.attention import attend_batch, attend_rows
from lucekv.kernels.cpu.matvec import matmul, matvec_rows
from lucekv.kernels.cpu.moe import group_by_expert, route
from lucekv.kernels.cpu.quants import PackedMatrix, dequantize, dequantize_rows, pack_stacked, pack_tensor, split_rows
from lucekv.kvflash.host_store import HostStore
from lucekv.kvflash.pager import CHUNK_TOKENS, RECENT_QUERIES, Move, PageIn, PageOut
from lucekv.model.arch import ModelSpec
from lucekv.model.decoder import LayerWeights, MoeWeights, Weights, forward, load_weights, project_qkv
from lucekv.model.gguf import GGUFFile, TensorInfo

KV_DTYPES = {"f16": np.float16, "f32": np.float32}
GELU_C = np.float32(np.sqrt(2.0 / np.pi))


class KVPool(SlotMap):
    """K and V of every layer in `size` host slots."""

    def __init__(self, spec: ModelSpec, size: int, dtype: str):
        super().__init__(size)
        shape = (size, spec.n_kv_head, spec.head_dim)
        self.dtype = KV_DTYPES[dtype]
        # np.zeros maps untouched pages lazily, so a pool sized to the whole context costs what is used.
        self.k = [np.zeros(shape, self.dtype) for _ in range(spec.n_layer)]
        self.v = [np.zeros(shape, self.dtype) for _ in range(spec.n_layer)]


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

    def __init__(self, spec: ModelSpec, pool: KVPool):
        self.spec = spec
        self.pool = pool
        self._layer_rope = [spec.layer_rope(i) for i in range(spec.n_layer)]
        self._slots = np.zeros(0, np.intp)  # the slots the forward's tokens attend over, one run per sequence
        self._offsets: np.ndarray | None = None  # decode rows: token t reads run offsets[t] .. offsets[t + 1]
        # post-RoPE queries [n_tokens, n_head, head_dim] of each layer's latest forward, for relevance scorers (a decode
        # row's, or a prompt's last RECENT_QUERIES)
        self.queries = [np.zeros((1, spec.n_head, spec.head_dim), np.float32) for _ in range(spec.n_layer)]

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
        self._slots = np.concatenate(runs).astype(np.intp)
        self._offsets = np.cumsum([0] + [len(r) for r in runs]) if n_tokens == len(runs) else None

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
        return [self.linear(w, h) if b is None else self.linear(w, h) + b for w, b in p]

    def linear(self, w: PackedMatrix, x: np.ndarray, norm: np.ndarray | None = None,
               residual: np.ndarray | None = None) -> np.ndarray:
        if norm is not None:
            x = self.rmsnorm(x, norm)
        y = matvec_rows(w, x) if self._offsets is not None else matmul(w, x)
        return y if residual is None else residual + y

    def rmsnorm(self, x: np.ndarray, w: np.ndarray, groups: int = 1) -> np.ndarray:
        xs = x.reshape(len(x), groups, -1)
        ms = np.mean(xs * xs, axis=-1, keepdims=True, dtype=np.float32)
        return (xs / np.sqrt(ms + np.float32(self.spec.rms_eps)) * w).reshape(x.shape).astype(np.float32, copy=False)

    def _rope(self, x: np.ndarray, n_heads: int, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
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
        q = self._rope(q, spec.n_head, positions, rope.inv_freq)
        k = self._rope(k, spec.n_kv_head, positions, rope.inv_freq)
        kp, vp = pool.k[layer], pool.v[layer]
        kp[slots] = k.reshape(len(k), spec.n_kv_head, spec.head_dim)
        vp[slots] = v.reshape(len(v), spec.n_kv_head, spec.head_dim)
        qh = q.reshape(len(q), spec.n_head, spec.head_dim)
        self.queries[layer] = qh
        # numba's CPU target has no float16: the slots read are gathered and widened here (numpy uses F16C for it)
        k, v, sp = kp[self._slots].astype(np.float32), vp[self._slots].astype(np.float32), pool.slot_pos[self._slots]
        if self._offsets is not None:
            out = attend_rows(qh, k, v, sp, self._offsets, positions, window, rope.attn_scale)
        else:
            out = attend_batch(qh, k, v, sp, len(sp), positions, window, rope.attn_scale)
        return out.reshape(len(q), -1)

    def gated_linear(self, x: np.ndarray, g: tuple[PackedMatrix, PackedMatrix], norm: np.ndarray) -> np.ndarray:
        return self._gated(self.rmsnorm(x, norm), *g)

    def _gated(self, h: np.ndarray, gate: PackedMatrix, up: PackedMatrix) -> np.ndarray:
        return self._gated_act(self.linear(gate, h), self.linear(up, h))

    def moe_ffn(self, x: np.ndarray, m: MoeWeights, norm: np.ndarray) -> np.ndarray:
        """Tokens grouped by expert: each chosen expert's products run once, over all the tokens routed to it. Every
        token's k expert outputs are kept and summed in rank order, as a one-token step sums them."""
        spec, e = self.spec, m.experts
        h = self.rmsnorm(x, norm)
        k = spec.n_expert_used
        ids, weights = route(self.linear(e.router, h), k, spec.arch.norm_topk)
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


class CpuBackend(RunAhead):
    name = "cpu"
    prefill_chunk = 256  # tokens per prefill forward: bounds the attention score matrix

    def __init__(self, g: GGUFFile, spec: ModelSpec, kv_dtype: str = "f16", pool_size: int | None = None):
        # numba's threads already use every core. BLAS threads spinning beside them starve both (measured
        # on 2 cores: prefill 16 tok/s with 2 BLAS threads, 250 with 1), so BLAS runs single-threaded.
        threadpool_limits(limits=1, user_api="blas")
        super().__init__()
        self.spec = spec
        self.pool = KVPool(spec, pool_size or spec.n_ctx, kv_dtype)
        self.ops = CpuOps(spec, self.pool)
        self.weights: Weights = load_weights(g, spec, self.ops)

    def forward(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, all_logits: bool = False,
                tables: Sequence[np.ndarray] | None = None) -> np.ndarray:
        """Logits [1 or n, vocab] float32 for `tokens` at `positions`, their K/V written to `slots`. tables: each
        sequence's blocks in logical order, one for all the tokens or one per token (decode rows: the logits of
        every row); None: a sequence alone in the pool (see CpuOps.begin_step)."""
        self.pool.assign(slots, positions)
        self.ops.begin_step(len(tokens), tables)
        rows = tables is not None and len(tables) == len(tokens)
        return forward(self.spec, self.weights, self.ops, np.asarray(tokens), positions, slots, all_logits or rows)

    def forward_argmax(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                       tables: Sequence[np.ndarray] | None = None) -> np.ndarray:
        """The greedy token after each of `tokens` (int32 [n]) of one sequence (tables: see `forward`): a speculative
        round's verify forward."""
        logits = self.forward(tokens, positions, slots, all_logits=True, tables=tables)
        return np.argmax(logits[:, : self.spec.vocab_size], axis=1).astype(np.int32)

    def decode_rows(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, tables: Sequence[np.ndarray],
                    sampled: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """One token of each of several sequences (tables: each one's blocks in logical order): the greedy token of
        every row, int32 [n], and the logits [len(sampled), vocab] of the rows listed in `sampled`."""
        logits = self.forward(tokens, positions, slots, tables=tables)
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
