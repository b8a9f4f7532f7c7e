"""The pool limit's onset guard (extproc/policy/onset.py, `pools.<name>.limit.onset_guard`): a surge test on the
first class's arrivals that calibrates itself to their recent rate, a load curve learned from completions, and the
cap they put on the limit while a surge lasts."""

import random

import pytest

from extproc.policy.onset import ONSET_MEMORY_S, LoadCurve, OnsetGuard, SurgeTest
from extproc.policy.pool import PoolLimit
from extproc.policy.schema import PoolLimitSpec


def poisson(rng: random.Random, rate: float, start: float, end: float):
    t = start
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            return
        yield t


@pytest.mark.parametrize("rate", [0.5, 5.0, 50.0])
def test_calm_poisson_arrivals_never_read_as_a_surge_and_a_tripled_rate_does_soon(rate):
    rng = random.Random(7)
    test = SurgeTest()
    for t in poisson(rng, rate, 0.0, 600.0):
        test.arrival(t)
        assert not test.surge, t
    found = None
    for t in poisson(rng, 3 * rate, 600.0, 660.0):
        test.arrival(t)
        if test.surge and found is None:
            found = t
    assert found is not None
    # about ln(10^4) / (3 ln 2 - 2) / rate seconds of the surge's arrivals: a few arrivals' worth, whatever the rate
    assert found - 600.0 < 60.0 / rate
    test.advance(720.0)  # the surge over: the statistic drifts back to zero
    assert not test.surge


def test_no_surge_before_the_test_has_the_recent_rate_to_compare_with():
    test = SurgeTest()
    for i in range(200):  # 100 a second from the first arrival: nothing to call it a surge against yet
        test.arrival(i * 0.01)
    assert not test.surge
    assert test.recent_rate(1.99) == pytest.approx(100.0, rel=0.05)


def test_the_curve_is_read_where_its_line_meets_the_budget():
    curve = LoadCurve()
    t = 0.0
    rng = random.Random(3)
    for _ in range(800):  # service time 0.5 s + 0.1 s per unit of load, load held while each request runs
        load = rng.uniform(1, 15)
        curve.sample(t, load)
        service = 0.5 + 0.1 * load
        curve.sample(t + service, load)
        curve.observe(t, t + service, service)
        t += service + 0.01
    assert 10.5 < curve.level(budget_s=1.7, q=0.95, min_samples=10) <= 12.0  # per bin: its p95 against its mean load


def test_the_load_over_a_requests_life_is_its_time_average():
    curve = LoadCurve()
    curve.sample(0.0, 4.0)
    curve.sample(1.0, 12.0)  # 4 held for the first second, 12 from then on
    curve.sample(3.0, 0.0)
    curve.observe(0.0, 2.0, 2.0)
    curve.observe(1.0, 3.0, 2.0)
    assert list(curve.pairs) == [(8.0, 2.0), (12.0, 2.0)]
    curve.observe(-5.0, 1.0, 6.0)  # began before the first sample: no pair
    assert len(curve.pairs) == 2


@pytest.mark.parametrize("slope, first", [(0.0, 0.5), (-0.05, 1.5), (0.1, 1.9)])
def test_no_level_from_a_curve_that_does_not_rise_or_misses_the_budget_at_its_lightest_load(slope, first):
    curve = LoadCurve()
    for i in range(200):
        load = 1 + i % 20
        curve.pairs.append((float(load), first + slope * (load - 1)))
    assert curve.level(budget_s=1.7, q=0.95, min_samples=10) is None


def test_too_few_completions_give_no_level():
    curve = LoadCurve()
    for i in range(79):
        curve.pairs.append((float(i), 0.1 * i))
    assert curve.level(budget_s=1.7, q=0.95, min_samples=10) is None


def trained_guard() -> OnsetGuard:
    """A guard whose curve meets 1.7 s at a load of 11-12 and whose test has 60 s of arrivals at 2 a second."""
    guard = OnsetGuard()
    for i in range(200):
        load = 1 + i % 20
        guard.curve.pairs.append((float(load), 0.5 + 0.1 * load))
    for i in range(120):
        guard.arrival(i * 0.5)
    return guard


def test_the_guard_caps_during_a_surge_only_and_reads_the_level_once_at_its_onset():
    guard = trained_guard()
    assert guard.cap(60.0, 1.7, 0.95, 10) is None
    t = 60.0
    while not guard.test.surge:
        t += 0.05
        guard.arrival(t)
    assert guard.cap(t, 1.7, 0.95, 10) == pytest.approx(11.0, abs=0.5)
    guard.curve.pairs.clear()  # the surge's own completions do not move the level it was capped at
    assert guard.cap(t + 0.1, 1.7, 0.95, 10) == pytest.approx(11.0, abs=0.5)
    guard.released = True  # the latency loop cut: it reads the surge itself now
    assert guard.cap(t + 0.2, 1.7, 0.95, 10) is None
    assert guard.cap(t + 300.0, 1.7, 0.95, 10) is None  # the surge over: ready for the next one
    assert not guard.released


def spec(**kw) -> PoolLimitSpec:
    return PoolLimitSpec(enabled=True, unit="requests", initial=30, min=1, max=100, interval_s=0.5, window_s=5,
                         min_samples=10, **kw)


def test_the_pool_limit_has_no_guard_unless_the_policy_asks():
    assert PoolLimit(spec(), {0: 2.0}).onset is None
    assert PoolLimit(spec(onset_guard=True), {0: 2.0}).onset is not None


def test_a_surge_caps_the_pool_limit_at_the_curves_level_until_a_latency_cut():
    c = PoolLimit(spec(onset_guard=True), {0: 2.0})
    trained = trained_guard()
    c.onset = trained
    level = trained.curve.level(c.spec.target * 2.0, c.spec.quantile, c.spec.min_samples)
    assert level is not None and level < 30
    t = 60.0
    while not trained.test.surge:
        t += 0.05
        c.asked(0, t)
        c.asked(1, t)  # a lower class's arrivals are not the first class's surge
    c.update(t, 25.0, short=True, saturated=False)
    assert c.limit == pytest.approx(level) and c.last_action == "onset_cap"
    c.last_action = "cut_latency"
    c.onset.cap(t, 1.7, 0.95, 10)
    c._onset_cap(t + 0.6)  # the loop cut: the guard lets go for the rest of this surge
    assert c.onset.released


def test_a_reload_that_turns_the_guard_off_or_changes_the_first_class_starts_it_afresh():
    c = PoolLimit(spec(onset_guard=True), {0: 2.0, 1: 20.0})
    kept = c.onset
    c.respec(spec(onset_guard=True), {0: 2.0, 1: 20.0}, {0: 0, 1: 1})
    assert c.onset is kept
    c.respec(spec(onset_guard=True), {0: 20.0, 1: 2.0}, {0: 1, 1: 0})
    assert c.onset is not kept and c.onset is not None
    c.respec(spec(), {0: 2.0}, {0: 0})
    assert c.onset is None
