"""Tree verify in the engine on a tiny synthetic model (CPU): greedy and seeded sampled output token-identical to
plain decoding, with a whole-context cache and a paging pool, through sessions and snapshots. An oracle drafter
proposes trees that hold plain decoding's continuation on one path among decoys (numbered before it, so an
accepted path's K/V must move to its positions), every third proposal spoilt partway."""

import pytest

from lucekv.engine.sampling import SamplingParams
from lucekv.spec.tree import DraftTree
from tests.spec.test_spec_engine import (  # noqa: F401  (model: a fixture)
    POOLS,
    VOCAB,
    OracleDrafter,
    generate,
    load,
    model,
    prompt,
    restore_through_a_blob,
)


class OracleTreeDrafter(OracleDrafter):
    name = "oracle-tree"
    cheap = False

    def __init__(self, reference: list[int], longest: int = 7):
        super().__init__(reference, longest)

    def propose(self, max_len):
        """Depth d: a decoy child of the path's node, then the path's own (up to max_len nodes in all)."""
        self.proposals += 1
        at = len(self.seq)
        path = list(self.reference[at : at + 1 + self.proposals % self.longest])
        if path and self.proposals % 3 == 0:
            path[len(path) // 2] = (path[len(path) // 2] + 1) % VOCAB
        tokens, parents, node = [], [], 0
        for t in path:
            for token in ((t + 7) % VOCAB, t):
                if len(tokens) < max_len:
                    tokens.append(token)
                    parents.append(node)
            node = len(tokens)
        return DraftTree(tokens, parents)


def with_tree_oracle(engine, reference, **kw):
    engine.drafters["suffix-tree"] = lambda: OracleTreeDrafter(reference, **kw)
    return engine


def count_moves(engine):
    """Spy on the backend's K/V moves (an accepted path off the block's first indices)."""
    moves = []
    copy = engine.backend.copy_kv
    engine.backend.copy_kv = lambda src, dst: (moves.append(len(src)), copy(src, dst))
    return moves


@pytest.mark.parametrize("pool", POOLS.values(), ids=POOLS.keys())
def test_greedy_tree_rounds_equal_plain_greedy(model, pool):  # noqa: F811
    ids = prompt(700)
    plain, _ = generate(load(model, pool), ids)
    engine = with_tree_oracle(load(model, pool), ids + plain)
    moves = count_moves(engine)
    spec, out = generate(engine, ids, "suffix-tree")
    assert spec == plain
    u = out[-1].usage.speculation
    assert u.rounds + 1 + u.accepted == len(plain) and u.rounds < len(plain) / 2
    assert len(moves) > 10  # accepted paths moved to their positions
    assert engine._latest.tokens == ids + plain[:-1]
    if pool:
        assert engine.paged.usage().paged_chunks > 0
        assert engine.paged.pager.n_tokens == len(ids) + len(plain) - 1


def test_seeded_sampling_through_trees_equals_plain_sampling(model):  # noqa: F811
    """The walk draws the target's token at each node of the path with the request's RNG, as plain decoding draws
    it: with the same seed, the same tokens (the CPU's verify rows are bit-identical to one-token steps)."""
    ids = prompt(300, seed=2)
    def sample(engine, mode):
        params = SamplingParams(temperature=0.9, seed=7, top_k=40, max_tokens=80, ignore_eos=True)
        out = list(engine.generate(ids, params, speculation=mode))
        return [t for d in out for t in d.token_ids], out

    plain, _ = sample(load(model, None), "off")
    assert plain != generate(load(model, None), ids, n=80)[0]
    engine = with_tree_oracle(load(model, None), ids + plain)
    spec, out = sample(engine, "suffix-tree")
    assert spec == plain
    assert out[-1].usage.speculation.accepted > 20


def test_a_tree_block_stays_in_its_chunk_on_a_paging_pool(model):  # noqa: F811
    ids = prompt(600, seed=12)
    plain, _ = generate(load(model, 512), ids, n=100)
    engine = with_tree_oracle(load(model, 512), ids + plain, longest=20)
    blocks = []
    forward = engine.backend.forward_tree

    def spy(tokens, positions, *args):
        blocks.append((int(positions[0]), len(tokens)))
        return forward(tokens, positions, *args)
    engine.backend.forward_tree = spy
    spec, _ = generate(engine, ids, "suffix-tree", n=100)
    assert spec == plain
    assert all(start // 64 == (start + n - 1) // 64 for start, n in blocks)
    assert any((start + n) % 64 == 0 for start, n in blocks)  # one was cut at the boundary


@pytest.mark.parametrize("pool", POOLS.values(), ids=POOLS.keys())
def test_a_session_speculates_by_tree_through_turns_and_a_snapshot(model, pool):  # noqa: F811
    first, second = prompt(600, seed=6), prompt(30, seed=7)
    ref_engine = load(model, pool)
    a, _ = generate(ref_engine, first, session_id="s", n=70)
    b, _ = generate(ref_engine, first + a + second, session_id="s", n=70)
    engine = with_tree_oracle(load(model, pool), first + a)
    assert generate(engine, first, "suffix-tree", session_id="s", n=70)[0] == a
    other = with_tree_oracle(load(model, pool), first + a + second + b)
    header = restore_through_a_blob(engine, "s", other)
    assert len(header.token_ids) == len(first) + len(a) - 1  # no node of a tree past the answer
    b_spec, out = generate(other, first + a + second, "suffix-tree", session_id="s", n=70)
    assert b_spec == b
    assert out[-1].usage.cached_tokens == len(first) + len(a) - 1


def test_the_suffix_tree_mode_is_offered_and_exact_on_repetitive_text(model):  # noqa: F811
    engine = load(model, None)
    assert "suffix-tree" in engine.info.spec_modes
    ids = (prompt(40, seed=3) * 4)[:150]
    plain, _ = generate(engine, ids, n=60)
    tree, out = generate(engine, ids, "suffix-tree", n=60)
    assert tree == plain
    assert out[-1].usage.speculation.drafter == "suffix-tree"


def test_tree_rounds_share_steps_with_other_sequences_decode_rows(model):  # noqa: F811
    """A greedy tree request (paging), a seeded sampled one and a plain one submitted together: rounds beside the
    others' decode rows, and each gets its tokens alone (plain decoding's)."""
    prompts = [prompt(600, seed=20), prompt(80, seed=21), prompt(50, seed=22)]
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)]
    solo = load(model, 512)
    alone = [[t for d in solo.generate(ids, p) for t in d.token_ids] for ids, p in zip(prompts, params, strict=True)]
    references = [ids + out for ids, out in zip(prompts, alone, strict=True)]

    class Oracle(OracleTreeDrafter):
        def begin(self, tokens, params=None):
            super().begin(tokens, params)
            self.reference = next(r for r in references if r[: len(tokens)] == list(tokens))

    engine = load(model, 512, max_batch=4)
    engine.drafters["suffix-tree"] = lambda: Oracle([])
    requests = [engine.submit(ids, p, speculation=mode)
                for ids, p, mode in zip(prompts, params, ("suffix-tree", "suffix-tree", "off"), strict=True)]
    mixed = 0
    while engine.has_work:
        running = [r for r in requests if not r.done and r.started]
        mixed += any(r.speculating for r in running) and any(r.spec is None and r.n_out for r in running)
        engine.step()
    assert [[t for d in r.out for t in d.token_ids] for r in requests] == alone
    assert mixed > 0 and all(r.out[-1].usage.speculation.rounds > 0 for r in requests[:2])


@pytest.mark.parametrize("arch", ["qwen3moe", "gemma3"])
def test_tree_rounds_on_moe_and_sliding_window_models_equal_plain_greedy(tmp_path, arch):
    """An MoE model's forwards go op by op (the tree's nodes as one sequence's rows, each with its own view of the
    block); gemma3 has sliding-window layers and q/k norms."""
    from lucekv.model.synth import write_synthetic_gguf

    kw = {"n_expert": 4, "n_expert_used": 2} if arch == "qwen3moe" else {}
    path = write_synthetic_gguf(tmp_path / f"{arch}.gguf", arch, n_ctx=2048, vocab=VOCAB, **kw)
    ids = prompt(100, seed=30)
    plain, _ = generate(load(path, None), ids, n=24)
    spec, out = generate(with_tree_oracle(load(path, None), ids + plain), ids, "suffix-tree", n=24)
    assert spec == plain and out[-1].usage.speculation.accepted > 6
