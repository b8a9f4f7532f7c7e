"""`extproc serve --workers 2` behind one Envoy rendered for it (`envoyconf.render(workers=True)`): the workers share
the caps through this host's memory (policy store `memory`) or through Redis, so one cap holds exactly across them,
and each worker's access log brings back the completions of the requests it admitted (ticket header `<i>-<id>.<instance>`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import aiohttp
import pytest
import yaml

from extproc.policy.schema import StoreSpec
from extproc.store.host_store import HostStore
from extproc.store.redis_store import RedisStore
from extproc.tools import envoyconf, reaper
from extproc.tools.stack import free_port, free_ports, stop_group, wait_http
from tests.conftest import policy_file, stop_process, until
from tests.integration.helpers import chat, metrics, post, sample, sample_once, upstream_reset, upstream_stats

CAP = 4
WORKERS = 2


def worker(supervisor: int, index: int) -> tuple[int, list[str]]:
    """(pid, argv) of the supervisor's worker `index`."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode().split("\0")
            ppid = int((cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if ppid == supervisor and "--worker-index" in argv and argv[argv.index("--worker-index") + 1] == str(index):
            return int(cmdline.parent.name), argv
    raise LookupError(f"worker {index} of {supervisor} not found")


def serve(policy: Path, grpc: int, metrics_port: int, log: Path) -> subprocess.Popen:
    with open(log, "wb") as err:
        return subprocess.Popen([sys.executable, "-m", "extproc.cli", "serve", "--policy", str(policy),
                                 "--grpc", f"127.0.0.1:{grpc}", "--metrics", f"127.0.0.1:{metrics_port}",
                                 "--drain-s", "0", "--grace-s", "1", "--workers", str(WORKERS)],
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


@contextlib.contextmanager
def workers_behind_envoy(tmp_path: Path, policy: Path, upstream: tuple[str, int],
                         **render) -> Iterator[tuple[str, int, subprocess.Popen]]:
    """`extproc serve --workers WORKERS` on `policy` behind one Envoy (envoyconf.render with `render`'s options), both
    started and ready: yields (Envoy's URL, the first worker's metrics port, the supervisor). Each process's stop is
    registered as it starts, so a failure anywhere (a start, the test, a stop that raises) leaves neither running:
    Envoy is stopped first, then the supervisor's whole process group (its workers too)."""
    grpc, mport = free_ports(WORKERS), free_ports(WORKERS)
    listen, admin = free_port(), free_port()
    cfg = envoyconf.render(envoyconf.load_source(), listen_port=listen, admin_port=admin,
                           extproc=[("127.0.0.1", grpc + i) for i in range(WORKERS)],
                           pools={"vllm_llama70b": [upstream], "vllm_llama8b": [upstream]}, **render)
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    with contextlib.ExitStack() as stops:
        sup = serve(policy, grpc, mport, tmp_path / "extproc.log")
        stops.callback(stop_group, sup, timeout=20)
        envoy = subprocess.Popen([envoyconf.envoy_binary(), "-c", str(tmp_path / "envoy.yaml"), "--concurrency", "1",
                                  "--log-level", "error", "--base-id", str(admin), "--disable-hot-restart"],
                                 start_new_session=True)
        stops.callback(stop_process, envoy, 10.0)
        for i in range(WORKERS):
            wait_http(f"http://127.0.0.1:{mport + i}/healthz", timeout=30, proc=sup)
        wait_http(f"http://127.0.0.1:{admin}/ready", proc=envoy)
        time.sleep(2.5)  # Envoy's gRPC health check (1 s interval) marks both workers healthy
        yield f"http://127.0.0.1:{listen}", mport, sup


@pytest.fixture(params=["memory", "redis"])
def workers(request, tmp_path, upstream):
    """(Envoy URL, the workers' metrics URLs, the supervisor) for a cap of CAP shared by two workers."""
    if request.param == "redis":
        redis = request.getfixturevalue("redis_server")
        store = {"kind": "redis", "url": redis.url, "key_prefix": f"w{free_port()}:"}
    else:
        store = {"kind": "memory"}
    policy = policy_file(tmp_path, classes={"interactive": {"max_concurrency": CAP, "max_queue": 100,
                                                            "max_wait_ms": 10_000},
                                            "batch": {"max_concurrency": 2}}, store=store)
    with workers_behind_envoy(tmp_path, policy, upstream, workers=True) as (url, mport, sup):
        yield url, [f"http://127.0.0.1:{mport + i}" for i in range(WORKERS)], sup, store


async def test_two_workers_hold_one_cap_and_each_hears_its_own_completions(workers, upstream):
    url, metrics_urls, sup, store = workers
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)

        async def client() -> list[int]:
            return [(await post(http, url, chat(), {"x-test-delay-ms": "60"}))[0] for _ in range(3)]

        results = await asyncio.gather(*[client() for _ in range(16)])
        assert sorted({s for r in results for s in r}) == [200]
        assert (await upstream_stats(http, upstream))["max_in_service"] == CAP  # one cap, not one per worker
        accepted = []
        for m in metrics_urls:
            ms = await metrics(http, m)
            accepted.append(sample(ms, "extproc_requests_total", decision="accept"))
            # Every admission of this worker comes back through its own access log, none of the other's.
            assert await sample_once(http, m, "extproc_completion_reports_total", accepted[-1],
                                     result="matched") == accepted[-1]
            assert sample(ms, "extproc_completion_reports_total", result="unmatched") == 0
        assert sum(accepted) == 48 and min(accepted) > 0  # Envoy spread the streams over both workers
    assert await until(lambda: shared_count(sup, store), holds=lambda n: n == 0) == 0  # every slot given back


async def shared_count(sup: subprocess.Popen, store: dict) -> int:
    """Slots of `interactive` held in the store the workers share, read from outside them."""
    if store["kind"] == "redis":
        shared = RedisStore(StoreSpec(kind="redis", url=store["url"], key_prefix=store["key_prefix"]))
        try:
            return await shared.count("interactive")
        finally:
            await shared.close()
    _, argv = worker(sup.pid, 0)
    table = HostStore(Path(argv[argv.index("--host-store") + 1]), 0, WORKERS)
    try:
        return table.count("interactive")
    finally:
        await table.close()


def test_the_supervisor_stops_every_worker_on_sigterm_and_cleans_up(workers, request):
    _, metrics_urls, sup, _ = workers
    with urllib.request.urlopen(f"{metrics_urls[0]}/metrics") as r:
        assert 'extproc_store_state{state="shared"} 1.0' in r.read().decode()
    _, argv = worker(sup.pid, 0)
    table = Path(argv[argv.index("--host-store") + 1]) if "--host-store" in argv else None
    assert (table is not None) == (request.node.callspec.params["workers"] == "memory")
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(20) == 0
    for m in metrics_urls:
        with pytest.raises(OSError):
            wait_http(f"{m}/healthz", timeout=0.5)
    assert table is None or not table.exists()  # the supervisor removed the workers' table


def test_a_dead_worker_stops_the_others(workers):
    _, metrics_urls, sup, _ = workers
    os.kill(worker(sup.pid, 1)[0], signal.SIGKILL)
    # Exits with the dead worker's status as a shell reports it (128 + 9): the pod restarts whole, on a fresh table
    assert sup.wait(20) == 137
    with pytest.raises(OSError):
        wait_http(f"{metrics_urls[0]}/healthz", timeout=0.5)


def test_workers_do_not_outlive_a_killed_supervisor(workers):
    """SIGKILL leaves the supervisor no chance to stop its workers: they get SIGTERM from the kernel
    (PR_SET_PDEATHSIG) and drain, instead of serving on unwatched."""
    _, metrics_urls, sup, _ = workers
    pids = [worker(sup.pid, i)[0] for i in range(WORKERS)]
    _, argv = worker(sup.pid, 0)
    table = Path(argv[argv.index("--host-store") + 1]) if "--host-store" in argv else None
    sup.kill()
    sup.wait(10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.2)
    assert not any(Path(f"/proc/{p}").exists() for p in pids), pids
    if table is not None:  # a killed supervisor cannot remove its table: the test does
        assert table.name.startswith("extproc-workers-"), table  # the supervisor's own temporary directory
        shutil.rmtree(table, ignore_errors=True)


def test_a_sighup_at_start_up_kills_no_worker(tmp_path):
    """The supervisor forwards SIGHUP (reload) at once; a worker that had not installed its handler yet died of
    it, and the service exited without a word."""
    policy = policy_file(tmp_path, store={"kind": "memory"})
    grpc, mport = free_ports(WORKERS), free_ports(WORKERS)
    sup = serve(policy, grpc, mport, tmp_path / "extproc.log")
    try:
        deadline = time.monotonic() + 20
        while True:  # the workers exist, still starting (importing, loading the policy): reload them now
            try:
                worker(sup.pid, WORKERS - 1)
                break
            except LookupError:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        sup.send_signal(signal.SIGHUP)
        for i in range(WORKERS):
            wait_http(f"http://127.0.0.1:{mport + i}/healthz", timeout=30, proc=sup)
        assert sup.poll() is None
    finally:
        stop_group(sup, timeout=20)


@pytest.mark.parametrize("failure", ["envoy-start", "envoy-stop"])
def test_a_failure_in_the_fixture_leaves_no_process(tmp_path, monkeypatch, failure):
    """Envoy's start raising (here: no binary) or its stop raising (a wait that timed out) once left the supervisor
    and its workers running: the supervisor was started before the fixture's `try`, and stopped after Envoy's wait
    within its `finally`."""
    pids: list[int] = []  # the supervisor's and its workers', recorded when the failure comes
    sups: list[subprocess.Popen] = []
    envoys: list[subprocess.Popen] = []
    real_serve, real_stop = serve, stop_process

    def recorded_serve(*args) -> subprocess.Popen:
        sups.append(real_serve(*args))
        return sups[-1]

    def fail(error: BaseException):
        pids.extend(asyncio.run(until(lambda: with_workers(sups[-1]), timeout=30)))
        raise error

    def envoy_binary():
        fail(FileNotFoundError("no envoy here"))

    def stop_that_times_out(proc: subprocess.Popen, grace_s: float):
        envoys.append(proc)
        fail(subprocess.TimeoutExpired("envoy", grace_s))

    monkeypatch.setattr(f"{__name__}.serve", recorded_serve)
    if failure == "envoy-start":
        monkeypatch.setattr(envoyconf, "envoy_binary", envoy_binary)
    else:
        monkeypatch.setattr(f"{__name__}.stop_process", stop_that_times_out)
    upstream = ("127.0.0.1", free_port())  # nothing is sent
    try:
        with pytest.raises(FileNotFoundError if failure == "envoy-start" else subprocess.TimeoutExpired):
            with workers_behind_envoy(tmp_path, policy_file(tmp_path, store={"kind": "memory"}), upstream):
                pass
        assert len(pids) == 1 + WORKERS
        assert [p for p in map(reaper.running, pids) if p] == []
    finally:
        for envoy in envoys:
            real_stop(envoy, 10.0)


def with_workers(sup: subprocess.Popen) -> list[int]:
    """The pids of the supervisor and of its workers once every worker runs; [] before."""
    try:
        return [sup.pid, *(worker(sup.pid, i)[0] for i in range(WORKERS))]
    except LookupError:
        return []
