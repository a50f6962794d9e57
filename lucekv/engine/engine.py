"""The engine: a loaded model, its tokenizer and backend, and the step loop that serves many requests at once.

Requests are submitted, the scheduler (lucekv.engine.scheduler) forms each step from them, and `Engine.step` runs it:
each prompt piece as a forward of its own sequence, each speculative round's verify block as a forward of its own
sequence (lucekv.spec proposes and accepts), the plain decode tokens of every other running sequence as one forward
of rows (the weights read once for all). Each request keeps its session (its blocks of the one pool, lucekv.kvflash),
its sampler, its stop rules and its speculation (lucekv.engine.request). A step gives every sequence the numbers it
gets alone: pieces and verify blocks are the sequence's own, and each row is computed as it would be by itself (see
the backends).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from lucekv.engine.config import EngineConfig
from lucekv.engine.request import Request
from lucekv.engine.sampling import SamplingParams
from lucekv.engine.scheduler import Scheduler, SchedulerConfig
from lucekv.engine.sessions import Session, SessionInfo, SessionTable
from lucekv.engine.types import ChatMessage, GenerationDelta
from lucekv.errors import (
    ConfigError,
    ContextOverflowError,
    InvalidRequestError,
    LucekvError,
    PreconditionError,
    ResourceLimitError,
)
from lucekv.kvflash.blocks import BlockPool
from lucekv.kvflash.draft import DraftReader
from lucekv.kvflash.pager import CHUNK_TOKENS, RECENT_QUERIES, min_pool_tokens
from lucekv.kvflash.sequence import PagedSequence
from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import open_gguf
from lucekv.model.tokenizer import Tokenizer
from lucekv.pflash import PromptAlias
from lucekv.pflash.compressor import PromptCompressor
from lucekv.pflash.selection import check_keep_ratio
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
from lucekv.spark.record import TraceRecorder
from lucekv.spec.dflash import DFlashDrafter, DFlashModel
from lucekv.spec.draft_model import DraftModel, DraftModelDrafter, check_same_vocabulary
from lucekv.spec.drafter import Drafter
from lucekv.spec.gate import Gate, StepClock
from lucekv.spec.speculator import Speculator
from lucekv.spec.suffix import RecentOutputs, SuffixDrafter
from lucekv.spec.tree import DraftTree

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int] | Sequence[ChatMessage]
AUTO_POOL_SHARE = 0.9  # of the GPU memory free after the weights, for the KV pool
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
    kv_pool_tokens: int  # each sequence's residency budget; 0 = the whole context
    kv_policy: str  # "" without paging
    max_batch: int  # sequences in one step
    kv_cache_tokens: int  # the one pool every sequence borrows from
    spec_modes: tuple[str, ...]  # speculation modes a request may ask for
    spec_default: str  # the mode of requests that do not choose
    prefill_compression: bool = False  # requests may ask for prompt compression (a drafter is loaded)
    prefill_keep_ratio: float = 0.0  # the keep ratio of requests that do not choose; 0: they are not compressed
    prefill_threshold: int = 0  # prompts (their part to compute) no longer than this are never compressed


class Engine:
    """A model and its step loop. Requests are submitted (`submit`) and advance one step at a time (`step`), many at
    once; `generate` is the form for one caller, stepping until its request is done. Not thread-safe: one thread
    drives it (the server's engine thread)."""

    def __init__(self, path: Path, config: EngineConfig | None = None, snapshot_store: SnapshotStore | None = None):
        """config: the engine's options (lucekv.engine.config; default EngineConfig()). Its kv_pool "auto" on the
        CUDA backend: the whole context if it fits the GPU memory free after the weights, else the largest budget that
        does (`auto_pool_tokens`); on the CPU backend (whose device memory is host RAM) None. Its kv_cache None: room
        for max_batch sequences at their budget (on CUDA no more than AUTO_POOL_SHARE of the free GPU memory holds).
        Its step_tokens None: the backend's prefill batch. Its kv_policy "auto" is "draft" with a kv_drafter, else
        "quest". With prefill_compression or prefill_drafter set, or the draft policy's drafter loaded, requests may
        ask for compression (lucekv.pflash), its drafter prefill_drafter or else kv_drafter.
        snapshot_store: where idle sessions spill past the session limits (least recently used first); without one,
        new sessions past them are refused."""
        config = (config or EngineConfig()).check()
        self.path = Path(path)
        g = open_gguf(path)
        self.spec = ModelSpec.from_gguf(g)
        if config.layers is not None:
            self.spec = _first_layers(g, self.spec, config.layers)
        self.tokenizer = Tokenizer.from_metadata(g.metadata)
        self.n_ctx = min(config.n_ctx or self.spec.n_ctx, self.spec.n_ctx)
        kv_policy = config.kv_policy
        if kv_policy == "auto":  # issue 29: the drafter's ranking found the needles quest missed
            kv_policy = "draft" if config.kv_drafter else "quest"
        # before the backend: on CUDA the target's pool is sized in the GPU memory the drafter leaves
        prefill_drafter = config.prefill_drafter or config.kv_drafter
        wanted = config.prefill_compression is not None or config.prefill_drafter or \
            (config.kv_pool and kv_policy == "draft")
        self.compressor = self._compressor(config, prefill_drafter if wanted else None)
        self.prefill_keep = config.prefill_compression if config.prefill_compression != 1 else None  # all: none
        self.backend, kv_pool = _make_backend(config.backend, g, self.spec, config.kv_dtype, self.n_ctx, config.kv_pool,
                                              config.kv_cache, config.max_batch, _spark_options(g, config),
                                              config.mmq_tokens, config.gpu_memory_gib)
        self._spark_promote = config.spark_promote > 0
        self._recorder = self._routing_recorder(g.fingerprint, config)  # before prepare: graphs capture the counting
        self._kv_pool, self._kv_policy, self._kv_tau = kv_pool, kv_policy, config.kv_tau
        self.spec_config = replace(config.speculation, tree_verify=hasattr(self.backend, "forward_tree")).check()
        self._drafter = None
        if kv_pool and kv_policy == "draft":
            same = self.compressor is not None and prefill_drafter == config.kv_drafter \
                and not config.prefill_drafter_layers
            self._drafter = self.compressor.reader if same else self._load_drafter(config.kv_drafter, config.kv_dtype)
        self.blocks: BlockPool = self.backend.pool.blocks  # the pool every sequence borrows from
        step_tokens = config.step_tokens or self.backend.prefill_chunk
        # every forward a step may run, compiled (or loaded from the disk cache) and captured now, not mid-request;
        # any request may speculate
        self.backend.prepare(step_tokens, self.spec_config.max_draft + 1)
        self.scheduler = Scheduler(SchedulerConfig(config.max_batch, config.max_queue, step_tokens), self)
        self.layout = KVLayout(g.fingerprint, self.spec.arch.name, self.spec.n_layer, self.spec.n_kv_head,
                               self.spec.head_dim, config.kv_dtype, CHUNK_TOKENS)
        self.max_sessions, self.store = config.max_sessions, snapshot_store
        self.session_host_bytes = int(config.session_memory_gib * 2**30)
        self.sessions = SessionTable()
        self._anonymous: Session | None = self._new_session("")  # the latest request without a session, idle
        self._latest: Session = self._anonymous
        self._deferred: dict[str, deque[Request]] = {}  # requests waiting for their session's current one
        self._in_flight: deque[int | None] = deque()  # input tokens of enqueued greedy steps (None: chained)
        self._ahead: Request | None = None  # the request those steps are of
        self._last_greedy = 0  # the token of the latest settled greedy step
        self._step_clock = StepClock()  # the gate's measured step times, for the engine's life
        # speculation mode -> a new drafter ("auto" gates the suffix drafter); a session keeps its drafters
        recent = RecentOutputs() if self.spec_config.shared_outputs else None
        self.drafters: dict[str, Callable[[], Drafter]] = {"suffix": lambda: SuffixDrafter(recent),
                                                           "suffix-tree": lambda: SuffixDrafter(recent, tree=True)}
        if self.spec_config.draft_model is not None:
            draft_model = self._draft_model(g, config.kv_dtype)
            self.drafters["draft"] = lambda: DraftModelDrafter(draft_model)
        self._dflash = self._dflash_model(g) if self.spec_config.dflash_drafter is not None else None
        if self._dflash is not None:
            self.drafters["dflash"] = lambda: DFlashDrafter(self._dflash)
            self.drafters["dflash-tree"] = lambda: DFlashDrafter(self._dflash, tree=True)
        for key in snapshot_store.keys() if snapshot_store is not None else ():
            self.sessions.put(Session(key, None, stored_bytes=snapshot_store.size(key)))
        self.info = EngineInfo(self.spec.name, self.spec.arch.name, g.fingerprint, self.n_ctx,
                               self.spec.vocab_size, self.backend.name, self.spec.n_layer, self.spec.n_embd,
                               kv_pool or 0, kv_policy if kv_pool else "", config.max_batch,
                               self.blocks.n_blocks * CHUNK_TOKENS, self.spec_config.available(), self.spec_config.mode,
                               self.compressor is not None, config.prefill_compression or 0.0,
                               config.prefill_threshold if self.compressor is not None else 0)

    # ---- requests -------------------------------------------------------------------------------

    def prepare(self, prompt: Prompt, params: SamplingParams, pin_prefix: int | None = None,
                speculation: str | None = None, prefill_keep: float | None = None) -> list[int]:
        """Validate and tokenize; raises InvalidRequestError before any compute."""
        params.validate(self.spec.vocab_size)
        self.spec_config.resolve(speculation)
        self._prefill_keep(prefill_keep)
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
                 pin_prefix: int | None = None, speculation: str | None = None,
                 prefill_keep: float | None = None) -> Iterator[GenerationDelta]:
        """Stream the completion of `prompt`, stepping the engine (and whatever else it runs) until it is done. With
        a session id, the session (created if new) keeps the K/V for the next turn: a prompt that starts with its
        history only computes what is new. `pin_prefix`: with a bounded pool, the prompt's first tokens that are
        never paged out (None keeps the session's pins). `speculation`: a mode of `SpecConfig` (None: the engine's
        default); the output is the same either way (greedy: token for token; sampling: in distribution). Closing
        the iterator early cancels the request. `prefill_keep`: the keep ratio of a long prompt's compression
        (lucekv.pflash; 1.0: none; None: the engine's default)."""
        ids = self.prepare(prompt, params, pin_prefix, speculation, prefill_keep)
        request = self.submit(ids, params, session_id, pin_prefix, speculation, prefill_keep=prefill_keep)
        return self._stream(request)

    def prefill(self, prompt: Prompt, session_id: str = "") -> int:
        """Compute the K/V of `prompt` into the session (created if new), reusing the prefix it holds, without
        generating: a later generate whose prompt extends it computes only the rest (and, with a bounded pool, is
        the one that ranks and recalls chunks). Returns the tokens computed (the last one always is)."""
        ids = self._tokenize_prompt(prompt)
        if len(ids) > self.n_ctx:
            raise ContextOverflowError("prompt", f"{len(ids)} tokens exceed the context of {self.n_ctx}")
        request = self.submit(ids, SamplingParams(max_tokens=0), session_id)
        for _ in self._stream(request):
            pass
        return len(request.ids) - request.cached  # a compressed prompt: its kept tokens

    def _stream(self, request: Request) -> Iterator[GenerationDelta]:
        try:
            while True:
                while request.out:
                    yield request.out.popleft()
                if request.error is not None:
                    raise request.error
                if request.done:
                    return
                self.step()
        finally:
            self.cancel(request)

    def submit(self, ids: list[int], params: SamplingParams, session_id: str = "", pin_prefix: int | None = None,
               speculation: str | None = None, arrived: float | None = None,
               prefill_keep: float | None = None) -> Request:
        """Queue a prepared request (see `prepare`); its deltas collect in `Request.out` as steps run. `arrived`: when
        it arrived (perf_counter), if before now. `speculation`: a mode of `SpecConfig` (None: the engine's default).
        Raises QueueFullError when the queue is full, ResourceLimitError when a new session finds no room. max_tokens 0:
        the prompt's K/V only (`prefill`)."""
        if session_id:
            check_session_id(session_id)
        self.scheduler.check_room(extra=sum(len(d) for d in self._deferred.values()) + 1)
        mode = self.spec_config.resolve(speculation)
        keep = self._prefill_keep(prefill_keep)
        session = self._session_for(session_id, ids)
        request = self._request(ids, params, session, pin_prefix, mode, arrived, keep)
        if session.request is not None:  # its session is in use: it waits for that request to end
            self._deferred.setdefault(session_id, deque()).append(request)
            return request
        self.scheduler.add(request)
        session.request = request
        if session is self._anonymous:
            self._anonymous = None
        return request

    def _request(self, ids: list[int], params: SamplingParams, session: Session, pin_prefix: int | None, mode: str,
                 arrived: float | None, keep: float | None = None) -> Request:
        speculator = None if mode == "off" or params.max_tokens == 0 else lambda: self._speculator(mode, session)
        paged = session.paged  # a context the residency budget holds whole pages nothing out: no tail to recall for
        fits = paged.holds_all or len(ids) <= paged.pager.pool_tokens
        r = Request(ids, params, session, self.tokenizer, self.spec.vocab_size, pin_prefix, self._piece,
                    0 if fits else PROMPT_TAIL, speculator, keep)
        if speculator is not None and mode.startswith("dflash"):  # the session's drafter sees the target's features
            r.capture = self._session_drafter(mode, session).take_features
        r.submitted = arrived or r.submitted
        return r

    def _prefill_keep(self, keep: float | None) -> float | None:
        """A request's keep ratio (None: the engine's default) as the engine applies it: None for no compression.
        Raises InvalidRequestError for a ratio outside (0, 1], or one below 1 where no drafter is loaded."""
        if keep is None:
            return self.prefill_keep
        try:
            check_keep_ratio(keep)
        except ValueError as e:
            raise InvalidRequestError("prefill_keep_ratio", str(e)) from None
        if keep < 1 and self.compressor is None:
            raise InvalidRequestError("prefill_keep_ratio", "prompt compression is not available on this server "
                                      "(start it with --prefill-compression KEEP or --prefill-drafter MODEL)")
        return keep if keep < 1 else None

    def _speculator(self, mode: str, session: Session) -> Speculator:
        """A turn's speculation: its own gate (mode auto) and the session's drafter of that kind, kept across its turns
        (a suffix index, a draft model's K/V)."""
        gate = Gate(self._step_clock) if mode == "auto" else None
        return Speculator(mode, self._session_drafter(mode, session), gate, self.spec_config.max_draft,
                          self._step_clock, self.backend.verify_width)

    def _session_drafter(self, mode: str, session: Session) -> Drafter:
        kind = "suffix" if mode == "auto" else mode
        if kind not in session.drafters:
            session.drafters[kind] = self.drafters[kind]()
        return session.drafters[kind]

    def _session_for(self, session_id: str, ids: list[int]) -> Session:
        """The session a new request runs in: the named one (created if new, loaded if stored), or for a request
        without one the idle anonymous sequence if the prompt starts with what it holds (its prefix cache), else a new
        one (nothing of another conversation, its policy's state included, carries over)."""
        if not session_id:
            idle = self._anonymous
            if idle is not None and idle.tokens[:1] == ids[:1]:
                return idle
            if idle is not None:
                idle.paged.truncate(0)
                self._anonymous = None
            return self._new_session("")
        s = self.sessions.get(session_id)
        if s is None:
            self._make_room()
            s = self._new_session(session_id)
            self.sessions.put(s)
        elif s.stored_bytes:
            s = self._load_stored(s)
        return s

    def cancel(self, request: Request) -> None:
        """Stop a request (within this step): what it computed stays in its session."""
        waiting = self._deferred.get(request.session.id)
        if waiting is not None and request in waiting:
            waiting.remove(request)
            return
        if request.session.request is request:
            self._end(request)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def score(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [len(ids), vocab] for every position of a fresh sequence (used by oracle checks)."""
        seq = self._new_session("").paged
        self._reclaim(max(0, _n_chunks(len(ids)) - self.blocks.free_blocks))
        out, done = [], 0
        try:
            while done < len(ids):
                n = self._piece(seq, done, len(ids) - done)
                slots = seq.alloc(done, n)
                out.append(self.backend.forward(np.asarray(ids[done : done + n], np.int32),
                                                np.arange(done, done + n, dtype=np.int32), slots, all_logits=True,
                                                tables=[seq.table()]))
                seq.after_forward(0)
                done += n
        finally:
            seq.truncate(0)
        return np.concatenate(out)

    # ---- the step loop --------------------------------------------------------------------------

    def step(self) -> None:
        """Run the scheduler's next step: each request in it gets its next token (or its next prompt piece) into
        `Request.out`. A failure of the step fails the requests in it, and only those."""
        step = self.scheduler.schedule()
        solo = (len(step.works) == 1 and not step.works[0].prefill and not step.preempted
                and not self.scheduler.waiting and step.works[0].seq.device_greedy
                and not step.works[0].seq.speculating)
        if self._in_flight and not (solo and step.works[0].seq is self._ahead):
            self._drain()  # the request's steps enqueued ahead are its next tokens: settled now, out of turn
        try:
            for r in step.preempted:
                r.session.paged.park()
            self._reclaim(step.reclaim)
            works = [w for w in step.works if w.seq.computed == w.start and self._admitted(w.seq, step)]
            # decided before any runs: a round whose gate turns speculation off must not be followed by a plain step
            # in the same step (after its last token that made one more: the call got 32 tokens, usage said 33)
            rows = [w.seq for w in works if not w.prefill and not w.seq.speculating]
            for w in works:
                if w.prefill and w.seq.compress is not None:
                    self._compress(w.seq)
                    self._prefill(w.seq, w.start, w.seq.next_work()[1])  # no longer than the piece scheduled
                elif w.prefill:
                    self._prefill(w.seq, w.start, w.n)
                elif w.seq.speculating:
                    self._round(w.seq, len(works))
            if solo and rows:
                self._decode_greedy(rows[0])
            elif rows:
                self._decode_rows(rows)
        except Exception as e:  # the requests of the step get it; the engine goes on
            self._abandon([w.seq for w in step.works], e)
        for w in step.works:
            if w.seq.done:
                self._end(w.seq)

    def _admitted(self, r: Request, step) -> bool:
        """Set a request up as it (re)enters the batch; False if it failed to (a bad pin: that request alone)."""
        if r not in step.admitted:
            return True
        s = r.session
        s.paged.resume()  # what the pool took back while it was idle or parked comes back
        if r.started:
            return True
        r.started, r.t_start = True, time.perf_counter()
        s.last_used_unix = time.time()
        s.sampler = asdict(r.params)
        s.in_store = False  # it changes from here on
        self._latest = s
        try:
            if r.pin_prefix is not None:
                s.paged.pin_prefix(r.pin_prefix)
        except InvalidRequestError as e:
            r.fail(e)
            return False
        s.paged.truncate(r.cached)
        del s.tokens[r.cached :]
        if s.prompt_alias is not None and tuple(r.ids[: len(s.prompt_alias.held)]) != s.prompt_alias.held:
            s.prompt_alias = None  # the session will hold something else
        return True

    def _compress(self, r: Request) -> None:
        """Before a prompt's first piece: compress the part to compute if it is long (lucekv.pflash). In the step,
        after the request was admitted: the drafter's time counts in its first token's."""
        keep, r.compress = r.compress, None
        if not self.compressor.wants(len(r.ids) - r.cached):
            return
        kept, usage = self.compressor.compress(r.ids, r.cached, keep)
        r.compressed(kept, usage)
        r.session.prompt_alias = PromptAlias(tuple(r.client_ids), tuple(kept))

    def _prefill(self, r: Request, start: int, n: int) -> None:
        """A piece of the prompt; after the last one, the first token.

        A prompt longer than a bounded pool was computed beside the chunks resident as it went (the most recent): its
        tail, the question, never saw what it asks about. The tail is the prompt's last piece (Request.tail_start):
        its own queries rank the chunks, the best come back, and the tail is computed again, so that its K/V and the
        first sample see them (twice: the second ranking reads the queries of a tail that has seen the first
        recall). The resident chunks before the tail are computed again first, in order, each beside the ones before
        it: recalled needles were read beside whatever was recent then, and read so they led the question to a
        similar needle instead of the one asked (issue 29)."""
        logits = self._forward(r, r.ids[start : start + n], start)
        if r.prefilling:
            return
        if r.params.max_tokens == 0:  # the prompt's K/V was all it wanted (`prefill`)
            r.output.finish = "length"
            return
        tail = len(r.ids) - r.tail_start
        for _ in range(RECALL_ROUNDS if tail else 0):
            if not r.session.paged.recall_for_prompt(tail):
                break
            self._recompute(r, r.session.paged.resident_spans(r.tail_start))
            del r.session.tokens[r.tail_start :]
            pos = r.tail_start
            while pos < len(r.ids):
                n = self._piece(r.session.paged, pos, len(r.ids) - pos)
                logits = self._forward(r, r.ids[pos : pos + n], pos)
                pos += n
        r.take(logits[-1])

    def _recompute(self, r: Request, spans: list[tuple[int, int]]) -> None:
        """The K/V of the prompt's positions in `spans` [start, end) computed again, in order (the tokens stay)."""
        seq = r.session.paged
        for start, end in spans:
            while start < end:
                n = self._piece(seq, start, end - start)
                slots = seq.alloc(start, n)
                self.backend.forward(np.asarray(r.ids[start : start + n], np.int32),
                                     np.arange(start, start + n, dtype=np.int32), slots, tables=[seq.table()])
                seq.after_forward(decoded=0)
                start += n

    def _forward(self, r: Request, ids: list[int], start: int, round_at: int | None = None, all_logits: bool = False,
                 greedy: bool = False) -> np.ndarray:
        """A forward of the request's own sequence: the logits of `ids` at positions from `start` (the last, or all),
        or with `greedy` the argmax after each token, taken by the backend. `round_at`: the position of the speculative
        round whose verify block this is (a piece of), which the pager's policy counts when the round ends."""
        seq = r.session.paged
        slots = seq.alloc(start, len(ids))
        tokens, positions = np.asarray(ids, np.int32), np.arange(start, start + len(ids), dtype=np.int32)
        capture = self._dflash.spec.target_layers if r.capture is not None else ()
        self.backend.capture_layers = capture  # the target features of a dflash turn's forwards
        try:
            if greedy:
                out = self.backend.forward_argmax(tokens, positions, slots, tables=[seq.table()])
            else:
                out = self.backend.forward(tokens, positions, slots, all_logits, tables=[seq.table()])
        finally:
            self.backend.capture_layers = ()
        if capture:
            r.capture(start, self.backend.captured)
        r.session.tokens.extend(ids)
        r.computed = max(r.computed, start + len(ids))
        if round_at is None:
            seq.after_forward(decoded=0)
        else:  # the block's rows from `row` on, a chain's: each row's depth is its index
            row = start - round_at
            seq.after_verify(round_at, range(row, row + len(ids)), row)
        return out

    def _round(self, r: Request, batch: int) -> None:
        """A speculative round (lucekv.spec.Speculator.round): propose, verify the block on the request's own sequence,
        keep the accepted drafts; the block's tokens are the request's next. Greedy on the device where its next token
        would be, else on the host with its sampler. Tokens past a finish inside the block leave the sequence."""
        position = r.computed
        budget, limit = r.params.max_tokens - r.n_out, r.session.paged.round_limit(position)
        if limit is not None:  # the block ends by the pager policy's next event
            budget = min(budget, limit)
        block = r.spec.round(_RequestTarget(self, r), r.last_token, position, budget, r.n_out,
                             None if r.device_greedy else r.host_sampling)
        r.computed = position + len(block.tokens)  # `last` and the accepted drafts are the sequence's now
        r.emit(block, batch)
        if r.finish is not None:
            del r.session.tokens[len(r.ids) + r.n_out :]  # the drafts past the finish
            r.computed = min(r.computed, len(r.session.tokens))

    def _decode_rows(self, rows: list[Request]) -> None:
        """One decode token of each request, in one forward: weights are read once for all of them."""
        positions = np.array([r.computed for r in rows], np.int32)
        slots = np.array([r.session.paged.alloc(r.computed, 1)[0] for r in rows], np.int32)
        tables = [r.session.paged.table() for r in rows]
        tokens = np.array([r.last_token for r in rows], np.int32)
        sampled = [i for i, r in enumerate(rows) if not r.device_greedy]
        greedy, logits = self.backend.decode_rows(tokens, positions, slots, tables, sampled)
        for i, r in enumerate(rows):
            r.session.tokens.append(r.last_token)
            r.computed += 1
            r.session.paged.after_forward(decoded=1, row=i)
        for i, r in enumerate(rows):
            if i in sampled:
                r.take(logits[sampled.index(i)], batch=len(rows))
            else:
                r.take(None, int(greedy[i]), batch=len(rows))

    def _decode_greedy(self, r: Request) -> None:
        """The greedy token of a request decoding alone, argmax taken by the backend. Run-ahead: when a token after
        the next is wanted, nothing waits and the pager has nothing to do, the step after this one is enqueued before
        this one's token is read, its input the device's argmax: the device runs while the host handles the token."""
        pos = r.computed
        if not self._in_flight:  # else an earlier step enqueued this one
            self._enqueue(r, r.last_token, pos)
        if r.wants_more and r.session.paged.quiet_step(pos):
            self._enqueue(r, None, pos + 1)
        self._settle()

    def _enqueue(self, r: Request, tok: int | None, pos: int) -> None:
        seq = r.session.paged
        self.backend.decode_ahead(pos, int(seq.alloc(pos, 1)[0]), tok, seq.table())
        self._in_flight.append(tok)
        self._ahead = r

    def _settle(self) -> None:
        """Wait for the oldest enqueued greedy step: its input joins the sequence, the pager counts it, and its token
        is the request's next (unless the request ended meanwhile: its K/V is kept all the same)."""
        tok = self._in_flight.popleft()  # first: a backend error leaves nothing for a drain to wait on again
        out = self.backend.next_token()
        r = self._ahead
        r.session.tokens.append(self._last_greedy if tok is None else tok)
        r.session.paged.after_forward(decoded=1)
        self._last_greedy = out
        if not r.done:
            r.computed += 1
            r.take(None, out)

    def _drain(self) -> None:
        """Settle every enqueued step."""
        while self._in_flight:
            self._settle()

    def _end(self, r: Request) -> None:
        """The request is done (finished, failed or cancelled): its session stays as it is, idle, keeping its blocks
        until the pool needs them; a request waiting for the session goes into the queue."""
        if r.finish is None and r.error is None:
            r.cancelled = True  # first: steps it had enqueued ahead settle without making tokens
        if r is self._ahead:
            self._drain()
            self._ahead = None
        if self._spark_promote:
            self.backend.spark.promote()  # between requests: busier cold experts into the placement
        if self._recorder is not None and self._recorder.request_ended():
            try:
                self.save_routing_trace()
            except OSError as e:  # the counts stay for the next write; the requests go on
                logger.error("--spark-record: writing %s: %s", self._recorder.path, e)
        self.scheduler.remove(r)
        s = r.session
        if s.request is not r:
            return
        r.end_speculation()
        _forget_drafts(s)
        s.request = None
        s.last_used_unix = time.time()
        s.paged.suspend()
        if not s.id:
            if self._anonymous is not None:
                self._anonymous.paged.truncate(0)  # one idle anonymous sequence: the latest
            self._anonymous = s
        elif (waiting := self._deferred.get(s.id)) is not None:
            nxt = waiting.popleft()
            if not waiting:
                del self._deferred[s.id]
            nxt.reuse(s.tokens)
            s.request = nxt
            self.scheduler.requeue(nxt)  # it arrived before the requests queued since
        self._enforce_host_limit()

    def fail_all(self, error: BaseException) -> None:
        """Fail every request (a step went wrong outside the engine's own handling): each ends with `error`."""
        requests = [*self.scheduler.running, *self.scheduler.waiting]
        self._abandon(requests, error)
        for r in requests:
            self._end(r)

    def _abandon(self, requests: list[Request], error: BaseException) -> None:
        """Fail the requests of a step that raised: steps enqueued ahead are dropped, and each sequence forgets the
        positions it was given but never got the K/V of."""
        self._in_flight.clear()
        self.backend.discard_ahead()
        for r in requests:
            r.fail(error)
            seq, held = r.session.paged, len(r.session.tokens)
            if seq.pager.n_tokens > held:
                seq.truncate(held)

    def _piece(self, seq: PagedSequence, start: int, n: int) -> int:
        """Tokens of the prompt piece from position `start`, at most n: the backend's batch (or the step's token
        budget), and with a bounded pool no more than fit it beside the protected chunks (whole chunks, so the pool
        evicts as the prompt goes). The sequence's own state decides it, never what else a step holds."""
        n = min(n, self.backend.prefill_chunk, self.scheduler.config.step_tokens)
        if start % CHUNK_TOKENS + n <= CHUNK_TOKENS:
            return n  # within one chunk: the allocation checks the fit itself
        pager = seq.pager
        end = start + n
        while not pager.span_fits(start, end):
            end = (end - 1) // pager.chunk * pager.chunk  # down to the previous chunk boundary
            if end <= start:
                return min(n, pager.chunk - start % pager.chunk)
        return end - start

    # ---- the block pool, as the scheduler sees it (BlockLedger) -------------------------------------

    @property
    def free_blocks(self) -> int:
        return self.blocks.free_blocks

    @property
    def reclaimable_blocks(self) -> int:
        return sum(s.paged.held_blocks for s in self._idle())

    def _idle(self) -> list[Session]:
        """Sequences holding blocks that no running request uses (idle sessions, the idle anonymous sequence, those
        of queued requests), least recently used first."""
        running = set(map(id, self.scheduler.running))
        candidates = [*self.sessions.in_memory(), *(r.session for r in self.scheduler.waiting)]
        if self._anonymous is not None:
            candidates.append(self._anonymous)
        idle = {id(s): s for s in candidates
                if s.paged is not None and s.paged.held_blocks and id(s.request) not in running}
        return sorted(idle.values(), key=lambda s: s.last_used_unix)

    def _reclaim(self, n: int) -> None:
        """Take n blocks back from idle sequences (their chunks page out to host), least recently used first."""
        for s in self._idle():
            if n <= 0:
                return
            s.paged.suspend()
            n -= s.paged.give_back(n)

    # ---- sessions (DESIGN §5): idle ones keep their blocks until the pool needs them -------------------

    @property
    def paged(self) -> PagedSequence | None:
        """The sequence of the latest request, when it has a residency budget (None: it holds its whole context)."""
        seq = self._latest.paged
        return None if seq is None or seq.holds_all else seq

    def session_info(self, session_id: str) -> SessionInfo:
        return self.sessions.info(self.sessions.require(session_id))

    def snapshot(self, session_id: str, upto_tokens: int | None = None) -> tuple[SnapshotHeader, list[np.ndarray]]:
        """The session's header and chunk K/V (copies), cut to a chunk boundary below `upto_tokens` if that is
        shorter than the session. Runs on the engine thread; the caller serializes (write_snapshot) off it."""
        s = self.sessions.require(session_id)
        if self._ahead is not None and s is self._ahead.session:
            self._drain()
        if s.paged is not None:
            _forget_drafts(s)  # a running request's rejected drafts: out of view, and not the session's
        if s.stored_bytes:
            s = self._load_stored(s)
        n = len(s.tokens)
        if upto_tokens is not None and upto_tokens < n:
            n = upto_tokens // CHUNK_TOKENS * CHUNK_TOKENS
        chunks = [kv[:, :, : chunk_rows(n, CHUNK_TOKENS, c)].copy()
                  for c, kv in enumerate(s.paged.read_chunks(_n_chunks(n)))]
        partial = n < len(s.tokens)
        # the residency only fits the whole session (a partial one starts afresh with the policy)
        pager = s.paged.state() if not partial else None
        alias = s.prompt_alias
        held = alias is not None and len(alias.held) <= n and tuple(s.tokens[: len(alias.held)]) == alias.held
        alias = (alias.client, len(alias.held)) if held else None
        header = SnapshotHeader(self.layout, tuple(s.tokens[:n]), s.id, s.sampler, FLAG_PARTIAL if partial else 0,
                                time.time(), pager, alias)
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
            _check_unused(old, "restore over")
            self._forget(old)
        self.sessions.put(s)
        self._enforce_host_limit()
        return self.sessions.info(s)

    def delete_session(self, session_id: str) -> None:
        self.sessions.check_idle(session_id, "delete")
        s = self.sessions.require(session_id)
        _check_unused(s, "delete")
        self._forget(s)

    def _routing_recorder(self, fingerprint: str, config: EngineConfig) -> TraceRecorder | None:
        """--spark-record: the recorder, the backend counting its routing; or None."""
        if config.spark_record is None:
            return None
        if not self.spec.n_expert:
            raise ConfigError(f"--spark-record: {self.spec.name} is not a mixture of experts (it routes nothing)")
        recorder = TraceRecorder(config.spark_record, fingerprint, self.spec.n_layer, self.spec.n_expert,
                                 self.spec.n_expert_used, config.spark_record_every)
        self.backend.count_routing()
        return recorder

    def save_routing_trace(self) -> bool:
        """--spark-record: the routing counted so far (every forward enqueued) into its trace file, written whole or not
        at all; False when not recording. The engine writes it every --spark-record-every requests, the server at
        shutdown. Raises OSError if the file cannot be written (the counts are kept for the next write)."""
        if self._recorder is None:
            return False
        self._recorder.add(self.backend.take_routing_counts())
        self._recorder.save()
        return True

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
            self.sessions.put(Session(session_id, None, stored_bytes=self.store.size(session_id)))

    def _new_session(self, session_id: str) -> Session:
        s = Session(session_id, None)
        s.paged = PagedSequence(
            self.backend, self.blocks, self._kv_pool, n_layer=self.spec.n_layer, n_kv_head=self.spec.n_kv_head,
            head_dim=self.spec.head_dim, dtype=self.backend.pool.dtype, policy=self._kv_policy, tau=self._kv_tau,
            window=self.spec.sliding_window, drafter=self._drafter, history=lambda: s.tokens)
        return s

    def _draft_model(self, target, kv_dtype: str) -> DraftModel:
        """The draft model of SpecConfig on a backend of this engine's kind, its pool one sequence's whole context,
        prepared as the target's is (its catch-up prompt pieces and one-token steps compiled and captured now, not
        inside a request's rounds: on an H100 the 1.5b's draft rounds took 66 ms of host time unprepared, ~25 before
        the prefill graphs)."""
        path = self.spec_config.draft_model
        g = open_gguf(path)
        check_same_vocabulary(target.metadata, g.metadata, str(path))
        spec = ModelSpec.from_gguf(g)
        if spec.n_ctx < self.n_ctx:
            raise ConfigError(f"draft model {path}: its context of {spec.n_ctx} tokens is shorter than the target's "
                              f"{self.n_ctx}")
        backend, _ = _make_backend(self.backend.name, g, spec, kv_dtype, self.n_ctx, None, None, 1)
        backend.prepare(backend.prefill_chunk, 1)
        return DraftModel(backend, self.spec.vocab_size)

    def _dflash_model(self, target) -> DFlashModel:
        """The DFlash drafter of SpecConfig, made for this target, with the target's embeddings and LM head. It runs
        on the CPU backend's ops (beside a CUDA target too: that one's verify forwards then run without graphs)."""
        from lucekv.backends.cpu import CpuDraftOps

        shared = self.backend.weights if self.backend.name == "cpu" else None
        return DFlashModel(self.spec_config.dflash_drafter, self.spec, target, shared, CpuDraftOps)

    def _compressor(self, config: EngineConfig, model: str | Path | None) -> PromptCompressor | None:
        """The prompt compressor, `model` its drafter (None: none)."""
        if not model:
            return None
        reader = self._load_drafter(model, config.kv_dtype, config.backend, "prefill compression",
                                    config.prefill_drafter_layers or None)
        return PromptCompressor(reader, config.prefill_threshold)

    def _load_drafter(self, model: str | Path | None, kv_dtype: str, backend: str | None = None,
                      use: str = "kv policy draft", layers: int | None = None) -> DraftReader:
        """The draft policy's (or the prompt compressor's) reader: the drafter on this engine's backend, holding the
        whole context (one sequence at a time: its pool holds one)."""
        from lucekv.model.registry import resolve_model

        if not model:
            raise ConfigError(f"{use} needs a drafter model (--kv-drafter)")
        config = EngineConfig(backend=backend or self.backend.name, kv_dtype=kv_dtype, n_ctx=self.n_ctx, max_batch=1,
                              layers=layers)
        drafter = Engine(resolve_model(str(model)), config)
        if drafter.tokenizer.pieces != self.tokenizer.pieces:
            raise ConfigError(f"the drafter {drafter.spec.name!r} does not share {self.spec.name!r}'s tokenizer")
        if drafter.n_ctx < self.n_ctx:
            raise ConfigError(f"the drafter's context ({drafter.n_ctx}) is shorter than the model's ({self.n_ctx})")
        return DraftReader(drafter)

    def _session_from(self, session_id: str, header: SnapshotHeader, chunks: list[np.ndarray]) -> Session:
        s = self._new_session(session_id)
        s.tokens, s.sampler = list(header.token_ids), dict(header.sampler)
        if header.prompt_alias is not None:
            client, held = header.prompt_alias
            s.prompt_alias = PromptAlias(client, tuple(s.tokens[:held]))
        try:
            s.paged.restore(len(s.tokens), chunks, header.pager)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise SnapshotError(f"the header's pager state is malformed: {e}") from None
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
        s.paged.truncate(0)
        self.sessions.mark_stored(s, nbytes)

    def _forget(self, s: Session) -> None:
        """Drop a session: its K/V in the pool, on the host and in the store."""
        self._drop_local(s)
        if self.store is not None and s.id in self.store:
            self.store.delete(s.id)

    def _drop_local(self, s: Session) -> None:
        """Free the session's K/V in the pool and on the host, and its table entry."""
        if s.paged is not None:
            s.paged.truncate(0)
        self.sessions.remove(s.id)

    def _make_room(self) -> None:
        """Before a session enters memory: spill the least recently used idle one if the count is at its limit."""
        while len(self.sessions.in_memory()) >= self.max_sessions:
            idle = [s for s in self.sessions.idle_by_age() if s.request is None]
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
            if s.request is None:
                self._spill(s)


def _spark_options(g, config: EngineConfig):
    """SparkOptions of --spark-placement (a placement of another model is refused, by name), or None."""
    if config.spark_placement is None:
        return None
    from lucekv.backends.cuda_spark import SparkOptions
    from lucekv.spark.placement import Placement

    return SparkOptions(Placement.load(config.spark_placement, g.fingerprint), config.spark_spare,
                        config.spark_promote)


def _make_backend(name: str, g, spec: ModelSpec, kv_dtype: str, n_ctx: int, kv_pool: int | str | None,
                  kv_cache: int | None, max_batch: int, spark=None, mmq_tokens: int | None = None,
                  gpu_memory_gib: float = 0.0):
    """The backend with its KV pool, and each sequence's residency budget in tokens (None: the whole context) with
    "auto" resolved. The pool: `kv_cache` tokens, or room for max_batch sequences at that budget, on CUDA within
    AUTO_POOL_SHARE of the GPU memory free (within gpu_memory_gib, if > 0: `usable_bytes`) after the weights
    (`gpu_weight_bytes`: with Spark, the expert tables' share only); it always holds one sequence at least.
    mmq_tokens: CUDA's CudaOps.mmq_tokens (None: its default)."""
    from lucekv.backends.cpu import KV_DTYPES, CpuBackend

    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv dtype {kv_dtype!r} is not supported (choose {', '.join(KV_DTYPES)})")
    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"unknown backend {name!r} (choose auto, cpu or cuda)")
    whole = _whole_chunks(n_ctx)
    if name != "cpu":
        from lucekv.kernels.cuda import SIMULATOR, available

        if available() and (name == "cuda" or not SIMULATOR):  # "auto" never picks the slow simulator
            from lucekv.backends.cuda import CudaBackend

            room = _gpu_kv_room(g, spec, np.dtype(KV_DTYPES[kv_dtype]), spark, gpu_memory_gib)
            if kv_pool == "auto":
                kv_pool = auto_pool_tokens(room, whole)
            total = _check_cache(kv_cache or max(min(room, max_batch * (kv_pool or whole)), kv_pool or whole),
                                 kv_pool or whole)
            # one block more: the backend's scratch (see CudaKVPool)
            backend = CudaBackend(g, spec, kv_dtype, total + CHUNK_TOKENS, max_rows=max_batch, spark=spark)
            if mmq_tokens is not None:
                backend.ops.mmq_tokens = mmq_tokens
            return backend, kv_pool
        if name == "cuda":
            raise ConfigError("--backend cuda: no CUDA GPU is available (numba.cuda found none)")
    if spark is not None:
        raise ConfigError("--spark-placement needs the CUDA backend (the CPU backend keeps every expert in RAM)")
    kv_pool = None if kv_pool == "auto" else kv_pool
    total = kv_cache or max_batch * (kv_pool or whole)
    return CpuBackend(g, spec, kv_dtype, _check_cache(total, kv_pool or whole)), kv_pool


