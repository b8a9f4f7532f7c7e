"""A request waiting for a shared store's global slot is waiting, not running: it counts in its class's queue depth
and once as a queue entry, holds its local slot only as a reservation, and gives it back once however it ends."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from extproc.policy.admission import ACCEPT, QUEUE, REJECT, AdmissionController, RequestFacts
from extproc.policy.limits import Outcome
from extproc.server.final_admission import FinalAdmission
from extproc.store.shared_slots import SharedSlots
from extproc.telemetry import Telemetry
from tests.conftest import FakeClock, RecordedEvents, make_policy, until
from tests.store.test_share_fallback import FakeStore


def facts() -> RequestFacts:
    return RequestFacts(header_class="interactive", model="llama", max_tokens=10)


def gated_core(**overrides) -> tuple[AdmissionController, RecordedEvents, FakeClock]:
    clock, events = FakeClock(), RecordedEvents()
    core = AdmissionController(make_policy(**overrides), clock=clock, events=events)
    core.shared_slots = True
    return core, events, clock


def counts(core: AdmissionController, cls: str = "interactive") -> tuple[float, float]:
    s = core.snapshot()[cls]
    return s["inflight"], s["queue"]


def test_an_admission_waiting_for_the_store_is_queued_not_in_flight():
    core, events, clock = gated_core()
    d = core.decide(facts())
    core.await_store(d)
    assert counts(core) == (0, 1) and core.snapshot()["interactive"]["inflight_cost"] == 0
    assert events.entries == ["interactive"] and events.outcomes == []
    core.await_store(d)  # once per admission
    assert counts(core) == (0, 1) and events.entries == ["interactive"]
    clock.advance(0.3)
    core.confirm(d, 0.3)
    assert counts(core) == (1, 0) and events.outcomes == [(ACCEPT, "dequeued")]
    assert events.entries == ["interactive"]  # counted as queued once, when it began to wait
    core.finish(d.ticket, Outcome.OK)
    assert counts(core) == (0, 0) and core.limiters["interactive"].inflight == 0


def test_a_slot_granted_by_the_store_at_once_is_never_queued():
    core, events, _ = gated_core()
    d = core.decide(facts())
    assert counts(core) == (1, 0)
    core.confirm(d)
    assert counts(core) == (1, 0) and events.entries == []


def test_a_revoked_wait_gives_its_reserved_slot_back_once():
    core, events, _ = gated_core()
    d = core.decide(facts())
    core.await_store(d)
    core.revoke(d, "client_disconnected", "left")
    core.revoke(d, "client_disconnected", "again")
    lim = core.limiters["interactive"]
    assert counts(core) == (0, 0) and (lim.inflight, lim.reserved) == (0, 0) and not core.tickets


def test_a_lease_that_expires_while_waiting_for_the_store_frees_the_reservation():
    core, events, clock = gated_core()
    d = core.decide(facts())
    core.await_store(d)
    clock.advance(core.policy.lease_ms / 1000.0 + 1)
    core.reap()
    lim = core.limiters["interactive"]
    assert counts(core) == (0, 0) and (lim.inflight, lim.reserved) == (0, 0)


def test_a_wait_whose_lease_ran_out_takes_no_fallback_when_it_times_out_and_is_charged_once():
    # The safety net released it as a request that ran (charged, accounted): a degrade at the wait's end admitted
    # it a second time, and its tenant paid two requests for one it never got.
    core, events, clock = gated_core(
        classes={"interactive": {"max_concurrency": 2, "max_wait_ms": 5000, "on_overflow": "fallback",
                                 "fallback": {"action": "degrade", "model": "small"}}},
        tenants=[{"name": "t", "api_keys": ["k"], "requests_per_minute": 60, "max_class": "interactive"}],
        lease_ms=1000)
    d = core.decide(RequestFacts(api_key="k", header_class="interactive", model="llama", max_tokens=10))
    bucket = core.tenant_limits["t"].requests
    core.await_store(d)
    clock.advance(1.5)
    core.reap()
    r = core.revoke(d, "queue_timeout", "no global slot")
    assert (r.kind, r.reason, r.ticket) == (REJECT, "queue_timeout", None)
    assert bucket.refill(clock()) == bucket.capacity  # the one request it took is refilled (1 a second) by now
    assert not core.tickets and core.degraded["interactive"].inflight == 0


def test_waits_whose_leases_ran_out_are_no_errors_of_the_pool_and_cost_nothing():
    # The safety net ended them as requests that ran and expired: each an error for the class's error breaker on a
    # pool they never reached (4 opened it), and a completion its tenant paid for.
    core, events, clock = gated_core(
        classes={"interactive": {"max_concurrency": 8, "max_wait_ms": 5000,
                                 "error_breaker": {"min_requests": 4, "cooldown_s": 10}}},
        tenants=[{"name": "t", "api_keys": ["k"], "requests_per_minute": 60, "burst_s": 10,
                  "max_class": "interactive"}],
        lease_ms=1000)
    bucket = core.tenant_limits["t"].requests
    ds = [core.decide(RequestFacts(api_key="k", header_class="interactive", model="llama", max_tokens=10))
          for _ in range(4)]
    for d in ds:
        core.await_store(d)
    clock.advance(1.5)
    assert core.reap() == [d.ticket for d in ds]
    lim = core.limiters["interactive"]
    assert (lim.inflight, lim.reserved) == (0, 0) and not core.tickets
    assert bucket.refill(clock()) == bucket.capacity
    assert [b.state for b in core.breakers[("interactive", "pool_a")]] == ["closed"]
    assert core.decide(RequestFacts(api_key="k", header_class="interactive", model="llama")).kind == ACCEPT


def test_a_request_queued_locally_then_waiting_for_the_store_is_one_queue_entry():
    core, events, clock = gated_core()
    held = [core.decide(facts()) for _ in range(2)]
    for d in held:
        core.confirm(d)
    q = core.decide(facts())
    assert q.kind == QUEUE and counts(core) == (2, 1) and events.entries == ["interactive"]
    core.finish(held[0].ticket, Outcome.OK)
    granted = q.waiter.result
    assert core.gated(granted)
    core.await_store(granted)
    assert counts(core) == (1, 1) and events.entries == ["interactive"]
    core.confirm(granted, 0.1)
    assert counts(core) == (2, 0) and events.entries == ["interactive"]


def replica(store: FakeStore, registry: CollectorRegistry) -> SharedSlots:
    policy = make_policy(classes={"interactive": {"max_concurrency": 4, "max_queue": 10, "max_wait_ms": 5000}},
                         tenants=[], store={"kind": "redis", "url": "redis://fake", "poll_ms": 20})
    telemetry = Telemetry(registry)
    core = AdmissionController(policy, events=telemetry)
    telemetry.watch(core)
    return SharedSlots(core, store)


async def settle(r: SharedSlots) -> tuple[FinalAdmission, asyncio.Task]:
    """What the stream does: decide, then await the final admission (here always a gated one)."""
    d = r.core.decide(facts())
    assert d.kind == ACCEPT and r.core.gated(d)
    fa = FinalAdmission(r.core, r, d)

    async def extend(seconds: float) -> None:
        pass

    return fa, asyncio.create_task(fa.settle(extend))


async def test_two_replicas_sharing_a_cap_of_4_report_4_in_flight_and_4_queued_in_all():
    store = FakeStore()
    registries = [CollectorRegistry(), CollectorRegistry()]
    a, b = (replica(store, reg) for reg in registries)
    await a.start(), await b.start()
    pending = [(r, *await settle(r)) for r in (a, b) for _ in range(4)]
    await until(lambda: sum(t.done() for _, _, t in pending), holds=lambda n: n == 4)
    await asyncio.sleep(0.05)  # the waiters' polls: none may be admitted (what must NOT happen needs a wait)
    running = [(r, t.result()) for r, _, t in pending if t.done()]
    assert len(running) == 4 and all(d.kind == ACCEPT for _, d in running)

    def total(name: str) -> float:
        return sum(reg.get_sample_value(name, {"class": "interactive"}) or 0.0 for reg in registries)

    assert (total("extproc_inflight"), total("extproc_queue_depth")) == (4, 4)
    assert total("extproc_queue_entries_total") == 4

    # A waiting client leaves: its reservation and its place at the store go, once.
    fa, task = next((fa, t) for _, fa, t in pending if not t.done())
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert fa.give_back() is None
    assert (total("extproc_inflight"), total("extproc_queue_depth")) == (4, 3)

    # The running ones end: the 3 still waiting get the freed global slots.
    for r, d in running:
        r.core.finish(d.ticket, Outcome.OK)
        r.release(d.ticket)
    await until(lambda: sum(t.done() for _, _, t in pending), holds=lambda n: n == 8)
    later = [t.result() for _, _, t in pending if not t.cancelled() and t.result().reason == "dequeued"]
    assert len(later) == 3 and all(d.kind == ACCEPT for d in later)
    assert await until(lambda: len(store.slots["interactive"]), holds=lambda n: n == 3) == 3
    assert (total("extproc_inflight"), total("extproc_queue_depth")) == (3, 0)
    assert total("extproc_queue_entries_total") == 4
    for r in (a, b):
        lim = r.core.limiters["interactive"]
        assert lim.reserved == 0 and lim.inflight == len(r.held)
    await a.close(), await b.close()


async def test_a_wait_whose_lease_ran_out_is_refused_when_the_store_grants_it_and_its_global_slot_goes_back():
    # The safety net closed the ticket while it waited for the store (the lease is shorter than the class's wait);
    # the store's later grant confirmed it anyway: the request ran holding no local slot, and its global slot, which
    # no stream would release any more (finish() of a closed ticket), was renewed forever.
    store, clock = FakeStore(), FakeClock()
    policy = make_policy(classes={"interactive": {"max_concurrency": 4, "max_queue": 10, "max_wait_ms": 5000}},
                         tenants=[], lease_ms=1000, store={"kind": "redis", "url": "redis://fake", "poll_ms": 20})
    r = SharedSlots(AdmissionController(policy, clock=clock), store)
    await r.start()
    store.slots["interactive"] = {f"other:{i}" for i in range(4)}  # another replica holds the whole cap
    fa, task = await settle(r)
    await until(lambda: r.core.limiters["interactive"].reserved, holds=lambda n: n == 1)
    clock.advance(1.5)
    for t in r.core.reap():  # what housekeeping does with the expired tickets
        r.release(t)
    store.slots["interactive"].discard("other:0")
    r._wake("interactive")
    d = await asyncio.wait_for(task, 2.0)
    assert d.ticket is None and d.status == 429
    assert await until(lambda: len(store.slots["interactive"]), holds=lambda n: n == 3) == 3
    lim = r.core.limiters["interactive"]
    assert not r.held and (lim.inflight, lim.reserved) == (0, 0) and not r.core.tickets
    await r.close()


@pytest.mark.parametrize("key, before, reason", [("sk-b", {"allow": False}, "invalid_api_key"),
                                                  (None, {}, "missing_api_key"),
                                                  ("sk-guess", {}, "invalid_api_key")])
async def test_a_wait_a_reload_revokes_under_keys_only_is_refused_as_its_local_queue_is(key, before, reason):
    # configuration.md: with anonymous.allow false, queued requests of a tenant a reload removed, and anonymous ones,
    # get the 401 they now get at arrival. Those waiting in the class queue did; one waiting for the store's global
    # slot (queued too: it counts in the queue depth) was admitted when a slot freed, and ran on a revoked key.
    store = FakeStore()
    tenants = [{"name": "a", "api_keys": ["sk-a"]}, {"name": "b", "api_keys": ["sk-b"]}]
    classes = {"interactive": {"max_concurrency": 1, "max_queue": 10, "max_wait_ms": 5000}}
    shared = {"kind": "redis", "url": "redis://fake", "poll_ms": 20}
    r = SharedSlots(AdmissionController(make_policy(classes=classes, tenants=tenants, anonymous=before,
                                                    store=shared)), store)
    await r.start()
    store.slots["interactive"] = {"other:0"}  # another replica holds the whole cap
    d = r.core.decide(RequestFacts(api_key=key, header_class="interactive", model="llama", max_tokens=10))
    assert d.kind == ACCEPT and r.core.gated(d)
    task = asyncio.create_task(FinalAdmission(r.core, r, d).settle(lambda s: asyncio.sleep(0)))
    await until(lambda: r.core.limiters["interactive"].reserved, holds=lambda n: n == 1)
    r.apply(make_policy(classes=classes, tenants=tenants[:1], anonymous={"allow": False}, store=shared))
    store.slots["interactive"].discard("other:0")
    r._wake("interactive")
    out = await asyncio.wait_for(task, 2.0)
    assert (out.ticket, out.status, out.reason) == (None, 401, reason)
    lim = r.core.limiters["interactive"]
    assert (lim.inflight, lim.reserved) == (0, 0) and not r.core.tickets and not store.slots["interactive"]
    await r.close()


async def test_a_cancel_in_the_loop_turn_the_store_hands_the_slot_over_is_not_lost():
    # Python 3.11's asyncio.wait_for returned the slot and dropped the cancel (python/cpython#86296): the request of
    # a client that had gone was forwarded. The cancel goes on, and give_back() frees the global slot, once.
    store = FakeStore()
    r = replica(store, CollectorRegistry())
    await r.start()
    store.slots["interactive"] = {f"other:{i}" for i in range(4)}  # another replica holds the whole cap
    fa, task = await settle(r)
    await until(lambda: r.core.limiters["interactive"].reserved, holds=lambda n: n == 1)
    take = store.acquire

    async def acquire_as_the_client_leaves(claim):
        granted = await take(claim)
        if granted:  # the cancel runs in the turn the queue's pump hands this slot over, before the waiter wakes
            asyncio.get_running_loop().call_soon(task.cancel)
        return granted

    store.acquire = acquire_as_the_client_leaves
    store.slots["interactive"].discard("other:0")
    r._wake("interactive")
    await asyncio.wait([task], timeout=2.0)
    assert task.cancelled()
    assert fa.give_back() is None
    assert await until(lambda: len(store.slots["interactive"]), holds=lambda n: n == 3) == 3
    lim = r.core.limiters["interactive"]
    assert not r.held and (lim.inflight, lim.reserved) == (0, 0) and not r.core.tickets
    await r.close()
