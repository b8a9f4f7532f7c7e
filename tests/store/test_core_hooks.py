"""The core's hooks for a shared store: gated admissions are counted once, when confirmed or revoked."""

from __future__ import annotations

from extproc.policy.admission import ACCEPT, DEGRADE, QUEUE, REJECT, AdmissionController, RequestFacts
from extproc.policy.slot_store import local_share
from tests.conftest import FakeClock, RecordedEvents, make_policy


def facts(cls: str = "interactive") -> RequestFacts:
    return RequestFacts(header_class=cls, model="llama", max_tokens=10)


def gated_core(**overrides) -> tuple[AdmissionController, RecordedEvents, FakeClock]:
    clock, events = FakeClock(), RecordedEvents()
    core = AdmissionController(make_policy(**overrides), clock=clock, events=events)
    core.shared_slots = True
    return core, events, clock


def test_a_gated_admission_is_counted_when_confirmed_not_when_decided():
    core, events, _ = gated_core()
    d = core.decide(facts())
    assert d.kind == ACCEPT and core.gated(d)
    assert events.outcomes == []
    core.confirm(d)
    assert events.outcomes == [(ACCEPT, "slot_free")]


def test_revoke_gives_the_local_slot_back_and_counts_only_the_refusal():
    core, events, clock = gated_core()
    d = core.decide(facts())
    clock.advance(0.2)
    r = core.revoke(d, "queue_timeout", "no global slot")
    assert (r.kind, r.status, r.reason) == (REJECT, 429, "queue_timeout")
    assert abs(r.waited_s - 0.2) < 1e-9 and r.retry_after >= 1
    assert core.limiters["interactive"].inflight == 0 and not core.tickets
    assert events.outcomes == [(REJECT, "queue_timeout")]
    assert core.revoke(d, "queue_timeout", "again").kind == REJECT  # the slot is not given back twice
    assert core.limiters["interactive"].inflight == 0


def test_revoke_hands_the_freed_local_slot_to_the_queue():
    core, events, _ = gated_core()
    held = [core.decide(facts()) for _ in range(2)]
    q = core.decide(facts())
    assert q.kind == QUEUE
    core.revoke(held[0], "queue_timeout", "no global slot")
    assert q.waiter.result.kind == ACCEPT and core.gated(q.waiter.result)


def test_a_timed_out_global_wait_takes_the_class_fallback_when_configured():
    core, events, _ = gated_core(classes={
        "interactive": {"max_concurrency": 2, "max_wait_ms": 200, "on_overflow": "fallback",
                        "fallback": {"action": "degrade", "model": "small"}},
        "batch": {"max_concurrency": 3}})
    d = core.decide(facts())
    r = core.revoke(d, "queue_timeout", "no global slot")
    assert r.kind == DEGRADE and r.ticket is not None and r.cluster == "pool_b" and not core.gated(r)
    assert events.outcomes == [(DEGRADE, "queue_timeout")]


def test_a_global_wait_its_fallback_refuses_names_the_wait_it_had():
    # A request's own 50 ms deadline ended its wait: its refusal was told the class's 200 ms.
    core, _, clock = gated_core(classes={
        "interactive": {"max_concurrency": 2, "max_wait_ms": 200, "on_overflow": "fallback",
                        "fallback": {"action": "reject"}},
        "batch": {"max_concurrency": 3}})
    d = core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=10, deadline_ms=50))
    core.await_store(d)
    clock.advance(0.05)
    r = core.revoke(d, "queue_timeout", "no global slot")
    assert (r.kind, r.reason) == (REJECT, "queue_timeout") and "within 50 ms" in r.message, r.message


def test_a_timed_out_global_wait_of_a_class_a_reload_removed_is_refused_not_sent_to_its_gone_fallback():
    # A request whose store wait began as the reload went in (SharedSlots.apply refuses only those already waiting)
    # timed out into its class's fallback, which the reload had taken away with the class: a KeyError (its
    # degraded slots are forgotten when none runs), and a 500 for a client that had waited its whole max wait.
    fallback = {"max_concurrency": 2, "max_wait_ms": 200, "on_overflow": "fallback",
                "fallback": {"action": "degrade", "model": "small"}}
    core, events, _ = gated_core(classes={"interactive": fallback, "batch": {"max_concurrency": 3}})
    d = core.decide(facts())
    core.apply(make_policy(classes={"batch": {"max_concurrency": 3}}, default_class="batch"))
    r = core.revoke(d, "queue_timeout", "no global slot")
    assert (r.kind, r.reason, r.status) == (REJECT, "queue_timeout", 429) and r.ticket is None
    assert not core.tickets and not core._retired


def test_shadow_and_degraded_admissions_are_not_gated():
    core, events, _ = gated_core(mode="shadow")
    assert not core.gated(core.decide(facts()))


def test_local_share_divides_caps_and_budgets_with_at_least_one_slot():
    policy = make_policy(classes={"interactive": {"max_concurrency": 8, "max_inflight_gpu_seconds": 10.0},
                                  "batch": {"max_concurrency": 1}})
    share = local_share(policy, 3)
    assert share.classes["interactive"].max_concurrency == 2
    assert share.classes["interactive"].max_inflight_gpu_seconds == 10.0 / 3
    assert share.classes["batch"].max_concurrency == 1 and share.classes["batch"].max_inflight_gpu_seconds is None
    assert local_share(policy, 1) is policy


def test_local_share_divides_an_adaptive_caps_bounds():
    policy = make_policy(classes={"interactive": {"max_concurrency": 16, "slo_p95_ms": 2000, "adaptive": {
        "enabled": True, "min_limit": 4, "max_limit": 64}}, "batch": {"max_concurrency": 4}})
    adaptive = local_share(policy, 4).classes["interactive"].adaptive
    assert (adaptive.min_limit, adaptive.max_limit) == (1, 16)


def test_a_global_wait_its_lease_outlived_is_refused_with_the_wait_it_had():
    """The lease of an admission waiting for the shared store's global slot ran out (the reap closed it): its
    refusal said "no free slot within 200 ms", the class's max_wait_ms, after a wait of the whole lease."""
    core, events, clock = gated_core(classes={"interactive": {"max_concurrency": 2, "max_wait_ms": 200}}, tenants=[])
    d = core.decide(facts())
    core.await_store(d)
    waited = core._lease_s + 1.0
    clock.advance(waited)
    core.reap()
    r = core.confirm(d, waited_s=waited)
    assert (r.kind, r.status, r.reason) == (REJECT, 429, "queue_timeout")
    assert f"within {round(waited * 1000)} ms" in r.message and "within 200 ms" not in r.message, r.message
    assert core.limiters["interactive"].inflight == 0
