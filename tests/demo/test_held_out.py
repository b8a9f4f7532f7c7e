"""The pool-wide limit on scenarios no policy was tuned on (scenarios/ramp.yaml, long-answers.yaml, and
one-model-ramp.yaml and verbose-chat.yaml written by sessions testing as new users; docs/overload.md "Held out"):
what carried over from the tuned scenarios must keep carrying over."""

from pathlib import Path

import pytest

from extproc.tools.demo import what_if_stats
from extproc.tools.demo.results import calm_windows
from extproc.tools.demo.scenario import Scenario


def test_the_pool_limit_holds_the_slo_and_sheds_batch_first_on_a_ramp_it_was_not_tuned_on():
    scenario = Scenario.load("scenarios/ramp.yaml")
    stats = what_if_stats(scenario, "a,b,d")
    a, b, d = stats["a"]["climb"], stats["b"]["climb"], stats["d"]["climb"]
    slo = scenario.slo_p95_s
    # Measured 2.07 s worst window, 1.97 s over the climb (the controller lands on the SLO, not under it).
    assert d.p99 <= slo and d.p99_worst_window <= 1.05 * slo
    # Measured 15.7 req/s against Envoy's 7.8 and no control's 1.3.
    assert d.goodput >= 1.5 * b.goodput and d.goodput >= 5 * a.goodput
    assert d.useful_tokens_per_s >= 0.96 * a.useful_tokens_per_s
    assert d.first_degraded_at is None or (d.first_other_held_at or 1e9) <= d.first_degraded_at
    # At most one request in the ~630 of the phases at or under 60% load (a burst over a settled limit).
    assert sum(stats["d"][w].refused + stats["d"][w].degraded for w in calm_windows(scenario)) <= 1


def test_the_pool_limit_keeps_moving_through_a_slow_ramp_on_a_one_model_fleet():
    # scenarios/one-model-ramp.yaml, written from the docs by a session testing as a new user: 3x 70B, no small
    # model, load stepping 0.3x -> 3x every 20 s, then a drop to 0.3x. The calm baseline used to drift after the
    # ramp's latency, the limit froze over the SLO for 90 s (worst window 1.77 s) and batch bursts were refused
    # after the drop (10).
    scenario = Scenario.load("scenarios/one-model-ramp.yaml")
    stats = what_if_stats(scenario, "b,d")
    b, d = stats["b"]["overload"], stats["d"]["overload"]
    slo = scenario.slo_p95_s
    # Measured 1.51 s worst window (1.5 s SLO), goodput 28.0 req/s against Envoy's 10.3.
    assert d.p99_worst_window <= 1.05 * slo
    assert d.goodput >= 2 * b.goodput
    # One: a batch request that arrived 0.23 s after the 3x step ended, behind its backlog, and waited out its 5 s
    # (0 before 2026-12-07's running-requests count; seeds 102 / 103: 2 / 0 either way).
    assert sum(stats["d"][w].refused + stats["d"][w].degraded for w in calm_windows(scenario)) <= 1


def test_the_pool_limit_rises_at_the_pace_long_answers_show_their_latency():
    # scenarios/verbose-chat.yaml, from the same user session: answers of 1-2K tokens (5-15 s requests), four
    # classes, a surge to 2.5x. A raise every half second compounded from 27K to 83K tokens before the first raise
    # showed in latency; the premium class's worst window was 14.2 s against its 12 s SLO.
    scenario = Scenario.load("scenarios/verbose-chat.yaml")
    stats = what_if_stats(scenario, "b,d")
    b, d = stats["b"]["surge"], stats["d"]["surge"]
    # Measured 11.85 s worst window, full-model goodput 1.52 req/s against Envoy's 0.52 (tuned for the mix).
    assert d.p99_worst_window <= 1.05 * scenario.slo_p95_s
    assert d.goodput >= 2 * b.goodput


def test_the_pool_limit_holds_an_slo_whose_slowest_answers_take_several_times_the_median():
    # scenarios/long-answers.yaml: the spike with 512-token answers and a 5 s SLO, the docs' rules and no limit knob
    # set. Requests end in order of length, so the quantile of what had ended read the quick ones first; the limit
    # rose on it each round until the long ones ended, then cut: worst 10 s window 6.21 s (seeds 8 / 9: 6.30 / 6.40),
    # unless the policy set `max_raise: 0.01` by hand. Counting the requests still running (Kaplan-Meier), 4.82 s.
    scenario = Scenario.load("scenarios/long-answers.yaml")
    stats = what_if_stats(scenario, "b,d")
    b, d = stats["b"]["spike"], stats["d"]["spike"]
    assert d.p99_worst_window <= scenario.slo_p95_s
    # Measured 17.6 req/s against Envoy's 6.3 (its filter as the demo tunes it).
    assert d.goodput >= 2 * b.goodput


