"""The admission decision (accept / queue / reject / shed / degrade) and the ticket closed exactly once."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import math

from .adaptive import AdaptiveLimit, PoolSaturation
from .breakers import Breaker, ErrorBreaker, LatencyBreaker
from .classify import ANONYMOUS, Classification, Classifier
from .cost import CostEstimate, CostModel
from .limits import ClassLimiter, Completion, Outcome, Ticket, Waiter
from .ratelimit import Session, SessionBudgets, TenantLimits
from .reasons import REASONS
from .reasons import (R_CLASS_FULL, R_CLASS_REMOVED, R_CLIENT_GONE, R_DEADLINE, R_DEGRADED_FULL,  # noqa: F401 (re-exported)
                      R_DEQUEUED, R_ENDED_WHILE_QUEUED, R_ERROR_BREAKER, R_HIGHER_SATURATED, R_INVALID_KEY,
                      R_LATENCY_BREAKER, R_MAX_TOKENS, R_MISSING_KEY, R_QUEUE_FULL, R_QUEUE_TIMEOUT, R_SESSION_INFLIGHT,
                      R_SESSION_RATE, R_SHADOW, R_SLOT_FREE, R_TENANT_REQUESTS, R_TENANT_TOKENS, R_TOO_LARGE,
                      R_UNKNOWN_MODEL, say)
from .schema import ClassSpec, FallbackSpec, Policy

# Decision kinds
ACCEPT, QUEUE, REJECT, SHED, DEGRADE, INVALID = "accept", "queue", "reject", "shed", "degrade", "invalid"

# How long a released ticket waits for the data plane's completion report before it is accounted without one.
REPORT_WAIT_S = 5.0


@dataclass(slots=True)
class RequestFacts:
    """What the adapter read off the request; no policy in here."""

    api_key: str | None = None
    header_class: str | None = None
    body_class: str | None = None
    model: str | None = None
    max_tokens: int | None = None
    stream: bool = False
    request_id: str = ""
    session_id: str | None = None
    doc: dict | None = None      # the parsed JSON body, for the prompt-size estimate
    sequences: int = 1           # outputs generated (n, best_of)
    generates: bool = True       # False: a prefill-only endpoint (embeddings, score, ...): no output tokens
    degradable: bool = True      # a `degrade` fallback can serve it (another model, fewer tokens, no stream)
    cannable: bool = True        # a `canned` fallback can answer it (chat and completions shapes)
    reads_usage: bool = False    # its real usage will be read from the response (then refunded exactly)


class Charge:
    """What one request is estimated to cost, and whom it is charged to; settled once when it ends."""

    __slots__ = ("model", "estimate", "tenant", "session", "request_id", "tokens", "fallbacks")

    def __init__(self, model: str, estimate: CostEstimate, tenant: TenantLimits | None, session: Session | None,
                 request_id: str = "", reads_usage: bool = True):
        self.model = model
        self.request_id = request_id
        self.estimate = estimate
        self.tenant = tenant
        self.session = session
        # Tokens a tokens-per-minute limit charges up front: the worst case when real usage will be read and
        # refunded, else the expected output (a request whose usage is never read is never corrected).
        self.tokens = estimate.tokens if reads_usage else \
            estimate.prompt_tokens + math.ceil(estimate.expected_output)
        self.fallbacks = ("reject", "degrade", "canned")  # the fallback actions this request's endpoint allows


class Decision:
    """The core's answer for one request. Terminal unless kind is QUEUE (then `waiter` gets the final one)."""

    __slots__ = ("kind", "reason", "cls", "tenant", "status", "retry_after", "message", "ticket", "waiter",
                 "cluster", "classification", "waited_s", "fallback", "shadow_would", "headers", "charge")

    def __init__(self, kind: str, reason: str, cls: str, tenant: str, *, status: int = 200, retry_after: int = 0,
                 message: str = "", ticket: Ticket | None = None, waiter: Waiter | None = None,
                 cluster: str | None = None, classification: Classification | None = None,
                 waited_s: float = 0.0, fallback: FallbackSpec | None = None):
        self.kind = kind
        self.reason = reason
        self.cls = cls
        self.tenant = tenant
        self.status = status
        self.retry_after = retry_after
        self.message = message
        self.ticket = ticket
        self.waiter = waiter
        self.cluster = cluster
        self.classification = classification
        self.waited_s = waited_s
        self.fallback = fallback          # DEGRADE: what to change (model, max_tokens, stream) or the canned reply
        self.shadow_would: Decision | None = None  # shadow mode: the decision enforce mode would have made
        self.headers: list[tuple[str, str]] = []  # extra response headers (x-ratelimit-*)
        self.charge: Charge | None = None  # what the request was estimated to cost (for logs)

    def __repr__(self) -> str:
        return f"Decision({self.kind}, {self.reason}, cls={self.cls}, status={self.status})"


