"""A replica that answers every generation with 500 while its /health says 200 (a broken engine), through real
Envoy: a replica that fails fast is the one least-request prefers, and the ext_proc's error breaker cannot tell
replicas apart, so without envoy.yaml's outlier detection on the pool clusters half of these requests fail and
the breaker degrades the whole class to the small model. With it Envoy ejects the replica after 5 errors in a row
and the pool's other replica serves the rest, also once the broken replica's /health has passed again."""

from __future__ import annotations

import asyncio

import aiohttp

from extproc.tools.sim.fleet import SimFleet
from tests.conftest import policy_file, until

from .helpers import chat, metrics, post, sample

SPEED = 10.0


async def test_a_replica_answering_errors_is_ejected_and_the_pool_serves_on_without_it(make_stack, tmp_path):
    big = SimFleet("h100-llama70b-awq", replicas=2, speed=SPEED, model_names=["llama-70b"])
    small = SimFleet("h100-llama8b", replicas=1, speed=SPEED, model_names=["llama-8b"])
    async with big, small:
        # The error breaker off: this is about Envoy. (Requests here come 7 ms apart, so the few errors before the
        # ejection are a large share of any window; at a pool's real rate they are a handful in 30 s.)
        interactive = {"max_concurrency": 8, "max_queue": 8, "max_wait_ms": 2000,
                       "latency_breaker": {"enabled": False}, "error_breaker": {"enabled": False}}
        # Started off the event loop, so these in-process replicas answer Envoy's first health checks.
        s = await asyncio.to_thread(make_stack, policy_file(tmp_path, classes={"interactive": interactive},
                                                            tenants=[], shed={}),
                                    pools={"vllm_llama70b": [("127.0.0.1", p) for p in big.ports],
                                           "vllm_llama8b": [("127.0.0.1", small.ports[0])]})
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            async def healthy() -> int:  # replicas that passed Envoy's health check
                async with http.get(f"{s.admin_url}/clusters") as r:
                    lines = (await r.text()).splitlines()
                return sum(line.startswith("vllm_llama70b::") and line.endswith("::health_flags::healthy")
                           for line in lines)

            assert await until(healthy, 10, interval=0.1, holds=lambda n: n == 2) == 2
            async with http.post(f"{big.urls[0]}/sim/fault", json={"error_rate": 1}) as r:
                assert r.status == 200

            async def burst(n: int = 6) -> list[int]:
                # At once, long enough to overlap: least-request spreads them, and the broken replica, which
                # answers at once, is the one it prefers.
                answers = await asyncio.gather(*(post(http, s.url, chat(max_tokens=64)) for _ in range(n)))
                return [status for status, _, _ in answers]

            async def ejected() -> int:
                async with http.get(f"{s.admin_url}/stats?filter=vllm_llama70b.outlier_detection.ejections_active"
                                    "$") as r:
                    return int((await r.text()).split(":")[1])

            # Ejected at its 5th error in a row (Envoy may send it a few more in the moments that takes).
            errors = []
            while not await ejected() and len(errors) < 30:
                errors += [n for n in await burst() if n != 200]
            assert await ejected() == 1 and set(errors) == {500} and len(errors) >= 5
            # The ejection is counted on Envoy's main thread and reaches the worker's load balancer a moment later.
            await asyncio.sleep(0.2)
            # The pool's other replica serves everything from then on, also after the broken one passed a health
            # check (every second on this stack, and its /health answers): that must not take it back (with
            # successful_active_health_check_uneject_host at its default, true, it is back within this pause).
            for pause in (0, 0, 0, 3.5, 0, 0):
                await asyncio.sleep(pause)
                assert await burst() == [200] * 6


async def test_while_a_replica_is_stalled_one_answering_errors_is_not_named_either(make_stack, tmp_path):
    # Envoy's override_host takes the first replica the ext_proc names whatever its health, and one failing fast
    # shows the lowest load: the ext_proc leaves out a replica with 5 errors in a row (the access log's upstream
    # address), as Envoy's outlier detection would.
    big = SimFleet("h100-llama70b-awq", replicas=3, speed=SPEED, model_names=["llama-70b"])
    small = SimFleet("h100-llama8b", replicas=1, speed=SPEED, model_names=["llama-8b"])
    async with big, small:
        hung, failing, working = big.urls
        interactive = {"max_concurrency": 32, "max_queue": 8, "max_wait_ms": 2000,
                       "latency_breaker": {"enabled": False}, "error_breaker": {"enabled": False}}
        pools = {"vllm_llama70b": {"replicas": [f"127.0.0.1:{p}" for p in big.ports], "stall_ms": 1000,
                                   "scrape_interval_ms": 50, "stale_ms": 500}}
        s = await asyncio.to_thread(make_stack, policy_file(tmp_path, classes={"interactive": interactive},
                                                            tenants=[], shed={}, pools=pools),
                                    pools={"vllm_llama70b": [("127.0.0.1", p) for p in big.ports],
                                           "vllm_llama8b": [("127.0.0.1", small.ports[0])]})
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            async def stalled() -> float:
                return sample(await metrics(http, s.metrics_url), "extproc_pool_stalled_replicas",
                              pool="vllm_llama70b")

            async with http.post(f"{hung}/sim/fault", json={"hang": 1}) as r:
                assert r.status == 200
            held = [asyncio.ensure_future(post(http, s.url, chat(max_tokens=50))) for _ in range(6)]
            assert await until(stalled, 10, holds=lambda n: n == 1) == 1
            async with http.post(f"{failing}/sim/fault", json={"error_rate": 1}) as r:
                assert r.status == 200
            statuses = []
            for _ in range(15):
                answers = await asyncio.gather(*(post(http, s.url, chat(max_tokens=16)) for _ in range(4)))
                statuses += [status for status, _, _ in answers]
                await asyncio.sleep(0.15)  # the access log's flush (0.1 s) reports each batch
            async with http.post(f"{hung}/sim/fault", json={"reset": True}) as r:
                assert r.status == 200
            await asyncio.gather(*held, return_exceptions=True)
    assert statuses.count(500) >= 1  # the failing replica was named (it looked least loaded) ...
    assert statuses[-20:] == [200] * 20, statuses  # ... until its errors in a row left it out
