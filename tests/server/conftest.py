"""Real lucekv servers started in-process on ephemeral ports, serving a tiny synthetic llama model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_harness import ProbeEngine, ServerThread, load_engine

from lucekv.engine.engine import Engine
from lucekv.model.synth import write_synthetic_gguf


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_gguf(tmp_path_factory.mktemp("models") / "tiny-llama.gguf", "llama", n_ctx=512)


@pytest.fixture(scope="session")
def reference_engine(tiny_model: Path) -> Engine:
    """A second engine on the same file, driven directly by the tests to compute expected outputs."""
    return load_engine(tiny_model)


@pytest.fixture(scope="module")
def probe(tiny_model: Path) -> ProbeEngine:
    return ProbeEngine(load_engine(tiny_model))


@pytest.fixture(scope="module")
def server(probe: ProbeEngine) -> Iterator[ServerThread]:
    running = ServerThread(probe)
    yield running
    running.stop()


@pytest.fixture
def slow_probe(tiny_model: Path) -> ProbeEngine:
    """20 ms per step: a 400-token generation lasts 8 s unless the server stops it. One request at a time (a batch
    of one): the others queue behind it."""
    probe = ProbeEngine(load_engine(tiny_model, max_batch=1))
    probe.step_delay = 0.02
    return probe
