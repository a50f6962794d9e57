"""The lucekv.v1.LuceKV servicer: requests → engine calls, engine output → response chunks, errors → codes."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from importlib import metadata

import grpc

from lucekv.engine.engine import Engine, Prompt
from lucekv.engine.sampling import MAX_TOP_LOGPROBS, SamplingParams
from lucekv.engine.types import GenerationDelta
from lucekv.errors import InvalidRequestError
from lucekv.server.gen import lucekv_pb2 as pb
from lucekv.server.gen import lucekv_pb2_grpc
from lucekv.server.worker import EngineWorker, GenerationJob, QueueFullError, ServerStoppingError

logger = logging.getLogger(__name__)

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
            if request.session_id:
                await context.abort(
                    grpc.StatusCode.UNIMPLEMENTED, "session_id: sessions are not implemented yet"
                )
            params = sampling_params_from_proto(request.sampling)
            # Validation and tokenization happen here, before the queue: a bad request fails at once and costs
            # the engine thread nothing.
            prompt_ids = await asyncio.to_thread(self._engine.prepare, prompt_from_request(request), params)
            job = GenerationJob(prompt_ids, params, request_id)
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
    except InvalidRequestError as e:  # includes ContextOverflowError
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except QueueFullError as e:
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
