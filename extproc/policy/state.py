"""What one policy builds (limiters, classifier, cost models, buckets, breakers), rebuilt on reload with carry-over."""

from __future__ import annotations

from typing import Callable, Iterable

from .adaptive import AdaptiveLimit
from .breakers import Breaker, ErrorBreaker, LatencyBreaker
from .classify import ANONYMOUS, Classifier
from .cost import CostModel
from .limits import ClassLimiter, LimitFactory, StaticLimit, Ticket, Waiter, default_limit
from .pool import PoolGate
from . import served
from .ratelimit import SessionBudgets, TenantLimits
from .schema import ClassSpec, Policy


def reads_listings(policy: Policy, cluster: str) -> bool:
    """Whether a model routed to this cluster needs its replicas' /v1/models: it takes names from them, or its
    context length (it has no max_context_tokens)."""
    return any(m.names_from_replicas or not m.cost.max_context_tokens
               for m in policy.models.values() if m.cluster == cluster)


class PolicyState:
    """The policy as running state. A reload keeps what must survive it: slots held under a limiter and what they
    hold of a pool's limit (its learned limit too, unless its unit or `initial` changed), learned cost
    coefficients (unless the model's profile changed), tenant buckets and session budgets (what is left of them,
    within a changed spec), breaker state (a breaker whose specs changed is rebuilt, open or half-open if it was;
    those of a removed class or pool are dropped), adaptive limits (a retuned one goes on from its learned cap,
    within its new bounds) and the context lengths learned from a pool's /v1/models (while it is still read)."""

    def __init__(self, clock: Callable[[], float], on_breaker_change: Callable[[str, str, Breaker, str], None],
                 limit_factory: LimitFactory = default_limit,
                 on_breaker_created: Callable[[str, str, Breaker], None] = lambda cls, pool, b: None):
        self.clock = clock
        self.on_breaker_change = on_breaker_change
        self.on_breaker_created = on_breaker_created
        self.limit_factory = limit_factory
        self.limiters: dict[str, ClassLimiter] = {}
        self.degraded: dict[str, ClassLimiter] = {}   # per class: slots for requests served by its fallback
        self.breakers: dict[tuple[str, str], list[Breaker]] = {}  # (class, pool) -> its breakers
        self.cost_models: dict[str, CostModel] = {}
        self.tenant_limits: dict[str, TenantLimits] = {}
        self.sessions: SessionBudgets | None = None
        self.sheds: dict[str, list[ClassLimiter]] = {}     # protector -> the classes it sheds
        self.shed_by: dict[str, list[ClassLimiter]] = {}   # class -> the classes that shed it
        self.gates: dict[str, PoolGate] = {}          # Envoy cluster -> its pool-wide limit (pools.<name>.limit)
        self.ranked: list[ClassLimiter] = []          # the classes' limiters, highest priority first
        # models.<name>.names_from_replicas: each pool's replicas' last /v1/models listings (their `data`), and the
        # names they give that the policy does not, -> their model. Updated in place: the hot path holds the dict.
        self.listings: dict[str, list] = {}
        self.served_names: dict[str, str] = {}
        # (cluster, model) -> the context length its replicas there list, for a model with no max_context_tokens.
        self.contexts: dict[tuple[str, str], int] = {}
        self._catalog: dict[str, dict] | None = None  # GET /v1/models: built once per policy or listing change

    def apply(self, policy: Policy, retired: list[ClassLimiter] = ()) -> list[ClassLimiter]:
        """Install a (validated) policy; return the limiters of classes it removed. `retired`: limiters of classes
        an earlier reload removed that still hold slots; a class put back takes its old limiter up again, so the
        requests still running under it count against its cap (a fresh limiter would admit a whole cap more)."""
        old = {**{lim.name: lim for lim in retired}, **self.limiters}
        self.limiters = {name: self._limiter(old.get(name), name, spec) for name, spec in policy.classes.items()}
        for name, spec in policy.classes.items():
            # In shadow as its class is: a shadow pass holding a degraded slot is never gated on a shared store.
            deg_spec = ClassSpec(max_concurrency=spec.fallback.max_concurrency or spec.max_concurrency,
                                 max_queue=0, max_wait_ms=0, shadow=spec.shadow)
            deg = self.degraded.get(name)
            if deg is None:
                self.degraded[name] = ClassLimiter(name, deg_spec)
            else:  # reconfigure() keeps the limit for the limit algorithm to set: a degraded cap is static
                deg.reconfigure(deg_spec)
                deg.controller = StaticLimit(deg_spec.max_concurrency)
                deg.limit = deg_spec.max_concurrency
        # A removed class's degraded slots are forgotten once none runs (a class put back meanwhile counts them).
        self.degraded = {name: d for name, d in self.degraded.items() if name in policy.classes or d.inflight}
        self.policy = policy
        self.classifier = Classifier(policy)
        self.clusters = {name: m.cluster for name, m in policy.models.items()}
        self.routed = set(self.clusters.values())  # the pools a request may go to now
        for lim in (*self.limiters.values(), *self.degraded.values()):
            # A pool removed is none the class sends to: kept, classes that had both sent there went on yielding
            # to each other's latency, and heeding its saturation, wherever they went since.
            lim.pools &= self.routed
        # Every name a client may send -> the model it is admitted, charged and counted as (a key of `models`).
        self.model_names = {alias: name for name, m in policy.models.items() for alias in (name, *m.aliases)}
        # Listings no longer read are forgotten: kept, a pool whose names were turned back on (or put back) served
        # the names of its last listing, however old, until its replicas were read again.
        for cluster in [c for c in self.listings if not self.wants_listings(c)]:
            del self.listings[cluster]
        self._merge_served()
        self._catalog = None
        self.cost_models = {name: self.cost_models[name] if self._same_cost(name, m.cost) else CostModel(m.cost)
                            for name, m in policy.models.items()}
        self._relearn_contexts()
        tenants = [*policy.tenants, policy.anonymous.as_tenant()]
        now = self.clock()
        self.tenant_limits = {t.name: self.tenant_limits[t.name] if self._same_tenant(t) else
                              self._edited_tenant(t, now)
                              for t in tenants if t.requests_per_minute or t.tokens_per_minute}
        if self.sessions is None or self.sessions.spec != policy.sessions:
            self.sessions = SessionBudgets(policy.sessions).carried_from(self.sessions, now)
        # Those of a class or pool the policy removed go now: no new request reaches them, and a request still
        # running there is accounted without them (pool_breakers). Kept, an open one showed on the dashboards of a
        # pool nobody had any more, and a pool put back started from the old one's state.
        self.breakers = {key: self._rebuilt(*key, bs) for key, bs in self.breakers.items()
                         if key[0] in policy.classes and key[1] in self.routed}
        self.sheds, self.shed_by = {}, {}
        for protector, shed in policy.shed_map().items():
            self.sheds[protector] = [self.limiters[c] for c in shed]
            for c in shed:
                self.shed_by.setdefault(c, []).append(self.limiters[protector])
        weights = {t.name: t.weight for t in policy.tenants if t.weight != 1.0}
        guaranteed = {t.name: t.guaranteed_share for t in policy.tenants if t.guaranteed_share}
        labels = [t.name for t in policy.tenants] + [ANONYMOUS]
        for lim in self.limiters.values():
            lim.queue.clock = self.clock
            lim.queue.open_group = ANONYMOUS  # a key with no API key is the gateway's word for who it is
            lim.queue.configure(lim.spec.fairness.mode, weights, guaranteed, labels)
            lim.queue.capacity = lim.limit
        for name, lim in old.items():  # a removed class's requests run on, counted under the tenants it has now
            if name not in self.limiters:
                lim.queue.configure(lim.queue.mode, weights, guaranteed, labels)
        self.ranked = list(self.limiters.values())
        for rank, lim in enumerate(self.ranked):
            lim.rank = rank
            if lim.name in self.degraded:  # a degraded request weighs on a pool limit as its class does
                self.degraded[lim.name].rank = rank
        self.gates = self._gates(policy)
        return [lim for name, lim in old.items() if name not in self.limiters and lim not in retired]

    def _gates(self, policy: Policy) -> dict[str, PoolGate]:
        """A gate per pool with a limit. One whose limit spec and classes are unchanged is kept; otherwise a new
        one replaces it, starting from the limit it learned (PoolGate._controller) and holding what it held
        (move_pool_holds)."""
        slos = {rank: spec.slo_p95_ms / 1000.0 for rank, spec in enumerate(policy.classes.values())
                if spec.slo_p95_ms}
        shares = [spec.min_share for spec in policy.classes.values()]
        gates = {}
        for name, pool in policy.pools.items():
            if not pool.limit.enabled:
                continue
            gate = self.gates.get(name)
            if gate is not None and gate.spec == pool.limit and gate.class_names == list(policy.classes):
                gate.reconfigure(slos, shares)
            else:
                gate = PoolGate(name, pool.limit, slos, shares, list(policy.classes), previous=gate)
            gates[name] = gate
        return gates

    def move_pool_holds(self, tickets: Iterable[Ticket], ended: Iterable[Ticket]) -> None:
        """Nothing in flight is lost on a reload: what open `tickets` hold of a gate the reload replaced moves to
        the pool's new gate (in its unit, at the class's rank there), and so do the waiters' places: the limit
        holds across the reload and each ticket ends on the gate that holds it; a limit turned on counts what
        already runs on its pool. A new controller (a new unit, a limit turned on) is told which requests still
        run, for its latency reading (RecentLatencies.censored_quantile). Tickets that `ended` but are not
        accounted yet follow too, so their latency teaches the new gate."""
        for t in tickets:
            if t.gate is not None and self.gates.get(t.gate.name) is not t.gate:
                old = t.gate
                old.give_back(t.rank, t.units, t.flow, t.pool_stall)
                t.gate, t.rank, t.units = self._moved(old, t.cls, t.units, t.charge)
                if t.gate is not None:
                    t.pool_stall = t.gate.take(t.rank, t.units, t.flow, t.pool_stall)
                    if t.gate.controller is not old.controller:  # a new unit: a new controller, told what runs
                        old.controller.ended(t.id)
                        t.cohort = t.gate.controller.admitted(t.rank, t.admitted_at, t.id)
            elif t.gate is None and t.holds_slot and self._slot_pool(t) in self.gates:
                # A limit turned on over requests already running on its pool: they hold it too, or it would let
                # a whole limit more onto a pool that is likely why it was turned on.
                gate = t.gate = self.gates[self._slot_pool(t)]
                t.rank, t.units = gate.rank_of(t.cls), self._units(gate, None, 0.0, t.charge)
                t.pool_stall = gate.take(t.rank, t.units, t.flow)
                t.cohort = gate.controller.admitted(t.rank, t.admitted_at, t.id)
        for t in ended:
            if t.gate is not None and self.gates.get(t.gate.name) is not t.gate:
                t.gate, t.rank, t.units = self._moved(t.gate, t.cls, t.units, t.charge)
        for lim in self.limiters.values():
            for w in lim.queue:
                self._move_place(w)

    def _slot_pool(self, t: Ticket) -> str:
        """The pool a ticket's slot stands for. A shadow pass on a degraded slot runs on its own pool
        (ShadowMode.pass_through), where enforce would run it on its degrade's: it weighs there, as in enforce."""
        if t.degraded or t.limiter is not self.degraded.get(t.cls) or t.cls not in self.policy.classes:
            return t.pool
        model = self.policy.classes[t.cls].fallback.model
        return self.clusters.get(model, t.pool) if model else t.pool

    def _move_place(self, w: Waiter) -> None:
        """A queued waiter waits for its pool's gate now (a pool that lost its limit: for its class alone)."""
        gate, old, cls = self.gates.get(w.pool), w.gate, w.limiter.name
        if old is gate:
            return
        if old is not None:
            old.waiting[old.class_names.index(cls)] -= 1
        w.units = self._units(gate, old, w.units, w.charge) if gate is not None else 0.0
        w.gate = gate
        if gate is not None:
            gate.waiting[w.limiter.rank] += 1

    def _moved(self, old: PoolGate, cls: str, units: float, charge) -> tuple[PoolGate | None, int | None, float]:
        """(gate, rank, units) of a hold on `old` once the reload replaced it (None: the pool has no limit now)."""
        gate = self.gates.get(old.name)
        if gate is None:
            return None, None, 0.0
        return gate, gate.rank_of(cls), self._units(gate, old, units, charge)

    @staticmethod
    def _units(gate: PoolGate, old: PoolGate | None, units: float, charge) -> float:
        """What a request weighs on `gate`, given what it weighed on `old` (the same, unless the unit changed)."""
        if old is not None and old.tokens == gate.tokens:
            return units
        est = charge.estimate if charge is not None else None
        return gate.units(est.prompt_tokens, est.max_tokens, est.sequences) if est is not None else \
            gate.units(0, 0)

    def _limiter(self, lim: ClassLimiter | None, name: str, spec: ClassSpec) -> ClassLimiter:
        if lim is None:
            lim = ClassLimiter(name, spec)
        elif not lim.reconfigure(spec):
            return lim  # its limit algorithm carries over
        previous, lim.controller = lim.controller, self.limit_factory(spec)
        if isinstance(lim.controller, AdaptiveLimit) and isinstance(previous, AdaptiveLimit):
            lim.controller.carry_from(previous)  # retuned: turned on, it starts from max_concurrency
        lim.limit = int(lim.controller.limit)
        return lim

    def wants_listings(self, cluster: str) -> bool:
        """Whether this cluster's replicas' /v1/models are to be read: it is scraped, and a model routed to it
        needs them (reads_listings; names_from_replicas is refused by the schema on a pool that is not scraped)."""
        pool = self.policy.pools.get(cluster)
        return pool is not None and pool.scraped and reads_listings(self.policy, cluster)

    def set_listings(self, cluster: str, listings: list) -> dict[str, str]:
        """A pool's replicas' /v1/models `data` (one list per replica); returns the names now taken from them."""
        self.listings[cluster] = listings
        self._merge_served()
        self._learn_contexts(cluster, listings)
        self._hand_contexts()
        self._catalog = None
        return {name: model for name, model in self.served_names.items()
                if self.policy.models[model].cluster == cluster}

    def catalog(self) -> dict[str, dict]:
        """Every name the edge admits -> its /v1/models card's fields (served.catalog); the same dict until the
        policy or a pool's listings change."""
        if self._catalog is None:
            contexts = {name: m.context_tokens for name, m in self.cost_models.items()}
            self._catalog = served.catalog(self.policy.models, self.listings, self.served_names, contexts)
        return self._catalog

    def _learn_contexts(self, cluster: str, listings: list) -> None:
        """The context lengths a pool's listings give its models that have no max_context_tokens. A model they
        give none for (its replicas silent or refusing) keeps the one learned before: max_model_len is fixed for
        a replica's life, and a bounded estimate is worth more than one gone unbounded on a failed read."""
        unset = {name for name, m in self.policy.models.items()
                 if m.cluster == cluster and not m.cost.max_context_tokens}
        if not unset:
            return
        names = {name: model for names in (self.model_names, self.served_names)
                 for name, model in names.items() if model in unset}
        for model, tokens in served.context_lengths(listings, names).items():
            self.contexts[(cluster, model)] = tokens

    def _relearn_contexts(self) -> None:
        """After a reload: keep what was learned for a model still on the same read pool with no context of its
        own (as the listings are kept), learn from the kept listings for any model the reload put there or gave
        new names, and hand every cost model (some rebuilt) its context."""
        models = self.policy.models
        self.contexts = {(cluster, name): tokens for (cluster, name), tokens in self.contexts.items()
                         if name in models and models[name].cluster == cluster
                         and not models[name].cost.max_context_tokens and cluster in self.listings}
        for cluster, listings in self.listings.items():
            self._learn_contexts(cluster, listings)
        self._hand_contexts()

    def _hand_contexts(self) -> None:
        for name, m in self.policy.models.items():
            self.cost_models[name].learn_context(self.contexts.get((m.cluster, name)))

    def _merge_served(self) -> None:
        by_pool = {}
        for cluster, listings in self.listings.items():
            known = {alias: name for alias, name in self.model_names.items()
                     if self.policy.models[name].names_from_replicas and self.policy.models[name].cluster == cluster}
            by_pool[cluster] = served.pool_names(listings, known) if known else {}
        fresh = served.merge(by_pool, self.model_names)
        if fresh != self.served_names:
            self.served_names.clear()
            self.served_names.update(fresh)

    def current(self, lim: ClassLimiter) -> bool:
        """Whether `lim` is its class's limiter in the running policy: not one a reload retired, nor the class's
        degraded slots (which carry its name)."""
        return self.limiters.get(lim.name) is lim

    def _same_cost(self, model: str, spec) -> bool:
        return model in self.cost_models and self.cost_models[model].spec == spec

    def _edited_tenant(self, spec, now: float) -> TenantLimits:
        """A tenant's limits under a new spec, carried over. The same object, given the new buckets: the charges of
        requests in flight or queued hold it, and settle (refund, correct) against the buckets in use."""
        old = self.tenant_limits.get(spec.name)
        new = TenantLimits(spec, now).carried_from(old, now)
        if old is None:
            return new
        old.spec, old.requests, old.tokens = new.spec, new.requests, new.tokens
        return old

    def _same_tenant(self, spec) -> bool:
        return spec.name in self.tenant_limits and self.tenant_limits[spec.name].spec == spec

    def _breaker_specs(self, cls: str) -> list:
        spec = self.policy.classes[cls]
        specs: list = []
        if spec.slo_p95_ms and spec.latency_breaker.enabled:
            specs.append((spec.slo_p95_ms, spec.latency_breaker))
        if spec.error_breaker.enabled:
            specs.append(spec.error_breaker)
        return specs

    def _rebuilt(self, cls: str, pool: str, bs: list[Breaker]) -> list[Breaker]:
        """A class's breakers on a pool under a reloaded policy: the same ones while their specs are unchanged,
        else new ones, each open (or half-open) as the old one of its kind was. A reload that tunes a breaker
        mid-incident (a longer cooldown_s) closed it, and sent the class's traffic back to the pool it kept it off."""
        specs = self._breaker_specs(cls)
        if specs == [b.spec for b in bs]:
            return bs
        old = {b.kind: b for b in bs}
        new = [self._breaker(cls, pool, spec) for spec in specs]
        now = self.clock()
        for b in new:
            b.take_state(old.get(b.kind), now)
            self.on_breaker_created(cls, pool, b)
        return new

    def pool_breakers(self, cls: str, pool: str) -> list[Breaker]:
        """The breakers of one class on one pool, created on first use; none for a class or pool a reload removed
        (the outcome of a request still running there must not build them again)."""
        bs = self.breakers.get((cls, pool))
        if bs is None:
            if cls not in self.policy.classes or pool not in self.routed:
                return []
            bs = [self._breaker(cls, pool, spec) for spec in self._breaker_specs(cls)]
            self.breakers[(cls, pool)] = bs
            for b in bs:
                self.on_breaker_created(cls, pool, b)
        return bs

    def _breaker(self, cls: str, pool: str, spec) -> Breaker:
        if isinstance(spec, tuple):
            slo_ms, lb = spec
            b: Breaker = LatencyBreaker(slo_ms / 1000.0, lb.window_s, lb.min_samples, 0.95, lb.cooldown_s,
                                        lb.trickle, lb.trickle_s)
        else:
            b = ErrorBreaker(spec.max_error_ratio, spec.window_s, spec.min_requests, spec.cooldown_s,
                             spec.trickle, spec.trickle_s)
        b.spec = spec
        b.on_change = lambda br, state: self.on_breaker_change(cls, pool, br, state)
        return b

    def saturated_protector(self, cls: str, pool: str) -> ClassLimiter | None:
        """A class that sheds `cls` and is saturated now, if any, for a request of `cls` to `pool`. A refusal there
        must free something the protector uses: not on a pool with a pool-wide limit, whose strict priority already
        makes `cls` yield to it, where a protector held at its own class cap gains nothing from the refusal (an
        audit: interactive got 503 on a pool at 80% of its limit while the first class sat at its cap of 18); nor
        on a pool the protector has never been sent to (an audit: batch on a calm 70B pool got 503 while
        interactive was saturated on the 8B)."""
        if pool in self.gates:
            return None
        for protector in self.shed_by.get(cls, ()):
            if protector.saturated and (pool in protector.pools or not protector.pools):
                return protector
        return None
