"""Envoy's own adaptive_concurrency filter, the demo's mode b: its knobs, mode b's settings, and the values Envoy
uses for the knobs a config leaves unset.

The one place both sides read: the real stack's Envoy config (`extproc.tools.envoyconf.adaptive_filter`, mode
"adaptive") and the what-if's model of the filter (`extproc.tools.demo.baselines.EnvoyAdaptive`). A knob that mode
b or a scenario leaves unset is not rendered, so Envoy uses its own default, and the model uses `ENVOY_DEFAULTS`,
which are Envoy's: until 2026-12-06 the renderer filled unset knobs with values of its own (p90, buffer 100%, ceiling
32, update interval 0.5 s) and the model with others (p50, buffer 25%, ceiling 1000, update interval 0.1 s).

Knobs are given in simulated seconds (`*_s`); the rendered durations are divided by the run's speed.
"""

from __future__ import annotations

from typing import Any

# What Envoy uses for a knob its config leaves unset: envoy.extensions.filters.http.adaptive_concurrency.v3
# (adaptive_concurrency.proto's "Defaults to ...", and the filter's gradient_controller.cc, which reads them),
# checked against Envoy 1.40 by tests/integration/test_envoy_adaptive_model.py's "envoy-defaults" variant.
# Envoy has none for the update interval (`concurrency_update_interval` is required) nor for the minimum RTT:
# `min_rtt_calc_params.fixed_value` or a non-zero `interval` (re-measured every interval) must be set.
ENVOY_DEFAULTS: dict[str, float | int] = {
    "sample_aggregate_percentile": 50.0,  # sample_aggregate_percentile
    "max_concurrency_limit": 1000,  # concurrency_limit_params.max_concurrency_limit
    "min_concurrency": 3,  # min_rtt_calc_params.min_concurrency (also the floor and the starting limit)
    "buffer_percent": 25.0,  # min_rtt_calc_params.buffer
    "min_rtt_request_count": 50,  # min_rtt_calc_params.request_count (a re-measured minimum RTT only)
    "min_rtt_jitter_percent": 15.0,  # min_rtt_calc_params.jitter (a re-measured minimum RTT only)
}
DURATIONS = ("concurrency_update_interval_s", "min_rtt_fixed_s", "min_rtt_interval_s")
KNOBS = frozenset(ENVOY_DEFAULTS) | frozenset(DURATIONS)

# Mode b: Envoy's adaptive_concurrency, tuned as docs/demo.md explains (earlier measurements of the filter, and a
# sweep): a fixed minimum RTT (no periodic re-measurement that pins concurrency at 3), the largest buffer, an update
# interval longer than a request's round trip, and a ceiling at the fleet's knee (12 per replica: the best
# interactive p99 at the best goodput in the sweep). A scenario's `envoy_adaptive` replaces some of these.
TUNED: dict[str, float | int] = {
    "min_rtt_fixed_s": 1.0,
    "buffer_percent": 100.0,
    "concurrency_update_interval_s": 5.0,
    "sample_aggregate_percentile": 90.0,
    "max_concurrency_limit": 24,
    "min_concurrency": 3,
}


def effective(knobs: dict[str, Any]) -> dict[str, Any]:
    """Every knob as Envoy runs the filter configured with `knobs`: theirs, Envoy's defaults for the others (the
    minimum RTT knob not given: None). ValueError for an unknown knob, or a config Envoy rejects."""
    unknown = sorted(set(knobs) - KNOBS)
    if unknown:
        raise ValueError(f"adaptive_concurrency: unknown knob(s) {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(KNOBS))})")
    if not knobs.get("concurrency_update_interval_s"):
        raise ValueError("adaptive_concurrency: concurrency_update_interval_s is required (Envoy has no default)")
    if bool(knobs.get("min_rtt_fixed_s")) == bool(knobs.get("min_rtt_interval_s")):
        raise ValueError("adaptive_concurrency: give one of min_rtt_fixed_s (a fixed minimum RTT) and "
                         "min_rtt_interval_s (re-measured every interval)")
    return {"min_rtt_fixed_s": None, "min_rtt_interval_s": None, **ENVOY_DEFAULTS, **knobs}
