"""A model-based test of the whole admission core: random arrivals, completions (ok, upstream error, client abort),
clients leaving the queue, time passing (tick), lease expiry (reap), withdrawals (413 after admission), a shared
store's confirm / wait / revoke and reloads between a few small policies, against a reference model of what is live
(tickets running, waiters queued, admissions waiting for the store).

Checked after every step: a class that admitted holds no more than its cap (requests, and GPU-seconds where it has a
budget; a reload that lowers a cap does not evict what runs, docs/reliability.md); every limiter's counts, the fair
queues' per-flow counts and snapshot() match the model; no waiter is granted past its deadline, nor left pending
past it (the adapter's timer, emulated, fires at it; late when the event loop was held up); every ticket closes
exactly once whatever ends it, is accounted at most once (never when it did not run), and every decision is counted
once; each tenant's buckets and each session's budgets hold exactly what the live, queued and finished requests were
charged. At the end everything is drained and every gauge must read zero.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from extproc.policy.admission import ACCEPT, DEGRADE, QUEUE, AdmissionController, RequestFacts
from extproc.policy.decision import NoEvents
from extproc.policy.limits import Completion, Outcome
from extproc.policy.ratelimit import TenantLimits
from extproc.policy.reasons import (R_CLASS_REMOVED, R_CLIENT_GONE, R_DEQUEUED, R_QUEUE_FULL, R_QUEUE_TIMEOUT,
                                    R_STORE_UNAVAILABLE)
from extproc.policy.schema import load_policy
from tests.conftest import FakeClock

MODELS = {"llama": {"cluster": "pool_a"},
          "small": {"cluster": "pool_b", "cost": {"max_context_tokens": 2048}}}
TENANTS = [{"name": "a", "api_keys": ["sk-a"]}, {"name": "b", "api_keys": ["sk-b"], "max_class": "lo"}]
DEGRADE_SMALL = {"action": "degrade", "model": "small", "max_tokens": 16, "max_concurrency": 1}
CANNED = {"action": "canned", "status": 200}
FEW_ERRORS = {"min_requests": 3, "window_s": 10, "cooldown_s": 1, "trickle_s": 2}


def doc(classes: dict, tenants=TENANTS, **rest) -> dict:
    return {"classes": classes, "default_class": next(iter(classes)), "tenants": tenants,
            "anonymous": {"max_class": next(iter(classes))}, "models": MODELS, **rest}


POLICIES = [
    # base: the first class adapts its cap to its SLO and degrades its overflow to the small model, the second has
    # a GPU-seconds budget
    doc({"hi": {"max_concurrency": 2, "max_queue": 2, "max_wait_ms": 300, "on_overflow": "fallback",
                "fallback": DEGRADE_SMALL, "error_breaker": FEW_ERRORS, "slo_p95_ms": 1000,
                "latency_breaker": {"min_samples": 3, "window_s": 5, "cooldown_s": 1, "trickle_s": 2},
                "adaptive": {"enabled": True, "min_limit": 1, "max_limit": 4, "interval_s": 0.1, "window_s": 2,
                             "min_samples": 2}},
         "lo": {"max_concurrency": 2, "max_queue": 3, "max_wait_ms": 1500, "max_inflight_gpu_seconds": 2.0,
                "on_overflow": "fallback", "fallback": CANNED}},
        sessions={"max_inflight_gpu_seconds": 1.5, "gpu_seconds_per_minute": 30, "max_sessions": 2}, shed={}),
    # tight: lower caps and budget, a class added between, no shedding of it
    doc({"hi": {"max_concurrency": 1, "max_queue": 1, "max_wait_ms": 200, "on_overflow": "fallback",
                "fallback": {**DEGRADE_SMALL, "max_concurrency": 2}},
         "mid": {"max_concurrency": 1, "max_queue": 2, "max_wait_ms": 500},
         "lo": {"max_concurrency": 1, "max_queue": 1, "max_wait_ms": 800, "max_inflight_gpu_seconds": 1.0}},
        shed={"hi": ["lo"]}),
    # fair: raised caps, fair and round-robin queues, tenant weights and a guaranteed share
    doc({"hi": {"max_concurrency": 3, "max_queue": 4, "max_wait_ms": 800, "fairness": {"mode": "fair", "key": "header"},
                "on_overflow": "fallback", "fallback": DEGRADE_SMALL},
         "lo": {"max_concurrency": 2, "max_queue": 4, "max_wait_ms": 1500, "max_inflight_gpu_seconds": 3.0,
                "fairness": {"mode": "round_robin"}}},
        tenants=[{"name": "a", "api_keys": ["sk-a"], "weight": 3, "guaranteed_share": 0.5, "requests_per_minute": 120,
                  "tokens_per_minute": 20000},
                 {"name": "b", "api_keys": ["sk-b"], "max_class": "lo"}],
        sessions={"max_inflight_gpu_seconds": 2.0, "max_sessions": 3}, classify={"fairness_header": "x-flow"}),
    # rated: tenant b removed, rate limits on a and anonymous, the classes' order swapped
    doc({"lo": {"max_concurrency": 3, "max_queue": 2, "max_wait_ms": 600, "max_inflight_gpu_seconds": 2.5,
                "fairness": {"mode": "fair"}, "on_overflow": "fallback", "fallback": CANNED},
         "hi": {"max_concurrency": 1, "max_queue": 3, "max_wait_ms": 400, "on_overflow": "fallback",
                "fallback": DEGRADE_SMALL, "error_breaker": FEW_ERRORS}},
        tenants=[{"name": "a", "api_keys": ["sk-a"], "requests_per_minute": 30, "tokens_per_minute": 6000,
                  "burst_s": 10}],
        shed={}),
]
POLICIES[3]["anonymous"] = {"max_class": "hi", "requests_per_minute": 60, "burst_s": 5}
# closed: keys only (anonymous requests get 401, and b's queued requests too: b is gone), the middle class back
POLICIES.append(doc({"hi": {"max_concurrency": 2, "max_queue": 2, "max_wait_ms": 300},
                     "mid": {"max_concurrency": 2, "max_queue": 2, "max_wait_ms": 1000, "on_overflow": "fallback",
                             "fallback": CANNED},
                     "lo": {"max_concurrency": 1, "max_queue": 2, "max_wait_ms": 1000}},
                    tenants=TENANTS[:1], anonymous={"allow": False}))
# bare: model `small` gone (its degraded requests run on), no queue in the first class (overflow degrades on its own
# model), no early rejection, a canned 429
POLICIES.append(doc({"hi": {"max_concurrency": 2, "max_queue": 0, "max_wait_ms": 0, "on_overflow": "fallback",
                            "fallback": {"action": "degrade", "max_tokens": 8}},
                     "lo": {"max_concurrency": 1, "max_queue": 3, "max_wait_ms": 700, "early_reject": False,
                            "on_overflow": "fallback", "fallback": {"action": "canned", "status": 429}}},
                    models={"llama": {"cluster": "pool_a"}, "tiny": {"cluster": "pool_b"}}))
LOADED = [load_policy(p) for p in POLICIES]

KEYS = {"a": "sk-a", "b": "sk-b", "anonymous": None}
STATUS = {Outcome.OK: 200, Outcome.UPSTREAM_ERROR: 503, Outcome.CLIENT_ABORT: 499}


TENANT_LIMITS = {name: TenantLimits.__dict__[name] for name in ("charge", "refund", "correct")}


class Ledger:
    """What each tenant's buckets were charged and given back, per TenantLimits object (its requests, its tokens):
    TenantLimits' own methods, wrapped while a run lasts."""

    def __init__(self) -> None:
        self.net: dict[int, list[int]] = {}
        ledger, saved = self, TENANT_LIMITS

        def charge(limits, tokens, now):
            taken = saved["charge"](limits, tokens, now)
            ledger._add(limits, 1, taken)
            return taken

        def refund(limits, tokens):
            saved["refund"](limits, tokens)
            ledger._add(limits, -1, -tokens)

        def correct(limits, charged, actual):
            saved["correct"](limits, charged, actual)
            ledger._add(limits, 0, actual - charged)

        TenantLimits.charge, TenantLimits.refund, TenantLimits.correct = charge, refund, correct

    def _add(self, limits, requests: int, tokens: int) -> None:
        entry = self.net.setdefault(id(limits), [0, 0])
        entry[0] += requests
        entry[1] += tokens

    @staticmethod
    def close() -> None:
        for name, f in TENANT_LIMITS.items():
            setattr(TenantLimits, name, f)


