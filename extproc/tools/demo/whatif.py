"""A mode against the scenario in simulated time only: an admitter driving engine models, no I/O.

For tuning `policies/demo-*.yaml` in seconds instead of minutes (`extproc demo --what-if`): the same arrivals,
the same engine model as the simulator, and in front of it an `Admitter`: the same AdmissionController as the
ext_proc (PolicyAdmitter, modes c-e), or a model of a mode without it (extproc.tools.demo.baselines: no control,
Envoy's adaptive_concurrency). No Envoy, no HTTP. Clients give up after the scenario's `client_timeout_s`, which
aborts the sequence in its engine (or takes a queued request out of its queue), as on the real stack. Every pool
of the scenario is modelled (least-request or round robin across its replicas), so a degrade to the small model
runs on the small model's engine. The scenario's fleet events (a replica slowed down mid-run) are applied to the
engines at their time.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import orjson

from envoy.service.ext_proc.v3.external_processor_pb2 import HttpHeaders

from extproc.policy.admission import QUEUE, AdmissionController, Admit, Decision, Degrade, RequestFacts
from extproc.policy.classify import Classifier, ConflictingKeys, presented_key
from extproc.policy.decision import Canned
from extproc.policy.limits import Completion, LimitFactory, Outcome, default_limit
from extproc.policy.outcomes import LEARN, UsageSample, reads_answer
from extproc.policy.schema import ClassifySpec, Policy, SessionSpec, load_policy_file
from extproc.policy.state import reads_listings
from extproc.server.openai import min_output_of
from extproc.server.protocol import HeaderNames, read_request_headers
from extproc.server.saturation import PoolScraper, ScrapedReplica
from extproc.tools.loadgen import CLIENT_ERROR, ENDPOINTS, PlannedRequest, RequestKind, RequestRecord
from extproc.tools.sim.engine import Engine, Sequence
from extproc.tools.sim.openai_api import (clamp_max_tokens, fixed_output_tokens, ignores_eos, models_body,
                                          samples_per_prompt, sent_max_tokens)
from extproc.tools.sim.profile import load_profile

from .scenario import Scenario

# The schema's default header names (a mode without the ext_proc reads nothing by them).
DEFAULT_HEADERS = HeaderNames(ClassifySpec().header, SessionSpec().header)
DEFAULT_BODY_FIELD = ClassifySpec().body_field
TICK_S = 0.25  # simulated seconds between core.tick() calls (the ext_proc: every core.tick_s, at most 0.1 s)

# Event kinds, in the order they run when due at the same instant.
_ITERATION, _TIMEOUT, _LEFT, _TIMER, _FAULT = range(5)


def _facts(kind, prompt_tokens: int, session_id: str | None = None,
           names: HeaderNames = DEFAULT_HEADERS, body_field: str = DEFAULT_BODY_FIELD) -> RequestFacts:
    """The request as the ext_proc reads it: its headers through the server's own reader with the policy's header
    names (class, objective, fairness, deadline; both API key headers), the body fields the load generator sends,
    the class claimed in the body's `body_field` among them (server/openai.py parse_body)."""
    msg = HttpHeaders()
    for k, v in ((":method", "POST"), (":path", ENDPOINTS[kind.endpoint]), *kind.headers.items()):
        msg.headers.headers.add(key=k.lower(), raw_value=str(v).encode("latin-1"))
    head = read_request_headers(msg, names)
    try:
        api_key = presented_key(head.authorization, head.api_key)
    except ConflictingKeys:
        raise ValueError(f"request kind {kind.name!r} sends two different API keys") from None
    # A body of the prompt's size, for the core's own prompt estimate (characters / chars_per_token).
    doc = {"prompt": "x" * (4 * prompt_tokens)}
    max_tokens = sent_max_tokens(kind.endpoint, kind.body, kind.max_tokens)  # as parse_body reads it
    claim = kind.body.get(body_field)  # a kind's `body: {priority: batch}` was no claim in the what-if
    body_class = claim.strip().lower() if isinstance(claim, str) else None
    return RequestFacts(api_key=api_key, header_class=head.claim, body_class=body_class, model=kind.model,
                        max_tokens=max_tokens, stream=kind.stream, doc=doc, min_output=min_output_of(kind.body),
                        sequences=samples_per_prompt(kind.body),
                        session_id=session_id or head.session,
                        objective=head.objective, fairness_id=head.fairness_id, deadline_ms=head.deadline_ms)


