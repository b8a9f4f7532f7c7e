"""A request that waited in its class queue is counted like one that did not: its final decision carries how it
was classified (demoted, unknown class claimed), and it is counted once, at that decision."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from extproc.policy.admission import ACCEPT, QUEUE, REJECT, AdmissionController, RequestFacts
from extproc.policy.limits import Outcome
from extproc.telemetry import Telemetry

from tests.conftest import FakeClock, RecordedEvents, make_policy


def demoted(key: str = "sk-acme") -> RequestFacts:
    """acme's max_class is batch: a claim of interactive is demoted to batch (cap 3, queue 5)."""
    return RequestFacts(api_key=key, header_class="interactive", model="llama", max_tokens=10)


def core(events=None, clock=None, shared: bool = False) -> AdmissionController:
    c = AdmissionController(make_policy(), clock=clock or FakeClock(), events=events or RecordedEvents())
    c.shared_slots = shared
    return c


def test_a_granted_waiter_carries_its_classification_and_is_counted_once():
    events = RecordedEvents()
    c = core(events)
    first = [c.decide(demoted()) for _ in range(3)]
    queued = [c.decide(demoted()) for _ in range(3)]
    assert [d.kind for d in queued] == [QUEUE] * 3 and len(events.decisions) == 3
    for d in first:
        c.finish(d.ticket, Outcome.OK)
    assert [w.waiter.result.kind for w in queued] == [ACCEPT] * 3
    assert len(events.decisions) == 6  # each request once: the queued ones at their grant, not at queueing
    assert all(d.classification is not None and d.classification.demoted and d.cls == "batch"
               for d in events.decisions)


def test_a_waiter_refused_at_its_deadline_carries_its_classification():
    clock, events = FakeClock(), RecordedEvents()
    c = core(events, clock)
    for _ in range(3):
        c.decide(demoted())
    q = c.decide(demoted())
    clock.advance(6.0)  # past batch's max_wait_ms
    c.reap()
    assert q.waiter.result.kind == REJECT and q.waiter.result.classification.demoted
    assert events.decisions[-1] is q.waiter.result and len(events.decisions) == 4


def test_an_unknown_class_claim_that_waited_is_counted():
    registry = CollectorRegistry()
    c = core(Telemetry(registry))
    facts = RequestFacts(header_class="no-such-class", model="llama", max_tokens=10)  # -> interactive, cap 2
    held = [c.decide(facts) for _ in range(2)]
    queued = [c.decide(facts) for _ in range(2)]
    assert [d.kind for d in queued] == [QUEUE] * 2
    for d in held:
        c.finish(d.ticket, Outcome.OK)
    assert registry.get_sample_value("extproc_unknown_class_claims_total", {"tenant": "anonymous"}) == 4


def test_eight_demoted_claims_half_of_them_queued_are_eight_demotions():
    registry = CollectorRegistry()
    c = AdmissionController(make_policy(classes={"interactive": {"max_concurrency": 4},
                                                 "batch": {"max_concurrency": 4, "max_queue": 4,
                                                           "max_wait_ms": 5000}}),
                            clock=FakeClock(), events=Telemetry(registry))
    ds = [c.decide(demoted()) for _ in range(8)]
    assert [d.kind for d in ds] == [ACCEPT] * 4 + [QUEUE] * 4
    for d in ds[:4]:
        c.finish(d.ticket, Outcome.OK)
    assert registry.get_sample_value("extproc_class_demotions_total", {"tenant": "acme"}) == 8
    assert registry.get_sample_value("extproc_requests_total", {"class": "batch", "decision": "accept",
                                                                "reason": "dequeued"}) == 4


def test_a_queued_admission_gated_on_the_store_is_counted_once_with_its_classification():
    events = RecordedEvents()
    c = core(events, shared=True)
    first = [c.decide(demoted()) for _ in range(3)]
    for d in first:
        c.confirm(d)
    q = c.decide(demoted())
    c.finish(first[0].ticket, Outcome.OK)
    granted = q.waiter.result
    assert c.gated(granted) and len(events.decisions) == 3  # not counted until the store answers
    c.confirm(granted, 0.1)
    assert len(events.decisions) == 4 and events.decisions[-1].classification.demoted


def test_a_revoked_gated_admission_keeps_its_classification():
    events = RecordedEvents()
    c = core(events, shared=True)
    d = c.decide(demoted())
    r = c.revoke(d, "queue_timeout", "no global slot")
    assert r.kind == REJECT and r.classification is d.classification and r.classification.demoted
    assert events.decisions == [r]
