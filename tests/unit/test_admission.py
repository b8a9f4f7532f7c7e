"""The admission core with a fake clock: accept, FIFO queues, deadlines, bounds, shedding, release once."""

from extproc.policy.admission import ACCEPT, INVALID, QUEUE, REJECT, SHED, AdmissionController, RequestFacts
from extproc.policy.limits import Completion, Outcome
from tests.conftest import CORE, limits, make_policy


def req(cls=None, key=None, model="llama", body_cls=None):
    return RequestFacts(api_key=key, header_class=cls, body_class=body_cls, model=model)


def fill(core, cls, n):
    return [core.decide(req(cls)) for _ in range(n)]


def test_accepts_while_the_class_has_free_slots(core):
    ds = fill(core, "interactive", 2)
    assert [d.kind for d in ds] == [ACCEPT, ACCEPT]
    assert ds[0].cluster == "pool_a"
    assert core.limiters["interactive"].inflight == 2


def test_queues_fifo_and_grants_in_arrival_order(core):
    a, _ = fill(core, "interactive", 2)
    q1, q2 = fill(core, "interactive", 2)
    assert q1.kind == q2.kind == QUEUE
    got = []
    q1.waiter.notify(lambda d: got.append(("q1", d.kind)))
    q2.waiter.notify(lambda d: got.append(("q2", d.kind)))
    core.finish(a.ticket, Outcome.OK)
    assert got == [("q1", ACCEPT)]
    assert q1.waiter.result.ticket is not None and q2.waiter.pending


def test_queue_full_rejects_with_429_and_retry_after(core):
    fill(core, "interactive", 4)
    d = core.decide(req("interactive"))
    assert (d.kind, d.status, d.reason) == (REJECT, 429, "queue_full")
    assert d.retry_after >= 1
    assert "interactive" in d.message


def test_a_waiter_past_its_deadline_is_rejected_not_granted(core, clock):
    a, _ = fill(core, "interactive", 2)
    (q,) = fill(core, "interactive", 1)
    clock.advance(0.25)  # max_wait_ms is 200
    core.finish(a.ticket, Outcome.OK)
    assert q.waiter.result.kind == REJECT and q.waiter.result.reason == "queue_timeout"
    assert q.waiter.result.status == 429
    assert core.limiters["interactive"].inflight == 1


def test_reap_expires_waiters_at_their_deadline(core, clock):
    fill(core, "interactive", 2)
    (q,) = fill(core, "interactive", 1)
    clock.advance(0.1)
    core.reap()
    assert q.waiter.pending
    clock.advance(0.11)
    core.reap()
    assert q.waiter.result.reason == "queue_timeout"
    assert not core.limiters["interactive"].queue


def test_a_queue_timeout_names_the_wait_the_request_had(clock):
    """Found through Envoy with `classify.deadline_header`: a request whose own 150 ms deadline ran out in a class
    that waits 5000 ms was refused "had no free slot within 5000 ms" (and so was its fallback's refusal): the
    client and the on-call read a wait it never had."""
    for overflow in ({}, {"on_overflow": "fallback"}):  # the fallback's action defaults to reject: its refusal
        batch = {"max_concurrency": 1, "max_queue": 5, "max_wait_ms": 5000, "early_reject": False, **overflow}
        policy = make_policy(classes={"batch": batch}, default_class="batch", tenants=[])
        core = AdmissionController(policy, clock=clock)
        core.decide(req("batch"))
        own = core.decide(RequestFacts(header_class="batch", model="llama", deadline_ms=150))
        full = core.decide(req("batch"))
        clock.advance(0.2)
        core.reap()
        assert own.waiter.result.reason == "queue_timeout" and full.waiter.pending
        assert own.waiter.result.message == "class 'batch' had no free slot within 150 ms", own.waiter.result.message
        clock.advance(5)
        core.reap()
        assert full.waiter.result.message == "class 'batch' had no free slot within 5000 ms", full.waiter.result.message


def test_abandoned_waiter_leaves_the_queue_at_once(core):
    fill(core, "interactive", 2)
    q1, q2 = fill(core, "interactive", 2)
    d = core.abandon(q1.waiter, timed_out=False)
    assert d.reason == "client_disconnected"
    assert list(core.limiters["interactive"].queue) == [q2.waiter]
    assert core.abandon(q1.waiter, timed_out=False) is None  # only once


