"""Speculative decoding over gRPC: the request's mode, an accepted block as one chunk, usage figures, the modes a
server offers, and a cancelled call in the middle of rounds."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from server_harness import ProbeEngine, ServerThread

import lucekv
from lucekv.client import Client, SamplingOptions
from lucekv.engine.sampling import SamplingParams
from lucekv.spec.config import SpecConfig
from tests.spec.test_spec_engine import OracleDrafter

PROMPT = np.random.default_rng(3).integers(10, 200, 40).tolist()
GREEDY = {"temperature": 0.0, "max_tokens": 60, "ignore_eos": True}


@pytest.fixture(scope="module")
def plain(tiny_model):
    engine = lucekv.load(tiny_model, backend="cpu")
    return [t for d in engine.generate(PROMPT, SamplingParams(**GREEDY)) for t in d.token_ids]


@pytest.fixture(scope="module")
def spec_probe(tiny_model, plain):
    engine = lucekv.load(tiny_model, backend="cpu", speculation=SpecConfig(mode="auto"))
    engine.drafters["suffix"] = lambda: OracleDrafter(PROMPT + plain)
    return ProbeEngine(engine)


@pytest.fixture(scope="module")
def client(spec_probe):
    server = ServerThread(spec_probe)
    with Client(server.address) as c:
        yield c
    server.stop()


def test_server_info_lists_the_modes_and_the_default(client):
    info = client.server_info(timeout=10)
    assert list(info.speculation_modes) == ["off", "auto", "suffix", "suffix-tree"]
    assert info.speculation_default == "auto"


def test_the_suffix_tree_mode_over_the_wire(client, plain):
    reply = client.complete(PROMPT, SamplingOptions(**GREEDY), speculation="suffix-tree")
    assert reply.token_ids == plain and reply.usage.speculation.drafter == "suffix-tree"


def test_an_accepted_block_arrives_as_one_chunk_and_usage_counts_the_rounds(client, plain):
    chunks = list(client.generate(PROMPT, SamplingOptions(**GREEDY), speculation="suffix"))
    assert [t for c in chunks for t in c.token_ids] == plain
    assert max(len(c.token_ids) for c in chunks) > 3
    s = chunks[-1].usage.speculation
    assert (s.mode, s.drafter) == ("suffix", "oracle")
    assert s.rounds + 1 + s.accepted_tokens == len(plain) and 0 < s.accepted_tokens < s.drafted_tokens
    off = client.complete(PROMPT, SamplingOptions(**GREEDY), speculation="off")
    assert off.token_ids == plain and not off.usage.HasField("speculation")


def test_a_mode_the_server_does_not_offer_is_invalid_argument(client):
    with pytest.raises(grpc.RpcError) as e:
        client.complete(PROMPT, SamplingOptions(**GREEDY), speculation="draft")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "speculation" in e.value.details()


def test_a_call_cancelled_between_rounds_leaves_the_session_to_continue_exactly(client, spec_probe, plain):
    stream = client.generate(PROMPT, SamplingOptions(**GREEDY), session_id="c", speculation="suffix")
    got = []
    for chunk in stream:
        got += chunk.token_ids
        if len(got) >= 20:
            stream.cancel()
            break
    assert spec_probe.closed.wait(10)
    assert client.get_session("c", timeout=10).n_tokens >= len(PROMPT) + 19  # what the cancelled call decoded
    rest = client.complete(PROMPT + plain[:20], SamplingOptions(**{**GREEDY, "max_tokens": 40}), session_id="c",
                           speculation="off")
    assert plain[:20] + rest.token_ids == plain
