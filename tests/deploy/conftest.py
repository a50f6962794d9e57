"""The deployment on loopback: deploy/local's launcher starts Redis, 3 replicas serving smollm2 on the CPU, and
HAProxy with deploy/haproxy's configuration. One cluster serves a whole test module (3 model processes on 2
cores are the expensive part)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
from cluster_harness import SERVE_ARGS, launcher

from lucekv.model.gguf import open_gguf
from lucekv.model.tokenizer import Tokenizer


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
def tokenizer(model_path) -> Tokenizer:
    return Tokenizer.from_metadata(open_gguf(model_path("smollm2-135m")).metadata)
