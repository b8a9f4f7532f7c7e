"""`extproc serve`: the gRPC ext_proc server, its HTTP side (/metrics, /healthz) and policy reloads."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import hashlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, ProcessCollector

from ..policy.admission import AdmissionController
from ..policy.changes import policy_changes
from ..policy.sustained import SustainedLoad
from ..policy.schema import (Policy, PolicyError, load_policy_bytes, policy_warnings,
                             read_policy_bytes)
from ..store import host_store, open_store
from ..store.shared_slots import SharedSlots
from ..telemetry import StoreTelemetry, Telemetry
from .accesslog import AccessLogReceiver, ReportRelay, TicketTags
from .clusters import ClusterCheck
from .loop_lag import probe_loop_lag
from .protocol import MAX_BODY_BYTES, MAX_PENDING_BODIES, grpc_receive_limit
from .saturation import SaturationScrapers, host_port, split_host_port
from .servicer import ExtProcServicer

log = logging.getLogger("extproc")

# /healthz "status" (503 unless serving). Draining: SIGTERM received, still deciding (see Server._drain).
STARTING, SERVING, DRAINING = "starting", "ok", "draining"
# A scrape that took less than this the last time is written on the event loop: one moment for every series (in a
# thread the counters ran on while the text was written, ahead of the core's gauges read before it: a request
# counted as dequeued beside the pool gauges of before its dequeue). A longer one, or the first, goes to a thread.
SCRAPE_ON_LOOP_S = 0.02
# gRPC health services reported SERVING, then NOT_SERVING from the first SIGTERM. Envoy's health check asks for
# the second (envoy.yaml); "" is the server as a whole (grpc_health_probe, Kubernetes gRPC probes).
HEALTH_SERVICES = ("", "envoy.service.ext_proc.v3.ExternalProcessor")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", required=True, help="policy YAML file (see `extproc check`)")
    p.add_argument("--no-uvloop", action="store_true", help="run on asyncio's default event loop, not uvloop")
    p.add_argument("--grpc", type=split_host_port, default=("127.0.0.1", 50051), metavar="HOST:PORT",
                   help="ext_proc gRPC listen address (default 127.0.0.1:50051)")
    p.add_argument("--metrics", type=split_host_port, default=("127.0.0.1", 9090), metavar="HOST:PORT",
                   help="HTTP /metrics and /healthz address (default 127.0.0.1:9090; keep it off public interfaces)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help="largest request body accepted (match Envoy's per_connection_buffer_limit_bytes)")
    p.add_argument("--max-pending-bodies", type=int, default=MAX_PENDING_BODIES, metavar="N",
                   help="requests whose body has not arrived yet held at once (default 10,000); past it new requests "
                        "get 503 bodies_pending: held streams must not fill Envoy's extproc circuit breaker "
                        "(100,000), past which failure_mode_allow lets requests through unadmitted")
    p.add_argument("--watch-interval", type=float, default=2.0,
                   help="seconds between checks of the policy file for changes (0 disables; SIGHUP always works)")
    p.add_argument("--drain-s", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM, keep deciding new requests this long while gRPC health and /healthz report "
                        "not serving, so Envoy's health check moves traffic to another ext_proc first (default 10; "
                        "0 skips the drain; a second SIGTERM/SIGINT cuts it short)")
    p.add_argument("--grace-s", type=float, default=30.0, metavar="SECONDS",
                   help="after the drain, stop taking new streams and give open ones this long to finish (default "
                        "30; a signal during it cuts them at once)")
    p.add_argument("--log-level", default=os.environ.get("EXTPROC_LOG_LEVEL", "INFO"))
    p.add_argument("--log-accept-sample", type=float, default=0.0, metavar="FRACTION",
                   help="also log this share of accepted requests (refusals and degrades are logged, within "
                        "--log-decisions-per-s), e.g. 0.01")
    p.add_argument("--log-decisions-per-s", type=int, default=20, metavar="N",
                   help="at most N decision lines a second per (class, decision, reason); the rest are summed up "
                        "in one `decisions_suppressed` line a second (the metrics count every decision); 0: no limit")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="run N ext_proc processes (one core each), worker i on the --grpc and --metrics ports + i, "
                        "sharing the caps through this host's memory (policy `store: {kind: memory}`) or the "
                        "policy's Redis store; list every worker in Envoy's ext_proc cluster (`extproc "
                        "envoy-config --workers N`)")
    p.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)  # set for each worker
    p.add_argument("--host-store", default=None, help=argparse.SUPPRESS)  # the workers' shared table (kind: memory)


# Streams one gRPC connection may hold, and calls waiting for the server to take them: Envoy's `extproc` cluster
# circuit breaker (max_requests: 100,000 in envoy.yaml) is the bound that counts.
GRPC_MAX_STREAMS = 100_000


class Server:
    """Owns the core, the servicer and the endpoints; reloads the policy on SIGHUP or file change."""

    def __init__(self, policy_path: str, policy: Policy, args: argparse.Namespace,
                 loaded_version: FileVersion | None = None, digest: bytes | None = None):
        """`loaded_version`: the file's version (file_version) read before `policy` was loaded from it (default:
        now). `digest`: that of the bytes `policy` was parsed from (read_policy), so that a reload of the same
        bytes is not a parse (default: none, the first reload parses)."""
        self.policy_path = policy_path
        self.args = args
        self.telemetry = Telemetry(log_accept_sample=args.log_accept_sample, log_per_s=args.log_decisions_per_s)
        # process_cpu_seconds_total and process_start_time_seconds: what the alerts send on-call to when Envoy let
        # requests through (a saturated event loop, near one CPU second a second, or a restart).
        ProcessCollector(registry=self.telemetry.registry)
        self.core = AdmissionController(policy, events=self.telemetry)
        self.sustained = SustainedLoad(policy.sustained_window_s)
        self.telemetry.watch(self.core, self.sustained)
        store = open_store(policy.store, host=_host_store(args))
        self.shared: SharedSlots | None = None
        if store.shared:
            self.shared = SharedSlots(self.core, store, StoreTelemetry(self.telemetry.registry),
                                      workers=args.workers)
        tags = TicketTags(args.worker_index)
        self.servicer = ExtProcServicer(self.core, max_body_bytes=args.max_body_bytes, shared=self.shared,
                                        on_error=self.telemetry.stream_errors.inc, tags=tags,
                                        max_pending_bodies=args.max_pending_bodies)
        # Instances sharing a Redis store pass each other the reports Envoy sent to the wrong one.
        self.access_log = AccessLogReceiver(self.core, self.telemetry, tags,
                                            relay=store if isinstance(store, ReportRelay) else None)
        self.scrapers = SaturationScrapers(self.core)
        self.clusters = ClusterCheck(self.telemetry.policy_unknown_clusters)
        _log_warnings(policy)
        # Read before the load: an edit that lands while the file loads must still count as a change.
        self._version = file_version(policy_path) if loaded_version is None else loaded_version
        self._watched_at = 0.0
        self._reloading = asyncio.Lock()
        self._reload_waiting = False  # a reload asked for has not read the file yet (start_reload)
        # The digest of the file applied last (at start, or by a reload) and its policy.
        self._parsed: tuple[bytes, Policy] | None = None if digest is None else (digest, policy)
        self._reload_tasks: set[asyncio.Task] = set()
        self.heap = FrozenHeap()
        self._scrape_s = float("inf")  # how long the last /metrics text took to write (SCRAPE_ON_LOOP_S)
        self.status = STARTING

    def start_reload(self) -> None:
        """SIGHUP and the file watch: reload in a task of its own, so neither waits for it. One reload that has not
        read the file yet serves every ask until it does: it reads the file as it is then. A storm of SIGHUPs queued
        one reload each, each parsing the file in turn (2,000 tenants: 0.65-1.3 s each): 100 of them, one every
        0.2 s, kept it parsing for 75 s after the last, every answer slower meanwhile (bench/reload.py)."""
        if self._reload_waiting:
            return
        self._reload_waiting = True
        task = asyncio.get_running_loop().create_task(self.reload())
        self._reload_tasks.add(task)
        task.add_done_callback(self._reload_tasks.discard)

    async def reload(self) -> bool:
        """Apply the policy file if it validates; otherwise keep serving the old one. Never raises: an exception
        would be lost in its task. The file is read and validated in a thread: on the event loop a big file (20,000
        tenants: 10 s of YAML) held every admission, and past Envoy's 0.5 s message_timeout failure_mode_allow sent
        the requests upstream unadmitted. Reloads run one at a time, in the order asked (start_reload: asks that
        come while one waits to read the file are that one)."""
        async with self._reloading:
            self._reload_waiting = False  # an ask from now on may come after an edit this reload does not read
            policy = self.core.policy
            ok = await self._reload()
            if self.core.policy is not policy:  # applied: the old policy is garbage once `policy` lets go of it
                del policy
                await asyncio.sleep(0)  # the answers the apply held go out first
                self.heap.settle()
            return ok

    async def _reload(self) -> bool:
        self._version = file_version(self.policy_path)
        before = self.core.policy
        try:
            parsed = await asyncio.to_thread(read_policy, self.policy_path, self._parsed)
            if parsed is self._parsed:  # the file applied last, byte for byte: its policy is in force
                self._in_force(parsed[1])  # said again while it is due
                self._reconfigure()  # what a SIGHUP is documented to restart: a stopped scraper, the cluster check
            else:
                self._apply(parsed[1])
        except PolicyError as e:
            self.telemetry.policy_reloaded(applied=False)
            log.error("policy reload refused, keeping the current policy:\n  %s", "\n  ".join(e.errors))
            return False
        except Exception:
            self.telemetry.policy_reloaded(applied=False)
            log.exception("policy reload from %s failed", self.policy_path)
            return False
        self._parsed = parsed
        self.telemetry.policy_reloaded(applied=True)
        changes = "no change" if self.core.policy is before else policy_changes(before, self.core.policy)
        log.info("policy reloaded from %s: %s", self.policy_path, changes)
        _log_warnings(self.core.policy)
        return True

    def _in_force(self, policy: Policy) -> Policy:
        """The file's policy as it applies: with the running store, and a warning if the file's differs."""
        running = self.core.policy.store
        if policy.store == running:
            return policy
        # The store is opened once, at start: the policy in force keeps the running one, so the reload line,
        # the next reload and cap_scope() speak of the store that runs, not of the file's.
        pending = dataclasses.replace(policy, store=running)
        log.warning("policy reload: `store` differs from the running store (%s); it applies on restart, the "
                    "running store stays", policy_changes(pending, policy))
        return pending

    def _apply(self, policy: Policy) -> None:
        policy = self._in_force(policy)
        if self.shared is not None:
            self.shared.apply(policy)
        else:
            self.core.apply(policy)
        self._reconfigure()

    def _reconfigure(self) -> None:
        """The saturation scrapers and Envoy's cluster check, for the policy in force: a reload restarts a scraper
        that had stopped and names a missing cluster again, also for a file unchanged since the last one."""
        # Held like the reload tasks: the loop keeps only a weak reference to a task, so one nobody holds may be
        # collected before it has reconfigured the scrapers.
        policy = self.core.policy
        for configure in (self.scrapers.configure(policy.pools), self.clusters.configure(policy)):
            task = asyncio.get_running_loop().create_task(configure)
            self._reload_tasks.add(task)
            task.add_done_callback(self._reload_tasks.discard)

    async def control(self) -> None:
        """Limits move on their own intervals; tick often enough that none waits long for its turn (the policy's
        `tick_s`, which a reload may change)."""
        await _every(lambda: self.core.tick_s, self._tick, "control tick")

    async def _tick(self) -> None:
        self.core.tick()

    async def housekeeping(self) -> None:
        await _every(1.0, self.housekeep, "housekeeping")

    async def housekeep(self) -> None:
        """Pick up policy file changes, renew live leases, reap expired ones, sum up suppressed decision lines."""
        # The watch first: a step below that raised (each round, say, while some request is held) skipped it, and
        # file edits went unapplied, with only that step's error in the log, while SIGHUP still worked.
        self.watch_policy_file()
        self.servicer.renew_live()
        self.telemetry.log_budget.flush()
        expired = self.core.reap()
        if self.shared is not None:
            for t in expired:
                self.shared.release(t)
            await self.shared.tick()
        now = self.core.clock()
        self.sustained.window_s = self.core.policy.sustained_window_s
        self.sustained.sample(now, self.core.snapshot())

    def watch_policy_file(self) -> None:
        """Reload when the policy file changed since it was loaded (checked every --watch-interval)."""
        now = self.core.clock()
        if self.args.watch_interval and now - self._watched_at >= self.args.watch_interval:
            self._watched_at = now
            if file_version(self.policy_path) != self._version and not self._reloading.locked():
                self.start_reload()

    async def run(self) -> None:
        grpc_server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", grpc_receive_limit(self.args.max_body_bytes)),
            ("grpc.max_send_message_length", self.args.max_body_bytes * 2 + (64 << 10)),
            ("grpc.so_reuseport", 0),  # a second server must fail to bind, not silently share the port
            ("grpc.max_concurrent_streams", GRPC_MAX_STREAMS),
            # New calls wait in gRPC core until grpc.aio's loop takes them, one at a time. Past its defaults (1,000
            # waiting, 3,000 at most) core cancels new ones, and Envoy turns a cancelled stream into a request sent
            # on unadmitted at once (failure_mode_allow): a spike must wait here like any slow answer.
            ("grpc.server.max_pending_requests", GRPC_MAX_STREAMS),
            ("grpc.server.max_pending_requests_hard_limit", GRPC_MAX_STREAMS),
        ])
        pb_grpc.add_ExternalProcessorServicer_to_server(self.servicer, grpc_server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(self.access_log, grpc_server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
        host, port = self.args.grpc
        try:
            bound = grpc_server.add_insecure_port(host_port(host, port))
        except RuntimeError:  # grpcio raises on a port in use rather than returning 0
            bound = 0
        if not bound:
            raise SystemExit(f"extproc: cannot listen on {host_port(host, port)} for gRPC (in use, or not an address "
                             "here)")
        await grpc_server.start()
        if self.shared is not None:
            await self.shared.start()
        try:
            runner = await self._start_http()
        except SystemExit:
            # Stopped on this loop: left to the garbage collector, grpc's server schedules its shutdown on the
            # closed loop and prints a traceback under the one-line error.
            await grpc_server.stop(grace=None)
            raise
        self.heap.settle()  # what start-up made lives as long as the process
        for service in HEALTH_SERVICES:
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.status = SERVING
        loop = asyncio.get_running_loop()
        signals = _Signals()
        loop.add_signal_handler(signal.SIGHUP, self.start_reload)
        if file_version(self.policy_path) != self._version:  # changed while it started: a SIGHUP then was ignored (cli)
            self.start_reload()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, signals.received)
        housekeeping = asyncio.create_task(self.housekeeping())
        control = asyncio.create_task(self.control())
        lag_probe = asyncio.create_task(probe_loop_lag(self.telemetry.loop_lagged))
        await self.scrapers.configure(self.core.policy.pools)
        await self.clusters.configure(self.core.policy)
        grpc_at, http_at = host_port(host, bound), host_port(*self.args.metrics)
        log.info("extproc serving: grpc %s, http %s, policy %s", grpc_at, http_at, self.policy_path)
        print(f"extproc ready grpc={grpc_at} http={http_at}", flush=True)
        await signals.wait(1)
        await self._drain(health_servicer, signals)
        await self._stop_streams(grpc_server, signals)
        # Leases of the streams that ran to the end were renewed until now; the releases go out below.
        housekeeping.cancel()
        control.cancel()
        lag_probe.cancel()
        await self.scrapers.stop()
        await self.clusters.stop()
        if self.shared is not None:
            await self.shared.close()
        await runner.cleanup()
        log.info("extproc stopped")

    async def _drain(self, health_servicer: health.aio.HealthServicer, signals: "_Signals") -> None:
        """Report not serving, yet keep deciding every new stream for --drain-s: Envoy's active gRPC health check
        (envoy.yaml) takes this instance out within a few seconds and sends new streams to another one. Refusing
        streams at once would let them through unadmitted (failure_mode_allow: true)."""
        self.status = DRAINING
        await health_servicer.enter_graceful_shutdown()  # NOT_SERVING for "" and the ExternalProcessor service
        if self.args.drain_s <= 0:
            return
        log.info("draining: reporting NOT_SERVING, still deciding new requests for %.1f s (a second signal cuts "
                 "it short)", self.args.drain_s)
        await signals.wait(2, timeout=self.args.drain_s)

    async def _stop_streams(self, grpc_server: grpc.aio.Server, signals: "_Signals") -> None:
        """Take no new streams; open ones (admitted requests still running) get --grace-s to end."""
        log.info("drained: taking no new streams; %d admitted requests still running get up to %.1f s",
                 len(self.servicer.live), self.args.grace_s)
        self.access_log.close()
        stopping = asyncio.ensure_future(grpc_server.stop(grace=self.args.grace_s))
        cut = asyncio.ensure_future(signals.wait(signals.count + 1))
        await asyncio.wait([stopping, cut], return_when=asyncio.FIRST_COMPLETED)
        if not stopping.done():
            log.warning("signal during the grace period: cutting the open streams now")
            await grpc_server.stop(grace=None)  # the most restrictive grace wins
            await stopping
        cut.cancel()

    async def _start_http(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        host, port = self.args.metrics
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as e:
            await runner.cleanup()
            raise SystemExit(f"extproc: cannot listen on {host_port(host, port)} for /metrics ({e.strerror})") from None
        return runner

    async def _metrics(self, request: web.Request) -> web.Response:
        families = self.telemetry.core_families()  # the core is read on the loop, a big text written off it
        started = time.perf_counter()
        if self._scrape_s < SCRAPE_ON_LOOP_S:
            body = self.telemetry.exposition(families)
        else:
            body = await asyncio.to_thread(self.telemetry.exposition, families)
        self._scrape_s = time.perf_counter() - started
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        snap = self.core.snapshot()
        body = {"status": self.status, "classes": snap, "pools": self.core.pools_snapshot(),
                "stream_errors": _count(self.telemetry.stream_errors)}
        return web.json_response(body, status=200 if self.status == SERVING else 503)


class _Signals:
    """SIGTERM/SIGINT counted: the first starts the drain, the next ones cut each remaining wait short."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = asyncio.Event()

    def received(self) -> None:
        self.count += 1
        self._changed.set()

    async def wait(self, count: int, timeout: float | None = None) -> bool:
        """Until `count` signals have arrived (True) or `timeout` seconds have passed (False)."""
        async def reached() -> None:
            while self.count < count:
                self._changed.clear()
                await self._changed.wait()
        try:
            await asyncio.wait_for(reached(), timeout)
            return True
        except TimeoutError:
            return False


