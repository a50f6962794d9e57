"""Speculative rounds in the engine on a tiny synthetic model: greedy output token-identical to plain decoding with
accepted and rejected drafts of every length, across chunk boundaries, with a paging pool, through sessions,
snapshots, stops and cancellation. An oracle drafter (it knows plain decoding's answer and spoils some of its
proposals) makes long accepts and rejections happen on a model whose text a suffix match would not predict."""

import numpy as np
import pytest

import lucekv
from lucekv.engine.sampling import SamplingParams
from lucekv.errors import ConfigError, InvalidRequestError
from lucekv.model.synth import write_synthetic_gguf
from lucekv.snapshot.blob import read_snapshot, write_snapshot
from lucekv.spec.config import SpecConfig
from lucekv.spec.drafter import Draft

POOLS = {"whole context": None, "paged pool": 512}
VOCAB = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("spec") / "tiny.gguf", "llama", n_ctx=4096, vocab=VOCAB)


class OracleDrafter:
    """Proposes the reference continuation, 1 to `longest` tokens (cycling), every third proposal spoilt in its
    middle: rounds accept everything, nothing, and partway. With `more`, the reference after them comes along as the
    draft's continuation (as a suffix match's), every fourth one spoilt at its second token."""

    name = "oracle"
    cheap = True

    def __init__(self, reference: list[int], longest: int = 9, more: bool = False):
        self.reference, self.longest, self.more = reference, longest, more
        self.proposals = 0

    def begin(self, tokens, params=None):
        self.seq = list(tokens)

    def propose(self, max_len):
        self.proposals += 1
        at = len(self.seq)
        k = min(max_len, 1 + self.proposals % self.longest, len(self.reference) - at)
        tokens = list(self.reference[at : at + k])
        if tokens and self.proposals % 3 == 0:
            tokens[len(tokens) // 2] = (tokens[len(tokens) // 2] + 1) % VOCAB
        more = list(self.reference[at + k : at + max(k, max_len)]) if self.more else []
        if len(more) > 1 and self.proposals % 4 == 0:
            more[1] = (more[1] + 1) % VOCAB
        return Draft(tokens, more=more)

    def accept(self, tokens):
        self.seq += list(tokens)

    def end(self):
        pass


def load(model, pool, **kw):
    return lucekv.load(model, backend="cpu", kv_dtype="f32", kv_pool=pool, **{"kv_policy": "lru", **kw})


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(10, 500, n).tolist()


def generate(engine, ids, speculation="off", session_id="", n=150, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)
    out = list(engine.generate(ids, params, session_id, speculation=speculation))
    return [t for d in out for t in d.token_ids], out


def restore_through_a_blob(engine, session_id, other):
    """`engine`'s session written as a snapshot blob and restored into `other` under the same id."""
    header, chunks = engine.snapshot(session_id)
    other.restore(read_snapshot(write_snapshot(header, chunks.__getitem__), other.layout, max_tokens=other.n_ctx,
                                vocab_size=other.spec.vocab_size), session_id)
    return header


def with_oracle(engine, reference, **kw):
    engine.drafters["suffix"] = lambda: OracleDrafter(reference, **kw)  # each request gets its own
    return engine


@pytest.mark.parametrize("pool", POOLS.values(), ids=POOLS.keys())
def test_greedy_rounds_equal_plain_greedy(model, pool):
    ids = prompt(700)
    plain, _ = generate(load(model, pool), ids)
    engine = with_oracle(load(model, pool), ids + plain)
    spec, out = generate(engine, ids, "suffix")
    assert spec == plain
    u = out[-1].usage.speculation
    assert u.rounds < len(plain) and 0 < u.accepted < u.drafted
    assert u.rounds + 1 + u.accepted == len(plain)  # the first token comes from the prefill
    assert max(len(d.token_ids) for d in out) > 5  # an accepted block streams as one delta
    assert engine._latest.tokens == ids + plain[:-1]
    if pool:
        assert engine.paged.usage().paged_chunks > 0  # the pool paged during the run
        assert engine.paged.pager.n_tokens == len(ids) + len(plain) - 1  # rejected drafts' slots are freed


@pytest.mark.parametrize("policy", ["quest", "meankey"])
def test_greedy_rounds_on_a_pool_whose_residency_follows_queries_equal_plain_greedy(model, policy):
    """Reselects every ~16 tokens (kv_tau 8), each ranking chunks by the queries of the last 8 decoded tokens: a round
    changes residency at the token plain decoding does, with the same queries (issue 22: only the accepted tokens
    count, and a block never runs past the policy's next event)."""
    ids = prompt(700, seed=13)
    plain_engine = load(model, 512, kv_policy=policy, kv_tau=8)
    plain, _ = generate(plain_engine, ids)
    engine = with_oracle(load(model, 512, kv_policy=policy, kv_tau=8), ids + plain, longest=12, more=True)
    spec, out = generate(engine, ids, "suffix")
    assert spec == plain
    u = out[-1].usage.speculation
    assert 0 < u.accepted < u.drafted and u.rounds < len(plain) // 2
    assert engine.paged.usage().paged_chunks > 0 and engine.paged.pager.stats.page_ins > 0  # reselects recalled
    for key in "resident", "scores":  # (recency's clock counts allocations: a round's block is one)
        assert engine.paged.pager.residency()[key] == plain_engine.paged.pager.residency()[key]


@pytest.mark.parametrize("pool", POOLS.values(), ids=POOLS.keys())
def test_drafts_filling_padded_verify_blocks_equal_plain_greedy(model, pool, monkeypatch):
    """The CPU backend as one that pads verify blocks to multiples of 4 (as CUDA's graphs): drafts are filled from
    their continuation (lucekv.spec.fill) and the output stays plain greedy's."""
    from lucekv.engine.engine import _RequestTarget
    from lucekv.kvflash.sequence import PagedSequence

    ids = prompt(700, seed=1)
    plain, _ = generate(load(model, pool), ids)
    engine = with_oracle(load(model, pool), ids + plain, more=True)
    engine.backend.verify_width = lambda n: n if n == 1 else -(-n // 4) * 4
    blocks, limits = [], []
    verify = _RequestTarget.verify_greedy
    monkeypatch.setattr(_RequestTarget, "verify_greedy",
                        lambda self, tokens, *a, **kw: blocks.append(len(tokens)) or verify(self, tokens, *a, **kw))
    limit = PagedSequence.round_limit
    monkeypatch.setattr(PagedSequence, "round_limit", lambda self, at: limits.append(limit(self, at)) or limits[-1])
    spec, out = generate(engine, ids, "suffix")
    assert spec == plain
    u = out[-1].usage.speculation
    assert 0 < u.accepted < u.drafted and u.rounds + 1 + u.accepted == len(plain)
    # the oracle proposes 1 to 9 tokens, blocks of 2 to 10: filled to 4, 8 or 12 (but the last ones, at the budget,
    # and those that end where the pool's policy starts a reselect or makes its moves: 2 of each in 150 tokens)
    at_events = [n == limit for n, limit in zip(blocks, limits, strict=True)]
    assert any(at_events) == bool(pool)
    assert sum(n % 4 == 0 or at for n, at in zip(blocks, at_events, strict=True)) >= len(blocks) - 2
    assert max(blocks) > 10


def test_rejected_drafts_are_never_read_and_free_slots_never_are(model):
    """Non-finite bytes in every slot no query may see change nothing (attention reads only visible slots)."""
    ids = prompt(300, seed=3)
    engine = load(model, None)
    plain, _ = generate(engine, ids, n=60)
    generate(engine, ids[:-1], n=1)
    pool = engine.backend.pool
    invisible = pool.slot_pos < 0
    for k, v in zip(pool.k, pool.v, strict=True):
        k[invisible] = np.nan
        v[invisible] = np.nan
    with_oracle(engine, ids + plain)
    assert generate(engine, ids, "suffix", n=60)[0] == plain


def test_logprobs_and_penalty_free_sampling_paths_verify_on_the_host(model):
    ids = prompt(200, seed=4)
    plain, plain_out = generate(load(model, None), ids, n=40, logprobs=True, top_logprobs=3)
    engine = with_oracle(load(model, None), ids + plain)
    spec, out = generate(engine, ids, "suffix", n=40, logprobs=True, top_logprobs=3)
    assert spec == plain
    lp = [x for d in out for x in d.logprobs]
    ref = [x for d in plain_out for x in d.logprobs]
    assert [x.token_id for x in lp] == spec
    np.testing.assert_allclose([x.logprob for x in lp], [x.logprob for x in ref], atol=1e-4)
    assert [[t for t, _ in x.top] for x in lp] == [[t for t, _ in x.top] for x in ref]


def test_min_tokens_and_stops_inside_a_block(model):
    ids = prompt(200, seed=5)
    engine = load(model, None)
    free, _ = generate(engine, ids, n=40)
    stop = free[20]
    cut = free.index(stop)
    plain, _ = generate(engine, ids, n=40, stop_token_ids=[stop], min_tokens=3)
    with_oracle(engine, ids + free)
    spec, out = generate(engine, ids, "suffix", n=40, stop_token_ids=[stop], min_tokens=3)
    assert spec == plain == free[: cut + 1]
    assert out[-1].finish_reason == "stop"
    assert len(engine._latest.tokens) <= len(ids) + len(spec)  # no draft past the stop stays in the sequence


@pytest.mark.parametrize("pool", POOLS.values(), ids=POOLS.keys())
def test_a_session_speculates_through_turns_and_a_snapshot(model, pool):
    first, second = prompt(600, seed=6), prompt(30, seed=7)
    ref_engine = load(model, pool)
    a, _ = generate(ref_engine, first, session_id="s", n=70)
    b, _ = generate(ref_engine, first + a + second, session_id="s", n=70)
    # the oracle knows both turns' answers (the second turn's reference is the whole conversation)
    engine = with_oracle(load(model, pool), first + a)
    a_spec, _ = generate(engine, first, "suffix", session_id="s", n=70)
    assert a_spec == a
    other = with_oracle(load(model, pool), first + a + second + b)
    restore_through_a_blob(engine, "s", other)
    b_spec, out = generate(other, first + a + second, "suffix", session_id="s", n=70)
    assert b_spec == b
    assert out[-1].usage.cached_tokens == len(first) + len(a) - 1


def test_a_cancelled_stream_leaves_a_sequence_the_next_request_continues_exactly(model):
    ids = prompt(300, seed=8)
    plain, _ = generate(load(model, 512), ids, session_id="s", n=80)
    engine = with_oracle(load(model, 512), ids + plain)
    stream = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True), "s",
                             speculation="suffix")
    got = []
    while len(got) < 30:
        got += next(stream).token_ids
    stream.close()  # what the server does when a client cancels, between two rounds
    assert engine.paged.pager.n_tokens == len(engine._latest.tokens)
    resumed, out = generate(engine, ids + got, session_id="s", n=80 - len(got))
    assert got + resumed == plain
    assert out[-1].usage.cached_tokens == len(ids) + len(got) - 1


