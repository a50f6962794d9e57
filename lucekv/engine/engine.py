"""The engine: a loaded model, its tokenizer and backend, and the generation loop."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from lucekv.engine.output import OutputStream
from lucekv.engine.sampling import Sampler, SamplingParams, log_softmax
from lucekv.engine.sessions import Session, SessionInfo, SessionTable
from lucekv.engine.types import ChatMessage, GenerationDelta, TokenLogprob, Usage
from lucekv.errors import ConfigError, ContextOverflowError, InvalidRequestError, LucekvError, ResourceLimitError
from lucekv.kvflash.blocks import BlockPool
from lucekv.kvflash.draft import DraftReader
from lucekv.kvflash.host_store import MemoryHostStore
from lucekv.kvflash.pager import CHUNK_TOKENS, RECENT_QUERIES, PageIn, PageOut, min_pool_tokens
from lucekv.kvflash.sequence import PagedSequence
from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import open_gguf
from lucekv.model.tokenizer import Tokenizer
from lucekv.snapshot.blob import (
    FLAG_PARTIAL,
    KVLayout,
    Snapshot,
    SnapshotError,
    SnapshotHeader,
    chunk_rows,
    read_snapshot,
    write_snapshot,
)
from lucekv.snapshot.store import SnapshotStore, check_session_id
from lucekv.spec.config import SpecConfig
from lucekv.spec.draft_model import DraftModelDrafter, check_same_vocabulary
from lucekv.spec.drafter import Drafter
from lucekv.spec.gate import Gate, StepClock
from lucekv.spec.speculator import Block, Speculator
from lucekv.spec.suffix import RecentOutputs, SuffixDrafter

Prompt = str | Sequence[int] | Sequence[ChatMessage]
AUTO_POOL_SHARE = 0.9  # of the GPU memory free after the weights, for --kv-pool auto's pool
PROMPT_TAIL = RECENT_QUERIES  # a pooled prompt's last tokens, recomputed after the chunks they rank are recalled
RECALL_ROUNDS = 2  # rank, recall and recompute the tail at most this often per prompt


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    arch: str
    fingerprint: str
    n_ctx: int
    vocab_size: int
    backend: str
    n_layer: int
    n_embd: int
    kv_pool_tokens: int  # 0 = the whole context
    kv_policy: str  # "" without paging
    spec_modes: tuple[str, ...]  # speculation modes a request may ask for
    spec_default: str  # the mode of requests that do not choose


class Engine:
    """Not thread-safe: one generation at a time (the server serializes requests)."""

    def __init__(self, path: Path, backend: str = "auto", kv_dtype: str = "f16", n_ctx: int | None = None,
                 kv_pool: int | str | None = None, kv_policy: str = "quest", kv_tau: int = 64,
                 kv_drafter: str | Path | None = None, max_sessions: int = 64, session_host_bytes: int = 16 << 30,
                 snapshot_store: SnapshotStore | None = None, speculation: SpecConfig | None = None):
        """kv_pool: KV slots on the device in tokens (a multiple of 64); None holds the whole context; "auto" sizes
        it from free GPU memory on the CUDA backend (`auto_pool_tokens`) and is None on the CPU backend, whose
        device memory is host RAM.
        max_sessions / session_host_bytes: limits on sessions held in memory and on the host RAM their K/V
        takes; past them idle sessions spill to `snapshot_store` (least recently used first), or, without a
        store, new sessions are refused.
        kv_drafter: a small model with the same tokenizer (registry name or GGUF path) that reads the context for
        kv_policy "draft".
        speculation: the default speculation mode and the drafters (default: off)."""
        self.spec_config = (speculation or SpecConfig()).check()
        self.path = Path(path)
        g = open_gguf(path)
        self.spec = ModelSpec.from_gguf(g)
        self.tokenizer = Tokenizer.from_metadata(g.metadata)
        self.n_ctx = min(n_ctx or self.spec.n_ctx, self.spec.n_ctx)
        self.backend, kv_pool = _make_backend(backend, g, self.spec, kv_dtype, self.n_ctx, kv_pool)
        self._kv_pool, self._kv_policy, self._kv_tau = kv_pool, kv_policy, kv_tau
        pool = self.backend.pool
        self.blocks = BlockPool(pool.size // CHUNK_TOKENS, CHUNK_TOKENS, pool.slot_pos)  # the sessions' pagers borrow
        self._drafter = self._load_drafter(kv_drafter, kv_dtype) if kv_pool and kv_policy == "draft" else None
        self.layout = KVLayout(g.fingerprint, self.spec.arch.name, self.spec.n_layer, self.spec.n_kv_head,
                               self.spec.head_dim, kv_dtype, CHUNK_TOKENS)
        if max_sessions < 1 or session_host_bytes < 0:
            raise ConfigError(f"session limits must be positive (got {max_sessions} sessions, "
                              f"{session_host_bytes} bytes)")
        self.max_sessions, self.session_host_bytes, self.store = max_sessions, session_host_bytes, snapshot_store
        self.sessions = SessionTable()
        self._anonymous = self._live = self._new_session("")
        self._in_flight: deque[int | None] = deque()  # input tokens of enqueued greedy steps (None: chained)
        self._last_greedy = 0  # the token of the latest settled greedy step
        self._step_clock = StepClock()  # the gate's measured step times, for the engine's life
        # by speculation mode; "auto" gates the suffix drafter
        self.drafters: dict[str, Drafter] = {
            "suffix": SuffixDrafter(RecentOutputs() if self.spec_config.shared_outputs else None)}
        if self.spec_config.draft_model is not None:
            self.drafters["draft"] = self._draft_model(g, kv_dtype)
        self._sequence = _Sequence(self)  # the live sequence as a speculative round's target
        for key in snapshot_store.keys() if snapshot_store is not None else ():
            self.sessions.put(Session(key, stored_bytes=snapshot_store.size(key)))
        self.info = EngineInfo(self.spec.name, self.spec.arch.name, g.fingerprint, self.n_ctx,
                               self.spec.vocab_size, self.backend.name, self.spec.n_layer, self.spec.n_embd,
                               kv_pool or 0, kv_policy if kv_pool else "", self.spec_config.available(),
                               self.spec_config.mode)

    # ---- requests -------------------------------------------------------------------------------

    def prepare(self, prompt: Prompt, params: SamplingParams, pin_prefix: int | None = None,
                speculation: str | None = None) -> list[int]:
        """Validate and tokenize; raises InvalidRequestError before any compute."""
        params.validate(self.spec.vocab_size)
        self.spec_config.resolve(speculation)
        ids = self._tokenize_prompt(prompt)
        if pin_prefix is not None and not 0 <= pin_prefix <= len(ids):
            raise InvalidRequestError("pin_prefix_tokens", f"must be in [0, {len(ids)}], the prompt's tokens "
                                      f"(got {pin_prefix})")
        if len(ids) + params.max_tokens > self.n_ctx:
            raise ContextOverflowError(
                "max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context of {self.n_ctx} tokens")
        return ids

    def _tokenize_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "is empty")
            return self.tokenizer.encode(prompt)
        items = list(prompt)
        if not items:
            raise InvalidRequestError("prompt", "is empty")
        if all(isinstance(m, Mapping) for m in items):
            text = self.tokenizer.apply_chat_template(items)
            return self.tokenizer.encode(text, add_special=False)
        if not all(isinstance(t, int | np.integer) for t in items):
            raise InvalidRequestError("prompt", "must be text, a list of token ids, or a list of chat messages")
        bad = [int(t) for t in items if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise InvalidRequestError("token_ids", f"ids {bad[:5]} are outside [0, {self.spec.vocab_size})")
        return [int(t) for t in items]

    def generate(self, prompt: Prompt, params: SamplingParams, session_id: str = "",
                 pin_prefix: int | None = None, speculation: str | None = None) -> Iterator[GenerationDelta]:
        """Stream the completion of `prompt`. With a session id, the session (created if new) keeps the K/V for
        the next turn: a prompt that starts with its history only computes what is new. `pin_prefix`: with a
        bounded pool, the prompt's first tokens that are never paged out (None keeps the session's pins).
        `speculation`: a mode of `SpecConfig` (None: the engine's default); the output is the same either way
        (greedy: token for token; sampling: in distribution)."""
        ids = self.prepare(prompt, params, pin_prefix, speculation)
        if session_id:
            check_session_id(session_id)
        return self._run(ids, params, session_id, pin_prefix, self.spec_config.resolve(speculation))

    def prefill(self, prompt: Prompt, session_id: str = "") -> int:
        """Compute the K/V of `prompt` into the session (created if new), reusing the prefix it holds, without
        generating: a later generate whose prompt extends it computes only the rest (and, with a bounded pool, is
        the one that ranks and recalls chunks). Returns the tokens computed."""
        ids = self._tokenize_prompt(prompt)
        if len(ids) > self.n_ctx:
            raise ContextOverflowError("prompt", f"{len(ids)} tokens exceed the context of {self.n_ctx}")
        if session_id:
            check_session_id(session_id)
        self._activate(session_id)
        try:
            reused = self._reuse(ids, len(ids))
            if reused < len(ids):
                self._forward(ids[reused:], reused)
        finally:
            self._enforce_host_limit()
        return len(ids) - reused

    def score(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [len(ids), vocab] for every position of a fresh sequence (used by oracle checks)."""
        self._activate("")
        self._truncate(0)
        return np.concatenate(self._forward(list(ids), 0, all_logits=True))

    # ---- the loop -------------------------------------------------------------------------------

    def _forward(self, ids: list[int], start: int, all_logits: bool = False, decoding: bool = False,
                 greedy: bool = False) -> list[np.ndarray]:
        """Logits of `ids` at positions from `start` (each piece's last, or all), or with `greedy` the argmax after
        each token, taken by the backend. `decoding`: output tokens (a plain step or a verify block)."""
        out = []
        done = 0
        while done < len(ids):
            n = self._batch(start + done, len(ids) - done, decoding)
            chunk = np.asarray(ids[done : done + n], np.int32)
            pos = np.arange(start + done, start + done + n, dtype=np.int32)
            done += n
            slots = self._slots(int(pos[0]), len(chunk))
            if greedy:
                out.append(self.backend.forward_argmax(chunk, pos, slots))
            else:
                out.append(self.backend.forward(chunk, pos, slots, all_logits))
            self._live.tokens.extend(int(t) for t in chunk)
            if self.paged is not None:
                self.paged.after_forward(decoded=len(chunk) if decoding else 0)
        return out

    def _slots(self, start: int, n: int) -> np.ndarray:
        """Pool slots for positions start .. start + n - 1: the positions themselves when the pool holds the whole
        context, else the pager's (which may move chunks first)."""
        if self.paged is None:
            return np.arange(start, start + n, dtype=np.int32)
        return self.paged.alloc(start, n)

    def _batch(self, start: int, n: int, decoding: bool = False) -> int:
        """Tokens of the next forward from position `start`, at most n: the backend's batch, and with a bounded pool
        no more than fit it beside the protected chunks (whole chunks, so the pool evicts as the prompt goes).
        A verify block (`decoding`) with a bounded pool stops at a chunk boundary: the next chunk takes a block (and
        a chunk is evicted) only when a query has reached it, as in plain decoding."""
        n = min(n, self.backend.prefill_chunk)
        if self.paged is not None and decoding:
            return min(n, CHUNK_TOKENS - start % CHUNK_TOKENS)
        if self.paged is None or start % CHUNK_TOKENS + n <= CHUNK_TOKENS:
            return n  # within one chunk: the allocation checks the fit itself
        pager = self.paged.pager
        end = start + n
        while not pager.span_fits(start, end):
            end = (end - 1) // pager.chunk * pager.chunk  # down to the previous chunk boundary
            if end <= start:
                return min(n, pager.chunk - start % pager.chunk)
        return end - start

    def _truncate(self, n: int) -> None:
        if self.paged is None:
            self.backend.pool.truncate(n)
        else:
            self.paged.truncate(n)
        del self._live.tokens[n:]

    def _reuse(self, ids: list[int], limit: int) -> int:
        """Cut the live sequence to its longest common prefix with `ids` (at most `limit` tokens); its length."""
        reused = 0
        held = self._live.tokens
        limit = min(limit, len(held))
        while reused < limit and held[reused] == ids[reused]:
            reused += 1
        self._truncate(reused)
        return reused

    def _prefill(self, ids: list[int]) -> tuple[np.ndarray, int]:
        """Last-position logits of `ids`, reusing the K/V of the longest prefix the pool already holds.

        At least the last token is recomputed: its logits are what the first sample needs."""
        reused = self._reuse(ids, len(ids) - 1)
        if self.paged is None:
            return self._forward(ids[reused:], reused)[-1][-1], reused
        # A prompt longer than the pool was computed beside the chunks resident as it went (the most recent): its
        # tail, the question, never saw what it asks about. Its own queries rank the chunks, the best come back, and
        # the tail is computed again, so that its K/V and the first sample see them (twice: the second ranking
        # reads the queries of a tail that has seen the first recall).
        start = len(ids) - min(len(ids) - reused, PROMPT_TAIL)
        if start > reused:
            self._forward(ids[reused:start], reused)
        logits = self._forward(ids[start:], start)[-1][-1]
        for _ in range(RECALL_ROUNDS):
            if not self.paged.recall_for_prompt(len(ids) - start):
                break
            logits = self._forward(ids[start:], start)[-1][-1]
            del self._live.tokens[len(ids):]
        return logits, reused

    def _run(self, ids: list[int], params: SamplingParams, session_id: str, pin_prefix: int | None,
             speculation: str) -> Iterator[GenerationDelta]:
        t0 = time.perf_counter()
        session = self._activate(session_id)
        if pin_prefix is not None and session.paged is not None:
            session.paged.pin_prefix(pin_prefix)
        session.last_used_unix = time.time()
        session.sampler = asdict(params)
        session.in_store = False
        try:
            yield from self._generate(ids, params, t0, speculation)
        finally:
            self._drain()  # a cancelled stream may leave a step in flight
            self._forget_drafts()
            session.last_used_unix = time.time()
            self._enforce_host_limit()

    def _generate(self, ids: list[int], params: SamplingParams, t0: float, speculation: str
                  ) -> Iterator[GenerationDelta]:
        logits, cached = self._prefill(ids)
        sampler = Sampler(params, ids, self.spec.vocab_size)
        out = OutputStream(self.tokenizer, params, ids[-1], self.tokenizer.eog_ids)

        def host(rows: np.ndarray) -> _BlockSampling:  # the next block's tokens, sampled on the host
            return _BlockSampling(sampler, out, rows)

        block = Block([host(logits[None]).sample(0)], logits[None])
        spec = self._speculator(speculation, ids, block.tokens[0], params)
        device_greedy = sampler.plain_greedy and not params.logprobs  # the sample is the argmax: the device's
        while True:
            logprobs = None
            if params.logprobs:
                logprobs = [self._logprob(row, t, params.top_logprobs)
                            for row, t in zip(block.logits, block.tokens, strict=True)]
            delta = out.emit(block.tokens, logprobs)
            if out.finish:
                self._drain()  # before the last delta: a caller may never resume this generator
                self._truncate(min(len(self._live.tokens), len(ids) + out.n))  # drafts past the finish
                delta.usage = self._usage(ids, cached, out, t0, spec)
                yield delta
                return
            yield delta
            tok, pos = block.tokens[-1], len(ids) + out.n - 1
            greedy_now = device_greedy and out.n >= params.min_tokens
            if spec is not None and spec.speculating and not self._in_flight:
                block = spec.round(self._sequence, tok, pos, params.max_tokens - out.n, out.n,
                                   None if greedy_now else host)
                continue
            if greedy_now:
                more = out.n + 1 < params.max_tokens and (spec is None or not spec.speculating)
                block = Block([self._decode_greedy(tok, pos, more)])
            else:
                logits = self._forward([tok], pos, decoding=True)[0][-1]
                block = Block([host(logits[None]).sample(0)], logits[None])
            if spec is not None:
                spec.plain(block.tokens[0], pos + 1, out.n)

    def _speculator(self, mode: str, ids: list[int], first: int, params: SamplingParams) -> Speculator | None:
        """The turn's speculation (None: off), its drafter started on the prompt and the first token."""
        if mode == "off":
            return None
        gate = Gate(self._step_clock) if mode == "auto" else None
        drafter = self.drafters["suffix" if mode == "auto" else mode]
        spec = Speculator(mode, drafter, gate, self.spec_config.max_draft)
        spec.begin(ids, first, params)
        return spec

    def _usage(self, ids: list[int], cached: int, out: OutputStream, t0: float, spec: Speculator | None) -> Usage:
        elapsed = time.perf_counter() - out.t_first
        usage = Usage(len(ids), cached, out.n, out.t_first - t0, (out.n - 1) / elapsed if elapsed > 0 else 0.0)
        if self.paged is not None:
            kv = self.paged.usage()
            usage.kv_resident_chunks, usage.kv_paged_chunks = kv.resident_chunks, kv.paged_chunks
            usage.kv_bytes_moved = kv.bytes_moved
        if spec is not None:
            usage.speculation = spec.end()
        return usage

    def _draft_model(self, target, kv_dtype: str) -> DraftModelDrafter:
        """The draft model of SpecConfig on a backend of this engine's kind, its pool the whole context."""
        path = self.spec_config.draft_model
        g = open_gguf(path)
        check_same_vocabulary(target.metadata, g.metadata, str(path))
        spec = ModelSpec.from_gguf(g)
        if spec.n_ctx < self.n_ctx:
            raise ConfigError(f"draft model {path}: its context of {spec.n_ctx} tokens is shorter than the target's "
                              f"{self.n_ctx}")
        backend, _ = _make_backend(self.backend.name, g, spec, kv_dtype, self.n_ctx, None)
        return DraftModelDrafter(backend, self.spec.vocab_size)

    def _forget_drafts(self) -> None:
        """Free the slots of rejected drafts past the sequence's end (they are out of view already): a pager's
        head and a snapshot's residency then match the sequence again."""
        n = len(self._live.tokens)
        if self.paged is not None and self.paged.pager.n_tokens > n:
            self.paged.truncate(n)
        elif self.paged is None and self.backend.pool.slot_pos.max(initial=-1) >= n:
            self.backend.pool.truncate(n)

    def _decode_greedy(self, tok: int, pos: int, more: bool) -> int:
        """The greedy token after `tok` at `pos`, argmax taken by the backend. Run-ahead: with `more` (a token after
        the next is wanted) and nothing for the pager to do, the step after this one is enqueued before this one's
        token is read, its input the device's argmax: the device runs while the host handles the token."""
        if not self._in_flight:  # else the previous call enqueued this step
            self._enqueue_greedy(tok, pos)
        if more and (self.paged is None or self.paged.quiet_step(pos)):
            self._enqueue_greedy(None, pos + 1)
        return self._settle_greedy()

    def _enqueue_greedy(self, tok: int | None, pos: int) -> None:
        self.backend.decode_ahead(pos, int(self._slots(pos, 1)[0]), tok)
        self._in_flight.append(tok)

    def _settle_greedy(self) -> int:
        """Wait for the oldest enqueued greedy step: its token joins the sequence, the pager counts it."""
        tok = self._in_flight.popleft()  # first: a backend error leaves nothing for the drain to wait on again
        out = self.backend.next_token()
        self._live.tokens.append(self._last_greedy if tok is None else tok)
        if self.paged is not None:
            self.paged.after_forward(decoded=1)
        self._last_greedy = out
        return out

    def _drain(self) -> None:
        """Settle every enqueued step (its K/V is written: the sequence keeps it)."""
        while self._in_flight:
            self._settle_greedy()

    def _logprob(self, logits: np.ndarray, tok: int, top: int) -> TokenLogprob:
        lp = log_softmax(logits)
        best = np.argsort(-lp)[:top] if top else []
        return TokenLogprob(tok, float(lp[tok]), [(int(t), float(lp[t])) for t in best])


    # ---- sessions (DESIGN §5): one is live in the pool, the others parked on the host or stored ---------

    @property
    def paged(self) -> PagedSequence | None:
        """The live sequence's pager; None when the pool holds the whole context."""
        return self._live.paged

    def session_info(self, session_id: str) -> SessionInfo:
        return self.sessions.info(self.sessions.require(session_id))

    def snapshot(self, session_id: str, upto_tokens: int | None = None) -> tuple[SnapshotHeader, list[np.ndarray]]:
        """The session's header and chunk K/V (copies), cut to a chunk boundary below `upto_tokens` if that is
        shorter than the session. Runs on the engine thread; the caller serializes (write_snapshot) off it."""
        s = self.sessions.require(session_id)
        if s.stored_bytes:
            s = self._load_stored(s)
        n = len(s.tokens)
        if upto_tokens is not None and upto_tokens < n:
            n = upto_tokens // CHUNK_TOKENS * CHUNK_TOKENS
        host = self._host_copy(s, _n_chunks(n))
        chunks = [host.chunk(c)[:, :, : chunk_rows(n, CHUNK_TOKENS, c)].copy() for c in range(_n_chunks(n))]
        partial = n < len(s.tokens)
        # the residency only fits the whole session (a partial one starts afresh with the policy)
        pager = s.paged.state() if s.paged is not None and not partial else None
        header = SnapshotHeader(self.layout, tuple(s.tokens[:n]), s.id, s.sampler, FLAG_PARTIAL if partial else 0,
                                time.time(), pager)
        return header, chunks

    def restore(self, snap: Snapshot, session_id: str = "") -> SessionInfo:
        """Install a validated snapshot as a parked session (replacing an idle one of the same id)."""
        session_id = check_session_id(session_id or snap.header.session_id)
        self.sessions.check_idle(session_id, "restore over")
        s = self._session_from(session_id, snap.header, snap.chunks)
        old = self.sessions.get(session_id)
        added = s.host_bytes - (old.host_bytes if old is not None else 0)
        if self.store is None and self.sessions.host_bytes() + added > self.session_host_bytes:
            raise ResourceLimitError(
                f"restoring {session_id!r} needs {s.host_bytes} bytes of host memory for its K/V; sessions "
                f"would then hold more than the limit of {self.session_host_bytes}: delete sessions or start "
                "the server with a snapshot store")
        if old is None:
            self._make_room()
        else:
            self._forget(old)
        self.sessions.put(s)
        self._enforce_host_limit()
        return self.sessions.info(s)

    def delete_session(self, session_id: str) -> None:
        self.sessions.check_idle(session_id, "delete")
        self._forget(self.sessions.require(session_id))

    def save_sessions(self) -> int:
        """Write every session held in memory to the snapshot store (at shutdown); how many were written. One that
        cannot be written does not keep the others from it: the first such error is raised after them."""
        if self.store is None:
            return 0
        saved, failure = 0, None
        for s in self.sessions.in_memory():
            try:
                self._spill(s)
                saved += 1
            except LucekvError as e:
                failure = failure or e
        if failure:
            raise failure
        return saved

    def save_session(self, session_id: str) -> None:
        """Write the session to the snapshot store and keep it in memory (replicas: after every turn)."""
        s = self.sessions.require(session_id)
        if not s.in_store and not s.stored_bytes:
            header, chunks = self.snapshot(session_id)
            self.store.put(session_id, write_snapshot(header, chunks.__getitem__))
            s.in_store = True

    def reload_from_store(self, session_id: str) -> None:
        """Another process changed the session in the shared store: drop what this one holds of it, so that its
        next use loads the store's blob (or starts afresh if the store has none). On the engine thread, by the
        holder of the session's lease."""
        s = self.sessions.get(session_id)
        if s is not None:
            self._drop_local(s)
        if session_id in self.store:
            self.sessions.put(Session(session_id, stored_bytes=self.store.size(session_id)))

    def _new_session(self, session_id: str) -> Session:
        s = Session(session_id)
        if self._kv_pool is not None:
            s.paged = PagedSequence(
                self.backend, self.blocks, self._kv_pool, n_layer=self.spec.n_layer, n_kv_head=self.spec.n_kv_head,
                head_dim=self.spec.head_dim, dtype=self.backend.pool.dtype, policy=self._kv_policy,
                tau=self._kv_tau, window=self.spec.sliding_window, drafter=self._drafter, history=lambda: s.tokens)
        return s

    def _load_drafter(self, model: str | Path | None, kv_dtype: str) -> DraftReader:
        """The draft policy's reader: the drafter on this engine's backend, holding the whole context."""
        from lucekv.model.registry import resolve_model

        if not model:
            raise ConfigError("kv policy draft needs a drafter model (--kv-drafter)")
        drafter = Engine(resolve_model(str(model)), backend=self.backend.name, kv_dtype=kv_dtype, n_ctx=self.n_ctx)
        if drafter.tokenizer.pieces != self.tokenizer.pieces:
            raise ConfigError(f"the drafter {drafter.spec.name!r} does not share {self.spec.name!r}'s tokenizer")
        if drafter.n_ctx < self.n_ctx:
            raise ConfigError(f"the drafter's context ({drafter.n_ctx}) is shorter than the model's ({self.n_ctx})")
        return DraftReader(drafter)

    def _new_host_store(self) -> MemoryHostStore:
        return MemoryHostStore(self.spec.n_layer, CHUNK_TOKENS, self.spec.n_kv_head, self.spec.head_dim,
                               self.backend.pool.dtype)

    def _activate(self, session_id: str) -> Session:
        """Make the session live (its K/V in the pool): created if new, loaded if stored, the live one parked."""
        if session_id == self._live.id:
            return self._live
        target = self.sessions.get(session_id) if session_id else self._anonymous
        if target is None:
            self._make_room()
            target = self._new_session(session_id)
            self.sessions.put(target)
        elif target.stored_bytes:
            target = self._load_stored(target)
        self._park_live()
        if target.paged is not None:
            target.paged.resume()
        elif target.parked is not None:  # whole-context pool: chunk c goes back to block c (slot = position)
            pos = np.arange(len(target.tokens), dtype=np.int32)
            if len(pos):
                self.backend.pool.assign(pos, pos)
            self.backend.execute([PageIn(c, c) for c in range(_n_chunks(len(pos)))], target.parked)
            target.parked = None
        self._set_live(target)
        return target

    def _park_live(self) -> None:
        """Free the pool: the live session's K/V goes to the host (the anonymous sequence's is dropped)."""
        s = self._live
        if not s.id:
            self._truncate(0)
        elif s.paged is not None:
            s.paged.park()
        else:
            s.parked = self._host_copy(s, _n_chunks(len(s.tokens)))
            self.backend.pool.truncate(0)
        self._set_live(self._anonymous)

    def _set_live(self, s: Session) -> None:
        self._live = s
        self.sessions.live_id = s.id

    def _host_copy(self, s: Session, n_chunks: int) -> MemoryHostStore:
        """A host store holding the session's first `n_chunks` chunks, current (copied out of the pool if live)."""
        if s.paged is not None:
            if s is self._live:
                s.paged.sync_to_host()
            return s.paged.host
        if s is not self._live:
            return s.parked
        host = self._new_host_store()
        self.backend.execute([PageOut(c, c) for c in range(n_chunks)], host)
        return host

    def _session_from(self, session_id: str, header: SnapshotHeader, chunks: list[np.ndarray]) -> Session:
        s = self._new_session(session_id)
        s.tokens, s.sampler = list(header.token_ids), dict(header.sampler)
        if s.paged is not None:
            try:
                s.paged.restore(len(s.tokens), chunks, header.pager)
            except (KeyError, TypeError, ValueError, OverflowError) as e:
                raise SnapshotError(f"the header's pager state is malformed: {e}") from None
        else:
            s.parked = self._new_host_store()
            for c, kv in enumerate(chunks):
                s.parked.put_chunk(c, kv)
        return s

    def _load_stored(self, s: Session) -> Session:
        """A stored session back in memory, parked (replacing its table entry)."""
        snap = read_snapshot(self.store.open(s.id), self.layout, max_tokens=self.n_ctx,
                             vocab_size=self.spec.vocab_size)
        self._make_room()
        loaded = self._session_from(s.id, snap.header, snap.chunks)
        loaded.created_unix, loaded.in_store = s.created_unix, True
        self.sessions.put(loaded)
        return loaded

    def _spill(self, s: Session) -> None:
        """Write the session to the snapshot store and free its memory."""
        if s.in_store:
            nbytes = self.store.size(s.id)
        else:
            header, chunks = self.snapshot(s.id)
            nbytes = self.store.put(s.id, write_snapshot(header, chunks.__getitem__))
        if s is self._live:
            self._park_live()
        if s.paged is not None:
            s.paged.truncate(0)
        self.sessions.mark_stored(s, nbytes)

    def _forget(self, s: Session) -> None:
        """Drop a session: its K/V in the pool, on the host and in the store."""
        self._drop_local(s)
        if self.store is not None and s.id in self.store:
            self.store.delete(s.id)

    def _drop_local(self, s: Session) -> None:
        """Free the session's K/V in the pool and on the host, and its table entry."""
        if s is self._live:
            self._truncate(0)
            self._set_live(self._anonymous)
        elif s.paged is not None:
            s.paged.truncate(0)
        self.sessions.remove(s.id)

    def _make_room(self) -> None:
        """Before a session enters memory: spill the least recently used idle one if the count is at its limit."""
        while len(self.sessions.in_memory()) >= self.max_sessions:
            idle = [s for s in self.sessions.idle_by_age() if s is not self._live]
            if self.store is None or not idle:
                raise ResourceLimitError(
                    f"{self.max_sessions} sessions are held in memory, the limit: delete one"
                    + ("" if self.store else " or start the server with a snapshot store to spill idle ones"))
            self._spill(idle[0])

    def _enforce_host_limit(self) -> None:
        """Spill idle sessions, least recently used first, while their host memory exceeds the limit."""
        if self.store is None:
            return
        for s in self.sessions.idle_by_age():
            if self.sessions.host_bytes() <= self.session_host_bytes:
                return
            if s is not self._live:
                self._spill(s)


class _BlockSampling:
    """The request's sampler over a block's logits (lucekv.spec.verify.TargetSampler): row i gives the block's i-th
    token. Tokens are observed as they are drawn or kept (penalties of later rows see them; device-greedy tokens
    are not: plain greedy reads no penalties)."""

    def __init__(self, sampler: Sampler, out: OutputStream, rows: np.ndarray):
        self._sampler, self._out, self._rows = sampler, out, rows

    def sample(self, i: int) -> int:
        return self.keep(self._sampler.sample(self._rows[i], self._out.banned(i)))

    def probs(self, i: int) -> np.ndarray:
        return self._sampler.distribution(self._rows[i], self._out.banned(i))

    def draw(self, probs: np.ndarray) -> int:
        return self.keep(self._sampler.draw(probs))

    def uniform(self) -> float:
        return float(self._sampler.rng.random())

    def keep(self, token: int) -> int:
        self._sampler.observe(token)
        return token


class _Sequence:
    """The live sequence as a speculative round's target (lucekv.spec.speculator.Target)."""

    def __init__(self, engine: Engine):
        self._engine = engine

    def verify_greedy(self, tokens: list[int], start: int) -> np.ndarray:
        return np.concatenate(self._engine._forward(tokens, start, decoding=True, greedy=True))

    def verify_logits(self, tokens: list[int], start: int) -> np.ndarray:
        return np.concatenate(self._engine._forward(tokens, start, all_logits=True, decoding=True))

    def keep(self, n_tokens: int) -> None:
        del self._engine._live.tokens[n_tokens:]


def _make_backend(name: str, g, spec: ModelSpec, kv_dtype: str, n_ctx: int, kv_pool: int | str | None):
    """The backend, and its KV pool in tokens (None: the whole context) with "auto" resolved."""
    from lucekv.backends.cpu import KV_DTYPES, CpuBackend

    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv dtype {kv_dtype!r} is not supported (choose {', '.join(KV_DTYPES)})")
    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"unknown backend {name!r} (choose auto, cpu or cuda)")
    if name != "cpu":
        from lucekv.kernels.cuda import SIMULATOR, available

        if available() and (name == "cuda" or not SIMULATOR):  # "auto" never picks the slow simulator
            from lucekv.backends.cuda import CudaBackend

            if kv_pool == "auto":
                kv_pool = _auto_gpu_pool(g, spec, np.dtype(KV_DTYPES[kv_dtype]), n_ctx)
            return CudaBackend(g, spec, kv_dtype, kv_pool or _whole_chunks(n_ctx)), kv_pool
        if name == "cuda":
            raise ConfigError("--backend cuda: no CUDA GPU is available (numba.cuda found none)")
    kv_pool = None if kv_pool == "auto" else kv_pool
    return CpuBackend(g, spec, kv_dtype, kv_pool or _whole_chunks(n_ctx)), kv_pool


