"""The admission decision (accept / queue / reject / shed / degrade) and the ticket closed exactly once.

One request, in order (decide): identify and classify -> route to its model's pool -> estimate its cost ->
budgets (charging.py: tenant rate limits, session budgets, the class's GPU-seconds) -> shedding (a higher class
saturated) -> the class's breakers on that pool -> its limit (a slot now, a place in the bounded queue, or
overflow) -> the class's fallback (fallback.py). Shadow mode (shadow.py) wraps the result. Every admitted ticket is
released once (_release), however it ends, and its completion feeds the outcome listeners (outcomes.py). The
limits move at tick() (limit_moves.py).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Callable, TypeVar

from .adaptive import PoolSaturation
from .breakers import OPEN, Breaker
from .charging import Charging
from .fallback import Fallbacks, on_pool
from .classify import ANONYMOUS, Classification
from .decision import (ACCEPT, DEGRADE, INVALID, QUEUE, REJECT, SHED, Admit, AdmissionEvents,  # noqa: F401
                       Canned, Charge, Decision, Degrade, NoEvents, Queued, Refusal, RequestFacts)
from .limit_moves import LimitMoves
from .limits import ClassLimiter, Completion, LimitFactory, Outcome, Ticket, Waiter, default_limit, wait_ends
from .outcomes import Completed, CostLearning, PoolLearning
from .pool import UNGRANTED
from .reasons import (R_CLASS_FULL, R_CLASS_REMOVED, R_CLIENT_GONE, R_DEADLINE, R_DEQUEUED,  # noqa: F401
                      R_ENDED_WHILE_QUEUED, R_ERROR_BREAKER, R_HIGHER_SATURATED, R_INVALID_KEY,
                      R_LATENCY_BREAKER, R_MAX_TOKENS, R_MISSING_KEY, R_QUEUE_FULL, R_QUEUE_TIMEOUT, R_SHADOW,
                      R_SLOT_FREE, R_UNKNOWN_MODEL, REASONS, say)
from .schema import Policy
from .shadow import ShadowMode
from .state import PolicyState
from .steering import ReplicaSteering

# How long a released ticket waits for the data plane's completion report before it is accounted without one.
REPORT_WAIT_S = 5.0
# Most choices a `canned` answer is written with (one per sequence the client asked for); past it the fallback
# rejects instead. Each costs the event loop ~1 µs and ~100 bytes: `n: 2147483647` on an overflowing class had it
# build two billion of them (n 1,000,000 alone: 1.3 s of the loop and a 100 MB answer no gRPC write takes).
CANNED_MAX_CHOICES = 1024
# How a request that ran to its end is reported (by Envoy's access log, or its stream without one): a failure the
# replica wrote into such an answer (Ticket.answer_failed) makes it the replica's error.
_ANSWERED_WHOLE = (Outcome.OK, Outcome.ENDED)
# tick() is due every half of the shortest interval a limit moves at (a move is then at most half an interval
# late), within these bounds: under 25 ms the ticks cost more than they buy; 100 ms is the default policy's pace.
TICK_BOUNDS_S = (0.025, 0.1)
T = TypeVar("T")


class AdmissionController:
    """Sans-IO admission: decide() per request, finish() once per ticket, report() with how it ended."""

    def __init__(self, policy: Policy, clock: Callable[[], float] = time.monotonic,
                 events: AdmissionEvents | None = None, limit_factory: LimitFactory = default_limit):
        self.clock = clock
        self.events: AdmissionEvents = events or NoEvents()
        self.state = PolicyState(clock, self._breaker_changed, limit_factory, self._breaker_created)
        self.pool_breakers = self.state.pool_breakers  # bound once: called on every decision
        self.tickets: dict[int, Ticket] = {}   # open tickets, for the lease safety net
        self.saturation: dict[str, PoolSaturation] = {}  # pool -> the replicas' own load (set_saturation)
        self.steering = ReplicaSteering()
        self._unreported: OrderedDict[int, Ticket] = OrderedDict()  # released, completion report pending
        self._retired: list[ClassLimiter] = []
        self.shadow = ShadowMode(self)
        self.listeners = [CostLearning(self.state, self.events), PoolLearning(self.state)]
        self.charging = Charging(self.state, self.events)
        self.fallbacks = Fallbacks(self)
        self.moves = LimitMoves(self.state, self.events, self.saturation)
        # True once a shared store confirms each admission (gate_on_store; see gated()): such admissions are
        # counted once, by confirm() or revoke(), instead of when decided.
        self.shared_slots = False
        # True once the adapter counts each admission when its answer forwards the request (count_on_forward).
        self.counts_on_forward = False
        self.apply(policy)

    # --- the running policy (PolicyState builds it) ---

    def apply(self, policy: Policy) -> None:
        """Install a (validated) policy. Held slots stay with the limiter they were taken from; what they hold of a
        pool's limit moves to the pool's new gate."""
        asks = self.moves.pending_asks()
        removed = self.state.apply(policy, self._retired)
        self._retired = [lim for lim in self._retired if not self.state.current(lim)]
        self.state.move_pool_holds(self.tickets.values(), self._unreported.values())
        st = self.state  # plain attributes, not properties: the hot path reads them on every request
        self.policy, self.limiters, self.degraded, self.classifier = st.policy, st.limiters, st.degraded, \
            st.classifier
        self.cost_models, self.tenant_limits, self.sessions = st.cost_models, st.tenant_limits, st.sessions
        self.clusters, self.model_names, self.served_names = st.clusters, st.model_names, st.served_names
        self.gates = st.gates  # Envoy cluster -> its pool-wide limit (empty: per-class caps only)
        self.moves.restore_asks(asks)
        self._sessions_on = st.sessions.enabled
        self.shadow.configure(policy)
        self._lease_s = policy.lease_ms / 1000.0
        self.tick_s = tick_interval(policy)
        self._retry_ceiling = policy.retry_after_max_s
        now = self.clock()
        for lim in removed:
            self._retire(lim, now)
        if not policy.anonymous.allow:
            self._refuse_revoked(now)
        for lim in self.limiters.values():
            self._grant(lim, now)  # a raised cap may admit waiters at once

    @property
    def breakers(self) -> dict[tuple[str, str], list[Breaker]]:
        return self.state.breakers

    def replicas_for(self, cluster: str, cls: str | None = None, model: str | None = None) -> str | None:
        """The override-host list for a request of class `cls` for `model` (the name it is forwarded with)
        forwarded to `cluster` (policy.steering), None: Envoy picks. A class with an SLO is kept off the pool's slow
        replicas, however much of the pool-wide limit it holds: the limit's latency is then the fast replicas', and
        bounds what it sends them. A request for one of the pool's LoRA adapters prefers a replica running it."""
        steering = self.steering
        if not steering.active:
            return None
        lim = self.limiters.get(cls) if cls is not None else None
        tight = lim is not None and lim.spec.slo_p95_ms is not None
        return steering.pick(cluster, self.clock(), tight_slo=tight, model=model)

    def replica_answered(self, address: str, failed: bool) -> None:
        """A replica's answer, as the access log reports it (only counted while some pool is steered)."""
        self.steering.answered(address, failed, self.clock())

    def set_saturation(self, pool: str, saturation: PoolSaturation | None) -> None:
        """The replicas' own view of a pool's load (a scraper's), or None when the pool is no longer watched."""
        now = self.clock()
        if saturation is None:
            self.saturation.pop(pool, None)
            self.steering.update(pool, (), now=now)
            self.steering.update_loras(pool, ())
        else:
            self.saturation[pool] = saturation
            self.steering.update(pool, saturation.working, stalled=saturation.stalled > 0, now=now)
            self.steering.update_loras(pool, saturation.loras)

    def wants_listings(self, pool: str) -> bool:
        """Whether this pool's replicas' /v1/models are to be read (models.<name>.names_from_replicas)."""
        return self.state.wants_listings(pool)

    def set_listings(self, pool: str, listings: list) -> dict[str, str]:
        """The pool's replicas' /v1/models `data`, one list per replica (a scraper's); returns the names it now
        serves beyond the policy's, -> the model each is admitted as."""
        served = self.state.set_listings(pool, listings)
        # Its LoRA adapters (cards with a parent), for policy.steering
        self.steering.set_adapters(pool, frozenset(
            c.get("id") for cards in listings if isinstance(cards, list) for c in cards
            if isinstance(c, dict) and isinstance(c.get("id"), str) and isinstance(c.get("parent"), str)))
        return served

    def model_catalog(self) -> dict[str, dict]:
        """What GET /v1/models lists: every name admitted, -> its card's fields (policy/served.py catalog)."""
        return self.state.catalog()

    def gate_on_store(self, shared: bool) -> None:
        """A shared store confirms each admission from now on (extproc.store.shared_slots.SharedSlots)."""
        self.shared_slots = shared

    def count_on_forward(self) -> None:
        """From now on an admission (a decision holding a ticket) is counted (events.decided: extproc_requests_total)
        when the adapter's answer forwards its request (forwarded()), not when it is decided or granted. One taken
        back before that never went upstream and has no outcome to account: withdrawn (the adapter refused it after
        the decision), or a queue's grant to a client that left in that same instant (revoke: counted as the
        client's leaving while queued). Counted when decided, each was an admission that no outcome ever matched
        (extproc.server.stream.Processor sets this)."""
        self.counts_on_forward = True

    def _retire(self, lim: ClassLimiter, now: float) -> None:
        while lim.queue:
            w = self._dequeue(lim.queue.popleft())
            self._resolve(w, self._reject(w, 503, R_CLASS_REMOVED, say(R_CLASS_REMOVED, cls=lim.name), now))
        if lim.inflight:
            self._retired.append(lim)

    def revoked(self, tenant: str) -> bool:
        """Whether requests of `tenant` are no longer served: the policy takes keys only (`anonymous.allow:
        false`) and they are anonymous, or of a tenant a reload removed, so they now get 401 at arrival."""
        return not self.policy.anonymous.allow and (tenant == ANONYMOUS or tenant not in self.classifier.tenant_names)

    @staticmethod
    def revoked_reason(c: Classification | None) -> str:
        """The 401 reason a revoked request gets, as at arrival (authenticate): no key, or one nobody owns."""
        return R_MISSING_KEY if c is not None and not c.keyed else R_INVALID_KEY

    def _refuse_revoked(self, now: float) -> None:
        """Queued requests the reload revoked (anonymous ones, and a removed tenant's) get the 401 they would now
        get at arrival: they are not served from the queue they waited in (found by reload audits: they were
        admitted when a slot freed). Those already running finish, as in a removed class."""
        for lim in self.limiters.values():
            for w in [w for w in lim.queue if self.revoked(w.tenant)]:
                lim.queue.remove(w)
                self._dequeue(w)
                reason = self.revoked_reason(w.classification)
                self._resolve(w, Refusal(INVALID, reason, lim.name, w.tenant, 401, say(reason),
                                         waited_s=now - w.enqueued_at, cluster=w.pool))

    def _breaker_created(self, cls: str, pool: str, breaker: Breaker) -> None:
        self.events.breaker_created(cls, pool, breaker)

    def _breaker_changed(self, cls: str, pool: str, breaker: Breaker, state: str) -> None:
        self.events.breaker_changed(cls, pool, breaker, state)
        if state == OPEN and breaker.kind == "error":
            self._answer_waiters_of_failing_pool(cls, pool, breaker)

    def _answer_waiters_of_failing_pool(self, cls: str, pool: str, breaker: Breaker) -> None:
        """An error breaker opened: the class's requests queued for its pool get what an arrival gets now, the
        class's fallback. They were sent to the failing pool one by one as slots freed (a latency breaker's are
        left to wait: there lower classes yield first, _yield_first)."""
        lim = self.limiters.get(cls)
        if lim is None or not lim.queue:
            return
        now = self.clock()
        for w in [w for w in lim.queue if w.pool == pool and w.pending]:
            lim.queue.remove(w)
            self._dequeue(w)
            lim.queue.unmet(w.flow, w.cost)
            self._resolve(w, self.fallbacks.answer(lim, cls, w.tenant, pool, R_ERROR_BREAKER, now, overflow=False,
                                                   c=w.classification, charge=w.charge,
                                                   waited_s=now - w.enqueued_at, closed_in=breaker.opens_in(now)))

    # --- who may ask at all ---

    def authenticate(self, facts: RequestFacts) -> Decision | None:
        """None when the request may go on; a 401 when the policy refuses requests without a known key."""
        if self.policy.anonymous.allow or self.classifier.knows(facts.api_key):
            return None
        c = self.classifier.classify(None, None, None)
        reason = R_MISSING_KEY if facts.api_key is None else R_INVALID_KEY  # never echo the key: it may be real
        return self._emit(_with_id(Refusal(INVALID, reason, c.cls, ANONYMOUS, 401, say(reason), classification=c),
                                   facts))

    def body_limit(self, api_key: str | None, server_limit: int) -> int:
        """The largest body this caller may send: its tenant's `max_body_bytes` under the server's own limit."""
        own = self.classifier.tenant_for(api_key).max_body_bytes
        return server_limit if own is None else min(own, server_limit)

    def reads_usage(self, api_key: str | None) -> bool:
        """Whether this caller's responses must be read for their usage: its tokens-per-minute bucket is
        charged the worst case up front and refunded from the real count."""
        limits = self.tenant_limits.get(self.classifier.tenant_for(api_key).name)
        return limits is not None and limits.tokens is not None

    # --- the decision ---

    def decide(self, facts: RequestFacts) -> Decision:
        """Classify and admit, queue, shed, degrade or reject one request."""
        now = self.clock()
        c = self.classifier.classify(facts.api_key, facts.header_class, facts.body_class, facts.objective,
                                     facts.fairness_id)
        name = facts.model
        model = (self.model_names.get(name) or self.served_names.get(name)) if name is not None else None
        if model is None:
            return self._emit(_with_id(Refusal(INVALID, R_UNKNOWN_MODEL, c.cls, c.tenant, 404,
                                               say(R_UNKNOWN_MODEL, model=_shown(facts.model)), classification=c),
                                       facts))
        cluster = self.clusters[model]
        # The policy's word only, not a length learned from the replicas: this 400 is given in shadow too, and a
        # replica refuses past its own length anyway (the estimate is bounded by the learned one meanwhile).
        context_tokens = self.cost_models[model].spec.max_context_tokens
        if context_tokens and facts.max_tokens is not None and facts.max_tokens > context_tokens:
            field = facts.max_tokens_field  # named as the client sent it, as vLLM does
            return self._emit(_with_id(Refusal(INVALID, R_MAX_TOKENS, c.cls, c.tenant, 400,
                                               say(R_MAX_TOKENS, field=field, max_tokens=facts.max_tokens,
                                                   context=context_tokens), classification=c, param=field),
                                       facts))
        charge = self._estimate(facts, model, c, now)
        lim = self.limiters[c.cls]
        d = self._enforce(c, lim, cluster, now, charge, facts.deadline_ms, facts.max_tokens_field)
        d.charge = charge
        if charge.tenant is not None:
            d.headers = charge.tenant.headers(now)
        if self.shadow.everything or lim.spec.shadow:
            return self.shadow.pass_through(d, lim, c, cluster, now, charge)
        if d.kind != QUEUE:
            self._emit(d)
        return d

    def _estimate(self, facts: RequestFacts, name: str, c: Classification, now: float) -> Charge:
        """What the request is expected to cost as model `name` (the key of `models` its name resolved to), and
        whom it is charged to."""
        model = self.cost_models[name]
        prompt = model.prompt_tokens(facts.doc, facts.generates) if facts.doc else 0
        prompt = model.truncated(prompt, facts.prompt_cap, facts.prompts)
        est = model.estimate(prompt, facts.max_tokens, facts.sequences, facts.generates, facts.prompts,
                             facts.min_output)
        session = None
        if facts.session_id and self._sessions_on:
            session = self.sessions.get(c.tenant, facts.session_id, now)
        charge = Charge(name, est, self.tenant_limits.get(c.tenant), session, facts.request_id,
                        facts.reads_usage)
        if facts.model != name:
            charge.alias = facts.model  # an alias or adapter: for the decision log, never a metric label
        charge.streams = facts.stream and facts.cannable  # cannable: the chat and completions shapes
        cannable = facts.cannable and facts.sequences <= CANNED_MAX_CHOICES
        if not (facts.generates and cannable):
            charge.fallbacks = ("reject", *(("degrade",) if facts.generates else ()),
                                *(("canned",) if cannable else ()))
        return charge

    def _enforce(self, c: Classification, lim: ClassLimiter, cluster: str, now: float, charge: Charge,
                 deadline_ms: float | None = None, field: str = "max_tokens") -> Decision:
        """The stages after the estimate, in order; the first that answers decides."""
        refused = self.charging.refusal(c, lim, cluster, now, charge, field)
        if refused is not None:
            return refused
        protector = self.state.saturated_protector(c.cls, cluster)
        if protector is not None:
            lim.queue.unmet(_flow_of(lim, c), charge.estimate.gpu_seconds)
            return Refusal(SHED, R_HIGHER_SATURATED, c.cls, c.tenant, 503,
                           say(R_HIGHER_SATURATED, cls=c.cls, protector=protector.name),
                           protector.retry_after_s(now, self._retry_ceiling), classification=c, cluster=cluster)
        trickle = False
        for b in self.pool_breakers(c.cls, cluster):
            allowed, probe = b.allow(now)
            if not allowed and b.kind == "latency" and self._yield_first(lim, cluster, now, b):
                continue  # lower classes give way first; the request goes on to the limit
            if not allowed:
                reason = R_LATENCY_BREAKER if b.kind == "latency" else R_ERROR_BREAKER
                lim.queue.unmet(_flow_of(lim, c), charge.estimate.gpu_seconds)
                return self.fallbacks.answer(lim, c.cls, c.tenant, cluster, reason, now, overflow=False, c=c,
                                             charge=charge, closed_in=b.opens_in(now))
            trickle = trickle or probe
        return self._limit(c, lim, cluster, now, charge, trickle, deadline_ms)

    def _yield_first(self, lim: ClassLimiter, cluster: str, now: float, breaker: Breaker) -> bool:
        """A latency breaker would send this class elsewhere. That is the last resort.
         - Per-class limits: while a lower class holds more than its floor on the pool, it yields instead.
         - A pool-wide limit: on a full pool, lower classes holding more than their guarantee yield first (their
           share shrinks to it for one cooldown per opening of the breaker), and while the limit itself can still
           come down, cutting it (the pool's controller sees the same latency) is what restores the latency.
        Either way the request goes on to the limit instead of degrading."""
        gate = self.gates.get(cluster) if self.gates else None
        if gate is None:
            return self._lower_classes_yield(lim, cluster, now, breaker)
        if gate.full(now) and gate.lower_hold_more_than_guaranteed(lim.rank):
            if gate.squeeze(lim.rank, breaker.since, now + breaker.cooldown_s):
                self.events.pool_yielded(cluster, lim.name)
            return True
        return gate.can_cut() or gate.lower_hold_more_than_guaranteed(lim.rank)

    def _lower_classes_yield(self, lim: ClassLimiter, cluster: str, now: float, breaker: Breaker) -> bool:
        """Per-class limits: while a lower class holds more than its floor on the pool, it yields (its cap is cut
        once to under what it holds) and the breaker is reset instead of degrading: it trips again only if the
        latency stays over the SLO after they have."""
        if not self.moves.lower_excess(lim, (cluster,)):
            return False
        self.moves.ask_yield((cluster,), lim.rank)
        breaker.reset(now)
        self.events.pool_yielded(cluster, lim.name)
        return True

    def _pool_admits(self, gate, lim: ClassLimiter, units: float, now: float) -> bool:
        """Strict priority on the pool: within its guarantee a class goes in; beyond it, only while no higher
        class waits for this pool (a waiter held back by its own class cap does not wait for the pool)."""
        if gate.guaranteed(lim.rank, units, now):
            return True
        return not self._higher_waits(gate, lim) and gate.fits(lim.rank, units, now)

    def _higher_waits(self, gate, lim: ClassLimiter) -> bool:
        """A higher class waits for this pool (a waiter held back by its own class cap does not)."""
        return any(self._waits_for_pool(gate, r) for r in range(lim.rank))

    def _waits_for_pool(self, gate, rank: int) -> bool:
        """The class at `rank` has requests queued for this pool that wait for the pool, not for its own cap."""
        ranked = self.state.ranked
        return bool(gate.waiting[rank]) and rank < len(ranked) and ranked[rank].has_room()

    def _owed(self, gate, lim: ClassLimiter, flow: str, units: float, now: float) -> bool:
        """A fair class's flow under its share of what the class holds on the pool (among the flows there): it goes
        in on a full pool (PoolGate.owed), unless a higher class waits for the pool."""
        q = lim.queue
        return q.mode != "fifo" and not self._higher_waits(gate, lim) and \
            gate.owed(lim.rank, flow, units, q.share(flow, gate.name, gate.flows[lim.rank]), now,
                      lambda: q.borrowed(gate.name, gate.flows[lim.rank], flow))

    def _limit(self, c: Classification, lim: ClassLimiter, cluster: str, now: float, charge: Charge,
               trickle: bool, deadline_ms: float | None = None) -> Decision:
        """A slot now (the class's and its pool's), a place in the bounded queue, or overflow."""
        est = charge.estimate
        cost = est.gpu_seconds
        gate = self.gates.get(cluster) if self.gates else None
        units = gate.units(est.prompt_tokens, est.max_tokens, est.sequences) if gate is not None else 0.0
        if gate is not None:
            gate.controller.asked(lim.rank, now)
        flow = _flow_of(lim, c)
        if lim.has_room(cost) and (
                (self._queue_passable(lim, cluster, gate)
                 and (gate is None or self._pool_admits(gate, lim, units, now)))
                or (gate is not None and not lim.queue.waiting_in(flow)
                    and self._owed(gate, lim, flow, units, now))):
            ticket = self._admit(lim, c.tenant, cluster, now, charge, 0.0, gate, units, flow)
            ticket.trickle = trickle
            if deadline_ms is not None:  # else the ticket's own (the class's max wait) is the same
                ticket.wait_until = wait_ends(lim, now, deadline_ms)
            return Admit(R_SLOT_FREE, c.cls, c.tenant, ticket, cluster=cluster, classification=c)
        # The class's drain rate predicts its own queue; a request waiting only for its pool is granted by
        # priority as the pool frees, which that rate does not measure: it waits up to its max wait instead.
        missed = lim.queue_has_room() and lim.spec.early_reject and (gate is None or not lim.has_room(cost)) \
            and self._cannot_make_it(lim, charge, now, deadline_ms, flow)
        if missed:
            return self._overflow(lim, c, cluster, R_DEADLINE, now, charge,
                                  say(R_DEADLINE, cls=c.cls, within=missed, queued=lim.queue.ahead(flow)))
        # One place freed must make room (a reload may leave more waiting than max_queue): else nobody takes it.
        if not lim.queue_has_room() and lim.spec.max_wait_ms > 0 and len(lim.queue) == lim.spec.max_queue:
            crowded = lim.queue.crowded_out_by(flow)  # fair modes: a flood does not keep the places either
            if crowded is not None:
                self._overflow_waiter(crowded, R_QUEUE_FULL, now)
        if lim.queue_has_room():
            waiter = Waiter(lim, c.tenant, cluster, now, cost, flow, deadline_ms)
            waiter.trickle = trickle
            waiter.charge = charge
            waiter.classification = c
            if gate is not None:
                waiter.gate, waiter.units = gate, units
                gate.waiting[lim.rank] += 1
            lim.queue.append(waiter)
            self.charging.prepay(charge, now)
            self.events.queued(waiter)
            return Queued(R_CLASS_FULL, c.cls, c.tenant, waiter, cluster=cluster, classification=c)
        held = self._pool_hold(lim, gate, units, cost, now)  # its queue waits for the pool, not for its cap
        return self._overflow(lim, c, cluster, R_QUEUE_FULL, now, charge,
                              say(R_QUEUE_FULL, cls=c.cls, detail=f"{_waits_for(cluster, held)}{lim.inflight} "
                                  f"running, {len(lim.queue)} queued, queue limit {lim.spec.max_queue}"))

    @staticmethod
    def _queue_passable(lim: ClassLimiter, cluster: str, gate) -> bool:
        """Nobody in the class's queue is ahead of a request for `cluster`: it is empty, or every waiter waits
        for another pool's limit with room in the class (as _grant_class passes them over). Found with
        scenarios/moe-rag.yaml: one class on two pools, its requests for an idle pool were refused behind those
        waiting for the full one."""
        if not lim.queue:
            return True
        if gate is not None and gate.waiting[lim.rank]:
            return False  # the cheap answer under a one-pool overload: its own pool's waiters come first
        # In no particular order: the first waiter that fails answers (in arrival order, each arrival sorted, or in
        # fifo copied, every waiter first: a class whose GPU-seconds budget held a large request back, with room for
        # the small ones arriving, paid O(waiters) an arrival).
        return all(w.gate is not None and w.pool != cluster and lim.has_room(w.cost) for w in lim.queue.unordered())

    def _overflow(self, lim: ClassLimiter, c: Classification, cluster: str, reason: str, now: float,
                  charge: Charge, message: str) -> Decision:
        """The class cannot take the request now: its fallback if overflow goes there (saying `message` too),
        else 429."""
        lim.queue.unmet(_flow_of(lim, c), charge.estimate.gpu_seconds)
        if lim.spec.on_overflow == "fallback":
            return self.fallbacks.answer(lim, c.cls, c.tenant, cluster, reason, now, overflow=True, c=c, charge=charge,
                                  why=message)
        return Refusal(REJECT, reason, c.cls, c.tenant, 429, message, lim.retry_after_s(now, self._retry_ceiling),
                       classification=c, cluster=cluster)

    def _cannot_make_it(self, lim: ClassLimiter, charge: Charge, now: float,
                        deadline_ms: float | None = None, flow: str | None = None) -> str:
        """Deadline-aware early rejection: the predicted queue wait (queue ahead over the observed drain rate)
        exceeds the request's max wait (the class's, or its own deadline if shorter), or wait plus the predicted
        service time exceeds its SLO. The service-time half is used only once the model's cost coefficients have
        been learned from real durations. Returns the bound missed, in words for the refusal ("": none): a message
        naming the class's max wait whatever was missed sent the on-call to a deadline that was met."""
        # The whole queue first: no flow has more ahead of it, and both bounds only get harder with a longer wait,
        # so when that is in time the flow's own queue ahead (a pass over the waiting flows in fair mode, on every
        # queued arrival) is not needed.
        wait = lim.queue_wait_s(now)
        if wait is None:
            return ""
        missed = self._misses(lim, charge, wait, deadline_ms)
        if missed and flow is not None and lim.queue.mode != "fifo":
            missed = self._misses(lim, charge, lim.queue_wait_s(now, flow), deadline_ms)
        return missed

    def _misses(self, lim: ClassLimiter, charge: Charge, wait: float, deadline_ms: float | None) -> str:
        """The bound a request predicted to wait `wait` seconds misses (_cannot_make_it), "" for none."""
        own = deadline_ms is not None and deadline_ms < lim.spec.max_wait_ms
        max_wait_ms = deadline_ms if own else lim.spec.max_wait_ms
        if wait > max_wait_ms / 1000.0:
            return f"within the request's own {max_wait_ms:g} ms deadline" if own else \
                f"within its {max_wait_ms:g} ms queue deadline"
        slo = lim.spec.slo_p95_ms
        model = self.cost_models.get(charge.model)
        if slo and model is not None and model.samples >= 20:
            service = model.service_s(charge.estimate)  # not its GPU-seconds: its sequences decode side by side
            if wait + service > slo / 1000.0:
                return f"within its {slo:g} ms SLO (predicted wait {wait:.2f} s + service {service:.2f} s)"
        return ""

    def invalid(self, status: int, reason: str, message: str, facts: RequestFacts | None = None) -> Decision:
        """A request refused before admission (bad body, bad headers): counted, never holding a slot."""
        cls, tenant = "", ""
        if facts is not None:
            c = self.classifier.classify(facts.api_key, facts.header_class, facts.body_class, facts.objective,
                                         facts.fairness_id)
            cls, tenant = c.cls, c.tenant
        return self._emit(_with_id(Refusal(INVALID, reason, cls, tenant, status, message), facts))

    # --- the queue ---

    def abandon(self, waiter: Waiter, timed_out: bool, regrant: bool = True) -> Decision | None:
        """The waiter's deadline passed or its client left. Returns its final decision, or None if it had one.
        A waiter whose client left stops holding lower classes back on its pool (`regrant`)."""
        if not waiter.pending:
            return None
        now = self.clock()
        lim = waiter.limiter
        try:
            lim.queue.remove(waiter)
            self._dequeue(waiter)
        except ValueError:
            pass
        if timed_out:
            d = self._overflowed(waiter, R_QUEUE_TIMEOUT, now)
        else:
            d = self._reject(waiter, 499, R_CLIENT_GONE, say(R_CLIENT_GONE, waiting="queued"), now)
        self._resolve(waiter, d)
        if regrant and not timed_out and waiter.gate is not None:
            # A client that left frees its place for lower classes; one that timed out showed the pool short
            # for its class, whose next arrivals come first: lower classes wait for the next release.
            self._grant(lim, now)
        return d

    def _overflowed(self, w: Waiter, reason: str, now: float) -> Decision:
        """A queued request that cannot wait on (its deadline passed, or its place was taken): its class's overflow."""
        lim = w.limiter
        lim.queue.unmet(w.flow, w.cost)
        held = self._pool_hold(lim, w.gate, w.units, w.cost, now)
        # The wait it had: the class's max wait, or the request's own deadline when shorter (a 150 ms deadline
        # timed out was told "no free slot within 2000 ms").
        waited_ms = round((w.deadline - w.enqueued_at) * 1000.0)
        if lim.spec.on_overflow == "fallback":
            return self.fallbacks.answer(lim, lim.name, w.tenant, w.pool, reason, now, overflow=True,
                                  waited_s=now - w.enqueued_at, charge=w.charge, held=held, max_wait_ms=waited_ms)
        return self._reject(w, 429, reason, say(reason, cls=lim.name, where=on_pool(w.pool, held),
                                                max_wait_ms=waited_ms,
                                                detail="queue full: its place went to a tenant with fewer "
                                                       "waiting"), now)

    def _pool_hold(self, lim: ClassLimiter, gate, units: float, cost: float, now: float) -> str:
        """What of its pool-wide limit keeps a request of `lim` out now, in words for its refusal; "" when nothing
        does or the class's own cap holds it. An on-call reading "no free slot" raised the class's cap, which had
        room: the pool held the request."""
        if gate is None or not lim.has_room(cost):
            return ""
        if gate.guaranteed(lim.rank, units, now):
            return UNGRANTED
        above = next((r for r in range(lim.rank) if self._waits_for_pool(gate, r)), None)
        return f"class {self.state.ranked[above].name!r} waits for it first" if above is not None else \
            gate.held_back_by(lim.rank, units, now)

    def _overflow_waiter(self, w: Waiter, reason: str, now: float) -> None:
        w.limiter.queue.remove(w)
        self._dequeue(w)
        self._resolve(w, self._overflowed(w, reason, now))

    def _grant(self, lim: ClassLimiter, now: float) -> None:
        """Hand free slots to waiters. With pool-wide limits a slot freed on a pool may go to any class: every
        class is looked at, highest priority first."""
        if not self.gates:
            self._grant_class(lim, now, None)
            return
        blocked: set[str] = set()  # pools a higher class is waiting for: lower classes get only their guarantee
        for ranked in self.state.ranked:
            if ranked.queue:
                self._grant_class(ranked, now, blocked)

    def _grant_class(self, lim: ClassLimiter, now: float, blocked: set[str] | None) -> None:
        """Waiters past their deadline leave first; then slots go in the queue's grant order (arrival order, or
        by its fairness mode). A waiter whose pool has no room keeps its place and blocks that pool for the rest
        of this class and the classes below it, except that in fair modes a flow still owed its share of the pool
        goes in over the limit (_owed_waiter)."""
        q = lim.queue
        if not q:
            return  # the common case: every release calls this
        for w in q.overdue(now):
            if w.pending:
                self.abandon(w, timed_out=True, regrant=False)
        arrivals = q.in_line() if q.mode == "fifo" else None  # fifo: one pass, the order does not change
        skipped: set[str] = set()  # fair modes: pools this class found no room on in this pass
        above = set(blocked) if blocked else ()  # pools a higher class waits for: no over-commit there
        while True:
            if lim.inflight >= lim.limit:
                return  # no slot for anyone (has_room below): the next grant is not looked for (O(flows) in fair)
            w = next(arrivals, None) if arrivals is not None else self._next_fair(q, skipped)
            if w is None:
                return
            if not w.pending:
                continue  # resolved meanwhile (a fallback of an earlier waiter may grant)
            if not lim.has_room(w.cost):
                return
            gate = w.gate
            if gate is not None and blocked is not None and not gate.guaranteed(lim.rank, w.units, now):
                if gate.name in blocked or not gate.fits(lim.rank, w.units, now):
                    owed = None if arrivals is not None or gate.name in above else \
                        self._owed_waiter(lim, gate, w.pool, now)
                    if owed is None:
                        blocked.add(gate.name)
                        skipped.add(w.pool)
                        continue
                    w = owed
                    if not lim.has_room(w.cost):
                        return
            protector = self.state.saturated_protector(lim.name, w.pool)
            if protector is not None:
                self._shed_queue(lim, protector, now)
                continue  # waiters for other pools may still go in
            q.take(w)
            self._dequeue(w)
            waited = now - w.enqueued_at
            if self.shadow.grant(w, lim, waited, now):
                continue
            ticket = self._admit(lim, w.tenant, w.pool, now, w.charge, waited, gate, w.units, w.flow)
            ticket.trickle, ticket.wait_until = w.trickle, w.deadline
            ticket.queued, ticket.fair_turn = True, q.mode == "round_robin"
            self._resolve(w, Admit(R_DEQUEUED, lim.name, w.tenant, ticket, waited_s=waited, cluster=w.pool))

    def _owed_waiter(self, lim: ClassLimiter, gate, pool: str, now: float) -> Waiter | None:
        """On a full pool, the next waiter for it of a flow still owed its share (of those, the flow holding
        least per weight), or None. O(flows)."""
        q = lim.queue
        if self._higher_waits(gate, lim):
            return None
        best, least = None, math.inf
        holders = gate.flows[lim.rank]
        weights = _once(lambda: q.pool_weights(pool, holders))
        borrowed = _once(lambda: q.borrowed(pool, holders, weights=weights()))  # the waiting flows are active
        for key, share, w in q.heads_for(pool, holders, weights):
            if gate.owed(lim.rank, key, w.units, share, now, borrowed):
                per_weight = gate.held_by(lim.rank, key) / share
                if per_weight < least:
                    best, least = w, per_weight
        return best

    @staticmethod
    def _next_fair(q, skipped: set[str]) -> Waiter | None:
        """The next grant of a fair queue, on a pool not skipped (the queue's head if its pool has room)."""
        if not q:
            return None
        head = q[0]
        if head.pool not in skipped:
            return head
        # The queue's own order among the pools left, not the first of them in arrival order: that gave the
        # slot to whoever of that pool came next, ahead of a flow served less waiting for another pool.
        return q.first_outside(skipped)

    def _dequeue(self, w: Waiter) -> Waiter:
        """A waiter left its class queue (granted, refused, shed): it no longer waits for its pool either."""
        if w.gate is not None:
            w.gate.waiting[w.limiter.rank] -= 1
        return w

    def _shed_queue(self, lim: ClassLimiter, protector: ClassLimiter, now: float) -> None:
        """Shed the class's waiters for the pools the protector's saturation covers (saturated_protector)."""
        for w in list(lim.queue):
            if self.state.saturated_protector(lim.name, w.pool) is not protector:
                continue
            lim.queue.remove(w)
            self._dequeue(w)
            lim.queue.unmet(w.flow, w.cost)
            self._resolve(w, Refusal(SHED, R_HIGHER_SATURATED, lim.name, w.tenant, 503,
                                     say(R_HIGHER_SATURATED, cls=lim.name, protector=protector.name),
                                     protector.retry_after_s(now, self._retry_ceiling), waited_s=now - w.enqueued_at))

    def _reject(self, w: Waiter, status: int, reason: str, message: str, now: float) -> Decision:
        return Refusal(REJECT, reason, w.limiter.name, w.tenant, status, message,
                       w.limiter.retry_after_s(now, self._retry_ceiling), waited_s=now - w.enqueued_at,
                       cluster=w.pool)

    def _resolve(self, w: Waiter, d: Decision) -> None:
        """A waiter's final decision: its request's own, so it carries how the request was classified (counted
        here, once: a queued decision is not counted when it is made)."""
        w.result = d
        d.charge = w.charge
        if d.ticket is None:
            self.charging.refund(w.charge)
        if w.charge is not None and w.charge.tenant is not None:
            # Where its bucket stands now (refunded if refused), as decisions made on arrival say it.
            d.headers = w.charge.tenant.headers(self.clock())
        d.classification = w.classification
        if self.shadow.resolved(w, d):
            return
        self._emit(d)
        if w.on_result is not None:
            w.on_result(d)

    # --- taking and giving back a slot (the only two places) ---

    def _admit(self, lim: ClassLimiter, tenant: str, pool: str, now: float, charge: Charge | None,
               waited_s: float, gate=None, units: float = 0.0, flow: str | None = None) -> Ticket:
        cost = charge.estimate.gpu_seconds if charge is not None else 0.0
        ticket = Ticket(lim, tenant, pool, now, self._lease_s, cost, waited_s)
        ticket.flow = flow or tenant
        ticket.charge = charge
        self.hold(ticket, lim, cost, now, gate, units)
        self.tickets[ticket.id] = ticket
        self.shed_below(lim, now)
        return ticket

    def shed_below(self, lim: ClassLimiter, now: float) -> None:
        """A slot just taken filled the class: the queues of the classes it sheds are refused."""
        if lim.saturated and self.state.current(lim):  # not its degraded slots' limiter (same name)
            for shed in self.state.sheds.get(lim.name, ()):
                self._shed_queue(shed, lim, now)

    def hold(self, ticket: Ticket, lim: ClassLimiter, cost: float, now: float, gate=None, units: float = 0.0) -> None:
        """What a slot taken holds, each given back by _release: the class's slot and GPU-seconds, the flow's fair
        charge, the pool's units, the session's in-flight budget. For a new ticket (_admit) and for a shadow pass
        that reaches its virtual place (ShadowMode.grant), which once charged no session budget but gave one back."""
        if ticket.pool in self.state.routed:  # the pools whose struggles the class yields to (limit_moves); not one
            lim.pools.add(ticket.pool)        # a reload removed, that a waiter queued before it was granted on
        lim.take(cost, now)
        ticket.fair_charge = lim.queue.admitted(ticket.flow, cost)
        ticket.fair_flow = lim.queue.flow_of(ticket.flow)
        ticket.fair_stats = lim.queue.stats_of(ticket.flow)
        if gate is not None:
            self.hold_pool(ticket, gate, units)
        if ticket.charge is not None:
            self.charging.admitted(ticket.charge, cost, now)

    def _release(self, ticket: Ticket, now: float, ran: bool) -> None:
        """Close the ticket and give back what it holds (slot, session budget). A request that never ran (its
        admission was revoked or withdrawn) also gets its tokens and its flow's fair charge back (round_robin: the turn
        its grant took) and does not count as a completion for the drain rate."""
        ticket.closed = True
        ticket.released_at = now
        self.tickets.pop(ticket.id, None)
        lim, charge = ticket.limiter, ticket.charge
        if ticket.awaiting_store:  # revoked (or its lease ran out) while it waited for the shared store
            self._store_answered(ticket)
        if ticket.holds_slot:
            if ran:
                lim.give_back(ticket.cost, now)
            else:
                lim.untake(ticket.cost, now)
            if lim.inflight == 0:
                lim.inflight_cost = 0.0  # a float sum drifts: nothing held is exactly 0, not -8e-17
            if not ran:  # its flow was charged the estimate (virtual time, served GPU-seconds) for nothing
                lim.queue.settle(ticket.flow, ticket.fair_charge, 0.0, ticket.fair_flow, ticket.fair_stats)
                if ticket.fair_turn:  # and, granted from a round_robin queue, its turn
                    lim.queue.return_turn(ticket.flow, ticket.fair_flow)
            lim.queue.released(ticket.flow, ticket.cost)
            if ticket.gate is not None:
                ticket.gate.give_back(ticket.rank, ticket.units, ticket.flow, ticket.pool_stall)
                ticket.gate.controller.ended(ticket.id)
                if ticket.rest and ran:  # one that never ran (revoked) held nothing of the replicas: nothing owed
                    ticket.gate.rest(ticket.rank, now + (now - ticket.admitted_at) * ticket.rest, now)
                if not ran:  # nor will it be served: the limit does not wait for it after a latency cut
                    ticket.gate.controller.withdrawn(ticket.cohort)
            if charge is not None:
                self.charging.released(charge, ticket.cost, ran)
        if lim in self._retired and lim.inflight == 0:
            self._retired.remove(lim)

    def hold_pool(self, ticket: Ticket, gate, units: float) -> None:
        """The ticket holds `units` of its pool's limit (released with its slot)."""
        ticket.gate, ticket.units, ticket.rank = gate, units, ticket.limiter.rank
        rest = gate.rest_after(ticket.rank, units)  # 0 for the first class and within the share: the usual case
        # Over its share while the pool is contended (a higher class waits, or it has no room under its fill): the
        # class's guarantee, paid back by a rest. A request that finds the pool empty with nobody above waiting
        # takes nothing from anyone: on a limit of 1 request, where a lower class never has room under its fill,
        # each of its requests rested it 19 s per second it ran, and its queue waited out max_wait on an idle pool.
        if rest and (self._higher_waits(gate, ticket.limiter)
                     or (gate.holding and not gate.room(ticket.rank, units))):
            ticket.rest = rest
        ticket.pool_stall = gate.take(ticket.rank, units, ticket.flow)
        ticket.cohort = gate.controller.admitted(ticket.rank, ticket.admitted_at, ticket.id)

    # --- the end of an admitted request ---

    def finish(self, ticket: Ticket, outcome: Outcome = Outcome.ENDED, status: int = 0) -> bool:
        """Release the ticket's slot now. Idempotent: only the first call counts.

        `outcome` is what the adapter saw, and `status` the response's if it read one (0: it did not); a
        completion report (report()) may refine them, before or after.
        """
        now = self._close(ticket, True)
        if now is None:
            return False
        ticket.stream_outcome = outcome
        ticket.stream_status = status
        if ticket.completion is not None or outcome is Outcome.LEASE_EXPIRED:
            self._account(ticket)
        else:
            self._unreported[ticket.id] = ticket
        if ticket.holds_slot:
            self._grant(ticket.limiter, now)
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

    def answer_failed(self, ticket: Ticket) -> None:
        """The response the replica began with a 2xx carries its failure (vLLM's error event in a stream): the
        request ended as the replica's error, whatever status Envoy reports."""
        ticket.answer_failed = True

    def usage(self, ticket: Ticket, prompt_tokens: int, completion_tokens: int) -> None:
        """Real token usage read from the response (learned from when the request is accounted)."""
        ticket.usage = (prompt_tokens, completion_tokens)

    def _account(self, ticket: Ticket) -> None:
        """One completion event, to the metrics and to every outcome listener."""
        c = ticket.completion
        outcome = c.outcome if c is not None else ticket.stream_outcome
        if ticket.answer_failed and outcome in _ANSWERED_WHOLE:
            outcome = Outcome.UPSTREAM_ERROR  # a 200 whose body said the generation failed
        # What the client waited: Envoy's total when its report has one, else queued + admission to end.
        latency = c.total_s if c is not None and c.total_s else \
            ticket.released_at - ticket.admitted_at + ticket.waited_s
        self.events.finished(ticket, outcome, latency)
        event = Completed(ticket, outcome, c, latency, self.clock(), ticket.cls in self.policy.classes)
        for listener in self.listeners:
            listener.completed(event)

    # --- time passing ---

    def tick(self) -> None:
        """Move the classes' limits and the pools' (called a few times a second by the adapter; each algorithm
        keeps its own interval)."""
        self.moves.tick(self.clock(), self._grant)

    def pool_reading(self, pool: str, now: float) -> PoolSaturation | None:
        """The pool's last saturation reading, None once nobody refreshes it (LimitMoves.pool_reading)."""
        return self.moves.pool_reading(pool, now)

    def renew(self, ticket: Ticket) -> None:
        ticket.lease_until = self.clock() + self._lease_s

    def reap(self) -> list[Ticket]:
        """Close tickets whose lease ran out and reject waiters past their deadline (safety nets)."""
        now = self.clock()
        expired = [t for t in self.tickets.values() if t.lease_until <= now]
        for t in expired:
            if t.awaiting_store:  # it waited for the store and never ran: its slot goes back unused, no completion
                self._release(t, now, False)
                self._grant(t.limiter, now)
            else:
                self.finish(t, Outcome.LEASE_EXPIRED)
        while self._unreported:
            t = next(iter(self._unreported.values()))
            if now - t.released_at < REPORT_WAIT_S:
                break
            del self._unreported[t.id]
            self._account(t)
        for lim in self.limiters.values():
            for w in lim.queue.overdue(now):
                self.abandon(w, timed_out=True)
        return expired

    def _emit(self, d: Decision) -> Decision:
        """Count a decision, unless it is an admission counted later: by confirm() (a shared store's global slot)
        or by forwarded() (count_on_forward)."""
        if not self.gated(d) and not (self.counts_on_forward and d.ticket is not None):
            self.events.decided(d)
        return d

    def forwarded(self, d: Decision) -> None:
        """The adapter's answer forwards this admission's request: it is counted now (count_on_forward)."""
        if self.counts_on_forward:
            self.events.decided(d)

    # --- a shared store's say (extproc.store.shared_slots): the adapter awaits it between decide() and the answer ---

    def gated(self, d: Decision) -> bool:
        """Whether this admission also needs a global slot from the shared store before it stands.

        Only enforced class slots are shared; degraded slots and shadow passes stay per replica."""
        t = d.ticket
        return (self.shared_slots and t is not None and t.holds_slot and not t.degraded and not t.closed
                and not self.shadow.covers(t.limiter))

    def await_store(self, d: Decision) -> None:
        """The shared store has no global slot for this gated admission now, and it waits for one: until confirm()
        or revoke() its class slot is only reserved, so it counts as queued (queue depth), not in flight, and as one
        queue entry unless it already waited in its class queue. Once per admission."""
        t = d.ticket
        if t.awaiting_store or t.closed:
            return
        t.awaiting_store = True
        t.limiter.reserve(t.cost)
        if not t.queued:
            t.queued = True
            self.events.queued(t)  # what it reads of a Waiter, a ticket has too: its class (`limiter`)

    def _store_answered(self, t: Ticket) -> None:
        t.awaiting_store = False
        t.limiter.unreserve(t.cost)

    def confirm(self, d: Decision, waited_s: float = 0.0) -> Decision:
        """The shared store granted the global slot, after `waited_s` in its wait (0: at once): the admission
        stands and is counted now. A wait counts as queueing; the request's service starts now. One whose lease
        ran out while it waited (reap closed it) holds no slot to run in: its wait is over, as a timed-out one's
        (the caller gives the global slot back when the answer is not this ticket's)."""
        t = d.ticket
        if t.closed:  # told the wait it had (its class queue's and the store's), not the class's max_wait_ms
            waited_ms = round((t.waited_s + waited_s) * 1000.0)
            return self.revoke(d, R_QUEUE_TIMEOUT, say(R_QUEUE_TIMEOUT, cls=t.limiter.name, where="",
                                                       max_wait_ms=waited_ms))
        if t.awaiting_store:
            self._store_answered(t)
        if waited_s > 0.0:
            t.waited_s += waited_s
            t.admitted_at += waited_s
            t.lease_until += waited_s
            d.waited_s, d.reason = t.waited_s, R_DEQUEUED
        if not self.counts_on_forward:
            self.events.decided(d)
        return d

    def withdraw(self, ticket: Ticket) -> bool:
        """Take back an admission whose request never went upstream (the adapter refused it after the decision: its
        body as it would be forwarded is over the limit): its slot goes back unused and it is charged nothing, as a
        revoked one's. Released as a finished request, it was a completion for the drain rate, a charge of its
        expected output, and a report awaited from Envoy that never comes. Not counted as an admission either
        (count_on_forward, which the adapter that withdraws sets): counted, it had no outcome. False if it was
        closed already."""
        now = self._close(ticket, False)
        if now is None:
            return False
        if ticket.holds_slot:
            self._grant(ticket.limiter, now)
        return True

    def _close(self, ticket: Ticket, ran: bool) -> float | None:
        """Close an open ticket (finish, withdraw): its virtual shadow place ends, its slot goes back. Returns the
        time, or None if it was closed already."""
        if ticket.closed:
            return None
        now = self.clock()
        if self.shadow.places:
            self.shadow.ended(ticket)
        self._release(ticket, now, ran)
        return now

    def revoke(self, d: Decision, reason: str, message: str) -> Decision:
        """The shared store did not grant a global slot (none within the class's wait, store down and failing
        closed, or the client left), or the class queue's verdict came in the instant its client left, before the
        adapter took it (extproc.server.final_admission.FinalAdmission.give_back): the local slot goes back unused
        and the request gets a refusal instead, counted as its one decision.
        A class with `on_overflow: fallback` takes its fallback on a wait that timed out."""
        t = d.ticket
        now = self.clock()
        lim = t.limiter
        # Closed already (the lease safety net ended it): its wait is over, and no fallback admits it again (one
        # released as having run, its lease out before it waited, would be charged twice).
        fallback = reason == R_QUEUE_TIMEOUT and lim.spec.on_overflow == "fallback" and not t.closed
        if not t.closed:  # closed without accounting: the request never ran
            self._release(t, now, False)
        if reason in (R_QUEUE_TIMEOUT, R_QUEUE_FULL):  # no global slot: refused for want of room, as a queue's
            lim.queue.unmet(t.flow, t.cost)
        waited = t.waited_by(now)
        # A class a reload removed has no fallback left (its degraded slots and model may be gone with it).
        if fallback and self.state.current(lim):
            out = self.fallbacks.answer(lim, lim.name, t.tenant, t.pool, R_QUEUE_TIMEOUT, now, overflow=True,
                                 waited_s=waited, charge=t.charge, max_wait_ms=round(waited * 1000.0))
        else:
            out = Refusal(REJECT, reason, lim.name, t.tenant, REASONS[reason].status, message,
                          lim.retry_after_s(now, self._retry_ceiling), waited_s=waited, cluster=t.pool)
        out.headers = d.headers
        out.classification = d.classification
        self._grant(lim, now)
        return self._emit(out)

    # --- introspection (metrics collectors read this at scrape time) ---

    def pools_snapshot(self) -> dict[str, dict]:
        """Per pool with a pool-wide limit: PoolGate.snapshot."""
        now = self.clock()
        return {name: gate.snapshot(now, self.waiting_for_pool(gate)) for name, gate in self.gates.items()}

    def class_limiters(self) -> list[ClassLimiter]:
        """The policy's class limiters, then those of classes a reload removed whose requests still run."""
        return [*self.limiters.values(), *self._retired]

    def waiting_for_pool(self, gate) -> list[int]:
        """Per class rank, its requests queued for this pool that wait for the pool: none while the class's own
        cap is full (those wait for the cap: _waits_for_pool)."""
        return [n if self._waits_for_pool(gate, rank) else 0 for rank, n in enumerate(gate.waiting)]

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per class: requests running and their estimated cost, requests waiting (in the class queue, or holding a
        reserved slot while the shared store has no global slot for them), the cap, degraded requests running."""
        out = {name: {"inflight": lim.running, "queue": lim.waiting, "limit": lim.limit,
                      "inflight_cost": lim.running_cost, "degraded_inflight": self.degraded[name].inflight}
               for name, lim in self.limiters.items()}
        for lim in self._retired:
            out.setdefault(lim.name, {"inflight": lim.running, "queue": lim.reserved, "limit": 0,
                                      "inflight_cost": lim.running_cost, "degraded_inflight": 0})
        for name, deg in self.degraded.items():  # a removed class's degraded requests run on until they end too
            if name not in self.limiters and deg.inflight:
                out.setdefault(name, {"inflight": 0, "queue": 0, "limit": 0, "inflight_cost": 0.0})
                out[name]["degraded_inflight"] = deg.inflight
        return out


def tick_interval(policy: Policy) -> float:
    """How often the adapter should call tick() for this policy (TICK_BOUNDS_S). A fixed 100 ms let a pool limit
    with `interval_s: 0.1` move every 100-200 ms, and in the demo at speed 5 every 0.5 simulated s where the what-if
    moved it every 0.25."""
    intervals = [c.adaptive.interval_s for c in policy.classes.values() if c.adaptive.enabled]
    intervals += [p.limit.interval_s for p in policy.pools.values() if p.limit.enabled]
    low, high = TICK_BOUNDS_S
    return min(high, max(low, min(intervals, default=2 * high) / 2))


def _once(compute: Callable[[], T]) -> Callable[[], T]:
    """`compute`, called at most once however often the result is asked for."""
    memo: list[T] = []

    def value() -> T:
        if not memo:
            memo.append(compute())
        return memo[0]
    return value


def _flow_of(lim: ClassLimiter, c: Classification) -> str:
    """A request's fairness key in its class: the header's where the class keys flows by it, else its tenant."""
    return c.flow if lim.spec.fairness.key == "header" else c.tenant


def _shown(name: str | None) -> str | None:
    """A client's string as an error message quotes it: cut short (a 4 MB `model` must not come back whole)."""
    return name if name is None or len(name) <= 128 else name[:128] + "..."


def _with_id(d: Decision, facts: RequestFacts | None) -> Decision:
    """A decision made before the request is charged carries the client's request id itself (for its log line)."""
    if facts is not None:
        d.request_id = facts.request_id
    return d


def _waits_for(pool: str, held: str) -> str:
    """The start of a full queue's `detail` when its requests wait for a pool-wide limit, not the class's cap."""
    return f"its queue waits for pool {pool!r}: {held}; " if held else ""
