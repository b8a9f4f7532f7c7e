"""Adaptive caps with a fake clock, saturation parsing against real vLLM's /metrics, deadline-aware rejection."""

import dataclasses
from pathlib import Path

from extproc.policy.adaptive import AdaptiveLimit, PoolSaturation
from extproc.policy.admission import ACCEPT, DEGRADE, QUEUE, REJECT, AdmissionController, RequestFacts
from extproc.policy.limits import Completion, Outcome
from extproc.policy.schema import AdaptiveSpec, PoolSpec
from extproc.server.saturation import PoolScraper, parse_vllm_metrics
from tests.conftest import make_policy

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
SPEC = AdaptiveSpec(enabled=True, min_limit=2, max_limit=64, interval_s=1.0, window_s=10, min_samples=5)


def run(ctl, t0, seconds, latency, inflight, sat=None, per_s=20):
    """Feed `seconds` of completions at `latency` and update once a second; return the limits seen."""
    limits = []
    for i in range(seconds):
        now = t0 + i
        for k in range(per_s):
            ctl.observe(now + k / per_s, latency)
        limits.append(ctl.update(now + 0.99, inflight if not callable(inflight) else inflight(ctl), sat))
    return limits


def test_rises_while_under_the_slo_and_the_cap_binds():
    ctl = AdaptiveLimit(SPEC, slo_s=2.0, initial=8)
    limits = run(ctl, 0, 10, latency=0.8, inflight=lambda c: c.limit)
    assert limits[-1] > 8 and limits == sorted(limits)


def test_does_not_drift_up_when_the_cap_does_not_bind():
    ctl = AdaptiveLimit(SPEC, slo_s=2.0, initial=8)
    assert set(run(ctl, 0, 20, latency=0.5, inflight=2)) == {8}


def test_cuts_when_latency_approaches_the_slo():
    ctl = AdaptiveLimit(SPEC, slo_s=2.0, initial=32)
    limits = run(ctl, 0, 3, latency=1.95, inflight=32)
    assert limits[0] < 32 and limits[-1] < limits[0]
    assert ctl.last_action == "cut_latency"


def test_cuts_at_once_on_replica_saturation_even_with_good_latency():
    ctl = AdaptiveLimit(SPEC, slo_s=2.0, initial=32)
    sat = PoolSaturation()
    sat.saturated = True
    assert run(ctl, 0, 1, latency=0.3, inflight=32, sat=sat) == [25]
    assert ctl.last_action == "cut_saturated"


def test_bounded_by_min_and_max():
    ctl = AdaptiveLimit(SPEC, slo_s=2.0, initial=8)
    assert min(run(ctl, 0, 30, latency=5.0, inflight=8)) == 2
    ctl = AdaptiveLimit(SPEC, slo_s=2.0, initial=60)
    assert max(run(ctl, 0, 30, latency=0.1, inflight=lambda c: c.limit)) == 64


def test_no_oscillation_under_a_steady_load_whose_latency_tracks_the_cap():
    # A toy pool: p95 grows with the cap (1.2 s at 16 ... 2.4 s at 32). The controller should settle and stay.
    ctl = AdaptiveLimit(SPEC, slo_s=2.0, initial=8)
    limits = []
    for second in range(120):
        latency = 1.2 + (ctl.limit - 16) * 0.075
        for k in range(20):
            ctl.observe(second + k / 20, latency)
        limits.append(ctl.update(second + 0.99, int(ctl.limit), None))
    tail = limits[-60:]
    assert max(tail) - min(tail) <= 3, tail
    assert 16 <= min(tail) and max(tail) <= 26  # inside the band: p95 between 0.7 and 0.9 of the SLO


def test_reacts_within_seconds_to_a_spike():
    ctl = AdaptiveLimit(SPEC, slo_s=2.0, initial=24)
    before = run(ctl, 0, 10, latency=1.0, inflight=lambda c: c.limit)[-1]
    limits = run(ctl, 10, 4, latency=4.0, inflight=lambda c: c.limit)  # a spike fills whatever the cap is
    assert limits[-1] <= before * 0.8 ** 3


def test_saturation_cuts_again_only_once_what_is_in_flight_is_back_under_the_cap():
    ctl = AdaptiveLimit(SPEC, slo_s=2.0, initial=20)
    sat = PoolSaturation()
    sat.saturated = True
    assert ctl.update(0.0, 18, sat) == 16 and ctl.last_action == "cut_saturated"
    for t in range(1, 6):  # a queue that does not drain (a hung replica) must not take the cap to its floor
        assert ctl.update(float(t), 18, sat) == 16
    assert ctl.last_action == "hold"
    assert ctl.update(6.0, 15, sat) == 12 and ctl.last_action == "cut_saturated"


