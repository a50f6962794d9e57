"""Deploy test helpers: deploy/local's launcher, and the retry a client of replicas does."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import grpc

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SERVE_ARGS = ("--backend", "cpu", "--lease-seconds", "5", "--drain-seconds", "20")
RETRIED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION}  # a replica going away, a lease


def _load_launcher():
    spec = importlib.util.spec_from_file_location("lucekv_local_cluster", DEPLOY / "local" / "cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launcher = _load_launcher()


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