def test_auto_mode_gates_and_reports_its_decisions(model):
    ids = prompt(200, seed=9)
    engine = load(model, None)
    plain, _ = generate(engine, ids, n=120)
    with_oracle(engine, ids + plain, longest=12)
    auto, out = generate(engine, ids, "auto", n=120)
    assert auto == plain
    u = out[-1].usage.speculation
    assert u.mode == "auto" and u.drafter == "oracle"
    # the clock was cold: plain steps first, scored in the shadow, then rounds once they pay
    assert u.plain_steps > 0 and u.gate_decisions and u.gate_decisions[0][1] is True and u.rounds > 0


def test_modes_are_checked_before_any_compute(model):
    engine = load(model, None, speculation=SpecConfig(mode="auto"))
    assert engine.info.spec_modes == ("off", "auto", "suffix", "suffix-tree") and engine.info.spec_default == "auto"
    for mode, message in (("draft", "draft model"), ("dflash", "DFlash"), ("fast", "unknown mode")):
        with pytest.raises(InvalidRequestError, match=message):
            engine.generate(prompt(5), SamplingParams(), speculation=mode)
    with pytest.raises(ConfigError, match="draft model"):
        load(model, None, speculation=SpecConfig(mode="draft"))


def test_a_greedy_verify_block_reaches_the_next_chunk_only_through_accepted_drafts(model):
    """(test_dflash checks it for rounds sampled with the rejection rule.)"""
    ids = prompt(600, seed=12)
    plain, _ = generate(load(model, 512), ids, n=80)
    engine = with_oracle(load(model, 512), ids + plain, longest=16)  # drafts that cross, spoilt before or after
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    assert verify_forwards_past_a_boundary(engine, ids, params, "suffix") > 0


