"""The Redis scripts against a real redis-server: atomic caps under concurrency, idempotence, lease expiry."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from extproc.policy.schema import StoreSpec
from extproc.policy.slot_store import SlotClaim, StoreUnavailable
from extproc.store.redis_store import SETTLE_MS, RedisStore
from extproc.tools.stack import free_port
from tests.conftest import until


def spec(url: str, **kw) -> StoreSpec:
    return StoreSpec(kind="redis", url=url, key_prefix="t:", **{"timeout_ms": 1000, **kw})


def claim(holder: str, cap: int = 1, cost: float = 0.0, budget: float | None = None, cls: str = "c") -> SlotClaim:
    return SlotClaim(cls, holder, cost, cap, budget)


async def test_fifty_clients_never_hold_more_than_the_cap(redis_server):
    cap = 5
    stores = [RedisStore(spec(redis_server.url)) for _ in range(5)]  # five "replicas", each its own pool
    holding = peak = granted = 0
    redis_peak = 0
    stop = asyncio.Event()

    async def client(i: int) -> None:
        nonlocal holding, peak, granted
        store = stores[i % len(stores)]
        rnd = random.Random(i)
        for n in range(30):
            holder = f"r{i % 5}:{i}-{n}"
            while not await store.acquire(claim(holder, cap)):
                await asyncio.sleep(0)
            holding += 1
            granted += 1
            peak = max(peak, holding)
            await asyncio.sleep(rnd.random() * 0.002)
            holding -= 1  # before the release is sent: `holding` never exceeds what Redis holds
            await store.release([("c", holder)])

    async def watch() -> None:
        nonlocal redis_peak
        while not stop.is_set():
            redis_peak = max(redis_peak, await stores[0].count("c"))
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    await asyncio.wait_for(asyncio.gather(*[client(i) for i in range(50)]), 60)
    stop.set()
    await watcher
    assert granted == 50 * 30
    assert peak == cap and redis_peak <= cap
    assert await stores[0].count("c") == 0
    for s in stores:
        await s.close()


async def test_budget_counts_gpu_seconds_across_holders(redis_server):
    store = RedisStore(spec(redis_server.url))
    assert await store.acquire(claim("a", cap=10, cost=0.6, budget=1.0))
    assert not await store.acquire(claim("b", cap=10, cost=0.6, budget=1.0))
    assert await store.acquire(claim("c", cap=10, cost=0.4, budget=1.0))
    await store.release([("c", "a")])
    assert await store.acquire(claim("b", cap=10, cost=0.6, budget=1.0))
    await store.close()


async def listening(url: str) -> tuple[RedisStore, list[str]]:
    """A store subscribed to the release channel, and the classes it has heard released so far."""
    store = RedisStore(spec(url))
    heard: list[str] = []
    store.on_release(heard.append)
    await store.start()
    subscribers = await until(lambda: store.client.pubsub_numsub(store.channel), holds=lambda n: n[0][1] >= 1)
    assert subscribers[0][1] >= 1
    return store, heard


async def announced_until_sentinel(store: RedisStore, heard: list[str]) -> list[str]:
    """What was heard before a last release of class "end": one channel delivers in order, so once "end" is heard
    every announcement made before it has been heard too (a duplicate included)."""
    assert await store.acquire(claim("sentinel", cls="end"))
    await store.release([("end", "sentinel")])
    assert (await until(lambda: heard, holds=lambda h: "end" in h))[-1] == "end"
    return heard[:-1]


async def test_release_is_idempotent_and_announced_once(redis_server):
    store, heard = await listening(redis_server.url)
    assert await store.acquire(claim("a"))
    assert await store.acquire(claim("a"))  # a retried acquire: still one slot
    assert await store.count("c") == 1
    await store.release([("c", "a")])
    await store.release([("c", "a")])
    await store.release([("c", "never-held")])
    assert await store.count("c") == 0
    assert await store.acquire(claim("b"))
    assert await announced_until_sentinel(store, heard) == ["c"]
    await store.close()


async def test_one_release_call_frees_many_slots_and_announces_each_class_once(redis_server):
    store, heard = await listening(redis_server.url)
    for holder, cls in (("a", "x"), ("b", "x"), ("c", "y")):
        assert await store.acquire(claim(holder, cap=5, cls=cls))
    await store.release([("x", "a"), ("x", "b"), ("y", "c"), ("y", "gone")])
    assert await store.count("x") == 0 and await store.count("y") == 0
    assert sorted(await announced_until_sentinel(store, heard)) == ["x", "y"]
    await store.close()


async def test_expired_leases_are_purged_by_the_next_acquire(redis_server):
    store = RedisStore(spec(redis_server.url, lease_ms=200))
    assert await store.acquire(claim("crashed", cap=1, cost=1.0, budget=1.0))
    assert not await store.acquire(claim("b", cap=1, cost=1.0, budget=1.0))
    await asyncio.sleep(0.3)
    assert await store.acquire(claim("b", cap=1, cost=1.0, budget=1.0))  # slot and budget both freed
    assert await store.client.hkeys("t:cost:c") == [b"b"]
    await store.close()


async def test_renew_keeps_live_leases_and_reports_lost_ones(redis_server):
    # Renewed every 0.35 s, a 1 s lease survives a stall of 0.65 s on a loaded machine; unrenewed, it is gone by
    # the fourth renewal (1.4 s).
    store = RedisStore(spec(redis_server.url, lease_ms=1000))
    assert await store.acquire(claim("live", cap=2))
    assert await store.acquire(claim("dead", cap=2))
    for _ in range(4):
        await asyncio.sleep(0.35)
        lost = await store.renew([("c", "live")])
        assert lost == []
    assert await store.renew([("c", "live"), ("c", "dead")]) == [("c", "dead")]
    assert await store.count("c") == 1
    await store.adopt([claim("dead", cost=0.5)])  # a running request is recorded again, past the cap
    assert await store.count("c") == 2
    await store.close()


async def test_a_redis_that_lost_its_slots_grants_none_until_the_running_requests_are_recorded_again(
        redis_server):
    """Redis restarted empty (no persistence, a pod rescheduled) while replica a ran the whole cap: b's acquires
    were granted on the empty store at once, a's requests were adopted past the cap at its next renewal, and the
    cap of 4 ran 8 for as long as a's requests lasted."""
    a, b = RedisStore(spec(redis_server.url)), RedisStore(spec(redis_server.url))
    await a.ping(), await b.ping()  # both have seen the store (a fresh one settles nothing)
    running = [("c", f"a{i}") for i in range(4)]
    assert all([await a.acquire(claim(h, cap=4)) for _, h in running])
    redis_server.stop()
    redis_server.start()
    for store in (a, b):  # no call failed: neither noticed the restart
        await store.client.connection_pool.disconnect()
    settles = time.monotonic() + SETTLE_MS / 1000
    assert not await b.acquire(claim("b0", cap=4))  # settling: a may still run what the store forgot
    assert await a.renew(running) == running  # a's housekeeping (every second) finds them lost ...
    await a.adopt([claim(h) for _, h in running])  # ... and records them again
    await asyncio.sleep(max(0.0, settles - time.monotonic()) + 0.1)
    assert not await b.acquire(claim("b0", cap=4))  # the cap counts a's requests again
    await a.release(running[:1])
    assert await b.acquire(claim("b0", cap=4))
    assert await a.count("c") == 4
    await a.close(), await b.close()


