"""The DFlash block drafter (algorithms.md §1, lucebox_reference.md §3): a few transformer layers that read the
target's own hidden states and propose a whole block of tokens in one forward.

The drafter GGUF (`general.architecture` "dflash-draft", keys under "dflash-draft.", lucebox_reference.md §3.8):
- hyperparameters: context_length, embedding_length (= the target's), block_count, feed_forward_length,
  attention.{head_count, head_count_kv, key_length, value_length, layer_norm_rms_epsilon}, rope.freq_base,
  vocab_size (= the target's), dflash.{n_target_layers, block_size, mask_token_id, target_layer_ids}; any other key
  of the prefix (a sliding window, context_kv_layer_norm, Domino or DSpark heads) is refused by name;
- tensors: dflash.fc.weight [n_embd, n_target_layers * n_embd], dflash.hidden_norm.weight, output_norm.weight, and
  per layer blk.i.{attn_norm, attn_q, attn_k, attn_v, attn_q_norm, attn_k_norm, attn_output, ffn_norm, ffn_gate,
  ffn_up, ffn_down}.weight (a Qwen3 layer); no token embedding and no LM head: the target's are used.

The math (z-lab's reference, algorithms.md §1.2):
- features: the target's residual stream after each layer of target_layer_ids (the layer's output, before the final
  norm), concatenated in that order, fused as c_j = hidden_norm(fc @ h_j) for each committed position j;
- each layer's context K/V: k_norm(W_k c_j) rotated at position j, and W_v c_j (c is not attention-normed first);
  they are computed once per committed position and kept (`ContextKV`, the drafter's KV cache);
- the block: the target's embeddings (times its embedding scale, where it has one) of [last, MASK x (B-1)] at
  positions p .. p+B-1, p the position of `last` (the sequence's last token, not yet forwarded by the target); each
  layer is x += W_o attn(norm(x)), x += down(silu(gate) * up), where the block's queries see every context K/V and
  every block K/V: no mask (non-causal); NeoX RoPE at the drafter's rope.freq_base, scale head_dim^-0.5;
- logits: the target's LM head applied to output_norm(x) of block slots 1 .. B-1; slot s predicts position p+s.
  (The drafter's own final norm, then the target's LM head without the target's output norm, as z-lab's
  `lm_head(norm(x))` does.)
Not implemented (refused): draft sliding windows, the laguna attention gate, per-capture aux norms.

Lifecycle (algorithms.md §1.3): every target forward of a dflash turn (prefill and verify) hands its features to the
session's drafter (`take_features`, by position); a proposal moves those of the newly committed positions into the
context K/V and drops the rest (the verify block's rejected drafts), so a rejection never needs a rollback copy.
A later turn keeps the context K/V of the prefix it shares with the last one; positions whose features the drafter
never saw (a turn without dflash, a restored session) are simply absent from its context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lucekv.engine.sampling import SamplingParams
from lucekv.errors import ConfigError, ModelError
from lucekv.model import rope
from lucekv.model.arch import ArchMetadata, ArchSpec, ModelSpec
from lucekv.model.decoder import LayerWeights, Weights, project_qkv
from lucekv.model.gguf import GGUFFile, open_gguf
from lucekv.model.rope import RopeScaling
from lucekv.spec.draft_model import draft_sampler
from lucekv.spec.drafter import Draft
from lucekv.spec.tree import DraftTree, best_first

ARCH = "dflash-draft"
DRAFT_ARCH = ArchSpec(ARCH, rope_style="neox", qk_norm=True)  # each drafter layer is a Qwen3 layer
TREE_TOP_K = 4  # a tree proposal's candidates per block slot


def default_target_layers(n_target_layer: int, n_capture: int) -> list[int]:
    """z-lab's choice: one layer in the middle, else evenly spread from layer 1 to layer n-3."""
    if n_capture == 1:
        return [n_target_layer // 2]
    return [round(1 + i * (n_target_layer - 4) / (n_capture - 1)) for i in range(n_capture)]


@dataclass(frozen=True)
class DFlashSpec:
    model: ModelSpec  # the drafter's layers, as the decoder's ops see them
    block_size: int  # B: the block is [last, MASK x (B-1)]
    mask_token: int
    target_layers: tuple[int, ...]  # the target layers whose outputs are the features, in fc's order

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> DFlashSpec:
        if g.arch != ARCH:
            raise ModelError(f"{g.path.name}: architecture {g.arch!r} is not a DFlash drafter ({ARCH!r})")
        meta = ArchMetadata(g)
        n_embd, n_head = int(meta.require("embedding_length")), int(meta.require("attention.head_count"))
        head_dim = int(meta.get("attention.key_length", n_embd // n_head))
        if int(meta.get("attention.value_length", head_dim)) != head_dim:
            raise ModelError(f"{g.path.name}: key_length != value_length is not supported")
        n_kv = int(meta.get("attention.head_count_kv", n_head))
        if n_head % n_kv:
            raise ModelError(f"{g.path.name}: {n_head} heads are not a multiple of {n_kv} kv heads")
        model = ModelSpec(
            arch=DRAFT_ARCH, name=str(g.metadata.get("general.name", g.path.stem)), n_embd=n_embd,
            n_layer=int(meta.require("block_count")), n_head=n_head, n_kv_head=n_kv, head_dim=head_dim,
            n_ff=int(meta.require("feed_forward_length")), n_ctx=int(meta.require("context_length")),
            vocab_size=int(meta.require("vocab_size")),
            rms_eps=float(meta.require("attention.layer_norm_rms_epsilon")),
            rope_base=float(meta.require("rope.freq_base")), rope_dim=head_dim, rope_scaling=RopeScaling(),
            sliding_window=0, attn_scale=1.0 / float(np.sqrt(head_dim)))
        n_target = int(meta.require("dflash.n_target_layers"))
        layers = tuple(int(i) for i in meta.require("dflash.target_layer_ids"))
        block, mask = int(meta.require("dflash.block_size")), int(meta.require("dflash.mask_token_id"))
        meta.refuse_unread()
        if len(layers) != n_target or len(set(layers)) != n_target:
            raise ModelError(f"{g.path.name}: dflash.target_layer_ids {list(layers)} are not {n_target} distinct "
                             "layers (dflash.n_target_layers)")
        if block < 2:
            raise ModelError(f"{g.path.name}: dflash.block_size must be at least 2 (got {block})")
        if not 0 <= mask < model.vocab_size:
            raise ModelError(f"{g.path.name}: dflash.mask_token_id {mask} is outside the vocabulary")
        return cls(model, block, mask, layers)

    def check_target(self, target: ModelSpec, name: str) -> None:
        """Refuse a target this drafter was not made for, naming what differs."""
        m = self.model
        if m.n_embd != target.n_embd:
            raise ConfigError(f"DFlash drafter {name}: its embedding_length {m.n_embd} is not the target's "
                              f"{target.n_embd} (it reads the target's hidden states and embeddings)")
        if m.vocab_size != target.vocab_size:
            raise ConfigError(f"DFlash drafter {name}: its vocab_size {m.vocab_size} is not the target's "
                              f"{target.vocab_size}")
        bad = [i for i in self.target_layers if not 0 <= i < target.n_layer]
        if bad:
            raise ConfigError(f"DFlash drafter {name}: dflash.target_layer_ids {bad} are not layers of the target "
                              f"({target.n_layer} layers)")


@dataclass
class DFlashWeights:
    fc: object  # [n_embd, n_target_layers * n_embd]
    hidden_norm: object
    output_norm: object
    layers: list[LayerWeights]


def load_weights(g: GGUFFile, spec: DFlashSpec, target_embd: int, ops) -> DFlashWeights:
    m = spec.model
    fc = g.tensor("dflash.fc.weight")
    if fc.shape != (m.n_embd, len(spec.target_layers) * target_embd):
        raise ModelError(f"{g.path.name}: dflash.fc.weight has shape {fc.shape}, expected "
                         f"{(m.n_embd, len(spec.target_layers) * target_embd)} (numpy order)")
    layers = []
    for i in range(m.n_layer):
        p = f"blk.{i}."

        def t(name: str, p=p):
            return g.tensor(p + name + ".weight")
        layers.append(LayerWeights(
            attn_norm=ops.vector(t("attn_norm")),
            qkv=ops.projections([t("attn_q"), t("attn_k"), t("attn_v")], [None, None, None]),
            wo=ops.matrix(t("attn_output")), ffn_norm=ops.vector(t("ffn_norm")),
            gate_up=ops.gated(t("ffn_gate"), t("ffn_up")), w_down=ops.matrix(t("ffn_down")),
            q_norm=ops.vector(t("attn_q_norm")), k_norm=ops.vector(t("attn_k_norm"))))
    weights = DFlashWeights(ops.matrix(fc), ops.vector(g.tensor("dflash.hidden_norm.weight")),
                            ops.vector(g.tensor("output_norm.weight")), layers)
    g.refuse_unused_tensors()
    return weights


class ContextKV:
    """The drafter's KV cache: per layer, the K (rotated) and V rows of the committed positions it has features of,
    in position order (float32, capacity doubling as it grows)."""

    def __init__(self, n_layer: int, width: int):
        self.n_layer, self.width = n_layer, width
        self.positions = np.zeros(0, np.int64)
        self.k = np.zeros((n_layer, 0, width), np.float32)
        self.v = np.zeros((n_layer, 0, width), np.float32)
        self.n = 0

    @property
    def end(self) -> int:
        """One past the last position held (0 when empty)."""
        return int(self.positions[self.n - 1]) + 1 if self.n else 0

    def append(self, positions: np.ndarray, kv: list[tuple[np.ndarray, np.ndarray]]) -> None:
        m = len(positions)
        if self.n + m > len(self.positions):
            cap = max(2 * len(self.positions), self.n + m, 64)
            self.positions = np.resize(self.positions, cap)
            grow = np.zeros((self.n_layer, cap - self.k.shape[1], self.width), np.float32)
            self.k, self.v = np.concatenate([self.k, grow], 1), np.concatenate([self.v, grow], 1)
        self.positions[self.n:self.n + m] = positions
        for layer, (k, v) in enumerate(kv):
            self.k[layer, self.n:self.n + m], self.v[layer, self.n:self.n + m] = k, v
        self.n += m

    def truncate(self, end: int) -> None:
        """Keep the positions before `end`."""
        self.n = int(np.searchsorted(self.positions[:self.n], end))


class DFlashModel:
    """A drafter's weights on a backend's ops (the CPU's), with the target's embedding table and LM head: those of
    `target_weights` where they are on the same ops (a CPU target), else read from the target's GGUF."""

    def __init__(self, path: Path, target: ModelSpec, target_gguf: GGUFFile, target_weights: Weights | None,
                 ops_class):
        g = open_gguf(path)
        self.spec = DFlashSpec.from_gguf(g)
        self.spec.check_target(target, str(path))
        m = self.spec.model
        self.ops = ops_class(m, None)  # no pool: the drafter's K/V lives in each drafter's ContextKV
        self.weights = load_weights(g, self.spec, target.n_embd, self.ops)
        if target_weights is not None:
            self.target_embd, self.target_output = target_weights.token_embd, target_weights.output
        else:
            self.target_embd = self.ops.matrix(target_gguf.tensor("token_embd.weight"))
            output = target_gguf.optional_tensor("output.weight")  # None: tied to the embeddings
            self.target_output = self.target_embd if output is None else self.ops.matrix(output)
        self.embed_scale = float(np.sqrt(target.n_embd)) if target.arch.embed_scale else 1.0
        self.vocab_size = target.vocab_size
        self.inv_freq = rope.frequencies(m.rope_base, m.rope_dim, RopeScaling())

    def fuse(self, features: np.ndarray) -> np.ndarray:
        """c = hidden_norm(fc @ h) of target features [m, n_target_layers * n_embd]: [m, n_embd]."""
        w = self.weights
        return self.ops.rmsnorm(self.ops.linear(w.fc, np.ascontiguousarray(features, np.float32)), w.hidden_norm)

    def context_kv(self, c: np.ndarray, positions: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each layer's context K (k-normed, rotated) and V of fused features c [m, n_embd] (`fuse`)."""
        ops, w, m = self.ops, self.weights, self.spec.model
        out = []
        for lw in w.layers:
            (wk, _), (wv, _) = lw.qkv[1], lw.qkv[2]
            k = ops.rmsnorm(ops.linear(wk, c), lw.k_norm, groups=m.n_kv_head)
            out.append((ops.rope(k, m.n_kv_head, positions, self.inv_freq), ops.linear(wv, c)))
        return out

    def block_logits(self, ctx: ContextKV, last: int, position: int) -> np.ndarray:
        """Logits [B-1, output rows] of block slots 1 .. B-1 after `last` at `position`, over the context K/V."""
        ops, w, s = self.ops, self.weights, self.spec
        m = s.model
        tokens = np.array([last] + [s.mask_token] * (s.block_size - 1), np.int32)
        positions = np.arange(position, position + s.block_size, dtype=np.int64)
        x = ops.embed(self.target_embd, tokens, self.embed_scale)
        for layer, lw in enumerate(w.layers):
            q, k, v = project_qkv(m, ops, x, lw)
            q, k = ops.rope(q, m.n_head, positions, self.inv_freq), ops.rope(k, m.n_kv_head, positions, self.inv_freq)
            keys = np.concatenate([ctx.k[layer, :ctx.n], k])
            values = np.concatenate([ctx.v[layer, :ctx.n], v])
            x = ops.linear(lw.wo, ops.attend_all(q, keys, values, m.attn_scale), residual=x)
            x = ops.linear(lw.w_down, ops.gated_linear(x, lw.gate_up, norm=lw.ffn_norm), residual=x)
        return ops.linear(self.target_output, x[1:], norm=w.output_norm)


class DFlashDrafter:
    """One session's DFlash drafter: its context K/V, the target features not yet in it, its sequence.

    With `tree` (DDTree, algorithms.md §2) a proposal is a DraftTree from the block's per-slot distributions taken
    as independent: the greedy chain first, then best-first over paths of each slot's TREE_TOP_K most probable
    tokens, a path's probability the product of its slots' (at any temperature: the tree walk keeps the target's
    law with deterministic nodes)."""

    cheap = False  # a proposal is a forward of the drafter

    def __init__(self, model: DFlashModel, tree: bool = False):
        self.model = model
        self.tree = tree
        self.name = "dflash-tree" if tree else "dflash"
        m = model.spec.model
        self.ctx = ContextKV(m.n_layer, m.n_kv_head * m.head_dim)
        self.seq: list[int] = []
        self._features: dict[int, np.ndarray] = {}  # position -> the latest target forward's fused features there
        self._sampler = None

    def take_features(self, start: int, features: np.ndarray) -> None:
        """A target forward of this drafter's sequence computed `features` [n, ...] at positions start, start + 1...
        They are fused at once: a long prompt's wait for the first proposal in n_embd floats a position, not
        n_target_layers * n_embd."""
        for i, row in enumerate(self.model.fuse(features)):
            self._features[start + i] = row

    def begin(self, tokens: Sequence[int], params: SamplingParams) -> None:
        """Keeps the context K/V of the prefix `tokens` share with the sequence so far. Above temperature 0 the
        drafts are drawn from the drafter's distributions, which the rejection rule then uses."""
        common = next((i for i, (a, b) in enumerate(zip(self.seq, tokens, strict=False)) if a != b),
                      min(len(self.seq), len(tokens)))
        self.ctx.truncate(min(common, len(tokens) - 1))
        self.seq = list(tokens)
        self._sampler = draft_sampler(params, self.model.vocab_size)

    def propose(self, max_len: int) -> Draft | DraftTree:
        position = len(self.seq) - 1  # of the last token: the target has computed every one before it
        self._commit(position)
        n = min(max_len, self.model.spec.block_size - 1)
        if n <= 0:
            return Draft()
        logits = self.model.block_logits(self.ctx, self.seq[-1], position)[:n]
        if self.tree:
            return block_tree(logits[:, : self.model.vocab_size], max_len)
        if self._sampler is None:
            return Draft(np.argmax(logits[:, : self.model.vocab_size], axis=1).astype(int).tolist())
        probs = np.stack([self._sampler.distribution(row) for row in logits])
        return Draft([self._sampler.draw(q) for q in probs], probs)

    def accept(self, tokens: Sequence[int]) -> None:
        self.seq += tokens

    def end(self) -> None:
        pass

    def _commit(self, end: int) -> None:
        """The features of committed positions past the context (before `end`) join it; the others (a verify
        block's rejected drafts) are dropped."""
        new = sorted(p for p in self._features if self.ctx.end <= p < end)
        if new:
            positions = np.array(new, np.int64)
            self.ctx.append(positions, self.model.context_kv(np.stack([self._features[p] for p in new]), positions))
        self._features.clear()


def block_tree(logits: np.ndarray, budget: int) -> DraftTree:
    """The `budget` most probable paths through a block's slots [n, vocab] (slot d's distribution for depth d + 1,
    whatever the path before it), each slot's TREE_TOP_K best tokens its candidates; the argmax chain first."""
    z = logits.astype(np.float64)
    probs = np.exp(z - z.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    top = np.argsort(-probs, axis=1)[:, :TREE_TOP_K]
    offers = [[(int(t), float(probs[d, t])) for t in top[d]] for d in range(len(probs))]
    return best_first(lambda path: offers[len(path)] if len(path) < len(offers) else [], budget,
                      seed=top[:, 0].tolist())
