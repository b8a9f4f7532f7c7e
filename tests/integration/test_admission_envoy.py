"""Admission through real Envoy + the ext_proc to a loopback upstream: caps, queues, 429/503, release."""

from __future__ import annotations

import asyncio
import json
import signal

import aiohttp

from extproc.tools.sim.fleet import SimFleet
from tests.conftest import policy_file, until

from .helpers import (chat, healthz, metrics, post, raw_request, sample, sample_once, upstream_reset, upstream_stats,
                      wait_idle)

SLOW = {"x-test-delay-ms": "600"}


async def test_cap_runs_exactly_n_at_once_then_queues_then_rejects(make_stack, upstream):
    s = make_stack()  # interactive: 3 slots, queue 2, wait 2 s
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        results = await asyncio.gather(*[post(http, s.url, chat(), SLOW) for _ in range(7)])
        statuses = sorted(r[0] for r in results)
        assert statuses == [200] * 5 + [429] * 2
        assert (await upstream_stats(http, upstream))["max_in_service"] == 3
        queued = [r for r in results if r[0] == 200 and "x-extproc-queue-wait-ms" in r[1]]
        assert len(queued) == 2 and all(int(r[1]["x-extproc-queue-wait-ms"]) >= 400 for r in queued)
        for status, headers, body in results:
            assert headers["x-extproc-class"] == "interactive"
            if status == 429:
                assert int(headers["retry-after"]) >= 1
                err = json.loads(body)["error"]
                assert err["code"] == "queue_full" and "interactive" in err["message"]
                assert headers["x-extproc-decision"] == "reject"
            else:
                assert headers["x-extproc-decision"] == "accept"
        assert all(c["inflight"] == 0 for c in (await wait_idle(http, s.metrics_url)).values())


async def test_queued_requests_past_max_wait_get_429(make_stack, upstream, tmp_path):
    policy = policy_file(tmp_path, classes={"interactive": {"max_concurrency": 1, "max_queue": 5,
                                                            "max_wait_ms": 200}}, tenants=[])
    s = make_stack(policy)
    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(*[post(http, s.url, chat(), SLOW) for _ in range(3)])
        assert sorted(r[0] for r in results) == [200, 429, 429]
        for status, headers, body in results:
            if status == 429:
                assert json.loads(body)["error"]["code"] == "queue_timeout"
                assert int(headers["retry-after"]) >= 1
        ms = await metrics(http, s.metrics_url)
        assert sample(ms, "extproc_requests_total", decision="reject", reason="queue_timeout") == 2
        assert sample(ms, "extproc_queue_wait_seconds_count", **{"class": "interactive"}) == 2


async def test_batch_is_shed_with_503_while_interactive_is_saturated(make_stack):
    s = make_stack()
    async with aiohttp.ClientSession() as http:
        hold = [asyncio.create_task(post(http, s.url, chat(), SLOW)) for _ in range(3)]
        saturated = await until(lambda: healthz(http, s.metrics_url),
                                holds=lambda h: h["classes"]["interactive"]["inflight"] == 3)
        assert saturated["classes"]["interactive"]["inflight"] == 3
        status, headers, body = await post(http, s.url, chat(), {"x-priority": "batch"})
        assert status == 503
        assert headers["x-extproc-decision"] == "shed" and headers["x-extproc-class"] == "batch"
        assert int(headers["retry-after"]) >= 1
        assert json.loads(body)["error"]["code"] == "higher_class_saturated"
        await asyncio.gather(*hold)
        status, _, _ = await post(http, s.url, chat(), {"x-priority": "batch"})
        assert status == 200


async def test_a_tenant_cannot_promote_itself(make_stack):
    s = make_stack()
    async with aiohttp.ClientSession() as http:
        status, headers, _ = await post(http, s.url, chat(), {"authorization": "Bearer sk-acme-1",
                                                              "x-priority": "interactive"})
        assert status == 200 and headers["x-extproc-class"] == "batch"
        status, headers, _ = await post(http, s.url, chat(priority="internal"),
                                        {"authorization": "Bearer sk-acme-1"})
        assert headers["x-extproc-class"] == "internal"
        ms = await metrics(http, s.metrics_url)
        assert sample(ms, "extproc_class_demotions_total", tenant="acme") == 1


