"""The Prometheus config, recording rules and alerts: promtool checks, promtool unit tests, metric names."""

from __future__ import annotations

import pytest

from .conftest import COMPOSE, RULE_FILES, run_tool, tool
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
