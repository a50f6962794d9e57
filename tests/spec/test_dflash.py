"""The DFlash block drafter: its forward against a float64 reference of the architecture, the target features the CPU
backend captures, the loader's refusals, and greedy output with it equal to plain greedy."""

import numpy as np
import pytest
from gguf.quants import dequantize

import lucekv
from lucekv.backends.cpu import CpuBackend, CpuDraftOps
from lucekv.engine.sampling import SamplingParams
from lucekv.errors import ConfigError
from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import open_gguf
from lucekv.model.synth import write_dflash_gguf, write_synthetic_gguf
from lucekv.snapshot.blob import read_snapshot, write_snapshot
from lucekv.spec.config import SpecConfig
from lucekv.spec.dflash import ContextKV, DFlashModel, DFlashSpec

VOCAB = 512
CAPTURE = [1, 3]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("dflash")
    target = write_synthetic_gguf(d / "target.gguf", "llama", n_layer=4, n_ctx=4096, vocab=VOCAB)
    drafters = {b: write_dflash_gguf(d / f"dflash{b}.gguf", target, target_layers=CAPTURE, block_size=b, seed=b)
                for b in (2, 5, 16)}
    return target, drafters, d


def backend(path):
    g = open_gguf(path)
    return CpuBackend(g, ModelSpec.from_gguf(g), "f32", 4096)


# ---- the float64 reference of the architecture (lucekv.spec.dflash's docstring), from the GGUF tensors -------------

def tensor(g, name):
    t = g.tensors[name]
    return np.asarray(dequantize(t.data, t.qtype), np.float64).reshape(t.shape)


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_neox(x, positions, base):
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2) / d)
    ang = positions[:, None, None] * inv
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)], axis=-1)


