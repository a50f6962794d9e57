"""Speculation in the step loop on the CPU backend: speculating requests share steps with plain ones, each with its own
drafter and gate, and every request gets exactly what it gets alone; two draft-model requests take turns with the
one draft model and both keep plain decoding's output."""

from __future__ import annotations

import numpy as np
import pytest

import lucekv
from lucekv.engine.sampling import SamplingParams
from lucekv.model.synth import write_synthetic_gguf
from lucekv.spec.config import SpecConfig
from tests.engine.test_batching import assert_pool_adds_up
from tests.spec.test_spec_engine import OracleDrafter

VOCAB = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("specbatch") / "tiny.gguf", "llama", n_ctx=4096, vocab=VOCAB)


def prompt(n, seed):
    return np.random.default_rng(seed).integers(10, 500, n).tolist()


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


class Oracle(OracleDrafter):
    """An OracleDrafter of each request's own reference continuation (the one whose start is its prompt), 1 to 7
    tokens. One per request: `made` counts them."""

    made = 0

    def __init__(self, references: list[list[int]]):
        super().__init__([], longest=7)
        Oracle.made += 1
        self.references = references

    def begin(self, tokens, params=None):
        super().begin(tokens, params)
        self.reference = next((r for r in self.references if r[: len(tokens)] == self.seq), self.seq)


HISTORY = prompt(200, 100)  # the first turn of session "s", run before the batch
REQUESTS = [  # (prompt, params, session, speculation)
    (prompt(40, 1), greedy(30), "", "suffix"),
    (HISTORY + prompt(30, 2), greedy(24), "s", "suffix"),  # a session's second turn
    (prompt(1100, 3), greedy(40), "", "suffix"),  # pages through its 512-token budget between rounds
    (prompt(60, 4), greedy(50), "", "auto"),  # the gate decides, on the engine's shared clock
    (prompt(50, 5), greedy(20), "", "off"),
    (prompt(30, 6), SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True), "",
     "suffix"),  # sample-and-match on the host with its own RNG
    (prompt(70, 7), greedy(16, logprobs=True, top_logprobs=2), "", "suffix"),  # verified on the host
    (prompt(80, 8), greedy(40), "", "suffix"),  # cancelled after its third delta
]
CANCELLED, CANCEL_AFTER = 7, 3


def load(model, references, **kw):
    engine = lucekv.load(model, backend="cpu", kv_pool=512, kv_policy="lru", **kw)
    list(engine.generate(HISTORY, greedy(4), "s"))
    engine.drafters["suffix"] = lambda: Oracle(references)
    return engine


def tokens(deltas):
    return [t for d in deltas for t in d.token_ids]


@pytest.fixture(scope="module")
def references(model):
    """Plain greedy decoding of every request: what the oracle proposes (a sampled request's is a mere guess)."""
    engine = lucekv.load(model, backend="cpu", kv_pool=512, kv_policy="lru")
    list(engine.generate(HISTORY, greedy(4), "s"))
    return [ids + tokens(engine.generate(ids, params, sid)) for ids, params, sid, _ in REQUESTS]


def test_speculating_requests_share_steps_and_each_gets_what_it_gets_alone(model, references):
    engine = load(model, references)
    alone = [list(engine.generate(ids, params, sid, speculation=mode)) for ids, params, sid, mode in REQUESTS]
    engine = load(model, references, max_batch=8)
    made = Oracle.made
    requests = [engine.submit(engine.prepare(ids, params), params, sid, speculation=mode)
                for ids, params, sid, mode in REQUESTS]
    steps: list[set[str]] = []  # what each step ran besides prompt pieces
    for name in ("_round", "_decode_rows"):
        run = getattr(engine, name)
        setattr(engine, name, lambda *a, _run=run, _name=name: steps[-1].add(_name) or _run(*a))
    out = [[] for _ in requests]
    while engine.has_work:
        steps.append(set())
        engine.step()
        for i, r in enumerate(requests):
            while r.out:
                out[i].append(r.out.popleft())
            if i == CANCELLED and len(out[i]) == CANCEL_AFTER and not r.done:
                engine.cancel(r)
    assert any(s == {"_round", "_decode_rows"} for s in steps)  # rounds beside other sequences' decode rows
    for i, (got, want) in enumerate(zip(out, alone, strict=True)):
        if i == CANCELLED:
            assert tokens(got) == tokens(want)[: len(tokens(got))] and got[-1].finish_reason is None
            continue
        assert tokens(got) == tokens(want), f"request {i}"
        if REQUESTS[i][3] != "auto":  # (the gate decides on measured times: its rounds may fall elsewhere)
            assert [len(d.token_ids) for d in got] == [len(d.token_ids) for d in want]  # the same rounds
        if want[0].logprobs:
            assert [x.logprob for d in got for x in d.logprobs] == [x.logprob for d in want for x in d.logprobs]
        if REQUESTS[i][1].temperature == 0.0:
            assert tokens(got) == references[i][len(REQUESTS[i][0]) :]  # plain decoding's output
    assert Oracle.made - made == sum(mode != "off" for *_, mode in REQUESTS)  # a drafter per request's session
    usage = {i: got[-1].usage for i, got in enumerate(out) if i != CANCELLED}
    assert usage[4].speculation is None and usage[0].batch_size > 1
    assert all(u.speculation.rounds > 0 for i, u in usage.items() if i != 4)
    assert all(u.speculation.accepted > 0 for i, u in usage.items() if i not in (4, 5))  # (5 samples: guesses)
    assert usage[3].speculation.mode == "auto" and usage[3].speculation.gate_decisions
    assert usage[1].cached_tokens == len(HISTORY)  # the session's turn reused its K/V
    assert usage[2].kv_paged_chunks > 0
    assert_pool_adds_up(engine)


def test_two_draft_model_requests_take_turns_with_the_draft_model(model):
    """The draft model's pool holds one sequence: the request that drafts first keeps it for its turn, the other's
    rounds get no drafts until then, and both come out as plain greedy decoding."""
    engine = lucekv.load(model, backend="cpu", speculation=SpecConfig(draft_model=model, max_draft=6))
    first, second = prompt(100, 20), prompt(120, 21)
    plain = [tokens(engine.generate(ids, greedy(n))) for ids, n in ((first, 30), (second, 80))]
    requests = [engine.submit(ids, greedy(n), speculation="draft") for ids, n in ((first, 30), (second, 80))]
    drafted_while_first_ran = None
    while engine.has_work:
        if not requests[0].done and requests[1].spec is not None:
            drafted_while_first_ran = requests[1].spec.usage.drafted
        engine.step()
    got = [[t for d in r.out for t in d.token_ids] for r in requests]
    assert got == plain
    usage = [r.out[-1].usage.speculation for r in requests]
    assert usage[0].accepted > 0 and drafted_while_first_ran == 0 and usage[1].accepted > 0