async def test_body_class_field_is_stripped_before_vllm(make_stack, upstream):
    s = make_stack()
    async with aiohttp.ClientSession() as http:
        status, headers, _ = await post(http, s.url, chat(priority="batch"))
        assert status == 200 and headers["x-extproc-class"] == "batch"
        last = (await upstream_stats(http, upstream))["last_body"]
        assert "priority" not in last and last["model"] == "llama-70b"


async def test_malformed_json_is_400_and_takes_no_slot(make_stack):
    s = make_stack()
    async with aiohttp.ClientSession() as http:
        for bad in (b"{not json", b"[]", json.dumps(chat(max_tokens="lots")).encode()):
            status, headers, body = await post(http, s.url, bad)
            assert status == 400
            assert json.loads(body)["error"]["type"] == "invalid_request_error"
        status, _, body = await post(http, s.url, chat(model="gpt-99"))
        assert status == 404 and "gpt-99" in json.loads(body)["error"]["message"]
        snap = await wait_idle(http, s.metrics_url)
        assert all(c["inflight"] == 0 for c in snap.values())


# Requests vLLM 0.32 answers 400 before it runs anything (tests/fixtures/vllm/differential.json, its
# validate_json_request): (path, Content-Type, body, the error's code, its param).
VLLM_REFUSES = [
    ("/v1/chat/completions", b"text/plain", chat(), "unsupported_media_type", None),
    ("/v1/chat/completions", None, chat(), "unsupported_media_type", None),
    ("/v1/completions", b"application/x-www-form-urlencoded", {"model": "llama-70b", "prompt": "hi"},
     "unsupported_media_type", None),
    *[("/v1/chat/completions", b"application/json", chat(messages=m), "invalid_body", "messages")
      for m in (None, "hi", 5, [], ["hi"], [{"content": "hi"}])],
    *[("/v1/completions", b"application/json; charset=utf-8", {"model": "llama-70b", "prompt": p}, "invalid_body",
       "prompt") for p in (None, 5, {"a": 1}, [])],
    # what is inside them: a prompt list's entries, a message's content, the Responses API's input
    *[("/v1/completions", b"application/json", {"model": "llama-70b", "prompt": p}, "invalid_body", "prompt")
      for p in ([[]], [[5], []], [5, "a"], [-1], [[5], "a"], [[[5]]])],
    *[("/v1/chat/completions", b"application/json", chat(messages=[{"role": "user", "content": c}]), "invalid_body",
       "messages") for c in (5, True, None, {"type": "text", "text": "hi"}, [5])],
    *[("/v1/responses", b"application/json", {"model": "llama-70b", "max_output_tokens": 8, **i}, "invalid_body",
       "input") for i in ({}, {"input": 5}, {"input": []}, {"input": ["hi"]})],
]
# Their near misses, which vLLM runs (differential.json): admitted.
VLLM_RUNS = [
    ("/v1/completions", {"model": "llama-70b", "prompt": [5, "6", True], "max_tokens": 4}),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": None}, {"role": "user", "content": {}}])),
]


async def test_a_request_vllm_refuses_unrun_is_refused_before_admission_and_never_reaches_a_replica(make_stack,
                                                                                                   upstream):
    # Admitted, each held a slot (and its class's queue) until the replica answered its 400.
    s = make_stack()
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        for path, content_type, body, code, param in VLLM_REFUSES:
            headers = [] if content_type is None else [(b"content-type", content_type)]
            status, hs, text = await raw_request(s.listen_port, headers, json.dumps(body).encode(), path=path.encode())
            assert status == 400, (path, content_type, body, text[:300])
            err = json.loads(text)["error"]
            assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error"), err
            assert hs["x-extproc-decision"] == "invalid" and hs["content-type"] == "application/json"
        async with http.get(f"http://{upstream[0]}:{upstream[1]}/test/seen") as r:
            assert await r.json() == []  # not one reached the replica
        snap = await wait_idle(http, s.metrics_url)
        assert all(c["inflight"] == 0 and c["queue"] == 0 for c in snap.values()), snap
        ms = await metrics(http, s.metrics_url)
        assert sample(ms, "extproc_requests_total", decision="invalid") == len(VLLM_REFUSES)
        assert sample(ms, "extproc_requests_total", decision="accept") == 0
        # every spelling vLLM takes is admitted
        for content_type in (b"application/json; charset=utf-8", b"Application/JSON"):
            status, _, text = await raw_request(s.listen_port, [(b"content-type", content_type)],
                                                json.dumps(chat()).encode())
            assert status == 200, (content_type, text[:300])
        for path, body in VLLM_RUNS:
            status, _, text = await raw_request(s.listen_port, [(b"content-type", b"application/json")],
                                                json.dumps(body).encode(), path=path.encode())
            assert status == 200, (path, body, text[:300])
        assert (await upstream_stats(http, upstream))["served"] == 2 + len(VLLM_RUNS)


