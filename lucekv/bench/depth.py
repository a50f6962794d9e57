"""`lucekv bench depth`: decode speed versus context length, a bounded KVFlash pool against the full cache, beside
llama.cpp's `llama-bench` at the same depths in the same run.

The context is installed without prefill (the CUDA backend prefills ~400 tok/s at 4K today, slower deeper, so 128K
would take far longer than the decode measured): a synthetic snapshot of random token ids and random K/V in the
model's layout (fresh keys for every chunk) goes in through
`Engine.restore`, then the session's tokens plus one more are generated on, greedily with ignore_eos. The engine
reuses the session's K/V (usage.cached_tokens == context, checked) and computes only the new token before decoding.

Random K/V does not change decode speed: a decode step reads every resident K/V row and every weight whatever their
values, and the pooled run's reselects move whole 64-token chunks whatever they hold. Only which chunks a reselect
moves depends on the keys, and with random keys the quest policy finds no chunk that stands out, so it moves more
chunks than on real text: the paging cost is, if anything, overstated.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

import lucekv
from lucekv.bench.decode import file_sha256, git_commit, machine, report
from lucekv.engine.sampling import SamplingParams
from lucekv.kvflash.pager import CHUNK_TOKENS, PageIn, PageOut
from lucekv.kvflash.policy import HISTORY_PER_TAU, reselect_lag, tau_eff
from lucekv.kvflash.sequence import PagedSequence
from lucekv.model.arch import ModelSpec
from lucekv.model.gguf import GGUFFile, open_gguf
from lucekv.model.registry import resolve_model
from lucekv.snapshot.blob import KVLayout, Snapshot, SnapshotHeader, chunk_rows

RESELECT_MARGIN = 1.1  # pooled runs decode 10% past a reselect's moves (tau_eff + its lag), so each includes one
SHARED_VALUES = 4  # V arrays shared by all chunks
F16_SIGN_MANTISSA, F16_ONE = 0x83FF, 0x3C00  # float16 bits: sign and mantissa; the exponent of 1.0
NO_HOST_LIMIT = 1 << 10  # GiB: one session at a time, deleted after its run: the default 16 GiB would refuse 128K at 8B
WARMUP_TOKENS = 8
PAGING_BATCH_CHUNKS = 64
PAGING_REPEATS = 3
LLAMA_GEN_TOKENS = 128
CONTEXT_NOTE = ("The context's K/V is random, installed by Restore (a synthetic snapshot), not by prefill. Decode "
                "speed does not depend on K/V values: each step reads every resident K/V row and every weight, and "
                "reselects move whole chunks. With random keys quest's reselects move more chunks than on real "
                "text, so paging cost is if anything overstated.")
DECODE_NOTE = ("decode_tok_s is the engine's usage.decode_tokens_per_s: (tokens - 1) / time from the first sampled "
               "token to the last, so it excludes installing the context and computing the one new token, and "
               "includes every reselect and page move during decode. decode_wall_tok_s is the same span on the "
               "bench's clock; wall_s is the whole generate call.")


# ---- sizes --------------------------------------------------------------------------------------------------


def gen_tokens_for(context: int, gen_tokens: int, tau: int, pooled: bool) -> int:
    """Pooled runs decode past one reselect's moves at this depth (its scoring included: started after tau_eff
    tokens, its moves made reselect_lag tokens later); full-cache runs (no reselects) just gen_tokens."""
    if not pooled:
        return gen_tokens
    return max(gen_tokens, math.ceil(RESELECT_MARGIN * (tau_eff(context + 1, tau) + reselect_lag(context + 1, tau))))


def fit_context(context: int, n_ctx: int, gen_tokens: int, tau: int) -> int:
    """The context itself, or, past the model's, n_ctx less one new token and the decode of a pooled run at n_ctx
    (so "131072" on a 131072-token model means 131072 - 1 - gen)."""
    if context + 1 + gen_tokens_for(context, gen_tokens, tau, True) <= n_ctx:
        return context
    return n_ctx - 1 - gen_tokens_for(n_ctx, gen_tokens, tau, True)


# ---- one run: install a context, decode on it -------------------------------------------------------------


class RandomChunks(Sequence):
    """Chunk c's K/V [n_layer, 2, rows, n_kv_head, head_dim], made when asked for (the engine copies each into its
    host store, so the bench never holds them all). Keys are fresh per chunk, so the policy ranks chunks as it would
    distinct text (chunks sharing keys would tie and a reselect would keep what is resident); values come from a few
    shared arrays, nothing reads them but attention. Keys are +-[1, 2): random sign and mantissa bits, drawn far
    faster than normal floats."""

    def __init__(self, layout: KVLayout, n_tokens: int, rng: np.random.Generator):
        self.layout, self.n_tokens, self.rng = layout, n_tokens, rng
        shape = layout.chunk_shape(CHUNK_TOKENS)[:1] + layout.chunk_shape(CHUNK_TOKENS)[2:]
        self.values = [rng.standard_normal(shape, np.float32).astype(layout.dtype) for _ in range(SHARED_VALUES)]

    def __len__(self) -> int:
        return -(-self.n_tokens // CHUNK_TOKENS)

    def __getitem__(self, c: int) -> np.ndarray:
        if not 0 <= c < len(self):
            raise IndexError(c)
        rows = chunk_rows(self.n_tokens, CHUNK_TOKENS, c)
        kv = np.empty(self.layout.chunk_shape(rows), self.layout.dtype)
        kv[:, 1] = self.values[c % SHARED_VALUES][:, :rows]
        kv[:, 0] = _random_keys(kv[:, 0].shape, self.rng)
        return kv


def _random_keys(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """float16 +-[1, 2) (cast on assignment where the KV dtype is f32)."""
    bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    return ((bits & F16_SIGN_MANTISSA) | F16_ONE).view(np.float16)


def synthetic_snapshot(layout: KVLayout, n_tokens: int, vocab_size: int, session_id: str,
                       rng: np.random.Generator) -> Snapshot:
    """Random token ids and random K/V (RandomChunks: a lazy sequence, which is all restore needs of the chunk
    list); pager state None, so the policy starts afresh as after any restore into another pool."""
    ids = tuple(int(t) for t in rng.integers(0, vocab_size, n_tokens))
    header = SnapshotHeader(layout, ids, session_id, {}, created_unix=time.time())
    return Snapshot(header, RandomChunks(layout, n_tokens, rng), nbytes=0)  # never serialized


def decode_paging(before: dict, after: dict) -> dict:
    """What decode itself moved: the cumulative counters' growth after the first token."""
    return {k: after[k] - before[k] for k in ("page_ins", "page_outs", "bytes_moved")}


