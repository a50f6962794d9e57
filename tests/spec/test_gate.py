"""The gate on scripted timings: off when rounds do not pay, back on when the shadow says they would."""

from lucekv.spec.gate import Gate, GateConfig, StepClock, context_bucket


def warm_clock(t_plain=0.010, context=100):
    clock = StepClock(GateConfig())
    for _ in range(clock.config.warm_steps):
        clock.observe_plain(context_bucket(context), t_plain)
    return clock


def test_context_buckets_double():
    assert [context_bucket(n) for n in (1, 512, 513, 1024, 1025, 100_000)] == [0, 0, 1, 1, 2, 8]


def test_a_turn_starts_speculating_only_where_plain_steps_are_timed():
    assert not Gate.start(StepClock(), 100).speculating
    assert Gate.start(warm_clock(), 100).speculating
    assert not Gate.start(warm_clock(), 5000).speculating  # another context bucket


def test_rounds_that_pay_keep_speculation_on():
    gate = Gate.start(warm_clock(), 100)
    for i in range(20):
        gate.real_round(0.012, width=5, emitted=3, context=100, at=i)  # 3 tokens in 12 ms vs 30 ms plain
    assert gate.speculating and gate.decisions == []


def test_rounds_that_do_not_pay_switch_it_off_after_min_rounds():
    gate = Gate.start(warm_clock(), 100)
    for i in range(3):
        gate.real_round(0.015, width=5, emitted=1, context=100, at=i)
        assert gate.speculating
    gate.real_round(0.015, width=5, emitted=1, context=100, at=3)
    assert not gate.speculating and gate.decisions == [(3, False)]


def test_shadow_rounds_bring_it_back_after_a_backoff_that_doubles():
    clock = warm_clock()
    gate = Gate.start(clock, 100)
    for i in range(4):
        gate.real_round(0.015, width=5, emitted=1, context=100, at=i)
    assert not gate.speculating
    backoff = clock.config.backoff << 1  # one switch off so far
    for i in range(backoff - 1):
        gate.shadow_round(width=5, emitted=4, context=100, at=10 + i)  # 4 tokens for a 15 ms round: pays
    assert not gate.speculating
    gate.shadow_round(width=5, emitted=4, context=100, at=99)
    assert gate.speculating and gate.decisions == [(3, False), (99, True)]


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