def test_scrape_parsing_reads_the_real_vllm_metrics_fixture():
    m = parse_vllm_metrics((FIXTURES / "metrics.txt").read_text())
    assert set(m) == {"running", "waiting", "kv", "preemptions", "tokens", "started", "itl_sum", "itl_count",
                      "deferred", "finished", "steps"}
    assert all(v >= 0 for v in m.values()) and m["kv"] <= 1.0


def test_stale_or_missing_replicas_count_as_saturated():
    scraper = PoolScraper(core=None, name="p", spec=PoolSpec(replicas=["a:1", "b:2"], stale_ms=1000), session=None,
                          clock=lambda: 10.0)
    assert scraper.aggregate(10.0).saturated  # nothing read yet
    for r in scraper.replicas.values():
        r.metrics, r.at = {"running": 3, "waiting": 0, "kv": 0.2, "preemptions": 0, "preempting": 0}, 10.0
    fresh = scraper.aggregate(10.5)
    assert not fresh.saturated and fresh.running == 6
    assert scraper.aggregate(11.5).saturated  # older than stale_ms
    scraper.replicas["a:1"].metrics["waiting"] = 2
    assert scraper.aggregate(10.5).saturated


def test_adaptive_class_follows_its_controller_in_the_core(clock):
    core = AdmissionController(make_policy(classes={"interactive": {
        "max_concurrency": 4, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 2000,
        "adaptive": {"enabled": True, "min_limit": 2, "max_limit": 8, "min_samples": 3}}}, tenants=[]),
        clock=clock)
    lim = core.limiters["interactive"]
    sat = PoolSaturation()
    sat.saturated = True
    core.saturation["pool_a"] = sat
    d = core.decide(RequestFacts(header_class="interactive", model="llama"))
    core.finish(d.ticket, Outcome.OK)
    clock.advance(1.0)
    core.tick()
    assert lim.limit == 3  # 4 * 0.8, the pool said it was saturated


def early_core(clock, **spec):
    interactive = {"max_concurrency": 1, "max_queue": 10, "max_wait_ms": 200, **spec}
    return AdmissionController(make_policy(classes={"interactive": interactive}, tenants=[]), clock=clock)


def drain_at(core, clock, per_s, n=5):
    """Complete n requests at `per_s` so the class has an observed drain rate."""
    for _ in range(n):
        d = core.decide(RequestFacts(header_class="interactive", model="llama"))
        clock.advance(1.0 / per_s)
        core.finish(d.ticket, Outcome.OK)


def test_rejects_at_arrival_when_the_queue_ahead_cannot_clear_within_the_deadline(clock):
    core = early_core(clock)
    drain_at(core, clock, per_s=5)                   # ~5 completions/s: each place in the queue costs ~0.2 s
    core.decide(RequestFacts(header_class="interactive", model="llama"))
    first = core.decide(RequestFacts(header_class="interactive", model="llama"))
    assert first.kind == QUEUE                        # one ahead: ~0.2 s, within 200 ms... just
    d = core.decide(RequestFacts(header_class="interactive", model="llama"))
    assert (d.kind, d.status, d.reason) == (REJECT, 429, "deadline_unmeetable")
    assert "queue deadline" in d.message


def test_idle_time_does_not_dilute_the_drain_rate(clock):
    # Found by an audit through Envoy: after a quiet spell the rate counted the idle seconds, predicted a wait of
    # seconds for a queue that drains in a fraction of one, and refused a burst it would have served.
    core = early_core(clock, max_wait_ms=2000)
    drain_at(core, clock, per_s=2)                   # busy: one completion every 0.5 s
    clock.advance(40.0)                              # nothing in flight for 40 s
    core.decide(RequestFacts(header_class="interactive", model="llama"))
    burst = [core.decide(RequestFacts(header_class="interactive", model="llama")) for _ in range(3)]
    assert [d.kind for d in burst] == [QUEUE, QUEUE, QUEUE]  # ~0.5, 1.0, 1.5 s ahead: within 2 s
    more = [core.decide(RequestFacts(header_class="interactive", model="llama")) for _ in range(3)]
    assert (more[-1].kind, more[-1].reason) == (REJECT, "deadline_unmeetable")  # ~3 s ahead: the pace binds