async def test_a_replica_back_from_an_outage_longer_than_a_lease_lets_the_others_record_theirs_first(
        redis_server):
    """A freeze longer than a lease expires every holder: the first replica back acquired on a store that no
    longer counted the requests the others still ran (recorded again only at their next renewal)."""
    import os
    import signal

    a, b = (RedisStore(spec(redis_server.url, lease_ms=2000, timeout_ms=100)) for _ in range(2))
    await a.ping(), await b.ping()
    assert await a.acquire(claim("a0", cap=1))
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(StoreUnavailable):
            await b.ping()
        await asyncio.sleep(2.1)  # a's lease (Redis's clock) runs out meanwhile
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    await b.ping()  # b's probe: back after more than a lease
    assert not await b.acquire(claim("b0", cap=1))  # a still runs a0, recorded again at its next renewal
    assert await a.renew([("c", "a0")]) == [("c", "a0")]
    await a.adopt([claim("a0")])
    assert await a.count("c") == 1
    await a.close(), await b.close()


async def test_a_short_outage_long_ago_starts_no_settling(redis_server):
    """Only a replica back from failing for a lease settles: one whose calls failed for a moment, then went through
    for longer than a lease, must not stop every acquire at its next probe."""
    import os
    import signal

    a, b = (RedisStore(spec(redis_server.url, lease_ms=2000, timeout_ms=100)) for _ in range(2))
    await a.ping(), await b.ping()
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(StoreUnavailable):
            await a.ping()
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert await until(lambda: a.acquire(claim("a0", cap=2)))
    await asyncio.sleep(2.1)
    await a.ping()
    assert await b.acquire(claim("b0", cap=2))
    await a.close(), await b.close()