async def _every(seconds: float | Callable[[], float], step: Callable[[], Awaitable[None]], what: str) -> None:
    """Run `step` every `seconds` (or every `seconds()`, read before each wait) until cancelled. A failed run is
    logged with its traceback and the next one goes ahead: a background loop that died would stop its work (lease
    renewal, reaping, reloads) without a word."""
    while True:
        wait = seconds() if callable(seconds) else seconds
        await asyncio.sleep(wait)
        try:
            await step()
        except Exception:
            log.exception("%s failed; it runs again in %g s", what, wait)


def _count(counter) -> int:
    """A label-less prometheus Counter's value (the one its servicer was handed to increment)."""
    return int(next(s.value for s in counter.collect()[0].samples if s.name.endswith("_total")))


# A policy file this big is parsed in a child process (read_policy). 2,000 tenants (220 kB) take 0.65 s of YAML
# and more on a busy host; parsed in a thread of ours, the parse holds the GIL all along, the event loop gets it
# back only every sys.getswitchinterval() (5 ms) each time it lets go (each syscall), and its steps stretched to
# 0.15-0.9 s: answers past Envoy's 0.5 s message_timeout, let through unadmitted. A child costs ~0.1 s of start,
# on another core; demo-full.yaml (2 kB, 5 ms of YAML) stays in the thread.
PARSE_APART_BYTES = 32 << 10