def test_early_rejection_can_degrade_and_can_be_turned_off(clock):
    core = early_core(clock, on_overflow="fallback", fallback={"action": "degrade", "model": "small"})
    drain_at(core, clock, per_s=2)
    core.decide(RequestFacts(header_class="interactive", model="llama"))
    d = core.decide(RequestFacts(header_class="interactive", model="llama"))
    assert (d.kind, d.reason, d.cluster) == (DEGRADE, "deadline_unmeetable", "pool_b")
    core = early_core(clock, early_reject=False)
    drain_at(core, clock, per_s=2)
    core.decide(RequestFacts(header_class="interactive", model="llama"))
    assert core.decide(RequestFacts(header_class="interactive", model="llama")).kind == QUEUE


def test_without_a_drain_rate_nothing_is_rejected_early(clock):
    core = early_core(clock)
    assert core.decide(RequestFacts(header_class="interactive", model="llama")).kind == ACCEPT
    assert core.decide(RequestFacts(header_class="interactive", model="llama")).kind == QUEUE


def test_a_cap_cut_to_its_floor_recovers_within_a_few_intervals_once_capacity_returns():
    """Issue 20 (2): a 2x slowdown drives the cap to min_limit; at 2 slots of ~1 s the 5 s window never holds
    min_samples completions, so latency alone could never raise it again. With nothing slow in the window and
    the replicas not saturated, it probes upward one slot per interval until the samples can speak."""
    spec = AdaptiveSpec(enabled=True, min_limit=2, max_limit=64, interval_s=1.0, window_s=5, min_samples=10)
    ctl = AdaptiveLimit(spec, slo_s=1.5, initial=12)
    sat = PoolSaturation()
    done = 0.0  # completions owed by Little's law (limit / latency per second), carried between seconds
    t = 0.0

    def second(latency, saturated):
        nonlocal done, t
        sat.saturated = saturated
        done += ctl.limit / latency
        for k in range(int(done)):
            ctl.observe(t + k / max(int(done), 1), latency)
        done -= int(done)
        t += 1.0
        return ctl.update(t, int(ctl.limit), sat)  # the queue is never empty: the cap binds

    slowed = [second(latency=2.0, saturated=True) for _ in range(15)]
    assert slowed[-1] == spec.min_limit
    recovered = [second(latency=1.0, saturated=False) for _ in range(10)]
    assert recovered[4] > spec.min_limit + 1, recovered  # moving within a few intervals, not pinned
    assert recovered[-1] >= 5 and ctl.last_action in ("probe", "raise")


def test_no_probe_while_the_few_samples_are_slow_or_the_replicas_saturated():
    spec = AdaptiveSpec(enabled=True, min_limit=2, max_limit=64, interval_s=1.0, window_s=5, min_samples=10)
    ctl = AdaptiveLimit(spec, slo_s=1.5, initial=2)
    sat = PoolSaturation()
    for i in range(5):
        ctl.observe(i + 0.5, 1.3)  # over raise_below * SLO (1.05 s): evidence the floor is where it must be
        assert ctl.update(i + 1.0, 2, sat) == 2
    sat.saturated = True
    for i in range(5, 10):
        ctl.observe(i + 0.25, 0.5)
        ctl.observe(i + 0.75, 0.5)
        assert ctl.update(i + 1.0, 2, sat) == 2
    sat.saturated = False
    assert ctl.update(11.0, 0, sat) == 2  # not binding: an idle class does not drift up
    ctl.observe(11.5, 0.5)
    assert ctl.update(12.0, 2, sat) == 3 and ctl.last_action == "probe"


def test_no_probe_on_one_or_two_fast_samples():
    spec = AdaptiveSpec(enabled=True, min_limit=2, max_limit=64, interval_s=1.0, window_s=5, min_samples=10)
    ctl = AdaptiveLimit(spec, slo_s=1.5, initial=2)
    ctl.observe(0.5, 0.2)
    ctl.observe(1.5, 0.2)
    assert ctl.update(2.0, 2, PoolSaturation()) == 2 and ctl.last_action == "hold"


