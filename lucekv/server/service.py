"""The lucekv.v1.LuceKV servicer: requests → engine calls, engine output → response chunks, errors → codes."""

from __future__ import annotations

import asyncio
import logging
import queue
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from importlib import metadata

import grpc

from lucekv.engine.engine import Engine, Prompt
from lucekv.engine.sampling import MAX_TOP_LOGPROBS, SamplingParams
from lucekv.engine.sessions import SessionInfo
from lucekv.engine.types import GenerationDelta
from lucekv.errors import InvalidRequestError, NotFoundError, PreconditionError, ResourceLimitError
from lucekv.server.gen import lucekv_pb2 as pb
from lucekv.server.gen import lucekv_pb2_grpc
from lucekv.server.worker import EngineWorker, GenerationJob, ServerStoppingError
from lucekv.snapshot.blob import (
    Snapshot,
    SnapshotError,
    SnapshotMismatchError,
    blob_size,
    read_snapshot,
    write_snapshot,
)
from lucekv.snapshot.store import check_session_id

logger = logging.getLogger(__name__)

PIECE_BYTES = 1 << 20  # blobs stream in messages of about 1 MiB (gRPC's default message limit is 4 MiB)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["LuceKV"].full_name
FINISH_REASONS: Mapping[str, pb.FinishReason] = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "eos": pb.FINISH_REASON_EOS,
}


