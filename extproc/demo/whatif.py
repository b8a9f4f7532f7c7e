"""A policy against the scenario in simulated time only: the real admission core driving engine models, no I/O.

For tuning `policies/demo-*.yaml` in seconds instead of minutes (`extproc demo --what-if`): the same arrivals,
the same engine model as the simulator, the same AdmissionController as the ext_proc; no Envoy, no HTTP, no
client timeouts (they do not bind when admission works). Least-request balancing across the first pool.
"""

from __future__ import annotations

import heapq
import random

import yaml

from extproc.loadgen import RequestRecord, plan_request, poisson_arrivals
from extproc.policy.admission import ACCEPT, QUEUE, AdmissionController, RequestFacts
from extproc.policy.schema import load_policy
from extproc.sim.engine import Engine
from extproc.sim.profile import load_profile

from .scenario import Scenario


def _facts(kind) -> RequestFacts:
    auth = kind.headers.get("Authorization", "")
    return RequestFacts(api_key=auth.removeprefix("Bearer ").strip() or None,
                        header_class=kind.headers.get("x-priority"), model=kind.model,
                        max_tokens=kind.max_tokens, stream=kind.stream)


def what_if(scenario: Scenario, policy_path: str, capacity: float) -> list[RequestRecord]:
    """Records (simulated seconds) of the scenario's arrivals admitted by the policy into the first pool."""
    policy = load_policy(yaml.safe_load(open(policy_path, encoding="utf-8")))
    clock = [0.0]
    core = AdmissionController(policy, clock=lambda: clock[0])
    pool = scenario.pools[0]
    profile = load_profile(pool.profile)
    engines = [Engine(profile, seed=scenario.seed + i) for i in range(pool.replicas)]
    busy = [False] * len(engines)
    events: list[tuple[float, int, int]] = []  # (time, order, engine index) of iteration ends
    order = 0
    owner = {}  # (engine index, seq id) -> (record, ticket)
    records: list[RequestRecord] = []

    def kick(i: int) -> None:
        nonlocal order
        if busy[i]:
            return
        duration = engines[i].begin_iteration(clock[0])
        if duration is not None:
            busy[i] = True
            order += 1
            heapq.heappush(events, (clock[0] + duration, order, i))

    def start(record: RequestRecord, ticket, prompt: int, max_tokens: int) -> None:
        i = min(range(len(engines)), key=lambda j: len(engines[j].running) + len(engines[j].waiting))
        seq = engines[i].add_request(prompt, max_tokens, clock[0])
        owner[(i, seq.id)] = (record, ticket)
        kick(i)

    def refuse(record: RequestRecord, status: int) -> None:
        record.status, record.latency, record.error = status, clock[0] - record.start, "refused"

    rng = random.Random(scenario.seed + 1)
    plans = [plan_request(n, scenario.workload, rng, at)
             for n, at in enumerate(poisson_arrivals(scenario.schedule(capacity), scenario.seed))]
    for planned in plans + [None]:
        horizon = planned.at if planned is not None else float("inf")
        while events and events[0][0] <= horizon:
            clock[0], _, i = heapq.heappop(events)
            busy[i] = False
            for em in engines[i].end_iteration(clock[0]):
                record, ticket = owner[(i, em.seq.id)]
                if record.ttft is None:
                    record.ttft = clock[0] - record.start
                if em.finish_reason is not None:
                    del owner[(i, em.seq.id)]
                    record.status, record.latency, record.output_tokens = 200, clock[0] - record.start, \
                        em.seq.generated
                    if ticket is not None:
                        core.finish(ticket)
            core.reap()
            kick(i)
        if planned is None:
            break
        clock[0] = planned.at
        core.reap()
        kind = planned.kind
        record = RequestRecord(planned.at, kind.name, "", 0, prompt_tokens=planned.prompt_tokens)
        records.append(record)
        d = core.decide(_facts(kind))
        max_tokens = kind.max_tokens or profile.default_max_tokens
        if d.kind == ACCEPT:
            start(record, d.ticket, planned.prompt_tokens, max_tokens)
        elif d.kind == QUEUE:
            def done(final, record=record, prompt=planned.prompt_tokens, max_tokens=max_tokens):
                if final.kind == ACCEPT:
                    start(record, final.ticket, prompt, max_tokens)
                else:
                    refuse(record, final.status)
            d.waiter.on_result = done
        else:
            refuse(record, d.status)
    return records