def test_plain_overload_with_a_long_wait_bound_does_not_cut_the_cap_for_its_own_queueing(clock):
    """Issue 20 (1): 1.5 s SLO, 500 ms wait bound, twice the arrivals the pool can serve. Requests wait in our
    queue up to the bound whatever the cap, so a controller that reads latency with the wait included cut the cap
    from 12 to 2 and kept it there. It must steer on the service time the replicas give: here 0.6 s plus 40 ms per
    request in flight, well within the SLO at 12."""
    core = AdmissionController(make_policy(classes={"interactive": {
        "max_concurrency": 12, "max_queue": 50, "max_wait_ms": 500, "slo_p95_ms": 1500,
        "adaptive": {"enabled": True, "min_limit": 2, "max_limit": 64},
        "latency_breaker": {"enabled": False}}}, tenants=[]), clock=clock)  # the cap alone is under test
    lim = core.limiters["interactive"]
    running = []  # (ends at, arrived at, ticket)
    served = []   # end times
    limits = []

    def start(d, arrived):
        if getattr(d, "ticket", None) is not None:  # admitted (refused or degraded otherwise)
            running.append((clock() + 0.6 + 0.04 * lim.inflight, arrived, d.ticket))

    step, t_end = 0.05, 60.0
    for i in range(int(t_end / step)):
        clock.advance(step)
        for r in [r for r in running if r[0] <= clock()]:
            running.remove(r)
            core.finish(r[2], Outcome.OK)  # frees a slot: the queue's head is admitted (its callback runs)
            core.report(r[2].id, Completion(Outcome.OK, 200, None, clock() - r[1]))  # as Envoy's access log
            served.append(clock())
        d = core.decide(RequestFacts(header_class="interactive", model="llama"))  # 20 arrivals/s
        if d.kind == QUEUE:
            d.waiter.notify(lambda final, arrived=clock(): start(final, arrived))
        else:
            start(d, clock())
        if i % 2:
            core.tick()
            limits.append(lim.limit)
    tail = limits[-200:]  # the last 20 s
    assert min(tail) >= 10, tail
    assert sum(1 for s in served if s > t_end - 20) / 20 >= 10  # ~11 served/s on service time; ~4.6 on latency


def two_adaptive_classes(clock, breaker: bool = False):
    """Interactive and batch, both adaptive, on one pool without a pool-wide limit."""
    return AdmissionController(two_adaptive_policy(breaker), clock=clock)


def two_adaptive_policy(breaker: bool = False, **overrides):
    adaptive = {"enabled": True, "min_limit": 2, "max_limit": 16, "interval_s": 1, "window_s": 5, "min_samples": 5}
    lb = ({"window_s": 10, "min_samples": 5, "cooldown_s": 5, "trickle": 0.1, "trickle_s": 10} if breaker
          else {"enabled": False})
    return make_policy(classes={
        "interactive": {"max_concurrency": 8, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 2000,
                        "adaptive": adaptive, "latency_breaker": lb,
                        "on_overflow": "fallback", "fallback": {"action": "degrade", "model": "small"}},
        "batch": {"max_concurrency": 8, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 60000, "adaptive": adaptive},
    }, tenants=[], **overrides)


def hold(core, cls: str, n: int) -> list:
    return [core.decide(RequestFacts(header_class=cls, model="llama")).ticket for _ in range(n)]


def serve_slow(core, clock, n: int, seconds: float) -> None:
    """n interactive requests that each take `seconds` of service."""
    for t in hold(core, "interactive", n):
        clock.advance(seconds / n)
        core.finish(t, Outcome.OK)
        core.report(t.id, Completion(Outcome.OK, 200, None, seconds))


def test_a_slow_higher_class_makes_the_lower_class_yield_before_its_own_cap_is_cut(clock):
    """Issue 19's order for per-class caps: interactive over its SLO on a pool where batch holds 6 over its floor
    of 2. Batch is cut below what it holds; interactive keeps its cap (cutting it would only overflow it)."""
    core = two_adaptive_classes(clock)
    hold(core, "batch", 6)
    serve_slow(core, clock, 6, 3.0)  # p95 3 s against a 2 s SLO
    clock.advance(1.0)
    core.tick()
    assert core.limiters["interactive"].controller.last_action == "ask_yield"
    assert core.limiters["interactive"].limit == 8
    assert core.limiters["batch"].limit == 4  # 6 held x 0.8, not one step of 8


def test_once_the_lower_class_is_at_its_floor_the_higher_class_cuts_its_own_cap(clock):
    core = two_adaptive_classes(clock)
    hold(core, "batch", 2)  # at its floor: nothing left to yield
    serve_slow(core, clock, 6, 3.0)
    clock.advance(1.0)
    core.tick()
    assert core.limiters["interactive"].controller.last_action == "cut_latency"
    assert core.limiters["interactive"].limit == 6


