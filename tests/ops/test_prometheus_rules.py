"""The Prometheus config, recording rules and alerts: promtool checks, promtool unit tests, metric names."""

from __future__ import annotations

import asyncio

import pytest

from extproc.policy.admission import AdmissionController
from extproc.policy.schema import load_policy, load_policy_file
from extproc.server.servicer import ExtProcServicer
from extproc.server.stream import TRANSITIONS, Phase
from extproc.telemetry import LATENCY_BUCKETS
from tests.reliability.test_servicer_regressions import Ctx
from tests.unit.test_stream import request_body, request_headers

from .conftest import COMPOSE, ROOT, RULE_FILES, description, run_tool, shipped_alert, tool
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


def test_stream_errors_alert_says_what_became_of_the_failed_streams_requests(monkeypatch):
    """ExtprocStreamErrors told on-call that the failed streams' requests "bypassed admission". The servicer
    refuses a request whose stream fails before its decision (500 admission_error), precisely so that a bug is no
    way around admission: a handler bug on a real stream, then what the alert says of it."""
    ctx = Ctx([request_headers(), request_body({"model": "llama", "messages": [{"role": "user", "content": "hi"}]})])

    def bug(stream, msg):
        raise ZeroDivisionError("a bug in the body handler")

    core = AdmissionController(load_policy({"classes": {"interactive": {"max_concurrency": 1}},
                                            "models": {"llama": {"cluster": "vllm"}}}))
    errors = []
    servicer = ExtProcServicer(core, on_error=lambda: errors.append(1))
    monkeypatch.setitem(TRANSITIONS[Phase.BODY], "request_body", bug)
    asyncio.run(servicer.Process(None, ctx))
    assert errors == [1]  # extproc_stream_errors_total
    refusal = ctx.writes[-1].immediate_response
    reason = {h.header.key: h.header.raw_value for h in refusal.headers.set_headers}["x-extproc-reason"].decode()
    assert refusal.status.code == 500 and reason == "admission_error"
    assert not core.tickets and not servicer.live

    said = description(shipped_alert("ExtprocStreamErrors"))
    assert reason in said
    assert "bypassed admission" not in said.replace("None bypassed admission", "")