async def test_an_unreachable_store_fails_within_its_timeout():
    store = RedisStore(StoreSpec(kind="redis", url=f"redis://127.0.0.1:{free_port()}/0", timeout_ms=50))
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        await store.acquire(claim("a"))
    with pytest.raises(StoreUnavailable):
        await store.ping()
    assert time.monotonic() - started < 2.0  # two 50 ms timeouts; loose for a loaded machine, not a hang
    await store.close()


async def test_a_store_that_answers_but_takes_no_writes_is_unavailable(redis_server):
    """Full under noeviction (or read-only after a failover), Redis still answers PING but refuses every slot
    script: the probe must be a write, or the store state flaps between shared and local every second."""
    import redis.asyncio as aioredis

    store = RedisStore(spec(redis_server.url))
    await store.ping()
    admin = aioredis.from_url(redis_server.url)
    await admin.config_set("maxmemory-policy", "noeviction")
    await admin.config_set("maxmemory", "1")
    try:
        assert await admin.ping()
        with pytest.raises(StoreUnavailable):
            await store.ping()
        with pytest.raises(StoreUnavailable):
            await store.acquire(claim("a"))
    finally:
        await admin.config_set("maxmemory", "0")
        await admin.aclose()
        await store.close()


async def test_completion_reports_reach_the_instance_they_are_relayed_to(redis_server):
    """Only the named instance hears a relayed batch, and the release channel keeps working beside it."""
    owner, other, sender = (RedisStore(spec(redis_server.url)) for _ in range(3))
    heard: dict[str, list] = {"owner": [], "other": [], "released": []}
    owner.on_reports("own1", heard["owner"].append)
    other.on_reports("oth2", heard["other"].append)
    owner.on_release(heard["released"].append)
    for store in (owner, other, sender):
        await store.start()
    try:
        reports = [[17, "ok", 200, 0.05, 1.25], [18, "upstream_error", 503, None, 0.01]]
        # Subscriptions take a moment: send until the owner has heard a batch.
        assert await until(lambda: _relay_and_wait(sender, heard["owner"], reports))
        assert heard["owner"][0] == reports and heard["other"] == []
        assert await owner.acquire(claim("h1")) is True
        await sender.release([("c", "h1")])
        assert await until(lambda: heard["released"])
    finally:
        for store in (owner, other, sender):
            await store.close()


async def test_a_relay_says_whether_anyone_heard_it(redis_server):
    """Reports for an instance that is gone (restarted: a new id) or sent while Redis is away reach nobody: the
    sender learns so and counts them as unmatched, not relayed."""
    owner, sender = RedisStore(spec(redis_server.url, timeout_ms=200)), RedisStore(spec(redis_server.url,
                                                                                        timeout_ms=200))
    owner.on_reports("own1", lambda reports: None)
    await owner.start()
    results: list[bool] = []
    try:
        assert await until(lambda: _relay_and_wait(sender, [], [[1, "ok", 200, None, None]], results), timeout=5)
        assert results[-1] is True
        results.clear()
        sender.relay("gone", [[1, "ok", 200, None, None]], results.append)
        assert await until(lambda: results) == [False]
        redis_server.stop()
        sender.relay("own1", [[2, "ok", 200, None, None]], results.append)
        assert await until(lambda: len(results) == 2) and results[1] is False
        assert not sender._relaying
    finally:
        await owner.close()
        await sender.close()