def reference_logits(drafter_path, target_path, features, ctx_positions, last, position):
    g, t = open_gguf(drafter_path), open_gguf(target_path)
    spec = DFlashSpec.from_gguf(g)
    m = spec.model
    eps, base, hd = m.rms_eps, m.rope_base, m.head_dim
    c = rms(features @ tensor(g, "dflash.fc.weight").T, tensor(g, "dflash.hidden_norm.weight"), eps)
    tokens = [last] + [spec.mask_token] * (spec.block_size - 1)
    block_pos = np.arange(position, position + spec.block_size, dtype=np.float64)
    x = tensor(t, "token_embd.weight")[tokens]
    for i in range(m.n_layer):
        w = {n: tensor(g, f"blk.{i}.{n}.weight") for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm",
                                                         "attn_k_norm", "attn_output", "ffn_norm", "ffn_gate",
                                                         "ffn_up", "ffn_down")}
        h = rms(x, w["attn_norm"], eps)
        q = rms((h @ w["attn_q"].T).reshape(len(h), m.n_head, hd), w["attn_q_norm"], eps)
        k_in = np.concatenate([c, h])  # context features (not attention-normed), then the block
        k = rms((k_in @ w["attn_k"].T).reshape(len(k_in), m.n_kv_head, hd), w["attn_k_norm"], eps)
        v = (k_in @ w["attn_v"].T).reshape(len(k_in), m.n_kv_head, hd)
        q = rope_neox(q, block_pos, base)
        k = rope_neox(k, np.concatenate([ctx_positions, block_pos]), base)
        group = m.n_head // m.n_kv_head
        out = np.empty_like(q)
        for head in range(m.n_head):  # no mask: every block query sees the whole context and the whole block
            s = q[:, head] @ k[:, head // group].T / np.sqrt(hd)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, head] = (p / p.sum(axis=1, keepdims=True)) @ v[:, head // group]
        x = x + out.reshape(len(x), -1) @ w["attn_output"].T
        h = rms(x, w["ffn_norm"], eps)
        gate, up = h @ w["ffn_gate"].T, h @ w["ffn_up"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w["ffn_down"].T
    out = t.tensors.get("output.weight")
    head = tensor(t, "output.weight" if out is not None else "token_embd.weight")
    return rms(x[1:], tensor(g, "output_norm.weight"), eps) @ head.T


@pytest.mark.parametrize("block", [2, 5, 16])
def test_block_logits_equal_the_float64_reference(files, block):
    """A context of 100 positions (past a 64-token chunk), committed in two pieces as rounds commit them."""
    target, drafters, _ = files
    b = backend(target)
    model = DFlashModel(drafters[block], b.spec, None, b.weights, CpuDraftOps)
    rng = np.random.default_rng(block)
    features = rng.standard_normal((100, len(CAPTURE) * b.spec.n_embd))
    positions = np.arange(100)
    ctx = ContextKV(model.spec.model.n_layer, model.spec.model.n_kv_head * model.spec.model.head_dim)
    for piece in (slice(0, 70), slice(70, 100)):
        ctx.append(positions[piece], model.context_kv(model.fuse(features[piece]), positions[piece]))
    got = model.block_logits(ctx, 42, 100)
    want = reference_logits(drafters[block], target, features, positions.astype(np.float64), 42, 100)
    assert got.shape == (block - 1, VOCAB)
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-4
    # beside a target on another backend it reads the target's embeddings and LM head from the GGUF: the same numbers
    apart = DFlashModel(drafters[block], b.spec, open_gguf(target), None, CpuDraftOps)
    np.testing.assert_array_equal(apart.block_logits(ctx, 42, 100), got)


def test_the_backend_captures_each_layers_output_on_both_paths(files):
    """The last layer's captured output, through the output norm and LM head, is the logits; the prefill path (op by
    op) and the verify path (the fused decode step) capture the same features."""
    target, _, _ = files
    b = backend(target)
    ids = np.random.default_rng(0).integers(0, VOCAB, 20).astype(np.int32)
    pos = np.arange(20, dtype=np.int32)
    b.capture_layers = (3, 1)
    logits = b.forward(ids, pos, pos)  # a prompt piece: op by op
    prefill = b.captured
    assert prefill.shape == (20, 2 * b.spec.n_embd)
    head = b.ops.linear(b.weights.output, prefill[-1:, :b.spec.n_embd], norm=b.weights.output_norm)
    np.testing.assert_allclose(head, logits, rtol=0, atol=1e-5 * np.abs(logits).max())
    verify = b.forward(ids, pos, pos, all_logits=True)
    np.testing.assert_allclose(b.captured, prefill, rtol=0, atol=1e-3 * np.abs(prefill).max())
    np.testing.assert_allclose(b.ops.linear(b.weights.output, b.captured[:, :b.spec.n_embd],
                                            norm=b.weights.output_norm), verify, rtol=0,
                               atol=1e-4 * np.abs(verify).max())
    b.capture_layers = ()
    b.captured = None
    b.forward(ids, pos, pos, all_logits=True)
    assert b.captured is None  # nothing captured while no drafter asks


def test_the_synth_command_writes_a_drafter_for_a_target(files):
    from lucekv.model import synth

    target, _, d = files
    assert synth.main(["dflash", str(target), str(d / "cli.gguf"), "--layers", "0,2", "--block", "4"]) == 0
    spec = DFlashSpec.from_gguf(open_gguf(d / "cli.gguf"))
    assert (spec.block_size, spec.target_layers, spec.mask_token, spec.model.n_layer) == (4, (0, 2), VOCAB - 1, 2)


def copy_with(src, dst, key=None, tensor=None):
    """The GGUF at src written to dst with one more metadata key (name, value) or F32 tensor (name, array)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    writer = GGUFWriter(dst, "dflash-draft")
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub)
    if key is not None:
        writer.add_uint32(*key)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.ascontiguousarray(t.data), raw_dtype=t.tensor_type)
    if tensor is not None:
        writer.add_tensor(*tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_a_drafter_with_what_lucekv_does_not_implement_is_refused_by_name(files):
    from lucekv.errors import ModelError

    target, drafters, d = files
    window = copy_with(drafters[5], d / "window.gguf", key=("dflash-draft.attention.sliding_window", 2048))
    aux = copy_with(drafters[5], d / "aux.gguf", tensor=("dflash.aux_hidden_norm.0.weight", np.ones(64, np.float32)))
    for path, name in ((window, "dflash-draft.attention.sliding_window"), (aux, "dflash.aux_hidden_norm.0.weight")):
        with pytest.raises(ModelError, match=name.replace(".", r"\.")):
            load(target, path)
    assert "dflash" in load(target, copy_with(drafters[5], d / "same.gguf")).info.spec_modes  # the copy itself loads


def test_a_drafter_made_for_another_target_is_refused(files):
    target, drafters, d = files
    wide = write_synthetic_gguf(d / "wide.gguf", "llama", n_layer=4, n_embd=128, n_ctx=4096, vocab=VOCAB)
    other_vocab = write_synthetic_gguf(d / "vocab.gguf", "llama", n_layer=4, n_ctx=4096, vocab=VOCAB + 64)
    shallow = write_synthetic_gguf(d / "shallow.gguf", "llama", n_layer=2, n_ctx=4096, vocab=VOCAB)
    for path, message in ((wide, "embedding_length 64 is not the target's 128"),
                          (other_vocab, "vocab_size 512 is not the target's 576"),
                          (shallow, r"target_layer_ids \[3\] are not layers of the target")):
        with pytest.raises(ConfigError, match=message):
            lucekv.load(path, backend="cpu", speculation=SpecConfig(dflash_drafter=drafters[5]))


def load(target, drafter, pool=None, policy="lru"):
    """`policy` quest reselects every ~14 tokens (kv_tau 8) against the last decoded tokens' queries."""
    return lucekv.load(target, backend="cpu", kv_dtype="f32", kv_pool=pool, kv_policy=policy,
                       kv_tau=8 if policy == "quest" else 64, speculation=SpecConfig(dflash_drafter=drafter))


def greedy(engine, ids, mode, session_id="", n=60):
    out = list(engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), session_id,
                               speculation=mode))
    return [t for d in out for t in d.token_ids], out[-1].usage


