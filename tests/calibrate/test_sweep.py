"""The sweep state machine with synthetic steps: doubling, bisection, margin, refusals (no HTTP)."""

import pytest

from extproc.tools.calibrate.sweep import Status, StepResult, Sweep, SweepConfig, Verdict, apply_margin


def step(concurrency, p95, requests=100, errors=None):
    errors = errors or {}
    return StepResult(concurrency=concurrency, requests=requests, ok=requests - sum(errors.values()), errors=errors,
                      latency_p50=p95 / 2, latency_p95=p95, latency_p99=p95 * 1.1, ttft_p95=0.1,
                      tokens_per_s=100.0 * concurrency)


def drive(sweep, p95_of, errors_of=lambda c: None):
    """Run the sweep against a latency curve; returns the concurrencies it asked for."""
    asked = []
    while (c := sweep.next_concurrency()) is not None:
        asked.append(c)
        sweep.record(step(c, p95_of(c), errors=errors_of(c)))
    return asked


def test_doubles_until_the_slo_is_crossed_then_bisects_to_the_knee():
    sweep = Sweep(SweepConfig(slo_p95_s=2.0, bisect_steps=4))
    asked = drive(sweep, lambda c: 0.5 + c * 0.08)  # crosses 2.0 s after 18
    assert asked == [1, 2, 4, 8, 16, 32, 24, 20, 18, 19]
    outcome = sweep.outcome()
    assert outcome.status is Status.CAP and outcome.knee == 18 and outcome.cap == 14
    assert outcome.reason == ("p95 2.02 s > SLO 2.00 s at 19; last good 18 (p95 1.94 s); "
                              "cap = floor(18 x 0.80) = 14")


def test_bisection_stops_after_the_configured_number_of_steps():
    sweep = Sweep(SweepConfig(slo_p95_s=2.0, bisect_steps=2))
    asked = drive(sweep, lambda c: 0.5 + c * 0.08)
    assert asked == [1, 2, 4, 8, 16, 32, 24, 20]
    assert sweep.outcome().knee == 16


def test_no_bisection_when_the_bad_step_is_next_to_the_good_one():
    sweep = Sweep(SweepConfig(slo_p95_s=1.0, start=1))
    assert drive(sweep, lambda c: 0.9 if c == 1 else 1.5) == [1, 2]
    assert sweep.outcome().knee == 1 and sweep.outcome().cap == 1


def test_the_margin_is_configurable_and_overridable_for_moe():
    sweep = Sweep(SweepConfig(slo_p95_s=2.0, margin=0.25, bisect_steps=0))
    drive(sweep, lambda c: 1.0 if c <= 20 else 3.0)
    assert sweep.outcome().knee == 16 and sweep.outcome().cap == 12
    moe = sweep.outcome(margin=0.35)
    assert moe.cap == 10 and moe.margin == 0.35 and "floor(16 x 0.65) = 10" in moe.reason


def test_apply_margin_floors_without_float_noise_and_keeps_at_least_one():
    assert apply_margin(20, 0.2) == 16
    assert apply_margin(10, 0.3) == 7
    assert apply_margin(1, 0.5) == 1


def test_the_slo_holding_up_to_the_ceiling_caps_from_the_ceiling():
    sweep = Sweep(SweepConfig(slo_p95_s=2.0, max_concurrency=48))
    assert drive(sweep, lambda c: 0.5) == [1, 2, 4, 8, 16, 32, 48]
    outcome = sweep.outcome()
    assert outcome.knee == 48 and outcome.cap == 38 and "up to --max-concurrency 48" in outcome.reason


def test_a_slo_missed_at_the_start_gives_no_cap():
    sweep = Sweep(SweepConfig(slo_p95_s=0.1, start=4))
    assert drive(sweep, lambda c: 1.0) == [4]
    outcome = sweep.outcome()
    assert outcome.status is Status.SLO_MISSED_AT_START and not outcome.has_cap


def test_errors_over_the_limit_end_the_sweep_without_a_cap():
    sweep = Sweep(SweepConfig(slo_p95_s=2.0, max_error_rate=0.05))
    asked = drive(sweep, lambda c: 0.5, errors_of=lambda c: {"InternalServerError": 30, "timeout": 2} if c == 8 else None)
    assert asked == [1, 2, 4, 8]
    outcome = sweep.outcome()
    assert outcome.status is Status.TARGET_FAILED and outcome.cap is None
    assert "step 4 (concurrency 8): 32 of 100 requests failed" in outcome.reason
    assert "InternalServerError x30, timeout x2" in outcome.reason


def test_errors_within_the_limit_are_tolerated():
    config = SweepConfig(slo_p95_s=2.0, max_error_rate=0.05)
    assert config.verdict(step(8, 1.0, errors={"timeout": 5})) is Verdict.GOOD
    assert config.verdict(step(8, 1.0, errors={"timeout": 6})) is Verdict.FAILED


def test_a_step_with_no_successful_request_is_a_failure_even_without_a_limit():
    config = SweepConfig(slo_p95_s=2.0, max_error_rate=0.0)
    assert config.verdict(step(8, float("nan"), requests=0)) is Verdict.FAILED


def test_an_interrupted_sweep_keeps_its_steps_and_gives_no_cap():
    sweep = Sweep(SweepConfig(slo_p95_s=2.0))
    sweep.record(step(1, 0.5))
    sweep.interrupt()
    assert sweep.next_concurrency() is None and len(sweep.steps) == 1
    assert sweep.outcome().status is Status.INTERRUPTED and not sweep.outcome().has_cap


def test_a_step_for_another_concurrency_is_rejected():
    sweep = Sweep(SweepConfig(slo_p95_s=2.0))
    with pytest.raises(ValueError, match="expected a step at concurrency 1"):
        sweep.record(step(2, 0.5))


def test_phase_turns_to_bisect_after_the_first_bad_step():
    sweep = Sweep(SweepConfig(slo_p95_s=2.0))
    sweep.record(step(1, 0.5))
    assert sweep.phase == "double"
    sweep.record(step(2, 3.0))
    assert sweep.phase == "bisect"


@pytest.mark.parametrize("kwargs", [dict(slo_p95_s=0), dict(slo_p95_s=1, start=0), dict(slo_p95_s=1, margin=1.0),
                                    dict(slo_p95_s=1, start=300), dict(slo_p95_s=1, far_factor=1.0)])
def test_bad_configs_are_refused(kwargs):
    with pytest.raises(ValueError):
        SweepConfig(**kwargs)
