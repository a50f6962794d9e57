"""A generation's output side: tokens become text (stop strings held back until they cannot match), and the
finish rule (end-of-generation token, stop string, max_tokens) cuts the output at the first token that ends it.
Tokens arrive in blocks (one from a plain step, several from a speculative round); a block is one delta."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from lucekv.engine.sampling import SamplingParams
from lucekv.engine.stops import StopMatcher
from lucekv.engine.types import FinishReason, GenerationDelta, TokenLogprob
from lucekv.model.tokenizer import Tokenizer


class OutputStream:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, after: int, eog_ids: Iterable[int]):
        """after: the prompt's last token (the detokenizer's context)."""
        self.params = params
        self.detok = tokenizer.stream(after=after)
        self.stops = StopMatcher(params.stop)
        self.end_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eog_ids))
        self._banned = sorted(self.end_ids)
        self.n = 0  # tokens emitted
        self.t_first = 0.0  # perf_counter of the first token
        self.finish: FinishReason | None = None

    def banned(self, i: int) -> list[int] | None:
        """Tokens the sampler must not pick for the i-th token of the next block (end tokens before min_tokens)."""
        return self._banned if self.n + i < self.params.min_tokens else None

    def emit(self, tokens: Sequence[int], logprobs: list[TokenLogprob] | None = None) -> GenerationDelta:
        """The delta of a block: its tokens up to the one that finishes the generation, if any (`finish` is set)."""
        text = ""
        kept = 0
        for tok in tokens:
            self.n += 1
            kept += 1
            if self.n == 1:
                self.t_first = time.perf_counter()
            if tok in self.end_ids:
                self.finish = "stop" if tok in self.params.stop_token_ids else "eos"
                text += self.stops.flush() + self.detok.flush()
                break
            piece, stopped = self.stops.feed(self.detok.add(tok))
            text += piece
            if stopped:
                self.finish = "stop"
                break
            if self.n >= self.params.max_tokens:
                self.finish = "length"
                text += self.stops.feed(self.detok.flush())[0] + self.stops.flush()
                break
        return GenerationDelta(list(tokens[:kept]), text, logprobs[:kept] if logprobs else None, self.finish)