def test_zero_wait_means_no_queue():
    core = AdmissionController(make_policy(classes={"only": {"max_concurrency": 1, "max_queue": 10,
                                                            "max_wait_ms": 0}}, tenants=[], default_class="only"))
    assert core.decide(req("only")).kind == ACCEPT
    assert core.decide(req("only")).kind == REJECT


def test_lower_classes_are_shed_while_the_first_class_is_saturated(core):
    fill(core, "interactive", 2)
    d = core.decide(req("batch"))
    assert (d.kind, d.status, d.reason) == (SHED, 503, "higher_class_saturated")
    assert d.retry_after >= 1
    assert core.decide(req("internal")).kind == SHED
    assert core.limiters["batch"].inflight == 0


def test_queued_lower_class_requests_are_shed_the_moment_the_higher_class_saturates(core):
    fill(core, "batch", 3)
    (qb,) = fill(core, "batch", 1)
    assert qb.kind == QUEUE
    fill(core, "interactive", 2)
    assert qb.waiter.result.kind == SHED
    assert not core.limiters["batch"].queue


def test_a_saturated_class_sheds_lower_classes_only_on_the_pools_it_uses():
    # An audit: batch on a calm 70B pool got 503 while interactive was saturated on the 8B's; refusing it freed
    # nothing interactive used. The CORE policy: llama on pool_a, small on pool_b.
    core = AdmissionController(make_policy())
    for _ in range(2):
        core.decide(req("interactive", model="small"))  # saturated, on pool_b only
    assert core.decide(req("batch", model="llama")).kind == ACCEPT
    assert core.decide(req("batch", model="small")).kind == SHED
    # Queued for pool_a, it is granted when batch has room, not shed; one queued for pool_b is shed.
    core = AdmissionController(make_policy(classes={**CORE["classes"], "batch": limits(1, 5, 5000)}))
    first = core.decide(req("batch", model="llama"))
    qa, qb = core.decide(req("batch", model="llama")), core.decide(req("batch", model="small"))
    assert (qa.kind, qb.kind) == (QUEUE, QUEUE)
    for _ in range(2):
        core.decide(req("interactive", model="small"))
    core.finish(first.ticket)
    assert qb.waiter.result.kind == SHED and qa.waiter.result.kind == ACCEPT


def test_a_class_at_its_own_cap_sheds_nothing_on_a_pool_with_a_pool_wide_limit():
    # An audit: critical at its class cap of 18 held 12% of a 58K-token limit, and the default shed sent
    # interactive (which has a degrade) and the queued lower classes 503s on a pool at 80% of its limit. The
    # pool's strict priority makes lower classes yield to a class waiting for room there; one waiting on its own
    # cap gains nothing from their refusal.
    core = AdmissionController(make_policy(pools={"pool_a": {"limit": {"enabled": True, "unit": "requests",
                                                                       "initial": 20, "max": 20}}}))
    fill(core, "interactive", 2)  # its cap
    assert core.decide(req("batch")).kind == ACCEPT
    assert core.decide(req("internal")).kind == ACCEPT


def test_shedding_is_configurable_and_can_be_disabled():
    core = AdmissionController(make_policy(shed={}))
    fill(core, "interactive", 2)
    assert core.decide(req("batch")).kind == ACCEPT
    core = AdmissionController(make_policy(shed={"batch": ["internal"]}))
    fill(core, "interactive", 2)
    assert core.decide(req("internal")).kind == ACCEPT
    fill(core, "batch", 3)
    assert core.decide(req("internal")).kind == SHED


def test_release_is_exactly_once(core):
    (a,) = fill(core, "interactive", 1)
    assert core.finish(a.ticket, Outcome.OK) is True
    assert core.finish(a.ticket, Outcome.CLIENT_ABORT) is False
    assert core.limiters["interactive"].inflight == 0


def test_lease_expiry_frees_a_slot_never_seen_to_end(clock):
    core = AdmissionController(make_policy(lease_ms=5000), clock=clock)
    (a,) = fill(core, "interactive", 1)
    clock.advance(4)
    core.renew(a.ticket)
    clock.advance(4)
    assert core.reap() == []
    clock.advance(2)
    assert core.reap() == [a.ticket]
    assert core.limiters["interactive"].inflight == 0 and a.ticket.closed


def test_unknown_model_is_404_and_takes_no_slot(core):
    d = core.decide(req("interactive", model="gpt-9"))
    assert (d.kind, d.status, d.reason) == (INVALID, 404, "unknown_model")
    assert core.limiters["interactive"].inflight == 0


def test_spoofed_class_is_demoted_to_the_tenant_cap(core):
    d = core.decide(req("interactive", key="sk-acme"))
    assert d.cls == "batch" and d.classification.demoted