def check_routes(scenario: Scenario, policy: Policy, source: str) -> None:
    """Every cluster the policy sends the workload's requests to (their model's, and their class's degrade
    model's) is a pool of the scenario: a route to a cluster the fleet lacks crashed the what-if mid-run with a
    KeyError, where Envoy refuses such a config. Only the models the workload asks for count: the shipped mode
    policies name models many scenarios never request."""
    fleet = [p.name for p in scenario.pools]
    names = {alias: name for name, m in policy.models.items() for alias in (name, *m.aliases)}
    classes = kind_classes(scenario, policy)
    for kind in scenario.workload.kinds:
        model = names.get(kind.model) if kind.model is not None else None
        if model is None:  # the policy answers 404 (or learns it from the replicas): no route
            continue
        cls = classes[kind.name]
        fb = policy.classes[cls].fallback
        routes = [(f"model {kind.model!r}", policy.models[model].cluster)]
        if fb.action == "degrade" and fb.model:
            routes.append((f"class {cls}'s degrade model {fb.model!r}", policy.models[fb.model].cluster))
        for what, cluster in routes:
            if cluster not in fleet:
                raise ValueError(f"scenario {scenario.name}: policy {source} sends workload kind {kind.name!r} "
                                 f"({what}) to cluster {cluster!r}, which is no pool of the scenario (pools: "
                                 f"{', '.join(fleet)}); Envoy would refuse a route to a cluster it lacks")


def kind_classes(scenario: Scenario, policy: Policy) -> dict[str, str]:
    """Each workload kind's class, as the policy's classifier reads the kind's headers and body."""
    classifier = Classifier(policy)
    out = {}
    for kind in scenario.workload.kinds:
        facts = _facts(kind, 0, names=HeaderNames.of(policy), body_field=policy.classify.body_field)
        out[kind.name] = classifier.classify(facts.api_key, facts.header_class, facts.body_class, facts.objective,
                                             facts.fairness_id).cls
    return out


def unserved_kinds(scenario: Scenario, policy: Policy) -> list[str]:
    """The workload's kinds whose model the policy does not name (a key or an alias): each of their requests gets the
    ext_proc's 404 `unknown_model`. A mode the scenario does not give a policy runs the demo's, written for its
    `llama-70b` fleet: on a fleet of one's own every request of such a mode failed, and the tables said only
    "error 100%". A policy that learns names from its replicas (`names_from_replicas`) may serve any: none listed."""
    if any(m.names_from_replicas for m in policy.models.values()):
        return []
    names = {alias for name, m in policy.models.items() for alias in (name, *m.aliases)}
    return [kind.name for kind in scenario.workload.kinds if kind.model is not None and kind.model not in names]


def _replica_indexes(named: str) -> list[int]:
    """The replica indexes of an override-host list naming the what-if's scraped replicas ("<pool>/<index>")."""
    return [int(name.rpartition("/")[2]) for name in named.split(",")]


