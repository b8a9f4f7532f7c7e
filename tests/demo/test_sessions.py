"""Agent sessions and per-phase kind weights: arrivals, call chaining, growing prompts, retries, in the real load
generator and in the what-if."""

import random
from collections import Counter

import pytest
from aiohttp import web

from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import what_if
from extproc.tools.loadgen import (CLIENT_ERROR, SESSION_HEADER, LoadClient, RequestKind, RequestRecord, Workload,
                                   plan_arrivals, plan_request, poisson_arrivals, run_open_loop)
from extproc.tools.sim.fleet import SimFleet
from extproc.tools.sim.tokens import estimate_chat_tokens

AGENT = {"name": "agent", "weight": 1.0, "endpoint": "chat", "model": "llama-70b", "prompt_tokens": 1000,
         "max_tokens": 64, "headers": {"Authorization": "Bearer sk-agent-1", "x-priority": "agent"},
         "session": {"calls": {"min": 3, "max": 5}, "think_s": 2.0, "growth_tokens": {"min": 100, "max": 200}}}


def by_session(records):
    sessions = {}
    for r in sorted(records, key=lambda r: r.start):
        if r.session:
            sessions.setdefault(r.session, []).append(r)
    return sessions


def assert_chained(calls, think_s, growth=(100, 200)):
    """One session's records, in order: one call after another, each prompt the last + its output + growth."""
    assert [r.call for r in calls] == list(range(len(calls)))
    assert len({r.calls for r in calls}) == 1 and len(calls) <= calls[0].calls
    for prev, nxt in zip(calls, calls[1:]):
        assert prev.ok
        assert nxt.start >= prev.start + prev.latency + think_s * 0.9
        assert growth[0] <= nxt.prompt_tokens - prev.prompt_tokens - prev.output_tokens <= growth[1]


def scenario(kinds, phases=None, seed=3):
    return Scenario.from_dict({
        "seed": seed, "capacity": 4.0,
        "pools": {"vllm_llama70b": {"profile": "h100-llama70b-awq", "replicas": 2, "model_names": ["llama-70b"]},
                  "vllm_llama8b": {"profile": "h100-llama8b", "replicas": 1, "model_names": ["llama-8b"]}},
        "phases": phases or [{"name": "only", "duration_s": 30, "rate": 0.5}],
        "workload": {"kinds": kinds}})


def test_session_starts_are_divided_by_mean_calls_so_the_request_rate_holds():
    plain = dict(AGENT, name="plain", session=None)
    agent = dict(AGENT, session={**AGENT["session"], "calls": 4})
    plans = plan_arrivals(Workload.from_dict({"kinds": [plain, agent]}), [(2000.0, 10.0)], seed=1)
    kinds = Counter(p.kind.name for p in plans)
    # 10 requests/s, half of them agent calls: 5/s plain arrivals, 5/4 agent sessions/s of 4 calls each
    assert kinds["plain"] == pytest.approx(10_000, rel=0.05) and kinds["agent"] == pytest.approx(2_500, rel=0.05)
    sessions = [p.session for p in plans if p.session]
    assert len({s.id for s in sessions}) == len(sessions) and {s.calls for s in sessions} == {4}
    assert all(len(s.growth) == 3 and all(100 <= g <= 200 for g in s.growth) for s in sessions)


def test_plain_workloads_draw_the_same_arrivals_as_before_sessions():
    workload = Workload([RequestKind(name="a", weight=0.7, prompt_tokens={"min": 10, "max": 900}),
                         RequestKind(name="b", weight=0.3, abort_prob=0.5)])
    schedule = [(20.0, 5.0), (20.0, 15.0)]
    rng = random.Random(5)
    before = [plan_request(i, workload, rng, at) for i, at in enumerate(poisson_arrivals(schedule, 4))]
    now = plan_arrivals(workload, schedule, 4, [{}, {}])
    assert [(p.at, p.kind.name, p.prompt_tokens, p.abort_fraction) for p in now] == \
        [(p.at, p.kind.name, p.prompt_tokens, p.abort_fraction) for p in before]


def test_phase_weights_multiply_one_kinds_rate_and_leave_the_others():
    s = scenario([dict(AGENT, name="a", weight=0.5, session=None), dict(AGENT, name="b", weight=0.5, session=None)],
                 phases=[{"name": "before", "duration_s": 500, "rate": 1.0},
                         {"name": "flood", "duration_s": 500, "rate": 1.0, "weights": {"a": 5}}])
    plans = s.arrivals(10.0)
    assert [(p.at, p.kind.name) for p in plans] == [(p.at, p.kind.name) for p in s.arrivals(10.0)]  # by seed
    count = Counter((p.kind.name, p.at >= 500) for p in plans)
    assert count[("a", False)] == pytest.approx(2500, rel=0.08) and count[("b", False)] == pytest.approx(2500, rel=0.08)
    assert count[("a", True)] == pytest.approx(12500, rel=0.05) and count[("b", True)] == pytest.approx(2500, rel=0.08)
    assert s.shortened(10).phases[1].weights == {"a": 5.0}


def test_phase_weights_must_name_a_kind():
    with pytest.raises(ValueError, match="nobody"):
        scenario([dict(AGENT, session=None)], phases=[{"name": "p", "duration_s": 10, "rate": 1, "weights":
                                                       {"nobody": 2}}])