class AdmissionEvents(Protocol):
    """What the core tells the outside world (metrics, logs). Implementations must be cheap and never raise."""

    def decided(self, decision: Decision) -> None: ...
    def queued(self, waiter: Waiter) -> None: ...
    def finished(self, ticket: Ticket, outcome: Outcome, duration_s: float) -> None: ...
    def shadow(self, cls: str, would: str, reason: str) -> None: ...
    def breaker_changed(self, cls: str, pool: str, breaker: Breaker, state: str) -> None: ...
    def cost_observed(self, ticket: Ticket, estimated_s: float, actual_s: float) -> None: ...
    def first_token(self, ticket: Ticket, seconds: float) -> None: ...
    # A tenant rate-limit check: `exceeded` is the limit it is over ("requests" or "tokens"), None if it fits.
    def rate_limit_checked(self, tenant: str, exceeded: str | None) -> None: ...
    def session_refused(self, tenant: str, reason: str) -> None: ...


class NoEvents:
    def decided(self, decision: Decision) -> None:
        pass

    def queued(self, waiter: Waiter) -> None:
        pass

    def finished(self, ticket: Ticket, outcome: Outcome, duration_s: float) -> None:
        pass

    def shadow(self, cls: str, would: str, reason: str) -> None:
        pass

    def breaker_changed(self, cls: str, pool: str, breaker: Breaker, state: str) -> None:
        pass

    def cost_observed(self, ticket: Ticket, estimated_s: float, actual_s: float) -> None:
        pass

    def first_token(self, ticket: Ticket, seconds: float) -> None:
        pass

    def rate_limit_checked(self, tenant: str, exceeded: str | None) -> None:
        pass

    def session_refused(self, tenant: str, reason: str) -> None:
        pass


