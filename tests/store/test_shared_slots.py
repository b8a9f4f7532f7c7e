"""Two replicas' cores sharing caps through one real Redis: waits, hand-over on release, failure and return."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from prometheus_client import CollectorRegistry

from extproc.policy.admission import ACCEPT, REJECT, AdmissionController, RequestFacts
from extproc.policy.limits import Outcome
from extproc.store.redis_store import SETTLE_MS, RedisStore
from extproc.store.shared_slots import CLOSED, LOCAL, SHARED, SharedSlots
from extproc.telemetry import StoreTelemetry
from tests.conftest import make_policy, until


def replica(url: str, cap: int = 1, max_wait_ms: int = 2000, **store) -> SharedSlots:
    policy = make_policy(classes={"interactive": {"max_concurrency": cap, "max_queue": 5,
                                                  "max_wait_ms": max_wait_ms},
                                  "batch": {"max_concurrency": 3}},
                         store={"kind": "redis", "url": url, "timeout_ms": 500, **store})
    core = AdmissionController(policy)
    return SharedSlots(core, RedisStore(policy.store), StoreTelemetry(CollectorRegistry()))


def metric(r: SharedSlots, name: str, **labels) -> float | None:
    return r.events.registry.get_sample_value(name, labels)


def facts() -> RequestFacts:
    return RequestFacts(header_class="interactive", model="llama", max_tokens=10)


async def admit(r: SharedSlots):
    """What the servicer does: decide, then one try, then a wait if the class is full across replicas."""
    d = r.core.decide(facts())
    assert d.kind == ACCEPT and r.core.gated(d)
    return await r.try_now(d) or await r.wait(d)


def finish(r: SharedSlots, d) -> None:
    r.core.finish(d.ticket, Outcome.OK)
    r.release(d.ticket)


async def test_a_slot_released_on_another_replica_goes_to_a_waiter_without_polling(redis_server):
    a, b = replica(redis_server.url, poll_ms=5000), replica(redis_server.url, poll_ms=5000)
    await a.start(), await b.start()
    first = await admit(a)
    assert first.kind == ACCEPT and a.held
    waiting = asyncio.create_task(admit(b))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    finish(a, first)
    second = await asyncio.wait_for(waiting, 10)
    # The first retry by poll comes 5 s into the wait: woken well before that, it was the release's pub/sub.
    assert second.kind == ACCEPT and second.waited_s < 4.0
    # It waited the 0.2 s above, less the first store round trip its wait is timed from (0.1978 s seen once).
    assert second.reason == "dequeued" and second.waited_s >= 0.15 and second.ticket.waited_s >= 0.15
    assert await b.store.count("interactive") == 1
    finish(b, second)
    assert await until(lambda: b.store.count("interactive"), holds=lambda n: n == 0) == 0
    await a.close(), await b.close()


async def test_no_global_slot_within_max_wait_is_a_queue_timeout_that_frees_the_local_slot(redis_server):
    a, b = replica(redis_server.url, max_wait_ms=200), replica(redis_server.url, max_wait_ms=200)
    await a.start(), await b.start()
    held = await admit(a)
    started = time.monotonic()
    refused = await admit(b)
    assert (refused.kind, refused.status, refused.reason) == (REJECT, 429, "queue_timeout")
    # At max_wait (0.2 s); the upper bound is loose for a loaded machine.
    assert 0.15 < time.monotonic() - started < 1.5
    assert b.core.limiters["interactive"].inflight == 0 and not b.held
    assert await a.store.count("interactive") == 1
    finish(a, held)
    await a.close(), await b.close()


async def test_a_requests_own_shorter_deadline_ends_its_wait_for_a_global_slot_too(redis_server):
    # It ends its wait in the class queue; the store's wait went on to the class's max_wait_ms (2 s here), past
    # the deadline the client gave.
    a, b = replica(redis_server.url), replica(redis_server.url)
    await a.start(), await b.start()
    held = await admit(a)
    started = time.monotonic()
    d = b.core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=10, deadline_ms=200))
    refused = await b.try_now(d) or await b.wait(d)
    assert (refused.kind, refused.status, refused.reason) == (REJECT, 429, "queue_timeout")
    assert 0.15 < time.monotonic() - started < 1.5
    # Told the wait it had, not the class's 2,000 ms.
    waited_ms = int(refused.message.split(" within ")[1].split(" ms")[0])
    assert 150 <= waited_ms < 1500, refused.message
    assert b.core.limiters["interactive"].inflight == 0 and not b.held
    finish(a, held)
    await a.close(), await b.close()


async def test_a_client_leaving_during_the_wait_gives_back_what_it_had(redis_server):
    a, b = replica(redis_server.url), replica(redis_server.url)
    await a.start(), await b.start()
    held = await admit(a)
    d = b.core.decide(facts())
    assert await b.try_now(d) is None
    waiting = asyncio.create_task(b.wait(d))
    await asyncio.sleep(0.1)
    waiting.cancel()
    b.abandon(d)
    finish(a, held)
    assert await until(lambda: a.store.count("interactive"), holds=lambda n: n == 0) == 0
    assert b.core.limiters["interactive"].inflight == 0
    await a.close(), await b.close()


async def test_redis_down_fails_open_on_the_replica_share_then_returns_and_adopts(redis_server):
    r = replica(redis_server.url, cap=4, instances=2, on_failure="local")
    await r.start()
    kept = await admit(r)
    redis_server.stop()
    during = await admit(r)  # the store does not answer: admitted on the local share
    assert during.kind == ACCEPT and r.state == LOCAL
    assert r.core.limiters["interactive"].limit == 2
    assert metric(r, "extproc_store_switches_total", to=LOCAL) == 1
    assert metric(r, "extproc_store_state", state=LOCAL) == 1 and metric(r, "extproc_store_state", state=SHARED) == 0
    assert r.core.decide(facts()).kind == "queue"  # 2 running: the share is full
    await r.tick()
    assert r.state == LOCAL  # still down: the probe fails, nothing changes
    redis_server.start()
    await r.tick()
    assert r.state == SHARED and r.core.limiters["interactive"].limit == 4
    assert metric(r, "extproc_store_switches_total", to=SHARED) == 1
    await r.tick()  # the request admitted during the outage is counted globally now
    assert await r.store.count("interactive") == 1 + (kept.ticket.id in r.held)
    await r.close()


async def test_redis_down_fails_closed_with_503(redis_server):
    r = replica(redis_server.url, on_failure="closed")
    await r.start()
    redis_server.stop()
    refused = await admit(r)
    assert (refused.kind, refused.status, refused.reason) == (REJECT, 503, "store_unavailable")
    assert r.state == CLOSED and r.core.limiters["interactive"].inflight == 0
    redis_server.start()
    await r.tick()
    assert r.state == SHARED
    # Redis came back empty: acquires wait for the settling, while every replica records what it runs again
    await asyncio.sleep(SETTLE_MS / 1000)
    assert (await admit(r)).kind == ACCEPT
    await r.close()


async def test_releases_the_store_missed_during_a_stall_are_sent_again_when_it_answers(redis_server):
    """Redis stalled (SIGSTOP, a long command, a failover) as four requests ended: their releases failed. Dropped,
    the four global slots stayed held until their leases ran out and the class refused everything on an idle
    fleet."""
    import os
    import signal

    r = replica(redis_server.url, cap=4, instances=2, on_failure="local", lease_ms=30000)
    await r.start()
    done = [await admit(r) for _ in range(4)]
    assert await r.store.count("interactive") == 4
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        for d in done:
            finish(r, d)
        assert await until(lambda: r.state == LOCAL, timeout=5)  # the releases timed out
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    await r.tick()
    assert r.state == SHARED
    assert await r.store.count("interactive") == 0
    assert (await admit(r)).kind == ACCEPT
    await r.close()


async def test_a_reload_reaches_requests_waiting_for_a_global_slot(redis_server):
    """Waiters kept the claim (and the cap) they were queued with: after a reload lowered the cap from 2 to 1 they
    were still let in under 2, and waiters of a class the reload removed ran later under no class."""
    a, b = replica(redis_server.url, cap=2), replica(redis_server.url, cap=2)
    await a.start(), await b.start()
    running = [await admit(a), await admit(a)]
    waiting = [asyncio.create_task(admit(b)) for _ in range(2)]
    await asyncio.sleep(0.2)
    assert not any(w.done() for w in waiting)
    lower = make_policy(classes={"interactive": {"max_concurrency": 1, "max_queue": 5, "max_wait_ms": 2000},
                                 "batch": {"max_concurrency": 3}}, store=dataclasses.asdict(b.policy.store))
    b.apply(lower)
    finish(a, running[0])  # 1 of the old 2 is still running: under the new cap of 1, nobody may start
    await asyncio.sleep(0.3)
    assert not any(w.done() for w in waiting)
    finish(a, running[1])
    assert await until(lambda: sum(w.done() for w in waiting) == 1)
    await asyncio.sleep(0.3)  # and not the second: the cap is 1 now
    assert sum(w.done() for w in waiting) == 1 and await b.store.count("interactive") == 1
    removed = make_policy(classes={"batch": {"max_concurrency": 3}}, default_class="batch", tenants=[],
                          store=dataclasses.asdict(b.policy.store))
    b.apply(removed)
    (last,) = [w for w in waiting if not w.done()]
    refused = await asyncio.wait_for(last, 5)
    assert (refused.kind, refused.status, refused.reason) == (REJECT, 503, "class_removed")
    # The one admitted before the removal runs on; its end gives its global slot back, and the replica keeps no
    # queue or wake-up for the class (one per class a reload ever removed, kept for the process's life).
    (admitted,) = [w.result() for w in waiting if w.result().kind == ACCEPT]
    finish(b, admitted)
    assert await until(lambda: b.store.count("interactive"), holds=lambda n: n == 0) == 0
    assert await until(lambda: not b._pumps)
    assert "interactive" not in b._waiting and "interactive" not in b._released
    assert await b.store.client.exists(*b.store.keys("interactive")) == 0  # nor does Redis
    await a.close(), await b.close()