def paging_cost(paged: PagedSequence, backend) -> dict:
    """Time page-outs, then page-ins, of a batch of resident chunks through the backend's own moves. Each chunk
    leaves and returns to its block, so the sequence ends exactly as it was."""
    resident = paged.pager.resident_chunks()[:PAGING_BATCH_CHUNKS]
    blocks = [int(paged.pager.block_of[c]) for c in resident]
    outs = [PageOut(int(c), b) for c, b in zip(resident, blocks, strict=True)]
    ins = [PageIn(int(c), b) for c, b in zip(resident, blocks, strict=True)]
    out_s, in_s = [], []
    for _ in range(PAGING_REPEATS):
        out_s.append(_timed_moves(backend, outs, paged))
        in_s.append(_timed_moves(backend, ins, paged))
    chunk_bytes, n = paged.host.chunk_bytes, len(outs)
    return {"chunks": n, "chunk_bytes": chunk_bytes, "repeats": PAGING_REPEATS,
            **_move_figures("page_out", statistics.median(out_s), n, chunk_bytes),
            **_move_figures("page_in", statistics.median(in_s), n, chunk_bytes)}


def _timed_moves(backend, moves: list, paged: PagedSequence) -> float:
    t0 = time.perf_counter()
    backend.execute(moves, paged.host)
    _synchronize(backend)
    return time.perf_counter() - t0


