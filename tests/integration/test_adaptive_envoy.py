"""Adaptive caps through real Envoy + the ext_proc + simulated vLLM replicas: the ext_proc scrapes the replicas'
own /metrics, marks the pool saturated when vLLM has requests waiting, cuts the class limit, raises it again once
the load is gone, and counts a replica it cannot read (stopped) as saturated."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import aiohttp

from extproc.tools.demo.runner import start_pool
from extproc.tools.sim.fleet import SimFleet
from extproc.tools.sim.profile import load_profile
from extproc.tools.stack import Stack
from tests.conftest import policy_file, until

from .helpers import chat, metrics, post, sample

SPEED = 10.0
START_LIMIT = 16


def write_policy(tmp_path, pool: dict) -> object:
    interactive = {"max_concurrency": START_LIMIT, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 60_000,
                   "latency_breaker": {"enabled": False},
                   "adaptive": {"enabled": True, "min_limit": 2, "max_limit": START_LIMIT, "interval_s": 0.2,
                                "window_s": 3, "min_samples": 2, "binding": 0.2}}
    # waiting_saturated 2, not 1: vLLM counts a request as waiting until its next engine step, so under CPU load a
    # scrape can catch one arrival of the steady phase (3 at a time, under max_num_seqs 4) as "waiting" and cut.
    # The burst leaves 12 waiting, far above either.
    pools = {"vllm_llama70b": {"scrape_interval_ms": 50, "stale_ms": 500, "waiting_saturated": 2, **pool}}
    return policy_file(tmp_path, classes={"interactive": interactive,
                                          "batch": {"max_concurrency": 4, "max_queue": 0, "max_wait_ms": 0}},
                       tenants=[], shed={}, pools=pools)


async def gauges(http, url) -> tuple[float, float]:
    ms = await metrics(http, url)
    return (sample(ms, "extproc_class_limit", **{"class": "interactive"}),
            sample(ms, "extproc_pool_saturated", pool="vllm_llama70b"))


async def test_waiting_requests_saturate_the_pool_cut_the_limit_and_it_recovers(make_stack, tmp_path):
    # A replica that runs 4 sequences at a time: a 16-request burst leaves 12 waiting in its scheduler.
    profile = replace(load_profile("h100-llama70b-awq"), max_num_seqs=4)
    big = SimFleet(profile, replicas=1, speed=SPEED, model_names=["llama-70b"])
    small = SimFleet("h100-llama8b", replicas=1, speed=SPEED, model_names=["llama-8b"])
    async with big, small:
        s = make_stack(write_policy(tmp_path, {"replicas": [f"127.0.0.1:{big.ports[0]}"]}),
                       pools={"vllm_llama70b": [("127.0.0.1", big.ports[0])],
                              "vllm_llama8b": [("127.0.0.1", small.ports[0])]})
        async with aiohttp.ClientSession() as http:
            assert await until(lambda: gauges(http, s.metrics_url), 10, holds=lambda g: g == (START_LIMIT, 0)) == \
                (START_LIMIT, 0)
            burst = asyncio.gather(*[post(http, s.url, chat(max_tokens=600, ignore_eos=True))
                                     for _ in range(START_LIMIT)])
            saw_saturated, lowest, waiting = False, START_LIMIT, 0.0
            while not burst.done():  # watch the gauges while the burst runs
                ms = await metrics(http, s.metrics_url)
                saw_saturated |= sample(ms, "extproc_pool_saturated", pool="vllm_llama70b") == 1
                lowest = min(lowest, sample(ms, "extproc_class_limit", **{"class": "interactive"}))
                waiting = max(waiting, sample(ms, "extproc_pool_waiting", pool="vllm_llama70b"))
                await asyncio.sleep(0.05)
            assert saw_saturated and waiting >= 1 and lowest < START_LIMIT, (saw_saturated, waiting, lowest)
            results = await burst
            assert all(status == 200 for status, _, _ in results)  # admitted before the cuts: all served

            # The load is gone: vLLM has nothing waiting, the pool is not saturated; the limit stays where it was
            # cut until the class uses it again (an idle class does not drift up).
            limit, sat = await until(lambda: gauges(http, s.metrics_url), 10, holds=lambda g: g[1] == 0)
            assert sat == 0
            low = limit

            # Steady load the replica runs without queueing (3 at a time, under its 4; at `binding: 0.2` 3 in flight
            # binds any limit up to 15, however deep the burst's cuts went): the limit rises.
            async def worker():
                for _ in range(15):
                    await post(http, s.url, chat(max_tokens=100, ignore_eos=True))

            await asyncio.gather(*[worker() for _ in range(3)])
            limit, sat = await gauges(http, s.metrics_url)
            assert limit > low and sat == 0, (low, limit, sat)


async def test_a_replica_that_cannot_be_read_counts_as_saturated(tmp_path):
    # Replicas as processes (`extproc sim`): a stopped process closes its connections, as a dead vLLM does.
    s = Stack(tmp_path / "stack", {}, policy_path=tmp_path / "policy.yaml")
    try:
        s.pools = {"vllm_llama70b": start_pool(s, "big", "h100-llama70b-awq", 1, ["llama-70b"], SPEED, 0),
                   "vllm_llama8b": start_pool(s, "small", "h100-llama8b", 1, ["llama-8b"], SPEED, 0)}
        # No replica list: the scraper takes the pool's endpoints from this stack's Envoy admin API.
        write_policy(tmp_path, {"envoy_admin": s.admin_url})
        s.start()
        async with aiohttp.ClientSession() as http:
            limit, sat = await until(lambda: gauges(http, s.metrics_url), 10, holds=lambda g: g[1] == 0)
            assert (limit, sat) == (START_LIMIT, 0)
            status, _, _ = await post(http, s.url, chat())  # a class heeds the pools it sends to
            assert status == 200
            s.process("sim-big").stop()  # the replica is gone: its /metrics cannot be read
            limit, sat = await until(lambda: gauges(http, s.metrics_url), 10,
                                     holds=lambda g: g[1] == 1 and g[0] < START_LIMIT)
            assert sat == 1 and limit < START_LIMIT, (limit, sat)
    finally:
        s.stop()
