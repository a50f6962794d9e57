"""Speculative verify on the CUDA backend: each row's argmax taken on the device, verify widths replayed from
captured graphs, and the engine's rounds on the GPU equal to its plain greedy decoding.

Without a GPU, `test_in_simulator` runs this file again under numba's CUDA simulator, where only the backend-level
test runs (a forward takes minutes there, so it stands in for the model's); the rest are `gpu` tests (the last:
speculating requests batched with plain ones):
    pytest -q -m gpu tests/spec/test_spec_cuda.py
"""

from __future__ import annotations

import numpy as np
import pytest

import lucekv
from lucekv.engine.sampling import SamplingParams
from lucekv.engine.types import Usage
from lucekv.kernels.cuda import available, cuda
from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import open_gguf
from lucekv.model.synth import write_synthetic_gguf
from tests.kernels.cuda_sim import needs_gpu, needs_kernels, run_in_simulator
from tests.spec.test_spec_engine import OracleDrafter

gpu = pytest.mark.gpu
VOCAB = 512
POOLS = {"whole": (None, "lru"), "paged": (512, "lru"), "paged by queries": (512, "quest")}


@pytest.mark.skipif(available(), reason="runs directly in this process")
def test_in_simulator():
    run_in_simulator(__file__)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("spec_cuda") / "tiny.gguf", "llama", n_ctx=4096,
                                vocab=VOCAB)


def cuda_backend(model, **kw):
    from lucekv.backends.cuda import CudaBackend

    g = open_gguf(model)
    return CudaBackend(g, ModelSpec.from_gguf(g), "f32", 512, **kw)


@needs_kernels
def test_forward_argmax_takes_each_rows_argmax_on_the_device(model, monkeypatch):
    import lucekv.backends.cuda as cuda_module

    backend = cuda_backend(model, use_graph=False)
    logits = np.random.default_rng(1).standard_normal((5, VOCAB)).astype(np.float32)
    logits[3, 17] = logits[3, 400] = 50.0  # a tie: the first index, as numpy's argmax
    monkeypatch.setattr(cuda_module, "forward", lambda *args, **kw: cuda.to_device(logits))
    slots = np.array([3, 4, 5, 6, 7], np.int32)
    pos = slots + 100
    got = backend.forward_argmax(np.array([1, 2, 3, 4, 5], np.int32), pos, slots, tables=[np.array([0], np.int32)])
    assert got.tolist() == np.argmax(logits, axis=1).tolist()
    assert backend.pool.slot_pos[slots].tolist() == pos.tolist()


@gpu
@needs_gpu
@pytest.mark.parametrize("n", [2, 5, 17])
def test_a_verify_width_replayed_from_its_graph_equals_its_eager_run(model, n):
    """The graph of the width's bucket, captured from a padded forward and replayed (padding rows first), against
    the same block run eagerly and unpadded on a backend without graphs."""
    from lucekv.backends.cuda import verify_bucket
    from tests.kernels.test_cuda_kernels import F16_PREFILL, rel_err

    rng = np.random.default_rng(n)
    prefix = rng.integers(10, 500, 40).astype(np.int32)
    tokens = rng.integers(10, 500, n).astype(np.int32)
    pos, p = np.arange(40, dtype=np.int32), np.arange(40, 40 + n, dtype=np.int32)
    backend, plain = cuda_backend(model), cuda_backend(model, use_graph=False)
    for b in (backend, plain):
        b.forward(prefix, pos, pos)
    eager, eager_logits = plain.forward_argmax(tokens, p, p), plain.forward(tokens, p, p, all_logits=True)
    first = backend.forward_argmax(tokens, p, p)
    assert backend.verify_graphs[verify_bucket(n)].ready
    replayed = backend.forward_argmax(tokens, p, p)
    logits = backend.forward(tokens, p, p, all_logits=True)  # the same graph, its logits to the host
    assert logits.shape == eager_logits.shape and rel_err(logits, eager_logits) <= F16_PREFILL
    assert first.tolist() == replayed.tolist() == eager.tolist() == np.argmax(logits[:, :VOCAB], axis=1).tolist()


