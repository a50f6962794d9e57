"""One Generate call inside the engine: its prompt, sampler and stop rules, its session's sequence, and where it
stands. The scheduler sees it as a `Schedulable`; the engine feeds it each token and collects its deltas."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np

from lucekv.engine.sampling import Sampler, SamplingParams, log_softmax
from lucekv.engine.sessions import Session
from lucekv.engine.stops import StopMatcher
from lucekv.engine.types import GenerationDelta, TokenLogprob, Usage
from lucekv.kvflash.sequence import PagedSequence
from lucekv.model.tokenizer import Tokenizer


class Request:
    def __init__(self, ids: list[int], params: SamplingParams, session: Session, tokenizer: Tokenizer,
                 vocab_size: int, pin_prefix: int | None, piece: Callable[[PagedSequence, int, int], int],
                 prompt_tail: int = 0):
        """piece(sequence, start, n): the tokens of the prompt piece from `start` (at most n), the sequence's own.
        prompt_tail: the prompt's last tokens that go as a piece of their own (a pooled prompt's, whose queries rank
        the chunks to recall: see Engine._prefill); 0: none."""
        self.ids = ids
        self.params = params
        self.session = session
        self.pin_prefix = pin_prefix
        self._piece = piece
        self._prompt_tail = prompt_tail
        self.sampler = Sampler(params, ids, vocab_size)
        self.detok = tokenizer.stream(after=ids[-1])
        self.stops = StopMatcher(params.stop)
        self.end_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eog_ids))
        self.reuse(session.tokens)
        self.n_out = 0
        self.last_token = -1  # the latest sampled token: the next decode step's input
        self.started = False  # admitted once (its session set up for it)
        self.out: deque[GenerationDelta] = deque()  # deltas not yet taken by the caller
        self.finish: str | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.submitted = time.perf_counter()
        self.t_start = self.t_first = 0.0
        self.steps = self.rows = 0  # steps that produced a token of it, and the sequences those steps held

    def reuse(self, held: list[int]) -> None:
        """The prompt's first position to compute: what the session holds of it (`held`) is reused, but never the
        last token (its logits are the first sample's)."""
        limit = min(len(self.ids) - 1, len(held))
        reused = 0
        while reused < limit and held[reused] == self.ids[reused]:
            reused += 1
        self.cached = self.computed = reused  # computed: positions whose K/V the sequence holds for this request
        self.tail_start = len(self.ids) - min(len(self.ids) - reused, self._prompt_tail)

    # ---- Schedulable -----------------------------------------------------------------------------

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.ids)

    def next_work(self) -> tuple[int, int, bool]:
        if self.prefilling:
            end = self.tail_start if self.computed < self.tail_start else len(self.ids)
            return self.computed, self._piece(self.session.paged, self.computed, end - self.computed), True
        return self.computed, 1, False

    def blocks_wanted(self, end: int) -> int:
        return self.session.paged.blocks_wanted(end)

    @property
    def held_blocks(self) -> int:
        return self.session.paged.held_blocks

    # ---- output ----------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.finish is not None or self.error is not None or self.cancelled

    @property
    def device_greedy(self) -> bool:
        """Its next token is the argmax of the logits: the device may take it."""
        return self.sampler.plain_greedy and not self.params.logprobs and self.n_out >= self.params.min_tokens

    @property
    def wants_more(self) -> bool:
        """Whether a token after the next one may still be wanted (max_tokens allows it)."""
        return self.n_out + 1 < self.params.max_tokens

    def take(self, logits: np.ndarray | None, token: int | None = None, batch: int = 1) -> None:
        """The next token: `token` (a greedy one the device took) or sampled from `logits`; queues its delta, the last
        one with the finish reason and usage. `batch`: sequences in the step that made it."""
        p = self.params
        if token is None:
            banned = sorted(self.end_ids) if self.n_out < p.min_tokens else None
            token = self.sampler.sample(logits, banned)
        self.sampler.observe(token)
        self.n_out += 1
        self.last_token = token
        self.steps += 1
        self.rows += batch
        if self.n_out == 1:
            self.t_first = time.perf_counter()
        logprobs = [_logprob(logits, token, p.top_logprobs)] if p.logprobs else None
        finish = None
        if token in self.end_ids:
            finish = "stop" if token in p.stop_token_ids else "eos"
            text = self.stops.flush() + self.detok.flush()
        else:
            text, stopped = self.stops.feed(self.detok.add(token))
            if stopped:
                finish = "stop"
            elif self.n_out >= p.max_tokens:
                finish = "length"
                text += self.stops.feed(self.detok.flush())[0] + self.stops.flush()
        if finish is None:
            self.out.append(GenerationDelta([token], text, logprobs))
            return
        self.finish = finish
        self.out.append(GenerationDelta([token], text, logprobs, finish, self._usage()))

    def fail(self, error: BaseException) -> None:
        self.error = error

    def _usage(self) -> Usage:
        elapsed = time.perf_counter() - self.t_first
        usage = Usage(len(self.ids), self.cached, self.n_out, self.t_first - self.t_start,
                      (self.n_out - 1) / elapsed if elapsed > 0 else 0.0, queue_time_s=self.t_start - self.submitted,
                      batch_size=self.rows / self.steps)
        seq = self.session.paged
        if not seq.holds_all:
            kv = seq.usage()
            usage.kv_resident_chunks, usage.kv_paged_chunks = kv.resident_chunks, kv.paged_chunks
            usage.kv_bytes_moved = kv.bytes_moved
        return usage


def _logprob(logits: np.ndarray, tok: int, top: int) -> TokenLogprob:
    lp = log_softmax(logits)
    best = np.argsort(-lp)[:top] if top else []
    return TokenLogprob(tok, float(lp[tok]), [(int(t), float(lp[t])) for t in best])
