"""A model-based test of shadow mode: a core in shadow (the whole policy, or one class) run beside an enforce-mode twin
of the same policy, fed the same requests, ends, client departures, time and reloads (some switching a class between
shadow and enforce while its requests run and wait).

Shadow's promise (shadow.py, docs/configuration.md `mode`): every decision is made and counted as enforce would make
it, nothing is refused (every request of a class in shadow runs), and enforce-mode state stays exact for what enforce
would admit. Checked after every step: an arrival in a class in shadow is admitted at once; each class's in-flight
count and GPU-seconds, its degraded slots and its queue length, each tenant's buckets and each session's budgets
are the twin's; what shadow counts it would have decided (its own decisions plus extproc_shadow_decisions_total) is
what the twin decided, a request that ended while enforce would still have had it queued (`ended_while_queued`)
being the twin's client that left its queue; every ticket closes exactly once. At the end everything is drained and
every gauge of both reads zero.

The policies (one with fair queues on a pool-wide limit) have static caps and no breakers, and no usage is read:
those learn from how requests ran, and in shadow more requests run (and earlier) than under enforce, so a twin would
rightly part from it there.
"""

from __future__ import annotations

import copy
import math
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from extproc.policy.admission import ACCEPT, QUEUE, AdmissionController, RequestFacts
from extproc.policy.decision import NoEvents
from extproc.policy.limits import Outcome
from extproc.policy.reasons import R_CLIENT_GONE, R_ENDED_WHILE_QUEUED, R_SHADOW
from extproc.policy.schema import load_policy
from tests.conftest import FakeClock

MODELS = {"llama": {"cluster": "pool_a"}, "small": {"cluster": "pool_b"}}
TENANTS = [{"name": "a", "api_keys": ["sk-a"], "requests_per_minute": 60, "tokens_per_minute": 60000,
            "burst_s": 10},
           {"name": "b", "api_keys": ["sk-b"], "max_class": "lo"}]
# No max_tokens: a degrade in shadow runs (and is charged) as it asked, enforce's clamped (fallback.py), so a clamp
# would rightly part the twins' token buckets and GPU-seconds.
DEGRADE_SMALL = {"action": "degrade", "model": "small", "max_concurrency": 1}
KEYS = {"a": "sk-a", "b": "sk-b", "anonymous": None}


def doc(classes: dict, **rest) -> dict:
    for spec in classes.values():
        spec.update(latency_breaker={"enabled": False}, error_breaker={"enabled": False})
    return {"classes": classes, "default_class": next(iter(classes)), "tenants": TENANTS,
            "anonymous": {"max_class": next(iter(classes))}, "models": MODELS, **rest}


BASES = [
    doc({"hi": {"max_concurrency": 2, "max_queue": 2, "max_wait_ms": 300, "on_overflow": "fallback",
                "fallback": DEGRADE_SMALL},
         "lo": {"max_concurrency": 2, "max_queue": 3, "max_wait_ms": 1500, "max_inflight_gpu_seconds": 2.0,
                "on_overflow": "fallback", "fallback": {"action": "canned", "status": 200}}},
        sessions={"max_inflight_gpu_seconds": 1.5, "gpu_seconds_per_minute": 30, "max_sessions": 2},
        shed={"hi": ["lo"]}),
    doc({"hi": {"max_concurrency": 1, "max_queue": 1, "max_wait_ms": 200},
         "lo": {"max_concurrency": 1, "max_queue": 2, "max_wait_ms": 800, "fairness": {"mode": "round_robin"}}},
        shed={}),
    # fair queues on a pool-wide limit (static: min = max) that both classes share
    doc({"hi": {"max_concurrency": 3, "max_queue": 3, "max_wait_ms": 400, "fairness": {"mode": "fair", "key": "header"},
                "on_overflow": "fallback", "fallback": DEGRADE_SMALL},
         "lo": {"max_concurrency": 2, "max_queue": 3, "max_wait_ms": 1000, "fairness": {"mode": "round_robin"}}},
        shed={}, classify={"fairness_header": "x-flow"},
        pools={"pool_a": {"limit": {"enabled": True, "unit": "requests", "initial": 3, "min": 3, "max": 3}}}),
]


