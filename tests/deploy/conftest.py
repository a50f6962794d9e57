"""The deployment on loopback: deploy/local's launcher starts Redis, 3 replicas serving smollm2 on the CPU, and
HAProxy with deploy/haproxy's configuration. One cluster serves a whole test module (3 model processes on 2
cores are the expensive part)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

import lucekv

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SERVE_ARGS = ("--backend", "cpu", "--lease-seconds", "5", "--drain-seconds", "20")
RETRIED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION}  # a replica going away, a lease


def _load_launcher():
    spec = importlib.util.spec_from_file_location("lucekv_local_cluster", DEPLOY / "local" / "cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launcher = _load_launcher()


@pytest.fixture(scope="module")
def cluster(model_path, tmp_path_factory) -> Iterator:
    missing = [tool for tool in ("redis-server", "haproxy") if shutil.which(tool) is None]
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"{', '.join(missing)} not installed (.ci/run installs them)")
        pytest.skip(f"{', '.join(missing)} not installed (apt-get install redis-server haproxy)")
    # three model processes on two cores: one numba thread each, or their threads' spin-waits starve one another
    running = launcher.LocalCluster(str(model_path("smollm2-135m")), 3, SERVE_ARGS,
                                    workdir=tmp_path_factory.mktemp("cluster"),
                                    env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    try:
        running.start()
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def reference(model_path) -> lucekv.Engine:
    """The same model in this process: what an uninterrupted conversation on one server gives."""
    return lucekv.load(model_path("smollm2-135m"), backend="cpu")


def retrying(call: Callable, timeout: float = 60.0):
    """call() again while it fails with a code a client of a replicated service retries on."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except grpc.RpcError as e:
            if e.code() not in RETRIED or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