def test_tenant_may_ask_for_a_lower_class(core):
    d = core.decide(req("internal", key="sk-acme"))
    assert d.cls == "internal" and not d.classification.demoted


def test_unknown_class_falls_back_to_the_default_and_is_flagged(core):
    d = core.decide(req("platinum"))
    assert d.cls == "interactive" and d.classification.unknown
    d = core.decide(req("platinum", key="sk-acme"))
    assert d.cls == "batch" and d.classification.unknown


def test_header_claim_wins_over_body_claim_and_tenant_default_applies_without_claim(core):
    assert core.decide(req("internal", body_cls="batch")).cls == "internal"
    assert core.decide(req(None, body_cls="batch")).cls == "batch"
    assert core.decide(req(None, key="sk-acme")).cls == "batch"
    assert core.decide(req(None)).cls == "interactive"


def test_retry_after_follows_the_observed_drain_rate(core, clock):
    tickets = [d.ticket for d in fill(core, "batch", 3)]
    for t in tickets:  # ~10 completions/s
        clock.advance(0.1)
        core.finish(t, Outcome.OK)
        core.decide(req("batch"))
    fill(core, "batch", 5)  # fills the queue
    d = core.decide(req("batch"))
    assert d.kind == REJECT and 1 <= d.retry_after <= 3


def test_reload_keeps_held_slots_and_releases_them_against_their_class(core):
    held = [d.ticket for d in fill(core, "interactive", 2)]
    core.apply(make_policy(classes={"interactive": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0},
                                    "batch": {"max_concurrency": 1}}))
    assert core.limiters["interactive"].inflight == 2
    assert core.decide(req("interactive")).kind == REJECT  # caps shrank below what is held
    for t in held:
        core.finish(t, Outcome.OK)
    assert core.limiters["interactive"].inflight == 0
    assert core.decide(req("interactive")).kind == ACCEPT


def test_reload_removing_a_class_rejects_its_waiters_and_drains_its_slots(core):
    held = [d.ticket for d in fill(core, "internal", 1)]
    (q,) = fill(core, "internal", 1)
    core.apply(make_policy(classes={"interactive": {"max_concurrency": 2}, "batch": {"max_concurrency": 3}},
                           tenants=[]))
    assert q.waiter.result.status == 503 and q.waiter.result.reason == "class_removed"
    assert core.snapshot()["internal"]["inflight"] == 1
    core.finish(held[0], Outcome.OK)
    assert "internal" not in core.snapshot()


def test_a_reload_to_keys_only_refuses_queued_anonymous_requests_as_it_would_new_ones(core):
    """configuration.md: under `anonymous.allow: false` a request with no key, or a key no tenant owns, gets 401.
    Those already queued got a slot when one freed, and ran anonymous under a policy that takes keys only."""
    held = [d.ticket for d in fill(core, "batch", 3)]
    no_key, unknown, owned = (core.decide(req("batch", key)) for key in (None, "sk-guess", "sk-acme"))
    assert no_key.kind == unknown.kind == owned.kind == QUEUE
    core.apply(make_policy(anonymous={"allow": False}))
    assert (no_key.waiter.result.status, no_key.waiter.result.reason) == (401, "missing_api_key")
    assert (unknown.waiter.result.status, unknown.waiter.result.reason) == (401, "invalid_api_key")
    assert "sk-guess" not in unknown.waiter.result.message and core.snapshot()["batch"]["queue"] == 1
    core.finish(held[0], Outcome.OK)
    assert owned.waiter.result.kind == ACCEPT and owned.waiter.result.tenant == "acme"


def test_a_class_put_back_while_its_old_requests_run_counts_them_against_its_cap(core):
    """Remove a class and put it back (a bad deploy reverted): its requests still running hold its slots, or the
    class runs its whole cap again on top of them."""
    three = {"interactive": {"max_concurrency": 2}, "batch": {"max_concurrency": 3}, "internal": {"max_concurrency": 1}}
    held = fill(core, "internal", 1)[0].ticket
    core.apply(make_policy(classes={k: v for k, v in three.items() if k != "internal"}, tenants=[]))
    core.apply(make_policy(classes=three, tenants=[]))
    assert core.snapshot()["internal"]["inflight"] == 1
    (late,) = fill(core, "internal", 1)
    assert late.kind != ACCEPT  # the one slot is still held by the request admitted before the removal
    core.finish(held, Outcome.OK)
    assert late.waiter.result.kind == ACCEPT and core.limiters["internal"].inflight == 1