def read_policy(path: str, parsed: tuple[bytes, Policy] | None, apart: bool = True) -> tuple[bytes, Policy]:
    """A reload's read, in a thread: the digest of the file's bytes and the policy they hold, `parsed`'s own when
    they are its bytes (the file applied last, unchanged: a SIGHUP sent to be sure). `apart`: a big file is
    parsed in a child process (parse_apart); `serve`'s start, with no event loop to keep running, parses here."""
    raw = read_policy_bytes(path)
    digest = hashlib.sha256(raw).digest()
    if parsed is not None and parsed[0] == digest:
        return parsed
    if not apart or len(raw) < PARSE_APART_BYTES:
        return digest, load_policy_bytes(path, raw)
    return digest, parse_apart(path, raw)


def parse_apart(path: str, raw: bytes) -> Policy:
    """load_policy_bytes in a child process (schema.load_policy_pipe), off this one's GIL; in this thread if the
    child cannot give an answer (it could not start, it died): slower for the loop, but the reload happens."""
    argv = [sys.executable, "-c", "from extproc.policy.schema import load_policy_pipe; load_policy_pipe()", path]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # this process's extproc
    try:
        child = subprocess.run(argv, input=raw, capture_output=True, env=env, timeout=300, check=True)
        kind, value = pickle.loads(child.stdout)
    except Exception as e:  # its output is not logged: a traceback may quote the file, api keys and all
        detail = _status_text(e.returncode) if isinstance(e, subprocess.CalledProcessError) else type(e).__name__
        log.warning("policy reload: parsing %s in a child process failed (%s); parsing it here", path, detail)
        return load_policy_bytes(path, raw)
    if kind == "errors":
        raise PolicyError(value)
    return value


