"""The sustained-load signal: exact window means that ignore short bursts."""

import pytest

from extproc.policy.sustained import SustainedLoad


def snap(queue, inflight, limit=10):
    return {"interactive": {"queue": queue, "inflight": inflight, "limit": limit}}


def test_a_short_burst_barely_moves_the_five_minute_average():
    s = SustainedLoad(window_s=300)
    for t in range(300):
        s.sample(float(t), snap(20 if 100 <= t < 110 else 0, 5))
    depth, ratio = s.averages()["interactive"]
    assert depth == pytest.approx(200 / 300)
    assert ratio == pytest.approx(0.5)


def test_sustained_load_shows_fully_and_old_samples_leave_the_window():
    s = SustainedLoad(window_s=60)
    for t in range(120):
        s.sample(float(t), snap(8 if t >= 60 else 0, 10))
    assert s.averages()["interactive"] == (pytest.approx(8.0), pytest.approx(1.0))


def test_removed_classes_are_forgotten():
    s = SustainedLoad(window_s=60)
    s.sample(0.0, snap(1, 1))
    s.sample(1.0, {})
    assert s.averages() == {}


def test_a_class_idle_for_a_whole_window_averages_exactly_zero():
    """Running sums of the ratios (1/3 in flight, then 2/3, ...) drifted: once the window held only idle samples
    the exported average read 5.6e-18, not 0 (found by tests/unit/test_telemetry_model.py)."""
    s = SustainedLoad(window_s=10)
    for t in range(20):
        s.sample(float(t), snap(t % 3, t % 3, limit=3))
    for t in range(20, 40):
        s.sample(float(t), snap(0, 0, limit=3))
    assert s.averages()["interactive"] == (0.0, 0.0)
