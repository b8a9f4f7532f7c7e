"""Failing open on the replica's share (store.on_failure: local) holds from the first moment of a store outage:
requests that were waiting for a global slot keep waiting, in order, for a place within the share."""

from __future__ import annotations

import asyncio

from extproc.policy.admission import ACCEPT, REJECT, AdmissionController, RequestFacts
from extproc.policy.limits import Outcome
from extproc.policy.slot_store import SlotClaim, StoreUnavailable
from extproc.store.shared_slots import LOCAL, SHARED, SharedSlots
from tests.conftest import make_policy, until

CAP, INSTANCES = 4, 2
SHARE = CAP // INSTANCES


class FakeStore:
    """A SlotStore in memory that can be taken down (calls fail at once, like a refused connection) or frozen
    (calls hang until the client's timeout, like a SIGSTOPped Redis)."""

    shared = True

    def __init__(self, timeout_s: float = 0.05):
        self.timeout_s = timeout_s
        self.slots: dict[str, set[str]] = {}
        self.state = "up"  # "up", "down" or "frozen"
        self._listeners = []

    async def _reach(self) -> None:
        if self.state == "frozen":
            await asyncio.sleep(self.timeout_s)
        if self.state != "up":
            raise StoreUnavailable(f"fake store {self.state}")

    async def acquire(self, claim: SlotClaim) -> bool:
        await self._reach()
        held = self.slots.setdefault(claim.cls, set())
        if claim.holder not in held and len(held) >= claim.cap:
            return False
        held.add(claim.holder)
        return True

    async def release(self, slots: list[tuple[str, str]]) -> None:
        await self._reach()
        for cls, holder in slots:
            self.slots.get(cls, set()).discard(holder)
            for callback in self._listeners:
                callback(cls)

    async def renew(self, held):
        await self._reach()
        return []

    async def adopt(self, claims):
        await self._reach()
        for c in claims:
            self.slots.setdefault(c.cls, set()).add(c.holder)

    async def ping(self) -> None:
        await self._reach()

    def on_release(self, callback) -> None:
        self._listeners.append(callback)

    def forget(self, cls: str) -> None:
        pass

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


def replica(store: FakeStore, max_wait_ms: int = 1000) -> SharedSlots:
    policy = make_policy(classes={"interactive": {"max_concurrency": CAP, "max_queue": 10,
                                                  "max_wait_ms": max_wait_ms}}, tenants=[],
                         store={"kind": "redis", "url": "redis://fake", "instances": INSTANCES,
                                "on_failure": "local", "poll_ms": 20})
    return SharedSlots(AdmissionController(policy), store)


async def admit(r: SharedSlots):
    """What the servicer does: decide, then one try, then a wait if the class is full across replicas."""
    d = r.core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=10))
    assert d.kind == ACCEPT and r.core.gated(d)
    return await r.try_now(d) or await r.wait(d)


def finish(r: SharedSlots, d) -> None:
    r.core.finish(d.ticket, Outcome.OK)
    r.release(d.ticket)


def running(r: SharedSlots) -> int:
    return len(r.held) + len(r.unshared)


async def a_replica_with_two_running_and_two_waiting(store: FakeStore, **kw):
    """The other replica holds half the global cap; this one runs SHARE requests and has SHARE more waiting."""
    store.slots["interactive"] = {f"other:{i}" for i in range(CAP - SHARE)}
    r = replica(store, **kw)
    await r.start()
    ran = [await admit(r) for _ in range(SHARE)]
    waiting = [asyncio.create_task(admit(r)) for _ in range(SHARE)]
    local_places = await until(lambda: r.core.limiters["interactive"].inflight, holds=lambda n: n == 2 * SHARE)
    assert local_places == 2 * SHARE  # local places: running + waiting
    assert running(r) == SHARE and not any(t.done() for t in waiting)
    return r, ran, waiting


async def test_waiters_are_not_admitted_at_once_when_the_store_goes_down():
    store = FakeStore()
    r, ran, waiting = await a_replica_with_two_running_and_two_waiting(store)
    store.state = "down"
    assert await until(lambda: r.state, holds=lambda s: s == LOCAL) == LOCAL  # the waiters' polls hit the outage
    assert r.core.limiters["interactive"].limit == SHARE
    await asyncio.sleep(0.2)  # time for a wrong admission to show: what must NOT happen needs a fixed wait
    assert running(r) == SHARE and not any(t.done() for t in waiting)  # the share is full already
    finish(r, ran[0])
    first = await asyncio.wait_for(waiting[0], 1)  # the freed share slot goes to the first waiter
    assert first.kind == ACCEPT and first.reason == "dequeued" and running(r) == SHARE
    assert not waiting[1].done()
    await r.close()


async def test_a_frozen_store_holds_the_share_the_same_way():
    store = FakeStore(timeout_s=0.1)
    r, ran, waiting = await a_replica_with_two_running_and_two_waiting(store)
    store.state = "frozen"
    assert await until(lambda: r.state, holds=lambda s: s == LOCAL) == LOCAL
    await asyncio.sleep(0.2)  # time for a wrong admission to show
    assert running(r) == SHARE and not any(t.done() for t in waiting)
    finish(r, ran[1])
    assert (await asyncio.wait_for(waiting[0], 1)).kind == ACCEPT
    assert running(r) == SHARE and not waiting[1].done()
    await r.close()