@pytest.mark.parametrize("pool", [None, 512], ids=["whole context", "paged pool"])
def test_greedy_with_the_dflash_drafter_equals_plain_greedy(files, pool):
    """And the drafter's context K/V ends up exactly what the features of the whole sequence give: every position's
    features arrived, at its position, and the rejected drafts' never did."""
    target, drafters, _ = files
    ids = np.random.default_rng(1).integers(10, 500, 600 if pool else 100).tolist()
    plain, _ = greedy(load(target, drafters[5], pool), ids, "off")
    engine = load(target, drafters[5], pool)
    assert "dflash" in engine.info.spec_modes  # GetServerInfo lists it
    spec, usage = greedy(engine, ids, "dflash", "s")
    assert spec == plain
    s = usage.speculation
    assert s.drafter == "dflash" and s.rounds >= 10 and s.drafted >= 4 * (s.rounds - 4)
    drafter = engine.sessions.get("s").drafters["dflash"]
    drafter.propose(0)  # commits the last round's features
    n = len(ids) + len(spec) - 1
    assert list(drafter.ctx.positions[: drafter.ctx.n]) == list(range(n))
    if pool is None:
        b = backend(target)  # a fresh pool: the whole sequence in one forward
        b.capture_layers = tuple(CAPTURE)
        b.forward(np.array(ids + spec[:-1], np.int32), np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32))
        want = drafter.model.context_kv(drafter.model.fuse(b.captured), np.arange(n))
        for layer, (k, _) in enumerate(want):
            got = drafter.ctx.k[layer, :n]
            assert np.max(np.abs(got - k)) < 1e-3 * np.max(np.abs(k))