def _auto_gpu_pool(g, spec: ModelSpec, kv_dtype: np.dtype, n_ctx: int) -> int | None:
    from lucekv.kernels.cuda import cuda

    token_bytes = 2 * spec.n_layer * spec.n_kv_head * spec.head_dim * kv_dtype.itemsize
    weight_bytes = sum(t.data.nbytes for t in g.tensors.values())  # as uploaded, near enough: quants stay packed
    return auto_pool_tokens(cuda.current_context().get_memory_info().free, weight_bytes, token_bytes, n_ctx)


def auto_pool_tokens(free_bytes: float, weight_bytes: int, token_bytes: int, n_ctx: int) -> int | None:
    """--kv-pool auto on a GPU: None (the whole context, no paging) when its K/V fits in AUTO_POOL_SHARE of the
    memory left after the weights, else the most whole chunks that fit (the rest is scratch and headroom)."""
    budget = max(free_bytes - weight_bytes, 0) * AUTO_POOL_SHARE
    if _whole_chunks(n_ctx) * token_bytes <= budget:
        return None
    tokens = int(budget // token_bytes) // CHUNK_TOKENS * CHUNK_TOKENS
    if tokens < min_pool_tokens():
        raise ConfigError(
            f"--kv-pool auto: {free_bytes / 2**30:.2f} GiB of GPU memory are free and the weights take "
            f"{weight_bytes / 2**30:.2f} GiB, leaving room for {tokens} tokens of K/V, below the "
            f"{min_pool_tokens()} a pool needs; free GPU memory or use a smaller model")
    return tokens


def _n_chunks(n_tokens: int) -> int:
    return -(-n_tokens // CHUNK_TOKENS)


def _whole_chunks(n_tokens: int) -> int:
    """A whole-context pool rounded up to whole chunks, so sessions can move it chunk by chunk."""
    return _n_chunks(n_tokens) * CHUNK_TOKENS