def _synchronize(backend) -> None:
    """CUDA page-ins leave their copies running on the backend's stream; the CPU backend has none."""
    stream = getattr(backend, "stream", None)
    if stream is not None:
        stream.synchronize()


def _move_figures(name: str, seconds: float, n_chunks: int, chunk_bytes: int) -> dict:
    return {f"{name}_ms_per_chunk": seconds / n_chunks * 1e3, f"{name}_gb_s": n_chunks * chunk_bytes / seconds / 1e9}


def decode_run(engine: lucekv.Engine, context: int, gen: int, rng: np.random.Generator,
               session_id: str = "depth") -> dict:
    """Restore a random context of `context` tokens as a session, decode `gen` tokens on it, delete the session."""
    t0 = time.perf_counter()
    snap = synthetic_snapshot(engine.layout, context, engine.spec.vocab_size, session_id, rng)
    engine.restore(snap, session_id)
    restore_s = time.perf_counter() - t0
    ids = [*snap.header.token_ids, int(rng.integers(0, engine.spec.vocab_size))]
    try:
        row = _generate(engine, ids, gen, session_id)
        if engine.paged is not None:
            row["paging_cost"] = paging_cost(engine.paged, engine.backend)
    finally:
        engine.delete_session(session_id)
    if row["cached_tokens"] != context:
        raise RuntimeError(f"the engine reused {row['cached_tokens']} tokens of a {context}-token session")
    return {"context": context, "restore_s": restore_s, **row}


def _generate(engine: lucekv.Engine, ids: list[int], gen: int, session_id: str) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    t0 = time.perf_counter()
    stream = engine.generate(ids, params, session_id=session_id)
    first = next(stream)
    t_first = time.perf_counter()
    at_first = asdict(engine.paged.usage()) if engine.paged is not None else None
    usage = [first, *stream][-1].usage  # the last delta carries it
    t_end = time.perf_counter()
    if usage is None or usage.completion_tokens != gen:
        raise RuntimeError(f"the run did not decode {gen} tokens")
    row = {"gen_tokens": gen, "cached_tokens": usage.cached_tokens, "decode_tok_s": usage.decode_tokens_per_s,
           "decode_wall_tok_s": (gen - 1) / (t_end - t_first), "time_to_first_token_s": usage.time_to_first_token_s,
           "wall_s": t_end - t0}
    if at_first is not None:
        end = asdict(engine.paged.usage())
        row["pager"] = {"at_first_token": at_first, "at_end": end, "during_decode": decode_paging(at_first, end)}
    return row


# ---- one configuration: an engine, its contexts in increasing order -------------------------------------------