async def test_a_stray_message_on_the_release_channel_keeps_the_subscription(redis_server):
    """Anyone with access to Redis may publish there: bytes that are not UTF-8 dropped the subscription for a
    second, and the reports relayed to this instance meanwhile reached nobody."""
    owner, sender = RedisStore(spec(redis_server.url)), RedisStore(spec(redis_server.url))
    heard: list = []
    owner.on_reports("own1", heard.append)
    await owner.start()
    try:
        assert await until(lambda: _relay_and_wait(sender, heard, [[1, "ok", 200, None, None]]))
        await sender.client.publish(owner.channel, b"\xff\xfe")
        await asyncio.sleep(0.3)  # the subscriber has read it
        results: list[bool] = []
        sender.relay("own1", [[2, "ok", 200, None, None]], results.append)
        assert await until(lambda: results) == [True]
    finally:
        await owner.close()
        await sender.close()


async def _relay_and_wait(sender: RedisStore, heard: list, reports: list, results: list | None = None) -> bool:
    results = [] if results is None else results
    sender.relay("own1", reports, results.append)
    await asyncio.sleep(0.05)
    return bool(heard) or bool(results and results[-1])


async def give_up_and_count(store, first, queued) -> None:
    """The second caller gives up and releases what it may have got (as SharedSlots.try_now does): once the
    acquirer is idle only the first caller's slot is held."""
    queued.cancel()
    await store.release([("c", "b")])
    assert await first
    await until(lambda: store._acquirer is None and not store._busy)
    assert await store.count("c") == 1
    await store.close()


async def test_an_acquire_given_up_while_queued_does_not_take_a_slot_after_its_release(redis_server):
    # The caller that gives up releases what it may have got (SharedSlots.try_now), but a queued acquire goes out
    # with the next batch, after that release: the slot was taken for nobody and held until its lease ran out.
    store = RedisStore(spec(redis_server.url))
    first = asyncio.create_task(store.acquire(claim("a", cap=5)))
    await asyncio.sleep(0)  # on its way: the next one queues behind it
    queued = asyncio.create_task(store.acquire(claim("b", cap=5)))
    await asyncio.sleep(0)
    await give_up_and_count(store, first, queued)


async def test_an_acquire_given_up_during_its_batch_call_is_given_back(redis_server):
    store = RedisStore(spec(redis_server.url))
    real, sent = store._acquire_batch, asyncio.Event()

    async def slow(claims):
        if claims[0].holder == "b":
            sent.set()
            await asyncio.sleep(0.05)  # the caller gives up and releases meanwhile, ahead of the script
        return await real(claims)

    store._acquire_batch = slow
    first = asyncio.create_task(store.acquire(claim("a", cap=5)))
    await asyncio.sleep(0)
    queued = asyncio.create_task(store.acquire(claim("b", cap=5)))
    await sent.wait()
    await give_up_and_count(store, first, queued)


async def test_renewed_leases_keep_their_gpu_seconds_past_two_leases_without_an_acquire(redis_server):
    # Renewals used to extend only the slots' key: the costs' key expired two leases after the last acquire, so
    # long requests of a class held at its GPU budget (no acquire succeeding meanwhile) were counted as costing
    # nothing, and the next acquire was granted past the budget.
    store = RedisStore(spec(redis_server.url, lease_ms=200))
    assert await store.acquire(claim("long", cap=10, cost=0.6, budget=1.0))
    for _ in range(6):  # 0.6 s: three leases, renewed every 0.1 s
        await asyncio.sleep(0.1)
        assert await store.renew([("c", "long")]) == []
    assert await store.client.hkeys("t:cost:c") == [b"long"]
    assert not await store.acquire(claim("next", cap=10, cost=0.6, budget=1.0))
    await store.close()