def test_a_tripped_latency_breaker_lets_the_lower_class_yield_before_it_degrades(clock):
    """The breaker trips while batch holds more than its floor: the request is admitted on its own pool (not
    degraded), the breaker starts again from an empty window, and batch is cut at the next tick. With batch at
    its floor, the next trip degrades."""
    core = two_adaptive_classes(clock, breaker=True)
    batch = hold(core, "batch", 6)
    serve_slow(core, clock, 6, 3.0)
    d = core.decide(RequestFacts(header_class="interactive", model="llama"))
    assert d.kind == ACCEPT and not d.ticket.degraded
    core.finish(d.ticket, Outcome.OK)
    clock.advance(1.0)
    core.tick()
    assert core.limiters["batch"].limit < 6
    for t in batch[2:]:
        core.finish(t, Outcome.OK)  # batch down to its floor
    serve_slow(core, clock, 6, 3.0)
    assert core.decide(RequestFacts(header_class="interactive", model="llama")).kind == DEGRADE


def test_a_class_whose_tripped_breaker_asks_the_classes_below_to_yield_does_not_yield_itself(clock):
    """Batch's breaker trips while internal, below it, holds more than its floor: internal yields at the next tick.
    The ask was recorded for the pool alone and read at the tick as the first class's (interactive, calm): batch,
    below it, was cut to its floor by "cut_yield" as if a class above it missed its SLO."""
    adaptive = {"enabled": True, "min_limit": 2, "max_limit": 16, "interval_s": 1, "window_s": 5, "min_samples": 5}
    lb = {"window_s": 10, "min_samples": 5, "cooldown_s": 5, "trickle": 0.1, "trickle_s": 10}
    core = AdmissionController(make_policy(classes={
        "interactive": {"max_concurrency": 8, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 2000,
                        "adaptive": adaptive},
        "batch": {"max_concurrency": 8, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 2000, "adaptive": adaptive,
                  "latency_breaker": lb, "on_overflow": "fallback", "fallback": {"action": "degrade", "model": "small"}},
        "internal": {"max_concurrency": 8, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 60000,
                     "adaptive": adaptive},
    }, tenants=[]), clock=clock)
    for t in hold(core, "interactive", 1):
        core.finish(t, Outcome.OK)  # interactive sends to the pool too, and is calm
    hold(core, "internal", 6)
    for t in hold(core, "batch", 6):
        clock.advance(0.5)
        core.finish(t, Outcome.OK)
        core.report(t.id, Completion(Outcome.OK, 200, None, 3.0))  # p95 3 s against a 2 s SLO: the breaker trips
    d = core.decide(RequestFacts(header_class="batch", model="llama"))
    assert d.kind == ACCEPT and not d.ticket.degraded  # internal yields first
    core.finish(d.ticket, Outcome.OK)
    clock.advance(1.0)
    core.tick()
    assert core.limiters["internal"].limit < 6 and core.limiters["internal"].controller.last_action == "cut_yield"
    assert core.limiters["batch"].limit == 8 and core.limiters["batch"].controller.last_action != "cut_yield"


def test_a_breaker_that_tripped_on_an_idle_class_stops_the_classes_below_yielding_once_it_is_due_to_close(clock):
    """Batch's latency breaker trips, then batch sends nothing more. The classes below read the breaker's state as
    its last request left it (open) and yielded at every move for ever after, long after its cooldown and trickle
    period: internal's cap was cut to its floor on a pool nobody above it used."""
    adaptive = {"enabled": True, "min_limit": 2, "max_limit": 16, "interval_s": 1, "window_s": 5, "min_samples": 5}
    lb = {"window_s": 10, "min_samples": 5, "cooldown_s": 5, "trickle": 0.1, "trickle_s": 10}
    core = AdmissionController(make_policy(classes={
        "interactive": {"max_concurrency": 8, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 2000,
                        "adaptive": adaptive},  # sends nothing here
        "batch": {"max_concurrency": 8, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 2000, "adaptive": adaptive,
                  "latency_breaker": lb},
        "internal": {"max_concurrency": 8, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 60000,
                     "adaptive": adaptive},
    }, tenants=[]), clock=clock)
    for t in hold(core, "batch", 6):
        clock.advance(0.5)
        core.finish(t, Outcome.OK)
        core.report(t.id, Completion(Outcome.OK, 200, None, 3.0))  # p95 3 s against a 2 s SLO: the breaker trips
    assert core.pool_breakers("batch", "pool_a")[0].state == "open"
    clock.advance(60.0)  # batch idle: its breaker is past its cooldown and its trickle period
    hold(core, "internal", 6)
    core.tick()
    assert core.limiters["internal"].controller.last_action != "cut_yield"
    assert core.limiters["internal"].limit == 8