def config_runs(path: Path, pool: int | None, contexts: list[int], gen_tokens: int, options: dict,
                seed: int) -> dict:
    """The runs of one engine (pool None: the full cache), its KV sizes and backend. A failed run ends the
    configuration (a larger context would fail the same way) and is recorded."""
    label = "pooled" if pool else "full"
    engine = lucekv.load(path, kv_pool=pool, session_memory_gib=NO_HOST_LIMIT, **options)
    token_bytes = engine.layout.token_bytes
    pool_tokens = pool or -(-engine.n_ctx // CHUNK_TOKENS) * CHUNK_TOKENS
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    decode_run(engine, contexts[0], WARMUP_TOKENS, rng)  # compiles kernels, captures the decode graph
    _progress(f"{label}: warm-up {time.perf_counter() - t0:.1f} s")
    rows = []
    for context in contexts:
        gen = gen_tokens_for(context, gen_tokens, options["kv_tau"], bool(pool))
        try:
            row = decode_run(engine, context, gen, rng)
        except Exception as e:  # a long GPU run keeps what it measured (e.g. out of device memory)
            rows.append({"cache": label, "context": context, "gen_tokens": gen, "error": f"{type(e).__name__}: {e}"})
            _progress(f"{label} {context}: {rows[-1]['error']}")
            break
        held = min(context + gen, pool_tokens)
        rows.append({"cache": label, **row, "tau_eff": tau_eff(context + 1, options["kv_tau"]) if pool else None,
                     "resident_kv_bytes": (pool_tokens if pool else held) * token_bytes})
        _progress(_run_line(rows[-1]))
    kv = {"token_bytes": token_bytes, "chunk_bytes": token_bytes * CHUNK_TOKENS,
          "pool_tokens": pool_tokens, "pool_bytes": pool_tokens * token_bytes}
    backend = engine.info.backend
    del engine
    gc.collect()  # frees the pool on the device before the next configuration's engine
    return {"runs": rows, "kv": kv, "backend": backend}


def _run_line(row: dict) -> str:
    line = (f"{row['cache']} {row['context']}: decode {row['decode_tok_s']:.1f} tok/s over {row['gen_tokens']} "
            f"tokens (first token {row['time_to_first_token_s']:.2f} s, restore {row['restore_s']:.1f} s)")
    if "pager" in row:
        d, cost = row["pager"]["during_decode"], row["paging_cost"]
        line += (f"; decode paged in {d['page_ins']} / out {d['page_outs']} chunks; a chunk pages out in "
                 f"{cost['page_out_ms_per_chunk']:.2f} ms, in {cost['page_in_ms_per_chunk']:.2f} ms")
    return line


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- llama.cpp ---------------------------------------------------------------------------------------------------


def llama_bench_command(binary: str, model: Path, depths: list[int], reps: int) -> list[str]:
    return [binary, "-m", str(model), "-p", "0", "-n", str(LLAMA_GEN_TOKENS), "-d", ",".join(map(str, depths)),
            "-fa", "1", "-ngl", "99", "-r", str(reps), "-o", "json", "--progress"]


def run_llama_bench(binary: str, model: Path, depths: list[int], reps: int, timeout_s: float) -> dict:
    """llama-bench's tg figures per depth, or the error; never raises. Its progress goes on to stderr."""
    cmd = llama_bench_command(binary, model, depths, reps)
    result: dict = {"command": " ".join(cmd)}
    if shutil.which(binary) is None:
        return {**result, "error": f"{binary}: not found or not executable"}
    with tempfile.TemporaryFile("w+") as out:
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True, timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            return {**result, "error": f"{type(e).__name__}: {e}"}
        out.seek(0)
        text = out.read()
    sys.stderr.write(_tail(proc.stderr, 20))
    if proc.returncode:
        return {**result, "error": f"exit status {proc.returncode}: {_tail(proc.stderr, 5)}"}
    try:
        tg = parse_llama_bench(text)
    except ValueError as e:
        return {**result, "error": f"unreadable output: {e}"}
    return {**result, "tg": {str(d): v for d, v in sorted(tg.items())}}


def parse_llama_bench(text: str) -> dict[int, dict]:
    """Depth -> {tok_s, stddev_tok_s, n_gen, ...} of the text-generation rows (n_prompt 0) of llama-bench's JSON
    array (-o json) or JSON lines (-o jsonl). Raises ValueError when there are none."""
    rows = json_rows(text)
    tg = {}
    for r in rows:
        if not isinstance(r, dict) or r.get("n_prompt", 0) != 0 or not r.get("n_gen"):
            continue
        tg[int(r.get("n_depth", 0))] = {"tok_s": float(r["avg_ts"]), "stddev_tok_s": float(r.get("stddev_ts", 0.0)),
                                        "n_gen": int(r["n_gen"]), "build_commit": r.get("build_commit"),
                                        "gpu_info": r.get("gpu_info"), "model_type": r.get("model_type")}
    if not tg:
        raise ValueError("no text-generation rows")
    return tg


def json_rows(text: str) -> list:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError:
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"neither JSON nor JSON lines ({e})") from None
    if not isinstance(rows, list):
        raise ValueError("not a list of results")
    return rows


