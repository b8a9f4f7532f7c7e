"""Mode b is one filter on both sides: the gradient controller the real stack's rendered Envoy config makes Envoy
run, and the what-if's model of it (baselines.EnvoyAdaptive), have the same parameters, a knob that mode b or a
scenario leaves unset taking Envoy's own default on both. Until 2026-12-06 the renderer filled an unset knob with a
value of its own (p90, buffer 100%, ceiling 32, a 0.5 s update interval) and the model with another (p50, 25%,
1000, 0.1 s)."""

from pathlib import Path

import pytest
import yaml

from extproc.tools import envoyconf
from extproc.tools.demo.baselines import EnvoyAdaptive
from extproc.tools.demo.modes import DEFAULT_SPEED, MODES, parse_modes, with_policies
from extproc.tools.demo.scenario import Scenario

# What Envoy uses for a field its config leaves unset, as envoy.extensions.filters.http.adaptive_concurrency.v3
# documents it (adaptive_concurrency.proto, "Defaults to ..."): written out here, not read from the code under test.
ENVOY_PERCENTILE, ENVOY_MAX_LIMIT, ENVOY_MIN_CONCURRENCY, ENVOY_BUFFER = 50.0, 1000, 3, 25.0
SCENARIOS = sorted(str(p.relative_to(Path(__file__).resolve().parents[2]))
                   for p in (Path(__file__).resolve().parents[2] / "scenarios").glob("*.yaml"))
REQUIRED = {"min_rtt_fixed_s": 1.0, "concurrency_update_interval_s": 5.0}  # what Envoy needs set


def what_envoy_runs(knobs: dict | None, speed: float) -> dict:
    """The gradient controller's parameters Envoy runs from the config rendered for mode "adaptive" with `knobs`
    (read back from its YAML; a field not in it: Envoy's default), durations in simulated seconds."""
    cfg = envoyconf.render(envoyconf.load_source(), listen_port=10000, admin_port=9901, extproc=None,
                           pools={"vllm_llama70b": [("127.0.0.1", 8000)]}, mode="adaptive", adaptive=knobs,
                           speed=speed)
    cfg = yaml.safe_load(yaml.safe_dump(cfg, sort_keys=False))
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (flt,) = [f["typed_config"] for f in hcm["http_filters"] if f["name"] == envoyconf.ADAPTIVE]
    g = flt["gradient_controller_config"]
    limit, rtt = g["concurrency_limit_params"], g["min_rtt_calc_params"]
    assert "interval" not in rtt  # a fixed minimum RTT: never re-measured (the only kind the model has)
    return {
        "update_interval_s": pytest.approx(envoyconf.seconds(limit["concurrency_update_interval"]) * speed),
        "min_rtt_s": pytest.approx(envoyconf.seconds(rtt["fixed_value"]) * speed),
        "buffer_percent": rtt.get("buffer", {}).get("value", ENVOY_BUFFER),
        "percentile": g.get("sample_aggregate_percentile", {}).get("value", ENVOY_PERCENTILE),
        "min_concurrency": rtt.get("min_concurrency", ENVOY_MIN_CONCURRENCY),
        "max_concurrency_limit": limit.get("max_concurrency_limit", ENVOY_MAX_LIMIT),
    }


def what_the_model_runs(knobs: dict, speed: float) -> dict:
    b = EnvoyAdaptive(knobs, speed)
    c = b.controller
    return {"update_interval_s": b.interval_s, "min_rtt_s": c.min_rtt_s, "buffer_percent": c.buffer * 100,
            "percentile": c.sample_percentile, "min_concurrency": c.min_limit, "max_concurrency_limit": c.max_limit}


def test_the_model_runs_the_filter_the_rendered_config_makes_envoy_run_for_knobs_left_unset():
    assert what_the_model_runs(REQUIRED, DEFAULT_SPEED) == what_envoy_runs(REQUIRED, DEFAULT_SPEED)
    assert what_the_model_runs(REQUIRED, 1.0) == what_envoy_runs(REQUIRED, 1.0)
    envoy = what_envoy_runs(REQUIRED, DEFAULT_SPEED)
    assert (envoy["percentile"], envoy["buffer_percent"], envoy["max_concurrency_limit"]) == \
        (ENVOY_PERCENTILE, ENVOY_BUFFER, ENVOY_MAX_LIMIT)  # nothing rendered that was not given


@pytest.mark.parametrize("unset", sorted(set(MODES["b"].adaptive) - set(REQUIRED)))
def test_each_of_mode_bs_knobs_left_unset_is_envoys_default_on_both_sides(unset):
    knobs = {k: v for k, v in MODES["b"].adaptive.items() if k != unset}
    assert what_the_model_runs(knobs, DEFAULT_SPEED) == what_envoy_runs(knobs, DEFAULT_SPEED)


@pytest.mark.parametrize("path", SCENARIOS)
def test_every_scenarios_mode_b_is_the_same_filter_in_the_what_if_and_on_the_real_stack(path):
    scenario = Scenario.load(path)
    (b,) = with_policies(parse_modes("b"), scenario.policies, scenario.envoy_adaptive)
    assert what_the_model_runs(b.adaptive, DEFAULT_SPEED) == what_envoy_runs(b.adaptive, DEFAULT_SPEED)


def test_a_stack_in_mode_adaptive_without_knobs_runs_mode_b():
    """`extproc stack --mode adaptive` and `extproc envoy-config --mode adaptive` (no knobs, speed 1): the filter
    the demo's mode b runs, not one of the renderer's own."""
    assert what_envoy_runs(None, 1.0) == what_envoy_runs(MODES["b"].adaptive, 1.0) == \
        what_the_model_runs(MODES["b"].adaptive, 1.0)


def test_a_knob_envoy_does_not_have_or_requires_is_refused_on_both_sides():
    for knobs, match in (({**REQUIRED, "min_rtt_s": 1.0}, "unknown knob"),
                         ({"min_rtt_fixed_s": 1.0}, "concurrency_update_interval_s is required"),
                         ({"concurrency_update_interval_s": 5.0}, "give one of")):
        with pytest.raises(ValueError, match=match):
            envoyconf.adaptive_filter(knobs)
        with pytest.raises(ValueError, match=match):
            EnvoyAdaptive(knobs)
