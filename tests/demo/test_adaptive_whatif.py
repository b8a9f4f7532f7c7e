"""The shifted-fleet scenario in the engine-only what-if (the real admission core, simulated clock and engines):
deterministic, so it can assert the direction issue 12 asks for on every run."""

from pathlib import Path

import pytest

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


SEEDS = (11, 12, 13, 14, 15)
POLICIES = ("demo-static.yaml", "demo-adaptive.yaml", "demo-full.yaml")


@pytest.fixture(scope="module")
def shifted():
    """policy -> [second-half stats per seed of SEEDS], and the SLO (15 runs, ~40 s)."""
    runs = {p: [second_half(p, seed=s) for s in SEEDS] for p in POLICIES}
    return {p: [stats for stats, _ in r] for p, r in runs.items()}, runs[POLICIES[0]][0][1]


# The module fixture's 15 what-if runs (~40 s of CPU alone) count in this test's time: a make test run's four
# workers on two shared cores, with a benchmark beside them, took it past pyproject's default timeout of 120 s.
@pytest.mark.timeout(360)
def test_limits_that_move_keep_the_slowed_fleet_within_the_slo_where_static_caps_do_not(shifted):
    by_policy, slo = shifted
    static, adaptive, pool = (by_policy[p] for p in POLICIES)
    # On every seed: the per-class adaptive caps (issue 12) within the SLO, the playbook's static caps 8-10 s.
    assert all(a.p99 <= slo < s.p99 for a, s in zip(adaptive, static))
    # The pool limit aims its served p95 at 85% of the SLO and lands near it, against the static caps' 9 s. One
    # seed is one path through a controller that reacts to its past: seeds 11-13 read 2.14 / 2.31 / 2.44 s before
    # the post-cut blind spot (docs/overload.md, big-fleet), 2.25 / 2.11 / 2.28 s with it, 2.56 / 2.13 / 2.25 s
    # since interactive stays on the fast replica however much of the limit it holds (2026-12-05: seed 11's
    # second overload starts with the limit the calm left, all of it on the one fast replica: 2.68 s for 5 s,
    # 1.87-1.94 s from 10 s on), with 1.7-2.1x the full-model goodput; 2.74 / 1.99 / 2.36 / 2.45 / 2.04 s (seeds
    # 11-15) since the lower classes' request over their share rests them.
    assert all(p.p99 < s.p99 for p, s in zip(pool, static))
    assert max(p.p99 for p in pool[:3]) <= 1.4 * slo
    # The slow-replica rule keeps interactive off the slowed replica: 8.0-9.1 req/s full model on every seed (seed
    # 11: 4.85 while it spread interactive again past the fast replica's share of the limit, 3.29 before the rule),
    # against static's 3.9-5.6.
    assert all(p.goodput >= 7.0 and p.goodput > s.goodput for p, s in zip(pool, static))
    # The adaptive caps hold the SLO at about static's full-model goodput, not above it: seed 11 alone read as
    # "well above" (5.80 against 4.76 req/s), seeds 11-15 give 5.80 / 4.03 / 5.01 / 5.13 / 3.32 against 4.76 /
    # 4.36 / 5.56 / 3.91 / 5.09 (means 4.66 and 4.74; found by a held-out audit).
    assert sum(a.goodput for a in adaptive) >= 0.9 * sum(s.goodput for s in static)


def test_limits_that_move_keep_the_shrunk_fleet_within_the_slo_where_static_caps_do_not():
    static, slo = second_half("demo-static.yaml", "replica-removed.yaml")
    adaptive, _ = second_half("demo-adaptive.yaml", "replica-removed.yaml")
    pool, _ = second_half("demo-full.yaml", "replica-removed.yaml")
    assert adaptive.p99 <= slo < static.p99
    assert pool.p99 <= 1.05 * slo < static.p99
    assert pool.goodput >= adaptive.goodput