def verify_forwards_past_a_boundary(engine, ids, params, mode) -> int:
    """Run a request on a paging pool, checking that a verify block's forward past a chunk boundary (which takes the
    next chunk's block and evicts a chunk) runs only when every draft before the boundary stood, as plain decoding
    reaches a chunk: its first position is committed when the round ends. How many such forwards ran."""
    forwards = []
    forward = engine._forward

    def spy(r, piece, start, **kw):
        forwards.append((start, kw.get("round_at") is not None))
        return forward(r, piece, start, **kw)
    engine._forward = spy
    request = engine.submit(ids, params, speculation=mode)
    crossings = 0
    while engine.has_work:
        before = len(forwards)
        engine.step()
        for start, _ in [f for f in forwards[before:] if f[1]][1:]:  # a round's verify forwards after its first
            crossings += 1
            assert start % 64 == 0 and start < request.computed
    return crossings


def test_a_round_that_ends_speculation_with_the_last_token_is_the_last_word(model, monkeypatch):
    """The gate may turn speculation off in the round that makes the last token: the same step must not decode a
    plain token after it (it did: two finish deltas, the server kept the second, the call got one token fewer than
    its usage counted)."""
    from lucekv.spec.speculator import Speculator

    ids = prompt(100, seed=4)
    engine = load(model, None)
    plain, _ = generate(engine, ids, n=40)
    with_oracle(engine, ids + plain)
    real_round = Speculator.round

    def round_then_off(self, target, last, position, budget, *args, **kw):
        block = real_round(self, target, last, position, budget, *args, **kw)
        self.off = len(block.tokens) == budget  # the generation's last block: the gate says stop here
        return block

    monkeypatch.setattr(Speculator, "round", round_then_off)
    monkeypatch.setattr(Speculator, "speculating", property(lambda self: not getattr(self, "off", False)))
    tokens, out = generate(engine, ids, "suffix", n=40)
    assert tokens == plain
    assert [d.finish_reason for d in out if d.finish_reason] == ["length"]
    assert out[-1].usage.completion_tokens == 40