def _first_layers(g, spec: ModelSpec, layers: int) -> ModelSpec:
    """The spec of the model's first `layers` layers; the tensors of the others are left unread on purpose."""
    if not 0 < layers <= spec.n_layer:
        raise ConfigError(f"{spec.name} has {spec.n_layer} layers: cannot read with its first {layers}")
    g.used.update(n for n in g.tensors if n.startswith("blk.") and int(n.split(".")[1]) >= layers)
    return replace(spec, n_layer=layers)


def _check_cache(tokens: int, sequence: int) -> int:
    if tokens % CHUNK_TOKENS or tokens < sequence:
        raise ConfigError(f"a KV cache of {tokens} tokens must be a multiple of {CHUNK_TOKENS} and hold one "
                          f"sequence's {sequence} (its --kv-pool budget, or the whole context)")
    return tokens


def _gpu_kv_room(g, spec: ModelSpec, kv_dtype: np.dtype, spark=None, gpu_memory_gib: float = 0.0) -> int:
    """Tokens of K/V that fit AUTO_POOL_SHARE of the GPU memory free (`usable_bytes`: within gpu_memory_gib, if > 0)
    after the weights (the rest is scratch and headroom), in whole chunks."""
    from lucekv.kernels.cuda import cuda

    free_bytes, total_bytes = cuda.current_context().get_memory_info()
    return kv_room_tokens(usable_bytes(free_bytes, total_bytes, gpu_memory_gib), gpu_weight_bytes(g, spark),
                          kv_token_bytes(spec, kv_dtype))


