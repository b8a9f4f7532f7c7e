"""Replicas that answer oddly but plausibly, through real Envoy (envoy/envoy.yaml) and the ext_proc: what the
client gets, that nothing stays held, how the request is counted, what the error breaker sees, and what a
tokens-per-minute tenant is left charged. The replica is tests/odd_replica.py, its answer picked per request.

Covered elsewhere, and here only as part of the table: a replica's 500 releasing its slot and counted
`upstream_error` (test_admission_envoy.py::test_upstream_5xx_releases_the_slot_and_is_counted), a replica failing
every generation ejected by outlier detection (test_failing_replica.py), a replica killed mid-stream, its stream
cut without `[DONE]` (tests/reliability/test_faults_envoy.py), the refund of a replica's 400 and the expected output
charged for an answer that broke off (tests/unit/test_cost.py, in the core only), answers over the body limit or
without a Content-Length settled from their usage (test_cost_envoy.py)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.conftest import policy_file, until
from tests.odd_replica import OddReplica

from .helpers import chat, metrics, sample, wait_idle

BUCKET = 10_000  # each case's tenant: tokens_per_minute x burst_s, refilling 10 tokens a second
MAX_TOKENS = 3_000  # charged up front (with the prompt); the worst case a case may leave charged


def tenants(names) -> list[dict]:
    return [{"name": n, "api_keys": [f"sk-{n}"], "max_class": "interactive", "default_class": "interactive",
             "tokens_per_minute": 600, "burst_s": BUCKET / 10} for n in names]


async def start(make_stack, tmp_path, replica: OddReplica, names, min_samples: int = 1000, **top):
    """A stack whose pools are the odd replica; interactive's breakers watch without tripping, unless its latency
    breaker's `min_samples` is lowered."""
    classes = {"interactive": {"max_concurrency": 16, "max_queue": 0, "max_wait_ms": 0, "slo_p95_ms": 300,
                               "latency_breaker": {"min_samples": min_samples},
                               "error_breaker": {"min_requests": 1000}},
               "batch": {"max_concurrency": 16}}
    # A pool-wide limit that never binds nor moves: what matters is that every unit taken comes back.
    still = {"enabled": True, "unit": "tokens", "initial": 1e6, "min": 1e6, "max": 1e6}
    policy = policy_file(tmp_path, **{"classes": classes, "tenants": tenants(names), "shed": {},
                                      "pools": {"vllm_llama70b": {"limit": still}}, **top})
    pools = {pool: [("127.0.0.1", replica.port)] for pool in ("vllm_llama70b", "vllm_llama8b")}
    # Off the event loop: the replica runs on it and must answer Envoy's first health checks.
    return await asyncio.to_thread(make_stack, policy, pools=pools)


async def send(http, url: str, odd: str, tenant: str | None, stream: bool = False):
    """One request answered `odd` (of `tenant`, None: anonymous): status, headers, body (what arrived before any
    error) and the error, if any."""
    headers = {"x-odd": odd} | ({"authorization": f"Bearer sk-{tenant}"} if tenant else {})
    async with http.post(f"{url}/v1/chat/completions", json=chat(max_tokens=MAX_TOKENS, stream=stream),
                         headers=headers) as r:
        body = bytearray()
        try:
            async for piece in r.content.iter_any():
                body += piece
            failure = None
        except aiohttp.ClientPayloadError as e:
            failure = e
        return r.status, r.headers, bytes(body), failure


async def left_charged(http, url: str, tenant: str) -> int:
    """Tokens the tenant's bucket is short of full, read from a one-token probe's headers (the probe goes to batch,
    so interactive's metrics and breakers hold only the cases)."""
    async with http.post(f"{url}/v1/chat/completions", json=chat(max_tokens=1),
                         headers={"authorization": f"Bearer sk-{tenant}", "x-priority": "batch"}) as r:
        await r.read()
        return BUCKET - int(r.headers["x-ratelimit-remaining-tokens"])


async def outcomes(http, metrics_url: str) -> dict[str, float]:
    ms = await metrics(http, metrics_url)
    return {o: sample(ms, "extproc_request_duration_seconds_count", outcome=o, **{"class": "interactive"})
            for o in ("ok", "upstream_error", "client_abort", "ext_proc_error", "ended")}


