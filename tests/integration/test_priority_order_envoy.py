"""Issue 19: batch is queued or refused before any interactive request is degraded, through real Envoy.

Envoy + the ext_proc + simulated vLLM replicas on loopback. The 70B pool has a fixed pool-wide limit of 4 requests
(`pools.vllm_llama70b.limit`, min == max == initial), shared by interactive (first) and batch in strict priority.
The 70B replica holds every request for a long while (the simulator's `extra_latency_s` fault), so the pool stays
full until the test frees room, which it does by having a client leave (its connection closes; the ext_proc gives
the slot back at once): when room frees is the test's choice, not a timer's.

The order asserted, from the HTTP responses and the ext_proc's /metrics:
 1. while interactive waits for the pool, new batch requests are queued or refused, never admitted (batch holds
    more than its guarantee of one request);
 2. room freed on the pool goes to the waiting interactive request, ahead of a batch request that queued before it;
 3. interactive is degraded (to the 8B model, on its queue overflow) only after batch has been queued and refused,
    and no batch request was admitted from the moment interactive started waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp

from extproc.tools.sim.fleet import SimFleet
from tests.conftest import policy_file, until

from .conftest import FLEET_SPEED
from .helpers import chat, metrics, post, sample

SPEED = FLEET_SPEED  # simulated seconds per wall second of the `fleets` replicas
HOLD_S = 25.0     # wall seconds the 70B replica holds each request while the fault is on (longer than the test)
POOL = "vllm_llama70b"
LIMIT = 4
BATCH = {"x-priority": "batch"}
INTERACTIVE = {"x-priority": "interactive"}
WAIT_S = 10.0     # how long any state is polled for (a noisy 2-core machine); all of them together stay < 30 s


def write_policy(tmp_path, big_port: int, unit: str = "requests", limit: float = LIMIT):
    classes = {
        # Class caps far above the pool's limit: the pool-wide limit is what binds.
        "interactive": {"max_concurrency": 16, "max_queue": 1, "max_wait_ms": 20_000, "slo_p95_ms": 5_000,
                        "on_overflow": "fallback", "fallback": {"action": "degrade", "model": "llama-8b"}},
        "batch": {"max_concurrency": 16, "max_queue": 2, "max_wait_ms": 20_000},
    }
    pools = {POOL: {"replicas": [f"127.0.0.1:{big_port}"],
                    "limit": {"enabled": True, "unit": unit, "initial": limit, "min": limit, "max": limit}}}
    return policy_file(tmp_path, classes=classes, tenants=[], shed={}, pools=pools)


class Client:
    """One request through Envoy on its own connection, which the test can close (the client leaves)."""

    def __init__(self, url: str, headers: dict, words: int = 1):
        body = chat(max_tokens=4, ignore_eos=True)
        body["messages"][0]["content"] = " ".join(["hello"] * words)  # ~1.5 prompt tokens a word
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        self.task = asyncio.create_task(post(self.http, url, body, headers))

    async def result(self, timeout: float = WAIT_S):
        """The response (status, headers, body); fails the test if none came within `timeout`."""
        done, _ = await asyncio.wait({self.task}, timeout=timeout)
        assert done, f"no response within {timeout} s"
        await self.http.close()
        return self.task.result()

    async def leave(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task
        await self.http.close()


class Pool:
    """The ext_proc's view of the pool and the decisions so far, read from /metrics."""

    def __init__(self, http: aiohttp.ClientSession, metrics_url: str):
        self.http, self.metrics_url = http, metrics_url
        self.ms: dict = {}

    async def read(self) -> "Pool":
        self.ms = await metrics(self.http, self.metrics_url)
        return self

    def inflight(self, cls: str) -> float:
        return sample(self.ms, "extproc_pool_inflight", pool=POOL, **{"class": cls})

    def waiting(self, cls: str) -> float:
        return sample(self.ms, "extproc_pool_waiting_requests", pool=POOL, **{"class": cls})

    def decisions(self, cls: str, decision: str, reason: str | None = None) -> float:
        labels = {"class": cls, "decision": decision, **({"reason": reason} if reason else {})}
        return sample(self.ms, "extproc_requests_total", **labels)

    def queued(self, cls: str) -> float:
        return sample(self.ms, "extproc_queue_entries_total", **{"class": cls})

    def state(self) -> dict:
        return {"inflight": {c: self.inflight(c) for c in ("interactive", "batch")},
                "waiting": {c: self.waiting(c) for c in ("interactive", "batch")},
                "limit": sample(self.ms, "extproc_pool_limit", pool=POOL)}

    async def until(self, holds) -> "Pool":
        """Poll /metrics until `holds(self)`; fail with the last state read."""
        async def read():
            return await self.read()

        await until(read, WAIT_S, interval=0.05, holds=holds)
        assert holds(self), self.state()
        return self


