"""The official openai SDK through Envoy + the ext_proc + simulated vLLM: what an app that only changed its base_url
sees (answers, streams, error classes and fields, the SDK's own retries, a degrade, clients that break off)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from tests.conftest import policy_file, until

from .conftest import FLEET_SPEED
from .helpers import healthz, metrics, sample, wait_idle

HI = [{"role": "user", "content": "hi"}]


def sdk_policy(tmp_path):
    """interactive: 1 slot, overflow degraded to the 8B without streaming; batch: 1 slot, no queue (429 at once);
    internal: room for the break-off test; editor: 1 slot, overflow degraded on its own model by streaming off;
    kiosk: 1 slot, overflow answered with the canned message."""
    classes = {
        "interactive": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0, "on_overflow": "fallback",
                        "fallback": {"action": "degrade", "model": "llama-8b", "stream": False}},
        "batch": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0},
        "internal": {"max_concurrency": 8, "max_queue": 30, "max_wait_ms": 5000},
        "editor": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0, "on_overflow": "fallback",
                   "fallback": {"action": "degrade", "stream": False}},
        "kiosk": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0, "on_overflow": "fallback",
                  "fallback": {"action": "canned", "message": "Busy, back soon."}}}
    tenants = [{"name": "chat", "api_keys": ["sk-chat"], "max_class": "interactive", "default_class": "interactive"},
               {"name": "acme", "api_keys": ["sk-acme"], "max_class": "batch", "default_class": "batch",
                "requests_per_minute": 600},
               {"name": "ops", "api_keys": ["sk-ops"], "max_class": "internal", "default_class": "internal"},
               {"name": "ide", "api_keys": ["sk-ide"], "max_class": "editor", "default_class": "editor"},
               {"name": "kiosk", "api_keys": ["sk-kiosk"], "max_class": "kiosk", "default_class": "kiosk",
                "requests_per_minute": 600}]
    return policy_file(tmp_path, classes=classes, tenants=tenants, shed={}, anonymous={"allow": False})


@pytest.fixture
def sdk_stack(make_stack, tmp_path, fleets):
    big, small = fleets
    s = make_stack(sdk_policy(tmp_path), pools={"vllm_llama70b": [("127.0.0.1", big.ports[0])],
                                               "vllm_llama8b": [("127.0.0.1", small.ports[0])]})
    return s, big


def client(s, key: str, **kw) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{s.url}/v1", api_key=key, **kw)


async def hold_slot(http, s, big, key: str, cls: str) -> asyncio.Task:
    """A request of `key`'s class holding its one slot: every request on the 70B pool now waits 5 s (wall) before
    the engine. Cancel the task to free it."""
    async with http.post(f"{big.urls[0]}/sim/fault", json={"extra_latency_s": 5.0 * FLEET_SPEED}) as r:
        assert r.status == 200
    task = asyncio.create_task(client(s, key, max_retries=0).chat.completions.create(
        model="llama-70b", messages=HI, max_tokens=4))
    assert await until(lambda: inflight(http, s, cls), 5.0), f"{cls} never held its slot"
    return task


@contextlib.asynccontextmanager
async def held_class(s, big, key: str, cls: str):
    """`key`'s class with its one slot held (hold_slot), an HTTP session, and a client of `key` that does not
    retry."""
    async with aiohttp.ClientSession() as http:
        holder = await hold_slot(http, s, big, key, cls)
        try:
            yield http, client(s, key, max_retries=0)
        finally:
            await release(holder)


async def inflight(http, s, cls: str) -> int:
    return (await healthz(http, s.metrics_url))["classes"][cls]["inflight"]


async def release(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_answers_streams_and_errors_as_the_sdk_reads_them(sdk_stack):
    s, _ = sdk_stack
    c = client(s, "sk-chat", max_retries=0)
    raw = await c.chat.completions.with_raw_response.create(model="llama-70b", messages=HI, max_tokens=8)
    assert (raw.headers["x-extproc-class"], raw.headers["x-extproc-decision"]) == ("interactive", "accept")
    answer = raw.parse()
    assert answer.model == "llama-70b" and answer.choices[0].finish_reason in ("stop", "length")
    chunks = [ch async for ch in await c.chat.completions.create(
        model="llama-70b", messages=HI, max_tokens=8, stream=True, stream_options={"include_usage": True})]
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chunks[-1].usage.total_tokens - \
        chunks[-1].usage.prompt_tokens > 0
    events = [e async for e in await c.responses.create(model="llama-70b", input="hi", max_output_tokens=8,
                                                         stream=True)]
    assert events[-1].type == "response.completed"

    with pytest.raises(openai.BadRequestError) as bad:
        await c.chat.completions.create(model="llama-70b", messages=HI, max_tokens=-1)
    assert (bad.value.param, bad.value.code, bad.value.type) == ("max_tokens", "invalid_body", "invalid_request_error")
    with pytest.raises(openai.NotFoundError) as missing:
        await c.chat.completions.create(model="no-such-model", messages=HI, max_tokens=4)
    assert missing.value.code == "unknown_model"
    # The whole edge's models, not the one pool GET /v1/models is routed to.
    assert [m.id async for m in c.models.list()] == ["llama-70b", "llama-8b"]
    assert (await c.models.retrieve("llama-8b")).owned_by == "vllm"
    with pytest.raises(openai.NotFoundError) as missing:
        await c.models.retrieve("no-such-model")
    assert missing.value.code == "unknown_model"
    with pytest.raises(openai.AuthenticationError) as denied:
        await client(s, "sk-wrong", max_retries=0).chat.completions.create(model="llama-70b", messages=HI)
    assert denied.value.code == "invalid_api_key"


async def test_a_full_class_is_a_rate_limit_error_the_sdk_retries_after_retry_after(sdk_stack):
    s, big = sdk_stack
    async with aiohttp.ClientSession() as http:
        holder = await hold_slot(http, s, big, "sk-acme", "batch")
        before = sample(await metrics(http, s.metrics_url), "extproc_requests_total", reason="queue_full")
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError) as limited:
            await client(s, "sk-acme", max_retries=1).chat.completions.create(model="llama-70b", messages=HI,
                                                                                max_tokens=4)
        took = time.monotonic() - t0
        e = limited.value
        assert (e.code, e.type, e.param) == ("queue_full", "rate_limit_error", None)
        assert e.message.endswith(e.body["message"]) and "batch" in e.body["message"]
        assert e.response.headers["x-ratelimit-limit-requests"] == "600"
        retry_after = int(e.response.headers["retry-after"])
        # The SDK waited Retry-After before its one retry, which was refused on its own merits (counted again).
        assert retry_after * 0.95 <= took < retry_after + 2.0, (took, retry_after)
        after = sample(await metrics(http, s.metrics_url), "extproc_requests_total", reason="queue_full")
        assert after - before == 2
        await release(holder)


async def test_a_degraded_stream_is_one_answer_the_sdk_parses_with_its_model_and_usage(sdk_stack):
    s, big = sdk_stack
    async with held_class(s, big, "sk-chat", "interactive") as (http, chat):
        raw = await chat.chat.completions.with_raw_response.create(
            model="llama-70b", messages=HI, max_tokens=8, stream=True, stream_options={"include_usage": True})
        assert raw.headers["x-extproc-decision"] == "degrade"
        assert "stream=off" in raw.headers["x-extproc-degraded"]
        chunks = [ch async for ch in raw.parse()]
        assert [ch.model for ch in chunks] == ["llama-8b"] * 2  # the model that answered, as OpenAI reports it
        assert chunks[0].choices[0].delta.content and chunks[0].choices[0].finish_reason in ("stop", "length")
        assert chunks[1].choices == [] and chunks[1].usage.total_tokens > 0


async def test_a_degraded_answer_too_large_to_turn_back_into_a_stream_ends_it_with_an_error_the_sdk_raises(
        make_stack, tmp_path, fleets):
    # Before, an answer over the ext_proc's --max-body-bytes (Envoy's buffer, 4 MiB by default: ~3,500 tokens with
    # top_logprobs 20) went to the client as the JSON it was, and the SDK's stream read no event from it: an empty
    # answer, no error. 1 MiB here: 1,300 tokens with top_logprobs 20 are ~1.6 MB (within the 2 MiB its gRPC takes
    # in one message, as Envoy may hand the whole answer over at once).
    big, small = fleets
    s = make_stack(sdk_policy(tmp_path), extproc_args=["--max-body-bytes", str(1 << 20)],
                   pools={"vllm_llama70b": [("127.0.0.1", big.ports[0])],
                          "vllm_llama8b": [("127.0.0.1", small.ports[0])]})
    async with held_class(s, big, "sk-chat", "interactive") as (http, chat):
        kw = {"model": "llama-70b", "messages": HI, "stream": True, "extra_body": {"ignore_eos": True}}
        raw = await chat.chat.completions.with_raw_response.create(max_tokens=1300, logprobs=True, top_logprobs=20,
                                                                    **kw)
        assert "stream=off" in raw.headers["x-extproc-degraded"]
        assert raw.headers["content-type"].startswith("text/event-stream")
        with pytest.raises(openai.APIError) as failed:
            [ch async for ch in raw.parse()]
        assert failed.value.body["code"] == "degraded_answer_too_large" and "stream" in failed.value.message
        # One within the limit is still sent on as a stream.
        chunks = [ch async for ch in await chat.chat.completions.create(max_tokens=8, logprobs=True, top_logprobs=2,
                                                                        **kw)]
        assert chunks[0].choices[0].finish_reason == "length" and len(chunks[0].choices[0].logprobs.content) == 8
    async with aiohttp.ClientSession() as http:
        assert (await wait_idle(http, s.metrics_url, timeout=5.0))["interactive"]["inflight"] == 0


async def test_a_stream_off_degrade_refuses_what_it_would_not_change_instead_of_serving_it_on_the_full_pool(
        sdk_stack):
    # A non-streamed request, or a Responses API stream (which keeps streaming), under `fallback: {action: degrade,
    # stream: false}` was sent unchanged to the pool that had just had no room, answered 200 with
    # `x-extproc-decision: degrade` and `x-extproc-degraded: none`.
    s, big = sdk_stack
    async with held_class(s, big, "sk-ide", "editor") as (http, ide):
        for call in (lambda: ide.chat.completions.create(model="llama-70b", messages=HI, max_tokens=4),
                     lambda: ide.completions.create(model="llama-70b", prompt="hi", max_tokens=4),
                     lambda: ide.responses.create(model="llama-70b", input="hi", max_output_tokens=4, stream=True)):
            with pytest.raises(openai.RateLimitError) as limited:
                await call()
            e = limited.value
            assert (e.code, e.response.headers["x-extproc-decision"]) == ("queue_full", "reject")
            assert "would not change it: it is not a chat or completions stream" in e.message
            assert int(e.response.headers["retry-after"]) >= 1
        assert (await healthz(http, s.metrics_url))["classes"]["editor"]["inflight"] == 1  # the holder alone


async def test_a_canned_answer_reads_as_an_answer_and_says_where_the_tenants_rate_limit_stands(sdk_stack):
    s, big = sdk_stack
    async with held_class(s, big, "sk-kiosk", "kiosk") as (http, kiosk):
        plain = await kiosk.chat.completions.with_raw_response.create(model="llama-70b", messages=HI, max_tokens=8)
        answer = plain.parse()
        assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == ("Busy, back soon.", "stop")
        assert answer.model == "llama-70b" and answer.usage.total_tokens == 0  # no model answered
        streamed = await kiosk.chat.completions.with_raw_response.create(
            model="llama-70b", messages=HI, max_tokens=8, stream=True, stream_options={"include_usage": True})
        chunks = [ch async for ch in streamed.parse()]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Busy, back soon."
        assert chunks[-1].usage.total_tokens == 0
        for h in (plain.headers, streamed.headers):
            assert (h["x-extproc-decision"], h["x-extproc-degraded"]) == ("degrade", "canned; reason=queue_full")
            # As on every other answer to a tenant with a rate limit: a client pacing itself by them reads them.
            assert h["x-ratelimit-limit-requests"] == "600" and 0 <= int(h["x-ratelimit-remaining-requests"]) <= 600


async def test_clients_that_break_off_leave_nothing_in_flight(sdk_stack):
    s, big = sdk_stack
    ops = client(s, "sk-ops", max_retries=0)
    ended: list[str] = []

    async def one(i: int) -> None:
        stream = await ops.chat.completions.create(model="llama-70b", messages=HI, max_tokens=400, stream=True,
                                                   extra_body={"ignore_eos": True})
        n = 0
        async for _ in stream:
            n += 1
            if i % 2 and n == 3:  # stops reading and closes the stream
                await stream.close()
                ended.append("closed")
                return
        ended.append("read")

    async with aiohttp.ClientSession() as http:
        tasks = [asyncio.create_task(one(i)) for i in range(30)]  # 8 run, the rest queue
        await asyncio.sleep(0.5)
        for t in tasks[::3]:  # cancelled wherever they are: queued, waiting for headers or reading
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert not [r for r in results if r is not None and not isinstance(r, asyncio.CancelledError)], results
        snap = await wait_idle(http, s.metrics_url, timeout=5.0)
        assert snap["internal"]["inflight"] == 0 and snap["internal"]["queue"] == 0, snap
        assert sample(await metrics(http, s.metrics_url), "extproc_inflight") == 0
    assert ended and len(ended) < 30
