"""The Grafana dashboard: valid JSON, every panel queries Prometheus, every query names metrics that exist."""

from __future__ import annotations

import json
import re

import pytest

from .conftest import COMPOSE, run_tool, tool
from .promql import metric_names

DASHBOARDS = sorted((COMPOSE / "grafana" / "dashboards").glob("*.json"))
# What operators asked for (issue 6), each found by a metric its panel must query.
REQUIRED = {
    "latency percentiles": "class:extproc_request_duration_seconds:p99_5m",
    "SLO line": "class:extproc_slo_p95_seconds:config",
    "time to first token": "class:extproc_time_to_first_byte_seconds:p95_5m",
    "decisions by reason": "extproc_requests_total",
    "in-flight": "extproc_inflight",
    "cap": "class:extproc_class_limit:fleet",
    "queue depth": "extproc_queue_depth",
    "breaker state": "extproc_breaker_state",
    "sustained queue depth": "class:extproc_queue_depth:avg5m",
    # What docs/troubleshooting.md sends operators to look at: the fallback's slots (degraded_capacity_full) and
    # the shared store going away (store_unavailable, extproc_store_switches_total).
    "degraded in-flight": "extproc_degraded_inflight",
    "shared store switches": "extproc_store_switches_total",
    # Troubleshooting sends operators to it (alert ExtprocStoreLeasesLost): the fleet may have run over a shared
    # cap while Redis let running requests' slots expire; no panel showed it.
    "shared store leases lost": "extproc_store_leases_lost_total",
}


def load(path):
    return json.loads(path.read_text())


def panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out += p.get("panels", [])  # collapsed rows keep their panels inside
    return [p for p in out if p["type"] != "row"]


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target, template variable query and annotation."""
    out = [(p["title"], t["expr"]) for p in panels(dashboard) for t in p["targets"]]
    for v in dashboard.get("templating", {}).get("list", []):
        if v["type"] == "query":
            query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
            out.append((f"variable {v['name']}", m.group(1) if m else query))
    out += [(f"annotation {a['name']}", a["expr"]) for a in dashboard.get("annotations", {}).get("list", [])
            if "expr" in a]
    return out


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_has_a_prometheus_datasource_and_targets(path):
    d = load(path)
    assert d["uid"] and d["title"]
    for p in panels(d):
        assert p["datasource"] == {"type": "prometheus", "uid": "prometheus"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"], p["title"]
            assert t.get("datasource", p["datasource"]) == p["datasource"], p["title"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panels_do_not_overlap(path):
    taken = set()
    for p in load(path)["panels"]:
        g = p["gridPos"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert g["x"] + g["w"] <= 24 and not cells & taken, p["title"]
        taken |= cells


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_query_names_metrics_that_exist(path, known_metric_names):
    unknown = [(where, m) for where, expr in expressions(load(path)) for m in metric_names(expr)
               if m not in known_metric_names]
    assert not unknown, unknown


def test_the_dashboard_shows_what_operators_asked_for():
    d = load(COMPOSE / "grafana" / "dashboards" / "extproc.json")
    queried = set().union(*(metric_names(expr) for _, expr in expressions(d)))
    missing = {what for what, metric in REQUIRED.items() if metric not in queried}
    assert not missing
    kinds = {p["type"] for p in panels(d)}
    assert "state-timeline" in kinds  # the breaker state as a timeline


def panel_expr(dashboard: dict, title: str) -> str:
    """The panel's one query, with the dashboard variables as Grafana fills them for "All" and a 1 m step."""
    (target,) = next(p for p in panels(dashboard) if p["title"] == title)["targets"]
    return target["expr"].replace("$class", ".*").replace("$__rate_interval", "4m")


def test_served_gpu_seconds_panel_reads_through_an_ext_proc_restart(tmp_path):
    """A tenant served 0.9 GPU-s/s throughout, by an ext_proc restarted at minute 5 (its per-tenant numbers start
    again from 0; so do those of a class a reload removed and the next one brought back). The panel must read
    0.9 across the restart. It read deriv() of the served gauge, which starts again from 0: in a 16-minute run
    with incidents, a tenant served ~0.39 GPU-s/s read 0.19, 0.04, -0.06, -0.15 in the minutes after a SIGTERM
    restart, and the tenant of a class that every other reload removed read negative or ~0 most of the time."""
    expr = panel_expr(load(COMPOSE / "grafana" / "dashboards" / "extproc.json"), "Served GPU-seconds per tenant")
    labels = 'class="batch",tenant="acme",instance="a",job="extproc"'
    # What the ext_proc exports, scraped every minute: 60 GPU-s charged a minute, 6 refunded by learned usage.
    series = {"extproc_tenant_charged_gpu_seconds_total": "0+60x5 60+60x5",
              "extproc_tenant_refunded_gpu_seconds_total": "0+6x5 6+6x5",
              "extproc_tenant_served_gpu_seconds": "0+54x5 54+54x5"}
    test = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": f"{name}{{{labels}}}", "values": v} for name, v in series.items()],
            "promql_expr_test": [{
                "expr": f"((({expr}) > bool 0.85) * (({expr}) < bool 0.95))",
                "eval_time": f"{m}m",
                "exp_samples": [{"labels": '{class="batch",tenant="acme"}', "value": 1}],
            } for m in (6, 7, 8, 10)],
        }],
    }
    path = tmp_path / "panel.test.yml"
    path.write_text(json.dumps(test))
    r = run_tool([tool("promtool"), "test", "rules", path.name], cwd=tmp_path)
    assert r.returncode == 0, expr + "\n" + r.stdout + r.stderr