def usable_bytes(free_bytes: int, total_bytes: int, gpu_memory_gib: float) -> int:
    """The GPU memory the model may take: what is free, or with a bound (gpu_memory_gib > 0), no more than keeps the
    device's memory in use (this process's CUDA context and whatever else is there) under it."""
    if not gpu_memory_gib:
        return free_bytes
    return max(0, min(free_bytes, int(gpu_memory_gib * 2**30) - (total_bytes - free_bytes)))


def kv_token_bytes(spec: ModelSpec, kv_dtype: np.dtype) -> int:
    """One token's K and V in every layer."""
    return 2 * spec.n_layer * spec.n_kv_head * spec.head_dim * kv_dtype.itemsize


def gpu_weight_bytes(g, spark=None) -> int:
    """The model's bytes on the GPU, as uploaded near enough (quants stay packed): every tensor's; with Spark
    (SparkOptions), of the experts only those its tables hold, the placed ones and the spare slots of every layer (the
    rest stays in pinned host memory)."""
    total = sum(t.data.nbytes for t in g.tensors.values())
    if spark is None:
        return total
    from lucekv.spark.experts import expert_bytes

    sizes = expert_bytes(g)
    return total - sum(sizes) * spark.placement.n_expert + spark.placement.table_bytes(sizes, spark.spare)