class Counted(NoEvents):
    """What the core counts: each decision (metrics, the decision log), each queue entry, each completion."""

    def __init__(self) -> None:
        self.decisions: dict[int, int] = {}
        self.entries: dict[int, int] = {}
        self.completions: dict[int, int] = {}

    def decided(self, d) -> None:
        self.decisions[id(d)] = self.decisions.get(id(d), 0) + 1

    def queued(self, waiter) -> None:
        self.entries[id(waiter)] = self.entries.get(id(waiter), 0) + 1

    def finished(self, ticket, outcome, latency_s) -> None:
        self.completions[ticket.id] = self.completions.get(ticket.id, 0) + 1


class AdmissionModel(RuleBasedStateMachine):
    """The core driven as the adapter drives it, with a fake clock."""

    @initialize(start=st.sampled_from(range(len(LOADED))), shared=st.booleans())
    def start(self, start: int, shared: bool) -> None:
        self.clock = FakeClock()
        self.events = Counted()
        self.core = AdmissionController(LOADED[start], clock=self.clock, events=self.events)
        self.core.gate_on_store(shared)  # a shared store confirms (or revokes) each admission
        self.gated: dict[int, object] = {}  # ticket id -> its admission, waiting for the store's answer
        self.late = False                   # the event loop was held up: the waiters' timers fire late
        self.answers: list = []             # every final decision (kept alive: the counts are by id)
        self.queued: list = []              # every waiter
        self.withdrawn: list = []           # tickets whose request never ran
        self.live: dict[int, object] = {}   # ticket id -> Ticket: admitted, not yet ended
        self.waiting: list = []             # Waiters not yet answered
        self.ended: list = []               # tickets that ended (each must stay closed, once)
        self.admitted_now: list = []        # tickets admitted in the current step
        self.ran: list = []                 # ended tickets whose request ran (charged for good)
        self.ledger = Ledger()

    # --- what the model learns from the core's answers ---

    def _take(self, d) -> None:
        """A decision made now: a ticket to track, a waiter to track, or an answer that holds nothing."""
        gated = self.core.gated(d)
        if d.kind == QUEUE:
            self.queued.append(d.waiter)
        elif not gated:  # a gated admission is counted when the store answers
            self.answers.append(d)
        if d.ticket is not None:
            assert d.kind in (ACCEPT, DEGRADE) and not d.ticket.closed
            assert d.ticket.id not in self.live
            self.live[d.ticket.id] = d.ticket
            self.admitted_now.append(d.ticket)
            if gated:
                self.gated[d.ticket.id] = d
        elif d.kind == QUEUE:
            assert d.waiter.pending
            self.waiting.append(d.waiter)

    def _sweep(self) -> None:
        """Waiters answered since the last look: granted ones run now; answered no later than their deadline."""
        now = self.clock()
        for w in [w for w in self.waiting if not w.pending]:
            self.waiting.remove(w)
            if w.result.reason == R_DEQUEUED:  # granted its slot: never past its deadline
                assert now <= w.deadline + 1e-9, (w.result, now, w.deadline)
            elif not self.late:
                assert now <= w.deadline + self.core.tick_s + 1e-9, (w.result, now, w.deadline)
            assert w.result.kind != QUEUE
            self._take(w.result)

    def _running(self) -> list[int]:
        """The tickets whose request runs (not waiting for the store)."""
        return sorted(set(self.live) - set(self.gated))

    def _end(self, ticket, ran: bool = True) -> None:
        del self.live[ticket.id]
        if ran:
            self.ran.append(ticket)
        self.ended.append(ticket)
        assert ticket.closed

    def _step_begins(self) -> None:
        self.admitted_now = []

    # --- rules ---

    @rule(tenant=st.sampled_from(sorted(KEYS)), claim=st.sampled_from([None, "hi", "mid", "lo", "gold"]),
          model=st.sampled_from(["llama", "llama", "small"]), prompt=st.sampled_from([40, 400, 4000, 12000]),
          max_tokens=st.sampled_from([None, 8, 64, 512, 1024]), deadline_ms=st.sampled_from([None, None, 100, 1000]),
          session=st.sampled_from([None, None, "s1", "s2", "s3"]), flow=st.sampled_from([None, "f1", "f2"]))
    def arrive(self, tenant, claim, model, prompt, max_tokens, deadline_ms, session, flow) -> None:
        self._step_begins()
        facts = RequestFacts(api_key=KEYS[tenant], header_class=claim, model=model, max_tokens=max_tokens,
                             doc={"prompt": "x" * prompt}, deadline_ms=deadline_ms, session_id=session,
                             fairness_id=flow)
        d = self.core.authenticate(facts) or self.core.decide(facts)
        self._take(d)
        self._sweep()

    @rule(data=st.data(), outcome=st.sampled_from([Outcome.OK, Outcome.UPSTREAM_ERROR, Outcome.CLIENT_ABORT]),
          report=st.sampled_from(["before", "after", "never"]), took=st.sampled_from([0.05, 0.5, 3.0]))
    def complete(self, data, outcome, report, took) -> None:
        if not self._running():
            return
        self._step_begins()
        t = self.live[data.draw(st.sampled_from(self._running()))]
        done = Completion(outcome, STATUS[outcome], None, took)
        if report == "before":
            assert self.core.report(t.id, done)
        assert self.core.finish(t, outcome) is True
        self._end(t)
        if report == "after":
            assert self.core.report(t.id, done)
        assert self.core.finish(t, Outcome.OK) is False  # exactly once
        self._sweep()

    @rule(data=st.data())
    def withdraw(self, data) -> None:
        """The adapter refused the admitted request after the decision (its body over the limit: 413)."""
        if not self._running():
            return
        self._step_begins()
        t = self.live[data.draw(st.sampled_from(self._running()))]
        assert self.core.withdraw(t) is True
        self._end(t, ran=False)
        self.withdrawn.append(t)
        assert self.core.withdraw(t) is False and self.core.finish(t, Outcome.OK) is False
        self._sweep()

    @rule(data=st.data())
    def client_leaves_queue(self, data) -> None:
        if not self.waiting:
            return
        self._step_begins()
        w = data.draw(st.sampled_from(self.waiting))
        d = self.core.abandon(w, timed_out=False)
        assert d is not None and d.ticket is None and d.status == 499
        assert self.core.abandon(w, timed_out=False) is None
        self._sweep()

    @rule(dt=st.sampled_from([0.01, 0.1, 0.25, 0.6, 2.0]))
    def time_passes(self, dt) -> None:
        """The clock moves; each waiter's own timer fires at its deadline (the adapter's), then tick() runs."""
        self._step_begins()
        until = self.clock() + dt
        while True:
            due = sorted((w for w in self.waiting if w.pending and w.deadline <= until), key=lambda w: w.deadline)
            if not due:
                break
            w = due[0]
            self.clock.t = max(self.clock.t, w.deadline)
            self.core.abandon(w, timed_out=True)
            self._sweep()
        self.clock.t = until
        self.core.tick()
        self._sweep()

    @rule(data=st.data(), dt=st.sampled_from([0.3, 1.0]), then=st.sampled_from(["tick", "reap", "finish"]))
    def loop_held_up(self, data, dt, then) -> None:
        """The event loop is held up for `dt`: the first thing it runs may be the tick, the reaper or a request's
        end, and only then the waiters' timers (late)."""
        self._step_begins()
        self.late = True
        self.clock.advance(dt)
        if then == "tick":
            self.core.tick()
        elif then == "reap":
            self.core.reap()
        elif self._running():
            t = self.live[data.draw(st.sampled_from(self._running()))]
            assert self.core.finish(t, Outcome.OK)
            self._end(t)
        self._sweep()
        for w in sorted(self.waiting, key=lambda w: w.deadline):
            if w.pending and w.deadline <= self.clock():
                self.core.abandon(w, timed_out=True)
            self._sweep()
        self.late = False

    @rule(data=st.data())
    def lease_expires(self, data) -> None:
        """A request never seen to end: its lease runs out and reap() frees it (once)."""
        if not self.live:
            return
        self._step_begins()
        t = self.live[data.draw(st.sampled_from(list(sorted(self.live))))]
        if t.id in self.gated and not t.awaiting_store:
            return  # between the decision and the store's first answer: one round trip, never a lease
        t.lease_until = self.clock()
        expired = self.core.reap()
        assert expired == [t]
        self._end(t, ran=t.id not in self.gated)  # one that waited for the store never ran
        assert self.core.finish(t, Outcome.OK) is False
        assert self.core.report(t.id, Completion(Outcome.OK, 200, None, 1.0)) is False
        self._sweep()

    @rule()
    def reap(self) -> None:
        self._step_begins()
        assert self.core.reap() == []
        self._sweep()

    @rule(data=st.data())
    def store_waits(self, data) -> None:
        """The store has no global slot now: the admission waits for one (counted as queued)."""
        if not self.gated:
            return
        self._step_begins()
        d = self.gated[data.draw(st.sampled_from(sorted(self.gated)))]
        if not d.ticket.queued and not d.ticket.closed:
            self.queued.append(d.ticket)  # a queue entry, unless it waited in its class queue before
        self.core.await_store(d)
        self._sweep()

    @rule(data=st.data(), waited=st.sampled_from([0.0, 0.05]))
    def store_grants(self, data, waited) -> None:
        if not self.gated:
            return
        self._step_begins()
        tid = data.draw(st.sampled_from(sorted(self.gated)))
        d = self.gated.pop(tid)
        reaped = d.ticket.closed
        out = self.core.confirm(d, waited)
        if reaped:  # its lease ran out while it waited: refused, never run
            assert out is not d and out.ticket is None and tid not in self.live
        else:
            assert out is d and not d.ticket.awaiting_store
        self.answers.append(out)
        self._sweep()

    @rule(data=st.data(), reason=st.sampled_from([R_QUEUE_FULL, R_QUEUE_TIMEOUT, R_CLIENT_GONE, R_STORE_UNAVAILABLE,
                                                  R_CLASS_REMOVED]))
    def store_refuses(self, data, reason) -> None:
        """No global slot within the wait, the store down, the client gone, or the class removed meanwhile."""
        if not self.gated:
            return
        self._step_begins()
        tid = data.draw(st.sampled_from(sorted(self.gated)))
        d = self.gated.pop(tid)
        t = d.ticket
        out = self.core.revoke(d, reason, "refused")
        assert t.closed and not t.awaiting_store
        if tid in self.live:
            self._end(t, ran=False)
            self.withdrawn.append(t)
        if out.ticket is not None:  # a timed-out wait's fallback: a degraded admission, never gated
            assert not self.core.gated(out)
            self._take(out)
        else:
            self.answers.append(out)
        self._sweep()

    @rule(which=st.sampled_from(range(len(LOADED))))
    def reload(self, which) -> None:
        self._step_begins()
        self.core.apply(LOADED[which])
        self._sweep()

    # --- the promises ---

    def _limiters(self) -> list:
        core = self.core
        seen: dict[int, object] = {}
        for lim in [*core.limiters.values(), *core.degraded.values(), *core._retired]:
            seen[id(lim)] = lim
        for t in self.live.values():
            seen.setdefault(id(t.limiter), t.limiter)
        for w in self.waiting:
            seen.setdefault(id(w.limiter), w.limiter)
        return list(seen.values())

    @invariant()
    def counts_match_the_model(self) -> None:
        if not hasattr(self, "core"):
            return
        core = self.core
        assert set(core.tickets) == set(self.live), "the core's open tickets are the model's"
        assert all(not t.closed for t in self.live.values()) and all(t.closed for t in self.ended)
        assert all(w.pending for w in self.waiting)
        known = {id(lim) for lim in [*core.limiters.values(), *core.degraded.values(), *core._retired]}
        for lim in self._limiters():
            mine = [t for t in self.live.values() if t.limiter is lim]
            queued = [w for w in self.waiting if w.limiter is lim]
            if mine:
                assert id(lim) in known, f"{lim.name}: tickets held under a limiter the core forgot"
            assert lim.inflight == len(mine), (lim.name, lim.inflight, len(mine))
            assert math.isclose(lim.inflight_cost, sum(t.cost for t in mine), abs_tol=1e-9)
            assert len(lim.queue) == len(queued) and set(map(id, lim.queue)) == set(map(id, queued))
            assert lim.reserved == sum(t.awaiting_store for t in mine), (lim.name, lim.reserved)
            q = lim.queue
            for label, got in q.stats.items():  # per metric label: what runs and waits under it
                assert got.inflight == sum(q.label(t.flow) == label for t in mine), (lim.name, label, "inflight")
                assert got.waiting == sum(q.label(w.flow) == label for w in queued), (lim.name, label, "waiting")
                assert got.served_gpu_s >= -1e-9, (lim.name, label, got.served_gpu_s)
            assert sum(s.inflight for s in q.stats.values()) == len(mine)
            assert sum(s.waiting for s in q.stats.values()) == len(queued)
            assert sum(f.inflight for f in q._flows.values()) == len(mine), (lim.name, "flows in flight")
        snap = core.snapshot()
        running = [t for t in self.live.values() if not t.awaiting_store]
        assert sum(c["inflight"] for c in snap.values()) == sum(not t.degraded for t in running)
        assert sum(c["degraded_inflight"] for c in snap.values()) == sum(t.degraded for t in self.live.values())
        assert sum(c["queue"] for c in snap.values()) == len(self.waiting) + len(self.live) - len(running)

    @invariant()
    def budgets_charged_once(self) -> None:
        """Each tenant's buckets hold one request (and its tokens) per request live, queued or that ran; each
        session's in-flight budget, its running requests; its queued count, its waiters."""
        if not hasattr(self, "core"):
            return
        # Requests exactly; tokens between what the live and queued ones hold and that plus what the ended ones
        # were charged (accounting may correct an ended request's tokens down to 0: a failed one costs nothing).
        held = [t.charge for t in self.live.values()] + [w.charge for w in self.waiting]
        expected: dict[int, list[int]] = {}
        for ch, ran in [(ch, False) for ch in held] + [(t.charge, True) for t in self.ran]:
            if ch is not None and ch.tenant is not None:
                entry = expected.setdefault(id(ch.tenant), [0, 0, 0])
                entry[0] += 1
                entry[2 if ran else 1] += ch.tokens
        for key in set(expected) | set(self.ledger.net):
            requests, tokens = self.ledger.net.get(key, [0, 0])
            want, least, ended = expected.get(key, [0, 0, 0])
            assert requests == want, ("requests charged", requests, want)
            assert least <= tokens <= least + ended, ("tokens charged", tokens, least, ended)
        sessions = {}
        for ch in [t.charge for t in self.live.values()] + [w.charge for w in self.waiting]:
            if ch is not None and ch.session is not None:
                sessions[id(ch.session)] = ch.session
        for t in self.ran:
            if t.charge is not None and t.charge.session is not None:
                sessions.setdefault(id(t.charge.session), t.charge.session)
        for s in sessions.values():
            running = [t for t in self.live.values() if t.charge is not None and t.charge.session is s]
            queued = [w for w in self.waiting if w.charge is not None and w.charge.session is s]
            assert s.inflight == len(running), (s.inflight, len(running))
            assert math.isclose(s.inflight_gpu_s, sum(t.cost for t in running), abs_tol=1e-9)
            assert s.queued == len(queued), (s.queued, len(queued))

    @invariant()
    def counted_once(self) -> None:
        """Each request's final decision counted once (a queued one when it is answered), each waiter queued once,
        each ended request accounted at most once (once for good, at the drain) and a withdrawn one never."""
        if not hasattr(self, "core"):
            return
        ev = self.events
        assert ev.decisions == {id(d): 1 for d in self.answers}
        assert ev.entries == {id(w): 1 for w in self.queued}
        assert all(n == 1 for n in ev.completions.values())
        assert not set(ev.completions) - {t.id for t in self.ran}
        assert not {t.id for t in self.withdrawn} & set(ev.completions)

    @invariant()
    def caps_hold_when_admitting(self) -> None:
        if not hasattr(self, "core"):
            return
        for lim in {id(t.limiter): t.limiter for t in self.admitted_now}.values():
            assert lim.inflight <= lim.limit, (lim.name, lim.inflight, lim.limit)
            budget = lim.spec.max_inflight_gpu_seconds
            if budget is not None:
                assert lim.inflight_cost <= budget * (1 + 1e-9), (lim.name, lim.inflight_cost, budget)

    @invariant()
    def no_waiter_past_its_deadline(self) -> None:
        if not hasattr(self, "core"):
            return
        now = self.clock()
        for w in self.waiting:
            assert w.deadline + self.core.tick_s >= now, (w.deadline, now)

    def teardown(self) -> None:
        """Drain: every client leaves or finishes; then every gauge is back to zero and nothing waits."""
        if not hasattr(self, "core"):
            return
        try:
            self._drain()
        finally:
            self.ledger.close()

    def _drain(self) -> None:
        core = self.core
        for _ in range(100):
            for tid in sorted(self.gated):  # the store answers every admission waiting for it
                d = self.gated.pop(tid)
                self.answers.append(core.confirm(d))
            if not self.live and not self.waiting:
                break
            for w in list(self.waiting):
                if w.pending:
                    core.abandon(w, timed_out=False)
            self._sweep()
            for t in list(self.live.values()):
                assert core.finish(t, Outcome.OK)
                self._end(t)
            self._sweep()
        assert not self.live and not self.waiting
        self.budgets_charged_once()
        self.clock.advance(10.0)
        assert core.reap() == []
        self.counted_once()
        assert set(self.events.completions) == {t.id for t in self.ran}
        assert not core.tickets and not core._unreported and not core._retired
        for lim in self._limiters():
            assert (lim.inflight, lim.inflight_cost, len(lim.queue), lim.reserved) == (0, 0.0, 0, 0), lim.name
            q = lim.queue
            assert all(s.inflight == 0 and s.waiting == 0 for s in q.stats.values()), lim.name
            assert not q._where and not q._backlogged and not q._turns and not q._nested, lim.name
            assert all(not f.entries and f.inflight == 0 for f in q._flows.values()), lim.name
        for name, c in core.snapshot().items():
            assert (c["inflight"], c["queue"], c["inflight_cost"], c["degraded_inflight"]) == (0, 0, 0.0, 0), name


AdmissionModel.TestCase.settings = settings(max_examples=200, stateful_step_count=80, deadline=None,
                                            derandomize=True,
                                            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestAdmissionModel = AdmissionModel.TestCase
