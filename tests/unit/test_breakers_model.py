"""A model-based test of the circuit breakers (breakers.py), on their own and as the core drives them.

On their own: random arrivals, completions (latencies, failures; probes or not), time passing, a lower class
yielding (reset) and reloads that rebuild a breaker with new knobs (take_state), on a virtual clock, against a
reference model written from the docs (docs/configuration.md, the module docstring): closed until a window of at
least `min_samples` judged over `window_s` (cut in ten slices) trips it; open for `cooldown_s`, admitting nothing;
half-open for `trickle_s`, admitting `trickle` of the traffic as probes, re-opened by one bad probe and closed by a
clean period, each by time when it fell due; a reload keeps an open or half-open breaker so, counted from when the
state began, with an empty window. Checked after every step: the state, when it began and each transition the
breaker reported are the model's, and only legal ones (closed -> open -> half-open -> open or closed; a reset
closes).

Through the core: one class with both breakers on a pool, its requests arriving, queueing, completing with
latencies and statuses, a reload tuning its breakers mid-sequence. Checked: a request refused for a breaker was
refused by one that is open or half-open (and is not a probe), with a Retry-After of at least the rest of its
cooldown and at most `retry_after_max_s`; no request goes to the pool at arrival past an open breaker, and a
half-open one lets through no more than its trickle; at the end, every slot and gauge is back to zero.
"""

from __future__ import annotations

import copy
import math
import random

import pytest

from extproc.policy.admission import QUEUE, AdmissionController, RequestFacts
from extproc.policy.breakers import CLOSED, HALF_OPEN, OPEN, ErrorBreaker, LatencyBreaker
from extproc.policy.decision import NoEvents
from extproc.policy.limits import Completion, Outcome
from extproc.policy.reasons import R_ERROR_BREAKER, R_LATENCY_BREAKER
from extproc.policy.schema import load_policy
from tests.conftest import FakeClock, pass_time

BREAKER_REASON = {"latency": R_LATENCY_BREAKER, "error": R_ERROR_BREAKER}
# The cycle, and a reset: an open breaker closed at once when the lower classes yielded instead.
LEGAL = {(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, OPEN), (HALF_OPEN, CLOSED), (OPEN, CLOSED)}


class Reference:
    """What the docs say a breaker does, kept the plain way: every sample with its time."""

    SLICES = 10

    def __init__(self, kind: str, knobs: dict):
        self.kind, self.knobs = kind, knobs
        self.state, self.since = CLOSED, 0.0
        self.samples: list[tuple[float, bool]] = []   # (time, bad): bad is over the SLO, or a failure
        self.arrivals = self.probes = 0               # in the current half-open period

    def _slice(self, t: float) -> int:
        return math.floor(t / (self.knobs["window_s"] / self.SLICES))

    def poll(self, now: float) -> None:
        k = self.knobs
        if self.state == OPEN and now - self.since >= k["cooldown_s"]:
            self._set(HALF_OPEN, self.since + k["cooldown_s"])
        if self.state == HALF_OPEN and now - self.since >= k["trickle_s"]:
            self._set(CLOSED, self.since + k["trickle_s"])
            self.samples = []

    def _set(self, state: str, at: float) -> None:
        self.state, self.since = state, at
        self.arrivals = self.probes = 0

    def tripped(self, now: float) -> bool:
        newest = self._slice(now)
        window = [bad for t, bad in self.samples if self._slice(t) > newest - self.SLICES]
        n, bad = len(window), sum(window)
        if n < self.knobs["min"] or n == 0:
            return False
        if self.kind == "latency":
            return (n - bad) / n < 0.95
        return bad / n >= self.knobs["ratio"]

    def observe(self, now: float, bad: bool, probe: bool) -> None:
        self.poll(now)
        if self.state == CLOSED:
            self.samples.append((now, bad))
            if self.tripped(now):
                self._set(OPEN, now)
        elif self.state == HALF_OPEN and probe and bad:
            self._set(OPEN, now)


def aside(breaker):
    """A copy of `breaker` to ask without moving it (nor reporting what the copy does)."""
    report, breaker.on_change = breaker.on_change, None
    try:
        return copy.deepcopy(breaker)
    finally:
        breaker.on_change = report