@pytest.mark.parametrize(("pool", "policy"), [(None, "lru"), (512, "lru"), (512, "quest")],
                         ids=["whole context", "paged pool", "pool paged by queries"])
def test_dflash_trees_equal_plain_greedy_and_feed_the_drafter_the_accepted_paths_features(files, pool, policy,
                                                                                          monkeypatch):
    """DDTree on the random drafter, its slots steered (plain decoding's next token second in each, a decoy first):
    the greedy chain is rejected and the tree's other branches accepted, their K/V moved to their positions. The
    output is plain greedy's, and the drafter's context K/V holds each position's features (the accepted path's,
    by position), as a chain turn's does."""
    target, drafters, _ = files
    ids = np.random.default_rng(1).integers(10, 500, 600 if pool else 100).tolist()
    plain, _ = greedy(load(target, drafters[5], pool, policy), ids, "off", n=40)
    reference = ids + plain
    block_logits = DFlashModel.block_logits

    def steered(self, ctx, last, position):
        logits = block_logits(self, ctx, last, position).copy()
        for slot, row in enumerate(logits):
            if position + 1 + slot < len(reference):
                nxt, top = reference[position + 1 + slot], row.max()
                row[nxt], row[(nxt + 1) % VOCAB] = top + 1.0, top + 1.5
        return logits
    monkeypatch.setattr(DFlashModel, "block_logits", steered)
    contexts = {}
    for mode in ("dflash", "dflash-tree"):
        engine = load(target, drafters[5], pool, policy)
        moves = []
        copy = engine.backend.copy_kv
        engine.backend.copy_kv = lambda src, dst, _copy=copy, _moves=moves: (_moves.append(len(src)), _copy(src, dst))
        spec, usage = greedy(engine, ids, mode, "s", n=40)
        assert spec == plain
        assert (usage.speculation.accepted > 10 and len(moves) > 5) if mode == "dflash-tree" else not moves
        drafter = engine.sessions.get("s").drafters[mode]
        drafter.propose(0)  # commits the last round's features
        n = len(ids) + len(spec) - 1
        assert list(drafter.ctx.positions[: drafter.ctx.n]) == list(range(n))
        contexts[mode] = drafter.ctx.k[:, :n].copy(), drafter.ctx.v[:, :n].copy()
    for chain, tree in zip(contexts["dflash"], contexts["dflash-tree"], strict=True):  # (fused in other batches)
        np.testing.assert_allclose(tree, chain, rtol=0, atol=1e-5 * np.abs(chain).max())


def test_a_sessions_next_turn_keeps_the_drafters_context_and_a_restored_one_drafts_without_it(files):
    """A restored session's drafter never saw the first turn's features: it drafts from what it sees from then on
    (the positions of the new prompt's piece), and the output is still plain greedy's."""
    target, drafters, _ = files
    first, second = (np.random.default_rng(s).integers(10, 500, n).tolist() for s, n in ((2, 90), (3, 20)))
    ref = load(target, drafters[16])
    a, _ = greedy(ref, first, "off", "s", n=30)
    b, _ = greedy(ref, first + a + second, "off", "s", n=30)
    engine = load(target, drafters[16])
    assert greedy(engine, first, "dflash", "s", n=30)[0] == a
    header, chunks = engine.snapshot("s")
    assert greedy(engine, first + a + second, "dflash", "s", n=30)[0] == b
    ctx = engine.sessions.get("s").drafters["dflash"].ctx
    assert ctx.n >= len(first) + len(a) + len(second)
    other = load(target, drafters[16])
    other.restore(read_snapshot(write_snapshot(header, chunks.__getitem__), other.layout, max_tokens=other.n_ctx,
                                vocab_size=VOCAB), "s")
    assert greedy(other, first + a + second, "dflash", "s", n=30)[0] == b
    ctx = other.sessions.get("s").drafters["dflash"].ctx
    assert ctx.positions[0] == len(first) + len(a) - 1  # the first position the restored session computed


