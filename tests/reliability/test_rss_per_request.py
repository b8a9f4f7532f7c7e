"""ext_proc RSS per request through real Envoy: the grpc.aio leak pinned (docs/reliability.md, "The RSS leak that
was"). Part of `make soak`: ~40 s, and RSS needs tens of thousands of requests to say anything."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.conftest import policy_file
from tests.integration.helpers import chat, healthz

from .test_soak import rss_kib

pytestmark = [pytest.mark.slow, pytest.mark.soak]

WARMUP, ROUNDS, PER_ROUND, CONCURRENCY = 3000, 4, 6000, 16


async def test_rss_per_request_through_envoy(make_stack, tmp_path):
    s = make_stack(policy_file(tmp_path, classes={
        "interactive": {"max_concurrency": 64}, "batch": {"max_concurrency": 8}}),
                   extproc_args=["--log-level", "WARNING"])
    pid = s.process("extproc").popen.pid
    body = json.dumps(chat()).encode()
    accepted = 0

    async def run(http, n):
        nonlocal accepted
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one():
            nonlocal accepted
            async with sem, http.post(f"{s.url}/v1/chat/completions", data=body,
                                      headers={"content-type": "application/json"}) as r:
                await r.read()
                accepted += r.status == 200 and r.headers["x-extproc-decision"] == "accept"
        await asyncio.gather(*[one() for _ in range(n)])
        await asyncio.sleep(1)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONCURRENCY * 2)) as http:
        await run(http, WARMUP)
        base = rss_kib(pid)
        growth = []
        for _ in range(ROUNDS):
            await run(http, PER_ROUND)
            growth.append(rss_kib(pid) - base)
        assert (await healthz(http, s.metrics_url))["stream_errors"] == 0
    per_request = growth[-1] * 1024 / (ROUNDS * PER_ROUND)
    print(f"\nRSS growth after warm-up, KiB per {PER_ROUND} requests: {growth}; {per_request:.0f} B per request")
    assert accepted == WARMUP + ROUNDS * PER_ROUND
    assert per_request < 60, "before the shielded read it was ~125 B per request"