def as_time_moved(b, now: float) -> tuple[str, float]:
    """The (state, since) an unasked breaker is in at `now` by its stored state and its knobs (the docs' cycle)."""
    state, since = b.state, b.since
    if state == OPEN and now - since >= b.cooldown_s:
        state, since = HALF_OPEN, since + b.cooldown_s
    if state == HALF_OPEN and now - since >= b.trickle_s:
        state, since = CLOSED, since + b.trickle_s
    return state, since


def knobs(r: random.Random) -> dict:
    return {"window_s": r.choice([1.0, 5.0, 30.0]), "min": r.choice([1, 3, 10]), "ratio": r.choice([0.2, 0.5, 1.0]),
            "cooldown_s": r.choice([0.0, 0.5, 2.0, 10.0]), "trickle": r.choice([0.05, 0.3, 1.0]),
            "trickle_s": r.choice([0.0, 1.0, 5.0])}


def build(kind: str, k: dict, slo_s: float):
    if kind == "latency":
        return LatencyBreaker(slo_s, k["window_s"], k["min"], 0.95, k["cooldown_s"], k["trickle"], k["trickle_s"])
    return ErrorBreaker(k["ratio"], k["window_s"], k["min"], k["cooldown_s"], k["trickle"], k["trickle_s"])


class BreakerModel:
    """One breaker and its reference, driven by random events."""

    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self.kind = self.r.choice(["latency", "error"])
        self.slo_s = 1.0
        self.now = 100.0 + self.r.random()
        self.ref = Reference(self.kind, knobs(self.r))
        self.b = self._breaker(self.ref.knobs)
        self.running: list[bool] = []   # admitted requests not yet completed: probe or not

    def _breaker(self, k: dict):
        b = build(self.kind, k, self.slo_s)
        b.on_change = self._changed
        self.changes: list[tuple[str, str]] = []
        return b

    def _changed(self, b, state: str) -> None:
        self.changes.append((self.last, state))
        self.last = state

    def step(self) -> None:
        r = self.r
        self.last = self.b.state
        self.changes = []
        e = r.random()
        if e < 0.4:
            self.arrive()
        elif e < 0.75 and self.running:
            self.complete()
        elif e < 0.95:
            self.now += r.choice([0.01, 0.1, 0.5, 1.0, 3.0, 12.0])
        elif e < 0.97 and self.b.state != CLOSED:
            self.b.reset(self.now)
            self.ref._set(CLOSED, self.now)
            self.ref.samples = []
        else:
            self.reload()
        assert all(pair in LEGAL for pair in self.changes), self.changes
        self.ref.poll(self.now)
        state, since = as_time_moved(self.b, self.now)  # the breaker itself moves only when something asks it
        assert state == self.ref.state, (state, self.ref.state)
        assert math.isclose(since, self.ref.since, abs_tol=1e-9), (since, self.ref.since)

    def arrive(self) -> None:
        self.ref.poll(self.now)
        state = self.ref.state
        if state == OPEN:
            assert math.isclose(self.b.opens_in(self.now), self.ref.since + self.ref.knobs["cooldown_s"] - self.now,
                                abs_tol=1e-9)
        allowed, probe = self.b.allow(self.now)
        if state == CLOSED:
            assert (allowed, probe) == (True, False)
        elif state == OPEN:
            assert not allowed, "an open breaker let a request through"
        else:  # half-open: `trickle` of the arrivals, evenly spread
            ref = self.ref
            ref.arrivals += 1
            ref.probes += allowed
            assert allowed == probe
            assert ref.probes <= ref.arrivals * ref.knobs["trickle"] + 1e-9, "more probes than the trickle"
            assert ref.probes >= math.floor(ref.arrivals * ref.knobs["trickle"] + 1e-9) - 1e-9, "probes withheld"
        if allowed:
            self.running.append(probe)

    def complete(self) -> None:
        probe = self.running.pop(self.r.randrange(len(self.running)))
        if self.kind == "latency":
            seconds = self.r.choice([0.01, 0.5, 0.99, 1.0, 1.01, 3.0])
            bad = seconds > self.slo_s
            self.b.observe(self.now, seconds, probe)
        else:
            bad = self.r.random() < 0.4
            self.b.observe(self.now, bad, probe)
        self.ref.observe(self.now, bad, probe)

    def reload(self) -> None:
        """New knobs: an open or half-open breaker goes on as it was, from when its state began; the window is new."""
        old = self.b
        k = knobs(self.r)
        self.b = self._breaker(k)
        self.b.take_state(old, self.now)
        was = self.ref
        self.ref = Reference(self.kind, k)
        if was.state != CLOSED:
            self.ref.state, self.ref.since = was.state, was.since
        else:
            self.ref.since = self.b.since  # a new closed breaker: when it closed is not said


