"""`lucekv bench spec-sim`: speculative rounds replayed over real greedy outputs, timed by a measured cost table.

A draft-length rule is judged without a GPU: the greedy continuations of `bench spec`'s prompts (made once on any
backend and kept in a scratch file, `--sequences`; made there if it is missing) are replayed through the real
SuffixDrafter and Speculator (lucekv.spec): each round proposes from the sequence so far, and the replayed text
decides what greedy verification accepts, exactly as on the device. Time is modelled: a round costs the verify
forward of the width its block runs as (the CUDA backend's `graph_width`, padded) from a `bench spec` result measured
on a GPU (`--costs`: its `verify_forward_ms.as_run`, widths between two measured ones interpolated) plus that run's
host ms per round, a plain step that run's ms per token; the speculator's own clock reads that time, so the gate and
the draft-length rule see what they would see on that GPU. Rules (lucekv.spec.fill):

- old: the drafter's k = ceil(match length) tokens as proposed (before drafts filled their block);
- fill: the block of those k + 1 filled from the match's continuation, with no times measured;
- new: the engine's rule: filled, and one width narrower or wider where the clock and the turn's acceptance say it
  pays.

Each rule runs as mode `auto` (the gate decides) and then `suffix` (every step a round) on one clock shared by all
prompts (as one engine's: only gated rounds are timed into it, which forced turns' drafts then read; in `bench spec`
each prompt's auto turn comes after its suffix turn). The speedup of a mode is modelled tokens per second over plain
decoding's; beside it, the measured figures of the cost run (whose drafts followed the old rule) say how near the
model is.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from lucekv.bench.decode import git_commit, machine, report
from lucekv.engine.sampling import SamplingParams
from lucekv.spec.drafter import Draft
from lucekv.spec.gate import Gate, StepClock
from lucekv.spec.speculator import Speculator
from lucekv.spec.suffix import SuffixDrafter

RULES = ("old", "fill", "new")
MODES = ("suffix", "auto")


# ---- the greedy outputs -----------------------------------------------------------------------------------------


def make_sequences(model: str, prompts_path: str, workloads: list[str], n: int, max_tokens: int, out: Path,
                   backend: str) -> dict:
    """Greedy continuations of the prompts, kept in `out` after each one (a long run may stop and go on). Decoded
    with speculation suffix, whose greedy output is plain greedy decoding's (tests/spec: token for token, but for
    near-ties that a verify block's rounding may flip): several times faster on a CPU."""
    import lucekv
    from lucekv.model.registry import resolve_model

    prompts = json.loads(Path(prompts_path).read_text())["workloads"]
    done = json.loads(out.read_text()) if out.exists() else {
        "model": model, "max_tokens": max_tokens, "backend": backend, "commit": git_commit(), "workloads": {}}
    engine = lucekv.load(resolve_model(model), backend=backend)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for w in workloads:
        seqs = done["workloads"].setdefault(w, [])
        for i, prompt in enumerate(prompts[w][:n]):
            if i < len(seqs):
                continue
            ids = engine.prepare(prompt, params, None, "suffix", None)
            tokens = [t for d in engine.generate(prompt, params, speculation="suffix") for t in d.token_ids]
            seqs.append({"prompt": ids, "output": tokens})
            out.write_text(json.dumps(done))
            print(f"{w} {i + 1}/{n}: {len(ids)} prompt tokens, {len(tokens)} out", file=sys.stderr, flush=True)
    return done


# ---- the cost table ---------------------------------------------------------------------------------------------


def cost_table(measured: dict[int, float], width: Callable[[int], int], widest: int) -> dict[int, float]:
    """ms of a verify forward by the width it runs as, 1 to width(widest): a measured width's at the width it ran as
    (of two that ran as one, the one measured at it), the others interpolated between their measured neighbours."""
    at: dict[int, float] = {}
    for w, ms in sorted(measured.items(), key=lambda wm: (width(wm[0]), wm[0] == width(wm[0]))):
        at[width(w)] = ms
    known = sorted(at)
    table = {}
    for w in sorted({width(n) for n in range(1, widest + 1)}):
        if w not in at:
            lo, hi = max(k for k in known if k < w), min(k for k in known if k > w)  # (past them all: ValueError)
            table[w] = round(at[lo] + (at[hi] - at[lo]) * (w - lo) / (hi - lo), 3)
        else:
            table[w] = at[w]
    return table


# ---- the replay -------------------------------------------------------------------------------------------------


class _Replay:
    """A request's target whose greedy tokens are a recorded text's (lucekv.spec.speculator.Target, chains): each
    verify forward moves the modelled time on by its width's cost."""

    def __init__(self, text: list[int], now: list[float], verify_ms: dict[int, float], width: Callable[[int], int]):
        self.text, self.now, self.verify_ms, self.width = text, now, verify_ms, width
        self.widths: list[int] = []  # each forward's, as it ran

    def verify_greedy(self, tokens: list[int], start: int, tree=None) -> np.ndarray:
        self.widths.append(self.width(len(tokens)))
        self.now[0] += self.verify_ms[self.widths[-1]] / 1e3
        after = range(start + 1, start + 1 + len(tokens))
        return np.array([self.text[p] for p in after])

    def keep(self, start: int, path: list[int]) -> None:
        pass


class _AsProposed:
    """The suffix drafter without its continuation: the old rule's drafts."""

    def __init__(self, drafter: SuffixDrafter):
        self.drafter, self.name, self.cheap = drafter, drafter.name, drafter.cheap

    def begin(self, tokens, params=None) -> None:
        self.drafter.begin(tokens, params)

    def propose(self, max_len: int) -> Draft:
        return Draft(self.drafter.propose(max_len).tokens)

    def accept(self, tokens) -> None:
        self.drafter.accept(tokens)

    def end(self) -> None:
        self.drafter.end()