def test_a_mix_slow_at_any_load_gets_back_the_cap_a_spike_cut():
    """The spike scenario's interactive p95 is ~1.4 s of a 2 s SLO at any load: inside the band (raise under
    0.6, cut over 0.8). After a spike's cuts, at calm load again, the cap bound, nothing was slow, and it held:
    60% load was refused until the run ended. At the p95 it had while the cap did not bind, it recovers."""
    spec = AdaptiveSpec(enabled=True, min_limit=4, max_limit=48, interval_s=1.0, window_s=5, min_samples=10,
                        cut_at=0.8, raise_below=0.6)
    ctl = AdaptiveLimit(spec, slo_s=2.0, initial=16)
    sat = PoolSaturation()
    calm = run(ctl, 0, 20, latency=1.4, inflight=8, sat=sat)          # calm: the cap does not bind
    assert set(calm) == {16} and 1.4 <= ctl.calm_p95 < 1.55  # (the window's quantile is bucketed)
    sat.saturated = True
    spike = run(ctl, 20, 5, latency=1.9, inflight=lambda c: c.limit, sat=sat)
    assert spike[-1] <= 6
    sat.saturated = False
    after = run(ctl, 25, 40, latency=1.4, inflight=lambda c: c.limit, sat=sat)  # binding, p95 back at calm
    assert after[-1] >= 12, after
    assert all(0 <= b - a <= spec.increase for a, b in zip(after[1:], after[2:])), after  # a step at a time


def test_no_recovery_while_load_keeps_the_p95_over_its_calm_level():
    # The same cut, but the p95 stays 1.4 s with a calm p95 of 1.0 s: load is what slows it, so the band holds.
    spec = AdaptiveSpec(enabled=True, min_limit=4, max_limit=48, interval_s=1.0, window_s=5, min_samples=10,
                        cut_at=0.8, raise_below=0.6)
    ctl = AdaptiveLimit(spec, slo_s=2.0, initial=16)
    sat = PoolSaturation()
    run(ctl, 0, 20, latency=1.0, inflight=8, sat=sat)
    sat.saturated = True
    cut = run(ctl, 20, 5, latency=1.9, inflight=lambda c: c.limit, sat=sat)[-1]
    sat.saturated = False
    after = run(ctl, 25, 40, latency=1.4, inflight=lambda c: c.limit, sat=sat)
    assert after[-1] <= cut and set(after[5:]) == {after[-1]} and ctl.last_action == "hold", after


def test_an_early_rejection_names_the_bound_it_missed(clock):
    # The message said "within its 200 ms queue deadline" whatever refused it: a request whose own deadline header
    # was 50 ms, or one refused because wait + its predicted service time passed the SLO, sent the on-call to
    # the class's max_wait_ms, which was met.
    core = early_core(clock, max_wait_ms=2000, slo_p95_ms=300)
    drain_at(core, clock, per_s=5)  # ~0.2 s a place
    core.decide(RequestFacts(header_class="interactive", model="llama"))
    own = core.decide(RequestFacts(header_class="interactive", model="llama", deadline_ms=50))
    assert own.reason == "deadline_unmeetable"
    assert "50 ms deadline" in own.message and "2000" not in own.message, own.message
    core.cost_models["llama"].samples = 20  # learned: the SLO half applies
    slo = core.decide(RequestFacts(header_class="interactive", model="llama"))
    assert slo.reason == "deadline_unmeetable"
    assert "300 ms SLO" in slo.message, slo.message


def test_a_full_cap_binds_after_cuts_left_its_limit_fractional():
    """Two saturation cuts take 4 to 3.2 and then 2.56: the cap is 2 slots. With both held and fast completions it
    binds and rises; read against 2.56 it was 78% bound, under `binding`, and held at 2 for good."""
    ctl = AdaptiveLimit(SPEC, slo_s=2.0, initial=4)
    sat = PoolSaturation()
    sat.saturated = True
    assert ctl.update(0.0, 2, sat) == 3 and ctl.update(1.0, 2, sat) == 2
    for k in range(10):
        ctl.observe(1.5 + k / 10, 0.5, admitted_at=1.5)
    assert ctl.update(2.5, 2, PoolSaturation()) == 3 and ctl.last_action == "raise"


