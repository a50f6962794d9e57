"""The CUDA mixture of experts against float64 numpy: the router's top-k, the decode products of the chosen experts
(expert ids read on the device), the prefill grouped by expert (placement, tiles, tensor-core tiles) and the
weighted sum back, through CudaOps.moe_ffn on tiny models in the simulator and at the Qwen3-30B-A3B shapes on a GPU
(see test_cuda_kernels.py for how the simulator runs these without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from lucekv.kernels.cuda import available, cuda
from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import open_gguf
from lucekv.model.synth import write_synthetic_gguf
from tests.kernels import moe_reference
from tests.kernels.cuda_sim import needs_gpu, needs_kernels, run_in_simulator
from tests.kernels.test_cuda_kernels import check_backend_matches_cpu, check_pieces_replay, rel_err


@pytest.mark.skipif(available(), reason="kernels run directly in this process")
def test_moe_in_simulator():
    run_in_simulator(__file__)


def moe_layer(path, n_tokens: int, seed: int = 1):
    """(ours [n, n_embd], float64 reference [n, n_embd], ids) of the CUDA moe_ffn of layer 0 on random inputs."""
    from lucekv.backends.cuda import CudaKVPool, CudaOps
    from lucekv.model.decoder import load_weights

    g = open_gguf(path)
    spec = ModelSpec.from_gguf(g)
    stream = cuda.stream()
    ops = CudaOps(spec, CudaKVPool(spec, 64, "f32", stream), stream)
    layer = load_weights(g, spec, ops).layers[0]
    x = np.random.default_rng(seed).standard_normal((n_tokens, spec.n_embd)).astype(np.float32)
    out = ops.moe_ffn(cuda.to_device(x, stream=stream), layer.moe, layer.ffn_norm).copy_to_host(stream=stream)
    stream.synchronize()
    x64 = x.astype(np.float64)
    norm = moe_reference.dequantized(g, "blk.0.ffn_norm.weight")
    h = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + spec.rms_eps) * norm
    ref = x64 + moe_reference.moe_ffn(h, moe_reference.moe_layer(g, 0), spec.n_expert_used, spec.arch.norm_topk)
    return out, ref


TINY = {"n_embd": 64, "n_head": 4, "n_kv_head": 2, "head_dim": 16, "n_ff": 64, "n_layer": 1, "n_expert": 8,
        "n_expert_used": 3, "seed": 4}


@needs_kernels
@pytest.mark.parametrize(("arch", "qtype", "n_tokens"), [
    ("qwen3moe", Q.Q8_0, 1), ("qwen3moe", Q.Q8_0, 5),
    # slow in the simulator (20 to 40 s of CPU each), quick on a GPU
    pytest.param("qwen2moe", Q.Q4_0, 1, marks=pytest.mark.slow),
    pytest.param("qwen2moe", Q.Q5_1, 5, marks=pytest.mark.slow),
    pytest.param("llama", Q.F32, 5, marks=pytest.mark.slow),
], ids=lambda v: getattr(v, "name", str(v)))
def test_moe_ffn_matches_float64(tmp_path, arch, qtype, n_tokens):
    """q8, q4 with a bias, q6 (Q5_1's codes) and float experts; qwen2moe's shared expert; Mixtral's renormalised
    top-k. One token takes the routed matvecs, five the grouped tensor-core path (float experts: matvecs)."""
    dims = dict(TINY, n_ff_expert=32) if arch != "llama" else TINY
    path = write_synthetic_gguf(tmp_path / "m.gguf", arch, qtype=qtype, **dims)
    out, ref = moe_layer(path, n_tokens)
    assert rel_err(out, ref) <= 2e-3


@needs_kernels
def test_spark_products_read_cold_experts_from_the_host_copy_and_filled_slots_exactly():
    """The routed matvecs (and their sum back, `routed_sum`) and the grouped matmul over Spark's storage
    (backends/cuda_spark): experts 5 and 1 placed (slots 0, 1), one spare slot; every product equals the all-resident
    one bit for bit: hot, cold (read from the host copy), after a step boundary's fill cached, and after a promotion
    placed in the demoted expert's slot. In
    the simulator a mapped array is a plain device array: this checks the remap's indexing between the two tables,
    the copies and when the remap shows them."""
    from types import SimpleNamespace

    from gguf.quants import quantize

    from lucekv.backends.cuda_spark import SparkOptions, SparkStore
    from lucekv.kernels.cpu.quants import pack
    from lucekv.kernels.cuda import moe
    from lucekv.kernels.cuda.packed import upload
    from lucekv.spark.cache import COLD
    from lucekv.spark.placement import Placement

    n_expert, rows, cols = 8, 32, 64
    rng = np.random.default_rng(6)
    w = rng.standard_normal((n_expert * rows, cols)).astype(np.float32)
    packed = pack(quantize(w, Q.Q8_0), Q.Q8_0, w.shape)
    resident = moe.resident(upload(packed), n_expert)
    store = SparkStore(SparkOptions(Placement("fp", n_expert, ((5, 1),)), spare=1, promote=1),
                       SimpleNamespace(n_layer=1, n_expert=n_expert, n_expert_used=3), "fp", cuda.stream())
    spark = store.experts(0, packed, rows)
    x = cuda.to_device(rng.standard_normal((2, cols)).astype(np.float32))

    routing = moe.Routing(store.routed_rows[0], cuda.to_device(np.array([[0.5, 0.3, 0.2]], np.float32)))

    def routed(table) -> np.ndarray:
        out = cuda.device_array((3, rows), np.float32)
        moe.routed_matvecs(table, rows, x[:1], routing, out, x_per_slot=False)
        return out.copy_to_host()

    def summed(table) -> np.ndarray:  # the down products' launch: rows of every chosen expert summed back
        out = cuda.device_array((1, rows), np.float32)
        moe.routed_sum(table, rows, x_slots, routing, x[:1, :rows], out)
        return out.copy_to_host()

    store.routed_rows[0].copy_to_device(np.array([[2, 5, 7]], np.int32))  # as a one-token step's router leaves them
    want = routed(resident)
    np.testing.assert_array_equal(routed(spark), want)  # 2, 7 cold
    x_slots = cuda.to_device(rng.standard_normal((3, cols)).astype(np.float32))
    np.testing.assert_array_equal(summed(spark), summed(resident))
    store.observe_now()  # the step boundary: 2 copied into the spare slot, not shown until its copy has completed
    assert store.slots.remap[0, 2] == 2 and store.remap.copy_to_host()[0, 2] == COLD
    store.observe_now()
    assert store.remap.copy_to_host()[0].tolist() == [COLD, 1, 2, COLD, COLD, 0, COLD, COLD]
    assert (store.stats.steps, store.stats.cold, store.stats.fills) == (2, 4, 1)
    np.testing.assert_array_equal(routed(spark), want)  # 2 from its slot
    swaps = store.promote()  # a request's end: 2 (selected twice) takes the place of 1 (never), in slot 1
    assert [(s.demoted, s.promoted) for s in swaps] == [(1, 2)] and store.slots.placement.hot == ((5, 2),)
    store.observe_now()
    assert store.remap.copy_to_host()[0].tolist() == [COLD, COLD, 1, COLD, COLD, 0, COLD, COLD]
    np.testing.assert_array_equal(routed(spark), want)  # 2 from its placed slot

    ids = cuda.to_device(np.array([[2], [7]], np.int32))  # the grouped prefill: one token each of 2 and 7
    starts, pos = cuda.device_array(n_expert + 1, np.int32), cuda.device_array((2, 1), np.int32)
    src, tiles = cuda.device_array(2, np.int32), cuda.device_array((moe.max_tiles(2, n_expert), 2), np.int32)
    moe.group(ids, n_expert, starts, pos, src, tiles, cuda.device_array((1, n_expert), np.int32))
    gathered = cuda.device_array((2, cols // 2), np.uint32)
    moe.gather(x, src, gathered, "q8")
    outs = []
    for table in (resident, spark):
        out = cuda.device_array((2, rows), np.float32)
        moe.grouped_matmul(table, rows, gathered, starts, tiles, out)
        outs.append(out.copy_to_host())
    np.testing.assert_array_equal(*outs)


@pytest.mark.slow
@needs_kernels
def test_spark_experts_cold_and_cached_give_the_resident_output_exactly(tmp_path):
    """Spark storage (backends/cuda_spark): experts 5 and 1 placed (slots 0, 1), one spare slot, the others read from
    the host copy; moe_ffn gives the all-resident output bit for bit, for one token (routed matvecs) and five (grouped
    matmul), and one token again after the cache has copied a cold expert of the step into its spare slot (slow: 60 s
    of CPU in the simulator). (In the simulator a
    mapped array is a plain device array: this checks the remap's indexing between the two tables and the copies.)"""
    from lucekv.backends.cuda import CudaKVPool, CudaOps
    from lucekv.backends.cuda_spark import SparkOptions, SparkStore
    from lucekv.model.decoder import load_weights
    from lucekv.spark.cache import COLD
    from lucekv.spark.placement import Placement

    g = open_gguf(write_synthetic_gguf(tmp_path / "m.gguf", "qwen3moe", qtype=Q.Q8_0, **TINY, n_ff_expert=32))
    spec = ModelSpec.from_gguf(g)
    x = np.random.default_rng(5).standard_normal((5, spec.n_embd)).astype(np.float32)

    def ops_of(spark: SparkOptions | None):
        stream = cuda.stream()
        ops = CudaOps(spec, CudaKVPool(spec, 64, "f32", stream), stream)
        if spark is not None:
            ops.spark = SparkStore(spark, spec, g.fingerprint, stream)
        return ops, load_weights(g, spec, ops).layers[0]

    def moe_out(ops, layer, n: int) -> np.ndarray:
        out = ops.moe_ffn(cuda.to_device(x[:n], stream=ops.stream), layer.moe, layer.ffn_norm)
        return out.copy_to_host(stream=ops.stream)

    resident, resident_layer = ops_of(None)
    want = {n: moe_out(resident, resident_layer, n) for n in (1, 5)}
    ops, layer = ops_of(SparkOptions(Placement(g.fingerprint, 8, ((5, 1),)), spare=1))
    spark = ops.spark
    for n in (5, 1):
        np.testing.assert_array_equal(moe_out(ops, layer, n), want[n])
    spark.observe_now()  # the one-token step's experts: a cold one is copied into the spare slot, not shown yet
    chosen = spark.routed.copy_to_host().reshape(-1)
    assert spark.stats.cold == len(set(chosen.tolist()) - {5, 1}) > 0 and spark.stats.fills == 1
    filled = next(e for e in chosen if e not in (5, 1))
    assert spark.slots.remap[0, filled] == 2 and spark.remap.copy_to_host()[0, filled] == COLD
    spark.observe_now()  # the next boundary shows it (its copy has completed)
    assert spark.remap.copy_to_host()[0, filled] == 2 and spark.stats.fills == 1
    np.testing.assert_array_equal(moe_out(ops, layer, 1), want[1])


@pytest.mark.slow
@needs_kernels
def test_cuda_backend_runs_an_moe_model_like_the_cpu_backend(tmp_path):
    """The decoder through CudaOps.moe_ffn: a 4-token prefill (grouped path) and 2 decode steps (routed path) of a
    tiny qwen2moe against the CPU backend (slow: 75 s of CPU in the simulator; on a GPU it is quick)."""
    check_backend_matches_cpu(tmp_path, "qwen2moe", Q.Q8_0, decode_steps=2, **TINY, n_ff_expert=32)


def check_routed_sum(qtype, n_expert: int, rows: int, cols: int, k: int, seed: int = 7) -> None:
    """routed_sum of random experts (k chosen of n_expert, `rows` x `cols` each) against the routed matvecs' rows
    combined (`combine`), with and without a shared expert: bit for bit where a slot's warps cover its columns in one
    pass, as the routed matvec's do (else the same sums in another order); and within the x quantization's rounding
    of float64."""
    from lucekv.kernels.cpu.quants import dequantize_rows
    from lucekv.kernels.cuda import matvec, moe
    from lucekv.kernels.cuda.packed import upload
    from tests.kernels.test_cuda_kernels import random_packed

    rng = np.random.default_rng(seed)
    packed = random_packed(rng, qtype, n_expert * rows, cols)
    experts = moe.resident(upload(packed), n_expert)
    ids = rng.permutation(n_expert)[:k].astype(np.int32).reshape(1, k)
    weights = rng.random((1, k)).astype(np.float32)
    x = rng.standard_normal((k, cols)).astype(np.float32)  # one token's activations, a row per chosen expert
    residual, gate, values = (rng.standard_normal((1, w)).astype(np.float32) for w in (rows, 1, rows))
    d_ids, d_weights, d_x, d_residual = (cuda.to_device(a) for a in (ids, weights, x, residual))
    routing = moe.Routing(d_ids, d_weights)
    outs = cuda.device_array((k, rows), np.float32)
    moe.routed_matvecs(experts, rows, d_x, routing, outs, x_per_slot=True)
    ref = residual[0].astype(np.float64)
    for s, e in enumerate(ids[0]):
        ref += weights[0, s] * (dequantize_rows(packed, e * rows, (e + 1) * rows).astype(np.float64) @ x[s])
    for shared in (None, (gate, values)):
        d_shared = None if shared is None else tuple(cuda.to_device(a) for a in shared)
        want, got = cuda.device_array((1, rows), np.float32), cuda.device_array((1, rows), np.float32)
        moe.combine(outs, cuda.to_device(np.arange(k, dtype=np.int32).reshape(1, k)), d_weights, d_residual, want,
                    d_shared)
        moe.routed_sum(experts, rows, d_x, routing, d_residual, got, d_shared)
        if k * -(-cols // matvec.SEGMENT) <= matvec.MAX_WARPS:
            np.testing.assert_array_equal(got.copy_to_host(), want.copy_to_host())
        else:
            np.testing.assert_allclose(got.copy_to_host(), want.copy_to_host(), rtol=1e-5, atol=1e-5)
        if shared is None:
            assert rel_err(got.copy_to_host()[0], ref) <= 1e-3


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_1, pytest.param(Q.Q8_0, marks=pytest.mark.slow)],
                         ids=lambda q: q.name)
def test_routed_sum_is_the_routed_products_combined_bit_for_bit(qtype):
    """routed_sum, a decode step's down products summing themselves back into the residual in one launch (q4 with a
    bias, q6 and, slow, q8: 4 s of CPU each in the simulator). 20 rows an expert: a block's rows run past the last."""
    check_routed_sum(qtype, n_expert=6, rows=20, cols=32, k=2)


@pytest.mark.slow
@needs_kernels
def test_routed_sum_of_wide_experts_takes_passes():
    """16 chosen experts of 2048 columns: a warp per slot, each over its row in two passes (slow: ~25 s of CPU in
    the simulator)."""
    check_routed_sum(Q.Q4_0, n_expert=17, rows=8, cols=2048, k=16)


@needs_kernels
def test_router_top_k_and_grouping_are_exact():
    """route and route_prefill: ids and weights of a softmax top-k, ties to the lower id across lanes (3, 7) and
    within one (3, 35: lane l holds experts l, l + 32), weights renormalised or not;
    group: a stable placement by expert, the tile map of each expert's rows, tiles past the last marked -1."""
    from lucekv.kernels.cpu.quants import pack
    from lucekv.kernels.cuda import moe
    from lucekv.kernels.cuda.packed import upload

    n_expert, n_embd, k = 40, 32, 4
    rng = np.random.default_rng(2)
    router = rng.standard_normal((n_expert, n_embd)).astype(np.float32)
    router[7] = router[35] = router[3]  # ties: expert 3 must come first, then 7
    x = rng.standard_normal((6, n_embd)).astype(np.float32)
    x[0] = router[3] * np.float32(3 / n_embd)  # token 0 picks 3, 7 and 35, equal
    ids = cuda.device_array((6, k), np.int32)
    weights = cuda.device_array((6, k), np.float32)
    logits = cuda.device_array((6, n_expert), np.float32)
    parts = cuda.device_array(moe.router_parts(6, n_expert, n_embd), np.float32)
    w = upload(pack(router, Q.F32, router.shape))
    for renormalise in (False, True):
        ref_ids, ref_w = moe_reference.route(x.astype(np.float64), router.astype(np.float64), k, renormalise)
        for prefill in (False, True):  # one token's kernel (over six here), the prefill's tiles and top-k
            if prefill:
                moe.route_prefill(w, cuda.to_device(x), parts, logits, ids, weights, renormalise)
            else:
                moe.route(w, cuda.to_device(x), None, logits, ids, weights, renormalise)
            np.testing.assert_array_equal(ids.copy_to_host(), ref_ids)
            np.testing.assert_allclose(weights.copy_to_host(), ref_w, rtol=1e-5)
            assert ids.copy_to_host()[0, :3].tolist() == [3, 7, 35]

    slots = np.array([[2, 0], [2, 1], [0, 2], [2, 0]], np.int32)
    starts = cuda.device_array(5, np.int32)
    pos, src = cuda.device_array((4, 2), np.int32), cuda.device_array(8, np.int32)
    tiles = cuda.device_array((moe.max_tiles(8, 4), 2), np.int32)
    moe.group(cuda.to_device(slots), 4, starts, pos, src, tiles, cuda.device_array((1, 4), np.int32))
    assert starts.copy_to_host().tolist() == [0, 3, 4, 8, 8]
    assert src.copy_to_host().tolist() == [0, 2, 3, 1, 0, 1, 2, 3]  # expert 0: tokens 0, 2, 3; 1: 1; 2: 0, 1, 2, 3
    assert pos.copy_to_host().tolist() == [[4, 0], [5, 3], [1, 6], [7, 2]]
    assert tiles.copy_to_host().tolist() == [[0, 0], [1, 3], [2, 4]] + [[-1, 0]] * (len(tiles) - 3)


@needs_kernels
def test_route_prefill_of_a_quantized_router_matches_float64():
    """route_prefill decodes a quantized router's elements in its tiles (Q8_0, Q4_0 and Q5_1: the device's q8, q4
    and q6 forms; GGUF routers are F32 as llama.cpp keeps them, but a file may hold another kind): the float64 top-k
    of the dequantized router, over 34 tokens (two token tiles) and two column splits."""
    from gguf.quants import dequantize, quantize

    from lucekv.kernels.cpu.quants import pack
    from lucekv.kernels.cuda import moe
    from lucekv.kernels.cuda.packed import upload

    n, n_expert, n_embd, k = 34, 12, 320, 4
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, n_embd)).astype(np.float32)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_1):
        raw = quantize((rng.standard_normal((n_expert, n_embd)) / 8).astype(np.float32), qtype)
        router = dequantize(raw, qtype).reshape(n_expert, n_embd).astype(np.float64)
        ids, weights = cuda.device_array((n, k), np.int32), cuda.device_array((n, k), np.float32)
        moe.route_prefill(upload(pack(raw, qtype, (n_expert, n_embd))), cuda.to_device(x),
                          cuda.device_array(moe.router_parts(n, n_expert, n_embd), np.float32),
                          cuda.device_array((n, n_expert), np.float32), ids, weights, True)
        ref_ids, ref_w = moe_reference.route(x.astype(np.float64), router, k, True)
        np.testing.assert_array_equal(ids.copy_to_host(), ref_ids)
        np.testing.assert_allclose(weights.copy_to_host(), ref_w, rtol=1e-4)