async def test_a_waiter_without_a_share_slot_by_its_deadline_gets_a_429():
    store = FakeStore()
    r, ran, waiting = await a_replica_with_two_running_and_two_waiting(store, max_wait_ms=400)
    store.state = "down"
    refused = await asyncio.wait_for(asyncio.gather(*waiting), 2)
    assert [(d.kind, d.status, d.reason) for d in refused] == [(REJECT, 429, "queue_timeout")] * SHARE
    assert running(r) == SHARE and r.core.limiters["interactive"].inflight == SHARE
    await r.close()


async def test_the_fallback_admits_waiters_up_to_the_share_when_it_has_room():
    store = FakeStore()
    store.slots["interactive"] = {f"other:{i}" for i in range(CAP - 1)}
    r = replica(store)
    await r.start()
    ran = await admit(r)  # the one global slot left
    waiting = [asyncio.create_task(admit(r)) for _ in range(3)]
    await asyncio.sleep(0.05)
    store.state = "down"
    first = await asyncio.wait_for(waiting[0], 1)
    await asyncio.sleep(0.1)
    assert first.kind == ACCEPT and running(r) == SHARE  # 1 from before the outage + 1 waiter
    assert not waiting[1].done() and not waiting[2].done()
    finish(r, ran)
    assert (await asyncio.wait_for(waiting[1], 1)).kind == ACCEPT  # in arrival order
    assert not waiting[2].done() and running(r) == SHARE
    await r.close()


async def test_each_worker_of_a_replica_admits_its_part_of_the_share():
    """`serve --workers 2` with Redis: both workers fail open at once, each on its own, so each may take only half
    of what `instances` gives the replica (one replica here), or the host runs twice the cap while Redis is down."""
    policy = make_policy(classes={"interactive": {"max_concurrency": CAP, "max_queue": 10, "max_wait_ms": 1000}},
                         tenants=[], store={"kind": "redis", "url": "redis://fake", "instances": 1,
                                            "on_failure": "local", "poll_ms": 20})
    store = FakeStore()
    r = SharedSlots(AdmissionController(policy), store, workers=2)
    await r.start()
    store.state = "down"
    first = await admit(r)  # the outage is found by this request's own round trip
    assert r.state == LOCAL and first.kind == ACCEPT
    assert r.core.limiters["interactive"].limit == CAP // 2
    await r.close()


def test_the_server_passes_its_worker_count_to_the_shared_slots(tmp_path):
    import argparse

    from extproc.policy.schema import load_policy_file
    from extproc.server.main import Server, add_arguments
    path = tmp_path / "policy.yaml"
    path.write_text("classes: {interactive: {max_concurrency: 4}}\nmodels: {llama: {cluster: pool_a}}\n"
                    "store: {kind: redis, url: 'redis://127.0.0.1:1/0', instances: 3}\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--policy", str(path), "--workers", "2", "--worker-index", "1"])
    server = Server(str(path), load_policy_file(str(path)), args)
    assert server.shared.instances == 6  # 3 replicas of 2 workers: 6 processes fail open on their own


async def test_a_request_whose_adoption_went_through_unanswered_is_released_when_it_ends():
    """The store came back and took the adoption of a request admitted during the outage, but its answer was lost
    (the store stalled again). The request then ended while the replica failed open, and as a slot the store was
    thought never to have, it was not released: the class counted a finished request until its lease ran out."""
    store = FakeStore()
    r = replica(store)
    await r.start()
    store.state = "down"
    await r.tick()  # the probe finds the outage
    d = await admit(r)
    assert r.state == LOCAL and r.unshared and not r._to_release
    store.state = "up"
    adopt = store.adopt

    async def adopt_unanswered(claims):
        await adopt(claims)
        store.adopt = adopt
        raise StoreUnavailable("fake store: the answer was lost")
    store.adopt = adopt_unanswered
    await r.tick()  # back to shared; the adoption goes through unanswered, and the replica fails open again
    assert r.state == LOCAL and store.slots["interactive"] == {f"{r.replica}:{d.ticket.id}"}
    finish(r, d)
    await r.tick()
    assert r.state == SHARED
    assert await until(lambda: store.slots["interactive"], holds=lambda s: not s, timeout=1) == set()
    await r.close()


async def test_a_release_older_than_a_lease_is_sent_again_all_the_same():
    """An acquire that timed out can still reach the store later (its bytes held by TCP through a partition, or
    queued in a stalled Redis) and take its slot with a fresh lease. The release sent after it failed was let go
    once older than a lease, as if the slot had expired, and the store counted a request that never ran for a whole
    lease after it came back."""
    from tests.conftest import FakeClock
    clock = FakeClock()
    store = FakeStore()
    r = SharedSlots(AdmissionController(replica(store).policy, clock=clock), store)
    await r.start()
    on_its_way = []

    async def acquire_late(claim):
        on_its_way.append(claim)
        raise StoreUnavailable("fake store: timed out, the call still on its way")
    acquire, store.acquire = store.acquire, acquire_late
    store.state = "down"
    d = await admit(r)  # the acquire times out: admitted on the share, its global slot released (that fails too)
    assert r.state == LOCAL and await until(lambda: r._unreleased)
    finish(r, d)
    clock.advance(r.policy.store.lease_ms / 1000.0 + 1)
    store.state, store.acquire = "up", acquire
    assert await acquire(on_its_way[0])  # the acquire reaches the store at last
    await r.tick()
    assert r.state == SHARED and store.slots["interactive"] == set()
    await r.close()