def served(response) -> tuple[int, str | None, str | None]:
    """(status, the model that answered, x-extproc-degraded) of a response through Envoy."""
    status, headers, body = response
    model = json.loads(body).get("model") if status == 200 else None
    return status, model, headers.get("x-extproc-degraded")


def error_code(response) -> str:
    return json.loads(response[2])["error"]["code"]


async def fault(http, fleet: SimFleet, **body) -> None:
    async with http.post(f"{fleet.urls[0]}/sim/fault", json=body) as r:
        assert r.status == 200


def start(make_stack, tmp_path, fleets, **limit):
    big, small = fleets
    return make_stack(write_policy(tmp_path, big.ports[0], **limit),
                      pools={POOL: [("127.0.0.1", big.ports[0])], "vllm_llama8b": [("127.0.0.1", small.ports[0])]})


async def test_batch_is_queued_or_refused_before_interactive_is_degraded(make_stack, tmp_path, fleets):
    big, small = fleets
    s = start(make_stack, tmp_path, fleets)
    clients: list[Client] = []

    def send(headers: dict) -> Client:
        c = Client(s.url, headers)
        clients.append(c)
        return c

    async with aiohttp.ClientSession() as http:
        pool = Pool(http, s.metrics_url)
        try:
            await fault(http, big, extra_latency_s=HOLD_S * SPEED)  # the 70B pool holds what it admits
            assert (await pool.read()).state()["limit"] == LIMIT

            # Batch fills the pool as far as a lower class may (not the last request's room: interactive's).
            b1, b2, b3 = send(BATCH), send(BATCH), send(BATCH)
            await pool.until(lambda p: p.inflight("batch") == 3)
            b4 = send(BATCH)
            await pool.until(lambda p: p.waiting("batch") == 1)
            assert pool.inflight("batch") == 3 and pool.decisions("batch", "accept") == 3

            # Interactive takes the room batch left; the next interactive request waits for the pool (it is full),
            # queued after b4.
            i1 = send(INTERACTIVE)
            await pool.until(lambda p: p.inflight("interactive") == 1)
            i2 = send(INTERACTIVE)
            await pool.until(lambda p: p.waiting("interactive") == 1)
            assert pool.inflight("batch") + pool.inflight("interactive") == LIMIT
            batch_admitted = pool.decisions("batch", "accept")
            assert batch_admitted == 3

            # (1) While interactive waits: a new batch request is queued (not admitted), the next one refused.
            b5 = send(BATCH)
            await pool.until(lambda p: p.waiting("batch") == 2)
            b6 = send(BATCH)
            status, _, body = await b6.result()
            assert status == 429 and error_code((status, None, body)) == "queue_full", body
            await pool.read()
            assert pool.decisions("batch", "reject", "queue_full") == 1
            assert pool.decisions("batch", "accept") == batch_admitted and pool.inflight("batch") == 3
            assert pool.queued("batch") == 2
            assert not b4.task.done() and not b5.task.done()  # still queued: neither admitted nor refused

            # (3) Only now, with batch queued and refused, does interactive overflow its queue and degrade.
            assert pool.decisions("interactive", "degrade") == 0
            i3 = send(INTERACTIVE)
            status, model, degraded = served(await i3.result())
            assert (status, model) == (200, "llama-8b") and degraded and degraded.endswith("reason=queue_full"), \
                (status, model, degraded)
            await pool.read()
            assert pool.decisions("interactive", "degrade", "queue_full") == 1
            # No batch request was admitted between interactive's first wait and its degrade.
            assert pool.decisions("batch", "accept") == batch_admitted
            assert pool.inflight("batch") == 3 and pool.waiting("batch") == 2 and pool.waiting("interactive") == 1

            # (2) Room frees (a batch client leaves): it goes to the waiting interactive request, although b4 and
            # b5 queued first. With the fault off, what is admitted from now on answers at once.
            await fault(http, big, reset=True)
            await b1.leave()
            status, model, degraded = served(await i2.result())
            assert (status, model, degraded) == (200, "llama-70b", None)
            await pool.read()
            assert pool.decisions("interactive", "accept", "dequeued") == 1
            assert pool.decisions("batch", "accept", "dequeued") == 0
            assert pool.waiting("batch") == 2 and not b4.task.done() and not b5.task.done()

            # Batch is not starved: once no interactive request waits and the pool has room, its queue is served
            # in order, on the 70B pool.
            for c in (b2, b3, i1):
                await c.leave()
            for c in (b4, b5):
                status, model, degraded = served(await c.result())
                assert (status, model, degraded) == (200, "llama-70b", None)
            await pool.until(lambda p: p.decisions("batch", "accept", "dequeued") == 2)
            assert pool.decisions("interactive", "degrade") == 1 and pool.decisions("batch", "reject") == 1
        finally:
            for c in clients:
                await c.leave()
            with contextlib.suppress(Exception):
                await fault(http, big, reset=True)