@dataclass(frozen=True)
class _Ask:
    """What a request's body asks of the engine (extproc.tools.loadgen.LoadClient.body)."""

    prompt_tokens: int
    max_tokens: int | None  # None: the replica's default
    ignore_eos: bool  # the kind's `body: {ignore_eos: true}`: every answer runs to max_tokens
    sequences: int = 1  # the kind's `body: {n: N}`: N samples of the prompt (Engine.add_samples)

    @classmethod
    def of(cls, kind: RequestKind, prompt_tokens: int) -> _Ask:
        return cls(prompt_tokens, sent_max_tokens(kind.endpoint, kind.body, kind.max_tokens), ignores_eos(kind.body),
                   samples_per_prompt(kind.body))

    def degraded(self, ceiling: int | None) -> _Ask:
        """As the ext_proc's degrade_body rewrites it: the fallback's max_tokens when the body asks for more, or
        for none. ignore_eos stays in the body, so a degraded answer runs to the lower ceiling."""
        if ceiling is None or (self.max_tokens is not None and self.max_tokens <= ceiling):
            return self
        return replace(self, max_tokens=ceiling)

    def add_to(self, engine: Engine, now: float, priority: int, lora: int = 0) -> list[Sequence]:
        """Queue it as the simulator's server does (sim/replica.py), or the what-if's lengths would not be the
        real run's: one sequence per sample (`n`), each with max_tokens (unset: the profile's default) clamped to
        the context left, and under ignore_eos the answer's length is that, not the profile's draw. `lora`: the
        adapter's lora id when the request names one of the replica's LoRA adapters (0: the base model)."""
        p = engine.profile
        max_tokens = clamp_max_tokens(self.max_tokens, self.prompt_tokens, p.max_model_len, p.default_max_tokens)
        return engine.add_samples(self.prompt_tokens, max_tokens, now, self.sequences,
                                  natural_tokens=fixed_output_tokens(max_tokens, self.ignore_eos), priority=priority,
                                  lora=lora)


@dataclass(eq=False)
class _InFlight:
    """An admitted request in its replica: its sequences (several for `n` > 1), the ones not finished yet and the
    output they generated, summed as the replica's usage sums them."""

    record: RequestRecord
    ticket: Any
    seqs: list[Sequence]
    left: int
    generated: int = 0


@dataclass
class WhatIfResult:
    records: list[RequestRecord]
    served_elsewhere: int  # requests finished by the pools after the first (degraded)
    limits: list[tuple[float, dict[str, int]]]  # (time, class -> cap) whenever a cap moved
    preemptions: dict[str, int] = field(default_factory=dict)  # pool -> its engines' preemptions over the run
    # id(record) -> the engine time that was its own (Sequence.work_s; the sum of its attempts'): what it really
    # cost the replicas, to check the ext_proc's GPU-second estimates against
    engine_work: dict[int, float] = field(default_factory=dict)


class _Pool:
    def __init__(self, name: str, profile_name: str, replicas: int, seed: int, scheduling_policy: str | None = None,
                 model_names: list[str] | tuple[str, ...] = (), lora_modules: list[str] | tuple[str, ...] = (),
                 max_loras: int = 1):
        self.name = name
        self.profile = load_profile(profile_name)
        if model_names:  # as `extproc sim --model-name` serves them (SimFleet): what /v1/models lists
            self.profile = self.profile.with_model_names(model_names)
        if scheduling_policy:
            self.profile = self.profile.with_scheduling_policy(scheduling_policy)
        # LoRA adapters as `extproc sim --lora-modules` serves them (vLLM's --enable-lora): ids from 1 in their
        # order, at most max_loras of them in a batch (Engine); LoRA off without adapters.
        self.lora_ids = {adapter: i for i, adapter in enumerate(lora_modules, 1)}
        self.lora_names = {i: adapter for adapter, i in self.lora_ids.items()}
        self.max_loras = max_loras
        self.engines = [Engine(self.profile, seed=seed + i, max_loras=max_loras if lora_modules else None)
                        for i in range(replicas)]
        self.busy = [False] * replicas
        self.finished = 0
        self.draining: set[int] = set()  # replicas the load balancer no longer sends new requests to
        self.hung: set[int] = set()  # replicas whose engine does not step (fault `hang`)


