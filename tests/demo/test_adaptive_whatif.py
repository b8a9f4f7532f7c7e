"""The shifted-fleet scenario in the engine-only what-if (the real admission core, simulated clock and engines):
deterministic, so it can assert the direction issue 12 asks for on every run."""

from pathlib import Path

from extproc.tools.demo.results import window_stats
from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import what_if

ROOT = Path(__file__).resolve().parents[2]


def second_half(policy: str, scenario: str = "shifted-fleet.yaml", seed: int | None = None):
    scenario = Scenario.load(ROOT / "scenarios" / scenario)
    if seed is not None:
        scenario.seed = seed
    res = what_if(scenario, str(ROOT / "policies" / policy), scenario.fleet_capacity())
    return window_stats(res.records, scenario.report_windows()["second-half"], scenario.slo_class,
                        scenario.slo_p95_s, scenario.client_timeout_s, True), scenario.slo_p95_s


def test_limits_that_move_keep_the_slowed_fleet_within_the_slo_where_static_caps_do_not():
    static, slo = second_half("demo-static.yaml")      # the playbook's static per-class caps
    adaptive, _ = second_half("demo-adaptive.yaml")    # per-class AIMD caps (issue 12)
    pool, _ = second_half("demo-full.yaml")            # one pool-wide limit in strict priority (issue 19)
    assert adaptive.p99 <= slo < static.p99
    # The pool limit aims its served p95 at 85% of the SLO and lands near it, against the static caps' 9 s. One
    # seed is one path through a controller that reacts to its past: seeds 11-13 read 2.14 / 2.31 / 2.44 s before
    # the post-cut blind spot (docs/overload.md, big-fleet), 2.25 / 2.11 / 2.28 s with it, 2.56 / 2.13 / 2.25 s
    # since interactive stays on the fast replica however much of the limit it holds (2026-12-05: seed 11's
    # second overload starts with the limit the calm left, all of it on the one fast replica: 2.68 s for 5 s,
    # 1.87-1.94 s from 10 s on), with 1.7-2.1x the full-model goodput; 2.74 / 1.99 / 2.36 s since the lower
    # classes' request over their share rests them (seeds 11-15: mean 2.32 s against 2.25, full-model goodput
    # 8.47 against 8.58 req/s: interactive, kept on the one fast replica, gets the room batch leaves in a limit that
    # counts the whole pool).
    assert pool.p99 < static.p99
    assert max(second_half("demo-full.yaml", seed=s)[0].p99 for s in (11, 12, 13)) <= 1.4 * slo
    # The slow-replica rule keeps interactive off the slowed replica: 8.12 req/s full model (4.85 while it spread
    # interactive again past the fast replica's share of the limit, 3.29 before the rule).
    assert pool.goodput >= 7.0
    # Full-model answers: since the per-class caps steer on service time and make the lower classes yield first
    # (issue 20), they degraded less than the pool limit on this fleet (5.80 against 4.63 req/s with the
    # slow-replica rule; 3.49 against 3.29 before it, 1.71 before issue 20), until the pool limit stopped
    # spreading interactive onto the slowed replica (8.12 against 5.80, 2026-12-05). Both well above static.
    assert min(adaptive.goodput, pool.goodput) > static.goodput


def test_limits_that_move_keep_the_shrunk_fleet_within_the_slo_where_static_caps_do_not():
    static, slo = second_half("demo-static.yaml", "replica-removed.yaml")
    adaptive, _ = second_half("demo-adaptive.yaml", "replica-removed.yaml")
    pool, _ = second_half("demo-full.yaml", "replica-removed.yaml")
    assert adaptive.p99 <= slo < static.p99
    assert pool.p99 <= 1.05 * slo < static.p99
    assert pool.goodput >= adaptive.goodput
