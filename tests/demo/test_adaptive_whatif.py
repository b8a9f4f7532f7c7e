"""The shifted-fleet scenario in the engine-only what-if (the real admission core, simulated clock and engines):
deterministic, so it can assert the direction issue 12 asks for on every run."""

from pathlib import Path

from extproc.tools.demo.results import window_stats
from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import what_if

ROOT = Path(__file__).resolve().parents[2]


def second_half(policy: str, scenario: str = "shifted-fleet.yaml"):
    scenario = Scenario.load(ROOT / "scenarios" / scenario)
    res = what_if(scenario, str(ROOT / "policies" / policy), scenario.fleet_capacity())
    return window_stats(res.records, scenario.report_windows()["second-half"], scenario.slo_class,
                        scenario.slo_p95_s, scenario.client_timeout_s, True), scenario.slo_p95_s


def test_adaptive_caps_keep_the_slowed_fleet_within_the_slo_where_static_caps_do_not():
    static, slo = second_half("demo-full.yaml")       # caps tuned for two full-speed replicas
    adaptive, _ = second_half("demo-adaptive.yaml")   # the same policy with adaptive caps
    assert adaptive.p99 < static.p99
    assert adaptive.p99 <= slo < static.p99
    assert adaptive.goodput >= 0.95 * static.goodput


def test_adaptive_caps_keep_the_shrunk_fleet_within_the_slo_where_static_caps_do_not():
    static, slo = second_half("demo-full.yaml", "replica-removed.yaml")   # caps tuned for two replicas
    adaptive, _ = second_half("demo-adaptive.yaml", "replica-removed.yaml")
    assert adaptive.p99 <= slo < static.p99
    assert adaptive.goodput >= 0.95 * static.goodput
