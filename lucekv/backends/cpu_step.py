"""The CPU backend's decode step: the model's weights in flat arenas, and threads that run the whole step in one
numba call each (lucekv.kernels.cpu.step); `Workers`, the backend's threads (decode steps, prefill products)."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterator

import numba
import numpy as np

from lucekv.kernels.cpu import step as k
from lucekv.kernels.cpu.matvec import TILES
from lucekv.kernels.cpu.quants import GROUP_ROWS, PackedMatrix, group_rows
from lucekv.model.arch import ModelSpec
from lucekv.model.decoder import Weights

ALIGN = 64  # bytes: each matrix starts on a cache line
ROPE_TABLE = 16384  # positions whose RoPE rows DecodeStep keeps (gemma3's two rows of 256: 32 MB at most)
KINDS = {"q4": k.KIND_Q4, "q8": k.KIND_Q8, "f32": k.KIND_F32}


class Arenas:
    """Every matrix of `weights` in one byte arena (codes) and one float32 arena (scales, biases: float32, or two
    float16 a float where group_rows gives them so), every vector in a third; the PackedMatrix objects are re-pointed
    at views of the arenas, so the weights are held once."""

    def __init__(self, weights: Weights):
        mats = [m for lw in weights.layers for m in _layer_matrices(lw)] + [weights.output, weights.token_embd]
        self.mat_id: dict[int, int] = {}
        for m in mats:
            self.mat_id.setdefault(id(m), len(self.mat_id))
        unique = list({id(m): m for m in mats}.values())
        self.table = np.zeros((len(unique), k.MAT_FIELDS), np.int64)
        with_bias = {id(m) for m in unique if m.kind != "f32" and m.has_bias}  # others store none
        # quantized matrices grouped by 16 rows, the form the step's products read (quants.group_rows)
        code_bytes = sum(_aligned(_padded_rows(m) * _codes(m)[0].nbytes) for m in unique)
        scale_floats = sum((1 + (id(m) in with_bias)) * _padded_rows(m) * m.scale.shape[1]
                           for m in unique if m.kind != "f32")  # at most: float16 ones take half (pages never touched)
        self.codes = np.empty(code_bytes, np.uint8)
        self.scales = np.empty(scale_floats, np.float32)
        at = sat = 0
        for i, m in enumerate(unique):
            codes, scale, bias = (np.ascontiguousarray(m.codes), None, None) if m.kind == "f32" else group_rows(m)
            self.codes[at:at + codes.nbytes] = codes.reshape(-1).view(np.uint8)
            nb = m.scale.shape[1] if m.kind != "f32" else 0
            halves = scale is not None and scale.dtype == np.uint16
            bias_at = sat + -(-scale.nbytes // 4) if id(m) in with_bias else -1
            self.table[i] = (KINDS[m.kind], m.rows, m.cols, at, sat, bias_at, m.codes.shape[1], nb, halves)
            m.codes = _read_only(self.codes[at:at + codes.nbytes].view(codes.dtype).reshape(codes.shape))
            if m.kind != "f32":
                for name, part in (("scale", scale), ("bias", bias))[:1 + (id(m) in with_bias)]:
                    floats = -(-part.nbytes // 4)
                    held = self.scales[sat:sat + floats].view(np.uint8)[:part.nbytes].view(part.dtype)
                    held[:] = part.reshape(-1)
                    m.__dict__[name] = _read_only(held.reshape(part.shape))
                    sat += floats
                m.grouped = True
            at += _aligned(codes.nbytes)
        # read-only as the matrices' views are: the step's products and the op-by-op ones share their compiled forms
        self.codes.flags.writeable = self.scales.flags.writeable = False
        self._vec_parts: list[np.ndarray] = []
        self._vec_at: dict[int, int] = {}
        self._vec_len = 0

    def matrix(self, m: PackedMatrix) -> int:
        return self.mat_id[id(m)]

    def vector(self, v: np.ndarray | None) -> int:
        """v's offset in the vector arena (-1 for None); call `vectors()` once every vector is added."""
        if v is None:
            return -1
        if id(v) not in self._vec_at:
            self._vec_at[id(v)] = self._vec_len
            self._vec_parts.append(np.asarray(v, np.float32).reshape(-1))
            self._vec_len += v.size
        return self._vec_at[id(v)]

    def vectors(self) -> np.ndarray:
        return np.concatenate(self._vec_parts).astype(np.float32)


