"""The gRPC service against a real server on an ephemeral port and a second engine computing the truth."""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from server_harness import ProbeEngine, ServerThread

import lucekv
from lucekv.client import Client, SamplingOptions, generate_request
from lucekv.engine.engine import Engine
from lucekv.engine.sampling import SamplingParams
from lucekv.model.synth import write_synthetic_gguf
from lucekv.server.gen import lucekv_pb2 as pb
from lucekv.server.gen import lucekv_pb2_grpc
from lucekv.server.service import SERVICE_NAME, sampling_params_from_proto

PROMPT = "The quick brown fox"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, how are you today?"}]
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0.0}  # 8 s on the slow probe unless stopped


def direct(engine: Engine, prompt, **params) -> tuple[str, list[int], str]:
    deltas = list(engine.generate(prompt, SamplingParams(**params)))
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], deltas[-1].finish_reason


@pytest.fixture
def client(server: ServerThread):
    with Client(server.address) as c:
        yield c


@pytest.fixture
def slow_server(slow_probe: ProbeEngine):
    running = ServerThread(slow_probe, max_queued=1)
    yield running
    running.stop()


# --- output equals the engine's own -----------------------------------------------------------------------

SAMPLING_CASES = {
    "greedy": {"temperature": 0.0, "max_tokens": 24},
    "seeded sampling with every knob": {
        "temperature": 0.8,
        "top_k": 50,
        "top_p": 0.9,
        "min_p": 0.02,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.3,
        "frequency_penalty": 0.2,
        "seed": 1234,
        "max_tokens": 24,
    },
    "min_tokens and stop token ids": {
        "temperature": 1.0,
        "seed": 7,
        "max_tokens": 24,
        "min_tokens": 4,
        "stop_token_ids": [5, 17, 40, 99],
    },
}


@pytest.mark.parametrize("params", SAMPLING_CASES.values(), ids=SAMPLING_CASES.keys())
@pytest.mark.parametrize("prompt", [PROMPT, [1, 20, 30, 40, 50], CHAT], ids=["text", "token_ids", "chat"])
def test_streamed_output_equals_direct_engine_output(client, reference_engine, prompt, params):
    text, ids, finish = direct(reference_engine, prompt, **params)
    got = client.complete(prompt, SamplingOptions(**params))
    assert (got.text, got.token_ids, got.finish_reason) == (text, ids, finish)
    assert got.usage.completion_tokens == len(ids)
    assert got.usage.prompt_tokens == len(reference_engine.prepare(prompt, SamplingParams(**params)))


def test_stop_string_cuts_text_like_the_engine(client, reference_engine):
    full, _, _ = direct(reference_engine, PROMPT, temperature=0.0, max_tokens=24)
    stop = full[8:11]  # a piece that certainly occurs
    text, ids, finish = direct(reference_engine, PROMPT, temperature=0.0, max_tokens=24, stop=[stop])
    got = client.complete(PROMPT, SamplingOptions(temperature=0.0, max_tokens=24, stop=[stop]))
    assert (got.text, got.token_ids, got.finish_reason) == (text, ids, "stop")
    assert stop not in got.text and full.startswith(got.text)


def test_logprobs_match_the_engine(client, reference_engine):
    params = {"temperature": 0.7, "seed": 3, "max_tokens": 8, "logprobs": True, "top_logprobs": 5}
    expected = [lp for d in reference_engine.generate(PROMPT, SamplingParams(**params)) for lp in d.logprobs]
    got = client.complete(PROMPT, SamplingOptions(**params)).logprobs
    assert [lp.token_id for lp in got] == [lp.token_id for lp in expected]
    for mine, ref in zip(got, expected, strict=True):
        assert mine.logprob == pytest.approx(ref.logprob, rel=1e-6, abs=1e-6)
        assert [(t.token_id, pytest.approx(t.logprob, rel=1e-6, abs=1e-6)) for t in mine.top] == ref.top
        assert len(mine.top) == 5


def test_every_chunk_carries_the_request_id_and_only_the_last_a_finish_reason(client):
    chunks = list(
        client.generate(PROMPT, SamplingOptions(max_tokens=6, temperature=0.0), request_id="req-42")
    )
    assert [c.request_id for c in chunks] == ["req-42"] * len(chunks)
    assert [c.finish_reason for c in chunks[:-1]] == [pb.FINISH_REASON_UNSPECIFIED] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert [c.HasField("usage") for c in chunks] == [False] * (len(chunks) - 1) + [True]
    usage = chunks[-1].usage
    assert (
        usage.time_to_first_token_ms > 0 and usage.decode_tokens_per_second > 0 and usage.queue_time_ms >= 0
    )
    anonymous = list(client.generate(PROMPT, SamplingOptions(max_tokens=2, ignore_eos=True)))
    assert len(anonymous[0].request_id) == 32 and anonymous[0].request_id == anonymous[-1].request_id


