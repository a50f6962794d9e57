"""Tiny random-weight GGUF models for tests, laid out the way llama.cpp's converter writes real ones.

`write_synthetic_gguf` covers llama, qwen2, qwen3 and gemma3, and the mixture-of-experts families qwen2moe, qwen3moe
and Mixtral-style llama (llama with experts), with every weight matrix in one quant type (or per-tensor overrides),
norms, biases and routers in F32, llama.cpp's tensor names and metadata keys, and a small real tokenizer (byte-level
BPE; SentencePiece-style for gemma3, as real Gemma files have) so that both lucekv and Hugging Face transformers can
load the file. `write_upcycled_gguf` turns a real dense llama file into a Mixtral-style MoE, and
`write_qwen3_30b_a3b_shape` writes the MoE speed model; both from the command line too:
`python -m lucekv.model.synth {upcycle DENSE OUT [--distinct] [--router kmeans --corpus FILE] | qwen3-30b-a3b OUT
[--layers N] [--router zipf]}`; `write_dflash_gguf` writes a DFlash drafter for a target (`... dflash TARGET OUT
[--layers 1,27] [--block 16] [--draft-layers 2]`).

Block sizes: every matrix row (its input width) must be a multiple of the quant type's block, i.e. 32
for Q4_0..Q8_0 and 256 for the K-quants. The defaults (n_embd=64, head_dim=16, n_ff=128) suit the
32-blocks; for K-quants pass e.g. n_embd=256, n_head=4, head_dim=64, n_ff=512.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    MODEL_TENSOR,
    TENSOR_NAMES,
    GGMLQuantizationType,
    GGUFValueType,
    GGUFWriter,
    RopeScalingType,
    TokenType,
)
from gguf.quants import dequantize, quantize

from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import Reader, open_gguf

Q = GGMLQuantizationType
ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
MOE_ARCHS = ("llama", "qwen2moe", "qwen3moe")  # llama with n_expert > 0: Mixtral-style
_DENSE_SIBLING = {"qwen2moe": "qwen2", "qwen3moe": "qwen3"}  # whose attention, tokenizer and constants they share
K_QUANTS = frozenset({Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})
SUPPORTED_QTYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}) | K_QUANTS

# Byte offsets of the f16 super-block scale `d` and of the min scale `dmin` in one K-quant block
# (block_q*_K in ggml-common.h); Q3_K and Q6_K are symmetric and have no min.
_KQUANT_SCALE_OFFSETS: dict[GGMLQuantizationType, tuple[int, int | None]] = {
    Q.Q2_K: (80, 82), Q.Q3_K: (108, None), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, None),
}

# tokenizer.ggml.pre: the pre-tokenizer (text splitting) llama.cpp and transformers both know by this name.
_BPE_PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}
_ROPE_BASE = {"llama": 10_000.0, "qwen2": 1_000_000.0, "qwen3": 1_000_000.0, "gemma3": 1_000_000.0}
_RMS_EPS = {"llama": 1e-5, "qwen2": 1e-6, "qwen3": 1e-6, "gemma3": 1e-6}

# Text the toy tokenizers learn their merges from: English and a little code, so common pieces exist.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun and the fox runs into the forest.
A model reads the tokens of the prompt, then writes one token at a time until it reaches the end.
def main(args):
    for item in args.items:
        if item is not None:
            print(item.name, item.value)
    return 0
Hello, world! How are you today? I am fine, thank you. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024.
"""

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + ('model' if message['role'] =="
    " 'assistant' else message['role']) + '\\n' + message['content'] + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class _Dims:
    n_embd: int
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_ff: int
    n_ctx: int
    sliding_window: int
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_expert: int = 0
    n_ff_shared: int = 0


@dataclass(frozen=True)
class _TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order: ([experts,] rows, cols), cols being the row length ggml blocks run along
    kind: str  # "matrix" | "router" (a matrix llama.cpp keeps in F32) | "norm" | "bias"
    gain: float = 1.0  # matrices: std = gain / sqrt(row length)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True)
class _SynthTokenizer:
    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece-style)
    pre: str
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    bos_id: int
    eos_id: int
    unk_id: int | None
    pad_id: int
    add_bos: bool
    chat_template: str