async def counted_as(http, s, before: dict[str, float]) -> str:
    """The outcome label the last case was counted under (Envoy's access log reaches the ext_proc in batches)."""
    for _ in range(100):
        now = await outcomes(http, s.metrics_url)
        moved = [o for o in now if now[o] != before[o]]
        if moved:
            return moved[0] if len(moved) == 1 else ",".join(moved)
        await asyncio.sleep(0.02)
    return "none"


def assert_nothing_held_nor_failed(s, ms: dict) -> None:
    """No slot, no pool-limit unit held after the last answer, and nothing of ours failed on the way."""
    assert sample(ms, "extproc_inflight") == 0 and sample(ms, "extproc_pool_inflight") == 0
    assert sample(ms, "extproc_stream_errors_total") == 0
    log = s.process("extproc").log_path.read_text(errors="replace")
    assert " ERROR " not in log and "Traceback" not in log, s.process("extproc").tail()


def what_came(body: bytes) -> str:
    """A JSON body as the client reads it: an answer, an OpenAI error with a message, or JSON cut short."""
    try:
        doc = json.loads(body)
    except ValueError:
        return "cut"
    if "error" in doc:
        return "error" if doc["error"].get("message") else "error without a message"
    return "answer" if doc.get("choices") else "?"


SETTLED, EXPECTED, WORST_CASE = "settled", "expected output", "worst case"


def settled(charged: int) -> str:
    """What a case left its tenant charged: about its usage (12 tokens) or nothing (the probe's own few tokens
    aside), the whole up-front charge, or in between (what the model expects such a request to generate)."""
    if charged <= 40:
        return SETTLED
    return WORST_CASE if charged >= MAX_TOKENS - 100 else EXPECTED


# The non-streamed cases by what must come of them: (what the client's body is, outcome, settlement) for each.
WHOLE = ("ok", "close")  # answered in full: ("answer", "ok", SETTLED)
# The replica's failures, counted by the error breaker: ("error", "upstream_error", SETTLED). Envoy holds a
# buffered answer for the ext_proc to read: a short body becomes Envoy's own 502, and the client, who got nothing,
# pays nothing.
FAILED = ("status:500", "status:502", "status:503", "status:503:7", "shortbody")
# The replica's refusals, no evidence about the pool for either breaker: ("error", "ok", SETTLED).
REFUSED = ("status:429:3", "status:400")
# Answers whose usage cannot be read keep the charge (a client must not make its answer unreadable to pay less):
# (what the body is, "ok", WORST_CASE).
UNREADABLE = {"nousage": "answer", "truncjson": "cut", "error200": "error"}


def client_status(odd: str) -> int:
    """The status the client must get: the replica's own, Envoy's 502 for a body short of its length, else 200."""
    return int(odd.split(":")[1]) if odd.startswith("status:") else 502 if odd == "shortbody" else 200


def expected(odd: str) -> tuple:
    """(status, body, outcome, settlement) the case `odd` must come to."""
    if odd in UNREADABLE:
        return client_status(odd), UNREADABLE[odd], "ok", WORST_CASE
    body, outcome = ("answer", "ok") if odd in WHOLE else ("error", "upstream_error" if odd in FAILED else "ok")
    return client_status(odd), body, outcome, SETTLED


async def test_odd_non_streamed_answers_pass_through_free_their_slot_and_settle(make_stack, tmp_path):
    cases = [*WHOLE, *FAILED, *REFUSED, *UNREADABLE]
    names = [f"t{i}" for i in range(len(cases))]
    async with OddReplica() as replica, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        s = await start(make_stack, tmp_path, replica, names)
        seen = {}
        for odd, tenant in zip(cases, names):
            before = await outcomes(http, s.metrics_url)
            status, headers, body, failure = await send(http, s.url, odd, tenant)
            assert failure is None, (odd, failure)
            assert headers["x-extproc-decision"] == "accept", odd
            if odd.count(":") == 2:  # the replica's Retry-After reaches the client
                assert headers["retry-after"] == odd.rsplit(":", 1)[1], odd
            await wait_idle(http, s.metrics_url)
            seen[odd] = (status, what_came(body), await counted_as(http, s, before),
                         settled(await left_charged(http, s.url, tenant)))
        assert seen == {odd: expected(odd) for odd in cases}
        # Nothing held, nothing of ours failed, and the error breaker judged all but the refusals.
        await wait_idle(http, s.metrics_url)
        ms = await metrics(http, s.metrics_url)
        assert sample(ms, "extproc_breaker_window_error_ratio", **{"class": "interactive"}) == \
            pytest.approx(len(FAILED) / (len(cases) - len(REFUSED)))
        assert_nothing_held_nor_failed(s, ms)
        assert len(replica.answered) == 2 * len(cases)  # each case and its probe, once


