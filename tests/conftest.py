"""Shared fixtures. Real model files come from $LUCEKV_TEST_MODELS_DIR (files named `<name>.gguf`) when it
holds them, else from the registry, which downloads them once into its cache."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The simulator tests go last: each only waits for its file's child run, which the background threads started
    at collection; placed last, the other tests run beside those children instead of waiting for them part-way."""
    items.sort(key=lambda item: item.originalname.endswith("in_simulator"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Without a GPU, the simulator runs of the collected CUDA test files start now, in the background."""
    from lucekv.kernels.cuda import available
    from tests.kernels.cuda_sim import start_in_background

    if available():  # the kernels run directly in this process
        return
    files = dict.fromkeys(str(item.path) for item in session.items if item.originalname.endswith("in_simulator"))
    start_in_background(list(files))


@pytest.fixture(scope="session")
def model_path() -> Callable[[str], Path]:
    """`model_path(name)`: the path of a real model file, e.g. model_path("smollm2-135m")."""

    def find(name: str) -> Path:
        models_dir = os.environ.get("LUCEKV_TEST_MODELS_DIR")
        if models_dir and (Path(models_dir) / f"{name}.gguf").is_file():
            return Path(models_dir) / f"{name}.gguf"
        try:
            from lucekv.model.registry import ensure_model
        except ImportError as e:
            pytest.skip(f"no {name}.gguf in LUCEKV_TEST_MODELS_DIR and the registry is not importable: {e}")
        return ensure_model(name)

    return find


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port, data in a temp dir, for the whole test session: its URL
    without a database number. CI installs redis-server (.ci/run); elsewhere the tests that need it skip."""
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed (.ci/run installs it)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    workdir = tmp_path_factory.mktemp("redis")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "",
         "--appendonly", "no", "--daemonize", "no", "--logfile", str(workdir / "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"redis-server did not start: {(workdir / 'redis.log').read_text(errors='replace')}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """Database 0 of the session's redis-server, emptied for this test."""
    import redis

    with redis.Redis.from_url(redis_server + "/0") as r:
        r.flushdb()
    return redis_server + "/0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
