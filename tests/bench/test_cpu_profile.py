"""cpu_profile's trace of the decode step's phases, on a synthetic model."""

from __future__ import annotations

import numpy as np

import lucekv
from lucekv.bench.cpu_profile import phase_profile
from lucekv.model.synth import write_synthetic_gguf


def test_phase_profile_names_each_op_of_each_layer(tmp_path):
    path = write_synthetic_gguf(tmp_path / "llama.gguf", "llama", n_layer=3)
    backend = lucekv.load(path, backend="cpu", kv_dtype="f16").backend
    backend.forward(np.arange(5, 12, dtype=np.int32), np.arange(7, dtype=np.int32), np.arange(7, dtype=np.int32))

    def step(p: int) -> None:
        one = np.array([p], np.int32)
        backend.forward(one, one, one)

    r = phase_profile(backend, step, 3, 7)
    # one run: K/V and attention are one phase (no "kv"), no post-norms, no capture
    assert {op: t["phases"] for op, t in r["phases"].items()} == {
        "qkv": 3, "attention": 3, "wo": 3, "gate_up": 3, "down": 3, "output": 1}
    assert backend.decode_step.trace is None
    for t in r["phases"].values():
        assert len(t["busy_ms"]) == r["threads"] and min(t["busy_ms"] + t["wait_ms"]) >= 0
    assert sum(r["busy_ms"]) > 0 and r["span_ms"] > 0 and r["cycles_per_s"] > 1e8
