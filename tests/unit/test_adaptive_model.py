"""A model-based test of the adaptive per-class caps (adaptive.py) against docs/adaptive.md's rule table, on their
own and as the core drives them.

On their own: completions with service times around the SLO (some from requests admitted before the last latency
cut), in-flight counts, saturation readings (saturated, fleeting, quiet, none), yield requests from a higher class
and what the lower classes hold over their floors, at random times on a virtual clock, against a reference written
from the table: a move only once `interval_s` has passed since the last; the first row that holds decides it
(cut_yield, hold while a saturation cut drains, cut_saturated, ask_yield / cut_latency, raise, probe, recover at
most once per `window_s`, hold); a yield asked between two moves is made at the next. Checked after every call:
the action and the cap are the reference's, within [min_limit, max_limit]; no raise of any kind while saturated.

Through the core: two adaptive classes on one pool (the higher one's latency breaker on or off), requests
arriving, queueing, completing with service times around the SLO, saturation readings (some left to go stale),
reloads that change the adaptive knobs (rebuilt controllers) or keep them (kept ones). Checked after every step:
each cap within its (current) bounds, also right after a reload (a rebuilt controller keeps its cap, within the new
bounds); a class admits only below its cap (a cut under what it holds drains: nothing is admitted until it is back
under); a move only at its interval, across reloads too; no raise, probe or recover while the pool's (fresh)
reading is saturated, no saturation cut without one; when the higher class's move asked the lower class to yield
(or its breaker was reset for it), the lower class's next move is `cut_yield`, and it yields only after such an ask
(standing until the asker moves again) or while the higher class's latency breaker is not closed; the higher class
never yields.
"""

from __future__ import annotations

import math
import random

import pytest

from extproc.policy.adaptive import CALM_DRIFT, LOAD_TOLERANCE, RECOVER_WINDOWS, AdaptiveLimit, PoolSaturation
from extproc.policy.admission import ACCEPT, QUEUE, AdmissionController, RequestFacts
from extproc.policy.breakers import CLOSED, LatencyBreaker, LatencyWindow
from extproc.policy.limits import Completion, Outcome
from extproc.policy.schema import AdaptiveSpec
from tests.conftest import FakeClock, make_policy

SLICES = 5  # the controller's window is cut in five slices (a sample leaves with its slice)
SERVICE_S = (0.2, 0.3, 0.4, 0.6, 0.8, 0.95, 1.3)  # around a 1 s SLO


def bucket_edge(seconds: float) -> float:
    """The window's reading of a sample: the upper edge of its log-spaced bucket (LatencyWindow)."""
    low, ratio, n = LatencyWindow.LOW_S, LatencyWindow.RATIO, LatencyWindow.BUCKETS
    b = 0 if seconds <= low else int(math.log(seconds / low) / math.log(ratio)) + 1
    return low * ratio ** min(b, n - 1)