def plain_and_oracle_greedy_on_the_gpu(model, pool, mode: str, oracle, policy: str = "lru"
                                       ) -> tuple[list[int], list[int], Usage]:
    """150 greedy tokens after one 700-token prompt on CUDA, each run on a fresh engine: plainly, then speculating
    with `mode`, whose drafter is `oracle` (a drafter class) of the prompt and the plain tokens. Returns (plain
    tokens, speculative tokens, the speculative run's last usage). `policy` quest reselects every ~16 tokens."""
    ids = np.random.default_rng(7).integers(10, 500, 700).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)

    def run(speculation, reference=None):
        engine = lucekv.load(model, backend="cuda", kv_dtype="f32", kv_pool=pool, kv_policy=policy,
                             kv_tau=8 if policy == "quest" else 64)
        if reference is not None:
            engine.drafters[speculation] = lambda: oracle(reference)
        out = list(engine.generate(ids, params, speculation=speculation))
        return [t for d in out for t in d.token_ids], out[-1].usage

    plain, _ = run("off")
    spec, usage = run(mode, ids + plain)
    return plain, spec, usage


@gpu
@needs_gpu
@pytest.mark.parametrize(("pool", "policy"), POOLS.values(), ids=POOLS.keys())
def test_greedy_rounds_on_the_gpu_equal_its_plain_greedy(model, pool, policy):
    """(Paged by queries: the verify blocks' queries the quest window takes are the graphs' recent rows.)"""
    plain, spec, usage = plain_and_oracle_greedy_on_the_gpu(model, pool, "suffix", OracleDrafter, policy)
    assert spec == plain
    assert 0 < usage.speculation.accepted < usage.speculation.drafted