class FrozenHeap:
    """gc.freeze for what lives long. The modules and the policy in force outlive every request, and each gen-2
    collection walked them all on the event loop (2,000 tenants: ~120,000 objects, 10-80 ms of CPU; bench/
    gc_pauses.py); frozen, a collection walks only what came since. `settle` runs at start and after each applied
    reload: a collection of what is not frozen (the new policy, the requests of the moment: 2-8 ms at 2,000
    tenants, where the gen-2 a reload led to walked everything), then a freeze of what survived.

    What was frozen and then became garbage in a cycle (a request's, in flight at the freeze) is never collected
    while frozen. So once the objects frozen since the last full collection reach REGROWTH of what that one left,
    the frozen ones are counted (a walk of them all, a few ms); if they grew by that much, `settle` unfreezes
    first and collects everything (one pause of the whole heap, as each gen-2 was before). A replaced policy's
    objects are freed as it goes (by reference counts: it holds no cycles), frozen or not."""

    REGROWTH = 0.25

    def __init__(self) -> None:
        self._full_at: int | None = None  # how many were frozen after the last full collection
        self._added = 0  # how many more are frozen now, at most (those freed since the last count not deducted)

    def settle(self) -> None:
        full = self._full_at is None
        if not full and self._added > self._full_at * self.REGROWTH:
            self._added = gc.get_freeze_count() - self._full_at  # what was added less what was freed
            full = self._added > self._full_at * self.REGROWTH
        if full:
            gc.unfreeze()
        gc.collect()
        before = gc.get_freeze_count()
        gc.freeze()
        survivors = gc.get_freeze_count() - before  # counted by the freeze: no list of the whole heap built for it
        if full:
            self._full_at, self._added = survivors, 0
        else:
            self._added += survivors