async def test_odd_streams_reach_the_client_as_sent_free_their_slot_and_settle(make_stack, tmp_path):
    """Every stream read (learn_sample 1), so its usage settles its tenant (an unread stream keeps the charge, by
    design: reading it costs a message a chunk)."""
    # odd answer -> outcome, settlement. vLLM's error event after 3 tokens: the replica's failure, charged as an
    # answer that broke off.
    cases = {"sse": ("ok", SETTLED), "sse_nodone": ("ok", SETTLED), "sse_stall:0.6": ("ok", SETTLED),
             "sse_error:3": ("upstream_error", EXPECTED)}
    names = list(cases)
    async with OddReplica() as replica, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        s = await start(make_stack, tmp_path, replica, names, learn_sample=1)
        for odd, want in cases.items():
            before = await outcomes(http, s.metrics_url)
            status, headers, body, failure = await send(http, s.url, odd, odd, stream=True)
            assert status == 200 and failure is None, (odd, failure)
            events = [e for e in body.decode().split("\n\n") if e]
            # As sent, but for the usage chunk the ext_proc asked for, stripped: 3 tokens, the error event, [DONE].
            assert len(events) == 3 + (odd != "sse_nodone") + (odd == "sse_error:3"), (odd, events)
            await wait_idle(http, s.metrics_url)
            assert (await counted_as(http, s, before), settled(await left_charged(http, s.url, odd))) == want, odd
        # The stall past the class's 300 ms SLO is a latency sample over it; the error event is the error breaker's.
        await wait_idle(http, s.metrics_url)
        ms = await metrics(http, s.metrics_url)
        assert sample(ms, "extproc_breaker_window_error_ratio", **{"class": "interactive"}) == pytest.approx(1 / 4)
        assert sample(ms, "extproc_breaker_window_p95_seconds", **{"class": "interactive"}) >= 0.6
        assert_nothing_held_nor_failed(s, ms)


async def test_a_body_short_of_its_length_reaches_an_unread_client_with_a_payload_error_and_is_the_replicas(
        make_stack, tmp_path):
    """Unread (anonymous: no token bucket to settle), a JSON answer passes Envoy as it comes: a Content-Length the
    replica does not fill reaches the client as its 200, what was sent, and a payload error (the buffered case above
    got Envoy's 502). An HTTP/1.0-style body ended by the close is whole."""
    async with OddReplica() as replica, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        s = await start(make_stack, tmp_path, replica, [])
        for odd, want in {"shortbody": (True, "upstream_error"), "close": (False, "ok")}.items():
            before = await outcomes(http, s.metrics_url)
            status, _, body, failure = await send(http, s.url, odd, None)
            assert status == 200 and (failure is not None) is want[0], (odd, failure)
            assert what_came(body) == "answer", (odd, body)  # all it sent, short of what it promised
            await wait_idle(http, s.metrics_url)
            assert await counted_as(http, s, before) == want[1], odd
        await wait_idle(http, s.metrics_url)
        assert_nothing_held_nor_failed(s, await metrics(http, s.metrics_url))


async def test_a_replicas_instant_400s_do_not_hide_generations_that_miss_the_slo(make_stack, tmp_path):
    """240 prompts the replica refuses at once (past its context), then 8 generations of 0.5 s against a 300 ms SLO:
    the 400s used to be latency samples, the window's p95 read 0.013 s and the latency breaker stayed closed."""
    async with OddReplica() as replica, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        s = await start(make_stack, tmp_path, replica, [], min_samples=8)

        async def status_of(odd: str) -> int:
            return (await send(http, s.url, odd, None))[0]

        for odd, batches, status in (("status:400", 30, 400), ("slow:0.5", 1, 200)):
            for _ in range(batches):
                assert await asyncio.gather(*(status_of(odd) for _ in range(8))) == [status] * 8
        await wait_idle(http, s.metrics_url)

        async def latency_breaker() -> float:
            ms = await metrics(http, s.metrics_url)
            return sample(ms, "extproc_breaker_state", kind="latency", **{"class": "interactive"})

        assert await until(latency_breaker, timeout=5, holds=lambda state: state == 2) == 2  # open
        assert (await send(http, s.url, "ok", None))[0] == 503  # the class's fallback: refused, latency_breaker_open