class Reference:
    """What docs/adaptive.md's table says one class's cap does, kept the plain way: every sample with its time."""

    def __init__(self, spec: AdaptiveSpec, slo_s: float, initial: int):
        self.spec, self.slo_s = spec, slo_s
        self.limit = float(min(max(initial, spec.min_limit), spec.max_limit))
        self.samples: list[tuple[float, float]] = []  # (completed at, service time)
        self.last_move: float | None = None
        self.cut_at = float("-inf")        # the last latency cut (or ask): older admissions do not count
        self.yield_due = False
        self.calm: float | None = None
        self.recovered_at = float("-inf")
        self.action = "hold"

    def observe(self, now: float, latency: float, admitted_at: float) -> None:
        if admitted_at >= self.cut_at:
            self.samples.append((now, latency))

    def _live(self, now: float) -> list[float]:
        width = self.spec.window_s / SLICES
        newest = math.floor(now / width)
        return sorted(bucket_edge(s) for t, s in self.samples if math.floor(t / width) > newest - SLICES)

    def update(self, now: float, inflight: int, saturated: bool | None, yielding: bool, excess: float) -> int:
        s = self.spec
        self.yield_due = self.yield_due or yielding
        if self.last_move is not None and now - self.last_move < s.interval_s:
            return int(self.limit)
        yielding, self.yield_due, self.last_move = self.yield_due, False, now
        live = self._live(now)
        enough = len(live) >= s.min_samples
        p95 = next(x for k, x in enumerate(live, 1) if k >= 0.95 * len(live)) if enough else 0.0
        binding = inflight >= s.binding * int(self.limit)  # a fraction of the cap the class is held to
        if enough and not binding and not saturated:
            self.calm = p95 if self.calm is None else min(p95, self.calm * (1 + CALM_DRIFT))
        slow = enough and p95 > s.cut_at * self.slo_s
        raised = min(s.max_limit, self.limit + s.increase)
        if yielding:
            self._move("cut_yield", max(s.min_limit, min(self.limit, inflight) * s.decrease))
        elif saturated and inflight > self.limit:
            self._move("hold", self.limit)
        elif saturated:
            self._move("cut_saturated", max(s.min_limit, self.limit * s.decrease))
        elif slow:
            frees = min(self.limit, inflight) * (1 - s.decrease)
            if excess > 0 and excess >= frees:
                self._move("ask_yield", self.limit)
            else:
                self._move("cut_latency", max(s.min_limit, self.limit * s.decrease))
            self.samples.clear()
            self.cut_at = now
        elif enough and binding and p95 < s.raise_below * self.slo_s:
            self._move("raise", raised)
        elif not enough and binding and 2 * len(live) >= s.min_samples and live[-1] < s.raise_below * self.slo_s:
            self._move("probe", raised)
        elif enough and binding and self.calm is not None and p95 <= LOAD_TOLERANCE * self.calm \
                and now - self.recovered_at >= RECOVER_WINDOWS * s.window_s:
            self.recovered_at = now
            self._move("recover", raised)
        else:
            self._move("hold", self.limit)
        return int(self.limit)

    def _move(self, action: str, limit: float) -> None:
        self.action, self.limit = action, limit


def random_spec(rng: random.Random) -> AdaptiveSpec:
    lo = rng.randint(1, 4)
    cut_at = rng.choice([0.8, 0.9, 1.0])
    return AdaptiveSpec(enabled=True, min_limit=lo, max_limit=rng.randint(lo, 24),
                        interval_s=rng.choice([0.25, 0.5, 1.0]), window_s=rng.choice([2.0, 5.0, 10.0]),
                        min_samples=rng.randint(1, 12), cut_at=cut_at, raise_below=cut_at - rng.choice([0.1, 0.3]),
                        binding=rng.choice([0.5, 0.8, 1.0]), decrease=rng.choice([0.5, 0.8, 0.9]),
                        increase=rng.choice([0.5, 1.0, 2.0]))


def reading(rng: random.Random) -> PoolSaturation | None:
    kind = rng.choice(["none", "quiet", "quiet", "saturated", "fleeting"])
    if kind == "none":
        return None
    sat = PoolSaturation()
    sat.saturated = kind in ("saturated", "fleeting")
    sat.fleeting = kind == "fleeting"
    return sat