async def test_an_unexpected_failure_of_a_batch_reaches_every_caller_as_unavailable(redis_server):
    # A failure that is not a connection error (a script answer of another shape, a client library bug) must
    # still answer the callers queued behind the call: they used to wait on their futures for ever, holding
    # their admissions (and the local places they held while waiting) with them.
    store = RedisStore(spec(redis_server.url))

    async def broken(claims):
        await asyncio.sleep(0.01)
        raise TypeError("'int' object is not iterable")

    store._acquire_batch = broken
    first = asyncio.create_task(store.acquire(claim("a", cap=5)))
    await asyncio.sleep(0)
    queued = [asyncio.create_task(store.acquire(claim(h, cap=5))) for h in "bc"]
    done, pending = await asyncio.wait([first, *queued], timeout=2.0)
    assert not pending
    for task in done:
        with pytest.raises(StoreUnavailable, match="TypeError"):
            task.result()
    assert not store._busy and store._acquirer is None
    await store.close()


async def test_closing_the_store_answers_the_acquires_still_queued(redis_server):
    store = RedisStore(spec(redis_server.url))
    real, sent = store._acquire_batch, asyncio.Event()

    async def slow(claims):
        if claims[0].holder == "b":
            sent.set()
            await asyncio.sleep(10)
        return await real(claims)

    store._acquire_batch = slow
    first = asyncio.create_task(store.acquire(claim("a", cap=5)))
    await asyncio.sleep(0)
    queued = asyncio.create_task(store.acquire(claim("b", cap=5)))
    await sent.wait()
    later = asyncio.create_task(store.acquire(claim("c", cap=5)))
    await asyncio.sleep(0)
    await store.close()
    done, pending = await asyncio.wait([queued, later], timeout=2.0)
    assert not pending
    for task in done:
        with pytest.raises(StoreUnavailable):
            task.result()
    assert await first


async def test_a_call_fails_over_within_its_timeout_even_when_dropping_the_pool_hangs():
    # After a failed call the store drops its pooled connections; closing them waits on sockets to a Redis that
    # may be stopped (SIGSTOP, a partition). That wait was the caller's: an admission waited on it past the
    # store's timeout, unbounded but for redis-py's own per-connection timeouts.
    from redis.exceptions import ConnectionError as RedisConnectionError

    store = RedisStore(StoreSpec(kind="redis", url=f"redis://127.0.0.1:{free_port()}/0", timeout_ms=100))
    hung = asyncio.Event()

    async def disconnect(*_args, **_kw):
        hung.set()
        await asyncio.sleep(30)

    async def failing(*_args, **_kw):
        raise RedisConnectionError("connection reset by peer")

    store.client.connection_pool.disconnect = disconnect
    store._acquire = failing
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        await asyncio.wait_for(store.acquire(claim("a")), timeout=5)
    assert time.monotonic() - started < 1.0
    await asyncio.wait_for(hung.wait(), timeout=1)  # the pool is still dropped, in the background
    await store.close()


async def test_close_disconnects_the_connections_the_store_opened(redis_server):
    # The store builds its own connection pool and hands it to its client, and redis-py leaves a pool it was handed
    # to whoever made it: close() closed the client alone, and the pool's sockets stayed open on the Redis server
    # until the garbage collector got to them (a reload that replaced the store held a connection per call in flight).
    watcher = RedisStore(spec(redis_server.url))

    async def clients() -> int:
        return len(await watcher.client.client_list())

    alone = await clients()
    store = RedisStore(spec(redis_server.url))
    await store.start()  # a subscription, and a few calls at once: several pooled connections
    await asyncio.gather(*(store.acquire(claim(f"h{i}", cap=10)) for i in range(4)), store.count("c"))
    await until(clients, holds=lambda n: n > alone)
    await store.close()
    assert await until(clients, holds=lambda n: n == alone) == alone
    await watcher.close()
