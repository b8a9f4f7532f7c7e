"""Latency and error breakers with a fake clock: every transition of the cycle."""

import pytest

from extproc.policy.breakers import CLOSED, HALF_OPEN, OPEN, ErrorBreaker, LatencyBreaker, LatencyWindow


def latency_breaker(**kw):
    args = dict(slo_s=2.0, window_s=30, min_samples=50, cooldown_s=10, trickle=0.05, trickle_s=60)
    args.update(kw)
    return LatencyBreaker(**args)


def feed(b, now, seconds, n, trickle=False):
    for _ in range(n):
        b.observe(now, seconds, trickle)


def test_window_quantile_is_within_a_bucket_of_the_truth():
    w = LatencyWindow(30)
    for i in range(1, 1001):
        w.add(0.0, i / 1000)  # 1 ms .. 1 s uniformly
    assert w.count(0.0) == 1000
    assert 0.95 <= w.quantile(0.0, 0.95) <= 0.95 * 1.08 + 1e-9
    assert 0.5 <= w.quantile(0.0, 0.5) <= 0.5 * 1.08 + 1e-9


def test_window_forgets_samples_older_than_the_window():
    w = LatencyWindow(30, n_slices=10)
    w.add(0.0, 5.0)
    w.add(20.0, 0.1)
    assert w.count(29.0) == 2
    assert w.count(33.5) == 1
    assert w.quantile(33.5, 0.99) < 0.2
    assert w.count(100.0) == 0


def test_closed_to_open_when_p95_exceeds_the_slo():
    b = latency_breaker()
    feed(b, 0.0, 1.0, 45)
    feed(b, 1.0, 3.0, 5)   # 50 samples, p95 lands on the slow ones
    assert b.state == OPEN


def test_stays_closed_below_min_samples_however_slow():
    b = latency_breaker()
    feed(b, 0.0, 10.0, 49)
    assert b.state == CLOSED


def test_stays_closed_while_p95_is_under_the_slo():
    b = latency_breaker()
    feed(b, 0.0, 1.0, 96)
    feed(b, 0.0, 30.0, 4)  # p96+ slow only
    assert b.state == CLOSED


def test_open_fails_fast_then_half_opens_after_the_cooldown():
    b = latency_breaker()
    feed(b, 0.0, 5.0, 50)
    assert b.allow(5.0) == (False, False)
    assert b.allow(10.0)[0] in (False, True) and b.state == HALF_OPEN


def test_half_open_lets_exactly_the_trickle_fraction_through():
    b = latency_breaker()
    feed(b, 0.0, 5.0, 50)
    probes = sum(1 for i in range(1000) if b.allow(10.0 + i * 0.01) == (True, True))
    assert probes == 50  # 5%


def test_a_slow_probe_reopens():
    b = latency_breaker()
    feed(b, 0.0, 5.0, 50)
    while b.allow(11.0) != (True, True):
        pass
    b.observe(12.0, 2.5, trickle=True)
    assert b.state == OPEN and b.since == 12.0


def test_non_probe_samples_do_not_reopen_a_half_open_breaker():
    b = latency_breaker()
    feed(b, 0.0, 5.0, 50)
    b.allow(11.0)
    b.observe(12.0, 9.0, trickle=False)  # a request admitted before the trip, finishing late
    assert b.state == HALF_OPEN


def test_a_clean_trickle_period_closes_with_a_fresh_window():
    b = latency_breaker()
    feed(b, 0.0, 5.0, 50)
    b.allow(11.0)
    b.observe(12.0, 0.5, trickle=True)
    assert b.allow(71.5) == (True, False)
    assert b.state == CLOSED
    assert b.window.count(71.5) == 0


def test_samples_while_open_are_ignored():
    b = latency_breaker()
    feed(b, 0.0, 5.0, 50)
    feed(b, 1.0, 0.1, 1000)
    assert b.state == OPEN


def test_error_breaker_trips_on_the_failure_ratio_with_min_requests():
    b = ErrorBreaker(max_error_ratio=0.5, window_s=30, min_requests=20, cooldown_s=10)
    for i in range(19):
        b.observe(0.0, True, False)
    assert b.state == CLOSED  # 19 < min_requests
    b.observe(0.0, True, False)
    assert b.state == OPEN


def test_error_breaker_ignores_a_low_error_rate():
    b = ErrorBreaker(max_error_ratio=0.5, min_requests=20)
    for i in range(100):
        b.observe(0.0, i % 4 == 0, False)  # 25% errors
    assert b.state == CLOSED
    assert b.error_ratio(0.0) == pytest.approx(0.25)