class Admitter(Protocol):
    """What stands between the clients and the pools in one mode: the ext_proc's core (PolicyAdmitter), or a model
    of a mode without it (extproc.tools.demo.baselines). Decisions are the core's types (Admit, Degrade, Queued,
    Refusal, Canned); a ticket is whatever the admitter wants back when the request ends."""

    lb_policy: str  # how a pool picks a replica: "least_request" or "round_robin"
    limits: list[tuple[float, dict[str, int]]]  # (time, name -> limit) whenever a limit moved

    def start(self, clock: Callable[[], float], pools: dict[str, _Pool]) -> list[tuple[float, Callable[[], None]]]:
        """Called once before the first arrival; returns periodic timers (interval s, callback), first due at 0."""

    def decide(self, facts: RequestFacts) -> Decision: ...

    def engine_priority(self, d: Admit | Degrade) -> int:
        """The body's `priority` an admitted request reaches vLLM with (0: vLLM's default)."""

    def replicas_for(self, pool: str, cls: str, model: str | None = None) -> str | None:
        """The override-host list a request of class `cls` for `model` to `pool` is sent with (x-extproc-replica),
        None: the LB picks."""

    def abandon(self, waiter: Any) -> None:
        """A queued request's client gave up (its timeout) while it waited: it leaves the queue, as the ext_proc
        takes it out when Envoy closes its stream (server/final_admission.py). Only an admitter that queues."""

    def ended(self, ticket: Any, record: RequestRecord) -> None:
        """An admitted request ended: completed (record.ok), answered with an error by its replica (a 404 for a
        model the pool does not serve) or given up by its client (record.error, status CLIENT_ERROR)."""

    def reap(self) -> None: ...


class PolicyAdmitter:
    """The ext_proc's own admission core (modes c, d, e) with a simulated clock. Adaptive caps move as in the
    ext_proc: `core.tick()` every TICK_S, and for each pool in the policy's `pools`, the engines' own state is
    "scraped" every `scrape_interval_ms` and aggregated by the ext_proc's PoolScraper.aggregate."""

    lb_policy = "least_request"  # envoy/envoy.yaml: least request over every replica (FULL_SCAN)

    def __init__(self, policy_path: str, limit_factory: LimitFactory = default_limit):
        self.source = policy_path
        self.policy = load_policy_file(policy_path)  # as `extproc check` and `serve` read it
        self.header_names = HeaderNames.of(self.policy)
        self.body_field = self.policy.classify.body_field
        self.limit_factory = limit_factory
        self.limits: list[tuple[float, dict[str, int]]] = []
        self.core: AdmissionController | None = None
        self.usage_sample = UsageSample()  # the responses whose usage the ext_proc would read

    def start(self, clock: Callable[[], float], pools: dict[str, _Pool]) -> list[tuple[float, Callable[[], None]]]:
        core = self.core = AdmissionController(self.policy, clock=clock, limit_factory=self.limit_factory)
        timers = []
        for name, spec in self.policy.pools.items():
            if name not in pools:
                continue
            s = PoolScraper(core, name, spec, session=None, clock=clock)
            s.replicas = {f"{name}/{i}": ScrapedReplica(f"{name}/{i}") for i in range(len(pools[name].engines))}

            def scrape(s=s, pool=pools[name], name=name) -> None:
                for i, eng in enumerate(pool.engines):  # what the replica's /metrics would say, taken like a scrape
                    s.record(s.replicas[f"{name}/{i}"], {"running": float(len(eng.running)),
                                                        "waiting": float(len(eng.waiting)), "kv": eng.kv_usage,
                                                        # num_requests_waiting_by_reason{reason="deferred"}
                                                        "deferred": float(eng.deferred),
                                                        "preemptions": float(eng.stats.preemptions),
                                                        "tokens": float(eng.stats.prompt_tokens
                                                                        + eng.stats.generation_tokens),
                                                        "itl_sum": eng.stats.inter_token_s,
                                                        "itl_count": float(eng.stats.inter_tokens),
                                                        "finished": float(sum(eng.stats.finished.values())),
                                                        "steps": float(eng.stats.iterations)},
                             # vllm:lora_requests_info: the adapters of the requests it runs (as `extproc sim`)
                             (pool.max_loras, frozenset(pool.lora_names[q.lora] for q in eng.running if q.lora))
                             if pool.lora_ids else None)
                core.set_saturation(name, s.aggregate(clock()))
            timers.append((spec.scrape_interval_ms / 1000.0, scrape))
            # Every pool the policy names is scraped here, as the demo's rendered policy has it (its replicas filled in).
            if reads_listings(self.policy, name):
                # The replicas' /v1/models, as the scraper's first round reads them (names, context lengths): under
                # the served names `extproc sim --model-name` gives them (the scenario's), and also for a pool that
                # names no replicas, which the demo fills in with its own (render_policy), so the real stack reads
                # them.
                p = pools[name]
                cards = [(adapter, f"/adapters/{adapter}", p.profile.model_names[0]) for adapter in p.lora_ids]
                listing = orjson.loads(models_body(p.profile.model_names, p.profile.max_model_len,
                                                   adapters=cards))["data"]
                core.set_listings(name, [listing] * len(pools[name].engines))
        if core.gates or any(lim.spec.adaptive.enabled for lim in core.limiters.values()):
            def limits() -> dict[str, int]:
                # Each class's cap, and each pool-wide limit (in its unit) as "pool:<name>".
                out = {n: lim.limit for n, lim in core.limiters.items()}
                out.update((f"pool:{n}", round(g.limit)) for n, g in core.gates.items())
                return out

            def tick() -> None:
                before = limits()
                core.tick()
                after = limits()
                if after != before or not self.limits:
                    self.limits.append((clock(), after))
            timers.append((TICK_S, tick))
        return timers

    def decide(self, facts: RequestFacts) -> Decision:
        refused = self.core.authenticate(facts)  # `anonymous.allow: false` refuses requests without a known key
        if refused is not None:
            return refused  # the ext_proc refuses it before its usage reader picks: it takes no turn of the sample
        # As the ext_proc picks them, before the decision.
        which = self.usage_sample.pick(self.core, facts.api_key)
        facts.reads_usage = which is not None and reads_answer(which == LEARN, facts.stream)
        return self.core.decide(facts)

    def replicas_for(self, pool: str, cls: str, model: str | None = None) -> str | None:
        return self.core.replicas_for(pool, cls, model)

    def engine_priority(self, d: Admit | Degrade) -> int:
        # As the ext_proc writes it into the body (server/stream.py): the class's `vllm_priority`, else none.
        spec = self.policy.classes.get(d.cls)
        return spec.vllm_priority if spec is not None and spec.vllm_priority is not None else 0

    def abandon(self, waiter) -> None:
        self.core.abandon(waiter, timed_out=False)

    def ended(self, ticket, record: RequestRecord) -> None:
        # Completions are reported at once (as Envoy's access log does within a few milliseconds).
        if ticket is None:
            return
        # An HTTP answer ended it (a 404 too: Envoy's access log says OK below 500); no status: its client left.
        outcome = Outcome.OK if record.status != CLIENT_ERROR else Outcome.CLIENT_ABORT
        if record.ok and ticket.charge is not None and ticket.charge.reads_usage:
            self.core.usage(ticket, record.prompt_tokens, record.output_tokens)  # read as the answer ends
        self.core.finish(ticket, outcome)
        self.core.report(ticket.id, Completion(outcome, record.status, record.ttft, record.latency))

    def reap(self) -> None:
        self.core.reap()