def test_a_refused_call_is_retried_after_retry_after_then_the_session_ends():
    kind = RequestKind(**AGENT)
    plan = plan_arrivals(Workload([kind]), [(100.0, 1.0)], seed=2)[0]
    refused = RequestRecord(0.0, "agent", "", 429, latency=0.01, error="rate_limited", retry_after=3.0)
    first = plan.session.next_call(plan, refused, at=10.0)
    assert (first.call, first.retry, first.at, first.prompt_tokens) == (0, 1, 13.0, plan.prompt_tokens)
    second = plan.session.next_call(first, RequestRecord(0.0, "agent", "", 503, error="shed"), at=20.0)
    assert (second.retry, second.at) == (2, 21.0)  # no Retry-After: 0.5 s doubling, so 1 s for the second
    assert plan.session.next_call(second, refused, at=30.0) is None  # two retries, then the run fails
    timeout = RequestRecord(0.0, "agent", "", CLIENT_ERROR, error="timeout")
    assert plan.session.next_call(plan, timeout, at=10.0) is None
    ok = RequestRecord(0.0, "agent", "", 200, latency=1.0, output_tokens=40)
    nxt = plan.session.next_call(plan, ok, at=10.0)
    assert (nxt.call, nxt.retry, nxt.at) == (1, 0, 12.0)
    assert nxt.prompt_tokens == plan.prompt_tokens + 40 + plan.session.growth[0]


def test_a_sessions_context_is_trimmed_to_the_models_window():
    kind = RequestKind(**dict(AGENT, session={**AGENT["session"], "max_context_tokens": 1200}))
    assert kind.session.next_prompt(1100, 60, 150, kind.max_tokens) == 1200 - 64


def test_what_if_chains_a_sessions_calls_with_growing_prompts_and_is_deterministic():
    s = scenario([AGENT])
    s.policies = {"d": "policies/agents-full.yaml"}
    runs = [what_if(s, "policies/agents-full.yaml", s.fleet_capacity()).records for _ in range(2)]
    assert [(r.start, r.prompt_tokens, r.session, r.call) for r in runs[0]] == \
        [(r.start, r.prompt_tokens, r.session, r.call) for r in runs[1]]
    sessions = by_session(runs[0])
    assert len(sessions) >= 3 and len(runs[0]) == sum(len(c) for c in sessions.values())
    for calls in sessions.values():
        assert_chained(calls, think_s=2.0)
    done = [c for c in sessions.values() if c[-1].ok and c[-1].call + 1 == c[-1].calls]
    assert len(done) >= len(sessions) - 2  # half the fleet's capacity: the sessions that started long enough ago end


class RecordingUpstream:
    """Answers chat completions with 10 output tokens; refuses each session's second call once (429,
    Retry-After 1); keeps what it saw."""

    def __init__(self):
        self.seen: list[tuple[str | None, int]] = []  # (session header, prompt tokens)
        self.refused: set[str] = set()

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        session = request.headers.get(SESSION_HEADER)
        self.seen.append((session, estimate_chat_tokens(body["messages"])))
        if session and len([s for s, _ in self.seen if s == session]) == 2 and session not in self.refused:
            self.refused.add(session)
            return web.json_response({"error": {"type": "rate_limited"}}, status=429, headers={"Retry-After": "1"})
        return web.json_response({"choices": [{"message": {"content": "x"}}], "usage": {"completion_tokens": 10}})


async def test_the_load_generator_sends_a_sessions_calls_in_turn_with_its_header_and_retries_a_refusal():
    upstream = RecordingUpstream()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", upstream.chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    kind = dict(AGENT, session={"calls": 3, "think_s": 0.5, "growth_tokens": 100}, prompt_tokens=300)
    try:
        async with LoadClient([f"http://127.0.0.1:{port}"], time_scale=10) as client:
            # 3 requests/s of 3-call sessions over 2 s: ~2 sessions; Retry-After 1 (wall) = 10 simulated s
            await run_open_loop(client, Workload.from_dict({"kinds": [kind]}), [(2.0, 3.0)], seed=1)
    finally:
        await runner.cleanup()
    sessions = by_session(client.records)
    assert sessions and all(len(calls) == 4 for calls in sessions.values())  # 3 calls + 1 retry each
    for calls in sessions.values():
        assert [(r.call, r.retry, r.status) for r in calls] == [(0, 0, 200), (1, 0, 429), (1, 1, 200), (2, 0, 200)]
        assert calls[1].retry_after == 10.0 and calls[2].start >= calls[1].start + calls[1].latency + 9.0
        assert [r.prompt_tokens for r in calls] == [300, 410, 410, 520]
    for session, calls in sessions.items():  # what the server saw: the header on every call, the grown prompts
        assert [p for s, p in upstream.seen if s == session] == [300, 410, 410, 520]


async def test_sessions_against_the_simulator_chain_calls_with_the_real_outputs():
    kind = dict(AGENT, model=None, prompt_tokens={"min": 500, "max": 800}, stream=True)
    async with SimFleet("h100-llama8b", replicas=1, speed=20) as fleet:
        async with LoadClient(fleet.urls, time_scale=20) as client:
            await run_open_loop(client, Workload.from_dict({"kinds": [kind]}), [(20.0, 2.0)], seed=4)
    sessions = by_session(client.records)
    assert len(sessions) >= 3
    for calls in sessions.values():
        assert_chained(calls, think_s=2.0)
        assert calls[-1].call + 1 == calls[-1].calls and all(r.ok for r in calls)