async def test_a_background_response_is_refused_since_it_would_run_after_its_slot_is_freed(make_stack, upstream):
    # Found on the real vLLM 0.32 with VLLM_ENABLE_RESPONSES_API_STORE=1: a `background` request is answered in
    # milliseconds ("status": "queued") and generates afterwards, so a class capped at 1 slot with no queue let 4
    # of them run at once (extproc_inflight 0, vllm:num_requests_running 4); GET /v1/responses/{id} is not routed.
    s = make_stack()
    body = {"model": "llama-70b", "input": "hello", "max_output_tokens": 8, "store": True}
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        for background in (True, "true", 1):
            async with http.post(f"{s.url}/v1/responses", json={**body, "background": background}) as r:
                doc = await r.json()
                assert r.status == 400, (background, doc)
                err = doc["error"]
                assert err["param"] == "background", err
                assert err["type"] == "invalid_request_error" and "background" in err["message"]
        assert (await upstream_stats(http, upstream))["served"] == 0
        async with http.post(f"{s.url}/v1/responses", json={**body, "background": False}) as r:
            assert r.status == 200
        assert all(c["inflight"] == 0 for c in (await wait_idle(http, s.metrics_url)).values())


async def test_sse_stream_passes_through_byte_for_byte(make_stack, upstream):
    s = make_stack()
    body = chat(max_tokens=20, stream=True)
    async with aiohttp.ClientSession() as http:
        direct = await post(http, f"http://{upstream[0]}:{upstream[1]}", body)
        via = await post(http, s.url, body)
        assert via[0] == 200 and via[1]["content-type"].startswith("text/event-stream")
        assert via[2] == direct[2] and via[2].endswith(b"data: [DONE]\n\n")


async def test_upstream_5xx_releases_the_slot_and_is_counted(make_stack):
    s = make_stack()
    async with aiohttp.ClientSession() as http:
        status, headers, _ = await post(http, s.url, chat(), {"x-test-status": "500"})
        assert status == 500 and headers["x-extproc-decision"] == "accept"
        await wait_idle(http, s.metrics_url)
        assert await sample_once(http, s.metrics_url, "extproc_request_duration_seconds_count", 1,
                                 outcome="upstream_error") == 1
        assert sample(await metrics(http, s.metrics_url), "extproc_inflight") == 0


async def test_completed_requests_are_counted_ok(make_stack):
    s = make_stack()
    async with aiohttp.ClientSession() as http:
        for stream in (False, True):
            status, _, _ = await post(http, s.url, chat(stream=stream))
            assert status == 200
        await wait_idle(http, s.metrics_url)
        assert await sample_once(http, s.metrics_url, "extproc_request_duration_seconds_count", 2, outcome="ok") == 2
        assert await sample_once(http, s.metrics_url, "extproc_time_to_first_byte_seconds_count", 2) == 2