def one_adaptive_class(max_concurrency: int = 8, enabled: bool = True, **knobs):
    adaptive = {"enabled": enabled, "min_limit": 2, "max_limit": 16, "interval_s": 1, "window_s": 5,
                "min_samples": 5, **knobs}
    return make_policy(classes={"interactive": {"max_concurrency": max_concurrency, "max_queue": 0, "max_wait_ms": 0,
                                                "slo_p95_ms": 2000, "adaptive": adaptive}}, tenants=[])


def test_a_reload_that_tunes_an_adaptive_class_keeps_the_cap_it_learned(clock):
    """Found by test_adaptive_model: a reload that changed any adaptive knob (or the SLO) rebuilt the controller
    at `max_concurrency`: a cap cut to its floor on a saturated pool jumped back to 8 mid-incident when an operator
    only tuned `cut_at`, and the new controller moved at its first tick. The cap carries over (within the new
    bounds), and so does when it last moved; a reload that turns adaptive on starts from `max_concurrency`."""
    core = AdmissionController(one_adaptive_class(), clock=clock)
    lim = core.limiters["interactive"]
    for t in hold(core, "interactive", 1):
        core.finish(t, Outcome.OK)  # the class sends to pool_a: it heeds its saturation
    sat = PoolSaturation()
    sat.saturated = True
    for _ in range(8):
        clock.advance(1.0)
        sat.updated_at = clock.t
        core.set_saturation("pool_a", sat)
        core.tick()
    assert lim.limit == 2
    moved_at = lim.controller._last
    clock.advance(0.1)
    core.apply(one_adaptive_class(cut_at=0.8))
    assert lim.limit == 2 and lim.controller.spec.cut_at == 0.8
    assert lim.controller._last == moved_at  # its next move is an interval after the last, not at the next tick
    core.apply(one_adaptive_class(cut_at=0.8, min_limit=3))
    assert lim.limit == 3  # within the new bounds
    core.apply(one_adaptive_class(max_concurrency=6, enabled=False))
    core.apply(one_adaptive_class(max_concurrency=6))
    assert lim.limit == 6  # turned on: starts from max_concurrency


def test_a_reload_keeps_the_yields_asked_before_it(clock):
    """Found by test_adaptive_model: a reload dropped the asks the lower classes had not acted on yet. A breaker
    reset for batch to yield, or a move that asked it while batch's interval had not passed, left batch at its
    cap when a reload came in between (any reload: here one that only deepens a queue, or retunes batch)."""
    adaptive = {"enabled": True, "min_limit": 2, "max_limit": 16, "interval_s": 1, "window_s": 5, "min_samples": 5}
    lb = {"window_s": 10, "min_samples": 5, "cooldown_s": 5, "trickle": 0.1, "trickle_s": 10}

    def classes(batch_queue):  # interactive's cap is static: only its breaker asks batch to yield
        return {"interactive": {"max_concurrency": 8, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 2000,
                                "latency_breaker": lb, "on_overflow": "fallback",
                                "fallback": {"action": "degrade", "model": "small"}},
                "batch": {"max_concurrency": 8, "max_queue": batch_queue, "max_wait_ms": 1000,
                          "slo_p95_ms": 60000, "adaptive": adaptive}}
    core = AdmissionController(make_policy(classes=classes(0), tenants=[]), clock=clock)
    hold(core, "batch", 6)
    serve_slow(core, clock, 6, 3.0)
    d = core.decide(RequestFacts(header_class="interactive", model="llama"))  # the breaker is reset, batch asked
    assert d.kind == ACCEPT and not d.ticket.degraded
    core.finish(d.ticket, Outcome.OK)
    core.apply(make_policy(classes=classes(4), tenants=[]))
    clock.advance(1.0)
    core.tick()
    assert core.limiters["batch"].controller.last_action == "cut_yield" and core.limiters["batch"].limit < 6

    # Batch moves every 2 s, interactive every second: interactive asks while batch's interval has not passed,
    # then moves on (calm again) before batch moves. Batch yields at its next move, a reload that retunes it or not.
    adaptive = {"enabled": True, "min_limit": 2, "max_limit": 16, "interval_s": 1, "window_s": 5, "min_samples": 5}

    def classes(decrease):
        return {"interactive": {"max_concurrency": 8, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 2000,
                                "adaptive": adaptive},
                "batch": {"max_concurrency": 8, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 60000,
                          "adaptive": {**adaptive, "interval_s": 2, "decrease": decrease}}}
    core = AdmissionController(make_policy(classes=classes(0.8), tenants=[]), clock=clock)
    hold(core, "batch", 6)
    core.tick()  # both move (hold): batch next moves 2 s later
    for t in hold(core, "interactive", 6):
        clock.advance(0.05)
        core.finish(t, Outcome.OK)
        core.report(t.id, Completion(Outcome.OK, 200, None, 3.0))  # p95 3 s against a 2 s SLO
    clock.advance(0.75)
    core.tick()  # interactive asks batch to yield; batch's interval has not passed
    assert core.limiters["interactive"].controller.last_action == "ask_yield"
    assert core.limiters["batch"].limit == 8
    core.apply(make_policy(classes=classes(0.5), tenants=[]))
    clock.advance(1.0)
    core.tick()  # interactive moves first, calm now (its window starts again after the ask); then batch
    assert core.limiters["interactive"].controller.last_action != "ask_yield"
    assert core.limiters["batch"].controller.last_action == "cut_yield"
    assert core.limiters["batch"].limit == 3  # 6 held x 0.5