@pytest.mark.parametrize("seed", range(12))
def test_the_controller_moves_as_the_rule_table_says(seed):
    rng = random.Random(seed)
    slo = rng.choice([1.0, 2.0])
    spec = random_spec(rng)
    initial = rng.randint(1, 30)
    ctl, ref = AdaptiveLimit(spec, slo, initial), Reference(spec, slo, initial)
    now, moves = 0.0, []
    for step in range(1500):
        now += rng.choice([0.01, 0.05, 0.1, 0.25, 0.3])
        if rng.random() < 0.01:  # a reload that changes the knobs rebuilds the controller (PolicyState._limiter)
            spec, initial = random_spec(rng), rng.randint(1, 30)
            ctl, ref = AdaptiveLimit(spec, slo, initial), Reference(spec, slo, initial)
            assert spec.min_limit <= int(ctl.limit) <= spec.max_limit
        for _ in range(rng.choice([0, 0, 1, 2, 4])):
            service = slo * rng.choice([rng.uniform(0.1, 0.6), rng.uniform(0.6, 0.95), rng.uniform(0.9, 1.5)])
            admitted = now - service - rng.uniform(0, 0.5)
            ctl.observe(now, service, admitted)
            ref.observe(now, service, admitted)
        cap = int(ctl.limit)
        inflight = max(0, cap + rng.choice([-cap, -2, -1, 0, 0, 0, 1, 3]))
        sat = reading(rng)
        yielding = rng.random() < 0.05
        excess = rng.choice([0.0, 0.0, 1.0, 3.0, 10.0])
        before, before_ref = ctl.limit, ref.limit
        got = ctl.update(now, inflight, sat, yielding, excess)
        want = ref.update(now, inflight, sat is not None and sat.saturated, yielding, excess)
        where = f"seed {seed} step {step} t={now:.2f} spec={spec} inflight={inflight} sat={sat and sat.saturated}"
        assert (ctl.last_action, got) == (ref.action, want), where
        assert ctl.limit == pytest.approx(ref.limit), where
        assert spec.min_limit <= got <= spec.max_limit, where
        if ctl.limit != before:
            moves.append((now, ctl.last_action))
            assert before == pytest.approx(before_ref)
        if sat is not None and sat.saturated:
            assert not (ctl.limit > before), where  # no raise while saturated
    assert len({a for _, a in moves}) >= 3, moves  # the sequence exercised several rows


def tripped(core, now: float) -> bool:
    return any(isinstance(b, LatencyBreaker) and b.poll(now) != CLOSED
               for b in core.state.breakers.get(("interactive", "pool_a"), ()))


def two_classes(rng: random.Random, spec: dict, stale_ms: float = 500):
    base = {"max_queue": 4, "max_wait_ms": 400, "latency_breaker": {"enabled": rng.random() < 0.5}}
    return make_policy(
        classes={"interactive": {**base, "max_concurrency": 8, "slo_p95_ms": 1000, "adaptive": spec},
                 "batch": {**base, "max_concurrency": 8, "slo_p95_ms": 1000, "adaptive": spec}},
        pools={"pool_a": {"replicas": ["127.0.0.1:1"], "stale_ms": stale_ms}}, tenants=[])


def core_spec(rng: random.Random) -> dict:
    lo = rng.randint(1, 3)
    return {"enabled": True, "min_limit": lo, "max_limit": rng.randint(lo + 1, 12),
            "interval_s": rng.choice([0.5, 1.0]), "window_s": rng.choice([2.0, 4.0]),
            "min_samples": rng.randint(2, 6), "decrease": rng.choice([0.5, 0.8]), "increase": rng.choice([1.0, 2.0])}