def test_32_concurrent_generates_all_complete_correctly(server, reference_engine):
    # Prompts sharing their first words: each engine reuses earlier requests' prompt K/V after a history of its own
    # (the reference one request after another, the server's 32 at once), and a seeded sample must not tell them
    # apart (issue 25: request 13 flipped at its 6th token while reused rows were not bit for bit a fresh prefill's).
    requests = [(f"{PROMPT} {i}", {"temperature": 0.9, "seed": i, "max_tokens": 12}) for i in range(32)]
    expected = [direct(reference_engine, prompt, **params) for prompt, params in requests]

    def call(request):
        prompt, params = request
        with Client(server.address) as c:
            got = c.complete(prompt, SamplingOptions(**params), timeout=60)
        return got.text, got.token_ids, got.finish_reason

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(call, requests))
    assert results == expected


# --- tokenizer and info -----------------------------------------------------------------------------------


def test_tokenize_and_detokenize_use_the_model_tokenizer(client, reference_engine):
    tok = reference_engine.tokenizer
    assert client.tokenize(PROMPT) == tok.encode(PROMPT)
    assert client.tokenize(PROMPT, add_special_tokens=False) == tok.encode(PROMPT, add_special=False)
    ids = tok.encode(PROMPT)
    assert client.detokenize(ids) == tok.decode(ids)
    assert client.detokenize(ids, skip_special_tokens=True) == tok.decode(ids, skip_special=True) == PROMPT


def test_server_info_describes_the_engine(client, reference_engine):
    info, want = client.server_info(), reference_engine.info
    assert (
        info.model_name,
        info.arch,
        info.fingerprint,
        info.context_length,
        info.vocab_size,
        info.n_layer,
        info.n_embd,
    ) == (
        want.model_name,
        want.arch,
        want.fingerprint,
        want.n_ctx,
        want.vocab_size,
        want.n_layer,
        want.n_embd,
    )
    assert info.backend == want.backend
    assert set(info.features) == {"logprobs", "chat_template"}
    assert info.max_queued_requests == 64 and info.max_top_logprobs == 20


def test_sampling_fields_map_by_name_and_unset_ones_take_the_engine_defaults():
    assert {f.name for f in pb.SamplingParams.DESCRIPTOR.fields} <= {f.name for f in fields(SamplingParams)}
    assert sampling_params_from_proto(pb.SamplingParams()) == SamplingParams()
    message = pb.SamplingParams(temperature=0.0, top_k=0, seed=2**64 - 1, stop=["x"], stop_token_ids=[3])
    expected = SamplingParams(temperature=0.0, seed=2**64 - 1, stop=["x"], stop_token_ids=[3])
    assert sampling_params_from_proto(message) == expected


# --- bad requests -----------------------------------------------------------------------------------------


def _req(prompt=PROMPT, **sampling) -> pb.GenerateRequest:
    stop = sampling.pop("stop", [])
    return generate_request(prompt, SamplingOptions(stop=stop, **sampling))


INVALID = grpc.StatusCode.INVALID_ARGUMENT
BAD_GENERATE_REQUESTS = [  # (case, request, expected code, text the status message must contain)
    ("no input", pb.GenerateRequest(), INVALID, "input: set one of text, token_ids or messages"),
    ("empty text", _req(""), INVALID, "prompt: is empty"),
    ("empty token ids", _req([]), INVALID, "prompt: is empty"),
    ("token id beyond the vocabulary", _req([1, 2, 100_000]), INVALID, "token_ids: ids [100000] are outside"),
    ("negative token id", _req([-3]), INVALID, "token_ids: ids [-3] are outside"),
    ("chat message without role", _req([{"role": "", "content": "hi"}]), INVALID, "messages[0].role: must"),
    ("negative temperature", _req(temperature=-0.5), INVALID, "temperature: must be in [0, 100]"),
    ("NaN temperature", _req(temperature=math.nan), INVALID, "temperature: must be a finite number"),
    ("top_p zero", _req(top_p=0.0), INVALID, "top_p: must be in (0, 1]"),
    ("negative top_k", _req(top_k=-1), INVALID, "top_k: must be >= 0"),
    ("min_p above one", _req(min_p=1.5), INVALID, "min_p: must be in [0, 1]"),
    ("repetition_penalty zero", _req(repetition_penalty=0.0), INVALID, "repetition_penalty: must be in"),
    ("presence_penalty too big", _req(presence_penalty=2.5), INVALID, "presence_penalty: must be in [-2, 2]"),
    ("frequency_penalty too small", _req(frequency_penalty=-3.0), INVALID, "frequency_penalty: must be in"),
    ("max_tokens zero", _req(max_tokens=0), INVALID, "max_tokens: must be >= 1"),
    ("min_tokens above max_tokens", _req(max_tokens=4, min_tokens=5), INVALID, "min_tokens: must be in"),
    ("empty stop string", _req(stop=[""]), INVALID, "stop: stop strings must be non-empty"),
    ("stop token id beyond the vocabulary", _req(stop_token_ids=[999]), INVALID, "stop_token_ids: ids must"),
    ("too many top_logprobs", _req(logprobs=True, top_logprobs=21), INVALID, "top_logprobs: must be in"),
    ("max_tokens beyond the context", _req(max_tokens=600), INVALID,
     "+ max_tokens (600) exceeds the context of 512 tokens"),
    ("prompt beyond the context", _req("fox " * 600, max_tokens=1), INVALID, "exceeds the context of 512"),
    ("session_id with a path", pb.GenerateRequest(text=PROMPT, session_id="../etc"), INVALID, "session_id: "),
    ("session_id too long", pb.GenerateRequest(text=PROMPT, session_id="s" * 129), INVALID, "session_id: "),
    ("keep ratio above one", pb.GenerateRequest(text=PROMPT, prefill_keep_ratio=1.5), INVALID,
     "prefill_keep_ratio: a keep ratio must be in (0, 1]"),
    ("compression the server lacks", pb.GenerateRequest(text=PROMPT, prefill_keep_ratio=0.5), INVALID,
     "prefill_keep_ratio: prompt compression is not available"),
]