def test_dflash_turns_batched_with_other_requests_get_what_they_get_alone(files):
    """Features are captured per forward of a dflash turn only: rounds, prompt pieces and other sequences' decode
    rows share steps (the backend's capture is set and reset around each forward of the turn)."""
    target, drafters, _ = files
    prompts = [np.random.default_rng(10 + i).integers(10, 500, n).tolist() for i, n in enumerate((80, 30, 200))]
    modes = ["dflash", "off", "dflash"]
    params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    alone = [greedy(load(target, drafters[5]), ids, "off", n=25)[0] for ids in prompts]
    engine = lucekv.load(target, backend="cpu", kv_dtype="f32", max_batch=3,
                         speculation=SpecConfig(dflash_drafter=drafters[5]))
    requests = [engine.submit(ids, params, speculation=m) for ids, m in zip(prompts, modes, strict=True)]
    while engine.has_work:
        engine.step()
    assert [[t for d in r.out for t in d.token_ids] for r in requests] == alone


# CI time (57 s whole context, 49 s paged, on the loaded 2-core machine): the synthetic pairs above cover the wiring
@pytest.mark.slow
@pytest.mark.parametrize("pool", [None, 512], ids=["whole context", "paged pool"])
def test_smollm2_with_a_synthetic_dflash_drafter_equals_plain_greedy(model_path, tmp_path, pool):
    """128 tokens of smollm2 after a code prompt: its random drafter's blocks are rejected, every round verifies
    the last token and 7 drafts, and the output stays plain greedy's (up to a near-tie, see assert_same_greedy)."""
    from tests.spec.test_spec_real import assert_same_greedy
    from tests.spec.test_spec_real import greedy as greedy_128

    path = model_path("smollm2-135m")
    drafter = write_dflash_gguf(tmp_path / "dflash.gguf", path, block_size=8, n_ff=512)
    engine = lucekv.load(path, backend="cpu", kv_pool=pool, kv_policy="lru",
                         speculation=SpecConfig(dflash_drafter=drafter))
    _, plain_out = greedy_128(engine, "off", logprobs=True)
    engine = lucekv.load(path, backend="cpu", kv_pool=pool, kv_policy="lru",
                         speculation=SpecConfig(dflash_drafter=drafter))
    spec, out = greedy_128(engine, "dflash")
    assert_same_greedy(spec, plain_out)
    usage = out[-1].usage
    assert usage.speculation.rounds >= 64 and usage.speculation.drafted >= 7 * (usage.speculation.rounds - 8)
    if pool:
        assert usage.kv_paged_chunks > 0


def test_sampling_with_the_dflash_drafter_keeps_the_targets_distribution(files):
    """400 seeded generations (~5 s): the drafter's distributions go through the rejection rule correctly."""
    from tests.spec.test_draft_model import check_rounds_keep_the_distribution

    target, drafters, _ = files
    check_rounds_keep_the_distribution(load(target, drafters[5]), "dflash")


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_verify_block_reaches_the_next_chunk_only_through_accepted_drafts(files, temperature):
    """On a paging pool a block that crosses a chunk boundary is two forwards; the second (which takes the next
    chunk's block and evicts a chunk) must run only when every draft before the boundary stood, as plain decoding
    would reach that chunk. Greedy, this random drafter's first draft is always rejected, so no block may cross;
    sampled (the rejection rule with its distributions), some drafts stand and some blocks cross."""
    from tests.spec.test_spec_engine import verify_forwards_past_a_boundary

    target, drafters, _ = files
    engine = load(target, drafters[16], pool=512)
    ids = np.random.default_rng(5).integers(10, 500, 600).tolist()
    params = SamplingParams(temperature=temperature, max_tokens=60, ignore_eos=True, seed=1)
    crossings = verify_forwards_past_a_boundary(engine, ids, params, "dflash")
    assert crossings > 0 if temperature else crossings == 0
