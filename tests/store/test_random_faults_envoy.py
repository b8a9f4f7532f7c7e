"""A seeded random schedule of faults through real processes: two ext_proc instances behind one Envoy share their
caps through a real redis-server, closed-loop clients (some streaming, some leaving mid-answer) send through Envoy
to the recording upstream, and for ~30 s one fault at a time hits them: an instance SIGKILLed and started again,
Redis frozen (SIGSTOP/SIGCONT) or SIGKILLed and started again empty, a reload (SIGHUP) that lowers a cap and one
that raises it back.

Checked all along: the upstream never runs more admitted requests of a class than the bound of the moment (the cap
while Redis is healthy; cap + (cap - share) from a Redis fault until the instances are back on it and the requests
admitted on their shares have ended, docs/reliability.md "Redis fallback"; the old cap until a lowering reload is
applied and the requests admitted under it have ended); no client waits past its timeout; every refusal is an
OpenAI-style JSON error with a status a client can act on (429, 503, 504). At the end, once the leases have run
out: no slot held in Redis, nothing in flight or queued on either instance, no process dead but those killed, no
traceback or stream error. SEED picks the schedule (FAULT_SEED overrides it, to replay a run)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from extproc.policy.schema import StoreSpec
from extproc.store.redis_store import RedisStore
from extproc.tools.stack import Stack, free_port
from tests.conftest import policy_doc, run_upstream, until
from tests.integration.helpers import chat, metrics, sample

SEED = int(os.environ.get("FAULT_SEED", "46"))
FAULTS_S = 30.0       # faults are started for this long
CAPS = {"interactive": 4, "batch": 2}
INSTANCES = 2
LEASE_MS = 4000  # longer than any request: a killed instance's requests end before their leases do
CLIENTS = 10
CLIENT_TIMEOUT_S = 12.0
LONGEST_REQUEST_S = 2.5  # the longest a request runs at the upstream (delay, or tokens x token time)
# After Redis is back: each instance's probe (every second, late on a loaded machine) and its adoption, then what
# the instances admitted on their shares meanwhile ends.
SETTLE_S = 3.0 + LONGEST_REQUEST_S


class Bounds:
    """What the upstream may run of each class at each moment, from what the fault schedule did."""

    def __init__(self) -> None:
        self.caps: list[tuple[float, dict[str, int]]] = [(0.0, dict(CAPS))]  # (from, caps), in time order
        self.relaxed: list[tuple[float, float, dict[str, int]]] = []  # (from, until, bound) over the caps

    def cap_at(self, t: float) -> dict[str, int]:
        return next(caps for start, caps in reversed(self.caps) if start <= t)

    def reload(self, signalled: float, before: dict[str, int], after: dict[str, int]) -> int:
        """From the signal the new caps, and the higher of old and new until reloaded() says when the reload was
        applied on every instance (plus the time for what the old caps admitted to end)."""
        self.caps.append((signalled, after))
        self.relaxed.append((signalled, float("inf"), {c: max(before[c], after[c]) for c in CAPS}))
        return len(self.relaxed) - 1

    def reloaded(self, index: int, applied: float) -> None:
        start, _, bound = self.relaxed[index]
        self.relaxed[index] = (start, applied + LONGEST_REQUEST_S + 0.3, bound)

    def store_down(self, start: float) -> int:
        """From a Redis fault until store_back() says when Redis came back (plus the settling)."""
        caps = self.cap_at(start)
        self.relaxed.append((start, float("inf"),
                             {c: cap + (cap - max(1, cap // INSTANCES)) for c, cap in caps.items()}))
        return len(self.relaxed) - 1

    def store_back(self, index: int, back: float) -> None:
        start, _, bound = self.relaxed[index]
        self.relaxed[index] = (start, back + SETTLE_S, bound)

    def at(self, t0: float, t1: float) -> dict[str, int]:
        """The highest bound of any moment in [t0, t1]."""
        inside = [self.cap_at(t0)] + [caps for start, caps in self.caps if t0 < start <= t1]
        out = {c: max(caps[c] for caps in inside) for c in CAPS}
        for start, end, bound in self.relaxed:
            if start <= t1 and end >= t0:
                out = {c: max(out[c], bound[c]) for c in CAPS}
        return out


class Run:
    def __init__(self, tmp_path: Path, upstream, redis_server) -> None:
        self.tmp_path = tmp_path
        self.upstream = upstream
        self.redis = redis_server
        self.prefix = f"rf{free_port()}:"
        self.store = {"kind": "redis", "url": redis_server.url, "key_prefix": self.prefix, "lease_ms": LEASE_MS,
                      "instances": INSTANCES, "on_failure": "local", "timeout_ms": 200}
        self.policy = tmp_path / "policy.yaml"
        self.write_policy(CAPS)
        self.stack = Stack(tmp_path / "stack", {"vllm_llama70b": [upstream], "vllm_llama8b": [upstream]},
                           policy_path=self.policy, extprocs=INSTANCES, extproc_args=["--watch-interval", "0"])
        self.t0 = time.monotonic()
        self.bounds = Bounds()
        self.violations: list[str] = []
        self.log: list[str] = []  # what the schedule did, for the failure message
        self.killed: set[int] = set()  # pids this test killed
        self.results: dict[str, int] = {}
        self.peaks: dict[tuple[str, int], int] = {}  # (class, bound) -> the most seen in service under it

    def now(self) -> float:
        return time.monotonic() - self.t0

    def note(self, what: str) -> None:
        self.log.append(f"{self.now():6.2f} {what}")

    def write_policy(self, caps: dict[str, int]) -> None:
        classes = {"interactive": {"max_concurrency": caps["interactive"], "max_queue": 50, "max_wait_ms": 3000},
                   "batch": {"max_concurrency": caps["batch"], "max_queue": 20, "max_wait_ms": 3000},
                   "internal": {"max_concurrency": 1, "max_queue": 1, "max_wait_ms": 500}}
        self.policy.write_text(yaml.safe_dump(policy_doc(classes=classes, store=self.store), sort_keys=False))

    def instance(self, i: int):
        name = Stack.extproc_name(i)
        return [p for p in self.stack.processes if p.name == name][-1]

    def metrics_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.stack.metrics_ports[i]}"

    # --- the clients ---

    async def client(self, http: aiohttp.ClientSession, n: int, stop: asyncio.Event) -> None:
        rng = random.Random(SEED * 1000 + n)
        while not stop.is_set():
            cls = "interactive" if rng.random() < 0.7 else "batch"
            stream = rng.random() < 0.4
            headers = {"content-type": "application/json", "x-priority": cls}
            if stream:
                headers.update({"x-test-tokens": str(rng.randint(3, 8)), "x-test-token-ms": str(rng.randint(20, 90))})
            else:
                long = rng.random() < 0.15  # some outlast a Redis restart and the instances' next housekeeping
                headers["x-test-delay-ms"] = str(rng.randint(1000, 2500) if long else rng.randint(20, 800))
            abort = rng.random()
            started = time.monotonic()
            try:
                async with asyncio.timeout(CLIENT_TIMEOUT_S):
                    if abort < 0.08:  # leaves before (or while) it is admitted or answered
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(rng.uniform(0.0, 0.3)):
                                await self.request(http, headers, chat(stream=stream), leave_after_chunks=None)
                        self.count("left")
                    else:
                        await self.request(http, headers, chat(stream=stream),
                                           leave_after_chunks=1 if stream and abort < 0.2 else None)
            except TimeoutError:
                self.violations.append(f"{self.now():.2f} a client waited {time.monotonic() - started:.1f} s "
                                       f"(timeout {CLIENT_TIMEOUT_S} s)")
            except aiohttp.ClientError as e:  # a connection Envoy reset: counted, not a violation by itself
                self.count(f"error {type(e).__name__}")

    async def request(self, http, headers: dict, body: dict, leave_after_chunks: int | None) -> None:
        async with http.post(f"{self.stack.url}/v1/chat/completions", data=json.dumps(body).encode(),
                             headers=headers) as r:
            if r.status != 200:
                self.check_refusal(r.status, await r.read())
                return
            if leave_after_chunks is not None:
                await r.content.readany()
                self.count("left mid-stream")
                return  # leaving the block closes the connection mid-answer
            await r.read()
            self.count("200" if "x-extproc-decision" in r.headers else "200 unadmitted")

    def check_refusal(self, status: int, raw: bytes) -> None:
        try:
            err = json.loads(raw)["error"]
            ok = isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str) and "code" in err
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok or status not in (429, 503, 504):
            self.violations.append(f"{self.now():.2f} refusal {status} {raw[:300]!r}")
        code = json.loads(raw)["error"].get("code") if ok else "?"
        self.count(f"{status} {code}")

    def count(self, what: str) -> None:
        self.results[what] = self.results.get(what, 0) + 1

    # --- the watcher ---

    async def watch(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        """Reads the upstream's peaks per class every 50 ms and holds each against the bound of its window."""
        last = self.now()
        while not stop.is_set():
            await asyncio.sleep(0.05)
            async with http.get(f"http://{self.upstream[0]}:{self.upstream[1]}/test/classes") as r:
                got = await r.json()
                peaks = got["peak"]
            t = self.now()
            bound = self.bounds.at(last, t)
            for cls, peak in peaks.items():
                key = (cls, bound.get(cls))
                self.peaks[key] = max(self.peaks.get(key, 0), peak)
                if peak > bound.get(cls, 0):
                    self.violations.append(f"{last:.2f}-{t:.2f} {peak} {cls} in service at the upstream, bound "
                                           f"{bound.get(cls)} {got['detail'].get(cls)}")
            last = t

    # --- the faults ---

    async def faults(self) -> None:
        rng = random.Random(SEED)
        kinds = ["kill_instance", "freeze_redis", "kill_redis", "reload"]
        await asyncio.sleep(1.0)
        while self.now() < FAULTS_S:
            kind = rng.choice(kinds)
            await getattr(self, kind)(rng)
            await asyncio.sleep(rng.uniform(0.3, 1.5))

    async def kill_instance(self, rng: random.Random) -> None:
        i = rng.randrange(INSTANCES)
        proc = self.instance(i)
        self.killed.add(proc.popen.pid)
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait()
        self.note(f"SIGKILL ext_proc {i}")
        await asyncio.sleep(rng.uniform(0.2, 1.5))
        await asyncio.to_thread(self.stack.start_extproc, i)
        self.note(f"ext_proc {i} started again")

    async def freeze_redis(self, rng: random.Random) -> None:
        pid = self.redis.proc.pid
        down = self.bounds.store_down(self.now())
        os.kill(pid, signal.SIGSTOP)
        self.note("SIGSTOP redis")
        await asyncio.sleep(rng.uniform(0.3, 3.0))
        os.kill(pid, signal.SIGCONT)
        self.note("SIGCONT redis")
        self.bounds.store_back(down, self.now())

    async def kill_redis(self, rng: random.Random) -> None:
        down = self.bounds.store_down(self.now())
        self.redis.proc.kill()
        self.redis.proc.wait()
        self.killed.add(self.redis.proc.pid)
        self.note("SIGKILL redis")
        await asyncio.sleep(rng.choice([0.0, rng.uniform(0.1, 2.5)]))  # half of them back at once
        await asyncio.to_thread(self.redis.start)
        self.note("redis started again (empty)")
        self.bounds.store_back(down, self.now())

    async def reload(self, rng: random.Random) -> None:
        """Lower one class's cap to half, then raise it back."""
        cls = rng.choice(list(CAPS))
        start = self.bounds.cap_at(self.now())
        for before, after in ((start, {**start, cls: max(1, start[cls] // 2)}), (None, start)):
            before = before or self.bounds.cap_at(self.now())
            self.write_policy(after)
            pending = self.bounds.reload(self.now(), before, after)
            for i in range(INSTANCES):
                self.instance(i).popen.send_signal(signal.SIGHUP)
            self.note(f"SIGHUP: {cls} cap {after[cls]}")
            async with aiohttp.ClientSession() as http:
                for i in range(INSTANCES):
                    applied = await until(lambda: self.limit(http, i, cls), timeout=5,
                                          holds=lambda v: v == after[cls])
                    if applied != after[cls]:
                        self.violations.append(f"{self.now():.2f} ext_proc {i} did not apply the reload "
                                               f"({cls} limit {applied}, wanted {after[cls]})")
            self.bounds.reloaded(pending, self.now())
            self.note(f"reload applied on both: {cls} cap {after[cls]}")
            await asyncio.sleep(rng.uniform(0.5, 2.0))

    async def limit(self, http, i: int, cls: str) -> float:
        return sample(await metrics(http, self.metrics_url(i)), "extproc_class_limit", **{"class": cls})


@pytest.fixture
def upstream():
    """The recording upstream, ending a request whose client left at once (as vLLM aborts it): else a request
    Envoy reset ran out its delay there, and counted against a slot the ext_proc had rightly given back."""
    with run_upstream("--cancel-on-disconnect") as address:
        yield address


@pytest.fixture
def run(tmp_path, upstream, redis_server):
    r = Run(tmp_path, upstream, redis_server)
    try:
        r.stack.start()
        yield r
    finally:
        r.stack.stop()
        with contextlib.suppress(ProcessLookupError, AttributeError):  # a frozen Redis cannot stop
            os.kill(redis_server.proc.pid, signal.SIGCONT)


async def shared_counts(run: Run) -> dict[str, int]:
    store = RedisStore(StoreSpec(kind="redis", url=run.redis.url, key_prefix=run.prefix))
    try:
        return {c: await store.count(c) for c in CAPS}
    finally:
        await store.close()


async def idle(http, run: Run) -> list:
    out = []
    for i in range(INSTANCES):
        async with http.get(f"{run.metrics_url(i)}/healthz") as r:
            classes = (await r.json())["classes"]
        out.append({c: (v["inflight"], v["queue"]) for c, v in classes.items() if v["inflight"] or v["queue"]})
    return out


async def test_random_faults_keep_the_caps_and_leak_nothing(run, upstream):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        stop_clients, stop_watch = asyncio.Event(), asyncio.Event()
        watcher = asyncio.create_task(run.watch(http, stop_watch))
        clients = [asyncio.create_task(run.client(http, n, stop_clients)) for n in range(CLIENTS)]
        try:
            await run.faults()
            await asyncio.sleep(2.0)  # load on a healthy fleet after the last fault
        finally:
            stop_clients.set()
            await asyncio.gather(*clients)
            stop_watch.set()
            await watcher
        await asyncio.sleep(LEASE_MS / 1000 + 0.5)  # every lease a dead process left has run out
        counts = await until(lambda: shared_counts(run), timeout=5, holds=lambda c: not any(c.values()))
        left = await until(lambda: idle(http, run), timeout=5, holds=lambda v: not any(v))
        scraped = [await metrics(http, run.metrics_url(i)) for i in range(INSTANCES)]
        async with http.get(f"http://{upstream[0]}:{upstream[1]}/test/classes") as r:
            at_upstream = (await r.json())["in_service"]
    report = "\n".join(run.log) + f"\nresults: {run.results}\npeaks (class, bound): {run.peaks}"
    print(f"\nRELIABILITY random faults (seed {SEED}): {report}")
    assert not run.violations, "\n".join(run.violations[:20]) + "\n" + report
    assert counts == {c: 0 for c in CAPS}, (counts, report)  # no leaked lease in Redis
    assert left == [{}] * INSTANCES, (left, report)         # nor in flight or queued on an instance
    assert not any(at_upstream.values()), at_upstream
    assert [sample(ms, "extproc_stream_errors_total") for ms in scraped] == [0] * INSTANCES
    assert [sample(ms, "extproc_store_state", state="shared") for ms in scraped] == [1] * INSTANCES
    dead = [p.name for p in run.stack.processes if not p.alive() and p.popen.pid not in run.killed]
    assert not dead, (dead, report)
    assert run.redis.proc.poll() is None
    for p in run.stack.processes:
        assert "Traceback" not in p.tail(10_000), (p.name, p.tail(60))
    assert run.results.get("200", 0) > 100, run.results