class LuceKVServicer(lucekv_pb2_grpc.LuceKVServicer):
    def __init__(self, worker: EngineWorker):
        self._worker = worker
        self._engine: Engine = worker.engine

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        async with _status_on_error(context, f"Generate {request_id}"):
            session_id = check_session_id(request.session_id) if request.session_id else ""
            params = sampling_params_from_proto(request.sampling)
            # Validation and tokenization happen here, before the queue: a bad request fails at once and costs
            # the engine thread nothing.
            pin = request.pin_prefix_tokens if request.HasField("pin_prefix_tokens") else None
            prompt_ids = await asyncio.to_thread(self._engine.prepare, prompt_from_request(request), params, pin)
            job = GenerationJob(prompt_ids, params, request_id, session_id, pin)
            self._worker.submit(job)
            try:
                async for delta in job.deltas():
                    yield response_from_delta(delta, request_id, job.queue_time_s)
                    if delta.usage:
                        _log_finished(request_id, delta, job.queue_time_s)
            finally:
                self._worker.cancel(job)  # a no-op once the job is done; else frees its place or stops it

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        async with _status_on_error(context, "Tokenize"):
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = await asyncio.to_thread(self._engine.tokenizer.encode, request.text, add_special)
            return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        async with _status_on_error(context, "Detokenize"):
            vocab_size = self._engine.info.vocab_size
            bad = [t for t in request.token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError("token_ids", f"ids {bad[:5]} are outside [0, {vocab_size})")
            text = await asyncio.to_thread(
                self._engine.tokenizer.decode, list(request.token_ids), request.skip_special_tokens
            )
            return pb.DetokenizeResponse(text=text)

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerInfo:
        async with _status_on_error(context, "GetServerInfo"):
            info = self._engine.info
            features = ["logprobs"] + (["chat_template"] if self._engine.tokenizer.chat_template else [])
            return pb.ServerInfo(
                model_name=info.model_name,
                arch=info.arch,
                fingerprint=info.fingerprint,
                context_length=info.n_ctx,
                vocab_size=info.vocab_size,
                backend=info.backend,
                n_layer=info.n_layer,
                n_embd=info.n_embd,
                features=features,
                max_queued_requests=self._worker.max_queued,
                version=_version(),
                max_top_logprobs=MAX_TOP_LOGPROBS,
                kv_pool_tokens=info.kv_pool_tokens,
                kv_policy=info.kv_policy,
            )


    # ---- sessions ---------------------------------------------------------------------------------

    async def GetSession(self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        async with _status_on_error(context, "GetSession"):
            return session_to_proto(self._engine.session_info(check_session_id(request.session_id)))

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListSessionsResponse:
        async with _status_on_error(context, "ListSessions"):
            return pb.ListSessionsResponse(sessions=[session_to_proto(i) for i in self._engine.sessions.infos()])

    async def DeleteSession(
        self, request: pb.DeleteSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteSessionResponse:
        async with _status_on_error(context, "DeleteSession"):
            session_id = check_session_id(request.session_id)
            self._engine.sessions.check_idle(session_id, "delete")
            await self._worker.call(lambda e: e.delete_session(session_id), f"DeleteSession {session_id}")
            return pb.DeleteSessionResponse()

    async def Snapshot(
        self, request: pb.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SnapshotChunk]:
        async with _status_on_error(context, "Snapshot"):
            session_id = check_session_id(request.session_id)
            upto = request.upto_tokens if request.HasField("upto_tokens") else None
            header, chunks = await self._worker.call(lambda e: e.snapshot(session_id, upto),
                                                     f"Snapshot {session_id}")
            pieces = write_snapshot(header, chunks.__getitem__, PIECE_BYTES)
            # hashing and copying a piece takes a few ms: off the event loop
            piece = await asyncio.to_thread(next, pieces, None)
            yield pb.SnapshotChunk(data=piece, total_bytes=blob_size(header), n_tokens=header.n_tokens)
            while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
                yield pb.SnapshotChunk(data=piece)

    async def Restore(
        self, requests: AsyncIterator[pb.RestoreChunk], context: grpc.aio.ServicerContext
    ) -> pb.RestoreResponse:
        async with _status_on_error(context, "Restore"):
            session_id, snap = await _receive_snapshot(requests, self._engine)
            session_id = check_session_id(session_id or snap.header.session_id)
            self._engine.sessions.check_idle(session_id, "restore over")
            info = await self._worker.call(lambda e: e.restore(snap, session_id), f"Restore {session_id}")
            return pb.RestoreResponse(session=session_to_proto(info), bytes=snap.nbytes)


async def _receive_snapshot(requests: AsyncIterator[pb.RestoreChunk], engine: Engine) -> tuple[str, Snapshot]:
    """The session id of the first chunk and the parsed blob. Parsing runs on a thread beside the stream, so a
    blob for another model is refused after its header, not after all of it."""
    pieces: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    parsing = asyncio.ensure_future(asyncio.to_thread(
        read_snapshot, iter(pieces.get, None), engine.layout, max_tokens=engine.n_ctx,
        vocab_size=engine.spec.vocab_size))
    session_id = None
    try:
        async for chunk in requests:
            if session_id is None:
                session_id = chunk.session_id
            pieces.put(chunk.data)
            if parsing.done():  # refused already: stop reading
                break
    finally:
        pieces.put(None)  # the end of the stream, also when the client went away mid-way
    return session_id or "", await parsing


def session_to_proto(info: SessionInfo) -> pb.SessionInfo:
    return pb.SessionInfo(
        session_id=info.session_id,
        state=info.state,
        n_tokens=info.n_tokens,
        host_bytes=info.host_bytes,
        stored_bytes=info.stored_bytes,
        created_unix=info.created_unix,
        last_used_unix=info.last_used_unix,
        generating=info.generating,
    )


def prompt_from_request(request: pb.GenerateRequest) -> Prompt:
    match request.WhichOneof("input"):
        case "text":
            return request.text
        case "token_ids":
            return list(request.token_ids.ids)
        case "messages":
            return [{"role": m.role, "content": m.content} for m in request.messages.messages]
        case _:
            raise InvalidRequestError("input", "set one of text, token_ids or messages")


def sampling_params_from_proto(message: pb.SamplingParams) -> SamplingParams:
    """Fields the client left unset keep SamplingParams' defaults; the proto uses the same field names."""
    values = {}
    for field in message.DESCRIPTOR.fields:
        if field.is_repeated:
            values[field.name] = list(getattr(message, field.name))
        elif message.HasField(field.name):
            values[field.name] = getattr(message, field.name)
    return SamplingParams(**values)


def response_from_delta(delta: GenerationDelta, request_id: str, queue_time_s: float) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=request_id, token_ids=delta.token_ids, text=delta.text)
    for lp in delta.logprobs or ():
        top = [pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
        response.logprobs.append(pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=top))
    if delta.finish_reason:
        response.finish_reason = FINISH_REASONS[delta.finish_reason]
    if delta.usage:
        u = delta.usage
        response.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens,
                cached_tokens=u.cached_tokens,
                completion_tokens=u.completion_tokens,
                time_to_first_token_ms=u.time_to_first_token_s * 1e3,
                decode_tokens_per_second=u.decode_tokens_per_s,
                queue_time_ms=queue_time_s * 1e3,
                kv_resident_chunks=u.kv_resident_chunks,
                kv_paged_chunks=u.kv_paged_chunks,
                kv_bytes_moved=u.kv_bytes_moved,
            )
        )
    return response


def _log_finished(request_id: str, last: GenerationDelta, queue_time_s: float) -> None:
    u = last.usage
    logger.info(
        "request %s: %s; %d prompt + %d completion tokens; queued %.0f ms, first token %.0f ms, %.1f tok/s",
        request_id,
        last.finish_reason,
        u.prompt_tokens,
        u.completion_tokens,
        queue_time_s * 1e3,
        u.time_to_first_token_s * 1e3,
        u.decode_tokens_per_s,
    )


@asynccontextmanager
async def _status_on_error(context: grpc.aio.ServicerContext, call: str) -> AsyncIterator[None]:
    """Turn lucekv's errors into status codes; anything unexpected is logged and answered INTERNAL."""
    try:
        yield
    except (PreconditionError, SnapshotMismatchError) as e:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
    except (InvalidRequestError, SnapshotError) as e:  # includes ContextOverflowError, malformed blobs
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except NotFoundError as e:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
    except ResourceLimitError as e:  # includes QueueFullError
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    except ServerStoppingError as e:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    except grpc.aio.AbortError:
        raise
    except Exception as e:
        logger.exception("%s failed", call)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")


def _version() -> str:
    try:
        return metadata.version("lucekv")
    except metadata.PackageNotFoundError:
        return "unknown"
