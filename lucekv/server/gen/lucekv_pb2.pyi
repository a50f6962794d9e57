from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_MODE_UNSPECIFIED: _ClassVar[SpeculationMode]
    SPECULATION_MODE_OFF: _ClassVar[SpeculationMode]
    SPECULATION_MODE_AUTO: _ClassVar[SpeculationMode]
    SPECULATION_MODE_SUFFIX: _ClassVar[SpeculationMode]
    SPECULATION_MODE_DRAFT: _ClassVar[SpeculationMode]
    SPECULATION_MODE_DFLASH: _ClassVar[SpeculationMode]
    SPECULATION_MODE_SUFFIX_TREE: _ClassVar[SpeculationMode]
    SPECULATION_MODE_DFLASH_TREE: _ClassVar[SpeculationMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
SPECULATION_MODE_UNSPECIFIED: SpeculationMode
SPECULATION_MODE_OFF: SpeculationMode
SPECULATION_MODE_AUTO: SpeculationMode
SPECULATION_MODE_SUFFIX: SpeculationMode
SPECULATION_MODE_DRAFT: SpeculationMode
SPECULATION_MODE_DFLASH: SpeculationMode
SPECULATION_MODE_SUFFIX_TREE: SpeculationMode
SPECULATION_MODE_DFLASH_TREE: SpeculationMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "messages", "sampling", "request_id", "session_id", "pin_prefix_tokens", "speculation", "prefill_keep_ratio")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_KEEP_RATIO_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    sampling: SamplingParams
    request_id: str
    session_id: str
    pin_prefix_tokens: int
    speculation: SpeculationMode
    prefill_keep_ratio: float
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., pin_prefix_tokens: _Optional[int] = ..., speculation: _Optional[_Union[SpeculationMode, str]] = ..., prefill_keep_ratio: _Optional[float] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens", "time_to_first_token_ms", "decode_tokens_per_second", "queue_time_ms", "kv_resident_chunks", "kv_paged_chunks", "kv_bytes_moved", "speculation", "batch_size", "prefilled_tokens", "compression")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    KV_RESIDENT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float
    decode_tokens_per_second: float
    queue_time_ms: float
    kv_resident_chunks: int
    kv_paged_chunks: int
    kv_bytes_moved: int
    speculation: SpeculationUsage
    batch_size: float
    prefilled_tokens: int
    compression: PrefillCompression
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., time_to_first_token_ms: _Optional[float] = ..., decode_tokens_per_second: _Optional[float] = ..., queue_time_ms: _Optional[float] = ..., kv_resident_chunks: _Optional[int] = ..., kv_paged_chunks: _Optional[int] = ..., kv_bytes_moved: _Optional[int] = ..., speculation: _Optional[_Union[SpeculationUsage, _Mapping]] = ..., batch_size: _Optional[float] = ..., prefilled_tokens: _Optional[int] = ..., compression: _Optional[_Union[PrefillCompression, _Mapping]] = ...) -> None: ...

class PrefillCompression(_message.Message):
    __slots__ = ("keep_ratio", "scored_tokens", "kept_tokens", "score_ms")
    KEEP_RATIO_FIELD_NUMBER: _ClassVar[int]
    SCORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORE_MS_FIELD_NUMBER: _ClassVar[int]
    keep_ratio: float
    scored_tokens: int
    kept_tokens: int
    score_ms: float
    def __init__(self, keep_ratio: _Optional[float] = ..., scored_tokens: _Optional[int] = ..., kept_tokens: _Optional[int] = ..., score_ms: _Optional[float] = ...) -> None: ...

class SpeculationUsage(_message.Message):
    __slots__ = ("mode", "drafter", "rounds", "drafted_tokens", "accepted_tokens", "plain_steps", "gate_decisions")
    MODE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    GATE_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    drafter: str
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    plain_steps: int
    gate_decisions: _containers.RepeatedCompositeFieldContainer[GateDecision]
    def __init__(self, mode: _Optional[str] = ..., drafter: _Optional[str] = ..., rounds: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., plain_steps: _Optional[int] = ..., gate_decisions: _Optional[_Iterable[_Union[GateDecision, _Mapping]]] = ...) -> None: ...

class GateDecision(_message.Message):
    __slots__ = ("at_token", "speculating")
    AT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SPECULATING_FIELD_NUMBER: _ClassVar[int]
    at_token: int
    speculating: bool
    def __init__(self, at_token: _Optional[int] = ..., speculating: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("model_name", "arch", "fingerprint", "context_length", "vocab_size", "backend", "n_layer", "n_embd", "features", "max_queued_requests", "version", "max_top_logprobs", "kv_pool_tokens", "kv_policy", "speculation_modes", "speculation_default", "max_batch", "kv_cache_tokens", "running_requests", "waiting_requests", "prefill_keep_ratio", "prefill_threshold")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    N_LAYER_FIELD_NUMBER: _ClassVar[int]
    N_EMBD_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_POLICY_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_MODES_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_KEEP_RATIO_FIELD_NUMBER: _ClassVar[int]
    PREFILL_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    arch: str
    fingerprint: str
    context_length: int
    vocab_size: int
    backend: str
    n_layer: int
    n_embd: int
    features: _containers.RepeatedScalarFieldContainer[str]
    max_queued_requests: int
    version: str
    max_top_logprobs: int
    kv_pool_tokens: int
    kv_policy: str
    speculation_modes: _containers.RepeatedScalarFieldContainer[str]
    speculation_default: str
    max_batch: int
    kv_cache_tokens: int
    running_requests: int
    waiting_requests: int
    prefill_keep_ratio: float
    prefill_threshold: int
    def __init__(self, model_name: _Optional[str] = ..., arch: _Optional[str] = ..., fingerprint: _Optional[str] = ..., context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., backend: _Optional[str] = ..., n_layer: _Optional[int] = ..., n_embd: _Optional[int] = ..., features: _Optional[_Iterable[str]] = ..., max_queued_requests: _Optional[int] = ..., version: _Optional[str] = ..., max_top_logprobs: _Optional[int] = ..., kv_pool_tokens: _Optional[int] = ..., kv_policy: _Optional[str] = ..., speculation_modes: _Optional[_Iterable[str]] = ..., speculation_default: _Optional[str] = ..., max_batch: _Optional[int] = ..., kv_cache_tokens: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., prefill_keep_ratio: _Optional[float] = ..., prefill_threshold: _Optional[int] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "state", "n_tokens", "host_bytes", "stored_bytes", "created_unix", "last_used_unix", "generating")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_FIELD_NUMBER: _ClassVar[int]
    GENERATING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    state: str
    n_tokens: int
    host_bytes: int
    stored_bytes: int
    created_unix: float
    last_used_unix: float
    generating: bool
    def __init__(self, session_id: _Optional[str] = ..., state: _Optional[str] = ..., n_tokens: _Optional[int] = ..., host_bytes: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., created_unix: _Optional[float] = ..., last_used_unix: _Optional[float] = ..., generating: _Optional[bool] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...

class DeleteSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("session_id", "upto_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    UPTO_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    upto_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., upto_tokens: _Optional[int] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("data", "total_bytes", "n_tokens")
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    total_bytes: int
    n_tokens: int
    def __init__(self, data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., n_tokens: _Optional[int] = ...) -> None: ...

class RestoreChunk(_message.Message):
    __slots__ = ("session_id", "data")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    data: bytes
    def __init__(self, session_id: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("session", "bytes")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    bytes: int
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ..., bytes: _Optional[int] = ...) -> None: ...