def test_classes_that_shared_a_pool_a_reload_removed_no_longer_yield_to_each_other(clock):
    """Each class remembers the pools it sent to (whose saturation it heeds, and where the classes below it yield).
    A pool a reload removed stayed among them: interactive, slow on pool_b, had batch cut for what it ran on
    pool_c, because both had once sent to pool_a."""
    core = two_adaptive_classes(clock)
    for cls in ("interactive", "batch"):
        core.finish(hold(core, cls, 1)[0], Outcome.OK)  # both on pool_a
    core.apply(two_adaptive_policy(models={"small": {"cluster": "pool_b"}, "big": {"cluster": "pool_c"}}))
    for _ in range(6):
        core.decide(RequestFacts(header_class="batch", model="big"))
    for _ in range(6):
        t = core.decide(RequestFacts(header_class="interactive", model="small")).ticket
        clock.advance(0.5)
        core.finish(t, Outcome.OK)
        core.report(t.id, Completion(Outcome.OK, 200, None, 3.0))  # p95 3 s against a 2 s SLO
    clock.advance(1.0)
    core.tick()
    assert core.limiters["interactive"].controller.last_action == "cut_latency"  # nobody below it on pool_b
    assert core.limiters["batch"].limit == 8


def test_sequences_decoded_together_are_predicted_one_sequence_long(clock):
    # n=8 (or a completions list of 8 prompts) decodes its sequences side by side: it takes about as long as one.
    # Its GPU-seconds (8 sequences' decode) were taken as its service time, and it was refused as unable to make
    # the class's SLO ("predicted ... service 5.x s") where the same request with n=1 was queued, ~0.7 s predicted.
    core = early_core(clock, max_wait_ms=5000, slo_p95_ms=3000)
    drain_at(core, clock, per_s=5)
    core.cost_models["llama"].samples = 20  # learned: the SLO half applies
    core.decide(RequestFacts(header_class="interactive", model="llama"))
    one = core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=500))
    assert one.kind == QUEUE, one.message
    eight = core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=500, sequences=8))
    assert eight.kind == QUEUE, eight.message
    assert eight.charge.estimate.gpu_seconds > 3.0  # its charge is still all 8 sequences'


def test_an_adaptive_cap_holds_while_no_replica_of_its_pool_is_up(clock):
    """Every replica down (refusing connections, or none listed) is no word on load: read as saturation it cut
    the cap to its floor, and the replicas came back to a class held at min_limit, one step a window back up."""
    core = AdmissionController(one_adaptive_class(), clock=clock)
    lim = core.limiters["interactive"]
    for _ in range(30):
        clock.advance(1.0)
        down = PoolSaturation()
        down.saturated, down.down, down.updated_at = True, True, clock.t
        core.set_saturation("pool_a", down)
        for t in hold(core, "interactive", 1):
            core.finish(t, Outcome.UPSTREAM_ERROR)  # Envoy: no healthy upstream
        core.tick()
    assert lim.limit == 8