class InstancesAdmitter:
    """The policy run by several ext_proc instances (or `serve --workers`) behind one Envoy: each its own core,
    scraping the pools itself, with the requests spread round robin (the `extproc` cluster's policy) and each
    completion reported to the instance that admitted it (the access-log relay). The shared caps of a Redis or
    host store are not modelled: what it shows is what stays per instance (the pool-wide limit, the queues)."""

    lb_policy = "least_request"

    def __init__(self, policy_path: str, instances: int, limit_factory: LimitFactory = default_limit):
        self.parts = [PolicyAdmitter(policy_path, limit_factory) for _ in range(instances)]
        self.policy, self.source = self.parts[0].policy, policy_path
        self.header_names, self.body_field = self.parts[0].header_names, self.parts[0].body_field
        self.limits: list[tuple[float, dict[str, int]]] = []
        self._next = itertools.cycle(self.parts)

    def start(self, clock: Callable[[], float], pools: dict[str, _Pool]) -> list[tuple[float, Callable[[], None]]]:
        return [timer for part in self.parts for timer in part.start(clock, pools)]

    def decide(self, facts: RequestFacts) -> Decision:
        return next(self._next).decide(facts)

    def replicas_for(self, pool: str, cls: str, model: str | None = None) -> str | None:
        return self.parts[0].replicas_for(pool, cls, model)

    def engine_priority(self, d: Admit | Degrade) -> int:
        return self.parts[0].engine_priority(d)

    def abandon(self, waiter) -> None:
        for part in self.parts:
            if part.core.state.current(waiter.limiter):
                part.abandon(waiter)
                return

    def ended(self, ticket, record: RequestRecord) -> None:
        if ticket is None:
            return
        for part in self.parts:
            if part.core.tickets.get(ticket.id) is ticket:
                part.ended(ticket, record)
                return

    def reap(self) -> None:
        for part in self.parts:
            part.reap()


