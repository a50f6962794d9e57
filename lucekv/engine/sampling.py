"""Sampling parameters (vLLM/SGLang names) and the logits → token sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lucekv.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off; divides positive logits of seen tokens (CTRL rule)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise InvalidRequestError naming the first bad field; return self for chaining."""

        def check(name: str, ok: bool, why: str) -> None:
            if not ok:
                raise InvalidRequestError(name, f"{why} (got {getattr(self, name)!r})")

        def finite(name: str) -> None:
            check(name, math.isfinite(getattr(self, name)), "must be a finite number")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            finite(name)
        check("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]")
        check("top_k", self.top_k >= 0, "must be >= 0 (0 disables it)")
        check("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]")
        check("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]")
        check("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]")
        check("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]")
        check("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]")
        check("seed", self.seed is None or 0 <= self.seed < 2**64, "must be in [0, 2^64)")
        check("max_tokens", self.max_tokens >= 1, "must be >= 1")
        check("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]")
        check("stop", all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty")
        check("top_logprobs", 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, f"must be in [0, {MAX_TOP_LOGPROBS}]")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            check("stop_token_ids", not bad, f"ids must be in [0, {vocab_size})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


class Sampler:
    """Turns one step's logits into a token id; holds the RNG so a seed reproduces a whole generation."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int):
        self.p = params
        self.rng = np.random.default_rng(params.seed)
        self.vocab_size = vocab_size
        self.seen = np.zeros(vocab_size, bool)  # prompt + output, for the repetition penalty
        self.seen[[t for t in prompt_ids if t < vocab_size]] = True
        self.counts = np.zeros(vocab_size, np.int32)  # output only, for presence/frequency penalties

    def observe(self, token: int) -> None:
        self.seen[token] = True
        self.counts[token] += 1

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits: the sample is their argmax (the device can take it)."""
        p = self.p
        return p.greedy and p.repetition_penalty == 1.0 and not (p.presence_penalty or p.frequency_penalty)

    def sample(self, logits: np.ndarray, banned: list[int] | None = None) -> int:
        if self.plain_greedy and not banned:
            return int(np.argmax(logits[: self.vocab_size]))  # no copy: a decode step costs it at 150K vocabularies
        x = self._adjusted(logits, banned)
        if self.p.greedy:
            return int(np.argmax(x))
        order, probs = self._candidates(x)
        return int(order[self.rng.choice(len(order), p=probs)])

    def distribution(self, logits: np.ndarray, banned: list[int] | None = None) -> np.ndarray:
        """float64 [vocab]: the probabilities `sample` draws the next token with (one-hot when greedy)."""
        x = self._adjusted(logits, banned)
        out = np.zeros(self.vocab_size)
        if self.p.greedy:
            out[int(np.argmax(x))] = 1.0
            return out
        order, probs = self._candidates(x)
        out[order] = probs
        return out

    def draw(self, probs: np.ndarray) -> int:
        """A token drawn from probs [vocab] with this sampler's RNG."""
        support = np.flatnonzero(probs)
        return int(support[self.rng.choice(len(support), p=probs[support] / probs[support].sum())])

    def _adjusted(self, logits: np.ndarray, banned: list[int] | None) -> np.ndarray:
        """Logits after the penalties and bans, divided by the temperature (float32 [vocab], a copy)."""
        p = self.p
        x = logits[: self.vocab_size].astype(np.float32, copy=True)
        if p.repetition_penalty != 1.0:
            s = x[self.seen]
            x[self.seen] = np.where(s > 0, s / p.repetition_penalty, s * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            x -= p.presence_penalty * (self.counts > 0) + p.frequency_penalty * self.counts
        if banned:
            x[banned] = -np.inf
        return x if p.greedy else x / np.float32(p.temperature)

    def _candidates(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens a draw may pick, most likely first, and their probabilities (top-k, top-p, min-p applied)."""
        p = self.p
        # Tokens more than e^30 less likely than the best carry < 1e-13 of the mass: skip sorting them.
        cand = np.flatnonzero(x >= x.max() - np.float32(30.0))
        order = cand[np.argsort(-x[cand], kind="stable")]
        if p.top_k > 0:
            order = order[: p.top_k]
        probs = np.exp(x[order].astype(np.float64) - x[order[0]])
        probs /= probs.sum()
        keep = len(order)
        if p.top_p < 1.0:  # smallest prefix whose mass reaches top_p (always at least one token)
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
        return order[:keep], probs[:keep] / probs[:keep].sum()
