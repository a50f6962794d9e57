"""The gate (algorithms.md §6.3): speculation runs only while it pays, judged on measured times.

Speculation pays when a round's tokens would have taken plain decoding longer than the round took:
gain = sum(tokens_i * t_plain) / sum(t_round_i) over recent rounds. `StepClock` keeps the measured seconds of a
plain step and of a round of each verify width per context bucket (a step's cost grows with the context), for the
engine's whole life: they are properties of the model and backend, not of one text. `Gate` is one turn's decision.
A turn starts with plain steps, and the drafter is asked at each of them (when proposing is cheap): its proposals
are scored against the tokens plain decoding then produces, so the accepted length a round would have had is
exactly known (greedy), and such a shadow round's gain is estimated from the clock's round times. Above 1 + margin
over min_rounds shadow rounds, speculation starts; while speculating, real rounds are judged, and below
1 - margin speculation stops. The shadow must then pay for `backoff` rounds before it comes back, twice as many
after each further switch off in the turn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

BUCKET_TOKENS = 512  # contexts up to this are bucket 0; each bucket after it doubles the context


def context_bucket(n_tokens: int) -> int:
    return max(0, math.ceil(math.log2(max(n_tokens, 1) / BUCKET_TOKENS)))


@dataclass(frozen=True)
class GateConfig:
    margin: float = 0.05  # hysteresis: off below 1 - margin, back on above 1 + margin
    # rounds (real or shadow) before a judgement: 1, as replays of real greedy outputs timed by H100 costs ran best
    # with it (auto on code 1.70x against 1.32x at 4, chat 1.05x either way: bench/results/cpu-spec-sim-*-gate.json);
    # a turn's answer often starts by copying, and every round spent waiting to judge misses that copy
    min_rounds: int = 1
    warm_steps: int = 4  # plain steps timed in a context bucket before its plain step time is trusted
    decay: float = 0.8  # weight of the past in the running sums
    backoff: int = 8  # shadow rounds that must pay before speculation returns; doubles with each switch off


class _Ewma:
    def __init__(self, decay: float):
        self.decay = decay
        self.value = 0.0
        self.count = 0

    def add(self, x: float) -> None:
        self.value = x if self.count == 0 else self.decay * self.value + (1 - self.decay) * x
        self.count += 1


class StepClock:
    """Measured seconds per context bucket: a plain decode step, and a round of each verify width (the width the
    backend runs the block as, its padding included: `verify_width` of the backends)."""

    def __init__(self, config: GateConfig = GateConfig()):
        self.config = config
        self._plain: dict[int, _Ewma] = {}
        self._round: dict[tuple[int, int], _Ewma] = {}

    def observe_plain(self, bucket: int, seconds: float) -> None:
        self._plain.setdefault(bucket, _Ewma(self.config.decay)).add(seconds)

    def observe_round(self, bucket: int, width: int, seconds: float) -> None:
        self._round.setdefault((bucket, width), _Ewma(self.config.decay)).add(seconds)

    def plain(self, bucket: int) -> float | None:
        """A plain step's time in this bucket, else in the nearest smaller bucket measured (an underestimate, so
        the gate errs towards plain decoding); None when no bucket up to this one is warm."""
        for b in range(bucket, -1, -1):
            e = self._plain.get(b)
            if e is not None and e.count >= self.config.warm_steps:
                return e.value
        return None

    def warm(self, bucket: int) -> bool:
        e = self._plain.get(bucket)
        return e is not None and e.count >= self.config.warm_steps

    def round(self, bucket: int, width: int) -> float | None:
        """A round's time at this width and bucket; unmeasured: the nearest wider round measured (an upper bound),
        else the nearest narrower one; None when no width is measured in the bucket."""
        widths = sorted(w for b, w in self._round if b == bucket)
        if not widths:
            return None
        wider = [w for w in widths if w >= width]
        return self._round[(bucket, wider[0] if wider else widths[-1])].value


@dataclass
class Gate:
    clock: StepClock
    speculating: bool = False
    decisions: list[tuple[int, bool]] = field(default_factory=list)  # (output tokens so far, speculating from then)

    def __post_init__(self) -> None:
        self._switch_offs = 0
        self._reset()

    def plain_step(self, seconds: float, context: int) -> None:
        self.clock.observe_plain(context_bucket(context), seconds)

    def real_round(self, seconds: float, width: int, emitted: int, context: int, at: int) -> None:
        bucket = context_bucket(context)
        self.clock.observe_round(bucket, width, seconds)
        t_plain = self.clock.plain(bucket)
        if t_plain is None:
            return
        self._judge(emitted * t_plain, seconds, at)

    def shadow_round(self, width: int, emitted: int, context: int, at: int) -> None:
        """A round that did not run: `emitted` is what it would have produced at verify width `width`."""
        bucket = context_bucket(context)
        t_plain = self.clock.plain(bucket)
        if t_plain is None or not self.clock.warm(bucket):
            return
        t_round = self.clock.round(bucket, width)
        self._judge(emitted * t_plain, t_plain if t_round is None else t_round, at)  # unmeasured: try it

    def _judge(self, plain_seconds: float, round_seconds: float, at: int) -> None:
        self._saved.add(plain_seconds)
        self._spent.add(round_seconds)
        self._rounds += 1
        gain = self._saved.value / self._spent.value if self._spent.value > 0 else 1.0
        c = self.clock.config
        if self.speculating and self._rounds >= c.min_rounds and gain < 1 - c.margin:
            self._switch_offs += 1
            self._set(False, at)
        elif (not self.speculating and gain > 1 + c.margin
              and self._rounds >= (c.backoff << (self._switch_offs - 1) if self._switch_offs else c.min_rounds)):
            self._set(True, at)

    def _set(self, speculating: bool, at: int) -> None:
        self.speculating = speculating
        self.decisions.append((at, speculating))
        self._reset()

    def _reset(self) -> None:
        decay = self.clock.config.decay
        self._saved, self._spent, self._rounds = _Ewma(decay), _Ewma(decay), 0