@pytest.mark.parametrize(("request_", "code", "message"), [case[1:] for case in BAD_GENERATE_REQUESTS],
                         ids=[case[0] for case in BAD_GENERATE_REQUESTS])
def test_bad_generate_request_is_refused_before_any_compute(server, probe, request_, code, message):
    stub = lucekv_pb2_grpc.LuceKVStub(grpc.insecure_channel(server.address))
    calls = probe.calls
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(request_, timeout=10))
    assert (refused.value.code(), message in refused.value.details()) == (code, True), refused.value.details()
    assert probe.calls == calls  # the engine never started a generation


def test_detokenize_refuses_ids_outside_the_vocabulary(client, reference_engine):
    vocab = reference_engine.info.vocab_size
    with pytest.raises(grpc.RpcError) as refused:
        client.detokenize([1, vocab, 5])
    assert refused.value.code() == INVALID
    assert refused.value.details() == f"token_ids: ids [{vocab}] are outside [0, {vocab})"


# --- queueing, cancellation, deadlines, health -----------------------------------------------------------


def _start_long_generation(client: Client, probe: ProbeEngine):
    stream = client.generate(PROMPT, SamplingOptions(**LONG))
    chunks = iter(stream)
    first = [next(chunks) for _ in range(3)]
    assert not probe.closed.is_set()
    return stream, chunks, first


def test_cancel_after_three_tokens_stops_the_generation_and_frees_its_place(slow_server, slow_probe):
    with Client(slow_server.address) as c:
        stream, _, first = _start_long_generation(c, slow_probe)
        assert [len(ch.token_ids) for ch in first] == [1, 1, 1]
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(
                c.complete, PROMPT, SamplingOptions(max_tokens=3, temperature=0.0), timeout=30
            )
            time.sleep(0.1)  # queued behind the long generation (which goes on meanwhile)
            started = time.perf_counter()
            steps_before = slow_probe.steps
            stream.cancel()
            assert slow_probe.closed.wait(timeout=2.0)
            # the step under way and at most one more (read once it ended: the waiting call resets `steps`)
            assert slow_probe.steps_at_close <= steps_before + 2
            assert waiting.result().finish_reason == "length"
        assert time.perf_counter() - started < 4.0  # not the 8 s the long generation would have taken
        assert c.complete(PROMPT, SamplingOptions(max_tokens=2, ignore_eos=True)).usage.completion_tokens == 2