class DecodeStep:
    """Tokens through the model, each on its own (a row): `step(tokens, positions, slots, attended, runs, n_logits)
    -> (logits [n_logits, vocab] of the last rows, post-RoPE queries [n_layer, n_rows, n_head, head_dim])`. Row r
    writes its K/V to the pool's slots[r] and attends over the pool slots attended[runs[r, 0]:runs[r, 1]] (its
    sequence's, in logical order): rows may be one token of each of several sequences, or tokens of one sequence
    (each sees those before it by the position rule). A row's numbers are the same in any batch of rows. Threads:
    numba's thread count (NUMBA_NUM_THREADS) at the call. capture_at [n_layer] (-1: none) / captured [n_capture,
    n_rows, n_embd]: layer outputs handed out (see decode_step)."""

    def __init__(self, spec: ModelSpec, weights: Weights, pool, workers: Workers):
        self.spec, self.pool, self.workers = spec, pool, workers
        a = Arenas(weights)
        self.arenas = a
        self.token_embd = a.matrix(weights.token_embd)
        self.embed_scale = np.float32(np.sqrt(spec.n_embd) if spec.arch.embed_scale else 1.0)  # as CpuOps.embed
        ropes = [spec.layer_rope(i) for i in range(spec.n_layer)]
        self.inv_freqs: list[np.ndarray] = []
        rope_row = [self._rope_row(r.inv_freq) for r in ropes]
        self.layers = np.array([
            [a.matrix(lw.qkv[0][0]), a.matrix(lw.qkv[1][0]), a.matrix(lw.qkv[2][0]), a.matrix(lw.wo),
             a.matrix(lw.gate_up[0]), a.matrix(lw.gate_up[1]), a.matrix(lw.w_down),
             a.vector(lw.attn_norm), a.vector(lw.ffn_norm), a.vector(lw.qkv[0][1]), a.vector(lw.qkv[1][1]),
             a.vector(lw.qkv[2][1]), a.vector(lw.q_norm), a.vector(lw.k_norm), a.vector(lw.post_attn_norm),
             a.vector(lw.post_ffn_norm), spec.window(i), rope_row[i]]
            for i, lw in enumerate(weights.layers)], np.int64)
        self.dims = np.zeros(k.DIM_FIELDS, np.int64)
        self.dims[[k.N_HEAD, k.N_KV_HEAD, k.HEAD_DIM, k.ROPE_DIM, k.NEOX, k.GELU, k.N_EMBD, k.OUTPUT,
                   k.OUTPUT_NORM, k.N_FF, k.TILES]] = (
            spec.n_head, spec.n_kv_head, spec.head_dim, spec.rope_dim, spec.arch.rope_style == "neox",
            spec.arch.activation != "silu", spec.n_embd, a.matrix(weights.output), a.vector(weights.output_norm),
            weights.layers[0].gate_up[0].rows, TILES)
        self.vecs = a.vectors()
        self.rope_table = np.empty((0, len(self.inv_freqs), 2, spec.rope_dim // 2), np.float32)  # see _rope_rows
        self.attn_scales = np.array([r.attn_scale for r in ropes], np.float32)
        self.eps = np.float32(spec.rms_eps)
        self.n_out = weights.output.rows
        self.width = max(spec.n_embd, spec.n_head * spec.head_dim, spec.n_kv_head * spec.head_dim,
                         *(lw.gate_up[0].rows for lw in weights.layers))
        self._sized = (0, 0, 0)  # (threads, rows, slots of a run) the scratch holds
        self._no_capture = np.full(spec.n_layer, -1, np.int64)
        self._none_captured, self._no_trace = np.zeros((0, 1, 1), np.float32), np.zeros((0, 1, 3), np.int64)
        kp, vp = pool.k_all, pool.v_all
        self._pool = (kp.view(np.uint16), vp.view(np.uint16)) if kp.dtype == np.float16 else (kp, vp)
        self.trace: np.ndarray | None = None  # int64 [threads, step_phases + 1, 3]: the next step's (decode_step)

    def _rope_row(self, inv_freq: np.ndarray) -> int:
        for i, f in enumerate(self.inv_freqs):
            if np.array_equal(f, inv_freq):
                return i
        self.inv_freqs.append(inv_freq)
        return len(self.inv_freqs) - 1

    def _rope_rows(self, positions: np.ndarray) -> np.ndarray:
        """float32 [n, RoPE rows, 2, rope_dim / 2]: cos and sin of each position's angles, as CpuOps.rope computes
        them (float64 angles). Positions below ROPE_TABLE take theirs from a table of every position so far (grown by
        doubling: one numpy call a step instead of seven, each slow on caches a step left cold)."""
        top = int(positions.max()) + 1
        if top > ROPE_TABLE:
            return self._rope_of(positions)
        if top > len(self.rope_table):
            self.rope_table = self._rope_of(np.arange(min(max(top, 2 * len(self.rope_table), 1024), ROPE_TABLE)))
        return self.rope_table[positions]

    def _rope_of(self, positions: np.ndarray) -> np.ndarray:
        ang = np.asarray(positions, np.float64)[:, None, None] * np.stack(self.inv_freqs)
        return np.ascontiguousarray(np.stack([np.cos(ang), np.sin(ang)], axis=2).astype(np.float32))

    def _scratch(self, n: int, rows: int, run: int) -> None:
        """Scratch for n threads, `rows` rows and runs of up to `run` slots (grown as they grow: np.empty maps pages as
        they are touched)."""
        spec = self.spec
        if n != self._sized[0] or rows > self._sized[1]:
            rows = max(rows, self._sized[1])
            self.shared = np.zeros((k.SHARED_ROWS, rows * self.width), np.float32)
            self.private = np.zeros((n, k.PRIVATE_ROWS, rows * self.width), np.float32)
            self.private_q = np.zeros((n, rows * self.width), np.int16)
            self._sized = (n, rows, 0)
        if run > self._sized[2]:
            run = max(run, 2 * self._sized[2])  # a run grows a token a step: doubled, not each step
            # (row, q head) pairs of an attention task at most
            heads = min(self._sized[1], k.ATTENTION_ROWS) * spec.n_head // spec.n_kv_head
            self.attn_scratch = np.empty((n, heads * (run + k.LANES + 1)), np.float32)
            self._sized = (n, rows, run)

    def __call__(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, attended: np.ndarray,
                 runs: np.ndarray, n_logits: int, capture_at: np.ndarray | None = None,
                 captured: np.ndarray | None = None, attended_pos: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
        """attended_pos: the positions each row sees at its run of `attended` ([n_rows, run]: a draft tree's block,
        whose rows share one run; None: the slot map's)."""
        n, n_rows = numba.get_num_threads(), len(tokens)
        runs = np.ascontiguousarray(runs, np.int64)
        self._scratch(n, n_rows, int((runs[:, 1] - runs[:, 0]).max()))
        a = self.arenas
        x = np.empty((n_rows, self.spec.n_embd), np.float32)
        k.embed_rows(a.codes, a.scales, a.table, self.token_embd, np.asarray(tokens, np.int64), self.embed_scale, x)
        positions = np.asarray(positions, np.int64)
        logits = np.empty((n_logits, self.n_out), np.float32)
        queries = np.empty((self.spec.n_layer, n_rows, self.spec.n_head, self.spec.head_dim), np.float32)
        attended = np.ascontiguousarray(attended, np.intp)
        seen, seen_at = (self.pool.slot_pos[attended], np.ascontiguousarray(runs[:, 0])) if attended_pos is None else (
            np.ascontiguousarray(attended_pos, np.int32).reshape(-1),
            np.arange(n_rows, dtype=np.int64) * attended_pos.shape[1])
        args = (a.codes, a.scales, a.table, self.vecs, self.layers, self.attn_scales, self.dims, self.eps,
                self._rope_rows(positions), *self._pool, attended, seen, runs, seen_at,
                positions, np.asarray(slots, np.int64), x, self.shared, self.private,
                self.private_q, self.attn_scratch, logits, queries,
                self._no_capture if capture_at is None else capture_at,
                self._none_captured if captured is None else captured,
                self._no_trace if self.trace is None else self.trace)
        work = np.zeros(k.work_size(n, self.spec.n_layer), np.int64)
        work[0] = n
        self.workers.run(n, lambda t: k.decode_step(t, work, *args))
        return logits, queries


class Workers:
    """n - 1 persistent threads beside the caller's; `run(n, job)` calls job(t) on thread t = 0..n-1 at once and
    returns when all are done (job(0) on the caller's thread). numba's kernels release the GIL. The threads hold
    nothing of a job once it is done, and end when this object is collected."""

    def __init__(self) -> None:
        self._crew = _Crew()
        weakref.finalize(self, self._crew.stop)

    def run(self, n: int, job: Callable[[int], None]) -> None:
        crew = self._crew
        if crew.pid != os.getpid():  # a forked child has none of its parent's threads
            crew = self._crew = _Crew()
            weakref.finalize(self, crew.stop)
        while len(crew.go) < n - 1:
            crew.add_thread()
        crew.job = job
        for t in range(1, n):
            crew.done[t - 1].clear()
            crew.go[t - 1].set()
        try:
            job(0)
        finally:
            for t in range(1, n):
                crew.done[t - 1].wait()
            crew.job = None
        if crew.errors:
            err, crew.errors = crew.errors[0], []
            raise err


class _Crew:
    """The threads of a Workers and what they share (not the Workers itself, so that it can be collected)."""

    def __init__(self) -> None:
        self.go: list[threading.Event] = []
        self.done: list[threading.Event] = []
        self.job: Callable[[int], None] | None = None
        self.errors: list[BaseException] = []
        self.stopping = False
        self.pid = os.getpid()

    def add_thread(self) -> None:
        t = len(self.go) + 1
        self.go.append(threading.Event())
        self.done.append(threading.Event())
        threading.Thread(target=self._loop, args=(t,), daemon=True, name=f"lucekv-cpu-{t}").start()

    def stop(self) -> None:
        self.stopping = True
        for go in self.go:
            go.set()

    def _loop(self, t: int) -> None:
        go, done = self.go[t - 1], self.done[t - 1]
        while True:
            go.wait()
            go.clear()
            if self.stopping:
                return
            try:
                self.job(t)
            except BaseException as e:  # handed to the caller of run
                self.errors.append(e)
            finally:
                done.set()


def _layer_matrices(lw) -> Iterator[PackedMatrix]:
    yield from (w for w, _ in lw.qkv)
    yield lw.wo
    yield from lw.gate_up
    yield lw.w_down


def _codes(m: PackedMatrix) -> np.ndarray:
    return np.ascontiguousarray(m.codes).view(np.uint8)


def _padded_rows(m: PackedMatrix) -> int:
    """m's rows in the arena: whole groups of GROUP_ROWS where quantized."""
    return m.rows if m.kind == "f32" else -(-m.rows // GROUP_ROWS) * GROUP_ROWS


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a
