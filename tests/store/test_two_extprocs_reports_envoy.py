"""Two ext_proc instances behind one Envoy, sharing a Redis store: Envoy streams its access log (the completion
reports) to one of them, so half the reports reach the instance that did not admit the request. Each must still
learn every one of its own requests' status and timings, and never another instance's."""

from __future__ import annotations

import aiohttp
import pytest

from extproc.tools.stack import Stack, free_port
from tests.conftest import policy_file, until
from tests.integration.helpers import chat, metrics, post, sample
from tests.store.test_workers_envoy import workers_behind_envoy

REQUESTS = 24  # every third fails upstream


@pytest.fixture
def two_extprocs(tmp_path, upstream, redis_server):
    policy = policy_file(tmp_path, classes={
        "interactive": {"max_concurrency": 8, "max_queue": 8, "max_wait_ms": 2000},
        "batch": {"max_concurrency": 8, "max_queue": 8, "max_wait_ms": 2000}}, tenants=[], shed={},
        store={"kind": "redis", "url": redis_server.url, "key_prefix": f"rp{free_port()}:", "timeout_ms": 500})
    pools = {"vllm_llama70b": [upstream], "vllm_llama8b": [upstream]}
    with Stack(tmp_path / "two", pools, policy_path=policy, extprocs=2,
               extproc_args=["--watch-interval", "0", "--drain-s", "0"]) as s:
        yield s


@pytest.fixture
def workers_one_log(tmp_path, upstream, redis_server):
    """`extproc serve --workers 2` on Redis, both ports in Envoy's `extproc` cluster under envoy.yaml's one access
    log, as docs/kubernetes.md has a pod run it: each worker gets the other's reports too. (Envoy, the metrics
    ports.)"""
    policy = policy_file(tmp_path, classes={
        "interactive": {"max_concurrency": 8, "max_queue": 8, "max_wait_ms": 2000},
        "batch": {"max_concurrency": 8, "max_queue": 8, "max_wait_ms": 2000}}, tenants=[], shed={},
        store={"kind": "redis", "url": redis_server.url, "key_prefix": f"rw{free_port()}:", "timeout_ms": 500})
    with workers_behind_envoy(tmp_path, policy, upstream, health_check_interval_s=1.0) as (url, mport, _):
        yield url, [mport, mport + 1]


async def outcomes(http, ports: list[int]) -> list[dict]:
    out = []
    for port in ports:
        ms = await metrics(http, f"http://127.0.0.1:{port}")
        out.append({(c, o): sample(ms, "extproc_request_duration_seconds_count", **{"class": c, "outcome": o})
                    for c in ("interactive", "batch") for o in ("ok", "upstream_error", "ended")}
                   | {r: sample(ms, "extproc_completion_reports_total", result=r)
                      for r in ("matched", "relayed", "unmatched")})
    return out


async def test_each_instance_learns_how_its_own_requests_ended(two_extprocs):
    await each_learns_its_own(two_extprocs.url, two_extprocs.metrics_ports)


async def test_each_worker_learns_how_its_own_requests_ended_under_one_access_log(workers_one_log):
    """Before, a worker dropped the other worker's reports as not its own (unmatched): one worker accounted every
    one of its requests as `ended`, none `ok` or `upstream_error`."""
    await each_learns_its_own(*workers_one_log)


async def each_learns_its_own(url: str, metrics_ports: list[int]) -> None:
    async with aiohttp.ClientSession() as http:
        for i in range(REQUESTS):
            # The failures are batch requests, the successes interactive: a report landing on the wrong ticket
            # would show up as a batch `ok` or an interactive `upstream_error`.
            failing = i % 3 == 0
            status, headers, _ = await post(http, url, chat(), {
                "x-priority": "batch" if failing else "interactive",
                "x-test-status": "503" if failing else "200"})
            assert status == (503 if failing else 200) and headers["x-extproc-decision"] == "accept"

        def settled(per: list[dict]) -> bool:
            return sum(p[k] for p in per for k in (("interactive", "ok"), ("batch", "upstream_error"),
                                                   ("interactive", "ended"), ("batch", "ended"))) == REQUESTS

        per = await until(lambda: outcomes(http, metrics_ports), timeout=10, holds=settled)
    total = {k: sum(p[k] for p in per) for k in per[0]}
    assert min(p[("interactive", "ok")] + p[("batch", "upstream_error")] for p in per) > 0  # both admitted some
    assert total[("interactive", "ok")] == REQUESTS - REQUESTS // 3
    assert total[("batch", "upstream_error")] == REQUESTS // 3
    assert total[("interactive", "ended")] == total[("batch", "ended")] == 0
    assert total[("batch", "ok")] == total[("interactive", "upstream_error")] == 0
    assert total["matched"] == REQUESTS and total["unmatched"] == 0
    assert total["relayed"] > 0  # one instance got the other's reports and sent them on