async def test_a_batch_request_that_would_fit_still_yields_to_a_waiting_interactive_one(make_stack, tmp_path,
                                                                                         fleets):
    """Strict priority, not only fill levels: in KV tokens, a large interactive request waits for room while a
    small batch request would fit under batch's share of the limit; the batch request waits behind it all the same,
    the room freed goes to interactive, and interactive degrades only after that batch request was queued."""
    big, small = fleets
    limit = 1000  # tokens: prompt + expected output of the requests held
    s = start(make_stack, tmp_path, fleets, unit="tokens", limit=limit)
    clients: list[Client] = []

    def send(headers: dict, words: int) -> Client:
        c = Client(s.url, headers, words)
        clients.append(c)
        return c

    async with aiohttp.ClientSession() as http:
        pool = Pool(http, s.metrics_url)
        try:
            await fault(http, big, extra_latency_s=HOLD_S * SPEED)
            # Three medium batch requests (~160 tokens each) hold about half the pool, and one small interactive
            # request is in flight (each class's first request is its guarantee, admitted whatever its size).
            b1 = send(BATCH, 100)
            send(BATCH, 100), send(BATCH, 100)  # held to the end (left in `finally`)
            await pool.until(lambda p: p.decisions("batch", "accept") == 3)
            i0 = send(INTERACTIVE, 1)
            await pool.until(lambda p: p.decisions("interactive", "accept") == 1)
            held = pool.inflight("batch") + pool.inflight("interactive")
            assert 300 < held < 600, pool.state()
            # A large interactive request (~610 tokens) does not fit next to them: it waits for the pool.
            i1 = send(INTERACTIVE, 400)
            await pool.until(lambda p: p.waiting("interactive") == 1)
            # (1) A small batch request (~10 tokens) would fit under batch's share (85% of the limit), but a higher
            # class waits for this pool: it is queued, not admitted.
            tiny = send(BATCH, 1)
            await pool.until(lambda p: p.waiting("batch") == 1)
            assert held + 20 < 0.85 * limit  # room there was: what queued it is the interactive request waiting
            assert pool.decisions("batch", "accept") == 3
            assert pool.inflight("batch") + pool.inflight("interactive") == held

            # (3) Interactive overflows its queue only now, after batch was queued, and degrades to the small model.
            i2 = send(INTERACTIVE, 400)
            status, model, degraded = served(await i2.result())
            assert (status, model) == (200, "llama-8b") and degraded and degraded.endswith("reason=queue_full"), \
                (status, model, degraded)
            await pool.read()
            assert pool.decisions("interactive", "degrade", "queue_full") == 1
            assert pool.decisions("batch", "accept") == 3 and pool.waiting("batch") == 1

            # (2) A batch client leaves: the room goes to the large interactive request, not to the small batch
            # request that queued after it yet would have fitted.
            await b1.leave()
            await pool.until(lambda p: p.decisions("interactive", "accept", "dequeued") == 1)
            assert pool.waiting("interactive") == 0 and pool.inflight("interactive") > 600, pool.state()
            assert pool.decisions("batch", "accept", "dequeued") == 0 and pool.waiting("batch") == 1, pool.state()
            assert not tiny.task.done()

            # The small batch request is served (by the 70B pool) once the interactive requests are gone.
            await fault(http, big, reset=True)
            await i1.leave()
            await i0.leave()
            status, model, degraded = served(await tiny.result())
            assert (status, model, degraded) == (200, "llama-70b", None)
            await pool.until(lambda p: p.decisions("batch", "accept", "dequeued") == 1)
            assert pool.decisions("batch", "reject") == 0 and pool.decisions("interactive", "degrade") == 1
        finally:
            for c in clients:
                await c.leave()
            with contextlib.suppress(Exception):
                await fault(http, big, reset=True)
