"""The Prometheus config, recording rules and alerts: promtool checks, promtool unit tests, metric names."""

from __future__ import annotations

import pytest

from extproc.policy.schema import load_policy_file
from extproc.telemetry import LATENCY_BUCKETS

from .conftest import COMPOSE, ROOT, RULE_FILES, run_tool, tool
from .promql import metric_names, rule_expressions

PROM = COMPOSE / "prometheus"


def test_rule_files_pass_promtool_check():
    assert RULE_FILES, "no rule files under compose/prometheus/rules"
    r = run_tool([tool("promtool"), "check", "rules", *map(str, RULE_FILES)])
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("test_file", sorted((PROM / "tests").glob("*.yml")), ids=lambda p: p.name)
def test_rule_unit_tests_pass(test_file):
    r = run_tool([tool("promtool"), "test", "rules", test_file.name], cwd=test_file.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def test_prometheus_config_passes_promtool_check_and_loads_the_rules():
    r = run_tool([tool("promtool"), "check", "config", str(PROM / "prometheus.yml")])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(RULE_FILES)} rule files found" in r.stdout


def test_rules_use_only_metrics_that_exist(known_metric_names):
    unknown = {(name, m) for name, expr in rule_expressions(RULE_FILES) for m in metric_names(expr)
               if m not in known_metric_names}
    assert not unknown, f"rules name metrics nobody exports: {sorted(unknown)}"


def test_latency_histograms_reach_past_every_shipped_slo():
    """histogram_quantile() reads a quantile that falls in the +Inf bucket as the highest finite bound, so a class
    whose SLO is at or past that bound can never read over it: no p95 above the SLO line, and ExtprocLatencyOverSLO
    can never fire. policies/reasoning-full.yaml's interactive SLO (120 s) was the highest bucket."""
    top = max(LATENCY_BUCKETS)
    past = [(path.name, name, c.slo_p95_ms) for path in sorted((ROOT / "policies").glob("*.yaml"))
            for name, c in load_policy_file(str(path)).classes.items()
            if c.slo_p95_ms is not None and c.slo_p95_ms / 1000 >= top]
    assert not past, f"SLOs at or past the highest latency bucket ({top:g} s): {past}"