def variants(base: dict) -> list[tuple[dict, dict]]:
    """(the policy as run, its enforce twin): the whole policy in shadow, each class in shadow, none."""
    out = []
    for shadow in ("mode", "hi", "lo", None):
        run = copy.deepcopy(base)
        if shadow == "mode":
            run["mode"] = "shadow"
        elif shadow is not None:
            run["classes"][shadow]["shadow"] = True
        out.append((run, copy.deepcopy(base)))
    return out


PAIRS = [(load_policy(r), load_policy(e)) for base in BASES for r, e in variants(base)]


class Counted(NoEvents):
    """What each core says it decided: (kind, reason), shadow's would-be decisions included."""

    def __init__(self) -> None:
        self.would: Counter = Counter()
        self.completions: Counter = Counter()

    def decided(self, d) -> None:
        if d.reason != R_SHADOW:
            self.would[(d.kind, d.reason)] += 1

    def shadow(self, cls: str, would: str, reason: str) -> None:
        self.would[(would, reason)] += 1

    def finished(self, ticket, outcome, latency_s) -> None:
        self.completions[ticket.id] += 1


def live(d):
    """What stands for a decision's request now: the ticket it runs under, its pending waiter, or None."""
    while d is not None and d.kind == QUEUE:
        if d.waiter.pending:
            return d.waiter
        d = d.waiter.result
    if d is None or d.ticket is None or d.ticket.closed:
        return None
    return d.ticket