def test_error_breaker_cycle_reopens_on_a_failed_probe_and_closes_after_a_clean_period():
    b = ErrorBreaker(max_error_ratio=0.5, min_requests=4, cooldown_s=10, trickle=0.5, trickle_s=20)
    for _ in range(4):
        b.observe(0.0, True, False)
    assert b.state == OPEN
    assert b.allow(10.0) == (False, False) and b.state == HALF_OPEN  # credit 0.5
    assert b.allow(10.1) == (True, True)
    b.observe(10.2, True, True)
    assert b.state == OPEN
    b.allow(20.2)
    b.allow(20.3)
    b.observe(20.4, False, True)
    assert b.allow(40.3) == (True, False) and b.state == CLOSED


def test_transitions_are_reported():
    seen = []
    b = latency_breaker(min_samples=1)
    b.on_change = lambda br, state: seen.append(state)
    b.observe(0.0, 5.0, False)
    b.allow(10.0)
    b.allow(80.0)
    assert seen == [OPEN, HALF_OPEN, CLOSED]


def test_a_latency_breaker_does_not_trip_while_every_request_meets_the_slo():
    # Every request took 1.9 s against a 2 s SLO; the window's p95 read as its bucket's upper edge (2.04 s) tripped
    # the breaker, taking the class offline with no request over its SLO.
    b = latency_breaker()
    feed(b, 0.0, 1.9, 200)
    assert b.state == CLOSED
    feed(b, 1.0, 2.01, 20)  # just over the SLO, 20 of 220: past the 5% the p95 allows
    assert b.state == OPEN


def test_error_breaker_trips_when_failures_reach_exactly_the_ratio():
    # 7 failures of 50 reach a max_error_ratio of 0.14; 0.14 * 50 is 7.000000000000001 in floats: it did not trip.
    b = ErrorBreaker(max_error_ratio=0.14, min_requests=50)
    for i in range(50):
        b.observe(0.0, i < 7, False)
    assert b.state == OPEN


def test_an_idle_breaker_half_opens_and_closes_on_time():
    # Only a request moved the state on: a class that stopped sending after its breaker opened read as open (the
    # extproc_breaker_state gauge) for ever after, and ExtprocBreakerNotClosed fired for an idle class.
    b = latency_breaker()
    feed(b, 0.0, 5.0, 50)
    assert b.poll(9.9) == OPEN
    assert b.poll(10.0) == HALF_OPEN  # the trickle period starts at the end of the cooldown, not at a request
    assert b.poll(69.9) == HALF_OPEN
    assert b.poll(70.0) == CLOSED
    assert b.window.count(70.0) == 0


def test_a_half_open_breaker_probes_exactly_its_trickle():
    # 0.1 added ten times is 0.9999999999999999: the tenth request was refused and the first probe was the 11th
    # (found by test_breakers_model).
    b = ErrorBreaker(min_requests=1, cooldown_s=1.0, trickle=0.1, trickle_s=60.0)
    b.observe(0.0, True, False)
    probes = [b.allow(1.0)[1] for _ in range(30)]
    assert [i + 1 for i, probe in enumerate(probes) if probe] == [10, 20, 30]


def test_a_reload_does_not_reopen_a_breaker_that_closed_by_time():
    # Opened at 0 with a 1 s cooldown and a 1 s trickle period, then nothing asked it: closed by time at 2 s, its
    # state still read open. A reload at 100 s with a 200 s cooldown took that over and refused the class until 200 s.
    old = ErrorBreaker(min_requests=1, cooldown_s=1.0, trickle_s=1.0)
    old.observe(0.0, True, False)
    new = ErrorBreaker(min_requests=1, cooldown_s=200.0, trickle_s=1.0)
    new.take_state(old, 100.0)
    assert new.poll(100.0) == CLOSED
    reopened = ErrorBreaker(min_requests=1, cooldown_s=1.0, trickle_s=1.0)
    reopened.observe(100.0, True, False)
    longer = ErrorBreaker(min_requests=1, cooldown_s=200.0, trickle_s=1.0)
    longer.take_state(reopened, 100.5)  # open still: the new cooldown counts from when it opened
    assert (longer.poll(250.0), longer.opens_in(250.0)) == (OPEN, 50.0)


def test_a_sample_counts_in_the_state_time_has_moved_the_breaker_to():
    # A breaker unasked since its cooldown and trickle period ran out still read open or half-open when a sample
    # came: what the sample did hung on whether a request or a scrape had asked it in between (test_breakers_model).
    b = ErrorBreaker(min_requests=1, cooldown_s=1.0, trickle_s=1.0)
    b.observe(0.0, True, False)
    b.observe(10.0, True, False)  # closed at 2 s by time: a failure counts, and trips it again
    assert (b.poll(10.0), b.since) == (OPEN, 10.0)
    b = ErrorBreaker(min_requests=5, cooldown_s=1.0, trickle=1.0, trickle_s=1.0)
    for _ in range(5):
        b.observe(0.0, True, False)
    assert b.allow(1.5) == (True, True)
    b.observe(5.0, True, True)  # the probe failed after the clean period closed it: one sample of a closed window
    assert b.poll(5.0) == CLOSED and b.error_ratio(5.0) == 1.0
