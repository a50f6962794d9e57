"""A round's chain draft fills the verify block it pays for (lucekv.spec.fill), and the speculator's real and shadow
rounds use that rule alike."""

import numpy as np
import pytest

from lucekv.engine.sampling import SamplingParams
from lucekv.spec.drafter import Draft
from lucekv.spec.fill import Acceptance, fill
from lucekv.spec.gate import Gate, GateConfig, StepClock
from lucekv.spec.speculator import Speculator

# the 1.5b target's verify forward on an H100, ms by the width it runs as (bench/results/
# h100-spec-qwen2.5-coder-1.5b-draft-0.5b-code-edit-mmq.json; 12 between its neighbours)
H100_MS = {1: 1.84, 4: 4.03, 8: 4.24, 12: 4.94, 16: 5.65, 20: 7.02}


def by_four(n: int) -> int:
    return n if n == 1 else -(-n // 4) * 4


def draft(k: int, more: int = 20) -> Draft:
    tokens = list(range(100, 100 + k + more))
    return Draft(tokens[:k], more=tokens[k:])


def acceptance(rate: float, rounds: int = 1000) -> Acceptance:
    return Acceptance(accepted=round(rate * rounds), rejected=rounds - round(rate * rounds))


def test_a_draft_fills_its_block_even_before_any_round_is_timed():
    unmeasured = lambda width: None  # noqa: E731
    assert fill(draft(2), by_four, unmeasured, Acceptance()).tokens == list(range(100, 103))  # width 3 pays for 4
    assert len(fill(draft(5), by_four, unmeasured, Acceptance())) == 7
    assert len(fill(draft(5, more=1), by_four, unmeasured, Acceptance())) == 6  # as far as the continuation goes
    assert len(fill(draft(3), lambda n: n, unmeasured, Acceptance())) == 3  # no padding (the CPU): as proposed
    assert fill(Draft(), by_four, unmeasured, Acceptance()) == Draft()


def test_one_width_wider_is_taken_only_when_its_expected_tokens_pay_its_time():
    # 3 drafts in 4.03 ms vs 7 in 4.24 ms: at acceptance 0.8, 2.95 vs 4.16 tokens (a 41% gain for 5% more time)
    assert len(fill(draft(2), by_four, H100_MS.get, acceptance(0.8))) == 7
    # at 0.3 the four more drafts add 0.01 tokens for the 5%: not
    assert len(fill(draft(2), by_four, H100_MS.get, acceptance(0.3))) == 3
    # 13 drafts run at 16 (5.65 ms): 15 drafts there emit 8.1 tokens at 0.9, 19 at 20 (7.02 ms) 8.8: not
    assert len(fill(draft(13), by_four, H100_MS.get, acceptance(0.9))) == 15


def test_a_block_that_only_just_spills_into_a_wider_width_gives_its_last_draft_back():
    # the longest draft (16) makes a block of 17, which runs at 20 (7.02 ms) but cannot hold more drafts: 15 at 16
    assert len(fill(draft(16, more=0), by_four, H100_MS.get, acceptance(0.9))) == 15
    assert len(fill(draft(1, more=0), by_four, H100_MS.get, acceptance(0.1))) == 1  # never below one draft
    # where the wider forward costs next to nothing more, the 16th draft stays
    assert len(fill(draft(16, more=0), by_four, {**H100_MS, 20: 5.7}.get, acceptance(0.9))) == 16
    # a block the drafts fill keeps them (a rate this low is the gate's business)
    assert len(fill(draft(13, more=2), by_four, H100_MS.get, acceptance(0.1))) == 15


def test_draft_probabilities_follow_the_tokens_kept():
    probs = np.eye(8)[:5]
    cut = fill(Draft([1, 2, 3, 4, 5], probs), lambda n: 4 if n <= 4 else 20, H100_MS.get, acceptance(0.5))
    assert cut.tokens == [1, 2, 3] and np.array_equal(cut.probs, probs[:3])


def test_acceptance_counts_a_rejection_per_round_that_had_one():
    a = Acceptance(0, 0)
    a.add(drafted=4, accepted=4)
    a.add(drafted=4, accepted=1)
    assert a.rate == 5 / 6
    assert a.expected_tokens(2) == pytest.approx(1 + 5 / 6 + (5 / 6) ** 2)


class ListDrafter:
    """Proposes 2 tokens of `text` after the sequence so far and offers the rest as `more`."""

    name, cheap = "list", True

    def __init__(self, text):
        self.text, self.seq = text, []

    def begin(self, tokens, params=None):
        self.seq = list(tokens)

    def propose(self, max_len):
        rest = self.text[len(self.seq) : len(self.seq) + max_len]
        return Draft(rest[:2], more=rest[2:])

    def accept(self, tokens):
        self.seq += list(tokens)

    def end(self):
        pass


class Replay:
    """A target whose greedy tokens are `text`'s (lucekv.spec.speculator.Target, chains only); a verify forward takes
    H100_MS of the timer's time."""

    def __init__(self, text, now):
        self.text, self.now, self.widths = text, now, []

    def verify_greedy(self, tokens, start, tree=None):
        self.widths.append(len(tokens))
        self.now[0] += H100_MS[by_four(len(tokens))] / 1e3
        return np.array(self.text[start + 1 : start + 1 + len(tokens)])

    def keep(self, start, path):
        pass


def test_real_rounds_and_the_gates_shadow_rounds_fill_the_same_blocks():
    text = list(range(1000, 1200))
    now = [0.0]
    forced = Speculator("suffix", ListDrafter(text), None, 16, StepClock(GateConfig()), by_four, timer=lambda: now[0])
    forced.begin(text[:10], text[10], SamplingParams())
    target = Replay(text, now)
    for _ in range(2):
        forced.round(target, text[len(forced.drafter.seq) - 1], len(forced.drafter.seq) - 1, 100, 0)
    assert target.widths == [4, 4]  # 2 drafts proposed, 3 verified: the block of 4 they pay for (nothing timed)
    assert forced.clock.round(0, 4) is None  # a forced turn's rounds are not timed into the clock

    gate = Gate(StepClock(GateConfig()))
    shadows = []
    gate.shadow_round = lambda width, emitted, context, at: shadows.append((width, emitted))
    auto = Speculator("auto", ListDrafter(text), gate, 16, gate.clock, by_four, timer=lambda: now[0])
    auto.begin(text[:10], text[10], SamplingParams())
    for i in range(11, 20):
        auto.plain(text[i], i, i - 10)
    assert shadows[0] == (4, 4)  # the shadow drafted 3 (a block of 4), all came true, then the target's own token
    gate.speculating = True
    for _ in range(3):
        auto.round(target, text[len(auto.drafter.seq) - 1], len(auto.drafter.seq) - 1, 100, 20)
    # its rounds are timed; the untimed 8 looks as cheap as 4 (the clock's stand-in), is tried, and with every draft
    # accepted so far its measured 4.24 ms pays
    assert target.widths[2:] == [4, 8, 8] and gate.clock.round(0, 4) == pytest.approx(0.00403)
    gate.speculating = False
    for _ in range(20):
        n = len(auto.drafter.seq)
        auto.plain(text[n], n, n - 10)
    assert shadows[-1] == (8, 8)  # the shadow now proposes as the rounds did: 7 drafts at 8