class AdmissionController:
    """Sans-IO admission: decide() per request, finish() once per ticket, report() with how it ended."""

    def __init__(self, policy: Policy, clock: Callable[[], float] = time.monotonic,
                 events: AdmissionEvents | None = None):
        self.clock = clock
        self.events: AdmissionEvents = events or NoEvents()
        self.limiters: dict[str, ClassLimiter] = {}
        self.degraded: dict[str, ClassLimiter] = {}   # per class: slots for requests served by its fallback
        self.breakers: dict[tuple[str, str], list[Breaker]] = {}  # (class, pool) -> its breakers
        self.tickets: dict[int, Ticket] = {}   # open tickets, for the lease safety net
        self.saturation: dict[str, PoolSaturation] = {}  # pool -> the replicas' own load (set by a scraper)
        self._unreported: OrderedDict[int, Ticket] = OrderedDict()  # released, completion report pending
        self._retired: list[ClassLimiter] = []
        # Set by an adapter whose shared store must confirm each admission (see gated()): such admissions are
        # counted once, by confirm() or revoke(), instead of when decided.
        self.shared_slots = False
        self.apply(policy)

    # --- configuration ---

    def apply(self, policy: Policy) -> None:
        """Install a (validated) policy. Held slots stay with the limiter they were taken from."""
        old = self.limiters
        limiters: dict[str, ClassLimiter] = {}
        for name, spec in policy.classes.items():
            lim = old.get(name)
            if lim is None:
                lim = ClassLimiter(name, spec)
            else:
                lim.reconfigure(spec)
            limiters[name] = lim
            if spec.adaptive.enabled and lim.adaptive is None:
                lim.adaptive = AdaptiveLimit(spec.adaptive, spec.slo_p95_ms / 1000.0, spec.max_concurrency)
                lim.limit = int(lim.adaptive.limit)
            deg_spec = ClassSpec(max_concurrency=spec.fallback.max_concurrency or spec.max_concurrency,
                                 max_queue=0, max_wait_ms=0)
            if name in self.degraded:
                self.degraded[name].reconfigure(deg_spec)
            else:
                self.degraded[name] = ClassLimiter(name, deg_spec)
        self.policy = policy
        self.classifier = Classifier(policy)
        self.limiters = limiters
        self._shadow_all = policy.mode == "shadow"
        self._lease_s = policy.lease_ms / 1000.0
        self._retry_ceiling = policy.retry_after_max_s
        self._clusters = {name: m.cluster for name, m in policy.models.items()}
        old_models = getattr(self, "cost_models", {})
        # Learned coefficients survive a reload unless the model's cost profile changed.
        self.cost_models = {name: old_models[name] if name in old_models and old_models[name].spec == m.cost
                            else CostModel(m.cost) for name, m in policy.models.items()}
        old_tenants = getattr(self, "tenant_limits", {})
        self.tenant_limits = {t.name: old_tenants[t.name] if t.name in old_tenants and old_tenants[t.name].spec == t
                              else TenantLimits(t, self.clock())
                              for t in [*policy.tenants, policy.anonymous.as_tenant()]
                              if t.requests_per_minute or t.tokens_per_minute}
        old_sessions = getattr(self, "sessions", None)
        self.sessions = old_sessions if old_sessions and old_sessions.spec == policy.sessions \
            else SessionBudgets(policy.sessions)
        # Breakers whose class spec changed start afresh; the others keep their state across the reload.
        self.breakers = {key: bs for key, bs in self.breakers.items()
                         if key[0] in policy.classes and self._breaker_specs(key[0]) == [b.spec for b in bs]}
        self._shed_by: dict[str, list[ClassLimiter]] = {}
        self._sheds: dict[str, list[ClassLimiter]] = {}
        for protector, shed in policy.shed_map().items():
            self._sheds[protector] = [limiters[c] for c in shed]
            for c in shed:
                self._shed_by.setdefault(c, []).append(limiters[protector])
        now = self.clock()
        for name, lim in old.items():
            if name not in limiters:
                self._retire(lim, now)
        for lim in limiters.values():
            self._grant(lim, now)  # a raised cap may admit waiters at once

    def _retire(self, lim: ClassLimiter, now: float) -> None:
        while lim.queue:
            w = lim.queue.popleft()
            self._resolve(w, self._reject(w, 503, R_CLASS_REMOVED, f"class {lim.name!r} was removed from the "
                                          "policy while this request waited", now))
        if lim.inflight:
            self._retired.append(lim)

    def _breaker_specs(self, cls: str) -> list:
        spec = self.policy.classes[cls]
        specs: list = []
        if spec.slo_p95_ms and spec.latency_breaker.enabled:
            specs.append((spec.slo_p95_ms, spec.latency_breaker))
        if spec.error_breaker.enabled:
            specs.append(spec.error_breaker)
        return specs

    def pool_breakers(self, cls: str, pool: str) -> list[Breaker]:
        """The breakers of one class on one pool, created on first use."""
        bs = self.breakers.get((cls, pool))
        if bs is None:
            bs = []
            for spec in self._breaker_specs(cls):
                if isinstance(spec, tuple):
                    slo_ms, lb = spec
                    b: Breaker = LatencyBreaker(slo_ms / 1000.0, lb.window_s, lb.min_samples, 0.95, lb.cooldown_s,
                                                lb.trickle, lb.trickle_s)
                else:
                    b = ErrorBreaker(spec.max_error_ratio, spec.window_s, spec.min_requests, spec.cooldown_s,
                                     spec.trickle, spec.trickle_s)
                b.spec = spec
                b.on_change = lambda br, state, c=cls, p=pool: self.events.breaker_changed(c, p, br, state)
                bs.append(b)
            self.breakers[(cls, pool)] = bs
        return bs

    # --- decisions ---

    def authenticate(self, facts: RequestFacts) -> Decision | None:
        """None when the request may go on; a 401 when the policy refuses requests without a known key."""
        if self.policy.anonymous.allow or self.classifier.knows(facts.api_key):
            return None
        c = self.classifier.classify(None, None, None)
        if facts.api_key is None:
            reason, message = R_MISSING_KEY, ("You didn't provide an API key. Send it as `Authorization: Bearer "
                                              "<key>` (or `api-key: <key>`).")
        else:
            reason, message = R_INVALID_KEY, "Incorrect API key provided."  # never echo the key: it may be real
        return self._emit(Decision(INVALID, reason, c.cls, ANONYMOUS, status=401, message=message,
                                   classification=c))

    def reads_usage(self, api_key: str | None) -> bool:
        """Whether this caller's responses must be read for their usage: its tokens-per-minute bucket is
        charged the worst case up front and refunded from the real count."""
        limits = self.tenant_limits.get(self.classifier.tenant_for(api_key).name)
        return limits is not None and limits.tokens is not None

    def decide(self, facts: RequestFacts, context: Any = None) -> Decision:
        """Classify and admit, queue, shed, degrade or reject one request."""
        now = self.clock()
        c = self.classifier.classify(facts.api_key, facts.header_class, facts.body_class)
        cluster = self._clusters.get(facts.model) if facts.model is not None else None
        if cluster is None:
            return self._emit(Decision(INVALID, R_UNKNOWN_MODEL, c.cls, c.tenant, status=404,
                                       message=f"The model `{facts.model}` does not exist.", classification=c))
        model = self.cost_models[facts.model]
        ctx = model.spec.max_context_tokens
        if ctx and facts.max_tokens is not None and facts.max_tokens > ctx:
            return self._emit(Decision(INVALID, R_MAX_TOKENS, c.cls, c.tenant, status=400, classification=c,
                                       message=f"max_tokens {facts.max_tokens} exceeds the model's context of "
                                               f"{ctx} tokens."))
        prompt = model.prompt_tokens(facts.doc, facts.generates) if facts.doc else 0
        est = model.estimate(prompt, facts.max_tokens, facts.sequences, facts.generates)
        session = None
        if facts.session_id and self.sessions.enabled:
            session = self.sessions.get(c.tenant, facts.session_id, now)
        charge = Charge(facts.model, est, self.tenant_limits.get(c.tenant), session, facts.request_id,
                        facts.reads_usage)
        charge.fallbacks = ("reject", *(("degrade",) if facts.degradable else ()),
                            *(("canned",) if facts.cannable else ()))
        lim = self.limiters[c.cls]
        d = self._enforce(c, lim, cluster, now, context, charge)
        d.charge = charge
        if charge.tenant is not None:
            d.headers = charge.tenant.headers(now)
        if self._shadow_all or lim.spec.shadow:
            return self._shadowed(d, lim, c, cluster, now, charge)
        if d.kind != QUEUE:
            self._emit(d)
        return d

    def _enforce(self, c: Classification, lim: ClassLimiter, cluster: str, now: float, context: Any,
                 charge: Charge) -> Decision:
        refused = self._budgets(c, lim, cluster, now, charge)
        if refused is not None:
            return refused
        protector = self._saturated_protector(c.cls)
        if protector is not None:
            return Decision(
                SHED, R_HIGHER_SATURATED, c.cls, c.tenant, status=503, classification=c, cluster=cluster,
                retry_after=protector.retry_after_s(now, self._retry_ceiling),
                message=f"class {c.cls!r} is shed while class {protector.name!r} is saturated")
        trickle = False
        for b in self.pool_breakers(c.cls, cluster):
            allowed, probe = b.allow(now)
            if not allowed:
                reason = R_LATENCY_BREAKER if b.kind == "latency" else R_ERROR_BREAKER
                return self._fallback(lim, c.cls, c.tenant, cluster, reason, now, overflow=False, c=c,
                                      charge=charge)
            trickle = trickle or probe
        cost = charge.estimate.gpu_seconds
        if lim.has_room(cost) and not lim.queue:
            ticket = self._admit(lim, c.tenant, cluster, now, charge, 0.0)
            ticket.trickle = trickle
            return Decision(ACCEPT, R_SLOT_FREE, c.cls, c.tenant, ticket=ticket, cluster=cluster, classification=c)
        if lim.queue_has_room() and lim.spec.early_reject and self._cannot_make_it(lim, charge, now):
            return self._overflow(lim, c, cluster, R_DEADLINE, now, charge,
                                  f"class {c.cls!r} would not reach this request within its {lim.spec.max_wait_ms} "
                                  f"ms queue deadline ({len(lim.queue)} ahead at its current drain rate)")
        if lim.queue_has_room():
            waiter = Waiter(lim, c.tenant, cluster, now, cost, context)
            waiter.trickle = trickle
            waiter.charge = charge
            lim.queue.append(waiter)
            self.events.queued(waiter)
            return Decision(QUEUE, R_CLASS_FULL, c.cls, c.tenant, waiter=waiter, cluster=cluster, classification=c)
        return self._overflow(lim, c, cluster, R_QUEUE_FULL, now, charge,
                              f"class {c.cls!r} is at capacity ({lim.inflight} running, {len(lim.queue)} queued, "
                              f"queue limit {lim.spec.max_queue})")

    def _overflow(self, lim: ClassLimiter, c: Classification, cluster: str, reason: str, now: float,
                  charge: Charge, message: str) -> Decision:
        """The class cannot take the request now: its fallback if overflow goes there, else 429."""
        if lim.spec.on_overflow == "fallback":
            return self._fallback(lim, c.cls, c.tenant, cluster, reason, now, overflow=True, c=c, charge=charge)
        return Decision(REJECT, reason, c.cls, c.tenant, status=429, classification=c, cluster=cluster,
                        retry_after=lim.retry_after_s(now, self._retry_ceiling), message=message)

    def _cannot_make_it(self, lim: ClassLimiter, charge: Charge, now: float) -> bool:
        """Deadline-aware early rejection: the predicted queue wait (queue ahead over the observed drain rate)
        exceeds the class's max wait, or wait plus the predicted service time exceeds its SLO. The service-time
        half is used only once the model's cost coefficients have been learned from real durations."""
        wait = lim.queue_wait_s(now)
        if wait is None:
            return False
        if wait > lim.spec.max_wait_ms / 1000.0:
            return True
        slo = lim.spec.slo_p95_ms
        model = self.cost_models.get(charge.model)
        return bool(slo and model is not None and model.samples >= 20
                    and wait + charge.estimate.gpu_seconds > slo / 1000.0)

    def tick(self) -> None:
        """Move adaptive caps (called a few times a second by the adapter; each controller keeps its interval)."""
        now = self.clock()
        for lim in self.limiters.values():
            ctl = lim.adaptive
            if ctl is None:
                continue
            sat = self._class_saturation(lim, now)
            new = ctl.update(now, lim.inflight, sat)
            if new != lim.limit:
                raised = new > lim.limit
                lim.limit = new
                if raised:
                    self._grant(lim, now)

    def _class_saturation(self, lim: ClassLimiter, now: float) -> PoolSaturation | None:
        """The worst of the pools the class sends to: saturated if any of them is."""
        worst = None
        for pool in lim.pools:
            sat = self.saturation.get(pool)
            if sat is not None and (worst is None or sat.saturated):
                worst = sat
        return worst

    def _budgets(self, c: Classification, lim: ClassLimiter, cluster: str, now: float,
                 charge: Charge) -> Decision | None:
        """Per-tenant rate limits, session budgets and the class's GPU-seconds budget: who pays, not capacity."""
        est = charge.estimate

        def refuse(status: int, reason: str, wait_s: float, message: str) -> Decision:
            # A bucket knows exactly when it will hold the request: say so, uncapped, or a client that obeys
            # Retry-After is refused again. 0 for a request no wait can admit (413).
            retry = max(1, math.ceil(wait_s)) if math.isfinite(wait_s) else 0
            if retry:
                message += f"; retry in {retry} s"
            return Decision(REJECT, reason, c.cls, c.tenant, status=status, retry_after=retry, message=message,
                            classification=c, cluster=cluster)

        if charge.tenant is not None:
            which, wait = charge.tenant.check(charge.tokens, now)
            self.events.rate_limit_checked(c.tenant, which)
            if which is not None:
                reason = R_TENANT_REQUESTS if which == "requests" else R_TENANT_TOKENS
                return refuse(429, reason, wait, f"tenant {c.tenant!r} is over its {which} per minute limit")
        if charge.session is not None:
            which, wait = self.sessions.check(charge.session, est.gpu_seconds, now)
            if which is not None:
                reason = R_SESSION_INFLIGHT if which == "session_inflight" else R_SESSION_RATE
                self.events.session_refused(c.tenant, reason)
                if which == "session_inflight":  # frees when one of its requests ends: unknown, so a guess
                    wait = float(lim.retry_after_s(now, self._retry_ceiling))
                return refuse(429, reason, wait, "this agent session is over its GPU-seconds budget "
                              f"({'in flight' if which == 'session_inflight' else 'per minute'})")
        budget = lim.spec.max_inflight_gpu_seconds
        if budget is not None and est.gpu_seconds > budget:
            return refuse(413, R_TOO_LARGE, math.inf,
                          f"this request is estimated at {est.gpu_seconds:.1f} GPU-seconds ({est.prompt_tokens} "
                          f"prompt tokens, up to {est.max_tokens} output tokens), more than class {c.cls!r}'s "
                          f"whole budget of {budget:g}: shorten the prompt or lower max_tokens")
        return None

    def _fallback(self, lim: ClassLimiter, cls: str, tenant: str, cluster: str, reason: str, now: float,
                  overflow: bool, c: Classification | None = None, waited_s: float = 0.0,
                  charge: Charge | None = None) -> Decision:
        """The class's fallback for a request its pool cannot take now (breaker open, or overflow)."""
        fb = lim.spec.fallback
        allowed = charge is None or fb.action in charge.fallbacks
        why = {R_LATENCY_BREAKER: f"the latency breaker of class {cls!r} is open (p95 above its SLO)",
               R_ERROR_BREAKER: f"the error breaker of class {cls!r} is open (upstream failures)",
               R_QUEUE_FULL: f"class {cls!r} is at capacity and its queue is full",
               R_QUEUE_TIMEOUT: f"class {cls!r} had no free slot within {lim.spec.max_wait_ms} ms",
               R_DEADLINE: f"class {cls!r} would not reach this request within its {lim.spec.max_wait_ms} ms queue "
                           "deadline at its current drain rate"}[reason]
        if fb.action == "canned" and allowed:
            retry = lim.retry_after_s(now, self._retry_ceiling) if fb.status in (429, 503) else 0
            return Decision(DEGRADE, reason, cls, tenant, status=fb.status, message=fb.message, fallback=fb,
                            classification=c, cluster=cluster, waited_s=waited_s, retry_after=retry)
        if fb.action != "reject" and not allowed:
            why += f" (its `{fb.action}` fallback cannot serve this endpoint)"
        if fb.action == "degrade" and allowed:
            deg = self.degraded[cls]
            if deg.has_room():
                target = self._clusters[fb.model] if fb.model else cluster
                ticket = self._admit(deg, tenant, target, now, charge, waited_s)
                ticket.degraded = True
                return Decision(DEGRADE, reason, cls, tenant, ticket=ticket, cluster=target, fallback=fb,
                                classification=c, waited_s=waited_s, message=why)
            reason, why = R_DEGRADED_FULL, why + ", and its degraded capacity is full too"
        return Decision(REJECT, reason, cls, tenant, status=429 if overflow else 503, message=why,
                        retry_after=lim.retry_after_s(now, self._retry_ceiling), classification=c,
                        cluster=cluster, waited_s=waited_s)

    def _shadowed(self, d: Decision, lim: ClassLimiter, c: Classification, cluster: str, now: float,
                  charge: Charge) -> Decision:
        """Shadow mode: count what enforce mode decided, then let the request through to its own pool.

        The enforce-mode state stays exact for what enforce would admit: refused requests run without a slot;
        a request enforce would queue runs at once while its virtual place in the queue plays out.
        """
        if d.kind == ACCEPT:
            self._emit(d)
            return d
        ticket = d.ticket if d.kind == DEGRADE and d.ticket is not None else None
        if ticket is None:
            ticket = Ticket(lim, c.tenant, cluster, now, self._lease_s, 0.0, 0.0, holds_slot=False)
            ticket.charge = charge  # learns from usage like any request; charges nobody's budget
            self.tickets[ticket.id] = ticket
        ticket.pool = cluster
        ticket.degraded = False  # it runs on its own pool, so its outcome speaks for that pool's breakers
        if d.kind == QUEUE:
            ticket.waiter = d.waiter
            d.waiter.shadow_ticket = ticket
        else:
            self.events.shadow(c.cls, d.kind, d.reason)
        passed = Decision(ACCEPT, R_SHADOW, c.cls, c.tenant, ticket=ticket, cluster=cluster, classification=c)
        passed.shadow_would = d
        passed.headers = d.headers
        passed.charge = charge
        self._emit(passed)
        return passed

    def invalid(self, status: int, reason: str, message: str, facts: RequestFacts | None = None) -> Decision:
        """A request refused before admission (bad body, bad headers): counted, never holding a slot."""
        cls, tenant = "", ""
        if facts is not None:
            c = self.classifier.classify(facts.api_key, facts.header_class, facts.body_class)
            cls, tenant = c.cls, c.tenant
        return self._emit(Decision(INVALID, reason, cls, tenant, status=status, message=message))

    def abandon(self, waiter: Waiter, timed_out: bool) -> Decision | None:
        """The waiter's deadline passed or its client left. Returns its final decision, or None if it had one."""
        if not waiter.pending:
            return None
        now = self.clock()
        lim = waiter.limiter
        try:
            lim.queue.remove(waiter)
        except ValueError:
            pass
        waited = now - waiter.enqueued_at
        if timed_out and lim.spec.on_overflow == "fallback":
            d = self._fallback(lim, lim.name, waiter.tenant, waiter.pool, R_QUEUE_TIMEOUT, now, overflow=True,
                               waited_s=waited, charge=waiter.charge)
        elif timed_out:
            d = self._reject(waiter, 429, R_QUEUE_TIMEOUT,
                             f"class {lim.name!r} had no free slot within {lim.spec.max_wait_ms} ms", now)
        else:
            d = self._reject(waiter, 499, R_CLIENT_GONE, "client disconnected while queued", now)
        self._resolve(waiter, d)
        return d

    # --- ending ---

    def finish(self, ticket: Ticket, outcome: Outcome = Outcome.ENDED) -> bool:
        """Release the ticket's slot now. Idempotent: only the first call counts.

        `outcome` is what the adapter saw; a completion report (report()) may refine it, before or after.
        """
        if ticket.closed:
            return False
        ticket.closed = True
        now = self.clock()
        ticket.released_at = now
        ticket.stream_outcome = outcome
        self.tickets.pop(ticket.id, None)
        lim = ticket.limiter
        if ticket.waiter is not None and ticket.waiter.pending:
            # Shadow: the request ended while enforce mode would still have had it queued.
            lim.queue.remove(ticket.waiter)
            ticket.waiter.result = Decision(QUEUE, R_ENDED_WHILE_QUEUED, lim.name, ticket.tenant)
            self.events.shadow(lim.name, QUEUE, R_ENDED_WHILE_QUEUED)
        if ticket.holds_slot:
            lim.give_back(ticket.cost, now)
            if ticket.charge is not None and ticket.charge.session is not None:
                self.sessions.release(ticket.charge.session, ticket.cost)
        if lim in self._retired and lim.inflight == 0:
            self._retired.remove(lim)
        if ticket.completion is not None or outcome is Outcome.LEASE_EXPIRED:
            self._account(ticket)
        else:
            self._unreported[ticket.id] = ticket
        if ticket.holds_slot:
            self._grant(lim, now)
        return True

    def report(self, ticket_id: int, completion: Completion) -> bool:
        """The data plane's account of how an admitted request ended. Returns False for unknown tickets."""
        ticket = self._unreported.pop(ticket_id, None)
        if ticket is not None:
            ticket.completion = completion
            self._account(ticket)
            return True
        ticket = self.tickets.get(ticket_id)
        if ticket is None:
            return False
        ticket.completion = completion  # the stream has not closed yet: finish() accounts it
        return True

    def first_token(self, ticket: Ticket, seconds: float) -> None:
        """Time from arrival to the first generated token of a stream (measured on the sampled ones)."""
        self.events.first_token(ticket, seconds)

    def usage(self, ticket: Ticket, prompt_tokens: int, completion_tokens: int) -> None:
        """Real token usage read from the response (learned from when the request is accounted)."""
        ticket.usage = (prompt_tokens, completion_tokens)

    def _account(self, ticket: Ticket) -> None:
        c = ticket.completion
        outcome = c.outcome if c is not None else ticket.stream_outcome
        self.events.finished(ticket, outcome, ticket.released_at - ticket.admitted_at)
        if ticket.usage is not None and ticket.charge is not None:
            self._learn(ticket, c)
        if ticket.degraded or ticket.cls not in self.policy.classes:
            return  # served by a fallback pool, or its class is gone: says nothing about the class's pool
        latency = c.total_s if c is not None and c.total_s else ticket.released_at - ticket.admitted_at + \
            ticket.waited_s
        now = self.clock()
        ctl = ticket.limiter.adaptive
        if ctl is not None and (outcome is Outcome.OK or outcome is Outcome.ENDED):
            ctl.observe(now, latency)
        for b in self.pool_breakers(ticket.cls, ticket.pool):
            if isinstance(b, LatencyBreaker):
                # An aborted request's duration is a lower bound: it only counts once it is already too slow.
                if outcome is Outcome.OK or outcome is Outcome.ENDED or latency > b.slo_s:
                    b.observe(now, latency, ticket.trickle)
            elif outcome is not Outcome.CLIENT_ABORT:
                b.observe(now, outcome is Outcome.UPSTREAM_ERROR or outcome is Outcome.LEASE_EXPIRED,
                          ticket.trickle)

    def _learn(self, ticket: Ticket, c: Completion | None) -> None:
        charge, (prompt, completion) = ticket.charge, ticket.usage
        model = self.cost_models.get(charge.model)
        if model is None:
            return
        est = charge.estimate
        actual = model.actual(prompt, completion)
        self.events.cost_observed(ticket, est.gpu_seconds, actual)
        service = (c.total_s - ticket.waited_s) if c is not None and c.total_s else \
            ticket.released_at - ticket.admitted_at
        model.learn(est, prompt, completion, service if not ticket.degraded else None)
        if charge.tenant is not None and ticket.holds_slot:
            charge.tenant.correct(charge.tokens, prompt + completion)

    def renew(self, ticket: Ticket) -> None:
        ticket.lease_until = self.clock() + self._lease_s

    def reap(self) -> list[Ticket]:
        """Close tickets whose lease ran out and reject waiters past their deadline (safety nets)."""
        now = self.clock()
        expired = [t for t in self.tickets.values() if t.lease_until <= now]
        for t in expired:
            self.finish(t, Outcome.LEASE_EXPIRED)
        while self._unreported:
            t = next(iter(self._unreported.values()))
            if now - t.released_at < REPORT_WAIT_S:
                break
            del self._unreported[t.id]
            self._account(t)
        for lim in self.limiters.values():
            while lim.queue and lim.queue[0].deadline <= now:
                self.abandon(lim.queue[0], timed_out=True)
        return expired

    # --- internals ---

    def _saturated_protector(self, cls: str) -> ClassLimiter | None:
        for protector in self._shed_by.get(cls, ()):
            if protector.saturated:
                return protector
        return None

    def _admit(self, lim: ClassLimiter, tenant: str, pool: str, now: float, charge: Charge | None,
               waited_s: float) -> Ticket:
        cost = charge.estimate.gpu_seconds if charge is not None else 0.0
        lim.take(cost)
        lim.pools.add(pool)
        ticket = Ticket(lim, tenant, pool, now, self._lease_s, cost, waited_s)
        ticket.charge = charge
        if charge is not None:
            if charge.tenant is not None:
                charge.tenant.charge(charge.tokens, now)
            if charge.session is not None:
                self.sessions.charge(charge.session, cost, now)
        self.tickets[ticket.id] = ticket
        if lim.saturated:
            for shed in self._sheds.get(lim.name, ()):
                self._shed_queue(shed, lim, now)
        return ticket

    def _shed_queue(self, lim: ClassLimiter, protector: ClassLimiter, now: float) -> None:
        while lim.queue:
            w = lim.queue.popleft()
            self._resolve(w, Decision(
                SHED, R_HIGHER_SATURATED, lim.name, w.tenant, status=503, waited_s=now - w.enqueued_at,
                retry_after=protector.retry_after_s(now, self._retry_ceiling),
                message=f"class {lim.name!r} is shed while class {protector.name!r} is saturated"))

    def _grant(self, lim: ClassLimiter, now: float) -> None:
        """Hand free slots to the queue head, in FIFO order, skipping waiters already past their deadline."""
        while lim.queue and lim.has_room(lim.queue[0].cost):
            w = lim.queue[0]
            if w.deadline <= now:
                self.abandon(w, timed_out=True)
                continue
            protector = self._saturated_protector(lim.name)
            if protector is not None:
                self._shed_queue(lim, protector, now)
                return
            lim.queue.popleft()
            waited = now - w.enqueued_at
            if w.shadow_ticket is not None:  # shadow: the running request now holds the slot enforce gives it
                t = w.shadow_ticket
                lim.take(w.cost)
                t.cost, t.holds_slot, t.waiter = w.cost, True, None
                w.result = Decision(ACCEPT, R_DEQUEUED, lim.name, w.tenant, ticket=t, waited_s=waited)
                self.events.shadow(lim.name, ACCEPT, R_DEQUEUED)
                continue
            ticket = self._admit(lim, w.tenant, w.pool, now, w.charge, waited)
            ticket.trickle = w.trickle
            self._resolve(w, Decision(ACCEPT, R_DEQUEUED, lim.name, w.tenant, ticket=ticket, waited_s=waited,
                                      cluster=w.pool))

    def _reject(self, w: Waiter, status: int, reason: str, message: str, now: float) -> Decision:
        return Decision(REJECT, reason, w.limiter.name, w.tenant, status=status, message=message,
                        retry_after=w.limiter.retry_after_s(now, self._retry_ceiling),
                        waited_s=now - w.enqueued_at, cluster=w.pool)

    def _resolve(self, w: Waiter, d: Decision) -> None:
        w.result = d
        d.charge = w.charge
        if w.shadow_ticket is not None:  # shadow: the request is already running; only count the verdict
            self.events.shadow(d.cls, d.kind, d.reason)
            w.shadow_ticket.waiter = None
            return
        self._emit(d)
        if w.on_result is not None:
            w.on_result(d)

    def _emit(self, d: Decision) -> Decision:
        if not self.gated(d):
            self.events.decided(d)
        return d

    # --- a shared store's say (extproc.policy.store): the adapter awaits it between decide() and the answer ---

    def gated(self, d: Decision) -> bool:
        """Whether this admission also needs a global slot from the shared store before it stands.

        Only enforced class slots are shared; degraded slots and shadow passes stay per replica."""
        t = d.ticket
        return (self.shared_slots and t is not None and t.holds_slot and not t.degraded and not t.closed
                and not self._shadow_all and not t.limiter.spec.shadow)

    def confirm(self, d: Decision, waited_s: float = 0.0) -> Decision:
        """The shared store granted the global slot, after `waited_s` in its wait (0: at once): the admission
        stands and is counted now. A wait counts as queueing; the request's service starts now."""
        if waited_s > 0.0:
            t = d.ticket
            t.waited_s += waited_s
            t.admitted_at += waited_s
            t.lease_until += waited_s
            d.waited_s, d.reason = t.waited_s, R_DEQUEUED
        self.events.decided(d)
        return d

    def revoke(self, d: Decision, status: int, reason: str, message: str) -> Decision:
        """The shared store did not grant a global slot (none within the class's wait, store down and failing
        closed, or the client left): the local slot goes back unused and the request gets a refusal instead.
        A class with `on_overflow: fallback` takes its fallback on a wait that timed out."""
        t = d.ticket
        now = self.clock()
        lim = t.limiter
        if not t.closed:  # closed without accounting: the request never ran
            t.closed = True
            self.tickets.pop(t.id, None)
            lim.inflight -= 1
            lim.inflight_cost -= t.cost
            charge = t.charge
            if charge is not None and charge.session is not None:
                self.sessions.release(charge.session, t.cost)
            if charge is not None and charge.tenant is not None:
                charge.tenant.correct(charge.tokens, 0)
            if lim in self._retired and lim.inflight == 0:
                self._retired.remove(lim)
        waited = t.waited_s + (now - t.admitted_at)
        if reason == R_QUEUE_TIMEOUT and lim.spec.on_overflow == "fallback":
            out = self._fallback(lim, lim.name, t.tenant, t.pool, R_QUEUE_TIMEOUT, now, overflow=True,
                                 waited_s=waited, charge=t.charge)
        else:
            out = Decision(REJECT, reason, lim.name, t.tenant, status=status, message=message, waited_s=waited,
                           retry_after=lim.retry_after_s(now, self._retry_ceiling), cluster=t.pool)
        out.headers = d.headers
        self._grant(lim, now)
        return self._emit(out)

    # --- introspection (metrics collectors read this at scrape time) ---

    def snapshot(self) -> dict[str, dict[str, float]]:
        out = {name: {"inflight": lim.inflight, "queue": len(lim.queue), "limit": lim.limit,
                      "inflight_cost": lim.inflight_cost, "degraded_inflight": self.degraded[name].inflight}
               for name, lim in self.limiters.items()}
        for lim in self._retired:
            out.setdefault(lim.name, {"inflight": lim.inflight, "queue": 0, "limit": 0,
                                      "inflight_cost": lim.inflight_cost, "degraded_inflight": 0})
        return out