def what_if(scenario: Scenario, admitter: Admitter | str, capacity: float,
            limit_factory: LimitFactory = default_limit) -> WhatIfResult:
    """Records (simulated seconds) of the scenario's arrivals admitted by `admitter` (or the policy at that path)
    into the scenario's pools; `limit_factory` swaps a policy's classes' limit algorithm
    (extproc.policy.limits.Limit)."""
    if isinstance(admitter, str):
        admitter = PolicyAdmitter(admitter, limit_factory)
    if getattr(admitter, "policy", None) is not None:  # before the run, not a KeyError in it
        check_routes(scenario, admitter.policy, admitter.source)
    clock = [0.0]
    pools = {p.name: _Pool(p.name, p.profile, p.replicas, scenario.seed + 100 * i, p.scheduling_policy,
                           p.model_names, p.lora_modules, p.max_loras) for i, p in enumerate(scenario.pools)}
    first = scenario.pools[0].name
    # none named: the replicas answer any model
    serves = {p.name: set(p.served) if p.model_names else set() for p in scenario.pools}
    events: list[tuple[float, int, int, object]] = []  # (time, kind, order, payload)
    order = 0
    owner: dict[tuple[str, int, int], _InFlight] = {}  # (pool, engine index, seq id) -> the request it serves
    ran: list[_InFlight] = []  # every request started on a replica, for engine_work
    records: list[RequestRecord] = []
    next_replica = {name: 0 for name in pools}  # round robin

    def push(at: float, kind: int, payload: object) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (at, kind, order, payload))

    def kick(pool: _Pool, i: int) -> None:
        if pool.busy[i] or i in pool.hung:
            return
        duration = pool.engines[i].begin_iteration(clock[0])
        if duration is not None:
            pool.busy[i] = True
            push(clock[0] + duration, _ITERATION, (pool, i))

    def start(record: RequestRecord, ticket, pool_name: str, ask: _Ask, priority: int, cls: str) -> None:
        pool = pools[pool_name]
        engines = pool.engines
        # The replicas still in the load balancer (all of them if every one is draining): least request, or
        # round robin (Envoy's ROUND_ROBIN, mode a).
        live = [j for j in range(len(engines)) if j not in pool.draining] or list(range(len(engines)))
        # Envoy's override_host takes the first named replica it has; the ext_proc names none its health check
        # fails (here: draining), so skipping those is the same.
        named = admitter.replicas_for(pool_name, cls, record.model)
        chosen = next((j for j in _replica_indexes(named) if j in live), None) if named else None
        if chosen is not None:
            i = chosen
        elif admitter.lb_policy == "round_robin":
            i = live[next_replica[pool_name] % len(live)]
            next_replica[pool_name] += 1
        else:
            i = min(live, key=lambda j: len(engines[j].running) + len(engines[j].waiting))
        seqs = ask.add_to(engines[i], clock[0], priority, pool.lora_ids.get(record.model, 0))
        flight = _InFlight(record, ticket, seqs, len(seqs))
        for seq in seqs:
            owner[(pool.name, i, seq.id)] = flight
        ran.append(flight)
        push(record.start + scenario.client_timeout_s, _TIMEOUT, (pool, i, flight))
        kick(pool, i)

    def refuse(record: RequestRecord, status: int, reason: str, retry_after: float | None = None) -> None:
        record.status, record.latency, record.error = status, clock[0] - record.start, f"refused: {reason}"
        record.retry_after = retry_after
        ended(record)

    def not_served(record: RequestRecord, ticket, pool_name: str) -> bool:
        """The replica's 404 for a model it does not serve (sim/openai_api.py, vLLM), at once: without the ext_proc
        Envoy sends every model to the first pool (envoyconf.render)."""
        names = serves[pool_name]
        if not names or record.model is None or record.model in names:
            return False
        record.status, record.latency, record.error, record.model = 404, clock[0] - record.start, "NotFoundError", None
        admitter.ended(ticket, record)
        ended(record)
        return True

    def admitted(record: RequestRecord, d, ask: _Ask) -> None:
        if isinstance(d, Degrade):
            fb = d.fallback
            record.model = fb.model or record.asked_model
            record.degraded_by_policy = True
            if fb.stream is False:  # one answer, sent to a streaming client as one chunk once complete
                unstreamed.add(id(record))  # (server/stream.py): its first byte is its whole answer
            pool = d.cluster if d.cluster in pools else first
            if not not_served(record, d.ticket, pool):
                start(record, d.ticket, pool, ask.degraded(fb.max_tokens), admitter.engine_priority(d), d.cls)
        elif isinstance(d, Admit):
            record.model = record.asked_model
            if not not_served(record, d.ticket, d.cluster or first):
                start(record, d.ticket, d.cluster or first, ask, admitter.engine_priority(d), d.cls)
        elif isinstance(d, Canned) and d.status < 300:
            # The ext_proc's own answer at once, sent with `x-extproc-decision: degrade`: the load generator
            # records an answer (the asked model's name, no usage) degraded by the policy, not an error.
            record.status, record.latency, record.model = d.status, clock[0] - record.start, record.asked_model
            record.ttft, record.degraded_by_policy = record.latency, True
            ended(record)
        else:  # a refusal, or a canned error status (no engine time): its status as the reason table gives it
            refuse(record, d.status, d.reason, d.retry_after or None)

    for interval, callback in admitter.start(lambda: clock[0], pools):
        push(0.0, _TIMER, (interval, callback))
    for e in scenario.events:
        push(e.at_s, _FAULT, e)

    def handle(kind: int, payload) -> None:
        if kind == _ITERATION:
            pool, i = payload
            pool.busy[i] = False
            for em in pool.engines[i].end_iteration(clock[0]):
                flight = owner[(pool.name, i, em.seq.id)]
                record = flight.record
                if record.ttft is None and id(record) not in unstreamed:  # a stream's first token
                    record.ttft = clock[0] - record.start
                if em.finish_reason is None:
                    continue
                del owner[(pool.name, i, em.seq.id)]
                flight.left -= 1
                flight.generated += em.seq.generated
                if flight.left:  # the answer is complete when its last sample is
                    continue
                record.status, record.latency, record.output_tokens = 200, clock[0] - record.start, flight.generated
                if record.ttft is None:  # not streamed: the load generator's first byte is the whole answer
                    record.ttft = record.latency
                if pool.name != first:
                    pool.finished += 1
                admitter.ended(flight.ticket, record)
                ended(record)
            admitter.reap()
            kick(pool, i)
        elif kind == _TIMEOUT:  # the client gives up and closes its connection: the replica aborts the sequence
            pool, i, flight = payload
            running = [seq for seq in flight.seqs if owner.pop((pool.name, i, seq.id), None) is not None]
            if running:  # a closed connection aborts every sample still running
                for seq in running:
                    pool.engines[i].abort(seq, clock[0])
                record = flight.record
                record.status, record.latency, record.error = CLIENT_ERROR, scenario.client_timeout_s, "timeout"
                admitter.ended(flight.ticket, record)
                ended(record)
                kick(pool, i)
        elif kind == _LEFT:  # a queued request's client gives up: it leaves the queue (admitter.abandon)
            waiter, record = payload
            if waiter.pending:
                record.status, record.latency, record.error = CLIENT_ERROR, scenario.client_timeout_s, "timeout"
                admitter.abandon(waiter)
                ended(record)
        elif kind == _TIMER:
            interval, callback = payload
            callback()
            push(clock[0] + interval, _TIMER, payload)
        elif kind == _FAULT:
            pool = pools[payload.pool]
            if "slowdown" in payload.fault:
                pool.engines[payload.replica].slowdown = payload.fault["slowdown"]
            if "draining" in payload.fault:  # out of the load balancer at once (Envoy: after its health checks)
                if payload.fault["draining"]:
                    pool.draining.add(payload.replica)
                else:  # back in (a replica an autoscaler adds: its /health answers 200 once it is ready)
                    pool.draining.discard(payload.replica)
            if "hang" in payload.fault:  # the engine stops stepping; Envoy still routes to it (its /health answers)
                if payload.fault["hang"]:
                    pool.hung.add(payload.replica)
                else:
                    pool.hung.discard(payload.replica)
                    kick(pool, payload.replica)

    # Arrivals, earliest first: the scenario's, then each session's next call (or retry) once its previous one
    # ended (`ended`), `think_s` (or Retry-After) later.
    arrivals = [(p.at, n, p) for n, p in enumerate(scenario.arrivals(capacity))]
    sessions: dict[int, PlannedRequest] = {}  # id(record) -> its plan, for session calls
    waiting: set[int] = set()  # id(record) of the requests in a queue: the run is not over while any waits
    unstreamed: set[int] = set()  # id(record) of the requests not streamed (their TTFT is their answer's)
    arrival_order = itertools.count(len(arrivals))

    def ended(record: RequestRecord) -> None:
        planned = sessions.pop(id(record), None)
        following = planned and planned.session.next_call(planned, record, clock[0])
        if following is not None:
            heapq.heappush(arrivals, (following.at, next(arrival_order), following))

    while True:
        while events and events[0][0] <= (arrivals[0][0] if arrivals else float("inf")):
            if not arrivals and not owner and not waiting and events[0][1] not in (_ITERATION, _TIMEOUT, _LEFT):
                break  # only timers left: done
            clock[0], kind, _, payload = heapq.heappop(events)
            handle(kind, payload)
        if not arrivals:
            break
        _, _, planned = heapq.heappop(arrivals)
        clock[0] = planned.at
        admitter.reap()
        kind = planned.kind
        record = RequestRecord(planned.at, kind.name, "", 0, prompt_tokens=planned.prompt_tokens,
                               asked_model=kind.model)
        records.append(record)
        if not kind.stream:
            unstreamed.add(id(record))
        if planned.session is not None:
            record.session, record.call, record.calls = planned.session.id, planned.call, planned.session.calls
            record.retry = planned.retry
            sessions[id(record)] = planned
        d = admitter.decide(_facts(kind, planned.prompt_tokens, planned.session.id if planned.session else None,
                                   getattr(admitter, "header_names", DEFAULT_HEADERS),
                                   getattr(admitter, "body_field", DEFAULT_BODY_FIELD)))
        ask = _Ask.of(kind, planned.prompt_tokens)
        if d.kind == QUEUE:
            record.queued = True
            waiting.add(id(record))

            def done(final, record=record, ask=ask):
                waiting.discard(id(record))
                record.queue_wait = clock[0] - record.start
                if record.error != "timeout":  # not the verdict of a client that left (_LEFT)
                    admitted(record, final, ask)
            d.waiter.notify(done)
            if d.waiter.pending:  # its client gives up at its timeout, queued or not
                push(planned.at + scenario.client_timeout_s, _LEFT, (d.waiter, record))
        else:
            admitted(record, d, ask)
    served_elsewhere = sum(p.finished for name, p in pools.items() if name != first)
    preemptions = {name: sum(e.stats.preemptions for e in p.engines) for name, p in pools.items()}
    work: dict[int, float] = {}
    for flight in ran:
        key = id(flight.record)
        work[key] = work.get(key, 0.0) + sum(seq.work_s for seq in flight.seqs)
    return WhatIfResult(records, served_elsewhere, admitter.limits, preemptions, work)