def _log_warnings(policy: Policy) -> None:
    """What `extproc check` warns about (an SLO written in seconds, a shed map upside down), said by the server too:
    a live edit of a ConfigMap is seldom checked first, and it applies without a word otherwise."""
    for warning in policy_warnings(policy):
        log.warning("policy warning: %s", warning)


FileVersion = tuple[int, ...]


def file_version(path: str) -> FileVersion:
    """What the file watch compares: the file's identity, size and times, through symlinks (a ConfigMap's swap).
    Its modification time alone missed a file put in place keeping its source's time (`cp -p`, `rsync -t`,
    `docker cp`, a rename) and one rewritten within a tick of a filesystem with coarse timestamps when that time
    was the loaded one's: the old policy ran on without a word. The change time cannot be set back (utime sets
    it to now), and a size differs between a half-written file read and refused and the whole one."""
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _host_store(args: argparse.Namespace) -> host_store.HostStore | None:
    """This worker's view of the table its supervisor shares between the workers (None: not a worker)."""
    if not args.host_store:
        return None
    return host_store.HostStore(Path(args.host_store), args.worker_index, args.workers)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s",
                        stream=sys.stderr)
    loaded_version = file_version(args.policy)  # before the load: a file edited during it is reloaded once serving
    try:
        digest, policy = read_policy(args.policy, None, apart=False)
    except PolicyError as e:
        print(f"extproc: refusing to start, {args.policy} is invalid:", file=sys.stderr)
        for line in e.errors:
            print(f"  {line}", file=sys.stderr)
        return 1
    if args.workers > 1 and args.worker_index is None:
        return supervise(args, policy.store.kind == "memory")
    if args.worker_index is not None:
        _die_with_the_supervisor()
    server = Server(args.policy, policy, args, loaded_version, digest)
    try:
        if args.no_uvloop:
            asyncio.run(server.run())
        else:  # a few % less CPU per request than asyncio's loop (docs/benchmarks.md)
            import uvloop
            uvloop.run(server.run())
    except KeyboardInterrupt:
        pass
    return 0