async def test_aborting_50_streams_mid_response_returns_inflight_to_zero(make_stack, upstream, tmp_path):
    policy = policy_file(tmp_path, classes={"interactive": {"max_concurrency": 64, "max_queue": 0,
                                                            "max_wait_ms": 0}}, tenants=[])
    s = make_stack(policy)
    body = json.dumps(chat(max_tokens=200, stream=True)).encode()
    async with aiohttp.ClientSession() as http:
        async def abort_mid_stream():
            async with http.post(f"{s.url}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "x-test-token-ms": "20"}) as r:
                assert r.status == 200
                await r.content.readuntil(b"\n\n")
                await r.content.readuntil(b"\n\n")
                r.close()  # hard close mid-stream

        await asyncio.gather(*[abort_mid_stream() for _ in range(50)])
        snap = await wait_idle(http, s.metrics_url, timeout=1.0)
        assert snap["interactive"]["inflight"] == 0
        # The slot is freed at the stream end; how it ended comes from Envoy's access log (batched, 0.1 s).
        assert await sample_once(http, s.metrics_url, "extproc_request_duration_seconds_count", 50,
                                 outcome="client_abort") == 50


async def test_client_leaving_the_queue_frees_its_place_at_once(make_stack, tmp_path):
    policy = policy_file(tmp_path, classes={"interactive": {"max_concurrency": 1, "max_queue": 5,
                                                            "max_wait_ms": 5000}}, tenants=[])
    s = make_stack(policy)
    async with aiohttp.ClientSession() as http:
        async def interactive() -> dict:
            return (await healthz(http, s.metrics_url))["classes"]["interactive"]

        hold = asyncio.create_task(post(http, s.url, chat(), {"x-test-delay-ms": "1500"}))
        assert (await until(interactive, holds=lambda c: c["inflight"] == 1))["inflight"] == 1
        waiting = asyncio.create_task(post(http, s.url, chat()))
        assert (await until(interactive, holds=lambda c: c["queue"] == 1))["queue"] == 1
        waiting.cancel()
        assert (await until(interactive, timeout=1.0, holds=lambda c: c["queue"] == 0))["queue"] == 0
        assert await sample_once(http, s.metrics_url, "extproc_requests_total", 1, reason="client_disconnected") == 1
        await hold


async def test_non_generation_paths_pass_through_without_admission(make_stack):
    s = make_stack()
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{s.url}/v1/models") as r:
            assert r.status == 200 and "x-extproc-decision" not in r.headers
        ms = await metrics(http, s.metrics_url)
        assert sample(ms, "extproc_requests_total") == 0


async def test_client_cannot_choose_the_cluster_header(make_stack, upstream):
    """The header that picks the pool is the ext_proc's alone. Up, the ext_proc overwrites it; down (failure_mode_allow
    lets requests through unadmitted) only Envoy's own stripping of client-sent x-extproc-* headers
    (early_header_mutation in envoy/envoy.yaml) keeps it from picking a pool or opening a path the gateway denies
    (the route keyed on it matches any path)."""
    s = make_stack()
    cluster_8b = f"{s.admin_url}/stats?filter=^cluster\\.vllm_llama8b\\.upstream_rq_total$"
    async with aiohttp.ClientSession() as http:
        async def sent_to_8b() -> str:
            async with http.get(cluster_8b) as r:
                return (await r.text()).strip()

        async def denied_path_with_header() -> tuple[int, dict]:
            async with http.get(f"{s.url}/test/stats", headers={"x-extproc-cluster": "vllm_llama70b"}) as r:
                return r.status, await r.json(content_type=None)

        for extproc_up in (True, False):
            if not extproc_up:
                s.process("extproc").stop(signal.SIGKILL)
            status, _, _ = await post(http, s.url, chat(), {"x-extproc-cluster": "extproc"})
            assert status == 200, extproc_up
            status, _, _ = await post(http, s.url, chat(model="llama-70b"), {"x-extproc-cluster": "vllm_llama8b"})
            assert status == 200 and await sent_to_8b() == "cluster.vllm_llama8b.upstream_rq_total: 0", extproc_up
            status, body = await denied_path_with_header()
            assert status == 404 and body["error"]["code"] == "unknown_url", (extproc_up, status, body)

async def test_a_stream_degraded_to_no_streaming_still_reaches_its_client_as_a_stream(make_stack, upstream, tmp_path):
    # `fallback.stream: false` asks the replica for one JSON answer. Sent on as JSON to a client that asked to
    # stream, the OpenAI SDKs read no events from it and return an empty answer without an error: the client gets
    # the answer as the event stream it asked for, the usage chunk only if it asked for one, and Envoy's
    # content-type and content-length match the body.
    policy = policy_file(tmp_path, classes={"interactive": {
        "max_concurrency": 1, "max_queue": 0, "on_overflow": "fallback",
        "fallback": {"action": "degrade", "max_tokens": 3, "stream": False}}}, tenants=[])
    s = make_stack(policy)
    async with aiohttp.ClientSession() as http:
        hold = asyncio.create_task(post(http, s.url, chat(), {"x-test-delay-ms": "3000"}))
        assert await until(lambda: healthz(http, s.metrics_url),
                           holds=lambda h: h["classes"]["interactive"]["inflight"] == 1)
        for usage_asked in (False, True):
            body = chat(max_tokens=50, stream=True, **({"stream_options": {"include_usage": True}} if usage_asked
                                                       else {}))
            status, headers, raw = await post(http, s.url, body)
            assert status == 200 and headers["x-extproc-degraded"] == "max_tokens=3,stream=off; reason=queue_full"
            assert headers["content-type"].startswith("text/event-stream")
            events = raw.decode().split("\n\n")
            assert events[-2:] == ["data: [DONE]", ""]
            chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
            assert chunks[0]["object"] == "chat.completion.chunk"
            assert chunks[0]["choices"][0]["delta"]["content"] == "x x x "
            assert chunks[0]["choices"][0]["finish_reason"] == "length"
            assert (chunks[-1].get("usage") or {}).get("completion_tokens") == (3 if usage_asked else None)
        assert (await hold)[0] == 200
        assert all(c["inflight"] == 0 for c in (await wait_idle(http, s.metrics_url)).values())


async def test_a_degrade_that_clamps_max_tokens_keeps_the_clients_min_tokens_valid(make_stack, upstream, tmp_path):
    # vLLM refuses min_tokens > max_tokens with a 400: a clamp to 3 of a request with min_tokens 10 (valid as the
    # client sent it) got the client vLLM's 400 for a body the gateway wrote. Found through Envoy to real vLLM 0.32.
    policy = policy_file(tmp_path, classes={"interactive": {
        "max_concurrency": 1, "max_queue": 0, "on_overflow": "fallback",
        "fallback": {"action": "degrade", "max_tokens": 3}}}, tenants=[])
    s = make_stack(policy)
    async with aiohttp.ClientSession() as http:
        hold = asyncio.create_task(post(http, s.url, chat(), {"x-test-delay-ms": "3000"}))
        assert await until(lambda: healthz(http, s.metrics_url),
                           holds=lambda h: h["classes"]["interactive"]["inflight"] == 1)
        for asked in ({"max_tokens": 50, "min_tokens": 10}, {"max_completion_tokens": 50, "min_tokens": 10},
                      {"max_tokens": 50, "min_tokens": 2}):
            status, headers, raw = await post(http, s.url, chat(**asked))
            assert status == 200, raw
            assert headers["x-extproc-degraded"].startswith("max_tokens=3")
            sent = (await upstream_stats(http, upstream))["last_body"]
            assert sent["min_tokens"] == min(asked["min_tokens"], 3), sent
        assert (await hold)[0] == 200
        assert all(c["inflight"] == 0 for c in (await wait_idle(http, s.metrics_url)).values())


async def test_a_degrade_to_a_model_with_a_smaller_context_fits_the_request_to_it_or_refuses_it(make_stack, upstream, tmp_path):
    # A request sized for a 32k model (max_tokens 16,000) degraded to an 8k one: vLLM (here its simulator, which
    # answers as vLLM 0.32 does) refuses max_tokens beyond its max_model_len with a 400, so the degrade caps it at
    # the fallback model's max_context_tokens.
    models = {"llama-70b": {"cluster": "vllm_llama70b", "cost": {"max_context_tokens": 32768}},
              "llama-8b": {"cluster": "vllm_llama8b", "cost": {"max_context_tokens": 8192}}}
    policy = policy_file(tmp_path, models=models, tenants=[], classes={"interactive": {
        "max_concurrency": 1, "max_queue": 0, "on_overflow": "fallback",
        "fallback": {"action": "degrade", "model": "llama-8b"}}})
    async with SimFleet("h100-llama8b", replicas=1, speed=20.0, model_names=["llama-8b"]) as small:
        s = make_stack(policy, pools={"vllm_llama70b": [upstream], "vllm_llama8b": [("127.0.0.1", small.ports[0])]})
        async with aiohttp.ClientSession() as http:
            hold = asyncio.create_task(post(http, s.url, chat(), {"x-test-delay-ms": "3000"}))
            assert await until(lambda: healthz(http, s.metrics_url),
                               holds=lambda h: h["classes"]["interactive"]["inflight"] == 1)
            status, headers, raw = await post(http, s.url, chat(max_tokens=16_000))
            assert status == 200, raw
            assert headers["x-extproc-degraded"] == "model=llama-8b,max_tokens=8192; reason=queue_full"
            # A prompt of ~10,000 tokens fits the 32k model, not the 8k one (a 400 there): refused, to retry.
            long = chat(messages=[{"role": "user", "content": "word " * 8000}])
            status, headers, raw = await post(http, s.url, long)
            assert status == 429 and "does not fit the degrade model llama-8b" in json.loads(raw)["error"]["message"]
            assert int(headers["retry-after"]) >= 1
            assert (await hold)[0] == 200
            assert all(c["inflight"] == 0 for c in (await wait_idle(http, s.metrics_url)).values())
