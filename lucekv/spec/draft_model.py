"""The draft-model drafter: a small model with the target's tokenizer proposes a greedy chain.

It runs on a backend of the target's kind with its own KV pool (slot = position, the whole context), kept in step
with the sequence: `held` are the tokens whose K/V it holds. A proposal first forwards what joined the sequence
since (the last round's bonus, or a plain step's tokens), then chains one-token steps, each taking the previous
step's argmax on the device (the run-ahead decode: the host reads a token while the next step runs). After a
round, the held K/V stays only up to the last accepted draft; the rejected drafts' positions are rewritten by the
next forward before any query reaches them (the position rule of DESIGN §4), so rolling back copies nothing.

The pool holds one sequence (`DraftModel`): each session has a drafter of its own, and one turn at a time owns the
model; another turn that asks for drafts meanwhile gets none (its rounds verify its own token alone, plain decoding's
output either way) until that turn ends. A drafter that takes the model back after another sequence used it computes
its K/V again; one whose K/V is still there (the session's next turn) keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from lucekv.engine.sampling import Sampler, SamplingParams
from lucekv.errors import ConfigError
from lucekv.spec.drafter import Draft

DRAFT_SEED = 0x5EED_D4AF  # a seeded request's draft RNG: its seed xor this (a stream apart from the target's)


class DraftBackend(Protocol):
    prefill_chunk: int

    def forward(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                all_logits: bool = False) -> np.ndarray: ...
    def decode_ahead(self, position: int, slot: int, token: int | None = None) -> None: ...
    def next_token(self) -> int: ...


class DraftModel:
    """The draft model's backend, whose pool holds one sequence's K/V: which drafter's turn uses it now (`owner`), and
    whose sequence the pool holds (`holder`)."""

    def __init__(self, backend: DraftBackend, vocab_size: int):
        """vocab_size: the target's; a draft token past it ends the draft (a padded embedding's rows)."""
        self.backend = backend
        self.vocab_size = vocab_size
        self.owner: DraftModelDrafter | None = None
        self.holder: DraftModelDrafter | None = None

    def take(self, drafter: DraftModelDrafter) -> bool:
        """Whether `drafter` may use the model (it is free, or the drafter's turn holds it already); a drafter taking
        the pool over from another sequence holds nothing of its own there any more."""
        if self.owner not in (None, drafter):
            return False
        self.owner = drafter
        if self.holder is not drafter:
            drafter.held = []
            self.holder = drafter
        return True

    def release(self, drafter: DraftModelDrafter) -> None:
        if self.owner is drafter:
            self.owner = None


class DraftModelDrafter:
    name = "draft"
    cheap = False  # a proposal costs model steps: the gate does not score it in the shadow

    def __init__(self, model: DraftModel):
        self.model = model
        self.backend = model.backend
        self.vocab_size = model.vocab_size
        self.seq: list[int] = []  # the sequence
        self.held: list[int] = []  # its prefix (and, after a proposal, the drafts) whose K/V the pool holds

    def begin(self, tokens: Sequence[int], params: SamplingParams) -> None:
        """Keeps the K/V of the longest common prefix with what the pool holds (a session's next turn). Above
        temperature 0 the drafts are drawn from the draft model's distributions (the request's temperature, top-k,
        top-p and min-p; its own RNG), which verification's rejection rule needs."""
        self.seq = list(tokens)
        self._keep_common_prefix(0)
        self._sampler = draft_sampler(params, self.vocab_size)

    def propose(self, max_len: int) -> Draft:
        if max_len <= 0 or not self.model.take(self):
            return Draft()
        b = self.backend
        pending = self.seq[len(self.held) :]
        start = len(self.held)
        for i in range(0, len(pending) - 1, b.prefill_chunk):  # all but the last: K/V only
            piece = np.asarray(pending[i : min(i + b.prefill_chunk, len(pending) - 1)], np.int32)
            pos = np.arange(start + i, start + i + len(piece), dtype=np.int32)
            b.forward(piece, pos, pos)
        last = len(self.seq) - 1
        draft = self._sampled(pending[-1], last, max_len) if self._sampler else self._greedy(pending[-1], last, max_len)
        self.held = self.seq + draft.tokens[:-1]
        return draft

    def _greedy(self, token: int, position: int, n: int) -> Draft:
        b = self.backend
        b.decode_ahead(position, position, token)
        out = []
        for i in range(1, n):  # step i takes the token of step i - 1 on the device
            b.decode_ahead(position + i, position + i, None)
            out.append(b.next_token())
        out.append(b.next_token())
        valid = next((i for i, t in enumerate(out) if t >= self.vocab_size), len(out))
        return Draft(out[:valid])

    def _sampled(self, token: int, position: int, n: int) -> Draft:
        """Each token drawn on the host from the step's logits; the distributions come along."""
        tokens, probs = [], []
        for i in range(n):
            p = np.array([position + i], np.int32)
            logits = self.backend.forward(np.array([token], np.int32), p, p)[-1]
            q = self._sampler.distribution(logits)
            token = self._sampler.draw(q)
            tokens.append(token)
            probs.append(q)
        return Draft(tokens, np.stack(probs))

    def accept(self, tokens: Sequence[int]) -> None:
        before = len(self.seq)
        self.seq += tokens
        self._keep_common_prefix(before)

    def end(self) -> None:
        self.model.release(self)

    def _keep_common_prefix(self, checked: int) -> None:
        """held = its longest common prefix with seq (its first `checked` tokens are known to agree), never the
        sequence's last token: a proposal needs that token's logits."""
        n = min(checked, len(self.held))
        while n < len(self.held) and n < len(self.seq) - 1 and self.held[n] == self.seq[n]:
            n += 1
        del self.held[n:]


def draft_sampler(params: SamplingParams, vocab_size: int) -> Sampler | None:
    """What a drafter draws its drafts with above temperature 0 (None: greedy drafts): the request's temperature,
    top-k, top-p and min-p, and its own RNG."""
    if params.temperature <= 0:
        return None
    q = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                       seed=None if params.seed is None else params.seed ^ DRAFT_SEED)
    return Sampler(q, [], vocab_size)


def check_same_vocabulary(target: dict, draft: dict, draft_name: str) -> None:
    """Refuse a draft model whose token ids mean other strings than the target's (GGUF metadata of each)."""
    a, b = list(target.get("tokenizer.ggml.tokens") or ()), list(draft.get("tokenizer.ggml.tokens") or ())
    if a == b and target.get("tokenizer.ggml.model") == draft.get("tokenizer.ggml.model"):
        return
    diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    raise ConfigError(f"draft model {draft_name}: its tokenizer is not the target's ({len(b)} tokens vs {len(a)}, "
                      f"first difference at id {diff}); a draft model must share the target's vocabulary")