def write_synthetic_gguf(
    path: str | Path,
    arch: str,
    *,
    qtype: GGMLQuantizationType = Q.Q8_0,
    seed: int = 0,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_kv_head: int = 2,
    head_dim: int = 16,
    n_ff: int = 128,
    vocab: int | None = None,
    n_ctx: int = 512,
    tied_output: bool | None = None,
    sliding_window: int = 8,
    qtype_overrides: dict[str, GGMLQuantizationType] | None = None,
    rope_scaling: dict | None = None,
    n_expert: int = 0,
    n_expert_used: int = 2,
    n_ff_expert: int | None = None,
    n_ff_shared: int | None = None,
    router_zipf: float | None = None,
) -> Path:
    """Write a random-weight `arch` model to `path` and return the path.

    `qtype` applies to every 2-D weight; `qtype_overrides` maps a tensor-name suffix (e.g.
    "ffn_down.weight", "token_embd.weight") to another type. `vocab` pads the tokenizer's own vocabulary
    (a few hundred tokens) with unused tokens. `tied_output=None` ties the output projection to the
    embeddings for gemma3 only, as real Gemma files do. `sliding_window` is used by gemma3 alone, whose
    layers are 5 local : 1 global (pass n_layer >= 6 to get a global layer). `rope_scaling` is a Hugging Face
    config's (`{"rope_type": "linear" | "yarn" | "llama3", "factor": ..., ...}`), written as llama.cpp's converter
    writes it: metadata for linear and YaRN, a `rope_freqs.weight` tensor of per-pair factors for llama3.

    Experts (`n_expert` > 0; qwen2moe and qwen3moe need them, llama with them is Mixtral-style): every layer's FFN is
    a router (ffn_gate_inp, F32 as llama.cpp keeps it) over `n_expert` experts of width `n_ff_expert` (default n_ff),
    stacked into ffn_{gate,up,down}_exps, `n_expert_used` of them per token; qwen2moe adds a shared expert of width
    `n_ff_shared` (default n_ff) and its gate ffn_gate_inp_shexp. `router_zipf` = s: routers whose expert popularity
    follows Zipf's law of exponent s (lucekv.spark.router.zipf_row_norms), said in general.name, where random ones
    route every expert alike.

    Weights are N(0, gain / sqrt(row length)): q, k, output and embeddings at gain 1 so that attention
    scores and logits are O(1) (attention that is not uniform makes position bugs visible), the other
    matrices at gain 0.5 so the residual stream stays well-conditioned over layers. Norm weights are
    1 + N(0, 0.1), biases N(0, 0.1). K-quants (which gguf cannot quantize to) are random blocks scaled
    to the same spread.
    """
    supported = dict.fromkeys(ARCHS + MOE_ARCHS)
    if arch not in supported:
        raise ValueError(f"arch {arch!r} is not supported (supported: {', '.join(supported)})")
    if n_head % n_kv_head:
        raise ValueError(f"n_head {n_head} is not a multiple of n_kv_head {n_kv_head}")
    if arch in _DENSE_SIBLING and n_expert == 0:
        raise ValueError(f"{arch} needs n_expert > 0")
    if n_expert and (arch not in MOE_ARCHS or not 0 < n_expert_used <= n_expert):
        raise ValueError(f"experts: {arch} with n_expert {n_expert}, n_expert_used {n_expert_used} cannot be written")
    if router_zipf is not None and not (n_expert and router_zipf > 0):
        raise ValueError(f"a Zipf router needs experts and an exponent > 0 (n_expert {n_expert}, s {router_zipf})")
    if arch == "llama" and n_ff_expert not in (None, n_ff):
        raise ValueError("a llama MoE's experts are n_ff wide (llama.cpp reads no other width for them)")
    dims = _Dims(n_embd, n_layer, n_head, n_kv_head, head_dim, n_ff, n_ctx, sliding_window, n_expert,
                 n_expert_used if n_expert else 0, (n_ff_expert or n_ff) if n_expert else 0,
                 (n_ff_shared or n_ff) if arch == "qwen2moe" else 0)
    base = _DENSE_SIBLING.get(arch, arch)
    tokenizer = _pad_vocab(_spm_tokenizer() if arch == "gemma3" else _bpe_tokenizer(_BPE_PRE[base]), vocab)
    tied = arch == "gemma3" if tied_output is None else tied_output
    specs = _tensor_specs(arch, dims, len(tokenizer.tokens), tied)
    types = {s.name: _tensor_type(s, qtype, qtype_overrides or {}) for s in specs}
    for s in specs:
        _check_block_fit(s, types[s.name])

    path = Path(path)
    writer = GGUFWriter(path, arch)
    writer.add_name(f"synthetic-{arch}-{qtype.name}" + (f"-zipf{router_zipf:g}-router" if router_zipf else ""))
    _add_hparams(writer, arch, dims)
    freq_factors = _add_rope_scaling(writer, rope_scaling, _ROPE_BASE[base], head_dim)
    _add_tokenizer(writer, tokenizer)
    # tensors are made and written one at a time: a 30B-parameter model's never all sit in memory
    for s in specs:
        block_size, type_size = GGML_QUANT_SIZES[types[s.name]]
        writer.add_tensor_info(s.name, s.shape, np.dtype(np.float32), s.n_elements // block_size * type_size,
                               raw_dtype=types[s.name])
    if freq_factors is not None:
        writer.add_tensor_info(_name(MODEL_TENSOR.ROPE_FREQS, ".weight"), freq_factors.shape, freq_factors.dtype,
                               freq_factors.nbytes, raw_dtype=Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    zipf_norms = None
    if router_zipf:
        from lucekv.spark.router import zipf_row_norms

        zipf_norms = zipf_row_norms(n_expert, n_expert_used, router_zipf, seed=seed)
    for s in specs:
        if zipf_norms is not None and s.name.endswith("ffn_gate_inp.weight"):
            from lucekv.spark.router import zipf_router

            writer.write_tensor_data(zipf_router(zipf_norms, n_embd, rng))
        else:
            writer.write_tensor_data(_random_tensor(s, types[s.name], rng))
    if freq_factors is not None:
        writer.write_tensor_data(freq_factors)
    writer.close()
    return path


def write_twin_gguf(path: str | Path, like: str | Path, *, seed: int = 0) -> Path:
    """Write random weights with the shape and every matrix's quant type of the GGUF at `like` (a real model):
    its speed twin, the same products in the same kernels over the same bytes, where the real file cannot go
    (measured on an H200: qwen2.5-coder-0.5b's twin decodes at the real file's speed, a twin with guessed quant
    types 2.6% faster). What changes no work (RoPE base, norm eps, the tokenizer's text) is the synthetic
    defaults."""
    real = open_gguf(like)
    spec = ModelSpec.from_gguf(real)
    return write_synthetic_gguf(
        path, real.arch, seed=seed, n_embd=spec.n_embd, n_layer=spec.n_layer, n_head=spec.n_head,
        n_kv_head=spec.n_kv_head, head_dim=spec.head_dim, n_ff=spec.n_ff, vocab=spec.vocab_size, n_ctx=spec.n_ctx,
        tied_output="output.weight" not in real.tensors, sliding_window=spec.sliding_window or 8,
        qtype_overrides={name: t.qtype for name, t in real.tensors.items() if len(t.shape) == 2})


def write_upcycled_gguf(path: str | Path, dense: str | Path, *, n_expert: int = 4, n_expert_used: int = 2,
                        distinct: bool = False, seed: int = 0, routers: Sequence[np.ndarray] | None = None,
                        router_label: str = "") -> Path:
    """Write a Mixtral-style MoE (llama with experts) made of the real dense llama GGUF at `dense`: every layer's FFN
    becomes `n_expert` experts, byte copies of dense FFNs stacked into ffn_{gate,up,down}_exps, and a random F32
    router (logits about N(0, 1) on the layer's normalized input, so that routing varies from token to token).

    Identical experts (`distinct` False): every expert of layer i is layer i's FFN. Mixtral renormalises the top-k
    weights to sum to 1, so the MoE computes the dense model's function whatever the router picks: the dense model
    is its oracle, while routing and expert indexing run. `distinct`: expert e of layer i is the FFN of layer
    (i + e) mod n_layer, its down projection scaled by 2 ** (e % 3 - 1) (exactly: the scale fields of its blocks are
    multiplied), so that the output depends on which experts are picked and how they are weighted.

    `routers`: each layer's router rows (F32 [n_expert, n_embd], e.g. `kmeans_routers`) instead of random ones,
    `router_label` naming them in general.name."""
    reader = Reader(dense)
    arch = str(reader.fields["general.architecture"].contents())
    if arch != "llama":
        raise ValueError(f"{Path(dense).name}: only llama files upcycle (Mixtral-style), not {arch}")
    if not 0 < n_expert_used <= n_expert:
        raise ValueError(f"n_expert_used {n_expert_used} is not in 1..{n_expert}")
    writer = GGUFWriter(path, arch)
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name not in ("general.architecture", "general.name"):
            sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub)
    writer.add_name(f"{reader.fields['general.name'].contents()} upcycled {n_expert}x top-{n_expert_used}"
                    + (" distinct" if distinct else "") + (f" {router_label} router" if router_label else ""))
    writer.add_expert_count(n_expert)
    writer.add_expert_used_count(n_expert_used)
    tensors = {t.name: t for t in reader.tensors}
    n_layer = int(reader.fields["llama.block_count"].contents())
    if routers is not None and len(routers) != n_layer:
        raise ValueError(f"{len(routers)} routers for {n_layer} layers")
    rng = np.random.default_rng(seed)
    ffn = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.weight")
    for t in reader.tensors:
        m = ffn.fullmatch(t.name)
        if m is None:
            writer.add_tensor(t.name, _stored(t), raw_dtype=t.tensor_type)
            continue
        layer, part = int(m[1]), m[2]
        copies = []
        for e in range(n_expert):
            src = tensors[f"blk.{(layer + e) % n_layer if distinct else layer}.ffn_{part}.weight"]
            data = _stored(src)
            if distinct and part == "down":
                data = scale_blocks(data, src.tensor_type, 2.0 ** (e % 3 - 1))
            copies.append(data)
        writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", np.stack(copies), raw_dtype=t.tensor_type)
        if part == "gate":
            norm = np.asarray(tensors[f"blk.{layer}.ffn_norm.weight"].data, np.float32)
            n_embd = norm.shape[0]
            std = 1.0 / (np.sqrt(n_embd) * np.sqrt(np.mean(norm * norm)))  # |norm(x)| ~ sqrt(n_embd) * rms(w)
            router = (std * rng.standard_normal((n_expert, n_embd))).astype(np.float32)
            if routers is not None:
                router = np.asarray(routers[layer], np.float32)
                if router.shape != (n_expert, n_embd):
                    raise ValueError(f"layer {layer}'s router is {router.shape}, not ({n_expert}, {n_embd})")
            writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", router)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def write_dflash_gguf(path: str | Path, target: str | Path, *, target_layers: list[int] | None = None,
                      n_capture: int = 2, n_layer: int = 2, block_size: int = 16, n_ff: int | None = None,
                      mask_token: int | None = None, qtype: GGMLQuantizationType = Q.Q8_0, seed: int = 0) -> Path:
    """Write a DFlash drafter with random weights (seeded) shaped for the target GGUF at `target` (layout:
    lucekv.spec.dflash): `n_layer` Qwen3 layers of the target's width and heads (FFN `n_ff`, default the target's),
    reading the outputs of `target_layers` (default z-lab's spread of `n_capture` layers), blocks of `block_size`,
    the mask token `mask_token` (default the vocabulary's last id). Matrices in `qtype`, norms in F32, as
    `write_synthetic_gguf` makes them. With random weights its drafts are mostly rejected: it exists to prove the
    machinery exact."""
    from lucekv.spec.dflash import ARCH, default_target_layers

    t = ModelSpec.from_gguf(open_gguf(target))
    layers = list(target_layers) if target_layers is not None else default_target_layers(t.n_layer, n_capture)
    if not layers or any(not 0 <= i < t.n_layer for i in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"target layers {layers} are not distinct layers of the target's {t.n_layer}: pass them")
    n_ff = n_ff or t.n_ff
    q_width, kv_width = t.n_head * t.head_dim, t.n_kv_head * t.head_dim
    specs = [_TensorSpec("dflash.fc.weight", (t.n_embd, len(layers) * t.n_embd), "matrix"),
             _TensorSpec("dflash.hidden_norm.weight", (t.n_embd,), "norm")]
    for i in range(n_layer):
        def mat(name: str, *shape: int, gain: float = 0.5, i=i) -> _TensorSpec:
            return _TensorSpec(f"blk.{i}.{name}.weight", shape, "matrix", gain)

        def norm(name: str, width: int, i=i) -> _TensorSpec:
            return _TensorSpec(f"blk.{i}.{name}.weight", (width,), "norm")
        specs += [norm("attn_norm", t.n_embd), mat("attn_q", q_width, t.n_embd, gain=1.0),
                  mat("attn_k", kv_width, t.n_embd, gain=1.0), mat("attn_v", kv_width, t.n_embd),
                  norm("attn_q_norm", t.head_dim), norm("attn_k_norm", t.head_dim),
                  mat("attn_output", t.n_embd, q_width), norm("ffn_norm", t.n_embd), mat("ffn_gate", n_ff, t.n_embd),
                  mat("ffn_up", n_ff, t.n_embd), mat("ffn_down", t.n_embd, n_ff)]
    specs.append(_TensorSpec("output_norm.weight", (t.n_embd,), "norm"))
    types = {s.name: _tensor_type(s, qtype, {}) for s in specs}
    for s in specs:
        _check_block_fit(s, types[s.name])
    writer = GGUFWriter(path, ARCH)
    writer.add_name(f"synthetic-dflash-for-{t.name}")
    writer.add_context_length(t.n_ctx)
    writer.add_embedding_length(t.n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(t.n_head)
    writer.add_head_count_kv(t.n_kv_head)
    writer.add_key_length(t.head_dim)
    writer.add_value_length(t.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(t.rope_base)
    writer.add_vocab_size(t.vocab_size)
    writer.add_uint32(f"{ARCH}.dflash.n_target_layers", len(layers))
    writer.add_uint32(f"{ARCH}.dflash.block_size", block_size)
    writer.add_uint32(f"{ARCH}.dflash.mask_token_id", t.vocab_size - 1 if mask_token is None else mask_token)
    writer.add_array(f"{ARCH}.dflash.target_layer_ids", [int(i) for i in layers])
    rng = np.random.default_rng(seed)
    for s in specs:
        writer.add_tensor(s.name, _random_tensor(s, types[s.name], rng), raw_dtype=types[s.name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def kmeans_routers(dense: str | Path, texts: Sequence[tuple[str, str]], n_expert: int, n_expert_used: int = 2, *,
                   max_tokens: int = 1024, seed: int = 0) -> list[np.ndarray]:
    """Each layer's router rows (lucekv.spark.router.kmeans_router) for the upcycled model of `dense` with distinct
    experts, from its own FFN inputs over the (name, text) documents (their first `max_tokens` tokens each), fitted
    layer after layer (lucekv.spark.cli.fit_routers) so that each router is fitted to the inputs the finished model
    gives its layer. The model is upcycled once with random routers to run, in a scratch file."""
    import tempfile

    from lucekv.spark.cli import fit_routers, prompt_backend
    from lucekv.spark.router import kmeans_router

    with tempfile.TemporaryDirectory() as scratch:
        moe = write_upcycled_gguf(Path(scratch) / "upcycled.gguf", dense, n_expert=n_expert,
                                  n_expert_used=n_expert_used, distinct=True, seed=seed)
        backend, documents = prompt_backend(open_gguf(moe), texts, max_tokens)
        routers = fit_routers(backend, documents, lambda layer, h: kmeans_router(h, n_expert, seed + layer))
        del backend  # its arrays map the scratch file
    return routers


def _stored(t) -> np.ndarray:
    """A GGUFReader tensor's data in numpy order ([rows, bytes per row] for block quants), as GGUFWriter takes it
    with raw_dtype."""
    return np.ascontiguousarray(t.data)


# Byte offsets of the f16 fields that scale a whole block (d; and the min, m or dmin, of types with one): multiplying
# them by s multiplies every value of the block by s.
_BLOCK_SCALE_OFFSETS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}


def scale_blocks(data: np.ndarray, qtype: GGMLQuantizationType, factor: float) -> np.ndarray:
    """Stored tensor data with every value multiplied by `factor` (a power of two), exactly: a block quant's scale
    fields multiplied, a float tensor's values. Raises where a scale would not be exact (f16 overflow or underflow)."""
    if qtype == Q.F32:
        return data * np.float32(factor)
    if qtype not in _BLOCK_SCALE_OFFSETS:
        raise ValueError(f"scale_blocks: {qtype.name} is not supported")
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    blocks = data.reshape(-1, block_bytes).copy()
    for offset in _BLOCK_SCALE_OFFSETS[qtype]:
        old = np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16).astype(np.float32)
        new = (old * np.float32(factor)).astype(np.float16)
        if not np.array_equal(new.astype(np.float32), old * np.float32(factor)):
            raise ValueError(f"scale_blocks: {qtype.name} scales times {factor} are not exact in f16")
        blocks[:, offset:offset + 2] = new.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(data.shape)


# Qwen3-30B-A3B's shape: 48 layers, 128 experts of 768, top-8, n_embd 2048, 32 / 4 heads of 128, Qwen's vocabulary.
QWEN3_30B_A3B = {"n_embd": 2048, "n_layer": 48, "n_head": 32, "n_kv_head": 4, "head_dim": 128, "n_ff": 6144,
                 "n_ff_expert": 768, "n_expert": 128, "n_expert_used": 8, "vocab": 151936, "n_ctx": 40960}


def q4_k_m_types(n_layer: int, experts: bool = True) -> dict[str, GGMLQuantizationType]:
    """Overrides of Q4_K that make llama.cpp's Q4_K_M mix: Q6_K for the output and, in the layers its
    `use_more_bits` picks (the first and last eighth, every third between), for attn_v and the FFN's down
    projection (ffn_down_exps where the layers have experts)."""
    eighth = n_layer // 8
    more = [i for i in range(n_layer) if i < eighth or i >= 7 * n_layer // 8 or (i - eighth) % 3 == 2]
    down = "ffn_down_exps" if experts else "ffn_down"
    return {"output.weight": Q.Q6_K, **{f"blk.{i}.{name}.weight": Q.Q6_K for i in more for name in ("attn_v", down)}}


# Qwen2.5(-Coder)-1.5B's shape: the small real target's matrices (1536 columns; 1536, 256 and 8960 rows), its vocabulary
QWEN25_15B = {"n_embd": 1536, "n_layer": 28, "n_head": 12, "n_kv_head": 2, "head_dim": 128, "n_ff": 8960,
              "vocab": 151936, "n_ctx": 32768}


def write_qwen25_15b_shape(path: str | Path, seed: int = 0) -> Path:
    """Random weights in Qwen2.5-1.5B's shape and the Q4_K_M mix of its real file (`q4_k_m_types`, a Q6_K output
    head): its products' speed without carrying the real file (about 1.1 GB) to the GPU machine."""
    return write_synthetic_gguf(path, "qwen2", qtype=Q.Q4_K, seed=seed, tied_output=False,
                                qtype_overrides=q4_k_m_types(QWEN25_15B["n_layer"], experts=False), **QWEN25_15B)


def write_qwen3_30b_a3b_shape(path: str | Path, n_layer: int = QWEN3_30B_A3B["n_layer"], seed: int = 0,
                              router_zipf: float | None = None, n_ctx: int = QWEN3_30B_A3B["n_ctx"]) -> Path:
    """Random weights in Qwen3-30B-A3B's shape and a Q4_K_M mix (`q4_k_m_types`): the MoE speed model (about 17 GB;
    fewer layers for a quick look); `router_zipf`: Zipf-skewed expert popularity (see write_synthetic_gguf); `n_ctx`:
    its context (the 2507 release's is 262144)."""
    shape = dict(QWEN3_30B_A3B, n_layer=n_layer, n_ctx=n_ctx)
    return write_synthetic_gguf(path, "qwen3moe", qtype=Q.Q4_K, seed=seed, tied_output=False,
                                qtype_overrides=q4_k_m_types(n_layer), router_zipf=router_zipf, **shape)


# --- tensors -------------------------------------------------------------------------------------------


def _name(tensor: MODEL_TENSOR, suffix: str, layer: int | None = None) -> str:
    base = TENSOR_NAMES[tensor]
    return (base.format(bid=layer) if layer is not None else base) + suffix


def _tensor_specs(arch: str, d: _Dims, vocab: int, tied: bool) -> list[_TensorSpec]:
    T = MODEL_TENSOR
    specs = [_TensorSpec(_name(T.TOKEN_EMBD, ".weight"), (vocab, d.n_embd), "matrix")]
    for layer in range(d.n_layer):
        specs += _layer_specs(arch, d, layer)
    specs.append(_TensorSpec(_name(T.OUTPUT_NORM, ".weight"), (d.n_embd,), "norm"))
    if not tied:
        specs.append(_TensorSpec(_name(T.OUTPUT, ".weight"), (vocab, d.n_embd), "matrix"))
    return specs


def _layer_specs(arch: str, d: _Dims, layer: int) -> list[_TensorSpec]:
    T = MODEL_TENSOR
    q_width, kv_width = d.n_head * d.head_dim, d.n_kv_head * d.head_dim
    moe, arch = arch, _DENSE_SIBLING.get(arch, arch)

    def matrix(t: MODEL_TENSOR, *shape: int, gain: float = 0.5) -> _TensorSpec:
        return _TensorSpec(_name(t, ".weight", layer), shape, "matrix", gain)

    def norm(t: MODEL_TENSOR, width: int) -> _TensorSpec:
        return _TensorSpec(_name(t, ".weight", layer), (width,), "norm")

    specs = [
        norm(T.ATTN_NORM, d.n_embd),
        matrix(T.ATTN_Q, q_width, d.n_embd, gain=1.0),
        matrix(T.ATTN_K, kv_width, d.n_embd, gain=1.0),
        matrix(T.ATTN_V, kv_width, d.n_embd),
    ]
    if arch == "qwen2":
        specs += [_TensorSpec(_name(t, ".bias", layer), (width,), "bias")
                  for t, width in ((T.ATTN_Q, q_width), (T.ATTN_K, kv_width), (T.ATTN_V, kv_width))]
    if arch in ("qwen3", "gemma3"):
        specs += [norm(T.ATTN_Q_NORM, d.head_dim), norm(T.ATTN_K_NORM, d.head_dim)]
    specs.append(matrix(T.ATTN_OUT, d.n_embd, q_width))
    if arch == "gemma3":
        specs.append(norm(T.ATTN_POST_NORM, d.n_embd))
    specs.append(norm(T.FFN_NORM, d.n_embd))
    if d.n_expert == 0:
        specs += [matrix(T.FFN_GATE, d.n_ff, d.n_embd), matrix(T.FFN_UP, d.n_ff, d.n_embd),
                  matrix(T.FFN_DOWN, d.n_embd, d.n_ff)]
    else:
        # router at gain 1: logits O(1), so that routing varies from token to token
        e, ff = d.n_expert, d.n_ff_expert
        specs += [_TensorSpec(_name(T.FFN_GATE_INP, ".weight", layer), (e, d.n_embd), "router"),
                  matrix(T.FFN_GATE_EXP, e, ff, d.n_embd), matrix(T.FFN_UP_EXP, e, ff, d.n_embd),
                  matrix(T.FFN_DOWN_EXP, e, d.n_embd, ff)]
    if moe == "qwen2moe":
        sh = d.n_ff_shared
        specs += [_TensorSpec(_name(T.FFN_GATE_INP_SHEXP, ".weight", layer), (d.n_embd,), "router"),
                  matrix(T.FFN_GATE_SHEXP, sh, d.n_embd), matrix(T.FFN_UP_SHEXP, sh, d.n_embd),
                  matrix(T.FFN_DOWN_SHEXP, d.n_embd, sh)]
    if arch == "gemma3":
        specs.append(norm(T.FFN_POST_NORM, d.n_embd))
    return specs


def _tensor_type(spec: _TensorSpec, qtype: GGMLQuantizationType,
                 overrides: dict[str, GGMLQuantizationType]) -> GGMLQuantizationType:
    if spec.kind != "matrix":
        return Q.F32  # llama.cpp keeps 1-D tensors and routers in F32
    # a tensor's own name first: "output.weight" is also the suffix of every "blk.N.attn_output.weight"
    chosen = overrides[spec.name] if spec.name in overrides else next(
        (t for suffix, t in overrides.items() if spec.name.endswith(suffix)), qtype)
    if chosen not in SUPPORTED_QTYPES:
        raise ValueError(f"quant type {chosen.name} is not supported (supported: "
                         f"{', '.join(sorted(t.name for t in SUPPORTED_QTYPES))})")
    return chosen


def _check_block_fit(spec: _TensorSpec, qtype: GGMLQuantizationType) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    if spec.shape[-1] % block:
        raise ValueError(f"{spec.name}: row length {spec.shape[-1]} is not a multiple of the {qtype.name} "
                         f"block size {block}; choose dims that are (K-quants: e.g. n_embd=256, head_dim=64, "
                         f"n_ff=512)")


def _random_tensor(spec: _TensorSpec, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """The tensor's data as the file stores it (bytes of blocks for block quants)."""
    if spec.kind == "norm":
        # For gemma3 this is the stored value, i.e. Gemma's (1 + w) with the "+1" already folded in.
        return (1.0 + 0.1 * rng.standard_normal(spec.shape)).astype(np.float32)
    if spec.kind == "bias":
        return (0.1 * rng.standard_normal(spec.shape)).astype(np.float32)
    std = spec.gain / np.sqrt(spec.shape[-1])
    if qtype in K_QUANTS:
        return _random_kquant(spec.shape, qtype, std, rng)
    weights = (std * rng.standard_normal(spec.shape)).astype(np.float32)
    if qtype == Q.F32:
        return weights
    if qtype == Q.F16:
        return weights.astype(np.float16)
    return quantize(weights, qtype)


def _random_kquant(shape: tuple[int, ...], qtype: GGMLQuantizationType, std: float,
                   rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (gguf cannot quantize to these) whose dequantized values are ~N(0, std)-sized.

    Quants and sub-block scales are random bytes; dequantization is linear in the two f16 block scales
    (d, dmin), so measure it once with unit scales, choose dmin/d to centre the weights on zero, and d for
    the spread. d varies per block so that a kernel reading the wrong block's scale shows.
    """
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    cols = shape[-1]
    blocks = rng.integers(0, 256, size=(int(np.prod(shape)) // block_size, type_size), dtype=np.uint8)
    if qtype in _SUB_BLOCK_MINS:
        _correlate_sub_block_mins(blocks, qtype, rng)
    d_offset, min_offset = _KQUANT_SCALE_OFFSETS[qtype]
    sample = blocks[:_SPREAD_SAMPLE_BLOCKS]  # the spread of the random blocks, measured on some of them
    scaled_part = _dequantize_with_scales(sample, qtype, d_offset, 1.0, min_offset, 0.0)
    if min_offset is None:
        min_ratio, unit = 0.0, scaled_part
    else:
        min_part = _dequantize_with_scales(sample, qtype, d_offset, 0.0, min_offset, 1.0)  # = -dmin * m
        min_ratio = float(scaled_part.mean() / -min_part.mean())
        unit = scaled_part + min_ratio * min_part
    d = (std / unit.std()) * rng.uniform(0.5, 1.5, size=len(blocks))
    _set_f16(blocks, d_offset, d)
    if min_offset is not None:
        _set_f16(blocks, min_offset, d * min_ratio)
    return blocks.reshape(*shape[:-1], cols // block_size * type_size)


# Blocks whose dequantized spread sets a K-quant tensor's scales: all of a small tensor's; 2^16 blocks (16M weights)
# measure it to 0.1%, where dequantizing all of an MoE layer's 200M expert weights twice would take seconds.
_SPREAD_SAMPLE_BLOCKS = 1 << 16


# Where the sub-block scales and mins of the asymmetric K-quants live, and their bit width.
_SUB_BLOCK_MINS = {Q.Q2_K: (0, 4), Q.Q4_K: (4, 6), Q.Q5_K: (4, 6)}  # type -> (byte offset, bits)


def _correlate_sub_block_mins(blocks: np.ndarray, qtype: GGMLQuantizationType,
                              rng: np.random.Generator) -> None:
    """Make each sub-block's min track its scale (min = scale + small noise), as in real quantized weights.

    Independent random mins would give every sub-block of 16 or 32 weights its own large offset: a
    low-rank bias that makes attention saturate. The noise keeps min != scale, so a kernel that swaps
    the two still shows.
    """
    offset, bits = _SUB_BLOCK_MINS[qtype]
    n_sub = 16 if qtype == Q.Q2_K else 8
    top = (1 << bits) - 1
    scales = rng.integers(top // 4, top + 1, size=(len(blocks), n_sub))
    mins = np.clip(scales + rng.integers(-2, 3, size=scales.shape), 0, top)
    if qtype == Q.Q2_K:  # one byte per sub-block: scale in the low nibble, min in the high one
        packed = scales | (mins << 4)
    else:  # 12 bytes of 6-bit pairs, the layout get_scale_min_k4 in ggml-quants.c unpacks
        lo, hi = slice(0, 4), slice(4, 8)
        packed = np.concatenate([
            scales[:, lo] | ((scales[:, hi] >> 4) << 6),
            mins[:, lo] | ((mins[:, hi] >> 4) << 6),
            (scales[:, hi] & 0xF) | ((mins[:, hi] & 0xF) << 4),
        ], axis=1)
    blocks[:, offset:offset + packed.shape[1]] = packed.astype(np.uint8)


def _dequantize_with_scales(blocks: np.ndarray, qtype: GGMLQuantizationType, d_offset: int, d: float,
                            min_offset: int | None, dmin: float) -> np.ndarray:
    trial = blocks.copy()
    _set_f16(trial, d_offset, np.full(len(blocks), d))
    if min_offset is not None:
        _set_f16(trial, min_offset, np.full(len(blocks), dmin))
    return dequantize(trial, qtype)


def _set_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)


# --- metadata ------------------------------------------------------------------------------------------


def _add_hparams(writer: GGUFWriter, arch: str, d: _Dims) -> None:
    moe, arch = arch, _DENSE_SIBLING.get(arch, arch)
    writer.add_context_length(d.n_ctx)
    writer.add_embedding_length(d.n_embd)
    writer.add_block_count(d.n_layer)
    writer.add_feed_forward_length(d.n_ff)
    writer.add_head_count(d.n_head)
    writer.add_head_count_kv(d.n_kv_head)
    writer.add_key_length(d.head_dim)
    writer.add_value_length(d.head_dim)
    writer.add_rope_dimension_count(d.head_dim)
    writer.add_rope_freq_base(_ROPE_BASE[arch])
    writer.add_layer_norm_rms_eps(_RMS_EPS[arch])
    if arch == "gemma3":
        writer.add_sliding_window(d.sliding_window)
    if d.n_expert:
        writer.add_expert_count(d.n_expert)
        writer.add_expert_used_count(d.n_expert_used)
        if moe != "llama":  # Mixtral files have none: llama.cpp takes feed_forward_length for its experts
            writer.add_expert_feed_forward_length(d.n_ff_expert)
    if d.n_ff_shared:
        writer.add_expert_shared_feed_forward_length(d.n_ff_shared)


def _add_rope_scaling(writer: GGUFWriter, scaling: dict | None, base: float, rope_dim: int) -> np.ndarray | None:
    """Metadata for a Hugging Face rope_scaling; llama3's per-pair factors are returned, to be written as the
    `rope_freqs.weight` tensor."""
    if scaling is None:
        return None
    kind = scaling["rope_type"]
    if kind == "llama3":
        return _llama3_freq_factors(base, rope_dim, scaling)
    if kind not in ("linear", "yarn"):
        raise ValueError(f"rope_type {kind!r} is not one synth writes (linear, yarn, llama3)")
    writer.add_rope_scaling_type(RopeScalingType(kind))
    writer.add_rope_scaling_factor(float(scaling["factor"]))
    if kind == "yarn":
        writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    return None


def _llama3_freq_factors(base: float, rope_dim: int, s: dict) -> np.ndarray:
    """float32 [rope_dim // 2]: what each pair's speed is divided by under Llama 3's rope scaling. Pairs whose
    wavelength is short against the original context keep their speed, long ones are slowed by `factor`, and
    those between are blended by where their wavelength falls."""
    inv = 1.0 / base ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    context = s["original_max_position_embeddings"]
    low, high, factor = s["low_freq_factor"], s["high_freq_factor"], s["factor"]
    turns_per_context = context * inv / (2 * np.pi)  # = context / wavelength
    blend = np.clip((turns_per_context - low) / (high - low), 0.0, 1.0)  # 1: keep, 0: slow by factor
    return (1.0 / ((1.0 - blend) / factor + blend)).astype(np.float32)


def _add_tokenizer(writer: GGUFWriter, tok: _SynthTokenizer) -> None:
    writer.add_tokenizer_model(tok.model)
    writer.add_tokenizer_pre(tok.pre)
    writer.add_token_list(tok.tokens)
    writer.add_token_types(tok.token_types)
    if tok.scores is not None:
        writer.add_token_scores(tok.scores)
    if tok.merges is not None:
        writer.add_token_merges(tok.merges)
    writer.add_bos_token_id(tok.bos_id)
    writer.add_eos_token_id(tok.eos_id)
    if tok.unk_id is not None:
        writer.add_unk_token_id(tok.unk_id)
    writer.add_pad_token_id(tok.pad_id)
    writer.add_add_bos_token(tok.add_bos)
    if tok.model == "llama":
        # Gemma files say so; without the key llama.cpp would prepend "▁" where transformers does not.
        writer.add_add_space_prefix(False)
    writer.add_chat_template(tok.chat_template)


# --- tokenizers ----------------------------------------------------------------------------------------


def _learn_merges(words: list[tuple[str, ...]], max_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training: repeatedly merge the most frequent adjacent pair (ties broken by the pair)."""
    counts = Counter(words)
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, n in counts.items():
            for pair in zip(word[:-1], word[1:], strict=True):
                pairs[pair] += n
        if not pairs:
            break
        best, n = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if n < 2:
            break
        merges.append(best)
        counts = Counter({_merge_pair(word, best): c for word, c in counts.items()})
    return merges


def _merge_pair(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _gpt2_byte_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters, the alphabet byte-level BPE vocabularies use."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _bpe_tokenizer(pre: str) -> _SynthTokenizer:
    """Byte-level BPE in Qwen's layout: 256 byte tokens, learned merges, then the control tokens."""
    byte_char = _gpt2_byte_to_unicode()
    pieces = re.findall(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+", _CORPUS)
    words = [tuple(byte_char[b] for b in piece.encode()) for piece in pieces]
    merges = _learn_merges(words, 256)
    tokens = list(dict.fromkeys([byte_char[b] for b in range(256)] + [a + b for a, b in merges]))
    types = [TokenType.NORMAL] * len(tokens)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    first_special = len(tokens)
    tokens += specials
    types += [TokenType.CONTROL] * len(specials)
    return _SynthTokenizer(
        model="gpt2", pre=pre, tokens=tokens, token_types=[int(t) for t in types], scores=None,
        merges=[f"{a} {b}" for a, b in merges], bos_id=first_special, eos_id=first_special + 2, unk_id=None,
        pad_id=first_special, add_bos=False, chat_template=CHATML_TEMPLATE)


def _spm_tokenizer() -> _SynthTokenizer:
    """SentencePiece-style vocabulary in Gemma's layout: control tokens, <0xNN> byte fallbacks, pieces.

    Pieces are listed best-first and scored by rank, so score order (llama.cpp) and file order
    (transformers' Gemma loader) agree on merge priority.
    """
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    words = [tuple("\u2581" + w) for w in _CORPUS.split()]
    chars = sorted({c for w in words for c in w})
    merges = _learn_merges(words, 256)
    pieces = list(dict.fromkeys([a + b for a, b in merges] + chars))
    tokens = specials + byte_tokens + pieces
    types = [TokenType.CONTROL] * len(specials) + [TokenType.BYTE] * 256 + [TokenType.NORMAL] * len(pieces)
    scores = [0.0] * (len(specials) + 256) + [-float(rank) for rank in range(len(pieces))]
    return _SynthTokenizer(
        model="llama", pre="default", tokens=tokens, token_types=[int(t) for t in types], scores=scores,
        merges=None, bos_id=2, eos_id=1, unk_id=3, pad_id=0, add_bos=True, chat_template=GEMMA_TEMPLATE)


def _pad_vocab(tok: _SynthTokenizer, vocab: int | None) -> _SynthTokenizer:
    if vocab is None:
        return tok
    extra = vocab - len(tok.tokens)
    if extra < 0:
        raise ValueError(f"vocab {vocab} is smaller than the tokenizer's own {len(tok.tokens)} tokens")
    pad = [f"[PAD{i}]" for i in range(len(tok.tokens), vocab)]
    return replace(
        tok, tokens=tok.tokens + pad, token_types=tok.token_types + [int(TokenType.UNUSED)] * extra,
        scores=None if tok.scores is None else tok.scores + [0.0] * extra)


def main(argv: list[str] | None = None) -> int:
    """python -m lucekv.model.synth qwen3-30b-a3b OUT [--layers N] [--router zipf [--zipf-s S]] [--n-ctx N]
    | qwen2.5-1.5b OUT
    | upcycle DENSE OUT [--distinct] [--experts N --top-k K] [--router kmeans --corpus FILE ...]
    | dflash TARGET OUT [--layers L,..] [--block B] [--draft-layers N] [--seed S]"""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m lucekv.model.synth", description="write the MoE and DFlash GGUFs "
                                 "of the benchmarks and GPU checks")
    sub = ap.add_subparsers(dest="what", required=True)
    a3b = sub.add_parser("qwen3-30b-a3b", help="random weights, Qwen3-30B-A3B's shape, Q4_K_M mix")
    a3b.add_argument("out")
    a3b.add_argument("--layers", type=int, default=QWEN3_30B_A3B["n_layer"])
    a3b.add_argument("--router", choices=("random", "zipf"), default="random",
                     help="zipf: expert popularity skewed by Zipf's law (named so in general.name)")
    a3b.add_argument("--zipf-s", type=float, default=1.0, help="the Zipf exponent (default 1)")
    a3b.add_argument("--n-ctx", type=int, default=QWEN3_30B_A3B["n_ctx"], help="the context (default %(default)s; "
                     "the 2507 release's: 262144)")
    sub.add_parser("qwen2.5-1.5b", help="random weights, Qwen2.5-1.5B's shape, Q4_K_M mix").add_argument("out")
    up = sub.add_parser("upcycle", help="a real dense llama GGUF as a Mixtral-style MoE (4 experts, top-2)")
    up.add_argument("dense")
    up.add_argument("out")
    up.add_argument("--distinct", action="store_true", help="distinct experts (see write_upcycled_gguf)")
    up.add_argument("--experts", type=int, default=4, help="experts per layer (default 4)")
    up.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    up.add_argument("--router", choices=("random", "kmeans"), default="random",
                    help="kmeans: fitted to the dense model's FFN inputs over --corpus (implies --distinct)")
    up.add_argument("--corpus", action="append", default=[], metavar="FILE",
                    help="a UTF-8 text file, one document of the k-means corpus (repeatable)")
    up.add_argument("--max-tokens", type=int, default=1024, help="tokens read of each document (default 1024)")
    df = sub.add_parser("dflash", help="a DFlash drafter with random weights shaped for a target GGUF")
    df.add_argument("target")
    df.add_argument("out")
    df.add_argument("--layers", help="the target layers whose outputs it reads, e.g. 1,27 (default: 2, spread out)")
    df.add_argument("--block", type=int, default=16, help="block size B (default 16)")
    df.add_argument("--draft-layers", type=int, default=2, help="the drafter's own layers (default 2)")
    df.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.what == "upcycle" and (args.router == "kmeans") != bool(args.corpus):
        ap.error("--router kmeans needs --corpus FILE, and --corpus is only read by --router kmeans")
    if args.what == "upcycle" and args.max_tokens < 1:
        ap.error(f"--max-tokens must be >= 1, not {args.max_tokens}")
    if args.what == "dflash":
        layers = [int(i) for i in args.layers.split(",")] if args.layers else None
        print(write_dflash_gguf(args.out, args.target, target_layers=layers, n_layer=args.draft_layers,
                                block_size=args.block, seed=args.seed))
        return 0
    if args.what == "qwen2.5-1.5b":
        print(write_qwen25_15b_shape(args.out))
        return 0
    if args.what == "qwen3-30b-a3b":
        zipf = args.zipf_s if args.router == "zipf" else None
        print(write_qwen3_30b_a3b_shape(args.out, args.layers, router_zipf=zipf, n_ctx=args.n_ctx))
        return 0
    routers = None
    if args.router == "kmeans":
        from lucekv.spark.cli import read_documents

        texts = read_documents(args.corpus, 0)
        routers = kmeans_routers(args.dense, texts, args.experts, args.top_k, max_tokens=args.max_tokens)
    print(write_upcycled_gguf(args.out, args.dense, n_expert=args.experts, n_expert_used=args.top_k,
                              distinct=args.distinct or routers is not None, routers=routers,
                              router_label="k-means" if routers is not None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