class _Untimed(StepClock):
    """A clock that never tells a round's time: lucekv.spec.fill then only fills the block (rules old and fill; the
    gate keeps its own, real clock)."""

    def round(self, bucket: int, width: int) -> float | None:
        return None


def replay(prompt: list[int], out: list[int], rule: str, mode: str, clock: StepClock, costs: dict,
           width: Callable[[int], int], max_draft: int) -> dict:
    """One generation replayed: its rounds and plain steps, in modelled seconds. `clock`: the engine's (the gate's);
    the draft length reads it under rule new only. A round's budget ends with the recorded output (where that ended
    at a stop token the engine's went on, which only lets its last round verify drafts past the stop)."""
    now = [0.0]
    drafter = SuffixDrafter()
    gate = Gate(clock) if mode == "auto" else None
    spec = Speculator(mode, drafter if rule != "old" else _AsProposed(drafter), gate, max_draft,
                      clock if rule == "new" else _Untimed(), width, timer=lambda: now[0])
    target = _Replay(prompt + out, now, costs["verify_ms"], width)
    spec.begin(prompt, out[0], SamplingParams(temperature=0.0, max_tokens=len(out)))
    n = 1
    while n < len(out):
        if spec.speculating:
            now[0] += costs["host_ms_per_round"] / 1e3
            n += len(spec.round(target, out[n - 1], len(prompt) + n - 1, len(out) - n, n).tokens)
        else:
            now[0] += costs["step_ms"] / 1e3
            spec.plain(out[n], len(prompt) + n, n)
            n += 1
    u = spec.end()
    return {"decode_tokens": len(out) - 1, "seconds": now[0], "rounds": u.rounds, "drafted": u.drafted,
            "accepted": u.accepted, "plain_steps": u.plain_steps, "width_sum": sum(target.widths),
            "switches": len(u.gate_decisions)}


def summarize(runs: list[dict], step_ms: float) -> dict:
    """A mode's figures over all prompts, as `bench spec` gives them (speedup: over plain decoding's modelled time)."""
    total = {k: sum(r[k] for r in runs) for k in runs[0]}
    rounds = total["rounds"]
    plain_s = total["decode_tokens"] * step_ms / 1e3
    return {"speedup": round(plain_s / total["seconds"], 3),
            "decode_tok_s": round(total["decode_tokens"] / total["seconds"], 1),
            "tau": round((rounds + total["accepted"]) / rounds, 3) if rounds else None, "rounds": rounds,
            "drafted": total["drafted"], "accepted": total["accepted"],
            "acceptance": round(total["accepted"] / total["drafted"], 3) if total["drafted"] else None,
            "plain_steps": total["plain_steps"], "gate_switches": total["switches"],
            "width": round(1 + total["drafted"] / rounds, 2) if rounds else None,
            "width_run": round(total["width_sum"] / rounds, 2) if rounds else None}


def run(args) -> dict:
    from lucekv.backends.cuda import graph_width

    seq_path = Path(args.sequences)
    if seq_path.exists():
        sequences = json.loads(seq_path.read_text())
    else:
        sequences = make_sequences(args.model, args.prompts, args.workloads.split(","), args.n, args.max_tokens,
                                   seq_path, args.backend)
    source = json.loads(Path(args.costs).read_text())
    measured = {int(w): ms for w, ms in source["verify_forward_ms"]["as_run"].items()}
    verify_ms = cost_table(measured, graph_width, args.max_draft + 1)
    result = {"bench": "spec-sim", "commit": git_commit(), "machine": machine(),
              "command": f"lucekv bench spec-sim --sequences {seq_path.name} --costs {Path(args.costs).name} "
                         f"--workloads {args.workloads} --n {args.n} --max-draft {args.max_draft}",
              "sequences": {"file": seq_path.name, **{k: v for k, v in sequences.items() if k != "workloads"}},
              "cost_source": {"file": Path(args.costs).name, "device": source["device"], "commit": source["commit"],
                              "model": source["model"]["file"], "verify_forward_ms": measured},
              "verify_ms_by_width_run": verify_ms, "width_rule": "lucekv.backends.cuda.graph_width",
              "max_draft": args.max_draft, "max_tokens": args.max_tokens, "workloads": {}}
    for w in args.workloads.split(","):
        seqs = sequences["workloads"][w][: args.n]
        # a workload the cost run did not measure (e.g. chat) is timed by the first one it did: the verify costs are
        # the model's, the step and host times nearly so
        costs_from = w if w in source["workloads"] else next(iter(source["workloads"]))
        ran = source["workloads"][costs_from]
        costs = {"verify_ms": verify_ms, "step_ms": ran["off"]["step_ms"],
                 "host_ms_per_round": ran["suffix"]["host_ms_per_round"]}
        out: dict = {"prompts": len(seqs), "costs_from": costs_from, "step_ms": costs["step_ms"],
                     "host_ms_per_round": costs["host_ms_per_round"],
                     "measured": {m: {k: ran[m].get(k) for k in ("speedup", "tau", "rounds", "drafted", "accepted",
                                                                  "width", "plain_steps")} for m in MODES if m in ran}}
        for rule in RULES:
            clock = StepClock()  # one engine's: its auto turns time the rounds that its suffix turns then read
            for mode in ("auto", "suffix"):
                runs = [replay(s["prompt"], s["output"], rule, mode, clock, costs, graph_width, args.max_draft)
                        for s in seqs]
                out[f"{mode}-{rule}"] = summarize(runs, costs["step_ms"])
                _progress(f"{w} {mode}-{rule}: {json.dumps(out[f'{mode}-{rule}'])}")
        result["workloads"][w] = out
    return result


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(args) -> int:
    report(run(args), args.json)
    return 0