@pytest.mark.parametrize("seed", range(300))
def test_a_breaker_moves_as_its_docs_say(seed):
    model = BreakerModel(seed)
    for _ in range(300):
        model.step()


def class_doc(latency: dict, error: dict, fallback: dict) -> dict:
    return {"classes": {"hi": {"max_concurrency": 3, "max_queue": 3, "max_wait_ms": 500, "slo_p95_ms": 1000,
                               "latency_breaker": latency, "error_breaker": error, "on_overflow": "reject",
                               "fallback": fallback}},
            "default_class": "hi", "models": {"llama": {"cluster": "pool_a"}, "other": {"cluster": "pool_b"}},
            "retry_after_max_s": 8}


CORE_POLICIES = [load_policy(d) for d in (
    class_doc({"min_samples": 3, "window_s": 5, "cooldown_s": 2, "trickle": 0.3, "trickle_s": 3},
              {"min_requests": 3, "window_s": 5, "cooldown_s": 1, "trickle": 0.5, "trickle_s": 2},
              {"action": "canned", "status": 503}),
    # tuned mid-incident: longer cooldowns (past the Retry-After ceiling), a thinner trickle, a canned 200
    class_doc({"min_samples": 5, "window_s": 10, "cooldown_s": 12, "trickle": 0.1, "trickle_s": 4},
              {"min_requests": 2, "window_s": 3, "cooldown_s": 3, "trickle": 0.25, "trickle_s": 1,
               "max_error_ratio": 0.3},
              {"action": "canned", "status": 200}),
    # the error breaker off, the latency one as in the first; the fallback a plain refusal
    class_doc({"min_samples": 3, "window_s": 5, "cooldown_s": 2, "trickle": 0.3, "trickle_s": 3}, {"enabled": False},
              {"action": "reject"}),
)]


class Transitions(NoEvents):
    """Every transition each breaker reported, from the state it was created in."""

    def __init__(self) -> None:
        self.last: dict[int, str] = {}
        self.bad: list = []

    def breaker_created(self, cls, pool, breaker) -> None:
        self.last[id(breaker)] = breaker.state

    def breaker_changed(self, cls, pool, breaker, state) -> None:
        before = self.last.get(id(breaker), CLOSED)
        if (before, state) not in LEGAL:
            self.bad.append((cls, pool, breaker.kind, before, state))
        self.last[id(breaker)] = state


