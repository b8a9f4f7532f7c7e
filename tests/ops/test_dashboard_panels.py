"""Every panel of the Grafana dashboard shows data in a real run, and plausible data.

One stack run (~35 s): the incident drills' stack (simulated vLLM replicas, Envoy, the ext_proc on Redis, a real
Prometheus on the shipped rules scaled 60x, scraping every 0.5 s), with a policy that turns on what the dashboard
has panels for: shedding, a degrading fallback with its own slots, a tenant rate limit, every answer read
(time to first token), a pool-wide limit. Calm traffic with streamed answers, a class demotion, an unknown class
claim and a policy reload; a batch spike (degrade), then both classes (accept, queue, reject, shed); both replicas
failing (held until the error breaker opens); one replica killed. Then every panel target, the template variable's
query and the annotation are asked of Prometheus over the whole run, as Grafana sends them (all classes, the drill's
$__rate_interval).

A panel that comes back empty fails, unless EMPTY_OK names it with why this run cannot show it. test_grafana.py
checks that the queries name metrics that exist; this checks that they find series, the way an operator's
dashboard does, so that a renamed label, a recording rule that never yields a series or a variable that matches
nothing fails here rather than on the day of an incident.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import pytest
import yaml

from .conftest import COMPOSE
from .test_grafana import panels
from .test_incident_drills import CALM, HEADERS, POLICY, POOL, SPIKE, dashboard_queries, scale_expr, start_drill

pytestmark = pytest.mark.timeout(300)

DASHBOARD = COMPOSE / "grafana" / "dashboards" / "extproc.json"

# The drills' policy with shedding on (interactive saturated sheds batch: the default), batch's degraded requests
# on slots of their own and long enough (64 tokens) to be seen in flight, every answer read, a tenant rate limit
# and a pool-wide limit that counts requests (until the spike: see run()).
RUN_POLICY = {
    **{k: v for k, v in POLICY.items() if k != "shed"},
    "learn_sample": 1.0,
    "classes": {**POLICY["classes"],
                "batch": {**POLICY["classes"]["batch"],
                          "fallback": {"action": "degrade", "max_tokens": 64, "max_concurrency": 4}}},
    "tenants": [{**t, "requests_per_minute": 100_000} if t["name"] == "batch-jobs" else t for t in POLICY["tenants"]],
    "pools": {POOL: {**POLICY["pools"][POOL], "limit": {"enabled": True, "unit": "requests", "initial": 8}}},
}

# (panel title, refId) -> why this run leaves it empty. Everything else must show data.
EMPTY_OK = {
    ("Shadow mode: what enforce would have done", "A"): "the policy enforces (mode: shadow counts these)",
    ("Agent-session refusals and reloads", "A"): "no agent sessions in the run's traffic",
    ("ext_proc health", "G"): "a series only while the policy routes to a cluster Envoy lacks",
}


def panel_targets() -> list[tuple[str, str, str, str]]:
    """(title, refId, unit, query as Grafana sends it in drill time) for every panel target."""
    queries = dashboard_queries()
    out = []
    for p in panels(json.loads(DASHBOARD.read_text())):
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        for t, q in zip(p["targets"], queries[p["title"]], strict=True):
            out.append((p["title"], t["refId"], unit, q))
    return out


async def extras(url: str) -> None:
    """What calm traffic lacks: streamed answers (time to first token), a batch tenant claiming interactive
    (demoted), a claim of a class the policy lacks."""
    body = {"model": "llama-70b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}
    sends = [({**body, "stream": True}, HEADERS["interactive"])] * 6 + \
            [(body, {**HEADERS["batch"], "x-priority": "interactive"})] * 3 + \
            [(body, {**HEADERS["interactive"], "x-priority": "platinum"})] * 3
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        for payload, headers in sends:
            async with session.post(f"{url}/v1/chat/completions", json=payload, headers=headers) as r:
                await r.read()
            await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run's Prometheus, and the stretch of time it covers."""
    with start_drill(tmp_path_factory.mktemp("panels"), 100, 0, RUN_POLICY) as d:
        t0 = time.time()
        d.traffic.rate = dict(CALM)
        asyncio.run(extras(d.stack.url))
        d.reload()  # the same policy: an applied reload (the annotation)
        time.sleep(2)
        d.traffic.rate = {**CALM, "batch": SPIKE["batch"]}  # batch alone over its cap: it degrades
        time.sleep(4)
        # ... until Prometheus has seen a degraded request in flight (or 10 s more): on a busy machine the load
        # generator reaches the spike's rate later, and fewer requests degrade in the same time.
        d.api.wait_for('max(extproc_degraded_inflight)', lambda r: r and float(r[0]["value"][1]) >= 1, 10)
        # Shedding acts only on pools without a pool-wide limit (on one, the limit's strict priority makes batch
        # wait instead): the spike runs on the policy with the limit taken off, a reload that moves what runs.
        policy = yaml.safe_load(d.policy_path.read_text())
        del policy["pools"][POOL]["limit"]
        d.policy_path.write_text(yaml.safe_dump(policy, sort_keys=False))
        d.reload()
        time.sleep(1)
        d.traffic.rate = dict(SPIKE)  # interactive too: it queues and refuses, and batch is shed
        time.sleep(5)
        d.traffic.rate = {"interactive": 2 * CALM["interactive"]}
        d.fault(0, error_rate=1)
        d.fault(1, error_rate=1)
        # Held until the error breaker has opened and Prometheus has seen it (or 15 s), then one more second.
        d.api.wait_for('max(extproc_breaker_state{kind="error"})', lambda r: r and r[0]["value"][1] == "2", 15)
        time.sleep(1)
        d.fault(0, reset=1)
        d.fault(1, reset=1)
        d.traffic.rate = dict(CALM)
        d.stack.process(f"sim-{POOL}-1").stop(signal.SIGKILL)
        time.sleep(3)
        yield d.api, t0, time.time(), dict(d.traffic.seen)