async def test_a_wait_that_begins_after_the_store_failed_closed_is_refused_at_once():
    """The store said the class was full; before the request began its wait (the servicer first sends Envoy its
    timeout extension) another call found the store gone and the replica failed closed. The requests waiting then
    got their 503 at once, but this one queued for a slot nobody asked the store for, and got a 429 after its whole
    wait."""
    import time
    policy = make_policy(classes={"interactive": {"max_concurrency": 1, "max_queue": 10, "max_wait_ms": 1000}},
                         tenants=[], store={"kind": "redis", "url": "redis://fake", "on_failure": "closed",
                                            "poll_ms": 20})
    store = FakeStore()
    store.slots["interactive"] = {"other:1"}
    r = SharedSlots(AdmissionController(policy), store)
    await r.start()
    d = r.core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=10))
    assert await r.try_now(d) is None  # full across the replicas: it will wait
    store.state = "down"
    await r.tick()  # the probe finds the store gone
    assert r.state == "closed"
    started = time.monotonic()
    refused = await asyncio.wait_for(r.wait(d), 5)
    assert (refused.kind, refused.status, refused.reason) == (REJECT, 503, "store_unavailable")
    assert time.monotonic() - started < 0.5 and r.core.limiters["interactive"].inflight == 0
    await r.close()


async def test_a_wait_that_begins_after_a_reload_removed_its_class_is_refused():
    """A reload removed the class between the request's first try and its wait (the servicer first sends Envoy its
    timeout extension): the waiters of the class were refused, but this one queued after them, got a global slot
    and ran under a class the policy no longer has."""
    policy = make_policy(classes={"interactive": {"max_concurrency": 1, "max_queue": 10, "max_wait_ms": 1000},
                                  "batch": {"max_concurrency": 1}}, default_class="batch", tenants=[],
                         store={"kind": "redis", "url": "redis://fake", "poll_ms": 20})
    store = FakeStore()
    store.slots["interactive"] = {"other:1"}
    r = SharedSlots(AdmissionController(policy), store)
    await r.start()
    d = r.core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=10))
    assert await r.try_now(d) is None  # full across the replicas: it will wait
    r.apply(make_policy(classes={"batch": {"max_concurrency": 1}}, default_class="batch", tenants=[],
                        store={"kind": "redis", "url": "redis://fake", "poll_ms": 20}))
    store.slots["interactive"].clear()  # the other replica's request ends
    out = await asyncio.wait_for(r.wait(d), 5)
    assert (out.kind, out.status, out.reason) == (REJECT, 503, "class_removed")
    assert not r.held and store.slots["interactive"] == set()
    await r.close()


async def test_a_class_a_reload_removed_leaves_no_queue_behind_even_with_its_pump_not_yet_started():
    """The replica's queue and wake-up of a class a reload removed stayed for the process's life. They go at the
    reload, or, when its waiters' pump is scheduled but has not run yet (removed in the same turn as a wait
    began), when that pump ends: dropped under it, it found no queue and never ended. The request the class
    ran before the removal still gives its slot back."""
    classes = {"interactive": {"max_concurrency": 2, "max_queue": 10, "max_wait_ms": 1000},
               "batch": {"max_concurrency": 1}}
    store_spec = {"kind": "redis", "url": "redis://fake", "poll_ms": 20}
    store = FakeStore()
    store.slots["interactive"] = {"other:1"}  # another replica's request
    r = SharedSlots(AdmissionController(make_policy(classes=classes, default_class="batch", tenants=[],
                                                    store=store_spec)), store)
    await r.start()
    running = r.core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=10))
    assert (await r.try_now(running)).kind == ACCEPT
    d = r.core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=10))
    assert await r.try_now(d) is None
    waiting = asyncio.create_task(r.wait(d))
    await asyncio.sleep(0)  # the wait is queued and its pump scheduled, not yet run
    assert "interactive" in r._pumps
    r.apply(make_policy(classes={"batch": {"max_concurrency": 1}}, default_class="batch", tenants=[],
                        store=store_spec))
    out = await asyncio.wait_for(waiting, 5)
    assert (out.kind, out.reason) == (REJECT, "class_removed")
    assert await until(lambda: not r._pumps, timeout=2)
    assert "interactive" not in r._waiting and "interactive" not in r._released
    r.core.finish(running.ticket, Outcome.OK)
    r.release(running.ticket)
    assert await until(lambda: store.slots["interactive"] == {"other:1"}, timeout=2)
    assert not r.held and "interactive" not in r._waiting and "interactive" not in r._released
    await r.close()
