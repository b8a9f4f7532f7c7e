"""Two Envoy + ext_proc replicas sharing one Redis and one upstream: the global cap holds exactly, a killed
replica's slots free themselves within the lease, and a Redis outage switches to the fallback and back."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from extproc.tools.stack import Stack, free_port, wait_http
from tests.conftest import policy_file, until
from tests.integration.helpers import (chat, equals, metrics, post, sample, sample_once, upstream_reset,
                                       upstream_stats)

HERE = Path(__file__).resolve().parent
CAP = 4


@pytest.fixture
def replicas(tmp_path, upstream, redis_server):
    """Two stacks with the same policy: interactive capped at CAP across both, leases of 2 s."""
    policy = policy_file(tmp_path, classes={
        "interactive": {"max_concurrency": CAP, "max_queue": 50, "max_wait_ms": 5000},
        "batch": {"max_concurrency": 2}},
        store={"kind": "redis", "url": redis_server.url, "key_prefix": f"it{free_port()}:", "lease_ms": 2000,
               "instances": 2, "on_failure": "local", "timeout_ms": 200})
    pools = {"vllm_llama70b": [upstream], "vllm_llama8b": [upstream]}
    stacks = [Stack(tmp_path / f"replica{i}", pools, policy_path=policy) for i in range(2)]
    try:
        for s in stacks:
            s.start()
        yield stacks
    finally:
        for s in stacks:
            s.stop()


def delay(ms: int) -> dict:
    return {"x-test-delay-ms": str(ms)}


async def test_the_global_cap_holds_exactly_under_load_from_both_replicas(replicas, upstream):
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)

        async def client(url: str) -> list[int]:
            return [(await post(http, url, chat(), delay(80)))[0] for _ in range(4)]

        results = await asyncio.gather(*[client(replicas[i % 2].url) for i in range(16)])
        assert sorted(set(s for r in results for s in r)) == [200]
        stats = await upstream_stats(http, upstream)
        assert stats["max_in_service"] == CAP  # reached, never exceeded, although each replica alone allows CAP
        accepted, waited = [], 0.0
        for s in replicas:  # each admission counted once, on the replica that made it
            ms = await metrics(http, s.metrics_url)
            accepted.append(sample(ms, "extproc_requests_total", decision="accept"))
            waited += sample(ms, "extproc_requests_total", decision="accept", reason="dequeued")
            assert sample(ms, "extproc_requests_total") == accepted[-1]
            assert sample(ms, "extproc_store_state", state="shared") == 1
        assert accepted == [32, 32] and waited > 0


async def test_a_killed_replica_frees_its_slots_within_the_lease(replicas, upstream):
    a, b = replicas
    async with aiohttp.ClientSession() as http:
        held = [asyncio.create_task(post(http, a.url, chat(), delay(15000))) for _ in range(CAP)]
        busy = await until(lambda: upstream_stats(http, upstream), holds=lambda st: st["in_service"] == CAP)
        assert busy["in_service"] == CAP
        a.process("extproc").stop(signal.SIGKILL)
        killed = time.monotonic()
        status, headers, _ = await post(http, b.url, chat())
        freed_after = time.monotonic() - killed
        assert status == 200 and headers["x-extproc-decision"] == "accept"
        # Granted when the last lease (2 s, renewed every second until the kill) expires, and not before.
        assert 0.8 < freed_after < 2.0 + 0.5
        for t in held:
            t.cancel()


async def test_a_redis_outage_switches_to_local_shares_and_back(replicas, upstream, redis_server):
    async with aiohttp.ClientSession() as http:
        redis_server.stop()
        for s in replicas:  # the housekeeping probe notices within a second
            assert await sample_once(http, s.metrics_url, "extproc_store_state", 1, state="local") == 1
            ms = await metrics(http, s.metrics_url)
            assert sample(ms, "extproc_store_switches_total", to="local") == 1
            assert sample(ms, "extproc_class_limit", **{"class": "interactive"}) == CAP // 2
        await upstream_reset(http, upstream)
        results = await asyncio.gather(*[post(http, replicas[i % 2].url, chat(), delay(300)) for i in range(8)])
        assert sorted(r[0] for r in results) == [200] * 8
        assert (await upstream_stats(http, upstream))["max_in_service"] == CAP  # CAP // 2 on each replica
        redis_server.start()
        for s in replicas:
            assert await sample_once(http, s.metrics_url, "extproc_store_state", 1, state="shared") == 1
            ms = await metrics(http, s.metrics_url)
            assert sample(ms, "extproc_store_switches_total", to="shared") == 1
            assert sample(ms, "extproc_class_limit", **{"class": "interactive"}) == CAP
        for s in replicas:
            assert "store state -> local" in s.process("extproc").tail(200)
            assert "store state -> shared" in s.process("extproc").tail(200)


async def in_flight_here(http, s: Stack) -> tuple[int, int]:
    """(running, waiting) of interactive on one replica: a request waiting for a global slot holds a local place,
    but is reported as waiting, like one queued locally."""
    async with http.get(f"{s.metrics_url}/healthz") as r:
        c = (await r.json())["classes"]["interactive"]
    return c["inflight"], c["queue"]


async def store_state(http, s: Stack, state: str) -> bool:
    return sample(await metrics(http, s.metrics_url), "extproc_store_state", state=state) == 1


async def share_holds_through_an_outage(http, replicas, upstream, outage, recovery) -> dict:
    """Each replica runs its share of the cap (2 long requests with global slots) and has 2 more waiting for a
    global slot (plus 2 queued locally) when the store goes away. The waiters must wait for a share slot, not all
    start at once (which put 2 x 4 = 8 in flight at the upstream)."""
    share = CAP // 2
    await upstream_reset(http, upstream)
    tasks = []
    for n, s in enumerate(replicas, 1):
        tasks += [asyncio.create_task(post(http, s.url, chat(), delay(2500))) for _ in range(share)]
        assert await until(lambda: equals(upstream_in_service(http, upstream), n * share), timeout=5)
    for s in replicas:
        tasks += [asyncio.create_task(post(http, s.url, chat(), delay(200))) for _ in range(2 * share)]
    for s in replicas:  # 2 running, 2 waiting for a global slot (holding local places), 2 more queued locally
        assert await until(lambda: equals(in_flight_here(http, s), (share, 2 * share)), timeout=5)
    outage()
    try:
        for s in replicas:
            assert await until(lambda: store_state(http, s, "local"), timeout=3)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 15)
    finally:
        recovery()
    stats = await upstream_stats(http, upstream)
    assert sorted(r[0] for r in results) == [200] * len(tasks)
    return stats


async def upstream_in_service(http, upstream) -> int:
    return (await upstream_stats(http, upstream))["in_service"]


async def test_killing_redis_keeps_each_replica_within_its_share_waiters_included(replicas, upstream,
                                                                                  redis_server):
    async with aiohttp.ClientSession() as http:
        stats = await share_holds_through_an_outage(http, replicas, upstream, redis_server.stop, lambda: None)
    assert stats["max_in_service"] == CAP, stats  # share x instances, never the 8 of both local caps
    print(f"\nRELIABILITY redis killed with waiters: max in flight at the upstream {stats['max_in_service']} "
          f"(cap {CAP}, 2 replicas); {stats['served']} served")


async def test_freezing_redis_keeps_each_replica_within_its_share_waiters_included(replicas, upstream,
                                                                                   redis_server):
    pid = redis_server.proc.pid
    async with aiohttp.ClientSession() as http:
        stats = await share_holds_through_an_outage(http, replicas, upstream, lambda: os.kill(pid, signal.SIGSTOP),
                                                    lambda: os.kill(pid, signal.SIGCONT))
    assert stats["max_in_service"] == CAP, stats
    print(f"\nRELIABILITY redis frozen with waiters: max in flight at the upstream {stats['max_in_service']} "
          f"(cap {CAP}, 2 replicas); {stats['served']} served")


async def test_redis_restarted_empty_under_a_full_cap_does_not_double_it(replicas, upstream, redis_server):
    """Replica a runs the whole cap when Redis is SIGKILLed and started again empty. b's requests were granted at
    once on the empty store, a's were adopted past the cap at its next renewal: 8 ran of a cap of 4, for as long
    as a's requests lasted. Now acquires wait out the settling, while a records its requests again."""
    a, b = replicas
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        held = [asyncio.create_task(post(http, a.url, chat(), delay(3500))) for _ in range(CAP)]
        assert (await until(lambda: upstream_in_service(http, upstream), holds=lambda n: n == CAP)) == CAP
        redis_server.proc.kill()
        redis_server.proc.wait()
        redis_server.start()
        more = [asyncio.create_task(post(http, b.url, chat(), delay(200))) for _ in range(CAP)]
        results = await asyncio.wait_for(asyncio.gather(*held, *more), 15)
        stats = await upstream_stats(http, upstream)
    assert sorted(r[0] for r in results) == [200] * 2 * CAP  # b's waited for a's slots (max_wait_ms 5 s)
    assert stats["max_in_service"] == CAP, stats