def test_reloads_renaming_classes_keep_no_state_of_the_classes_they_removed(core):
    # Each class's degraded-slots limiter was created on first sight and never dropped: reloads that rename
    # classes kept one per name ever.
    for gen in range(50):
        core.apply(make_policy(classes={f"c{gen}": {"max_concurrency": 2}}, default_class=f"c{gen}", shed={},
                               tenants=[], anonymous={}))
    assert set(core.state.degraded) == {"c49"}


def test_a_reload_that_removes_a_pool_drops_its_breakers_and_a_late_outcome_does_not_bring_them_back(core, clock):
    """Breakers are kept per (class, pool) for every class still in the policy: those of a pool no model routes to
    any more stayed, open as they were, until a restart (an operator saw the removed pool's breaker on dashboards).
    A request still running there releases its slot and reports as usual, without building them again."""
    d = core.decide(req("interactive", model="small"))  # on pool_b
    (err,) = core.pool_breakers("interactive", "pool_b")
    for _ in range(err.min_requests):
        err.observe(clock(), True, False)
    assert err.state == "open"
    core.apply(make_policy(models={"llama": {"cluster": "pool_a"}}))
    assert ("interactive", "pool_b") not in core.breakers
    core.report(d.ticket.id, Completion(Outcome.UPSTREAM_ERROR, 503, None, 2.0))
    core.finish(d.ticket, Outcome.UPSTREAM_ERROR)
    assert core.limiters["interactive"].inflight == 0 and ("interactive", "pool_b") not in core.breakers
    core.apply(make_policy())  # pool_b back: a fresh pool, closed, whatever the old one was
    assert core.decide(req("interactive", model="small")).kind == ACCEPT
    assert [b.state for b in core.breakers["interactive", "pool_b"]] == ["closed"]


def test_a_waiter_granted_on_a_pool_a_reload_removed_does_not_put_the_pool_back_among_its_classs(core):
    """A reload keeps in each class's `pools` (whose saturation it heeds, where the classes below yield to it) only
    the pools a model still routes to. A waiter queued for a removed pool and granted after the reload added it
    back, until the next reload."""
    held = [core.decide(req("interactive", model="small")).ticket for _ in range(2)]  # interactive's cap: on pool_b
    late = core.decide(req("interactive", model="small"))
    assert late.kind == QUEUE and core.limiters["interactive"].pools == {"pool_b"}
    core.apply(make_policy(models={"llama": {"cluster": "pool_a"}}))
    assert core.limiters["interactive"].pools == set()
    core.finish(held[0], Outcome.OK)
    assert late.waiter.result.kind == ACCEPT and late.waiter.result.ticket.pool == "pool_b"
    assert core.limiters["interactive"].pools == set()
    for t in (held[1], late.waiter.result.ticket):
        core.report(t.id, Completion(Outcome.OK, 200, None, 1.0))
        core.finish(t, Outcome.OK)
    assert core.limiters["interactive"].inflight == 0 and core.limiters["interactive"].pools == set()
    assert ("interactive", "pool_b") not in core.breakers


def test_a_reload_that_changes_an_adaptive_classs_slo_moves_its_cap_against_the_new_one(core):
    # Found by a review: an adaptive cap is anchored to its class's SLO (it cuts over cut_at x slo_p95_ms), and a
    # reload kept the controller whenever the adaptive knobs were unchanged: an SLO tightened from 2 s to 0.5 s was
    # still judged against 2 s until a restart.
    def classes(slo_ms):
        return {"interactive": {"max_concurrency": 8, "slo_p95_ms": slo_ms, "adaptive": {"enabled": True}},
                "batch": {"max_concurrency": 3}, "internal": {"max_concurrency": 1}}

    core.apply(make_policy(classes=classes(2000)))
    kept = core.limiters["interactive"].controller
    core.apply(make_policy(classes=classes(2000)))
    assert core.limiters["interactive"].controller is kept  # unchanged: what it learned is kept
    core.apply(make_policy(classes=classes(500)))
    assert core.limiters["interactive"].controller.slo_s == 0.5


def test_raising_a_cap_on_reload_admits_waiters_at_once(core):
    fill(core, "batch", 3)
    (q,) = fill(core, "batch", 1)
    core.apply(make_policy(classes={"interactive": {"max_concurrency": 2}, "batch": {"max_concurrency": 4},
                                    "internal": {"max_concurrency": 1}}))
    assert q.waiter.result.kind == ACCEPT