@pytest.mark.parametrize("seed", range(6))
def test_through_the_core_caps_hold_and_lower_classes_yield(seed):
    rng = random.Random(seed)
    clock = FakeClock()
    spec = core_spec(rng)
    core = AdmissionController(two_classes(rng, spec), clock=clock)
    held: list = []  # (ticket, service seconds)
    waiters: list = []
    last_move: dict[str, float] = {}
    asked = False  # interactive's move asked batch to yield, and batch has not moved since
    may_yield = False  # interactive asked, or its latency breaker was not closed, since batch's last move
    for step in range(1200):
        clock.advance(rng.choice([0.02, 0.05, 0.1, 0.2]))
        if rng.random() < 0.3:  # a scrape (or none for a while: the reading goes stale)
            sat = PoolSaturation()
            sat.saturated = rng.random() < 0.1
            sat.fleeting = sat.saturated and rng.random() < 0.5
            sat.updated_at = clock.t
            core.set_saturation("pool_a", sat)
        for _ in range(rng.choice([0, 1, 2, 3])):
            cls = rng.choice(["interactive", "batch"])
            lim = core.limiters[cls]
            before = lim.inflight
            d = core.decide(RequestFacts(header_class=cls, model="llama"))
            if d.kind == ACCEPT:
                assert before < lim.limit, (seed, step, cls)  # admitted only below the cap
                held.append((d.ticket, rng.choice(SERVICE_S)))
            elif d.kind == QUEUE:
                waiters.append(d.waiter)
                d.waiter.notify(lambda r: r.kind == ACCEPT and held.append((r.ticket, rng.choice(SERVICE_S))))
        for w in [w for w in waiters if w.pending and w.deadline <= clock.t]:
            core.abandon(w, timed_out=True)
        waiters[:] = [w for w in waiters if w.pending]
        for t, service in list(held):
            if clock.t - t.admitted_at >= service or rng.random() < 0.02:
                held.remove((t, service))
                core.finish(t, Outcome.OK)
                core.report(t.id, Completion(Outcome.OK, 200, None, clock.t - t.admitted_at + t.waited_s))
        hi, lo = core.limiters["interactive"], core.limiters["batch"]
        may_yield |= tripped(core, clock.t)  # row 1: interactive's latency breaker is not closed
        if core.moves.yield_asked.get("pool_a", 1) < lo.rank:  # it tripped, and was reset for batch to yield
            asked = may_yield = True
        if rng.random() < 0.05:  # a reload (before the tick: asks made since the last one stand): new knobs rebuild
            # the controllers, the same ones keep them
            spec = spec if rng.random() < 0.5 else core_spec(rng)
            controllers = {n: lim.controller for n, lim in core.limiters.items()}
            caps = {n: lim.limit for n, lim in core.limiters.items()}
            core.apply(two_classes(rng, spec))
            for lim in core.limiters.values():
                ad = lim.spec.adaptive
                if lim.controller is not controllers[lim.name]:  # it goes on from the old one's cap and last move
                    assert lim.limit == min(max(caps[lim.name], ad.min_limit), ad.max_limit), (seed, step)
                assert ad.min_limit <= lim.limit <= ad.max_limit, (seed, step, lim.name)
        excess = core.moves.lower_excess(hi, hi.pools)  # after the reload: it may move the floors
        seen = core.pool_reading("pool_a", clock.t)  # None once nobody refreshed it for 3 x stale_ms
        saturated = seen is not None and seen.saturated
        before = {n: (lim.controller._last, lim.inflight) for n, lim in core.limiters.items()}
        core.tick()
        core.reap()
        if hi.controller.last_action in ("ask_yield", "cut_latency") and excess:
            # Its latest move found it slow: until it moves again, batch is asked at every tick, and yields at its
            # next move (this tick's, if its interval has passed).
            may_yield = True
            asked |= hi.controller._last == clock.t
        for lim in (hi, lo):
            ad, where = lim.spec.adaptive, (seed, step, lim.name)
            assert ad.min_limit <= lim.limit <= ad.max_limit, where
            # a raise grants waiters only up to the cap; a cut under what is held drains
            assert lim.inflight <= max(lim.limit, before[lim.name][1]), where
            moved_at = lim.controller._last
            if moved_at != before[lim.name][0]:
                prev = last_move.get(lim.name)
                assert prev is None or moved_at - prev >= ad.interval_s - 1e-9, where
                last_move[lim.name] = moved_at
                action = lim.controller.last_action
                assert not (saturated and action in ("raise", "probe", "recover")), where
                assert saturated or action != "cut_saturated", where
                if lim is hi:
                    assert hi.controller.last_action != "cut_yield", where  # nothing above it
                elif asked:
                    assert lo.controller.last_action == "cut_yield", where
                elif lo.controller.last_action == "cut_yield":
                    assert may_yield, where  # only when a class above missed its SLO since batch's last move
                if lim is lo:
                    asked = may_yield = False
    for w in waiters:
        core.abandon(w, timed_out=True)
    for t, _ in held:
        core.finish(t, Outcome.OK)
    assert all(lim.inflight == 0 for lim in core.limiters.values())