class CoreModel:
    """The core with one class whose breakers guard two pools, driven by random events."""

    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self.clock = FakeClock()
        self.events = Transitions()
        self.core = AdmissionController(CORE_POLICIES[self.r.randrange(len(CORE_POLICIES))], clock=self.clock,
                                        events=self.events)
        self.live: dict[int, object] = {}
        self.waiting: list = []
        self.periods: dict[tuple[int, float], list[int]] = {}  # (breaker, half-open since) -> [arrivals, passed]
        self.sick = {"pool_a": self.r.random(), "pool_b": self.r.random()}  # how often a pool is slow or fails

    def take(self, d) -> None:
        if d.kind == QUEUE:
            self.waiting.append(d.waiter)
        elif d.ticket is not None:
            self.live[d.ticket.id] = d.ticket

    def sweep(self) -> None:
        for w in [w for w in self.waiting if not w.pending]:
            self.waiting.remove(w)
            self.take(w.result)

    def arrive(self) -> None:
        model = self.r.choice(["llama", "other"])
        pool = self.core.clusters[model]
        now = self.clock()
        breakers = self.core.pool_breakers("hi", pool)
        before = {}
        for b in breakers:  # as time has moved them, without asking them (the core asks those it reaches)
            state, since = as_time_moved(b, now)
            before[b.kind] = (b, state, since + b.cooldown_s - now if state == OPEN else 0.0)
        d = self.core.decide(RequestFacts(model=model, max_tokens=16))
        went = d.ticket is not None or d.kind == QUEUE
        if d.reason in BREAKER_REASON.values():
            _, state, opens_in = before["latency" if d.reason == R_LATENCY_BREAKER else "error"]
            assert state in (OPEN, HALF_OPEN), (d.reason, state)
            if d.status in (429, 503):
                ceiling = self.core.policy.retry_after_max_s
                assert max(1, min(ceiling, math.ceil(opens_in))) <= d.retry_after <= ceiling, \
                    (d.retry_after, opens_in, ceiling)
        else:
            assert all(state != OPEN for _, state, _ in before.values()) or not went, "went past an open breaker"
        refused_at = next((i for i, b in enumerate(breakers) if d.reason == BREAKER_REASON[b.kind]), len(breakers))
        for i, b in enumerate(breakers):
            if before[b.kind][1] == HALF_OPEN:  # the breakers are asked in order: those after a refusal are not
                period = self.periods.setdefault((id(b), as_time_moved(b, now)[1]), [0, 0])
                period[0] += i <= refused_at
                period[1] += went
                assert period[1] <= period[0] * b.trickle + 1e-9, ("past the trickle", b.kind, period, b.trickle)
        self.take(d)
        self.sweep()

    def end(self) -> None:
        if not self.live:
            return
        t = self.live.pop(self.r.choice(sorted(self.live)))
        sick = self.r.random() < self.sick[t.pool]
        outcome = self.r.choice([Outcome.OK, Outcome.UPSTREAM_ERROR] if sick else [Outcome.OK, Outcome.CLIENT_ABORT])
        took = self.r.choice([1.5, 4.0] if sick else [0.05, 0.3])
        self.clock.advance(0.001)
        self.core.report(t.id, Completion(outcome, {Outcome.OK: 200, Outcome.UPSTREAM_ERROR: 503,
                                                    Outcome.CLIENT_ABORT: 499}[outcome], None, took))
        assert self.core.finish(t, outcome)
        self.sweep()

    def wait(self) -> None:
        pass_time(self.core, self.clock, self.waiting, self.clock() + self.r.choice([0.05, 0.2, 1.0, 2.5, 6.0]),
                  self.sweep)

    def reload(self) -> None:
        """New breaker knobs: each breaker open or half-open now (as time has moved it, though nothing asked it
        since) goes on as it was, from when its state began; the others are closed."""
        now = self.clock()
        before = {}
        for key, bs in self.core.breakers.items():
            for b in bs:
                seen = aside(b)  # the core's own breakers stay as nothing asked them
                before[key, b.kind] = (b, seen.poll(now), seen.since)
        self.core.apply(CORE_POLICIES[self.r.randrange(len(CORE_POLICIES))])
        for key, bs in self.core.breakers.items():
            for b in bs:
                old, state, since = before.get((key, b.kind), (None, CLOSED, None))
                if old is b:
                    continue  # its knobs did not change: the same breaker
                if state == CLOSED:
                    assert b.poll(now) == CLOSED, (key, b.kind, "opened by a reload")
                else:
                    assert (b.state, b.since) == (state, since), (key, b.kind, b.state, state)
        self.sweep()

    def step(self) -> None:
        e = self.r.random()
        if e < 0.45:
            self.arrive()
        elif e < 0.8:
            self.end()
        elif e < 0.97:
            self.wait()
        else:
            self.reload()
        assert not self.events.bad, self.events.bad

    def drain(self) -> None:
        for w in list(self.waiting):
            self.core.abandon(w, timed_out=False)
        self.sweep()
        while self.live or self.waiting:
            self.end()
        self.clock.advance(3600.0)
        self.core.reap()
        for (cls, pool), bs in self.core.breakers.items():  # an idle breaker closes by time; its gauge reads so
            for b in bs:
                assert b.poll(self.clock()) == CLOSED and self.events.last[id(b)] == CLOSED, (cls, pool, b.kind)
        assert not self.core.tickets and not self.events.bad
        for name, c in self.core.snapshot().items():
            assert (c["inflight"], c["queue"], c["degraded_inflight"]) == (0, 0, 0), name


@pytest.mark.parametrize("seed", range(120))
def test_the_core_keeps_its_breakers_promises(seed):
    model = CoreModel(seed)
    for _ in range(300):
        model.step()
    model.drain()
