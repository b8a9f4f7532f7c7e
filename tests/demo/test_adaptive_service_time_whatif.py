"""Issue 20's adaptive-cap fixes in the engine-only what-if (the real admission core, simulated clock and engines,
deterministic): (1) under plain overload with a wait bound that is a third of the SLO, the cap steers on the
replicas' service time, not on our own queue wait, so it does not cut itself to its floor; (2) after a slowdown
the cap comes back up within seconds of capacity returning."""

from __future__ import annotations

import pytest

from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import what_if
from tests.conftest import policy_file

CHAT = {"name": "interactive", "weight": 1, "endpoint": "chat", "model": "llama-70b",
        "prompt_tokens": {"min": 300, "max": 800}, "max_tokens": 128, "stream": True,
        "headers": {"Authorization": "Bearer sk-chat-1", "x-priority": "interactive"}}


def scenario(phases: list[tuple[str, float, float]], events: list[dict] = ()) -> Scenario:
    return Scenario.from_dict({
        "name": "adaptive-service-time", "seed": 5,
        "pools": {"vllm_llama70b": {"profile": "h100-llama70b-awq", "replicas": 2, "model_names": ["llama-70b"]},
                  "vllm_llama8b": {"profile": "h100-llama8b", "replicas": 1, "model_names": ["llama-8b"]}},
        "phases": [{"name": n, "duration_s": d, "rate": r} for n, d, r in phases],
        "events": list(events), "slo": {"class": "interactive", "p95_s": 1.5}, "workload": {"kinds": [CHAT]}})


@pytest.fixture
def policy(tmp_path):
    """The issue's class: 1.5 s SLO, a 500 ms wait bound, the cap adaptive from 12 (breaker off: the cap alone)."""
    return str(policy_file(tmp_path, classes={"interactive": {
        "max_concurrency": 12, "max_queue": 50, "max_wait_ms": 500, "slo_p95_ms": 1500,
        "adaptive": {"enabled": True, "min_limit": 2, "max_limit": 64},
        "latency_breaker": {"enabled": False}}},
        tenants=[{"name": "chat", "api_keys": ["sk-chat-1"], "max_class": "interactive",
                  "default_class": "interactive"}]))


def started(records, t0: float, t1: float):
    return [r for r in records if t0 <= r.start < t1]


def refused(records) -> int:
    return sum(1 for r in records if r.status in (429, 503))


def test_plain_overload_keeps_the_cap_where_the_service_time_holds_and_half_load_is_all_served(policy):
    sc = scenario([("overload", 40, 2.0), ("half", 30, 0.5)])
    capacity = sc.fleet_capacity()
    res = what_if(sc, policy, capacity)
    caps = [c["interactive"] for t, c in res.limits if t < 40]
    # Reading latency with the queue wait in it, this cap stayed at 13-14 and served 26 req/s (2 refused at half
    # load); on service time it rises to 30 and serves 35 of the pool's 44 req/s.
    assert caps[-1] >= 20, caps
    served = sum(r.ok for r in started(res.records, 0, 40)) / 40
    assert served >= 0.7 * capacity, (served, capacity)
    assert refused(started(res.records, 40, 70)) == 0


def test_the_cap_comes_back_within_seconds_once_a_slowdown_ends(policy):
    slow = [{"at_s": 20, "pool": "vllm_llama70b", "replica": i, "fault": {"slowdown": 2.0}} for i in (0, 1)]
    back = [{"at_s": 50, "pool": "vllm_llama70b", "replica": i, "fault": {"slowdown": 1.0}} for i in (0, 1)]
    sc = scenario([("before", 20, 0.6), ("slow", 30, 0.6), ("after", 40, 0.6)], slow + back)
    res = what_if(sc, policy, sc.fleet_capacity())
    cap_at = lambda t: [c["interactive"] for at, c in res.limits if at <= t][-1]  # noqa: E731
    assert cap_at(50) <= 0.6 * cap_at(20)  # the 2x slowdown cut it (26 -> 10 here)
    assert cap_at(75) >= 0.75 * cap_at(20), [(round(t), c["interactive"]) for t, c in res.limits]
    assert refused(started(res.records, 60, 90)) == 0  # 10 s after capacity returned, 60% load is all served