def _tail(text: str, lines: int) -> str:
    kept = text.strip().splitlines()[-lines:]
    return "\n".join(kept) + "\n" if kept else ""


# ---- the result --------------------------------------------------------------------------------------------


def summarize(rows: list[dict], contexts: list[int], llama: dict | None) -> dict:
    """Tok/s per context for each line of the plot, the ratios of the issue's goals."""
    def per_context(cache: str) -> list[float | None]:
        found = {r["context"]: r.get("decode_tok_s") for r in rows if r["cache"] == cache}
        return [found.get(c) for c in contexts]

    pooled, full = per_context("pooled"), per_context("full")
    tg = (llama or {}).get("tg", {})
    ours_llama = [tg[str(c)]["tok_s"] if str(c) in tg else None for c in contexts]
    summary = {"contexts": contexts, "pooled_tok_s": pooled, "full_tok_s": full, "llama_cpp_tok_s": ours_llama,
               "pooled_over_llama_cpp": [_ratio(p, q) for p, q in zip(pooled, ours_llama, strict=True)],
               "pooled_over_full": [_ratio(p, f) for p, f in zip(pooled, full, strict=True)],
               "pooled_largest_over_smallest": _ratio(pooled[-1], pooled[0])}
    deepest = summary["pooled_over_llama_cpp"][-1]
    summary["goals"] = {
        "pooled_largest_over_smallest_ge_0.9": _at_least(summary["pooled_largest_over_smallest"], 0.9),
        "pooled_over_llama_cpp_at_largest_ge_3": _at_least(deepest, 3.0)}
    return summary


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _at_least(value: float | None, goal: float) -> bool | None:
    return None if value is None else value >= goal


def model_info(path: Path, g: GGUFFile, spec: ModelSpec) -> dict:
    """Name and shape; the file's SHA-256 unless its weights are random (a synthetic shape, named so by its
    writer), where the shape is what identifies it."""
    quants = Counter(t.qtype.name for t in g.tensors.values())
    info = {"name": spec.name, "arch": spec.arch.name, "file": path.name,
            "file_bytes": path.stat().st_size, "fingerprint": g.fingerprint,
            "shape": {"n_layer": spec.n_layer, "n_embd": spec.n_embd, "n_head": spec.n_head,
                      "n_kv_head": spec.n_kv_head, "head_dim": spec.head_dim, "n_ff": spec.n_ff,
                      "vocab_size": spec.vocab_size, "n_ctx": spec.n_ctx},
            "tensor_types": dict(quants.most_common())}
    info["synthetic"] = spec.name.startswith("synthetic-")
    if not info["synthetic"]:
        info["sha256"] = file_sha256(path)
    return info


