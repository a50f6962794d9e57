"""`python -m lucekv.bench.serve_host`: the engine on a backend that waits like a GPU."""

from __future__ import annotations

import time

import pytest

from lucekv.bench.serve import BenchRequest
from lucekv.bench.serve_host import DeviceTimes, in_process, timed_engine
from lucekv.engine.sampling import SamplingParams
from lucekv.model.synth import write_synthetic_gguf


def test_device_times_take_the_batch_bucket_and_go_on_in_proportion_past_the_table():
    device = DeviceTimes.parse("1:2.0,2:3.0,4:3.5", 0.01)
    assert [device.decode_ms(n) for n in (1, 2, 3, 4, 5)] == [2.0, 3.0, 3.5, 3.5, 7.0]
    assert device.piece_ms(100) == pytest.approx(3.0)
    flags = device.flags()  # as the server process gets them
    assert DeviceTimes.parse(flags[1], float(flags[3])) == device


def test_the_timed_engine_decodes_the_script_and_waits_the_device_time(tmp_path):
    model = write_synthetic_gguf(tmp_path / "tiny.gguf", "llama", n_ctx=512)
    device = DeviceTimes({1: 2.0, 2: 3.0}, 0.0)
    engine = timed_engine(model, device, max_batch=2)
    script = engine.backend.reference
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    requests = [engine.submit(list(script[:n]), params) for n in (5, 9)]
    t = time.perf_counter()
    while not all(r.done for r in requests):
        engine.step()
    wall = time.perf_counter() - t
    for n, r in zip((5, 9), requests, strict=True):  # the greedy token after position p is the script's p + 1
        assert [t for d in r.out for t in d.token_ids] == list(script[n : n + 6])
    stats = engine.backend.stats
    assert stats["rows"] == 10 and stats["pieces"] == 2  # the first tokens come from the prompts' pieces
    assert wall >= stats["device_s"] >= 5 * 3.0e-3 + 2 * 2.0e-3

    figures = in_process(model, device, 2, [BenchRequest(list(script[:6]), 4), BenchRequest(list(script[:7]), 5)])
    assert figures["requests"] == 2 and figures["output_tokens"] == 9
