"""A model-based test of the pool-wide limit (extproc/policy/pool.py) driven through AdmissionController: requests of
three classes of widely varying sizes arrive on a limited pool, complete, leave their queues, time runs and the
limit moves on saturation readings and latency, degrades go to a fallback pool (with or without a limit of its
own), and reloads swap the policy. After every step the gates must agree with what the model knows is live, and
the promises of docs/overload.md must hold: the limit within its bounds, strict priority (guarantees apart), every
waiter answered by its deadline, no rest past MAX_REST_S, nothing lost or counted twice by a reload, and a drained
pool holding exactly nothing."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from extproc.policy.adaptive import PoolSaturation
from extproc.policy.admission import ACCEPT, DEGRADE, QUEUE, AdmissionController, RequestFacts
from extproc.policy.limits import Completion, Outcome
from extproc.policy.pool import MAX_REST_S, OWED_BOUND, PROVEN_FLOOR
from tests.conftest import FakeClock, make_policy

CLASSES = ("interactive", "batch", "internal")
FB_MAX_TOKENS = 16
COOLDOWN_S = 5.0

# Two tenants (flows of a fair class) besides anonymous requests.
TENANTS = [{"name": n, "api_keys": [f"sk-{n}"], "max_class": "interactive", "default_class": "interactive"}
           for n in ("a", "b")]


def policy(unit="tokens", order=CLASSES, batch_share=0.05, borrow=False, limited=True, fallback_limit=None,
           same_pool=False, fairness="fifo", cap=20):
    """A policy with a limit on pool_a (llama); interactive degrades to pool_b (small), or to its own pool."""
    size = 4000.0 if unit == "tokens" else 4.0
    fallback = {"action": "degrade", "max_tokens": FB_MAX_TOKENS, **({} if same_pool else {"model": "small"})}
    spec = {"interactive": {"max_concurrency": cap, "max_queue": 3, "max_wait_ms": 200, "slo_p95_ms": 2000,
                            "on_overflow": "fallback", "fallback": fallback,
                            "latency_breaker": {"window_s": 10, "min_samples": 5, "cooldown_s": COOLDOWN_S}},
            "batch": {"max_concurrency": 20, "max_queue": 4, "max_wait_ms": 2000, "min_share": batch_share},
            "internal": {"max_concurrency": 20, "max_queue": 4, "max_wait_ms": 3000}}
    for name in ("interactive", "batch"):
        spec[name]["fairness"] = {"mode": fairness}
    knobs = {"interval_s": 0.5, "window_s": 5.0, "min_samples": 3}
    pools = {"pool_a": {"limit": {"enabled": limited, "unit": unit, "initial": size, "min": max(1.0, size / 40),
                                  "max": 2 * size, "borrow_lower": borrow, **knobs}}}
    if fallback_limit is not None:
        pools["pool_b"] = {"limit": {"enabled": True, "unit": fallback_limit, "min": 1,
                                     "initial": 1000.0 if fallback_limit == "tokens" else 2.0,
                                     "max": 2000.0 if fallback_limit == "tokens" else 4.0, **knobs}}
    return make_policy(classes={name: spec[name] for name in order}, shed={}, pools=pools, tenants=TENANTS)


# A reload's policy: each knob drawn on its own (the first policy is all defaults).
VARIANTS = st.fixed_dictionaries({
    "unit": st.sampled_from(["tokens", "requests"]),
    "order": st.sampled_from([CLASSES, ("interactive", "batch"), ("interactive", "internal"),
                              ("batch", "interactive", "internal")]),
    "batch_share": st.sampled_from([0.0, 0.05, 0.3]),
    "borrow": st.booleans(),
    "limited": st.sampled_from([True, True, True, False]),
    "fallback_limit": st.sampled_from([None, "tokens", "requests"]),
    "same_pool": st.booleans(),
    "fairness": st.sampled_from(["fifo", "fifo", "fair", "round_robin"]),
    "cap": st.sampled_from([20, 2]),
})

READINGS = ("roomy", "waiting", "fleeting", "kv_full", "stale", "unreadable", "stalled")


def reading(kind: str, now: float, holding: int) -> PoolSaturation:
    sat = PoolSaturation()
    sat.updated_at = now
    if kind == "roomy":
        sat.kv_usage = 0.2
    elif kind == "waiting":
        sat.saturated, sat.waiting = True, 3.0
    elif kind == "fleeting":  # one request caught between its arrival and the next engine step
        sat.saturated, sat.fleeting, sat.waiting = True, True, 1.0
    elif kind == "kv_full":
        sat.saturated, sat.kv_usage = True, 0.95
    elif kind == "stale":
        sat.saturated, sat.updated_at = True, now - 60.0  # nobody refreshed it: ignored (LimitMoves.pool_reading)
    elif kind == "unreadable":
        sat.saturated = True  # a replica whose metrics cannot be read counts as saturated (the scraper's rule)
    else:
        sat.stalled, sat.stalled_requests = 1, float(max(1, holding // 2))
    return sat


class PoolLimitModel(RuleBasedStateMachine):
    """The adapter around AdmissionController, and what it knows is live: the open tickets and pending waiters."""

    def __init__(self):
        super().__init__()
        self.clock = FakeClock()
        self.core = AdmissionController(policy(), clock=self.clock)
        self.live: dict[int, object] = {}       # ticket id -> open ticket
        self.waiters: list = []                 # pending waiters, arrival order
        self.gates_seen: list = []              # every gate ever installed (a replaced one must end empty)
        self.violations: list[str] = []         # broken promises seen inside the core's callbacks
        self._seen_gates()

    # --- the model's bookkeeping ---

    def _seen_gates(self):
        for gate in self.core.gates.values():
            if all(gate is not g for g in self.gates_seen):
                self.gates_seen.append(gate)

    def _priority_state(self, cls: str, pool: str = "pool_a"):
        """What strict priority needs to know before a request of `cls` may go in on `pool`."""
        gate = self.core.gates.get(pool)
        lim = self.core.limiters.get(cls)
        if gate is None or lim is None:
            return None
        higher = any(self.core._waits_for_pool(gate, r) for r in range(lim.rank))
        # A higher class's squeeze holds the class to its guarantee as a higher waiter does.
        higher = higher or gate._squeezed(lim.rank, self.clock())
        return gate, lim.rank, higher, gate.held[lim.rank], gate.count[lim.rank], gate.rest_until[lim.rank]

    def _check_priority(self, before, ticket, now, how):
        """A lower class admitted beyond its guarantee while a higher class waits for the pool breaks strict
        priority (docs/overload.md: 'A class is admitted beyond its guarantee only while no higher class waits')."""
        if before is None or ticket.gate is not before[0]:
            return
        gate, rank, higher, held, count, rest_until = before
        if not higher or rank == 0:
            return
        within = held + ticket.units <= gate.min_shares[rank] * gate.limit + 1e-9
        one_over = count == 0 and now >= rest_until
        if not (within or one_over):
            self.violations.append(f"{how}: rank {rank} admitted {ticket.units} over its guarantee (held {held}, "
                                   f"count {count}, share {gate.min_shares[rank]} x {gate.limit}) while a higher "
                                   f"class waits")

    def _check_overcommit(self, before, ticket, now):
        """docs/demo.md, the owner's return: 'the pool at most twice the limit'. Past it only a class's guarantee
        goes in (its share, or one request while it holds nothing)."""
        if before is None or ticket.gate is not before[0]:
            return
        gate, rank, _, held, count, rest_until = before
        if gate.inflight - gate.stuck <= OWED_BOUND * gate.limit + 1e-9 or gate.holding == 1:
            return
        if held + ticket.units <= gate.min_shares[rank] * gate.limit + 1e-9 or (count == 0 and now >= rest_until):
            return
        self.violations.append(f"arrival: rank {rank} took the pool to {gate.inflight - gate.stuck} over twice its "
                               f"limit {gate.limit}, beyond its guarantee")

    def _degraded_last(self, cls, d, pool="pool_a"):
        """docs/overload.md, "Degrade last": on a pool with a limit, the latency breaker degrades only when nothing
        is left to yield or cut."""
        gate = self.core.gates.get(pool)
        if gate is None or d.reason != "latency_breaker_open" or cls not in self.core.limiters:
            return
        rank = self.core.limiters[cls].rank
        if gate.can_cut() or gate.lower_hold_more_than_guaranteed(rank):
            self.violations.append(f"a {cls} request was sent to its fallback by the latency breaker with the limit "
                                   f"at {gate.limit} (min {gate.spec.min}) or lower classes to yield")

    def _absorb(self, d):
        if d is None:
            return
        if d.ticket is not None and d.kind in (ACCEPT, DEGRADE) and not d.ticket.closed:
            self.live[d.ticket.id] = d.ticket
        elif d.kind == QUEUE:
            w = d.waiter
            self.waiters.append(w)
            w.notify(lambda r, w=w: self._answered(w, r))

    def _answered(self, w, d):
        now = self.clock()
        if now > w.deadline + 1e-9 and d.kind == ACCEPT:
            self.violations.append(f"a waiter was granted {now - w.deadline:.3f} s after its deadline")
        if d.kind == ACCEPT and d.ticket is not None and d.ticket.gate is not None:
            t = d.ticket
            gate, rank = t.gate, t.rank
            if rank is not None:
                higher = any(self.core._waits_for_pool(gate, r) for r in range(rank)) or gate._squeezed(rank, now)
                before = (gate, rank, higher, gate.held[rank] - t.units, gate.count[rank] - 1, gate.rest_until[rank])
                self._check_priority(before, t, now, "grant")
        self._absorb(d)

    def _pending(self):
        self.waiters = [w for w in self.waiters if w.pending]
        return self.waiters

    # --- rules ---

    @rule(cls=st.sampled_from(CLASSES), prompt=st.sampled_from([0, 100, 400, 1500, 6000]),
          max_tokens=st.sampled_from([16, 100, 800]), sequences=st.sampled_from([1, 1, 2, 5]),
          tenant=st.sampled_from([None, "a", "b"]), model=st.sampled_from(["llama", "llama", "llama", "small"]))
    def arrive(self, cls, prompt, max_tokens, sequences, tenant, model):
        """A request of `cls`, most of them for the limited pool (llama), some for the fallback pool (small)."""
        if cls not in self.core.limiters:
            return
        doc = {"prompt": "x" * (4 * prompt)} if prompt else None
        key = f"sk-{tenant}" if tenant else None
        asked, cls = cls, self.core.classifier.classify(key, cls, None).cls  # a claim over max_class is demoted
        before = self._priority_state(cls, self.core.clusters[model])
        lim = self.core.limiters[cls]
        idle = before is not None and before[0].holding == 0 and not before[2] and not lim.queue and lim.has_room()
        d = self.core.decide(RequestFacts(header_class=asked, api_key=key, model=model, max_tokens=max_tokens,
                                          doc=doc, sequences=sequences))
        if d.kind == ACCEPT and d.ticket is not None:
            self._check_priority(before, d.ticket, self.clock(), "arrival")
            self._check_overcommit(before, d.ticket, self.clock())
        self._degraded_last(cls, d, self.core.clusters[model])
        if idle and d.kind == QUEUE:
            # configuration.md, pools.<name>.limit.min: "a pool always takes at least one request".
            self.violations.append(f"arrival: a {cls} request ({d.waiter.units} units) queued on an idle pool")
        if d.kind == QUEUE and len(d.waiter.limiter.queue) == 1 and self._admissible(d.waiter):
            self.violations.append(f"arrival: a {cls} request ({d.waiter.units} units) queued on an empty queue "
                                   f"though the pool admits it")
        self._absorb(d)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), service_s=st.sampled_from([0.05, 0.5, 1.5, 4.0, None]), outcome=st.sampled_from(
        [Outcome.OK, Outcome.OK, Outcome.UPSTREAM_ERROR, Outcome.CLIENT_ABORT]), withdraw=st.booleans())
    def complete(self, data, service_s, outcome, withdraw):
        """A request ends: with Envoy's report of its service time first, or without one (its time since
        admission counts), or withdrawn before it went upstream."""
        t = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        if withdraw:
            assert self.core.withdraw(t)
        else:
            if service_s is not None:
                self.core.report(t.id, Completion(outcome, 200, None, t.waited_s + service_s))
            assert self.core.finish(t, outcome)
        self._after_release()

    @rule(n=st.integers(3, 6), service_s=st.sampled_from([0.2, 1.0, 3.0, 5.0]))
    def interactive_wave(self, n, service_s):
        """Several short first-class requests served in `service_s` each: what moves the latency loop (a raise
        with room left, a cut over the target) and opens the latency breaker (a squeeze of the classes below)."""
        if "interactive" not in self.core.limiters:
            return
        served = []
        for _ in range(n):
            d = self.core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=16))
            self._degraded_last("interactive", d)
            self._absorb(d)
            if d.kind == ACCEPT:
                served.append(d.ticket)
        self.advance(0.01)
        for t in served:
            if self.live.pop(t.id, None) is not None:
                self.core.report(t.id, Completion(Outcome.OK, 200, None, t.waited_s + service_s))
                self.core.finish(t, Outcome.OK)
                self._after_release()

    @precondition(lambda self: self._pending())
    @rule(data=st.data())
    def leave(self, data):
        w = data.draw(st.sampled_from(self.waiters))
        d = self.core.abandon(w, timed_out=False)
        assert d is not None and not w.pending
        self._after_release()  # a client that left frees its place for the classes below at once

    @rule(dt=st.sampled_from([0.01, 0.1, 0.3, 1.0, 3.0, 10.0]))
    def advance(self, dt):
        """Time passes as the adapter sees it: each waiter's own timer fires at its deadline, tick() every tick_s,
        the housekeeping reap at the end."""
        end = self.clock() + dt
        while self.clock() < end:
            step_end = min(end, self.clock() + self.core.tick_s)
            for w in sorted(self._pending(), key=lambda w: w.deadline):
                if w.pending and w.deadline <= step_end:
                    self.clock.t = max(self.clock.t, w.deadline)
                    self._absorb(self.core.abandon(w, timed_out=True))
                    assert not w.pending
            self.clock.t = step_end
            before = {name: (gate.limit, gate.controller.proven, gate.inflight, gate.controller.moved_at)
                      for name, gate in self.core.gates.items()}
            self.core.tick()
            for name, gate in self.core.gates.items():
                self._moved(gate, *before[name])
            if any(gate.limit > before[name][0] for name, gate in self.core.gates.items()):
                self._after_release()  # a raised limit is granted at once, as a release is
        for t in self.core.reap():
            self.live.pop(t.id, None)

    @rule(kind=st.sampled_from(READINGS), pool=st.sampled_from(["pool_a", "pool_a", "pool_b"]))
    def saturation(self, kind, pool):
        gate = self.core.gates.get(pool)
        self.core.set_saturation(pool, reading(kind, self.clock(), gate.holding if gate else 0))

    @rule(knobs=VARIANTS)
    def reload(self, knobs):
        live_before = sorted(self.live)
        old = self.core.gates.get("pool_a")
        held_to = {cls: old.held_to_share(rank, self.clock()) for rank, cls in enumerate(old.class_names)} \
            if old is not None else {}
        self.core.apply(policy(**knobs))
        self._seen_gates()
        gate = self.core.gates.get("pool_a")
        if gate is not None and old is not None and gate.class_names == old.class_names:
            # "A reload keeps the rest", and a squeeze lasts one cooldown per opening of the breaker: both carry on.
            for rank, cls in enumerate(gate.class_names):
                assert gate.held_to_share(rank, self.clock()) == held_to[cls], (cls, held_to[cls])
        self._after_release()  # a reload grants what it makes room for
        # A reload answers only waiters of a removed class; nothing admitted is lost or closed by it.
        assert all(not self.live[i].closed for i in live_before)

    @rule()
    def drain(self):
        for w in list(self._pending()):
            self.core.abandon(w, timed_out=False)
        while self.live:
            _, t = self.live.popitem()
            self.core.finish(t, Outcome.OK)
        # Degrades of waiters answered while draining may have been admitted: end them too.
        while self.live:
            _, t = self.live.popitem()
            self.core.finish(t, Outcome.OK)
        for gate in self.gates_seen:
            assert gate.inflight == 0.0 and gate.holding == 0, (gate.name, gate.inflight, gate.holding)
            assert gate.held == [0.0] * len(gate.held) and gate.count == [0] * len(gate.count)
            assert gate.waiting == [0] * len(gate.waiting), (gate.name, gate.waiting)
            assert not any(gate.flows), gate.flows
        for lim in self.core.limiters.values():
            assert lim.inflight == 0 and not lim.queue
        self.gates_seen = []
        self._seen_gates()

    def _moved(self, gate, limit, proven, inflight, moved_at):
        """How the limit moved at this tick, against docs/overload.md ("How the limit moves")."""
        c, spec, new = gate.controller, gate.spec, gate.limit
        if c.moved_at != self.clock():
            assert new == limit, "the limit moved between its intervals"
            return
        assert moved_at is None or self.clock() - moved_at >= spec.interval_s - 1e-9
        if c.last_action == "raise":
            assert new <= limit * (1 + spec.max_raise) * (1 + 1e-9), (limit, new)
        elif c.last_action == "settle":
            assert new >= min(limit, max(spec.min, PROVEN_FLOOR * proven)) - 1e-9, (limit, new, proven)
        elif c.last_action == "cut_saturated":
            # "It is cut again only once what is in flight has drained under the limit."
            assert inflight - gate.stuck <= limit + 1e-9, (inflight, gate.stuck, limit)
            assert new >= spec.min - 1e-9
        elif c.last_action == "hold":
            assert new == limit

    # --- after a release: room freed goes to the waiters it can go to ---

    def _admissible(self, w) -> bool:
        """Whether the pool would admit this waiter now (class room, strict priority, its guarantee or room)."""
        gate, lim = w.gate, w.limiter
        if gate is None or not lim.has_room(w.cost):
            return False
        short = gate.short  # fits() notes a request held back: the check must not change what it checks
        try:
            return self.core._pool_admits(gate, lim, w.units, self.clock())
        finally:
            gate.short = short

    def _after_release(self):
        """A release grants the room it frees: no class's first waiter (FIFO inside a class) is left waiting that
        the pool admits now, and no later one within its guarantee."""
        now = self.clock()
        for lim in self.core.state.ranked:
            pending = [w for w in lim.queue if w.pending]
            if lim.queue and self._admissible(lim.queue[0]):
                self.violations.append(f"after a release, {lim.name}'s first waiter ({lim.queue[0].units} units) "
                                       f"still waits though the pool admits it")
            for w in pending:
                if not lim.has_room(w.cost):
                    break
                if w.gate is not None and w.gate.guaranteed(lim.rank, w.units, now):
                    self.violations.append(f"after a release, a {lim.name} waiter ({w.units} units) still waits "
                                           f"within its guarantee")

    # --- invariants ---

    @invariant()
    def no_violation(self):
        assert not self.violations, self.violations

    @invariant()
    def limit_within_bounds(self):
        for gate in self.core.gates.values():
            spec = gate.spec
            assert spec.min - 1e-9 <= gate.limit <= spec.max + 1e-9, (gate.name, gate.limit, spec.min, spec.max)
            assert gate.limit == gate.controller.limit

    @invariant()
    def rests_are_bounded(self):
        now = self.clock()
        for gate in self.core.gates.values():
            for until in gate.rest_until:
                assert until <= now + MAX_REST_S + 1e-9
            for rank in range(len(gate.class_names)):
                assert gate.squeezed_until(rank) <= now + COOLDOWN_S + 1e-9  # one cooldown per opening

    @invariant()
    def waiters_answered_by_their_deadline(self):
        now = self.clock()
        for w in self._pending():
            assert w.deadline >= now - self.core.tick_s - 1e-9

    @invariant()
    def gates_hold_what_is_live(self):
        gates = self.core.gates
        for t in self.live.values():
            assert not t.closed
            assert t.gate is gates.get(t.pool), (t.pool, t.gate, gates.get(t.pool))
            if t.gate is not None:
                assert t.rank == t.gate.rank_of(t.cls)
                assert math.isclose(t.units, self._units(t), rel_tol=1e-9), (t.units, self._units(t))
        for gate in gates.values():
            mine = [t for t in self.live.values() if t.gate is gate]
            assert gate.holding == len(mine)
            assert math.isclose(gate.inflight, sum(t.units for t in mine), rel_tol=1e-9, abs_tol=1e-6)
            # Units taken in the stall going on (sent to the working replicas): never counted as the hung one's.
            steered = sum(t.units for t in mine if gate.stall and t.pool_stall == gate.stall)
            assert math.isclose(gate.steered, steered, rel_tol=1e-9, abs_tol=1e-6), (gate.steered, steered)
            for rank, cls in enumerate(gate.class_names):
                ours = [t for t in mine if t.cls == cls]
                assert gate.count[rank] == len(ours), (gate.name, cls, gate.count, len(ours))
                assert math.isclose(gate.held[rank], sum(t.units for t in ours), rel_tol=1e-9, abs_tol=1e-6)
                waiting = [w for w in self._pending() if w.gate is gate and w.limiter.name == cls]
                assert gate.waiting[rank] == len(waiting), (gate.name, cls, gate.waiting, len(waiting))
        for w in self._pending():
            assert w.gate is gates.get(w.pool)

    def _units(self, t) -> float:
        gate, est = t.gate, t.charge.estimate
        if not gate.tokens:
            return float(est.sequences)
        return float(est.prompt_tokens + est.max_tokens)  # a degrade's estimate is clamped to its max_tokens

    def teardown(self):
        if not self.violations:
            self.drain()


PoolLimitModel.TestCase.settings = settings(max_examples=120, stateful_step_count=60, deadline=None, database=None,
                                            derandomize=True, suppress_health_check=list(HealthCheck))
TestPoolLimitModel = PoolLimitModel.TestCase