def kv_room_tokens(free_bytes: float, weight_bytes: int, token_bytes: int) -> int:
    return int(max(free_bytes - weight_bytes, 0) * AUTO_POOL_SHARE // token_bytes) // CHUNK_TOKENS * CHUNK_TOKENS


def auto_pool_tokens(room: int, n_ctx: int) -> int | None:
    """--kv-pool auto on a GPU with `room` tokens of K/V (`kv_room_tokens`): None (the whole context, no paging)
    when it fits, else the room as a sequence's budget."""
    if _whole_chunks(n_ctx) <= room:
        return None
    if room < min_pool_tokens():
        raise ConfigError(
            f"--kv-pool auto: the GPU memory free (or --gpu-memory-gib) after the weights holds {room} tokens of K/V, "
            f"below the {min_pool_tokens()} a pool needs; free GPU memory, use a smaller model or, for an MoE, keep "
            "fewer experts on the GPU (--spark-placement)")
    return room


def _n_chunks(n_tokens: int) -> int:
    return -(-n_tokens // CHUNK_TOKENS)


def _whole_chunks(n_tokens: int) -> int:
    """A whole-context pool rounded up to whole chunks, so sessions can move it chunk by chunk."""
    return _n_chunks(n_tokens) * CHUNK_TOKENS



class _RequestTarget:
    """A request's sequence as a speculative round's target (lucekv.spec.speculator.Target). With a budget, a verify
    block stops at a chunk boundary and goes on in a second forward: the next chunk takes a block (and a chunk is
    evicted) only when a query has reached it, as in plain decoding, and only when every draft before the boundary
    stands: a rejected draft's query must not evict a chunk that the positions before it, verified again next round,
    would still see in plain decoding. Greedy, the target's tokens show it; sampled, the rows are forwarded as the
    rejection rule reads them (`_Rows`), and it reads a row only while every draft before it stood. The pager's
    policy counts the kept tokens when the round ends (`keep`: PagedSequence.after_round)."""

    def __init__(self, engine: Engine, r: Request):
        self._engine, self._r = engine, r
        self._tree_slots = np.zeros(0, np.int32)  # where a tree's verify block went
        self._tree_features: np.ndarray | None = None  # a dflash turn's target features of it, by block index

    def verify_greedy(self, tokens: list[int], start: int, tree: DraftTree | None = None) -> np.ndarray:
        if tree is not None:
            return self._tree(tokens, start, tree, greedy=True)
        out, at = [], 0
        for piece in self._pieces(tokens, start, greedy=True):
            out.append(piece)
            at += len(piece)
            if at < len(tokens) and any(piece != tokens[at - len(piece) + 1 : at + 1]):
                break  # a draft of this piece is rejected: no query reaches the next chunk
        return np.concatenate(out)

    def verify_logits(self, tokens: list[int], start: int, tree: DraftTree | None = None) -> np.ndarray:
        if tree is not None:
            return self._tree(tokens, start, tree)
        return _Rows(self._pieces(tokens, start, all_logits=True))

    def tree_width(self, start: int) -> int:
        """With a budget, a tree's block stays in its chunk: a node past it would take the next chunk's block (and
        evict one) before any query of plain decoding reached it."""
        widest = self._engine.backend.max_tree_block
        return min(widest, CHUNK_TOKENS - start % CHUNK_TOKENS) if not self._r.session.paged.holds_all else widest

    def keep(self, start: int, path: list[int]) -> None:
        tokens = self._r.session.tokens
        moved = [(j, i) for i, j in enumerate(path) if j != i]
        if moved:  # a tree's accepted nodes to their positions' slots (the slot map gives those their positions)
            src, dst = (self._tree_slots[list(idx)] for idx in zip(*moved, strict=True))
            self._engine.backend.copy_kv(src, dst)
        tokens[start:] = [tokens[start + j] for j in path]
        if self._tree_features is not None:  # the accepted path's features, at its positions
            self._r.capture(start, self._tree_features[path])
            self._tree_features = None
        self._r.session.paged.after_round(start, path)

    def _tree(self, tokens: list[int], start: int, tree: DraftTree, greedy: bool = False) -> np.ndarray:
        """Logits [n, vocab] of a tree's verify block (or with `greedy` each node's greedy token), every node at the
        root's position plus its depth, seeing its ancestors only (Backend.forward_tree)."""
        r, engine = self._r, self._engine
        seq = r.session.paged
        slots = self._tree_slots = seq.alloc(start, len(tokens))
        positions = start + tree.depths()
        b = engine.backend
        b.capture_layers = engine._dflash.spec.target_layers if r.capture is not None else ()
        try:
            out = b.forward_tree(np.asarray(tokens, np.int32), positions, slots, tree.ancestors(), seq.table(), greedy)
        finally:
            capture, b.capture_layers = b.capture_layers, ()
        self._tree_features = b.captured if capture else None
        r.session.tokens.extend(tokens)
        r.computed = max(r.computed, start + len(tokens))
        seq.after_verify(start, tree.depths())
        return out

    def _pieces(self, tokens: list[int], start: int, **kw) -> Iterator[np.ndarray]:
        """The forwards of the block, one per chunk it touches (with a budget), each run when the next is asked for."""
        done = 0
        bounded = not self._r.session.paged.holds_all
        while done < len(tokens):
            pos = start + done
            n = min(len(tokens) - done, CHUNK_TOKENS - pos % CHUNK_TOKENS) if bounded else len(tokens) - done
            yield self._engine._forward(self._r, tokens[done : done + n], pos, round_at=start, **kw)
            done += n


class _Rows:
    """A verify block's logits [n, vocab], each forward of it run when a row of it is first read (`rows[i]`,
    `rows[:k]`)."""

    def __init__(self, pieces: Iterator[np.ndarray]):
        self._pieces, self._rows = pieces, np.zeros((0, 0), np.float32)

    def __getitem__(self, idx: int | slice) -> np.ndarray:
        stop = idx.stop if isinstance(idx, slice) else idx + 1
        while stop is None or len(self._rows) < stop:
            piece = next(self._pieces, None)
            if piece is None:
                break
            self._rows = piece if not len(self._rows) else np.concatenate([self._rows, piece])
        return self._rows[idx]


def _forget_drafts(s: Session) -> None:
    """Free the slots of rejected drafts past the sequence's end (they are out of view already): a pager's head and
    a snapshot's residency then match the sequence again."""
    if s.paged.pager.n_tokens > len(s.tokens):
        s.paged.truncate(len(s.tokens))


def _check_unused(s: Session, action: str) -> None:
    if s.request is not None:
        raise PreconditionError(f"cannot {action} session {s.id!r}: a request is using it")