def worker_argv(args: argparse.Namespace, i: int) -> list[str]:
    """`extproc serve` for worker i: the same options, its own ports (the given ones + i)."""
    (host, port), (mhost, mport) = args.grpc, args.metrics
    argv = [sys.executable, "-m", "extproc.cli", "serve", "--policy", args.policy, "--grpc", host_port(host, port + i),
            "--metrics", host_port(mhost, mport + i), "--max-body-bytes", str(args.max_body_bytes),
            "--max-pending-bodies", str(args.max_pending_bodies), "--watch-interval", str(args.watch_interval),
            "--drain-s", str(args.drain_s), "--grace-s", str(args.grace_s), "--log-level", args.log_level,
            "--log-accept-sample", str(args.log_accept_sample), "--log-decisions-per-s", str(args.log_decisions_per_s),
            "--workers", str(args.workers), "--worker-index", str(i)]
    if args.host_store:
        argv += ["--host-store", args.host_store]
    return argv + (["--no-uvloop"] if args.no_uvloop else [])


def supervise(args: argparse.Namespace, host_memory: bool) -> int:
    """Run the workers; pass SIGTERM, SIGINT and SIGHUP on to every one of them. When one exits on its own, stop
    the others and exit with its status, so the process supervisor (Kubernetes, systemd) restarts the lot.
    `host_memory` (policy store `memory`): the workers share the caps through a table in this host's memory,
    created here and removed on exit; with `redis` they share them through Redis."""
    with contextlib.ExitStack() as stack:
        if host_memory:
            table = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="extproc-workers-", dir=host_store.table_parent(args.workers))))
            host_store.create(table, args.workers)
            args.host_store = str(table)
        return _run_workers(args)


