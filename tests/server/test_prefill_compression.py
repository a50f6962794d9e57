"""PFlash over gRPC: ServerInfo offers it, a request's keep ratio reaches the engine and its usage the client."""

from __future__ import annotations

import numpy as np
import pytest
from server_harness import ProbeEngine, ServerThread, load_engine

from lucekv.client import Client, SamplingOptions
from lucekv.model.synth import write_synthetic_gguf


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_synthetic_gguf(tmp_path_factory.mktemp("pflash") / "tiny.gguf", "llama", n_ctx=2048)
    running = ServerThread(ProbeEngine(load_engine(model, prefill_drafter=model, prefill_threshold=256)))
    yield running
    running.stop()


def test_a_request_asks_for_compression_and_its_usage_says_what_was_kept(server):
    with Client(server.address) as client:
        info = client.server_info()
        assert "prefill_compression" in info.features
        assert (info.prefill_keep_ratio, info.prefill_threshold) == (0.0, 256)  # off unless a request asks
        ids = np.random.default_rng(0).integers(10, 250, 640).tolist()
        greedy = SamplingOptions(max_tokens=4, temperature=0.0)
        usage = client.complete(ids, greedy, prefill_keep_ratio=0.5).usage
        assert (usage.prompt_tokens, usage.prefilled_tokens, usage.compression.kept_tokens) == (640, 320, 320)
        assert usage.compression.scored_tokens == 640 and usage.compression.keep_ratio == 0.5
        usage = client.complete(ids[:300], greedy).usage  # the server's default: no compression
        assert not usage.HasField("compression")
        # the previous prompt's kept head (a span of its budget of 10) is reused; the rest is computed
        assert (usage.cached_tokens, usage.prefilled_tokens) == (32, 268)
