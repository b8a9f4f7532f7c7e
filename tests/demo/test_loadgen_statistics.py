"""The load generator's arrivals against the scenario that describes them, over long seeded runs: each phase's
Poisson rate per kind (its weights counted, a session kind's starts divided by its mean calls), the gaps'
exponential shape, sessions' call counts and growth, and in the what-if the think time between a session's calls
and the requests each phase really starts. Bounds are 4 standard deviations of the sampling error (seeded: the
same draws every run)."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from extproc.tools.demo.baselines import NoAdmission
from extproc.tools.demo.results import window_stats
from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import what_if

CAPACITY = 6.0
CALLS, THINK_S, GROWTH = (5, 10), 1.5, (100, 400)
KINDS = [
    {"name": "interactive", "weight": 0.5, "model": "llama-70b", "prompt_tokens": {"min": 300, "max": 800},
     "max_tokens": 64, "stream": True},
    {"name": "batch", "weight": 0.2, "model": "llama-70b", "prompt_tokens": 500, "max_tokens": 64},
    {"name": "agent", "weight": 0.3, "model": "llama-70b", "prompt_tokens": {"min": 200, "max": 400},
     "max_tokens": 32, "session": {"calls": {"min": CALLS[0], "max": CALLS[1]}, "think_s": THINK_S,
                                   "growth_tokens": {"min": GROWTH[0], "max": GROWTH[1]}}},
]
MEAN_CALLS = sum(CALLS) / 2


def scenario(phases: list[dict], seed: int = 11) -> Scenario:
    return Scenario.from_dict({
        "seed": seed, "capacity": CAPACITY, "client_timeout_s": 60,
        "pools": {"vllm_llama70b": {"profile": "h100-llama70b-awq", "replicas": 2, "model_names": ["llama-70b"]}},
        "phases": phases, "workload": {"kinds": KINDS}})


def within(observed: float, expected: float, sd: float) -> bool:
    return abs(observed - expected) <= 4 * sd


PHASES = [{"name": "calm", "duration_s": 1500, "rate": 0.6},
          {"name": "flood", "duration_s": 1000, "rate": 1.5, "weights": {"batch": 4.0}},
          {"name": "idle", "duration_s": 100, "rate": 0.0},
          {"name": "no-agents", "duration_s": 1000, "rate": 1.0, "weights": {"agent": 0.0}}]


def test_each_phase_arrives_at_its_rate_per_kind_with_exponential_gaps():
    s = scenario(PHASES)
    plans = s.arrivals(CAPACITY)
    assert all(a.at <= b.at for a, b in zip(plans, plans[1:]))
    total = sum(k["weight"] for k in KINDS)
    start = 0.0
    for p in PHASES:
        end = start + p["duration_s"]
        mine = [x for x in plans if start <= x.at < end]
        counts = Counter(x.kind.name for x in mine)
        rate_total = 0.0
        for k in KINDS:  # requests/s of the kind: rate x capacity x its share, times its factor in this phase
            requests = p["rate"] * CAPACITY * k["weight"] * p.get("weights", {}).get(k["name"], 1.0) / total
            starts = requests / (MEAN_CALLS if "session" in k else 1.0)  # an arrival of a session kind: a session
            expected = starts * p["duration_s"]
            assert within(counts[k["name"]], expected, math.sqrt(expected)), (p["name"], k["name"], counts)
            rate_total += starts
        if rate_total == 0:
            assert not mine
        else:
            gaps = [b.at - a.at for a, b in zip(mine, mine[1:])]
            n = len(gaps)
            mean = sum(gaps) / n
            assert within(mean, 1 / rate_total, 1 / rate_total / math.sqrt(n)), p["name"]
            # exponential: a gap is longer than the mean gap with probability 1/e, and the spread equals the mean
            longer = sum(1 for g in gaps if g > 1 / rate_total) / n
            assert within(longer, math.exp(-1), math.sqrt(math.exp(-1) * (1 - math.exp(-1)) / n)), p["name"]
            sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (n - 1))
            assert sd == pytest.approx(mean, rel=8 / math.sqrt(n)), p["name"]
        # the requests the phase's arrivals will make (a session: its calls) are the phase's load x capacity
        calls = sum(x.session.calls if x.session else 1 for x in mine)
        load = s.phase_load(s.phases[PHASES.index(p)]) * CAPACITY * p["duration_s"]
        agents = [x for x in mine if x.session]
        var = sum(1 for x in mine if not x.session) + len(agents) * sum(c * c for c in range(CALLS[0], CALLS[1] + 1)) \
            / (CALLS[1] - CALLS[0] + 1)  # compound Poisson: E[N^2] per session
        assert within(calls, load, math.sqrt(max(var, 1.0))), (p["name"], calls, load)
        start = end


def test_session_call_counts_and_growth_are_drawn_as_the_scenario_says():
    sessions = [x.session for x in scenario(PHASES).arrivals(CAPACITY) if x.session]
    assert len({s.id for s in sessions}) == len(sessions)
    counts = Counter(s.calls for s in sessions)
    values = range(CALLS[0], CALLS[1] + 1)
    assert set(counts) == set(values)
    expected = len(sessions) / len(values)
    chi2 = sum((counts[v] - expected) ** 2 / expected for v in values)
    assert chi2 < 20.5  # 5 degrees of freedom: p = 0.001
    growth = [g for s in sessions for g in s.growth]
    assert all(len(s.growth) == s.calls - 1 for s in sessions)
    assert all(GROWTH[0] <= g <= GROWTH[1] for g in growth)
    width = GROWTH[1] - GROWTH[0] + 1
    assert within(sum(growth) / len(growth), sum(GROWTH) / 2, math.sqrt((width ** 2 - 1) / 12 / len(growth)))


def test_what_if_sessions_make_their_calls_think_between_them_and_each_phase_starts_its_load():
    # A light load the fleet serves at once: every session makes all its calls, each `think_s` after the last
    # one ended, and each phase starts what its rate says (sessions run on past their phase's end: a few).
    phases = [{"name": "low", "duration_s": 400, "rate": 0.3}, {"name": "high", "duration_s": 400, "rate": 0.6}]
    s = scenario(phases, seed=5)
    records = what_if(s, NoAdmission("least_request"), CAPACITY).records
    assert all(r.ok for r in records)
    sessions: dict[str, list] = {}
    for r in sorted(records, key=lambda r: r.start):
        if r.session:
            sessions.setdefault(r.session, []).append(r)
    for calls in sessions.values():
        assert [r.call for r in calls] == list(range(calls[0].calls))
        for prev, nxt in zip(calls, calls[1:]):
            assert nxt.start - (prev.start + prev.latency) == pytest.approx(THINK_S, abs=1e-9)
            assert GROWTH[0] <= nxt.prompt_tokens - prev.prompt_tokens - prev.output_tokens <= GROWTH[1]
    start = 0.0
    for p, phase in zip(phases, s.phases):
        window = (start, start + p["duration_s"])
        started = window_stats(records, window, "interactive", 2.0, 60.0, False).started_per_s
        expected = s.phase_load(phase) * CAPACITY
        # Poisson arrivals (sessions: compound), plus the spill of sessions across the boundary (~a session long)
        sd = math.sqrt(expected * MEAN_CALLS / p["duration_s"])
        assert within(started, expected, sd), (p["name"], started, expected)
        start = window[1]



def test_what_if_sessions_retry_a_refused_call_with_backoff_then_end():
    # Overloaded, behind the model of Envoy's adaptive_concurrency (a 503 without Retry-After): a refused call is
    # sent again 0.5 s, then 1 s after its refusal, at most twice; a call still refused ends its session.
    from extproc.tools.demo.baselines import EnvoyAdaptive
    from extproc.tools.adaptive_concurrency import TUNED
    s = scenario([{"name": "flood", "duration_s": 60, "rate": 12.0}], seed=8)
    records = what_if(s, EnvoyAdaptive(TUNED), CAPACITY).records
    attempts: dict[tuple[str, int], list] = {}
    for r in sorted(records, key=lambda r: (r.start, r.retry)):
        if r.session:
            attempts.setdefault((r.session, r.call), []).append(r)
    retried = ended = 0
    for (session, call), tries in attempts.items():
        assert [r.retry for r in tries] == list(range(len(tries))) and len(tries) <= 3
        for prev, nxt in zip(tries, tries[1:]):
            assert prev.status == 503 and prev.retry_after is None
            assert nxt.start - (prev.start + prev.latency) == pytest.approx(0.5 * 2 ** prev.retry, abs=1e-9)
            retried += 1
        if not tries[-1].ok:  # refused three times (or timed out): no later call of the session
            assert (session, call + 1) not in attempts
            ended += 1
    assert retried > 300 and ended > 30  # the run exercised both