@gpu
@needs_gpu
def test_speculating_requests_batched_on_the_gpu_decode_what_the_cpu_does(model):
    """Rounds (verify blocks replayed from their graphs, with a budget cut at chunk boundaries) in steps beside other
    sequences' decode rows (the bucket graphs) on CUDA: every greedy request's tokens are the CPU backend's plain
    greedy ones (these synthetic models' top tokens are far apart; see tests/engine/test_batching.py)."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(10, 500, n).tolist() for n in (700, 40, 300, 90)]
    modes = ["suffix", "off", "suffix", "auto"]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    cpu = lucekv.load(model, backend="cpu", kv_dtype="f16", kv_pool=512, kv_policy="lru")
    plain = [[t for d in cpu.generate(ids, params) for t in d.token_ids] for ids in prompts]
    references = [ids + out for ids, out in zip(prompts, plain, strict=True)]

    class Oracle(OracleDrafter):
        def begin(self, tokens, params=None):
            super().begin(tokens, params)
            self.reference = next(r for r in references if r[: len(tokens)] == list(tokens))

    engine = lucekv.load(model, backend="cuda", kv_dtype="f16", kv_pool=512, kv_policy="lru", max_batch=4)
    engine.drafters["suffix"] = lambda: Oracle([])
    requests = [engine.submit(ids, params, speculation=mode) for ids, mode in zip(prompts, modes, strict=True)]
    while engine.has_work:
        engine.step()
    assert [[t for d in r.out for t in d.token_ids] for r in requests] == plain
    usage = [r.out[-1].usage.speculation for r in requests]
    assert usage[0].rounds > 0 and usage[2].rounds > 0 and usage[1] is None
    assert engine.backend.verify_graphs and engine.backend.row_graphs


@needs_kernels
def test_captured_features_are_the_layers_outputs_copied_as_made(model, monkeypatch):
    """A DFlash drafter's features on CUDA: while capture_layers names layers, forwards run eagerly (a one-token
    verify too, not the decode graph) and each named layer's output is copied to the host when the decoder hands it
    out (its buffer is reused two layers on: here the fake decoder overwrites it at once), in capture_layers'
    order."""
    import lucekv.backends.cuda as cuda_module

    backend = cuda_backend(model, use_graph=False)
    d = backend.spec.n_embd

    def fake_forward(spec, weights, ops, tokens, positions, slots, all_logits, capture=None):
        buffer = cuda.to_device(np.zeros((len(tokens), d), np.float32))
        for layer in range(spec.n_layer):
            buffer.copy_to_device(np.full((len(tokens), d), layer + 1, np.float32))
            if capture is not None:
                capture(layer, buffer)
        return cuda.to_device(np.eye(len(tokens), VOCAB, dtype=np.float32))

    monkeypatch.setattr(cuda_module, "forward", fake_forward)
    monkeypatch.setattr(backend, "decode_ahead", lambda *a, **kw: pytest.fail("the decode graph ran"))
    backend.capture_layers = (1, 0)
    for n in (1, 3):
        slots = np.arange(n, dtype=np.int32)
        assert backend.forward_argmax(np.arange(n, dtype=np.int32), slots, slots).tolist() == list(range(n))
        assert backend.captured.shape == (n, 2 * d)
        assert (backend.captured[:, :d] == 2).all() and (backend.captured[:, d:] == 1).all()
    backend.forward(np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int32))
    assert backend.captured.shape == (4, 2 * d)


@gpu
@needs_gpu
@pytest.mark.parametrize("pool", [None, 512], ids=["whole", "paged"])
def test_greedy_with_a_dflash_drafter_beside_a_gpu_target_equals_plain_greedy(model, tmp_path, pool):
    """The target on CUDA (its features captured eagerly), the drafter on the CPU: plain greedy's tokens, and the
    CUDA features equal the CPU backend's."""
    from lucekv.model.synth import write_dflash_gguf
    from lucekv.spec.config import SpecConfig

    drafter = write_dflash_gguf(tmp_path / "dflash.gguf", model, target_layers=[0, 1], block_size=8)
    ids = np.random.default_rng(7).integers(10, 500, 700).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    def run(mode):
        engine = lucekv.load(model, backend="cuda", kv_dtype="f32", kv_pool=pool, kv_policy="lru",
                             speculation=SpecConfig(dflash_drafter=drafter))
        out = list(engine.generate(ids, params, speculation=mode))
        return [t for d in out for t in d.token_ids], out[-1].usage

    plain, _ = run("off")
    for mode in ("dflash", "dflash-tree"):  # (a tree block's features: captured eagerly too)
        spec, usage = run(mode)
        assert spec == plain
        assert usage.speculation.rounds >= 20
    from lucekv.backends.cpu import CpuBackend

    g = open_gguf(model)
    backends = (cuda_backend(model), CpuBackend(g, ModelSpec.from_gguf(g), "f32", 512))
    for b in backends:
        b.capture_layers = (1, 0)
        b.forward(np.array(ids[:40], np.int32), np.arange(40, dtype=np.int32), np.arange(40, dtype=np.int32))
    gpu_features, cpu_features = (b.captured for b in backends)
    assert np.max(np.abs(gpu_features - cpu_features)) < 1e-3 * np.max(np.abs(cpu_features))


# ---- draft trees (lucekv.spec.tree) ---------------------------------------------------------------------------


