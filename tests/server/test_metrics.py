"""Prometheus metrics scraped over HTTP while a server works and after."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerThread

from lucekv.client import Client, SamplingOptions


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_show_the_requests_tokens_and_sessions_of_a_run(slow_probe):
    slow_probe.step_delay = 0.1  # the long generation lasts 30 s: it is still running when cancelled, however loaded
    running = ServerThread(slow_probe, metrics_port=0)
    port = running.server.metrics_port
    try:
        with Client(running.address) as c:
            long = c.generate("Hello", SamplingOptions(max_tokens=300, ignore_eos=True), session_id="m-1")
            chunks = iter(long)
            next(chunks)
            queued = c.generate("Hello", SamplingOptions(max_tokens=5, ignore_eos=True, temperature=0.0))
            deadline = time.monotonic() + 10
            while scrape(port)[("lucekv_num_requests_waiting", ())] != 1:  # during the run: one waits
                assert time.monotonic() < deadline
                time.sleep(0.05)
            during = scrape(port)
            assert during[("lucekv_sessions", (("state", "live"),))] == 1
            long.cancel()
            assert sum(len(ch.token_ids) for ch in queued) == 5
            c.complete("Hello", SamplingOptions(max_tokens=3, ignore_eos=True), session_id="m-1")
        after = scrape(port)
    finally:
        running.stop()
    assert after[("lucekv_requests_total", (("code", "OK"), ("rpc", "Generate")))] == 2
    assert after[("lucekv_requests_total", (("code", "CANCELLED"), ("rpc", "Generate")))] == 1
    assert after[("lucekv_generation_tokens_total", ())] == 5 + 3
    assert after[("lucekv_time_to_first_token_seconds_count", ())] == 2
    assert after[("lucekv_time_per_output_token_seconds_count", ())] == 2
    assert after[("lucekv_decode_tokens_per_second", ())] > 0
    assert after[("lucekv_num_requests_waiting", ())] == 0
    assert after[("lucekv_sessions", (("state", "live"),))] == 1
    assert after[("lucekv_sessions", (("state", "stored"),))] == 0
    assert after[("lucekv_prompt_tokens_total", ())] > 0 and after[("lucekv_cached_prompt_tokens_total", ())] > 0
