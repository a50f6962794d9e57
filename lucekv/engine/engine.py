"""The engine: a loaded model, its tokenizer and backend, and the generation loop."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lucekv.engine.sampling import Sampler, SamplingParams, log_softmax
from lucekv.engine.stops import StopMatcher
from lucekv.engine.types import ChatMessage, GenerationDelta, TokenLogprob, Usage
from lucekv.errors import ConfigError, ContextOverflowError, InvalidRequestError
from lucekv.kvflash.sequence import PagedSequence
from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import open_gguf
from lucekv.model.tokenizer import Tokenizer

Prompt = str | Sequence[int] | Sequence[ChatMessage]
PREFILL_CHUNK = 256  # tokens per prefill forward: bounds the attention score matrix
PAGED_PREFILL_CHUNK = 64  # with a bounded pool: one chunk per forward, so eviction keeps pace


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


class Engine:
    """Not thread-safe: one generation at a time (the server serializes requests)."""

    def __init__(self, path: Path, backend: str = "auto", kv_dtype: str = "f16", n_ctx: int | None = None,
                 kv_pool: int | str | None = None, kv_policy: str = "quest", kv_tau: int = 64):
        """kv_pool: KV slots on the device in tokens (a multiple of 64); None holds the whole context; "auto" is
        None on the CPU backend, whose device memory is host RAM."""
        self.path = Path(path)
        g = open_gguf(path)
        self.spec = ModelSpec.from_gguf(g)
        self.tokenizer = Tokenizer.from_metadata(g.metadata)
        self.n_ctx = min(n_ctx or self.spec.n_ctx, self.spec.n_ctx)
        if kv_pool == "auto":
            kv_pool = None
        self.backend = _make_backend(backend, g, self.spec, kv_dtype, kv_pool or self.n_ctx)
        if kv_pool is not None and not hasattr(self.backend, "execute"):
            raise ConfigError(f"--kv-pool: paging is not implemented on the {self.backend.name} backend yet; "
                              "use --kv-pool off")
        self.paged = None if kv_pool is None else PagedSequence(
            self.backend, self.backend.pool.slot_pos, n_layer=self.spec.n_layer, n_kv_head=self.spec.n_kv_head,
            head_dim=self.spec.head_dim, dtype=self.backend.pool.dtype, policy=kv_policy, tau=kv_tau,
            window=self.spec.sliding_window)
        self._cached: list[int] = []  # tokens whose K/V the pool holds, at positions 0..len-1
        self.info = EngineInfo(self.spec.name, self.spec.arch.name, g.fingerprint, self.n_ctx,
                               self.spec.vocab_size, self.backend.name, self.spec.n_layer, self.spec.n_embd,
                               kv_pool or 0, kv_policy if kv_pool else "")

    # ---- requests -------------------------------------------------------------------------------

    def prepare(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Validate and tokenize; raises InvalidRequestError before any compute."""
        params.validate(self.spec.vocab_size)
        ids = self._tokenize_prompt(prompt)
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

    def generate(self, prompt: Prompt, params: SamplingParams) -> Iterator[GenerationDelta]:
        ids = self.prepare(prompt, params)
        return self._run(ids, params)

    def score(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [len(ids), vocab] for every position of a fresh sequence (used by oracle checks)."""
        self._truncate(0)
        return np.concatenate(self._forward(list(ids), 0, all_logits=True))

    # ---- the loop -------------------------------------------------------------------------------

    def _forward(self, ids: list[int], start: int, all_logits: bool = False, decoding: bool = False,
                 ) -> list[np.ndarray]:
        out = []
        step = PREFILL_CHUNK if self.paged is None else PAGED_PREFILL_CHUNK
        for i in range(0, len(ids), step):
            chunk = np.asarray(ids[i : i + step], np.int32)
            pos = np.arange(start + i, start + i + len(chunk), dtype=np.int32)
            # Without a pager the pool holds the whole context: slot = position.
            slots = pos if self.paged is None else self.paged.alloc(int(pos[0]), len(chunk))
            out.append(self.backend.forward(chunk, pos, slots, all_logits))
            self._cached.extend(int(t) for t in chunk)
            if self.paged is not None:
                self.paged.after_forward(decoded=len(chunk) if decoding else 0)
        return out

    def _truncate(self, n: int) -> None:
        if self.paged is None:
            self.backend.pool.truncate(n)
        else:
            self.paged.truncate(n)
        del self._cached[n:]

    def _prefill(self, ids: list[int]) -> tuple[np.ndarray, int]:
        """Last-position logits of `ids`, reusing the K/V of the longest prefix the pool already holds.

        At least the last token is recomputed: its logits are what the first sample needs."""
        reused = 0
        limit = min(len(ids) - 1, len(self._cached))
        while reused < limit and self._cached[reused] == ids[reused]:
            reused += 1
        self._truncate(reused)
        logits = self._forward(ids[reused:], reused)[-1][-1]
        if self.paged is not None and self.paged.recall_for_last_query():
            # chunks relevant to the prompt's end came back: recompute its last token so the first sample sees them
            logits = self._forward(ids[-1:], len(ids) - 1)[-1][-1]
            del self._cached[len(ids):]
        return logits, reused

    def _run(self, ids: list[int], params: SamplingParams) -> Iterator[GenerationDelta]:
        t0 = time.perf_counter()
        logits, cached = self._prefill(ids)
        sampler = Sampler(params, ids, self.spec.vocab_size)
        detok = self.tokenizer.stream(after=ids[-1])
        stops = StopMatcher(params.stop)
        end_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.tokenizer.eog_ids))
        t_first = 0.0
        n_out = 0
        while True:
            banned = sorted(end_ids) if n_out < params.min_tokens else None
            tok = sampler.sample(logits, banned)
            sampler.observe(tok)
            n_out += 1
            if n_out == 1:
                t_first = time.perf_counter()
            logprobs = [self._logprob(logits, tok, params.top_logprobs)] if params.logprobs else None
            finish = None
            if tok in end_ids:
                finish = "stop" if tok in params.stop_token_ids else "eos"
                text = stops.flush() + detok.flush()
            else:
                text, stopped = stops.feed(detok.add(tok))
                if stopped:
                    finish = "stop"
                elif n_out >= params.max_tokens:
                    finish = "length"
                    text += stops.feed(detok.flush())[0] + stops.flush()
            if finish:
                elapsed = time.perf_counter() - t_first
                usage = Usage(len(ids), cached, n_out, t_first - t0, (n_out - 1) / elapsed if elapsed > 0 else 0.0)
                if self.paged is not None:
                    kv = self.paged.usage()
                    usage.kv_resident_chunks, usage.kv_paged_chunks = kv.resident_chunks, kv.paged_chunks
                    usage.kv_bytes_moved = kv.bytes_moved
                yield GenerationDelta([tok], text, logprobs, finish, usage)
                return
            yield GenerationDelta([tok], text, logprobs)
            pos = len(ids) + n_out - 1
            logits = self._forward([tok], pos, decoding=True)[0][-1]

    def _logprob(self, logits: np.ndarray, tok: int, top: int) -> TokenLogprob:
        lp = log_softmax(logits)
        best = np.argsort(-lp)[:top] if top else []
        return TokenLogprob(tok, float(lp[tok]), [(int(t), float(lp[t])) for t in best])


def _make_backend(name: str, g, spec: ModelSpec, kv_dtype: str, n_ctx: int):
    from lucekv.backends.cpu import KV_DTYPES, CpuBackend

    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv dtype {kv_dtype!r} is not supported (choose {', '.join(KV_DTYPES)})")
    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"unknown backend {name!r} (choose auto, cpu or cuda)")
    if name != "cpu":
        from lucekv.kernels.cuda import SIMULATOR, available

        if available() and (name == "cuda" or not SIMULATOR):  # "auto" never picks the slow simulator
            from lucekv.backends.cuda import CudaBackend

            return CudaBackend(g, spec, kv_dtype, n_ctx)
        if name == "cuda":
            raise ConfigError("--backend cuda: no CUDA GPU is available (numba.cuda found none)")
    return CpuBackend(g, spec, kv_dtype, n_ctx)