def test_a_burst_after_an_idle_spell_gets_the_full_model(tmp_path):
    # An operator audit: idle, the settle took the pool limit to its floor (1), so a burst after a quiet spell
    # waited one request at a time and was mostly degraded (what-if: 2.07 req/s full model, 8.67 degraded).
    import yaml
    doc = yaml.safe_load(Path("scenarios/spike.yaml").read_text(encoding="utf-8"))
    doc["phases"] = [{"name": "normal", "duration_s": 30, "rate": 0.6}, {"name": "idle", "duration_s": 30, "rate": 0.0},
                     {"name": "burst", "duration_s": 30, "rate": 0.9}]
    doc["windows"] = {"burst": ["burst"]}
    path = tmp_path / "idle-burst.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    scenario = Scenario.load(str(path))
    d = what_if_stats(scenario, "d")["d"]["burst"]
    # Measured 10.60 req/s full model, 0.13 degraded, p99 1.76 s.
    assert d.goodput >= 8.0 and d.goodput_degraded <= 0.5 and d.p99 <= scenario.slo_p95_s


def test_the_small_models_own_customers_are_not_refused_while_its_pool_has_room():
    # scenarios/shared-small.yaml: the 8B pool is the 70B's degrade target and serves a product of its own
    # (lite-chat). It answers lite-chat in a fifth of the SLO, and its limit settled at the recent peak + 50%
    # (barely one request more): 8 of 199 lite-chat requests refused at 60% load and 65 in the spike.
    from extproc.tools.demo import admitter_for
    from extproc.tools.demo.modes import parse_modes, with_policies
    from extproc.tools.demo.whatif import what_if

    scenario = Scenario.load("scenarios/shared-small.yaml")
    d_mode = next(iter(with_policies(parse_modes("d"), scenario.policies, scenario.envoy_adaptive)))
    records = what_if(scenario, admitter_for(d_mode), scenario.fleet_capacity()).records
    lite = [r for r in records if r.kind == "lite-chat"]
    assert len(lite) > 1000
    assert [r for r in lite if not r.ok or r.degraded] == []
    spike = scenario.window("spike")
    served = sorted(r.latency for r in lite if spike[0] <= r.start < spike[1])
    assert served[int(0.99 * len(served))] <= scenario.slo_p95_s  # measured 0.42 s
    stats = what_if_stats(scenario, "b,d")
    # The 70B's interactive: measured 19.4 req/s full model against Envoy's 7.1.
    assert stats["d"]["spike"].goodput >= 2 * stats["b"]["spike"].goodput


def test_a_fleet_four_times_the_demos_keeps_its_goodput_and_priority():
    # scenarios/big-fleet.yaml: 8x 70B, caps scaled by the docs' rule 2. The p99 sat at 2.25-2.42 s through the
    # spike: after each latency cut the first, shortest completions read room, and the limit saw-toothed. With the
    # post-cut blind spot (PoolLimit._blind): 1.99 s on this seed (2.18 / 2.31 on seeds 62 / 63). Since the limit
    # counts the requests still running (2026-12-07): 2.17 s here, 2.02 / 2.08 s on seeds 62 / 63 (the spike's
    # first 10 s on this seed); the bound is 10%, which the saw-tooth (2.25-2.42 s) still fails.
    scenario = Scenario.load("scenarios/big-fleet.yaml")
    stats = what_if_stats(scenario, "b,d")
    b, d = stats["b"]["spike"], stats["d"]["spike"]
    assert d.goodput >= 3 * b.goodput  # measured 82.1 against 21.0 req/s (66.5 before the blind spot)
    assert d.first_degraded_at is None or (d.first_other_held_at or 1e9) <= d.first_degraded_at
    assert d.p99_worst_window <= 1.1 * scenario.slo_p95_s


# ~43 s of CPU alone (the what-if runs its engine models in virtual time: no wall-clock bound in it); a make test
# run's four workers on the two shared cores stretched it past pyproject's default timeout of 120 s.
@pytest.mark.timeout(360)
def test_short_requests_at_a_high_rate_are_not_refused_at_60_percent_load():
    # scenarios/code-completion.yaml, written from the docs by a platform-engineer session: 16-64-token completions
    # at ~80 requests a second a replica. One request caught between its arrival and the next engine step read as
    # saturation, and the pool limit was cut 8 times in the calm minute with the latency at a quarter of its
    # target: 42 refused at 60% load (197 and 93 on seeds 802, 803).
    scenario = Scenario.load("scenarios/code-completion.yaml")
    d = what_if_stats(scenario, "d")["d"]
    assert sum(d[w].refused + d[w].degraded for w in calm_windows(scenario)) == 0
    # Measured 0.43 s worst window (0.5 s SLO), 1,122 req/s full model, nothing of interactive refused.
    assert d["spike"].p99_worst_window <= scenario.slo_p95_s
    assert d["spike"].goodput >= 1000
