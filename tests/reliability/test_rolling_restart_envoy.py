"""A rolling restart of two ext_proc instances behind one Envoy, under load, admits every request: on SIGTERM an
instance reports NOT_SERVING but keeps deciding until Envoy's gRPC health check has moved new streams to the
other one, then lets its open streams finish and exits. With failure_mode_allow: true (shipped) any request Envoy
sent to an instance that no longer took streams would reach the upstream unadmitted."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
import pytest

from extproc.tools.stack import Stack
from tests.conftest import policy_file, until
from tests.integration.helpers import chat, equals, healthz, metrics, post, sample, upstream_reset, upstream_stats

DRAIN_S = 5.0  # > Envoy's time to mark the instance unhealthy: 2 failed checks 1 s apart (+ 0.5 s timeout)
HEALTH = "envoy.service.ext_proc.v3.ExternalProcessor"


@pytest.fixture
def two_extprocs(tmp_path, upstream):
    policy = policy_file(tmp_path, classes={"interactive": {"max_concurrency": 64, "max_queue": 64,
                                                            "max_wait_ms": 2000}}, tenants=[], shed={})
    pools = {"vllm_llama70b": [upstream], "vllm_llama8b": [upstream]}
    s = Stack(tmp_path / "rolling", pools, policy_path=policy, extprocs=2,
              extproc_args=["--drain-s", str(DRAIN_S), "--grace-s", "10", "--watch-interval", "0"])
    with s:
        yield s
        for i in range(s.extprocs):  # no drain at teardown
            with contextlib.suppress(StopIteration):
                s.process(s.extproc_name(i)).stop(signal.SIGKILL)


async def envoy_sees(http, stack: Stack, i: int) -> str:
    """How Envoy's ext_proc cluster sees instance i: "healthy", or its health flags (e.g. /failed_active_hc)."""
    async with http.get(f"{stack.admin_url}/clusters") as r:
        text = await r.text()
    prefix = f"extproc::127.0.0.1:{stack.grpc_ports[i]}::health_flags::"
    return next(line[len(prefix):] for line in text.splitlines() if line.startswith(prefix))


async def status_of(http, stack: Stack, i: int) -> tuple[int, str] | None:
    try:
        async with http.get(f"http://127.0.0.1:{stack.metrics_ports[i]}/healthz") as r:
            return r.status, (await r.json())["status"]
    except aiohttp.ClientError:
        return None


async def restart(http, stack: Stack, i: int) -> dict:
    """SIGTERM instance i, wait for it to exit, start it again, wait until Envoy uses it again. Returns when each
    step happened (seconds after the SIGTERM) for the caller to check after the load has stopped."""
    old = stack.process(stack.extproc_name(i))
    t0 = time.monotonic()
    os.killpg(old.popen.pid, signal.SIGTERM)
    steps = {"draining": await until(lambda: equals(status_of(http, stack, i), (503, "draining")), timeout=3)}
    if await until(lambda: equals(envoy_sees(http, stack, i), "/failed_active_hc"), timeout=DRAIN_S):
        steps["out of Envoy's cluster"] = time.monotonic() - t0
        steps["still deciding then"] = old.alive()
    await until(lambda: not old.alive(), timeout=DRAIN_S + 15)
    steps["exited"] = time.monotonic() - t0
    stack.processes.remove(old)
    await asyncio.to_thread(stack.start_extproc, i)  # the load keeps running meanwhile
    if await until(lambda: equals(envoy_sees(http, stack, i), "healthy"), timeout=10):
        steps["healthy in Envoy again"] = time.monotonic() - t0
    return steps


async def test_a_rolling_restart_under_load_admits_every_request(two_extprocs, upstream):
    s = two_extprocs
    async with aiohttp.ClientSession() as http:
        for i in range(2):
            assert await until(lambda: equals(envoy_sees(http, s, i), "healthy"), timeout=10)
        await upstream_reset(http, upstream)
        results: list[tuple[int, str | None]] = []  # (status, x-extproc-decision)
        stop = asyncio.Event()

        async def client():
            while not stop.is_set():
                try:
                    status, headers, _ = await post(http, s.url, chat(), {"x-test-delay-ms": "20"})
                    results.append((status, headers.get("x-extproc-decision")))
                except aiohttp.ClientError as e:
                    results.append((-1, type(e).__name__))

        clients = [asyncio.create_task(client()) for _ in range(4)]
        steps = []
        try:
            for i in range(2):
                steps.append(await restart(http, s, i))
                before = len(results)
                assert await until(lambda: len(results) > before + 20, timeout=10)
        finally:
            stop.set()
            await asyncio.gather(*clients)

        unadmitted = [r for r in results if r[1] not in ("accept", "reject", "queue")]
        stats = await upstream_stats(http, upstream)
        assert unadmitted == [] and stats["unticketed"] == 0, (unadmitted[:5], len(unadmitted), stats["unticketed"])
        assert {st for st, _ in results} == {200}
        assert stats["served"] == len(results) > 200
        for st in steps:
            assert st["draining"] and st["still deciding then"], st  # Envoy moved before it stopped deciding
            # Its 20 ms requests end at once: the grace must not wait for Envoy's access log stream either.
            assert st["exited"] < DRAIN_S + 4 and "healthy in Envoy again" in st, st
        for i in range(2):  # each restarted instance took traffic again
            ms = await metrics(http, f"http://127.0.0.1:{s.metrics_ports[i]}")
            assert sample(ms, "extproc_requests_total", decision="accept") > 0
    print(f"\nRELIABILITY rolling restart: {len(results)} requests from 4 clients, 0 unadmitted "
          f"(upstream saw {stats['unticketed']} without a ticket)\n" + "\n".join(
              f"  {s.extproc_name(i)}: " + ", ".join(f"{k} {v:.1f}s" for k, v in st.items() if k not in (
                  "draining", "still deciding then")) for i, st in enumerate(steps)))


async def test_sigterm_reports_not_serving_keeps_deciding_and_a_second_signal_ends_the_drain(tmp_path, upstream):
    policy = policy_file(tmp_path)
    s = Stack(tmp_path / "drain", {"vllm_llama70b": [upstream], "vllm_llama8b": [upstream]}, policy_path=policy,
              extproc_args=["--drain-s", "60", "--watch-interval", "0"])
    with s:
        proc = s.process("extproc")
        async with aiohttp.ClientSession() as http:
            os.killpg(proc.popen.pid, signal.SIGTERM)
            assert await until(lambda: equals(status_of(http, s, 0), (503, "draining")), timeout=3)
            assert (await healthz(http, s.metrics_url))["status"] == "draining"
            async with grpc.aio.insecure_channel(f"127.0.0.1:{s.grpc_port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for service in ("", HEALTH):
                    got = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                    assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING, service
            status, headers, _ = await post(http, s.url, chat())  # still decided while draining
            assert status == 200 and headers["x-extproc-decision"] == "accept"
            assert proc.alive()
            t0 = time.monotonic()
            os.killpg(proc.popen.pid, signal.SIGTERM)  # the second signal cuts the 60 s drain short
            assert await until(lambda: not proc.alive(), timeout=10)
            assert time.monotonic() - t0 < 10 and proc.popen.returncode == 0
            assert "extproc stopped" in proc.tail(5)
