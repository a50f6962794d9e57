"""The gate on scripted timings: off when rounds do not pay, back on when the shadow says they would."""

from lucekv.spec.gate import Gate, GateConfig, StepClock, context_bucket


def warm_clock(t_plain=0.010, context=100):
    clock = StepClock(GateConfig(min_rounds=4))  # judging after 4 rounds (the default judges after 1)
    for _ in range(clock.config.warm_steps):
        clock.observe_plain(context_bucket(context), t_plain)
    return clock


def test_context_buckets_double():
    assert [context_bucket(n) for n in (1, 512, 513, 1024, 1025, 100_000)] == [0, 0, 1, 1, 2, 8]


def speculating_gate(clock):
    """A gate whose shadow rounds paid for min_rounds rounds: speculating."""
    gate = Gate(clock)
    for i in range(clock.config.min_rounds):
        gate.shadow_round(width=5, emitted=4, context=100, at=i)
    assert gate.speculating
    return gate


def test_a_turn_starts_plain_and_speculates_once_the_shadow_pays_where_plain_steps_are_timed():
    cold = Gate(StepClock())
    for i in range(20):
        cold.shadow_round(width=5, emitted=5, context=100, at=i)
    assert not cold.speculating  # no plain step timed: nothing to compare with
    gate = Gate(warm_clock())
    for i in range(3):
        gate.shadow_round(width=5, emitted=4, context=100, at=i)
        assert not gate.speculating
    gate.shadow_round(width=5, emitted=4, context=100, at=3)
    assert gate.speculating and gate.decisions == [(3, True)]
    other_bucket = Gate(warm_clock())
    for i in range(20):
        other_bucket.shadow_round(width=5, emitted=5, context=5000, at=i)
    assert not other_bucket.speculating


def test_rounds_that_pay_keep_speculation_on():
    gate = speculating_gate(warm_clock())
    for i in range(20):
        gate.real_round(0.012, width=5, emitted=3, context=100, at=i)  # 3 tokens in 12 ms vs 30 ms plain
    assert gate.speculating and len(gate.decisions) == 1


def test_rounds_that_do_not_pay_switch_it_off_after_min_rounds():
    gate = speculating_gate(warm_clock())
    for i in range(3):
        gate.real_round(0.015, width=5, emitted=1, context=100, at=10 + i)
        assert gate.speculating
    gate.real_round(0.015, width=5, emitted=1, context=100, at=13)
    assert not gate.speculating and gate.decisions == [(3, True), (13, False)]


def test_shadow_rounds_bring_it_back_after_a_backoff_that_doubles():
    clock = warm_clock()
    gate = speculating_gate(clock)
    for backoff in (clock.config.backoff, 2 * clock.config.backoff):
        for i in range(4):
            gate.real_round(0.015, width=5, emitted=1, context=100, at=i)
        assert not gate.speculating
        for i in range(backoff - 1):
            gate.shadow_round(width=5, emitted=4, context=100, at=10 + i)  # 4 tokens for a 15 ms round: pays
        assert not gate.speculating
        gate.shadow_round(width=5, emitted=4, context=100, at=99)
        assert gate.speculating
    assert [on for _, on in gate.decisions] == [True, False, True, False, True]


def test_shadow_rounds_that_would_not_pay_leave_it_off():
    clock = warm_clock()
    clock.observe_round(context_bucket(100), 9, 0.030)
    gate = Gate(clock)
    for i in range(100):
        gate.shadow_round(width=9, emitted=2, context=100, at=i)  # 2 tokens for a 30 ms round, 20 ms plain
    assert not gate.speculating


def test_unmeasured_widths_take_the_nearest_wider_then_narrower_round():
    clock = StepClock()
    clock.observe_round(0, 3, 0.01)
    clock.observe_round(0, 9, 0.03)
    assert clock.round(0, 2) == clock.round(0, 3) == 0.01
    assert clock.round(0, 5) == 0.03
    assert clock.round(0, 17) == 0.03
    assert clock.round(1, 5) is None
