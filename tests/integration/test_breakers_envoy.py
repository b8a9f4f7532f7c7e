"""Breakers, degrade routing and shadow mode through real Envoy + the ext_proc + simulated vLLM replicas."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.conftest import policy_file

from .helpers import chat, metrics, post, sample, sample_once


def write_policy(tmp_path, interactive: dict, batch: dict | None = None, **top) -> object:
    batch = batch or {"max_concurrency": 32, "max_queue": 0, "max_wait_ms": 0}
    return policy_file(tmp_path, **{"classes": {"interactive": interactive, "batch": batch}, "tenants": [], "shed": {},
                                    **top})


def pools(big, small):
    return {"vllm_llama70b": [("127.0.0.1", big.ports[0])], "vllm_llama8b": [("127.0.0.1", small.ports[0])]}


async def fault(http, fleet, **body):
    async with http.post(f"{fleet.urls[0]}/sim/fault", json=body) as r:
        assert r.status == 200


async def served_by(http, url, n=1, headers=None, max_tokens=4):
    """Send n requests concurrently (each generating exactly max_tokens tokens); return (response model,
    x-extproc-degraded) for each."""
    body = chat(max_tokens=max_tokens, ignore_eos=True)
    results = await asyncio.gather(*[post(http, url, body, headers) for _ in range(n)])
    out = []
    for status, hs, body in results:
        assert status == 200, body
        out.append((json.loads(body)["model"], hs.get("x-extproc-degraded")))
    return out


async def test_slow_pool_trips_the_breaker_degrades_to_the_small_model_and_recovers(make_stack, tmp_path, fleets):
    big, small = fleets
    policy = write_policy(tmp_path, {
        "max_concurrency": 16, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 800,
        "latency_breaker": {"window_s": 20, "min_samples": 10, "cooldown_s": 1.5, "trickle": 0.5, "trickle_s": 2},
        "fallback": {"action": "degrade", "model": "llama-8b"}})
    s = make_stack(policy, pools=pools(big, small))
    async with aiohttp.ClientSession() as http:
        assert {m for m, _ in await served_by(http, s.url, 4)} == {"llama-70b"}
        await fault(http, big, extra_latency_s=12.0)  # 1.2 s wall per request on the 70B pool
        await served_by(http, s.url, 12)               # these are slow: the window's p95 crosses 0.8 s
        # The access-log batch that carries their latency: all 16 completions reported.
        assert await sample_once(http, s.metrics_url, "extproc_request_duration_seconds_count", 16, outcome="ok") == 16
        got = await served_by(http, s.url, 3)
        assert {m for m, _ in got} == {"llama-8b"}
        assert all(d and d.endswith("reason=latency_breaker_open") and "model=llama-8b" in d for _, d in got)
        ms = await metrics(http, s.metrics_url)
        assert sample(ms, "extproc_breaker_state", **{"class": "interactive", "kind": "latency",
                                                      "pool": "vllm_llama70b"}) == 2
        assert sample(ms, "extproc_requests_total", decision="degrade", reason="latency_breaker_open") == 3

        await fault(http, big, reset=True)             # the pool is fast again
        await asyncio.sleep(1.6)                       # cooldown -> half-open
        probes = await served_by(http, s.url, 4)       # half of these are probes to the 70B pool
        assert sum(m == "llama-70b" for m, _ in probes) == 2
        await asyncio.sleep(2.1)                       # a clean trickle period closes it
        assert {m for m, _ in await served_by(http, s.url, 4)} == {"llama-70b"}
        ms = await metrics(http, s.metrics_url)
        for to in ("open", "half_open", "closed"):
            assert sample(ms, "extproc_breaker_transitions_total", kind="latency", to=to) == 1


async def test_a_batch_only_slowdown_never_trips_the_interactive_breaker(make_stack, tmp_path, fleets):
    big, small = fleets
    breaker = {"window_s": 20, "min_samples": 8, "cooldown_s": 30}
    policy = write_policy(
        tmp_path,
        {"max_concurrency": 16, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 3000, "latency_breaker": breaker},
        {"max_concurrency": 16, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 100, "latency_breaker": breaker})
    s = make_stack(policy, pools=pools(big, small))
    batch = {"x-priority": "batch"}
    async with aiohttp.ClientSession() as http:
        # Long batch generations (400 tokens, ~0.17 s wall here) and short interactive ones share the pool.
        await asyncio.gather(served_by(http, s.url, 8, batch, max_tokens=400), served_by(http, s.url, 8))
        assert await sample_once(http, s.metrics_url, "extproc_request_duration_seconds_count", 16, outcome="ok") == 16
        status, headers, body = await post(http, s.url, chat(), batch)
        assert status == 503 and json.loads(body)["error"]["code"] == "latency_breaker_open"
        status, headers, _ = await post(http, s.url, chat())
        assert status == 200 and headers["x-extproc-class"] == "interactive"
        ms = await metrics(http, s.metrics_url)
        assert sample(ms, "extproc_breaker_state", **{"class": "interactive", "kind": "latency"}) == 0


async def test_shadow_mode_admits_everything_and_counts_what_enforce_rejects(make_stack, tmp_path, fleets):
    big, small = fleets
    spec = {"max_concurrency": 2, "max_queue": 0, "max_wait_ms": 0}
    counts = {}
    for mode in ("enforce", "shadow"):
        (tmp_path / mode).mkdir()
        s = make_stack(write_policy(tmp_path / mode, spec, mode=mode), pools=pools(big, small))
        async with aiohttp.ClientSession() as http:
            await fault(http, big, extra_latency_s=10.0)  # 1 s wall: all six overlap
            results = await asyncio.gather(*[post(http, s.url, chat(max_tokens=4)) for _ in range(6)])
            await fault(http, big, reset=True)
            statuses = sorted(r[0] for r in results)
            ms = await metrics(http, s.metrics_url)
            if mode == "enforce":
                assert statuses == [200, 200, 429, 429, 429, 429]
                counts[mode] = sample(ms, "extproc_requests_total", decision="reject", reason="queue_full")
            else:
                assert statuses == [200] * 6
                shadowed = [r for r in results if "x-extproc-shadow" in r[1]]
                assert len(shadowed) == 4
                assert all(r[1]["x-extproc-shadow"] == "would-reject; reason=queue_full" for r in shadowed)
                counts[mode] = sample(ms, "extproc_shadow_decisions_total", would="reject", reason="queue_full")
    assert counts["enforce"] == counts["shadow"] == 4


async def test_a_shadow_queue_place_times_out_at_its_max_wait(make_stack, tmp_path):
    """Found by rolling a policy of one's own out by docs/tuning.md (shadow, then enforce): a request enforce would
    queue runs at once in shadow while a virtual place in the queue plays out, and that place timed out only when
    the once-a-second housekeeping reaped it, up to a second past its `max_wait_ms`. Meanwhile it held a queue
    place, so later arrivals were counted as `would-reject; reason=queue_full` that enforce queues (a place every
    100 ms, each gone 100 ms later: enforce never has more than two waiting), and a release granted a place whose
    client enforce had already refused. Each place now times out at its own deadline, as a real waiter does."""
    classes = {"interactive": {"max_concurrency": 1, "max_queue": 3, "max_wait_ms": 100, "early_reject": False}}
    s = make_stack(policy_file(tmp_path, classes=classes, tenants=[], shed={}, mode="shadow"))
    async with aiohttp.ClientSession() as http:
        holder = asyncio.create_task(post(http, s.url, chat(), {"x-test-delay-ms": "3000"}))
        await asyncio.sleep(0.3)
        # Each runs 400 ms: longer than its place's 100 ms, so the place ends by its deadline, not with the request.
        arrivals = []
        for _ in range(12):
            arrivals.append(asyncio.create_task(post(http, s.url, chat(), {"x-test-delay-ms": "400"})))
            await asyncio.sleep(0.1)
        results = await asyncio.gather(*arrivals)
        assert (await holder)[0] == 200
        assert all(r[0] == 200 for r in results), [r[0] for r in results]  # shadow refuses nothing
        notes = [r[1].get("x-extproc-shadow") for r in results]
        assert notes == ["would-queue; reason=class_full"] * 12, notes
        ms = await metrics(http, s.metrics_url)
        assert sample(ms, "extproc_shadow_decisions_total", reason="queue_full") == 0
        assert sample(ms, "extproc_shadow_decisions_total", would="reject", reason="queue_timeout") == 12
