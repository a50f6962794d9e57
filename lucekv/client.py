"""A small typed client for the lucekv gRPC service (the CLI uses it; clients/python/ shows examples).

    with Client("127.0.0.1:50051") as client:
        for chunk in client.generate("Once upon a time", SamplingOptions(max_tokens=32, seed=1)):
            print(chunk.text, end="", flush=True)

Sessions keep a conversation's K/V on the server between turns; snapshots move them between servers:

        client.complete(history_ids, SamplingOptions(max_tokens=32), session_id="chat-1")
        blob = b"".join(client.snapshot("chat-1"))
        other.restore([blob], session_id="chat-1")

Failed calls raise grpc.RpcError; `.code()` and `.details()` say what went wrong (the details name the bad
field for INVALID_ARGUMENT).

A server with `--auth-tokens` wants `token=`; one with TLS wants `tls=TlsOptions(ca=PEM)` (and for mTLS the
client's certificate and key). Calls on a session carry metadata `lucekv-session-id`, which a proxy in front of
several replicas hashes to send a conversation's turns to one replica (deploy/).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields

import grpc

from lucekv.server.gen import lucekv_pb2 as pb
from lucekv.server.gen import lucekv_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
SESSION_METADATA = "lucekv-session-id"
FINISH_REASON_NAMES = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_EOS: "eos",
}

# Text, token ids, or chat messages ({"role": ..., "content": ...}).
Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]


@dataclass
class SamplingOptions:
    """Sampling fields of GenerateRequest; None leaves a field unset so the server's default applies."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def to_proto(self) -> pb.SamplingParams:
        return pb.SamplingParams(
            **{f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}
        )


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "eos"
    usage: pb.Usage
    logprobs: list[pb.TokenLogprob]  # empty unless requested
    request_id: str


class GenerateStream:
    """The chunks of one Generate call; `cancel()` stops the generation on the server."""

    def __init__(self, call: grpc.Call):
        self._call = call

    def __iter__(self) -> Iterator[pb.GenerateResponse]:
        return iter(self._call)

    def cancel(self) -> None:
        self._call.cancel()


@dataclass(frozen=True)
class TlsOptions:
    """PEM bytes: the CA that signed the server's certificate (None: the system's roots), and for mTLS the
    client's certificate chain and key."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None


class Client:
    def __init__(self, address: str = DEFAULT_ADDRESS, *, token: str | None = None, tls: TlsOptions | None = None):
        if tls is None:
            self._channel = grpc.insecure_channel(address)
        else:
            credentials = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
            self._channel = grpc.secure_channel(address, credentials)
        self._stub = lucekv_pb2_grpc.LuceKVStub(self._channel)
        self._auth = (("authorization", f"Bearer {token}"),) if token else ()

    def _metadata(self, session_id: str = "") -> tuple[tuple[str, str], ...]:
        return self._auth + (((SESSION_METADATA, session_id),) if session_id else ())

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(
        self,
        prompt: Prompt,
        sampling: SamplingOptions | None = None,
        *,
        request_id: str = "",
        session_id: str = "",
        pin_prefix_tokens: int | None = None,
        speculation: str | None = None,
        prefill_keep_ratio: float | None = None,
        timeout: float | None = None,
    ) -> GenerateStream:
        """speculation: "off", "auto", "suffix", "suffix-tree", "draft", "dflash" or "dflash-tree" (None: the server's
        default). prefill_keep_ratio: a long prompt's compression (PFlash; 1: none; None: the server's default)."""
        request = generate_request(prompt, sampling or SamplingOptions(), request_id, session_id)
        if pin_prefix_tokens is not None:
            request.pin_prefix_tokens = pin_prefix_tokens
        if prefill_keep_ratio is not None:
            request.prefill_keep_ratio = prefill_keep_ratio
        if speculation is not None:
            request.speculation = pb.SpeculationMode.Value(f"SPECULATION_MODE_{speculation.upper().replace('-', '_')}")
        return GenerateStream(self._stub.Generate(request, timeout=timeout, metadata=self._metadata(session_id)))

    def complete(
        self,
        prompt: Prompt,
        sampling: SamplingOptions | None = None,
        *,
        request_id: str = "",
        session_id: str = "",
        speculation: str | None = None,
        prefill_keep_ratio: float | None = None,
        timeout: float | None = None,
    ) -> Completion:
        """Generate and collect the whole completion."""
        text, token_ids, logprobs = [], [], []
        for chunk in self.generate(prompt, sampling, request_id=request_id, session_id=session_id,
                                   speculation=speculation, prefill_keep_ratio=prefill_keep_ratio, timeout=timeout):
            text.append(chunk.text)
            token_ids.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
        return Completion(
            "".join(text),
            token_ids,
            FINISH_REASON_NAMES[chunk.finish_reason],
            chunk.usage,
            logprobs,
            chunk.request_id,
        )

    def tokenize(self, text: str, add_special_tokens: bool = True, timeout: float | None = None) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self._stub.Tokenize(request, timeout=timeout, metadata=self._metadata()).token_ids)

    def detokenize(
        self, token_ids: Sequence[int], skip_special_tokens: bool = False, timeout: float | None = None
    ) -> str:
        request = pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return self._stub.Detokenize(request, timeout=timeout, metadata=self._metadata()).text

    def server_info(self, timeout: float | None = None) -> pb.ServerInfo:
        return self._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout, metadata=self._metadata())

    # ---- sessions -------------------------------------------------------------------------------

    def get_session(self, session_id: str, timeout: float | None = None) -> pb.SessionInfo:
        return self._stub.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=timeout,
                                     metadata=self._metadata(session_id))

    def list_sessions(self, timeout: float | None = None) -> list[pb.SessionInfo]:
        return list(self._stub.ListSessions(pb.ListSessionsRequest(), timeout=timeout,
                                            metadata=self._metadata()).sessions)

    def delete_session(self, session_id: str, timeout: float | None = None) -> None:
        self._stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id), timeout=timeout,
                                 metadata=self._metadata(session_id))

    def snapshot(self, session_id: str, upto_tokens: int | None = None,
                 timeout: float | None = None) -> Iterator[bytes]:
        """The session's blob, piece by piece (about 1 MiB each); concatenated they are the blob."""
        request = pb.SnapshotRequest(session_id=session_id, upto_tokens=upto_tokens)
        return (chunk.data for chunk in self._stub.Snapshot(request, timeout=timeout,
                                                            metadata=self._metadata(session_id)))

    def restore(self, pieces: Iterable[bytes], session_id: str = "",
                timeout: float | None = None) -> pb.RestoreResponse:
        """Upload a blob (pieces of at most a few MiB) as `session_id` (default: the id recorded in the blob)."""

        def chunks() -> Iterator[pb.RestoreChunk]:
            first = True
            for piece in pieces:
                yield pb.RestoreChunk(session_id=session_id if first else "", data=piece)
                first = False

        return self._stub.Restore(chunks(), timeout=timeout, metadata=self._metadata(session_id))


def generate_request(prompt: Prompt, sampling: SamplingOptions, request_id: str = "",
                     session_id: str = "") -> pb.GenerateRequest:
    request = pb.GenerateRequest(sampling=sampling.to_proto(), request_id=request_id, session_id=session_id)
    if isinstance(prompt, str):
        request.text = prompt
    elif all(isinstance(item, Mapping) for item in prompt) and prompt:
        request.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    else:
        request.token_ids.SetInParent()  # selects token_ids even when the list is empty
        request.token_ids.ids.extend(prompt)
    return request