class ShadowModel(RuleBasedStateMachine):

    @initialize(start=st.sampled_from(range(len(PAIRS))))
    def start(self, start: int) -> None:
        self.clock = FakeClock()
        self.ev_s, self.ev_e = Counted(), Counted()
        run, twin = PAIRS[start]
        self.s = AdmissionController(run, clock=self.clock, events=self.ev_s)
        self.e = AdmissionController(twin, clock=self.clock, events=self.ev_e)
        self.requests: list[list] = []  # [shadow decision, twin decision], per request that got a slot or a place
        self.tickets: list = []         # every shadow ticket
        self.ended: set[int] = set()    # requests whose client is done

    def _open(self) -> list[int]:
        return [i for i, (s, e) in enumerate(self.requests) if i not in self.ended]

    def _track(self, d) -> None:
        seen = {id(t) for t in self.tickets}
        while d is not None:
            if d.ticket is not None and id(d.ticket) not in seen:
                self.tickets.append(d.ticket)
            d = d.waiter.result if d.kind == QUEUE else None

    @rule(tenant=st.sampled_from(sorted(KEYS)), claim=st.sampled_from([None, "hi", "lo"]),
          model=st.sampled_from(["llama", "llama", "small"]), prompt=st.sampled_from([40, 4000, 12000]),
          max_tokens=st.sampled_from([None, 64, 1024]), session=st.sampled_from([None, "s1", "s2", "s3"]),
          flow=st.sampled_from([None, "f1", "f2"]))
    def arrive(self, tenant, claim, model, prompt, max_tokens, session, flow) -> None:
        facts = RequestFacts(api_key=KEYS[tenant], header_class=claim, model=model, max_tokens=max_tokens,
                             doc={"prompt": "x" * prompt}, session_id=session, fairness_id=flow)
        lim = self.s.limiters[self.s.classifier.classify(facts.api_key, claim, None).cls]
        covered = self.s.shadow.covers(lim)
        ds, de = self.s.decide(facts), self.e.decide(facts)
        if covered:  # nothing refused, queued or degraded: it runs now, on its own pool
            assert ds.kind == ACCEPT and ds.ticket is not None and not ds.ticket.degraded, ds
        self.requests.append([ds, de])
        if live(ds) is None:  # refused for real (an enforce class): nothing of it is open
            assert not covered
            self.ended.add(len(self.requests) - 1)
        self._track_all()  # a fair queue's full place may have gone to it: a waiter before it was answered
        for j in self._open():
            if live(self.requests[j][0]) is None:
                self.ended.add(j)

    @rule(data=st.data(), outcome=st.sampled_from([Outcome.OK, Outcome.UPSTREAM_ERROR, Outcome.CLIENT_ABORT]),
          newest=st.booleans())
    def end(self, data, outcome, newest) -> None:
        """A request that runs ends (in the twin: its ticket ends, its waiter's client leaves, or nothing)."""
        running = [i for i in self._open() if live(self.requests[i][0]) is not None
                   and live(self.requests[i][0]).__class__.__name__ == "Ticket"]
        if not running:
            return
        i = running[-1] if newest else data.draw(st.sampled_from(running))  # the newest: often still in its place
        ds, de = self.requests[i]
        t = live(ds)
        assert self.s.finish(t, outcome) is True and self.s.finish(t, Outcome.OK) is False
        self._mirror_end(de, outcome)
        self.ended.add(i)
        self._track_all()

    @rule()
    def oldest_ends(self) -> None:
        """The oldest running request ends: its slot goes to the queue (a grant, in the twin's too)."""
        running = [i for i in self._open() if live(self.requests[i][0]).__class__.__name__ == "Ticket"]
        if running:
            i = running[0]
            assert self.s.finish(live(self.requests[i][0]), Outcome.OK)
            self._mirror_end(self.requests[i][1], Outcome.OK)
            self.ended.add(i)
            self._track_all()

    def _mirror_end(self, de, outcome) -> None:
        x = live(de)
        if x is None:
            return
        if x.__class__.__name__ == "Waiter":
            d = self.e.abandon(x, timed_out=False)
            assert d.reason == R_CLIENT_GONE
            # shadow counts this as the place that ended with its request: the same event
            self.ev_e.would[(d.kind, d.reason)] -= 1
            self.ev_e.would[(QUEUE, R_ENDED_WHILE_QUEUED)] += 1
        else:
            assert self.e.finish(x, outcome)

    @rule(data=st.data())
    def client_leaves_queue(self, data) -> None:
        """A real waiter (a class in enforce) whose client leaves: the twin's leaves too."""
        waiting = [i for i in self._open() if live(self.requests[i][0]).__class__.__name__ == "Waiter"]
        if not waiting:
            return
        i = data.draw(st.sampled_from(waiting))
        ds, de = self.requests[i]
        assert self.s.abandon(live(ds), timed_out=False) is not None
        x = live(de)
        if x is not None and x.__class__.__name__ == "Waiter":
            self.e.abandon(x, timed_out=False)
        elif x is not None:
            self.e.finish(x, Outcome.CLIENT_ABORT)
        self._track_all()
        if live(ds) is None:
            self.ended.add(i)

    def _places(self):
        """(deadline, i, shadow waiter or virtual place, twin waiter) of each request enforce has queued."""
        out = []
        for i, (ds, de) in enumerate(self.requests):
            we = live(de)
            ws = live(ds)
            if ws.__class__.__name__ == "Ticket":
                ws = self.s.shadow.places.get(ws.id)
            if ws is not None and ws.__class__.__name__ == "Waiter" and ws.pending:
                out.append((ws.deadline, i, ws, we))
            elif we.__class__.__name__ == "Waiter":
                out.append((we.deadline, i, None, we))
        return sorted(out, key=lambda x: (x[0], x[1]))

    @rule(dt=st.sampled_from([0.05, 0.25, 0.6, 2.0]))
    def time_passes(self, dt) -> None:
        """Each queued request's deadline fires in both (a real waiter's timer; a virtual place's reap), then the
        tick and the reaper."""
        until = self.clock() + dt
        while True:
            due = [p for p in self._places() if p[0] <= until]
            if not due:
                break
            deadline, i, ws, we = due[0]
            self.clock.t = max(self.clock.t, deadline)
            for core, w in ((self.s, ws), (self.e, we)):
                if w is not None and w.__class__.__name__ == "Waiter" and w.pending:
                    core.abandon(w, timed_out=True)
            self._track_all()
            for j in self._open():
                if live(self.requests[j][0]) is None:
                    self.ended.add(j)
        self.clock.t = until
        self.s.tick(), self.e.tick()
        assert self.s.reap() == [] and self.e.reap() == []
        self._track_all()

    @rule(which=st.sampled_from(range(len(PAIRS))))
    def reload(self, which) -> None:
        run, twin = PAIRS[which]
        self.s.apply(run)
        self.e.apply(twin)
        self._track_all()
        for j in self._open():
            if live(self.requests[j][0]) is None:
                self.ended.add(j)

    def _track_all(self) -> None:
        for ds, _ in self.requests:
            self._track(ds)

    # --- the promises ---

    @invariant()
    def enforce_state_is_the_twins(self) -> None:
        if not hasattr(self, "s"):
            return
        for name, lim in self.s.limiters.items():
            twin = self.e.limiters[name]
            assert (lim.inflight, len(lim.queue)) == (twin.inflight, len(twin.queue)), \
                (name, lim.inflight, len(lim.queue), twin.inflight, len(twin.queue))
            assert math.isclose(lim.inflight_cost, twin.inflight_cost, abs_tol=1e-9), name
            assert self.s.degraded[name].inflight == self.e.degraded[name].inflight, name
        assert +self.ev_s.would == +self.ev_e.would, (+self.ev_s.would, +self.ev_e.would)
        for name, limits in self.s.tenant_limits.items():  # charged as enforce charges
            twin = self.e.tenant_limits[name]
            for mine, theirs in ((limits.requests, twin.requests), (limits.tokens, twin.tokens)):
                if mine is not None:
                    now = self.clock()  # the level as of now (each refills lazily, when read)
                    assert math.isclose(mine.refill(now), theirs.refill(now), abs_tol=1e-6), \
                        (name, mine.level, theirs.level)
        for key, session in self.s.sessions.sessions.items():
            twin = self.e.sessions.sessions.get(key)
            assert twin is not None, key
            assert (session.inflight, session.queued) == (twin.inflight, twin.queued), key
            assert math.isclose(session.inflight_gpu_s, twin.inflight_gpu_s, abs_tol=1e-9), key

    @invariant()
    def tickets_closed_once(self) -> None:
        if not hasattr(self, "s"):
            return
        assert all(n == 1 for n in self.ev_s.completions.values())
        open_ids = {t.id for t in self.tickets if not t.closed}
        assert set(self.s.tickets) == open_ids, (set(self.s.tickets), open_ids)

    def teardown(self) -> None:
        if not hasattr(self, "s"):
            return
        for _ in range(50):
            progressed = False
            for i in self._open():
                x = live(self.requests[i][0])
                if x.__class__.__name__ == "Ticket":
                    assert self.s.finish(x, Outcome.OK)
                    self._mirror_end(self.requests[i][1], Outcome.OK)
                elif x is not None:
                    self.s.abandon(x, timed_out=False)
                    y = live(self.requests[i][1])
                    if y.__class__.__name__ == "Waiter":
                        self.e.abandon(y, timed_out=False)
                    elif y is not None:
                        self.e.finish(y, Outcome.OK)
                self._track_all()
                if live(self.requests[i][0]) is None:
                    self.ended.add(i)
                progressed = True
                self.enforce_state_is_the_twins()
            if not progressed:
                break
        assert not self._open()
        for ds, de in self.requests:
            assert live(de) is None, de
        self.tickets_closed_once()
        self.clock.advance(10.0)
        for core in (self.s, self.e):
            assert core.reap() == []
            assert not core.tickets and not core._unreported and not core._retired
            assert not core.shadow.running and not core.shadow.places
            for name, c in core.snapshot().items():
                assert (c["inflight"], c["queue"], c["inflight_cost"], c["degraded_inflight"]) == (0, 0, 0.0, 0), \
                    name
        assert all(t.closed for t in self.tickets)
        assert all(n == 1 for n in self.ev_s.completions.values())


ShadowModel.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None, derandomize=True,
                                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestShadowModel = ShadowModel.TestCase