@needs_kernels
def test_forward_tree_marks_its_block_by_index_and_hands_its_masks_to_attention(model, monkeypatch):
    """With a stand-in forward: node j's slot takes position start + j (host and device maps), its query the root's
    position plus its depth, the attention its ancestor rows; greedy takes each row's argmax on the device. Then an
    accepted path's K/V moves (copy_kv) as numpy's moves in order."""
    import lucekv.backends.cuda as cuda_module
    from lucekv.kernels.cuda.attention import tree_rows
    from lucekv.spec.tree import DraftTree

    backend = cuda_backend(model, use_graph=False)
    tree = DraftTree([5, 6, 7, 8], [0, 0, 1, 3])
    logits = np.random.default_rng(2).standard_normal((5, VOCAB)).astype(np.float32)
    seen = {}

    def stand_in(spec, weights, ops, tokens, positions, slots, all_logits, **kw):
        seen["tree"], seen["positions"] = ops.tree.copy_to_host(), ops.positions.copy_to_host()
        return cuda.to_device(logits)
    monkeypatch.setattr(cuda_module, "forward", stand_in)
    start, slots = 100, np.arange(100, 105, dtype=np.int32)
    got = backend.forward_tree(np.arange(1, 6, dtype=np.int32), start + tree.depths(), slots, tree.ancestors(),
                               np.array([0, 1], np.int32), greedy=True)
    assert got.tolist() == np.argmax(logits, axis=1).tolist()
    assert backend.pool.slot_pos[slots].tolist() == backend.pool.d_slot_pos.copy_to_host()[slots].tolist() == list(
        range(100, 105))
    assert seen["positions"].tolist() == [100, 101, 101, 102, 103]
    np.testing.assert_array_equal(seen["tree"], tree_rows(start, tree.ancestors()))
    kv = np.random.default_rng(3).standard_normal(backend.pool.kv.shape).astype(backend.pool.kv.dtype)
    backend.pool.kv.copy_to_device(kv)
    backend.copy_kv(np.array([102, 104], np.int32), np.array([101, 102], np.int32))  # path [0, 2, 4]
    kv[:, :, 101] = kv[:, :, 102].copy()
    kv[:, :, 102] = kv[:, :, 104]
    np.testing.assert_array_equal(backend.pool.kv.copy_to_host(), kv)


@gpu
@needs_gpu
@pytest.mark.parametrize(("pool", "policy"), POOLS.values(), ids=POOLS.keys())
def test_greedy_tree_rounds_on_the_gpu_equal_its_plain_greedy(model, pool, policy):
    """Tree verify blocks replayed from the verify graphs (masks in their fixed buffers), accepted paths moved."""
    from tests.spec.test_tree_engine import OracleTreeDrafter

    plain, tree, usage = plain_and_oracle_greedy_on_the_gpu(model, pool, "suffix-tree", OracleTreeDrafter, policy)
    assert tree == plain
    assert usage.speculation.rounds < len(plain) / 2


@gpu
@needs_gpu
def test_a_tree_forward_on_the_gpu_equals_the_cpus(model):
    """The same tree block after the same context: CUDA (graph replay, and eager) against the CPU backend's logits."""
    from lucekv.backends.cpu import CpuBackend
    from lucekv.spec.tree import DraftTree
    from tests.kernels.test_cuda_kernels import rel_err

    g = open_gguf(model)
    spec = ModelSpec.from_gguf(g)
    rng = np.random.default_rng(5)
    prefix = rng.integers(10, 500, 70).astype(np.int32)
    tree = DraftTree(rng.integers(10, 500, 11).tolist(), [0, 0, 1, 1, 2, 3, 3, 5, 7, 7, 9])
    tokens = np.array([int(prefix[-1]), *tree.tokens], np.int32)
    pos = np.arange(69, dtype=np.int32)
    slots = 69 + np.arange(len(tokens), dtype=np.int32)
    table = np.array([0, 1], np.int32)
    results = []
    for backend in (CpuBackend(g, spec, "f32", 512), cuda_backend(model), cuda_backend(model, use_graph=False)):
        backend.forward(prefix[:-1], pos, pos, tables=[table])
        results.append(backend.forward_tree(tokens, 69 + tree.depths(), slots, tree.ancestors(), table))
    assert rel_err(results[1], results[0]) <= 1e-3 and rel_err(results[2], results[0]) <= 1e-3