def uncommitted_files() -> list[str]:
    """Files of the package that differ from the commit the result names (a run of work in progress says so)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "."], capture_output=True, text=True,
                             check=True, cwd=Path(lucekv.__file__).parent).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [line[3:] for line in out.splitlines()]


def gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, check=True, timeout=30).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError):
        from lucekv.bench.matvec_speed import device_name
        from lucekv.kernels.cuda import cuda

        return device_name(cuda.get_current_device())


def run(model: str, backend: str, contexts: list[int], pool: int, policy: str, tau: int, gen_tokens: int,
        kv_dtype: str, llama_bench: str | None, llama_reps: int, llama_timeout_s: float, seed: int = 0) -> dict:
    path = resolve_model(model)
    options = {"backend": backend, "kv_dtype": kv_dtype, "kv_policy": policy, "kv_tau": tau}
    g = open_gguf(path)
    spec = ModelSpec.from_gguf(g)
    n_ctx = spec.n_ctx  # what the engine caps its context at
    fitted = sorted({fit_context(c, n_ctx, gen_tokens, tau) for c in contexts})
    _progress(f"contexts {fitted} (model context {n_ctx}); pool {pool} tokens, {policy}, tau {tau}")
    llama = None
    if llama_bench:  # first, while the GPU holds nothing of ours
        llama = run_llama_bench(llama_bench, path, fitted, llama_reps, llama_timeout_s)
        _progress(f"llama-bench: {llama.get('error') or {d: round(v['tok_s'], 1) for d, v in llama['tg'].items()}}")
    pooled = config_runs(path, pool, fitted, gen_tokens, options, seed)
    full = config_runs(path, None, fitted, gen_tokens, options, seed)
    result = {
        "bench": "depth",
        "commit": git_commit(),
        "uncommitted": uncommitted_files(),
        "machine": machine() | ({"gpu": gpu_name()} if pooled["backend"] == "cuda" else {}),
        "backend": pooled["backend"],
        "model": model_info(path, g, spec),
        "command": "lucekv " + " ".join(sys.argv[1:]),
        "settings": {"contexts_requested": contexts, "contexts": fitted, "pool_tokens": pool, "policy": policy,
                     "tau": tau, "gen_tokens": gen_tokens, "kv_dtype": kv_dtype, "seed": seed},
        "context_note": CONTEXT_NOTE,
        "contexts_note": f"a requested context that leaves no room in the model's {n_ctx} tokens for one new token "
                         "and the pooled run's decode is cut to n_ctx - 1 - that decode",
        "decode_note": DECODE_NOTE,
        "gen_tokens_note": f"pooled runs decode max(gen_tokens, ceil({RESELECT_MARGIN} * (tau_eff + lag))) tokens, "
                           f"tau_eff = max(tau, history // {HISTORY_PER_TAU}), lag = min(64, tau_eff // 4) (a "
                           "reselect is scored in the background and its moves made lag tokens after it starts), "
                           "so each includes a reselect's scoring and moves; full-cache runs decode gen_tokens",
        "kv": {"pooled": pooled["kv"], "full": full["kv"]},
        "runs": pooled["runs"] + full["runs"],
        "llama_cpp": llama,
    }
    result["summary"] = summarize(result["runs"], fitted, llama)
    return result


# ---- the plot ------------------------------------------------------------------------------------------------


def plot(result: dict, png: str | Path) -> None:
    """Decode tok/s against context (log2 axis): pooled, full cache and llama.cpp, from a result (or its JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    pool = result["settings"]["pool_tokens"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, style in (("pooled_tok_s", f"lucekv, KVFlash pool {pool} ({result['settings']['policy']})", "o-"),
                              ("full_tok_s", "lucekv, full cache", "s--"),
                              ("llama_cpp_tok_s", "llama.cpp (llama-bench tg)", "^:")):
        points = [(c, v) for c, v in zip(s["contexts"], s[key], strict=True) if v]
        if points:
            ax.plot(*zip(*points, strict=True), style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(s["contexts"], [f"{c / 1024:.3g}K" if c >= 1024 else str(c) for c in s["contexts"]])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("context tokens (random K/V installed by Restore)")
    ax.set_ylabel("decode tok/s")
    gpu = result["machine"].get("gpu") or result["machine"].get("cpu", "")
    ax.set_title(f"{result['model']['name']} on {result['backend']} {gpu} ({result['commit']})", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def _try_plot(result: dict, png: str) -> None:
    """After the JSON is written: a missing matplotlib must not lose a GPU run (re-plot with `depth-plot`)."""
    try:
        plot(result, png)
    except ImportError as e:
        _progress(f"no plot ({e}): install matplotlib and run `lucekv bench depth-plot RESULT.json -o {png}`")


# ---- command line --------------------------------------------------------------------------------------------


def main(args) -> int:
    contexts = [int(c) for c in args.contexts.split(",")]
    result = run(args.model, args.backend, contexts, args.pool, args.policy, args.kv_tau, args.gen_tokens,
                 args.kv_dtype, args.llama_bench, args.llama_reps, args.llama_timeout)
    report(result, args.json)
    if args.plot:
        _try_plot(result, args.plot)
    return 0

