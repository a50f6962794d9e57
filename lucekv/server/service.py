"""The lucekv.v1.LuceKV servicer: requests → engine calls, engine output → response chunks, errors → codes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import time
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
from lucekv.server.auth import Authenticator, StreamLimit, scoped, unscoped
from lucekv.server.config import ServeConfig
from lucekv.server.gen import lucekv_pb2 as pb
from lucekv.server.gen import lucekv_pb2_grpc
from lucekv.server.leases import is_shared, take_lease
from lucekv.server.metrics import Metrics
from lucekv.server.worker import EngineWorker, GenerationJob, ServerStoppingError
from lucekv.snapshot.blob import (
    Snapshot,
    SnapshotError,
    SnapshotMismatchError,
    blob_size,
    read_snapshot,
    write_snapshot,
)
from lucekv.snapshot.redis_store import StoreError
from lucekv.snapshot.store import check_session_id

logger = logging.getLogger(__name__)

PIECE_BYTES = 1 << 20  # blobs stream in messages of about 1 MiB (gRPC's default message limit is 4 MiB)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["LuceKV"].full_name
FINISH_REASONS: Mapping[str, pb.FinishReason] = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "eos": pb.FINISH_REASON_EOS,
}
SPECULATION_MODES: Mapping[int, str | None] = {
    pb.SPECULATION_MODE_UNSPECIFIED: None,  # the server's default
    pb.SPECULATION_MODE_OFF: "off",
    pb.SPECULATION_MODE_AUTO: "auto",
    pb.SPECULATION_MODE_SUFFIX: "suffix",
    pb.SPECULATION_MODE_DRAFT: "draft",
    pb.SPECULATION_MODE_DFLASH: "dflash",
    pb.SPECULATION_MODE_SUFFIX_TREE: "suffix-tree",
    pb.SPECULATION_MODE_DFLASH_TREE: "dflash-tree",
}


class LuceKVServicer(lucekv_pb2_grpc.LuceKVServicer):
    """Every call runs in `_rpc`: its principal (auth.py), its status code from lucekv's errors, its metrics and
    its log line. Session ids from the client are the principal's (`scoped`); the engine sees its own ids."""

    def __init__(self, worker: EngineWorker, config: ServeConfig, auth: Authenticator, metrics: Metrics):
        self._worker = worker
        self._engine: Engine = worker.engine
        self._config = config
        self._auth = auth
        self._metrics = metrics
        self._streams = StreamLimit(config.max_streams)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        async with self._rpc(context, "Generate", request_id) as principal:
            with self._streams.hold(principal):
                session_id = scoped(principal, request.session_id) if request.session_id else ""
                params = sampling_params_from_proto(request.sampling)
                # Validation and tokenization happen here, before the queue: a bad request fails at once and costs
                # the engine thread nothing.
                pin = request.pin_prefix_tokens if request.HasField("pin_prefix_tokens") else None
                speculation = speculation_from_proto(request.speculation)
                keep = request.prefill_keep_ratio if request.HasField("prefill_keep_ratio") else None
                prompt_ids = await asyncio.to_thread(self._engine.prepare, prompt_from_request(request), params, pin,
                                                     speculation, keep)
                limit = self._config.max_prompt_tokens
                if limit and len(prompt_ids) > limit:
                    raise InvalidRequestError("prompt", f"{len(prompt_ids)} tokens, more than the server's limit of "
                                                        f"{limit} (--max-prompt-tokens)")
                lease = await take_lease(self._engine.store, session_id) if session_id else None
                job = GenerationJob(prompt_ids, params, request_id, session_id, pin, lease, speculation, keep)
                self._worker.submit_or_release(job)
                try:
                    async for delta in job.deltas():
                        if delta.usage:
                            self._metrics.observe_generation(delta.usage)
                            _log_finished(request_id, delta)
                        yield response_from_delta(delta, request_id)
                finally:
                    self._worker.cancel(job)  # a no-op once the job is done; else frees its place or stops it

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        async with self._rpc(context, "Tokenize"):
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = await asyncio.to_thread(self._engine.tokenizer.encode, request.text, add_special)
            return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        async with self._rpc(context, "Detokenize"):
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
        async with self._rpc(context, "GetServerInfo"):
            info = self._engine.info
            features = ["logprobs"] + (["chat_template"] if self._engine.tokenizer.chat_template else []) \
                + (["prefill_compression"] if info.prefill_compression else [])
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
                speculation_modes=info.spec_modes,
                speculation_default=info.spec_default,
                max_batch=info.max_batch,
                kv_cache_tokens=info.kv_cache_tokens,
                running_requests=len(self._engine.scheduler.running),
                waiting_requests=len(self._engine.scheduler.waiting),
                prefill_keep_ratio=info.prefill_keep_ratio,
                prefill_threshold=info.prefill_threshold,
            )


    # ---- sessions ---------------------------------------------------------------------------------

    async def GetSession(self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        async with self._rpc(context, "GetSession") as principal:
            session_id = scoped(principal, request.session_id)
            s = self._engine.sessions.get(session_id)
            info = self._engine.sessions.info(s) if s is not None else self._stored_elsewhere(session_id)
            if info is None:
                raise NotFoundError(f"session {request.session_id!r} does not exist")
            return session_to_proto(info, request.session_id)

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListSessionsResponse:
        async with self._rpc(context, "ListSessions") as principal:
            infos = {i.session_id: i for i in self._engine.sessions.infos()}
            if is_shared(self._engine.store):  # and the sessions other replicas wrote
                for key in set(self._engine.store.keys()) - set(infos):
                    if (info := self._stored_elsewhere(key)) is not None:
                        infos[key] = info
            mine = ((infos[key], unscoped(principal, key)) for key in sorted(infos))
            return pb.ListSessionsResponse(sessions=[session_to_proto(i, name) for i, name in mine if name])

    async def DeleteSession(
        self, request: pb.DeleteSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteSessionResponse:
        async with self._rpc(context, "DeleteSession") as principal:
            session_id = scoped(principal, request.session_id)
            self._engine.sessions.check_idle(session_id, "delete")
            lease = await take_lease(self._engine.store, session_id)
            await self._worker.call(lambda e: e.delete_session(session_id), f"DeleteSession {session_id}", lease)
            return pb.DeleteSessionResponse()

    async def Snapshot(
        self, request: pb.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SnapshotChunk]:
        async with self._rpc(context, "Snapshot") as principal:
            with self._streams.hold(principal):
                session_id = scoped(principal, request.session_id)
                upto = request.upto_tokens if request.HasField("upto_tokens") else None
                lease = await take_lease(self._engine.store, session_id)
                header, chunks = await self._worker.call(lambda e: e.snapshot(session_id, upto),
                                                         f"Snapshot {session_id}", lease)
                # the blob names the session as its owner knows it
                header = dataclasses.replace(header, session_id=request.session_id)
                pieces = write_snapshot(header, chunks.__getitem__, PIECE_BYTES)
                # hashing and copying a piece takes a few ms: off the event loop
                piece = await asyncio.to_thread(next, pieces, None)
                yield pb.SnapshotChunk(data=piece, total_bytes=blob_size(header), n_tokens=header.n_tokens)
                self._metrics.snapshot_bytes.labels("out").inc(len(piece))
                while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
                    yield pb.SnapshotChunk(data=piece)
                    self._metrics.snapshot_bytes.labels("out").inc(len(piece))

    async def Restore(
        self, requests: AsyncIterator[pb.RestoreChunk], context: grpc.aio.ServicerContext
    ) -> pb.RestoreResponse:
        async with self._rpc(context, "Restore") as principal:
            with self._streams.hold(principal):
                name, snap = await _receive_snapshot(requests, self._engine, self._config.max_blob_bytes)
                self._metrics.snapshot_bytes.labels("in").inc(snap.nbytes)
                name = check_session_id(name or snap.header.session_id)
                session_id = scoped(principal, name)
                self._engine.sessions.check_idle(session_id, "restore over")
                lease = await take_lease(self._engine.store, session_id)
                info = await self._worker.call(lambda e: e.restore(snap, session_id), f"Restore {session_id}",
                                               lease)
                return pb.RestoreResponse(session=session_to_proto(info, name), bytes=snap.nbytes)

    def _stored_elsewhere(self, session_id: str) -> SessionInfo | None:
        """A session this server does not hold that the store replicas share has (None if it has not)."""
        store = self._engine.store
        if not is_shared(store):
            return None
        try:
            return SessionInfo(session_id, "stored", -1, 0, store.size(session_id), 0.0, 0.0, False)
        except KeyError:  # absent, or expired or deleted since it was listed
            return None

    @asynccontextmanager
    async def _rpc(self, context: grpc.aio.ServicerContext, rpc: str, request_id: str = "") -> AsyncIterator[str]:
        """Yields the caller's principal. Turns lucekv's errors into status codes (anything unexpected is logged
        and answered INTERNAL), counts the call by status and logs it with its request id."""
        principal = self._auth.principal(context.invocation_metadata()) or ""
        request_id = request_id or uuid.uuid4().hex
        code = grpc.StatusCode.OK
        started = time.perf_counter()
        try:
            yield principal
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            code, message = _status_of(e)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("%s %s failed", rpc, request_id)
            await context.abort(code, message)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self._metrics.requests.labels(rpc, code.name).inc()
            logger.info("%s request_id=%s principal=%s %s %.3f s", rpc, request_id, principal or "-", code.name,
                        time.perf_counter() - started)


def _status_of(e: Exception) -> tuple[grpc.StatusCode, str]:
    match e:
        case PreconditionError() | SnapshotMismatchError():
            return grpc.StatusCode.FAILED_PRECONDITION, str(e)
        case InvalidRequestError() | SnapshotError():  # includes ContextOverflowError, malformed blobs
            return grpc.StatusCode.INVALID_ARGUMENT, str(e)
        case NotFoundError():
            return grpc.StatusCode.NOT_FOUND, str(e)
        case ResourceLimitError():  # includes QueueFullError
            return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
        case ServerStoppingError() | StoreError():
            return grpc.StatusCode.UNAVAILABLE, str(e)
        case _:
            return grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"


async def _receive_snapshot(requests: AsyncIterator[pb.RestoreChunk], engine: Engine,
                            max_bytes: int = 0) -> tuple[str, Snapshot]:
    """The session id of the first chunk and the parsed blob. Parsing runs on a thread beside the stream, so a
    blob for another model is refused after its header, not after all of it. More than `max_bytes` (0: no limit)
    is refused with ResourceLimitError as soon as it arrives."""
    pieces: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    parsing = asyncio.ensure_future(asyncio.to_thread(
        read_snapshot, iter(pieces.get, None), engine.layout, max_tokens=engine.n_ctx,
        vocab_size=engine.spec.vocab_size))
    session_id = None
    received = 0
    try:
        async for chunk in requests:
            if session_id is None:
                session_id = chunk.session_id
            received += len(chunk.data)
            if max_bytes and received > max_bytes:
                raise ResourceLimitError(f"the blob is larger than the server's limit of {max_bytes} bytes "
                                         "(--max-blob-bytes)")
            pieces.put(chunk.data)
            if parsing.done():  # refused already: stop reading
                break
    except BaseException:
        parsing.add_done_callback(lambda f: f.cancelled() or f.exception())  # its error is not the one to report
        raise
    finally:
        pieces.put(None)  # the end of the stream, also when the client went away mid-way
    return session_id or "", await parsing


def session_to_proto(info: SessionInfo, session_id: str) -> pb.SessionInfo:
    """`session_id`: the session's name as the caller knows it."""
    return pb.SessionInfo(
        session_id=session_id,
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


def speculation_from_proto(mode: int) -> str | None:
    if mode not in SPECULATION_MODES:
        raise InvalidRequestError("speculation", f"unknown mode {mode}")
    return SPECULATION_MODES[mode]


def sampling_params_from_proto(message: pb.SamplingParams) -> SamplingParams:
    """Fields the client left unset keep SamplingParams' defaults; the proto uses the same field names."""
    values = {}
    for field in message.DESCRIPTOR.fields:
        if field.is_repeated:
            values[field.name] = list(getattr(message, field.name))
        elif message.HasField(field.name):
            values[field.name] = getattr(message, field.name)
    return SamplingParams(**values)


def response_from_delta(delta: GenerationDelta, request_id: str) -> pb.GenerateResponse:
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
                queue_time_ms=u.queue_time_s * 1e3,
                batch_size=u.batch_size,
                kv_resident_chunks=u.kv_resident_chunks,
                kv_paged_chunks=u.kv_paged_chunks,
                kv_bytes_moved=u.kv_bytes_moved,
                prefilled_tokens=u.prefilled_tokens,
            )
        )
        if c := u.compression:
            response.usage.compression.CopyFrom(pb.PrefillCompression(
                keep_ratio=c.keep_ratio, scored_tokens=c.scored_tokens, kept_tokens=c.kept_tokens,
                score_ms=c.score_s * 1e3))
        if s := u.speculation:
            response.usage.speculation.CopyFrom(pb.SpeculationUsage(
                mode=s.mode, drafter=s.drafter, rounds=s.rounds, drafted_tokens=s.drafted, accepted_tokens=s.accepted,
                plain_steps=s.plain_steps,
                gate_decisions=[pb.GateDecision(at_token=at, speculating=on) for at, on in s.gate_decisions]))
    return response


def _log_finished(request_id: str, last: GenerationDelta) -> None:
    u = last.usage
    logger.info(
        "request %s: %s; %d prompt + %d completion tokens; queued %.0f ms, first token %.0f ms, %.1f tok/s, "
        "batch %.1f",
        request_id,
        last.finish_reason,
        u.prompt_tokens,
        u.completion_tokens,
        u.queue_time_s * 1e3,
        u.time_to_first_token_s * 1e3,
        u.decode_tokens_per_s,
        u.batch_size,
    )


def _version() -> str:
    try:
        return metadata.version("lucekv")
    except metadata.PackageNotFoundError:
        return "unknown"