def test_full_queue_answers_resource_exhausted_and_a_cancelled_waiter_frees_its_place(
    slow_server, slow_probe
):
    with Client(slow_server.address) as c:
        running, _, _ = _start_long_generation(c, slow_probe)
        waiter = c.generate(PROMPT, SamplingOptions(max_tokens=2, ignore_eos=True))  # takes the only place in the queue
        waiter_chunks = iter(waiter)
        time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as refused:
            c.complete(PROMPT, SamplingOptions(max_tokens=2, ignore_eos=True), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "all 1 places in the request queue are taken" in refused.value.details()
        waiter.cancel()
        with pytest.raises(grpc.RpcError):
            next(waiter_chunks)
        time.sleep(0.2)
        queued = c.generate(PROMPT, SamplingOptions(max_tokens=2, ignore_eos=True))  # admitted now
        running.cancel()
        assert [ch.finish_reason for ch in queued][-1] == pb.FINISH_REASON_LENGTH


def test_deadline_stops_the_generation_within_a_step(slow_server, slow_probe):
    with Client(slow_server.address) as c:
        with pytest.raises(grpc.RpcError) as expired:
            c.complete(PROMPT, SamplingOptions(**LONG), timeout=0.3)
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert slow_probe.closed.wait(timeout=2.0)
        assert slow_probe.steps <= 0.3 / slow_probe.step_delay + 2


def test_health_and_other_calls_answer_during_a_long_generation(slow_server, slow_probe):
    channel = grpc.insecure_channel(slow_server.address)
    health = health_pb2_grpc.HealthStub(channel)
    with Client(slow_server.address) as c:
        running, chunks, _ = _start_long_generation(c, slow_probe)
        for service in ("", SERVICE_NAME):
            started = time.perf_counter()
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            assert time.perf_counter() - started < 1.0
        assert c.server_info(timeout=2).arch == "llama"
        assert c.tokenize(PROMPT, timeout=2)
        assert next(chunks).token_ids and not slow_probe.closed.is_set()  # still generating
        running.cancel()


def test_engine_failure_is_internal_and_logged_and_the_server_keeps_serving(slow_server, slow_probe, caplog):
    slow_probe.fail_after_steps = 2
    with Client(slow_server.address) as c, caplog.at_level(logging.ERROR, logger="lucekv.server"):
        with pytest.raises(grpc.RpcError) as failed:
            c.complete(PROMPT, SamplingOptions(max_tokens=8, ignore_eos=True), timeout=10)
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert failed.value.details() == "internal error: RuntimeError: synthetic engine failure"
        logged = [r for r in caplog.records if r.exc_info]
        assert logged and "synthetic engine failure" in str(logged[0].exc_info[1])
        slow_probe.fail_after_steps = None
        assert c.complete(PROMPT, SamplingOptions(max_tokens=3, ignore_eos=True)).usage.completion_tokens == 3


def test_stopping_the_server_stops_the_running_generation(slow_probe):
    running = ServerThread(slow_probe)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(running.address))
    with Client(running.address) as c:
        _start_long_generation(c, slow_probe)
        stopper = threading.Thread(target=running.stop)
        stopper.start()
        stopper.join(timeout=10)
    assert not stopper.is_alive()
    assert slow_probe.closed.is_set() and slow_probe.steps < 20
    with pytest.raises(grpc.RpcError) as gone:
        health.Check(health_pb2.HealthCheckRequest(), timeout=2)
    assert gone.value.code() == grpc.StatusCode.UNAVAILABLE


# --- reflection -------------------------------------------------------------------------------------------


def test_reflection_lists_the_services_and_describes_lucekv(server):
    stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(server.address))
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
    ]
    listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    from google.protobuf import descriptor_pb2

    file = descriptor_pb2.FileDescriptorProto.FromString(
        described.file_descriptor_response.file_descriptor_proto[0]
    )
    assert file.name == "lucekv/v1/lucekv.proto"
    assert [m.name for m in file.service[0].method] == ["Generate", "Tokenize", "Detokenize", "GetServerInfo",
                                                        "GetSession", "ListSessions", "DeleteSession", "Snapshot",
                                                        "Restore"]


def test_without_queue_places_an_idle_server_still_runs_a_call(slow_probe):
    running = ServerThread(slow_probe, max_queued=0)
    try:
        with Client(running.address) as c:
            assert c.complete(PROMPT, SamplingOptions(max_tokens=2, ignore_eos=True)).usage.completion_tokens == 2
            stream, _, _ = _start_long_generation(c, slow_probe)
            with pytest.raises(grpc.RpcError) as refused:
                c.complete(PROMPT, SamplingOptions(max_tokens=2, ignore_eos=True), timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            stream.cancel()
    finally:
        running.stop()


def test_a_paged_server_reports_its_pool_and_the_residency_of_each_generation(tmp_path):
    path = write_synthetic_gguf(tmp_path / "long.gguf", "llama", n_ctx=4096, vocab=512)
    running = ServerThread(ProbeEngine(lucekv.load(path, backend="cpu", kv_pool=512, kv_policy="lru")))
    try:
        with Client(running.address) as c:
            info = c.server_info()
            assert (info.kv_pool_tokens, info.kv_policy) == (512, "lru")
            ids = [10 + i % 400 for i in range(1200)]
            done = c.complete(ids, SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True))
            u = done.usage
            assert u.kv_resident_chunks == 512 // 64
            assert u.kv_resident_chunks + u.kv_paged_chunks == -(-(len(ids) + 3) // 64)
            assert u.kv_bytes_moved > 0
    finally:
        running.stop()