def shown(api, query: str, start: float, end: float) -> list[dict]:
    return api.query_range(query, start, end, 0.5)


def test_the_run_exercised_accept_queue_reject_shed_and_degrade(run):
    *_, seen = run
    decisions = {(cls, d) for cls, _, d, _ in seen}
    assert {("interactive", "accept"), ("interactive", "reject"), ("batch", "accept"), ("batch", "shed"),
            ("batch", "degrade")} <= decisions, seen
    assert any(reason == "error_breaker_open" for *_, reason in seen), seen


@pytest.mark.parametrize("title,ref,unit,query", panel_targets(), ids=lambda v: str(v)[:40])
def test_every_panel_target_shows_plausible_data(run, title, ref, unit, query):
    api, t0, t1, _ = run
    series = shown(api, query, t0, t1)
    values = [float(v) for s in series for _, v in s["values"] if v not in ("NaN", "+Inf", "-Inf")]
    if (title, ref) in EMPTY_OK:
        assert not values, f"{title!r} {ref} shows data now: take it off EMPTY_OK ({EMPTY_OK[title, ref]})"
        return
    assert values, f"{title!r} {ref} showed nothing over the run: {query}"
    if unit in ("reqps", "ops"):
        assert min(values) >= 0, (title, ref, min(values))
    if unit == "percentunit":
        assert 0 <= min(values) and max(values) <= 1.0 + 1e-9, (title, ref, min(values), max(values))
    if unit == "s":  # seconds, not milliseconds: nothing in this run takes a minute
        assert 0 <= min(values) and max(values) < 60, (title, ref, min(values), max(values))


def test_the_class_variable_and_the_reload_annotation_find_series(run):
    api, t0, t1, _ = run
    d = json.loads(DASHBOARD.read_text())
    (var,) = d["templating"]["list"]
    metric = var["query"]["query"].removeprefix("label_values(").split(",")[0]
    classes = {s["metric"]["class"] for s in shown(api, metric, t0, t1)}
    assert classes == set(POLICY["classes"]), classes
    (ann,) = [a for a in d["annotations"]["list"] if "expr" in a]
    assert shown(api, scale_expr(ann["expr"]), t0, t1), ann["expr"]


# What the run's incidents must show at their peak: (panel title, refId) -> a value reached.
PEAKS = {
    ("Refused and degraded share (capacity)", "A"): 0.1,    # the spike's refusals and sheds
    # batch alone over its cap: how many degrade (against the spike's other decisions) moves with the machine's
    # pace (0.015 in one CI run), but some must show (a CI run read 0.0 while its series were born at the burst)
    ("Refused and degraded share (capacity)", "B"): 1e-3,
    ("In-flight vs cap", "C"): 1,                           # degraded requests on their own slots
    ("Queue depth", "A"): 1,
    ("Breaker state", "A"): 2,                              # open
    ("Breaker window error ratio", "A"): 0.5,
    ("vLLM running / waiting / down", "C"): 1,              # the killed replica
}


@pytest.mark.parametrize("title,ref", PEAKS, ids=lambda v: str(v)[:30])
def test_the_incidents_show_on_their_panels(run, title, ref):
    api, t0, t1, _ = run
    (query,) = [q for t, r, _, q in panel_targets() if (t, r) == (title, ref)]
    values = [float(v) for s in shown(api, query, t0, t1) for _, v in s["values"] if v != "NaN"]
    assert values and max(values) >= PEAKS[title, ref], (title, ref, max(values, default=None))


# Percentiles that one panel (or two side by side) draws per class: lower <= higher at every step.
ORDERED = [
    ["class:extproc_request_duration_seconds:p50_5m", "class:extproc_request_duration_seconds:p95_5m",
     "class:extproc_request_duration_seconds:p99_5m"],
    ["class:extproc_time_to_first_token_seconds:p50_5m", "class:extproc_time_to_first_token_seconds:p95_5m",
     "class:extproc_time_to_first_token_seconds:p99_5m"],
]


@pytest.mark.parametrize("names", ORDERED, ids=lambda n: n[0].split(":")[1])
def test_percentiles_are_ordered(run, names):
    api, t0, t1, _ = run
    by = [{(s["metric"]["class"], t): float(v) for s in shown(api, n, t0, t1) for t, v in s["values"]
           if v != "NaN"} for n in names]
    common = set(by[0]) & set(by[1]) & set(by[2])
    assert common, names
    bad = [(k, [b[k] for b in by]) for k in sorted(common) if not by[0][k] <= by[1][k] + 1e-9 <= by[2][k] + 2e-9]
    assert not bad, bad[:5]