@needs_kernels
def test_grouping_over_several_blocks_is_a_stable_sort():
    """group over three blocks of slots (560 = 70 tokens x top-8 of 16 experts) and with the most experts (256): the
    rows, runs and tile map of numpy's stable argsort of the flattened ids."""
    from lucekv.kernels.cuda import matmul as mm
    from lucekv.kernels.cuda import moe

    rng = np.random.default_rng(3)
    for n, k, n_expert in ((70, 8, 16), (40, 3, moe.MAX_EXPERTS)):
        ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n)]).astype(np.int32)
        starts, pos = cuda.device_array(n_expert + 1, np.int32), cuda.device_array((n, k), np.int32)
        src = cuda.device_array(n * k, np.int32)
        tiles = cuda.device_array((moe.max_tiles(n * k, n_expert), 2), np.int32)
        counts = cuda.device_array((moe.group_blocks(n * k), n_expert), np.int32)
        moe.group(cuda.to_device(ids), n_expert, starts, pos, src, tiles, counts)
        order = np.argsort(ids.reshape(-1), kind="stable")
        rows = np.empty(n * k, np.int64)
        rows[order] = np.arange(n * k)
        per_expert = np.bincount(ids.reshape(-1), minlength=n_expert)
        first = np.concatenate([[0], np.cumsum(per_expert)])
        want_tiles = [[e, first[e] + j * mm.TOKENS] for e in range(n_expert)
                      for j in range(-(-per_expert[e] // mm.TOKENS))]
        assert starts.copy_to_host().tolist() == first.tolist()
        assert src.copy_to_host().tolist() == (order // k).tolist()
        assert pos.copy_to_host().reshape(-1).tolist() == rows.tolist()
        assert tiles.copy_to_host().tolist() == want_tiles + [[-1, 0]] * (len(tiles) - len(want_tiles))


# ---- the GPU, at the Qwen3-30B-A3B shapes: 128 experts, top-8, n_embd 2048, experts 768 wide ------------------

A3B = {"n_embd": 2048, "n_head": 32, "n_kv_head": 4, "head_dim": 128, "n_ff": 6144, "n_ff_expert": 768,
       "n_layer": 1, "n_expert": 128, "n_expert_used": 8}


@pytest.fixture(scope="module")
def a3b_layer(tmp_path_factory):
    """`a3b_layer(qtype)`: a one-layer qwen3moe file of those shapes, every matrix in qtype, written once."""
    written = {}

    def path(qtype):
        if qtype not in written:
            written[qtype] = write_synthetic_gguf(tmp_path_factory.mktemp("a3b") / f"{qtype.name}.gguf", "qwen3moe",
                                                  qtype=qtype, vocab=512, **A3B)
        return written[qtype]

    return path


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n_tokens", [1, 3, 512], ids=["decode", "short", "prefill"])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0], ids=lambda q: q.name)
def test_moe_ffn_at_qwen3_30b_a3b_shapes_gpu(a3b_layer, qtype, n_tokens):
    out, ref = moe_layer(a3b_layer(qtype), n_tokens)
    err = rel_err(out, ref)
    print(f"{qtype.name}, {n_tokens} tokens: max relative error {err:.2e}")
    assert err <= 2e-3


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_routed_sum_at_qwen3_30b_a3b_shapes_gpu(qtype):
    """The down products of 8 of 128 experts (2048 x 768) summed back by routed_sum: the two launches' sums bit for
    bit, within rounding of float64."""
    check_routed_sum(qtype, n_expert=A3B["n_expert"], rows=A3B["n_embd"], cols=A3B["n_ff_expert"],
                     k=A3B["n_expert_used"])


@pytest.mark.gpu
@needs_gpu
def test_upcycled_smollm2_on_cuda_equals_the_cpu_backend_gpu(tmp_path, model_path):
    """CUDA against CPU on the upcycled smollm2 (4 identical experts, top-2): logits within the parity bench's bound,
    64 greedy tokens identical (decode steps replayed from the captured graph, expert ids read on the device)."""
    from lucekv.bench.parity import compare
    from lucekv.model.synth import write_upcycled_gguf

    path = write_upcycled_gguf(tmp_path / "moe.gguf", model_path("smollm2-135m"))
    for kv_dtype in ("f32", "f16"):
        result = compare(str(path), 64, kv_dtype)
        print(result)
        assert result["max_rel_logit_err"] <= 1e-2 and result["differing_positions"] == 0


def cpu_moe_given_routing(path, calls: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], monkeypatch
                          ) -> tuple[float, float]:
    """The CPU backend's MoE FFN of each recorded (layer, x, ids, out) call, on the same x, taking the experts `ids`
    instead of its own router's (weighted by its own router's probabilities): the largest relative error of `out`
    against it, and the largest router-logit margin by which the CPU router's own choice beat a given pick (0 where
    they agree)."""
    from lucekv.backends import cpu
    from lucekv.model.decoder import load_weights

    g = open_gguf(path)
    spec = ModelSpec.from_gguf(g)
    ops = cpu.CpuOps(spec, cpu.KVPool(spec, 64, "f32"))
    layers = load_weights(g, spec, ops).layers
    own_route, given_ids, margins = cpu.route, [], [0.0]

    def given(logits, k, renormalise):
        own, _ = own_route(logits, k, renormalise)
        ids = given_ids[-1]
        lg = logits.astype(np.float64)
        p = np.exp(lg - lg.max(axis=1, keepdims=True))
        w = np.take_along_axis(p / p.sum(axis=1, keepdims=True), ids, axis=1)
        w = w / w.sum(axis=1, keepdims=True) if renormalise else w
        for t in range(len(ids)):
            dropped, added = set(own[t]) - set(ids[t]), set(ids[t]) - set(own[t])
            if dropped:
                margins.append(max(lg[t, list(dropped)]) - min(lg[t, list(added)]))
        return ids, w.astype(np.float32)

    monkeypatch.setattr(cpu, "route", given)
    err = 0.0
    for layer, x, ids, out in calls:
        given_ids.append(ids)
        ref = ops.moe_ffn(x, layers[layer].moe, layers[layer].ffn_norm)
        err = max(err, rel_err(out - x, ref - x))  # the FFN's output, not the residual it is added to
    return err, max(margins)


@pytest.mark.gpu
@needs_gpu
def test_upcycled_distinct_experts_on_cuda_equal_the_cpu_layer_by_layer_gpu(tmp_path, model_path, monkeypatch):
    """Distinct experts (another layer's FFN, down scaled by 1/2, 1 or 2) make the output depend on which experts
    are picked and how they are weighted, so this catches wrong expert indexing, weights or layers on a real model's
    quantized experts (Q4_1) at real widths, through the grouped prefill path (64 tokens) and the decode one.

    Logits of the whole model cannot be compared: a pick is discontinuous, and this model amplifies rounding (two CPU
    runs, f32 and f16 K/V, differ by 0.996 relative in a 64-token prompt's logits; given the same picks still by
    2.1e-2; CUDA against the CPU given CUDA's picks by 6.7e-2). So each MoE FFN the CUDA forwards run is recorded
    (its input x, its picks, its output) and the CPU computes the same layer on the same x with the same picks: they
    must agree within the tensor-core products' float16 rounding, and where the CPU's own router would have picked
    otherwise it must be a near-tie (router logits are about N(0, 1) here). Checked on the CPU against itself: the
    same picks agree within 1.1e-6; one wrong pick in one layer gives 8.7e-2 and a margin of 0.44."""
    from lucekv.backends.cuda import CudaBackend, CudaOps
    from lucekv.bench.parity import PROSE
    from lucekv.kernels.cuda import moe
    from lucekv.model.synth import write_upcycled_gguf
    from lucekv.model.tokenizer import Tokenizer

    path = write_upcycled_gguf(tmp_path / "moe.gguf", model_path("smollm2-135m"), distinct=True)
    g = open_gguf(path)
    spec = ModelSpec.from_gguf(g)
    calls, routed, own_moe, own_route, own_route_prefill = [], [], CudaOps.moe_ffn, moe.route, moe.route_prefill

    def route(*args, **kwargs):
        own_route(*args, **kwargs)
        routed.append(args[4])  # the ids the router wrote

    def route_prefill(*args, **kwargs):
        own_route_prefill(*args, **kwargs)
        routed.append(args[4])

    def recorded(self, x, m, norm):
        out = own_moe(self, x, m, norm)
        self.stream.synchronize()
        calls.append((m.layer, x.copy_to_host(), routed.pop().copy_to_host(), out.copy_to_host()))
        return out

    monkeypatch.setattr(moe, "route", route)
    monkeypatch.setattr(moe, "route_prefill", route_prefill)
    monkeypatch.setattr(CudaOps, "moe_ffn", recorded)
    backend = CudaBackend(g, spec, "f32", 256, use_graph=False)
    tokens = np.array(Tokenizer.from_metadata(g.metadata).encode(PROSE * 4)[:64], np.int32)
    positions = np.arange(len(tokens), dtype=np.int32)
    backend.forward(tokens, positions, positions)  # the grouped path
    backend.forward(tokens[:1], positions[-1:] + 1, positions[-1:] + 1)  # one token: the routed matvecs
    assert len(calls) == 2 * spec.n_layer
    err, margin = cpu_moe_given_routing(path, calls, monkeypatch)
    print(f"max relative error of a layer's MoE FFN {err:.2e}, largest margin of a routing disagreement {margin:.2e}")
    assert err <= 1e-2
    assert margin <= 1e-2


@pytest.mark.gpu
@needs_gpu
def test_moe_graphs_replay_the_eager_forwards_gpu(tmp_path, monkeypatch):
    """qwen2moe (a shared expert beside 8 routed ones, top-3): prompt pieces (full prefill chunks, a short piece
    padded to the chunk's width: padding rows routed too) and decode steps replayed from captured graphs give the
    eager backend's logits exactly, whatever the routing of each replay (check_pieces_replay)."""
    from lucekv.backends.cuda import CudaBackend

    monkeypatch.setattr(CudaBackend, "prefill_chunk", 16)
    g = open_gguf(write_synthetic_gguf(tmp_path / "m.gguf", "qwen2moe", qtype=Q.Q4_K, n_embd=256, n_head=4,
                                       n_kv_head=2, head_dim=64, n_ff=512, n_ff_expert=256, n_layer=3, n_expert=8,
                                       n_expert_used=3))
    assert check_pieces_replay(g, ModelSpec.from_gguf(g), [16, 16, 16, 5], decode_steps=40, pool=256) == {16}
