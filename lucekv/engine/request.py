"""One Generate call inside the engine: its prompt, sampler and output stream (lucekv.engine.output), its session's
sequence, its speculation if any (lucekv.spec), and where it stands. The scheduler sees it as a `Schedulable`; the
engine feeds it each token, or each speculative round's block of tokens, and collects its deltas."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np

from lucekv.engine.output import OutputStream
from lucekv.engine.sampling import Sampler, SamplingParams, log_softmax
from lucekv.engine.sessions import Session
from lucekv.engine.types import GenerationDelta, TokenLogprob, Usage
from lucekv.kvflash.sequence import PagedSequence
from lucekv.model.tokenizer import Tokenizer
from lucekv.pflash import CompressionUsage
from lucekv.spec.speculator import Block, Speculator


class Request:
    def __init__(self, ids: list[int], params: SamplingParams, session: Session, tokenizer: Tokenizer,
                 vocab_size: int, pin_prefix: int | None, piece: Callable[[PagedSequence, int, int], int],
                 prompt_tail: int = 0, speculator: Callable[[], Speculator] | None = None,
                 compress: float | None = None):
        """piece(sequence, start, n): the tokens of the prompt piece from `start` (at most n), the sequence's own.
        prompt_tail: the prompt's last tokens that go as a piece of their own (a pooled prompt's, whose queries rank
        the chunks to recall: see Engine._prefill); 0: none. speculator: makes the turn's speculation once the
        first token is known (None: speculation off). compress: the keep ratio of the prompt's compression
        (lucekv.pflash), done by the engine before its first piece; None: none."""
        self.client_ids = ids  # the prompt as sent; `ids` is what the session computes (lucekv.pflash aliases)
        self.ids = ids
        self.compress = compress
        self.compression: CompressionUsage | None = None
        self.params = params
        self.session = session
        self.pin_prefix = pin_prefix
        self._piece = piece
        self._prompt_tail = prompt_tail
        self._speculator = speculator
        self.spec: Speculator | None = None
        # a DFlash turn's hook: capture(start, features) after each target forward of the sequence (lucekv.spec.dflash)
        self.capture: Callable[[int, np.ndarray], None] | None = None
        self.sampler = Sampler(params, ids, vocab_size)
        self.output = OutputStream(tokenizer, params, ids[-1], tokenizer.eog_ids)
        self.reuse(session.tokens)
        self.last_token = -1  # the latest token out: the next decode step's (or round's) first input
        self.started = False  # admitted once (its session set up for it)
        self.out: deque[GenerationDelta] = deque()  # deltas not yet taken by the caller
        self.error: BaseException | None = None
        self.cancelled = False
        self.submitted = time.perf_counter()
        self.t_start = 0.0
        self.steps = self.rows = 0  # steps that produced tokens of it, and the sequences those steps held

    def reuse(self, held: list[int]) -> None:
        """The prompt's first position to compute: what the session holds of it (`held`) is reused, but never the
        last token (its logits are the first sample's). A session that holds a compressed prompt reads the client's
        prompt through its alias."""
        alias = self.session.prompt_alias
        self.ids = alias.rewrite(self.client_ids) if alias is not None else self.client_ids
        limit = min(len(self.ids) - 1, len(held))
        reused = 0
        while reused < limit and held[reused] == self.ids[reused]:
            reused += 1
        self.cached = self.computed = reused  # computed: positions whose K/V the sequence holds for this request
        self.tail_start = len(self.ids) - min(len(self.ids) - reused, self._prompt_tail)

    def compressed(self, kept: list[int], usage: CompressionUsage) -> None:
        """The prompt to compute is `kept` now (its reused prefix unchanged)."""
        self.ids, self.compression = kept, usage
        self.tail_start = len(kept) - min(len(kept) - self.cached, self._prompt_tail)

    # ---- Schedulable -----------------------------------------------------------------------------

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.ids)

    def next_work(self) -> tuple[int, int, bool]:
        if self.prefilling:
            end = self.tail_start if self.computed < self.tail_start else len(self.ids)
            return self.computed, self._piece(self.session.paged, self.computed, end - self.computed), True
        if self.speculating:  # a verify block: the last token and at most the longest draft the round may propose
            return self.computed, 1 + self.spec.max_draft_for(self.params.max_tokens - self.n_out), False
        return self.computed, 1, False

    def blocks_wanted(self, end: int) -> int:
        return self.session.paged.blocks_wanted(end)

    @property
    def held_blocks(self) -> int:
        return self.session.paged.held_blocks

    # ---- output ----------------------------------------------------------------------------------

    @property
    def n_out(self) -> int:
        return self.output.n

    @property
    def finish(self) -> str | None:
        return self.output.finish

    @property
    def t_first(self) -> float:
        return self.output.t_first

    @property
    def done(self) -> bool:
        return self.finish is not None or self.error is not None or self.cancelled

    @property
    def device_greedy(self) -> bool:
        """Its next token is the argmax of the logits: the device may take it."""
        return self.sampler.plain_greedy and not self.params.logprobs and self.n_out >= self.params.min_tokens

    @property
    def speculating(self) -> bool:
        """Its next step is a speculative round (a verify block on its own sequence)."""
        return self.spec is not None and self.spec.speculating

    @property
    def wants_more(self) -> bool:
        """Whether a plain step after the next one may still be wanted (max_tokens allows it, no round comes)."""
        return self.n_out + 1 < self.params.max_tokens and not self.speculating

    def host_sampling(self, rows: np.ndarray) -> BlockSampling:
        """The request's sampler over a verify block's logits (a round verified on the host)."""
        return BlockSampling(self.sampler, self.output, rows)

    def take(self, logits: np.ndarray | None, token: int | None = None, batch: int = 1) -> None:
        """The next token of a plain step: `token` (a greedy one the device took) or sampled from `logits`, at position
        `computed` (the first: the prompt's); queues its delta. `batch`: sequences in the step that made it."""
        if token is None:
            token = BlockSampling(self.sampler, self.output, logits[None]).sample(0)
        if self.n_out == 0 and self._speculator is not None:
            self.spec = self._speculator()
            self.spec.begin(self.ids, token, self.params)
        elif self.spec is not None:
            self.spec.plain(token, self.computed, self.n_out)
        self.emit(Block([token], None if logits is None else logits[None]), batch)

    def emit(self, block: Block, batch: int = 1) -> None:
        """Queue the delta of a block of tokens (a plain step's one, or a round's), cut at the one that finishes the
        generation; the last delta carries the finish reason and usage."""
        p = self.params
        logprobs = None
        if p.logprobs:
            logprobs = [_logprob(row, t, p.top_logprobs) for row, t in zip(block.logits, block.tokens, strict=True)]
        delta = self.output.emit(block.tokens, logprobs)
        self.last_token = block.tokens[-1]
        self.steps += 1
        self.rows += batch
        if self.finish is not None:
            delta.usage = self._usage()
        self.out.append(delta)

    def fail(self, error: BaseException) -> None:
        self.error = error

    def end_speculation(self) -> None:
        """The turn is over however it ended: its drafter learns so (a finished one's did in its usage)."""
        if self.spec is not None and self.finish is None:
            self.spec.end()

    def _usage(self) -> Usage:
        elapsed = time.perf_counter() - self.t_first
        usage = Usage(len(self.client_ids), self.cached, self.n_out, self.t_first - self.t_start,
                      (self.n_out - 1) / elapsed if elapsed > 0 else 0.0, queue_time_s=self.t_start - self.submitted,
                      batch_size=self.rows / self.steps, prefilled_tokens=len(self.ids) - self.cached,
                      compression=self.compression)
        seq = self.session.paged
        if not seq.holds_all:
            kv = seq.usage()
            usage.kv_resident_chunks, usage.kv_paged_chunks = kv.resident_chunks, kv.paged_chunks
            usage.kv_bytes_moved = kv.bytes_moved
        if self.spec is not None:
            usage.speculation = self.spec.end()
        return usage


class BlockSampling:
    """The request's sampler over a block's logits (lucekv.spec.verify.TargetSampler): row i gives the block's i-th
    token. Tokens are observed as they are drawn or kept (penalties of later rows see them; device-greedy tokens
    are not: plain greedy reads no penalties)."""

    def __init__(self, sampler: Sampler, output: OutputStream, rows: np.ndarray):
        self._sampler, self._output, self._rows = sampler, output, rows

    def sample(self, i: int) -> int:
        return self.keep(self._sampler.sample(self._rows[i], self._output.banned(i)))

    def probs(self, i: int) -> np.ndarray:
        return self._sampler.distribution(self._rows[i], self._output.banned(i))

    def draw(self, probs: np.ndarray) -> int:
        return self.keep(self._sampler.draw(probs))

    def uniform(self) -> float:
        return float(self._sampler.rng.random())

    def keep(self, token: int) -> int:
        self._sampler.observe(token)
        return token


def _logprob(logits: np.ndarray, tok: int, top: int) -> TokenLogprob:
    lp = log_softmax(logits)
    best = np.argsort(-lp)[:top] if top else []
    return TokenLogprob(tok, float(lp[tok]), [(int(t), float(lp[t])) for t in best])
