"""Acceptance of the replicated deployment (issue 26): HAProxy hashing lucekv-session-id over 3 replicas that share
sessions through Redis; failover after SIGKILL, two replicas racing for a session, metrics, drain on SIGTERM."""

from __future__ import annotations

import itertools
import random
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis
from cluster_harness import RETRIED, retrying
from prometheus_client.parser import text_string_to_metric_families

from lucekv.client import Client, SamplingOptions

MAX_TOKENS = 8
GREEDY = SamplingOptions(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
TURNS = ["<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
         "<|im_end|>\n<|im_start|>user\nAnd three more?<|im_end|>\n<|im_start|>assistant\n",
         "<|im_end|>\n<|im_start|>user\nWhich is your favourite?<|im_end|>\n<|im_start|>assistant\n"]


def uninterrupted(client: Client, tokenizer, turns: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """Each turn's prompt ids and generated ids when one server holds the conversation in one session throughout."""
    prompts, outputs, history = [], [], []
    for text in turns:
        history = history + tokenizer.encode(text, add_special=False)
        prompts.append(history)
        outputs.append(client.complete(history, GREEDY, session_id="uninterrupted").token_ids)
        history = history + outputs[-1]
    client.delete_session("uninterrupted")
    return prompts, outputs


def served_by(cluster, request_id: str) -> int:
    """The replica whose log has the call."""
    found = [i for i in range(len(cluster.replicas)) if f"request_id={request_id} " in cluster.log(i)]
    assert len(found) == 1, found
    return found[0]


def scrape(cluster, i: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_ports[i]}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


GENERATE_OK = ("lucekv_requests_total", (("code", "OK"), ("rpc", "Generate")))
TOKENS = ("lucekv_generation_tokens_total", ())


def test_failover_after_sigkill_continues_from_the_blob_token_identical(cluster, tokenizer):
    with Client(cluster.replica_address(0)) as one_server:
        prompts, expected = uninterrupted(one_server, tokenizer, TURNS)
    before = [scrape(cluster, i) for i in range(3)]
    with Client(cluster.address) as client:
        got = [client.complete(prompts[t], GREEDY, session_id="failover", request_id=f"failover-{t}")
               for t in range(2)]
        home = served_by(cluster, "failover-0")
        assert served_by(cluster, "failover-1") == home  # affinity: both turns on one replica
        after = scrape(cluster, home)  # metrics of the run, over HTTP
        assert after.get(GENERATE_OK, 0) - before[home].get(GENERATE_OK, 0) == 2
        assert after[TOKENS] - before[home].get(TOKENS, 0) == 2 * MAX_TOKENS
        assert after[("lucekv_sessions", (("state", "live"),))] >= 1
        cluster.kill(home)  # SIGKILL after a completed turn: nothing is saved at exit
        third = retrying(lambda: client.complete(prompts[2], GREEDY, session_id="failover", request_id="failover-2"))
    taker = served_by(cluster, "failover-2")
    assert taker != home
    assert [g.token_ids for g in got] + [third.token_ids] == expected
    # continued from turn 2's blob: all the history but its last token was cached, nothing re-prefilled
    assert third.usage.cached_tokens == len(prompts[1]) + MAX_TOKENS - 1
    cluster.restart(home)


def test_two_replicas_racing_for_one_session_exactly_one_serves(cluster):
    with Client(cluster.replica_address(0)) as first, Client(cluster.replica_address(1)) as second:
        long = first.generate(TURNS[0], SamplingOptions(max_tokens=48, ignore_eos=True), session_id="race")
        chunks = iter(long)
        next(chunks)
        with pytest.raises(grpc.RpcError) as refused:
            second.complete(TURNS[0], GREEDY, session_id="race")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "another replica" in refused.value.details()
        assert 1 + sum(len(c.token_ids) for c in chunks) == 48  # the first one was not disturbed
        again = second.complete(TURNS[0], GREEDY, session_id="race")  # free now: the second takes it over
        assert again.usage.cached_tokens > 0


def test_sigterm_drains_a_running_stream_and_the_session_survives_the_restart(cluster):
    i = 2
    with Client(cluster.replica_address(i)) as client:
        stream = client.generate(TURNS[0], SamplingOptions(max_tokens=32, ignore_eos=True, temperature=0.0),
                                 session_id="drain")
        chunks = iter(stream)
        tokens = list(next(chunks).token_ids)
        cluster.replicas[i].send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with Client(cluster.replica_address(i)) as late, pytest.raises(grpc.RpcError) as refused:
            late.tokenize("refused while draining", timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(chunks)
        tokens += [t for c in rest for t in c.token_ids]
        assert len(tokens) == 32 and rest[-1].usage.completion_tokens == 32
    assert cluster.replicas[i].wait(60) == 0
    cluster.restart(i)
    with Client(cluster.replica_address(i)) as client:
        prompt_ids = client.tokenize(TURNS[0], add_special_tokens=True)
        assert client.get_session("drain").state == "stored"  # in Redis, read on first use
        turn = client.complete(prompt_ids + tokens, GREEDY, session_id="drain")
        assert turn.usage.cached_tokens == len(prompt_ids) + 31


@pytest.mark.parametrize(("streams", "seconds"), [(24, 30), pytest.param(64, 180, marks=pytest.mark.slow)],
                         ids=["short", "3-minutes"])
def test_soak_concurrent_streams_with_cancellations_and_a_replica_restart(cluster, tokenizer, streams, seconds):
    """`streams` conversations at once through the proxy for `seconds`, a fifth of the turns cancelled after their
    first token, one replica restarted (SIGTERM, drain, start) a third of the way in. No call may fail with a code
    other than the ones a client of replicas retries on, no session may lose its history, and the store's keys
    must be the sessions."""
    deadline = time.monotonic() + seconds
    unexpected: list[tuple[str, str, str]] = []
    lost: list[tuple[str, int]] = []
    completed: dict[str, int] = {}

    def conversation(k: int, client: Client) -> None:
        rng = random.Random(k)
        session = f"soak-{k}"
        history = tokenizer.encode(f"<|im_start|>user\nTell me about the number {k}.<|im_end|>\n", add_special=False)
        while time.monotonic() < deadline:
            prompt = history + tokenizer.encode(f"<|im_start|>user\nAnd {rng.randint(0, 999)}?<|im_end|>\n",
                                                add_special=False)
            cancel = rng.random() < 0.2
            try:
                stream = client.generate(prompt, SamplingOptions(max_tokens=rng.randint(2, 6), ignore_eos=True,
                                                                 temperature=0.0), session_id=session, timeout=120)
                chunks = list(itertools.islice(iter(stream), 1)) if cancel else list(stream)
                if cancel:
                    stream.cancel()
                    continue
            except grpc.RpcError as e:
                if e.code() in RETRIED | {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}:
                    time.sleep(0.2)  # a draining replica ends its last calls CANCELLED, refuses new ones
                    continue
                unexpected.append((session, e.code().name, e.details()))
                return
            if completed.get(session) and chunks[-1].usage.cached_tokens == 0:
                lost.append((session, completed[session]))
            completed[session] = completed.get(session, 0) + 1
            history = prompt + [t for c in chunks for t in c.token_ids]

    def restart_one() -> None:
        time.sleep(seconds / 3)
        cluster.restart(1)

    with Client(cluster.address) as client, ThreadPoolExecutor(streams + 1) as pool:
        futures = [pool.submit(conversation, k, client) for k in range(streams)] + [pool.submit(restart_one)]
        for future in futures:
            future.result()
    assert unexpected == []
    assert lost == []
    assert sum(completed.values()) >= streams  # every conversation got turns through
    with redis.Redis.from_url(cluster.redis_url) as r:
        keys = {k.decode().rsplit(":", 1)[1] for k in r.scan_iter(match="lucekv:*:blob:soak-*")}
    # every session with a finished turn is in the store; the others were cut before their first turn finished
    assert set(completed) <= keys <= {f"soak-{k}" for k in range(streams)}
