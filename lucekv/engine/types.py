"""What the engine hands back while generating."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypedDict

from lucekv.pflash import CompressionUsage
from lucekv.spec.speculator import SpecUsage

FinishReason = Literal["stop", "length", "eos"]


class ChatMessage(TypedDict):
    role: str
    content: str


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first; empty unless top_logprobs > 0


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    time_to_first_token_s: float
    decode_tokens_per_s: float
    kv_resident_chunks: int = 0  # KVFlash residency at the end; zeros when the pool holds the whole context
    kv_paged_chunks: int = 0
    kv_bytes_moved: int = 0
    queue_time_s: float = 0.0  # from the request's arrival to its first step
    batch_size: float = 1.0  # sequences per step, on average over the steps that made its tokens
    speculation: SpecUsage | None = None  # rounds, drafted and accepted tokens, the gate's decisions; None: off
    prefilled_tokens: int = 0  # prompt tokens the model computed (fewer than prompt - cached when compressed)
    compression: CompressionUsage | None = None  # the prompt's compression (lucekv.pflash); None: not compressed


@dataclass
class GenerationDelta:
    """One step of output. `text` may be empty while a UTF-8 sequence or a possible stop string is pending."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None  # set on the last delta only
    usage: Usage | None = None  # set on the last delta only