def _run_workers(args: argparse.Namespace) -> int:
    # A SIGHUP before a worker has installed its reload handler would kill it: workers start with SIGHUP ignored
    # (the ignore is inherited through exec) until their event loop takes the signal over.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    env = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
    workers = [subprocess.Popen(worker_argv(args, i), env=env) for i in range(args.workers)]
    stopping = False

    def forward(sig: int, _frame) -> None:
        nonlocal stopping
        stopping = stopping or sig != signal.SIGHUP
        for w in workers:
            if w.poll() is None:
                w.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    status = 0
    reported: set[int] = set()
    while True:
        for i, w in enumerate(workers):
            code = w.poll()
            if code is None or i in reported:
                continue
            reported.add(i)
            if args.host_store:  # a worker that died holding slots: the others drain before they stop
                try:
                    host_store.forget(Path(args.host_store), i, args.workers)
                except OSError as e:
                    log.warning("could not free worker %d's slots in the shared table: %s", i, e)
            if not stopping:
                log.error("worker %d (pid %d) exited with %s: stopping the others", i, w.pid, _status_text(code))
                status = _exit_status(code)
                forward(signal.SIGTERM, None)
        if len(reported) == len(workers):
            break
        time.sleep(0.2)
    return status or max((_exit_status(w.returncode) for w in workers), default=0)


SUPERVISOR_ENV = "EXTPROC_SUPERVISOR_PID"


def _exit_status(code: int) -> int:
    """A child's return code as a shell reports it: a worker killed by signal N is 128 + N (SIGKILL: 137)."""
    return 128 - code if code < 0 else code


def _status_text(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"status {code}"


def _die_with_the_supervisor() -> None:
    """A worker whose supervisor is gone (SIGKILL) must not go on serving unwatched: the kernel sends it SIGTERM
    (PR_SET_PDEATHSIG, Linux), which drains it like any stop."""
    with contextlib.suppress(Exception):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        supervisor = os.environ.get(SUPERVISOR_ENV)
        if supervisor and os.getppid() != int(supervisor):  # it died before the call: nobody would signal us
            os.kill(os.getpid(), signal.SIGTERM)
