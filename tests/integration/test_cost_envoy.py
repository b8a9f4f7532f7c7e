"""Cost-aware admission, tenant rate limits, session budgets and usage learning through Envoy + the simulator."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from extproc.tools.sim.fleet import SimFleet
from tests.conftest import policy_file, until

from .helpers import chat, metrics, post, sample, sample_once, upstream_stats, wait_idle

SPEED = 10.0
COST = {"prefill_s_per_1k_tokens": 0.1, "decode_s_per_token": 0.001}


@pytest.fixture
async def fleet():
    async with SimFleet("h100-llama70b-awq", replicas=1, speed=SPEED, model_names=["llama-70b"]) as f:
        yield f


def policy(tmp_path, interactive: dict | None = None, **top):
    """Caps out of the way (200 each), so what refuses is the cost budget, a rate limit or a session budget."""
    classes = {"interactive": {"max_concurrency": 200, "max_queue": 0, "max_wait_ms": 0, **(interactive or {})},
               "batch": {"max_concurrency": 200, "max_queue": 0, "max_wait_ms": 0}}
    models = {"llama-70b": {"cluster": "vllm_llama70b", "cost": COST}}
    return policy_file(tmp_path, **{"classes": classes, "models": models, "tenants": [], "shed": {}, **top})


def stack_for(make_stack, tmp_path, fleet, **top):
    return make_stack(policy(tmp_path, **top), pools={"vllm_llama70b": [("127.0.0.1", fleet.ports[0])]})


async def hold(http, fleet, seconds):
    """Make every request on the pool take `seconds` of wall time, so the ones sent together overlap."""
    async with http.post(f"{fleet.urls[0]}/sim/fault", json={"extra_latency_s": seconds * SPEED}) as r:
        assert r.status == 200


def prompt_of(tokens: int) -> dict:
    return {"model": "llama-70b", "max_tokens": 16, "messages": [{"role": "user", "content": "x " * (2 * tokens)}]}


async def test_one_long_prompt_consumes_the_budget_many_short_ones_would(make_stack, tmp_path, fleet):
    # Budget 1 GPU-s. Long: ~8,000 prompt tokens = 0.8 + 0.016 GPU-s. Short: ~40 tokens = ~0.02 GPU-s.
    s = stack_for(make_stack, tmp_path, fleet, interactive={"max_inflight_gpu_seconds": 1.0})
    async with aiohttp.ClientSession() as http:
        await hold(http, fleet, 1.0)
        long = asyncio.create_task(post(http, s.url, prompt_of(8000)))
        for _ in range(100):  # until the long request holds its share of the budget
            if sample(await metrics(http, s.metrics_url), "extproc_inflight_gpu_seconds") > 0.8:
                break
            await asyncio.sleep(0.02)
        shorts = await asyncio.gather(*[post(http, s.url, prompt_of(40)) for _ in range(30)])
        admitted = sum(r[0] == 200 for r in shorts)
        assert 5 <= admitted <= 12, admitted  # ~9 fit next to the long one (estimates are approximate)
        refused = [r for r in shorts if r[0] == 429]
        assert refused and all(json.loads(r[2])["error"]["code"] == "queue_full" for r in refused)
        assert (await long)[0] == 200
        shorts = await asyncio.gather(*[post(http, s.url, prompt_of(40)) for _ in range(30)])
        assert all(r[0] == 200 for r in shorts)  # without the long one, all 30 fit
        await wait_idle(http, s.metrics_url)      # the last streams close a moment after their responses
        ms = await metrics(http, s.metrics_url)
        assert sample(ms, "extproc_inflight_gpu_seconds") == pytest.approx(0.0, abs=1e-6)


async def test_a_request_bigger_than_the_whole_budget_is_413(make_stack, tmp_path, fleet):
    s = stack_for(make_stack, tmp_path, fleet, interactive={"max_inflight_gpu_seconds": 0.5})
    async with aiohttp.ClientSession() as http:
        status, headers, body = await post(http, s.url, prompt_of(8000))
        err = json.loads(body)["error"]
        assert status == 413 and err["code"] == "request_too_large" and "GPU-seconds" in err["message"]


async def test_a_tenant_over_its_token_rate_gets_429_with_openai_headers(make_stack, tmp_path, fleet):
    s = stack_for(make_stack, tmp_path, fleet, tenants=[
        {"name": "acme", "api_keys": ["sk-acme"], "tokens_per_minute": 600, "burst_s": 60},
        {"name": "other", "api_keys": ["sk-other"], "tokens_per_minute": 600, "burst_s": 60}])
    acme, other = {"authorization": "Bearer sk-acme"}, {"authorization": "Bearer sk-other"}
    async with aiohttp.ClientSession() as http:
        # ~160 tokens charged up front each, and used in full (ignore_eos), so the refund from the read usage
        # (every non-streamed answer of a tenant with tokens_per_minute) gives nothing back.
        body = chat(max_tokens=150, ignore_eos=True)
        results = [await post(http, s.url, body, acme) for _ in range(5)]
        assert [r[0] for r in results][:3] == [200, 200, 200] and results[-1][0] == 429
        ok_headers, (_, headers, raw) = results[0][1], results[-1]
        assert ok_headers["x-ratelimit-limit-tokens"] == "600"
        assert int(ok_headers["x-ratelimit-remaining-tokens"]) < 600
        assert json.loads(raw)["error"]["code"] == "tenant_tokens_per_minute"
        assert int(headers["retry-after"]) >= 1 and headers["x-ratelimit-remaining-tokens"] is not None
        assert (await post(http, s.url, body, other))[0] == 200  # another tenant is unaffected
        ms = await metrics(http, s.metrics_url)
        assert sample(ms, "extproc_ratelimit_decisions_total", tenant="acme", result="limited") >= 1


async def test_an_agent_session_is_held_to_its_budget_while_others_are_unaffected(make_stack, tmp_path, fleet):
    # Each request ~0.02 GPU-s; a session may hold 0.05 in flight: two at once.
    s = stack_for(make_stack, tmp_path, fleet, sessions={"max_inflight_gpu_seconds": 0.05},
                  tenants=[{"name": "agents", "api_keys": ["sk-a"]}, {"name": "web", "api_keys": ["sk-w"]}])
    agent = {"authorization": "Bearer sk-a", "x-session-id": "loop-1"}
    async with aiohttp.ClientSession() as http:
        await hold(http, fleet, 0.8)
        loop = asyncio.gather(*[post(http, s.url, prompt_of(40), agent) for _ in range(6)])
        others = asyncio.gather(*[post(http, s.url, prompt_of(40), {"authorization": "Bearer sk-w",
                                                                    "x-session-id": f"s{i}"}) for i in range(6)])
        loop, others = await asyncio.gather(loop, others)
        assert sorted(r[0] for r in loop) == [200, 200, 429, 429, 429, 429]
        assert {json.loads(r[2])["error"]["code"] for r in loop if r[0] == 429} == {"session_inflight_budget"}
        assert all(r[0] == 200 for r in others)
        ms = await metrics(http, s.metrics_url)
        assert sample(ms, "extproc_session_rejections_total", tenant="agents") == 4


async def test_usage_is_learned_and_the_extra_usage_chunk_never_reaches_the_client(make_stack, tmp_path, fleet):
    s = stack_for(make_stack, tmp_path, fleet, learn_sample=1.0)
    async with aiohttp.ClientSession() as http:
        _, _, plain = await post(http, s.url, chat(max_tokens=2000, stream=True))  # natural ends: ratio < 1
        _, _, asked = await post(http, s.url, chat(max_tokens=20, stream=True,
                                                   stream_options={"include_usage": True}))
        _, _, whole = await post(http, s.url, chat(max_tokens=20))
        events = [e for e in plain.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]" and not any(b'"choices":[]' in e for e in events)
        assert any(b'"choices":[]' in e and b'"usage"' in e for e in asked.split(b"\n\n"))
        assert json.loads(whole)["usage"]["completion_tokens"] > 0
        assert await sample_once(http, s.metrics_url, "extproc_cost_estimate_error_ratio_count", 3) == 3
        ms = await metrics(http, s.metrics_url)
        assert sample(ms, "extproc_cost_model", model="llama-70b", param="samples") == 3
        assert sample(ms, "extproc_cost_model", model="llama-70b", param="output_ratio") < 1.0


async def test_a_completion_without_max_tokens_is_charged_the_16_tokens_it_can_generate(make_stack, tmp_path):
    # The completions API's max_tokens defaults to 16 (OpenAI's and vLLM 0.32's CompletionRequest), not to the
    # rest of the context as in chat: charged the policy's default_max_tokens (1,024) instead, a short completion
    # with no max_tokens was refused outright under a 600 tokens-per-minute limit. Found through Envoy against a
    # real vLLM 0.32, whose answer to such a request was 16 tokens.
    s = make_stack(policy(tmp_path, tenants=[{"name": "acme", "api_keys": ["sk-acme"], "tokens_per_minute": 600,
                                             "burst_s": 60}]))
    async with aiohttp.ClientSession() as http:
        for sent in (1, 2):  # the second was refused (429): the first had taken the whole bucket
            async with http.post(f"{s.url}/v1/completions", json={"model": "llama-70b", "prompt": "Say hi"},
                                 headers={"authorization": "Bearer sk-acme"}) as r:
                assert r.status == 200, await r.read()
                remaining = int(r.headers["x-ratelimit-remaining-tokens"])
            assert remaining >= 600 - sent * (16 + 8)  # each charged its prompt (a few tokens) and 16 of output
            assert sent > 1 or remaining < 600 - 16    # (the second after the refund of the first's usage)


async def test_a_completion_that_only_scores_its_prompt_is_admitted(make_stack, tmp_path, upstream):
    # echo with max_tokens 0 is how lm-evaluation-harness (and others) read a prompt's logprobs: vLLM 0.32 serves
    # it, running one output token per prompt, and answers only max_tokens 0 without echo with a 400. The gateway
    # refused both ("`max_tokens` must be a positive integer"). Found through Envoy against a real vLLM 0.32.
    s = make_stack(policy(tmp_path))
    body = {"model": "llama-70b", "prompt": ["Say hi", "Say bye"], "echo": True, "max_tokens": 0, "logprobs": 1}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.read()
            assert r.headers["x-extproc-decision"] == "accept"
        sent = (await upstream_stats(http, upstream))["last_body"]
        assert sent["max_tokens"] == 0 and sent["echo"] is True
        async with http.post(f"{s.url}/v1/completions", json={**body, "echo": False}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "max_tokens"


async def test_a_long_prompt_vllm_truncates_is_charged_what_vllm_keeps(make_stack, tmp_path):
    # vLLM 0.32's truncate_prompt_tokens keeps each prompt's last N tokens: a 3,000-word prompt with 50 ran as 50
    # prompt tokens (usage), on chat and completions, and a list of two as 100. The gateway charged the whole
    # text (~40,000 characters here): a 2,000 tokens-per-minute tenant was refused what vLLM runs as ~60 tokens.
    long = "admission " * 4000
    bodies = {"chat": ("/v1/chat/completions", chat(max_tokens=10, messages=[{"role": "user", "content": long}])),
              "completions": ("/v1/completions", {"model": "llama-70b", "prompt": [long, long], "max_tokens": 10}),
              # vLLM 0.32's pooling requests read it too, per input (charged whole before: refused here)
              "embeddings": ("/v1/embeddings", {"model": "llama-70b", "input": [long, long]})}
    s = make_stack(policy(tmp_path, tenants=[{"name": name, "api_keys": [f"sk-{name}"], "tokens_per_minute": 2000,
                                              "burst_s": 60} for name in bodies], endpoints={"embeddings": True}))
    async with aiohttp.ClientSession() as http:
        for name, (path, body) in bodies.items():  # a tenant each: the first one's refund comes in between
            key = {"authorization": f"Bearer sk-{name}"}
            async with http.post(f"{s.url}{path}", json={**body, "truncate_prompt_tokens": 50}, headers=key) as r:
                assert r.status == 200, (path, await r.read())
                assert 2000 - int(r.headers["x-ratelimit-remaining-tokens"]) <= 2 * (50 + 10) + 10, path
            async with http.post(f"{s.url}{path}", json=body, headers=key) as r:
                assert r.status in (413, 429), (path, r.status)  # not truncated: all of it is charged


async def test_best_of_which_vllm_ignores_is_not_charged(make_stack, tmp_path):
    # vLLM 0.32 has no best_of (neither request model nor SamplingParams reads it): {"best_of": 5} is logged as an
    # ignored field and one sequence is generated. Charged as five, a 600 tokens-per-minute tenant's 100-token
    # completion left it under 100. Seen through Envoy against a real vLLM 0.32 (best_of 3: one choice, usage 4 of
    # max_tokens 4).
    s = make_stack(policy(tmp_path, tenants=[{"name": "acme", "api_keys": ["sk-acme"], "tokens_per_minute": 600,
                                             "burst_s": 60}]))
    body = {"model": "llama-70b", "prompt": "Say hi", "max_tokens": 100, "best_of": 5}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/completions", json=body, headers={"authorization": "Bearer sk-acme"}) as r:
            assert r.status == 200, await r.read()
            assert int(r.headers["x-ratelimit-remaining-tokens"]) >= 600 - 100 - 8


async def test_video_and_untyped_media_parts_are_charged_like_media(make_stack, tmp_path):
    # vLLM 0.32 takes video_url (and *_embeds) parts, and parts without `type` by their media key: all of them were
    # costed as empty text, a 32-frame video as nothing at all (5 tokens charged through Envoy before the fix).
    tenants = [{"name": name, "api_keys": [f"sk-{name}"], "tokens_per_minute": 60_000, "burst_s": 60}
               for name in ("video", "untyped")]
    s = make_stack(policy(tmp_path, tenants=tenants))
    parts = {"video": ({"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}}, 4096),
             "untyped": ({"image_url": {"url": "https://example.com/cat.png"}}, 768)}
    async with aiohttp.ClientSession() as http:
        for name, (part, at_least) in parts.items():  # a tenant each: the first one's refund comes in between
            body = chat(max_tokens=1, messages=[{"role": "user", "content": [part]}])
            status, headers, raw = await post(http, s.url, body, {"authorization": f"Bearer sk-{name}"})
            assert status == 200, raw
            assert 60_000 - int(headers["x-ratelimit-remaining-tokens"]) >= at_least, name


async def test_ignore_eos_is_costed_to_its_cap_and_never_taught_as_a_natural_length(make_stack, tmp_path):
    # An ignore_eos request (benchmarks; vLLM runs it to max_tokens) was estimated at the learned output ratio,
    # 1 / ratio times too low, and its full-length answers taught the ratio that answers run long.
    s = make_stack(policy(tmp_path, learn_sample=1.0))
    short, full = {"x-test-tokens": "5"}, {"x-test-tokens": "100"}

    async def ratio(samples: int) -> float:
        await sample_once(http, s.metrics_url, "extproc_cost_model", samples, model="llama-70b", param="samples")
        return sample(await metrics(http, s.metrics_url), "extproc_cost_model", model="llama-70b",
                      param="output_ratio")

    async with aiohttp.ClientSession() as http:
        for _ in range(20):  # answers that end on their own at 5 of 100 tokens: the ratio comes down to ~0.4
            assert (await post(http, s.url, chat(max_tokens=100), short))[0] == 200
        learned = await ratio(20)
        assert learned < 0.5
        for _ in range(10):
            assert (await post(http, s.url, chat(max_tokens=100, ignore_eos=True), full))[0] == 200
        assert await ratio(30) == pytest.approx(learned)
        held = asyncio.create_task(post(http, s.url, chat(max_tokens=100, ignore_eos=True),
                                        {**full, "x-test-delay-ms": "1500"}))
        await sample_once(http, s.metrics_url, "extproc_inflight", 1, **{"class": "interactive"})
        ms = await metrics(http, s.metrics_url)
        decode = sample(ms, "extproc_cost_model", model="llama-70b", param="decode_s_per_token")
        # Its 100 tokens of decode in full (under the learned coefficient), not 100 x the ratio.
        assert sample(ms, "extproc_inflight_gpu_seconds", **{"class": "interactive"}) >= 100 * decode
        assert (await held)[0] == 200


ACME_10K = [{"name": "acme", "api_keys": ["sk-acme"], "tokens_per_minute": 10_000, "burst_s": 60}]


async def check_refunded_after_a_large_answer(s, size: int, chunked: bool) -> None:
    """One answer of `size` bytes (logprobs) and 50 tokens to a request charged 4,000: it reaches the client whole,
    and the tenant gets back all but its usage."""
    key = {"authorization": "Bearer sk-acme"}
    big = {**key, "x-test-tokens": "50", "x-test-logprobs-bytes": str(size)}
    if chunked:
        big["x-test-chunked"] = "1"
    async with aiohttp.ClientSession() as http:
        status, got, raw = await post(http, s.url, chat(max_tokens=4000), big)
        assert status == 200 and len(raw) > size * 0.9 and ("content-length" in got) != chunked
        assert json.loads(raw)["usage"]["completion_tokens"] == 50  # passed on whole, unchanged
        assert int(got["x-ratelimit-remaining-tokens"]) < 10_000 - 4000

        async def remaining() -> int:  # a small request's view of the bucket
            _, hs, _ = await post(http, s.url, chat(max_tokens=1), key)
            return int(hs["x-ratelimit-remaining-tokens"])

        # Refunded once the answer is accounted (Envoy's access log comes a moment later). Unread, the bucket
        # only refills: ~170 tokens a second, under 7,000 within the 5 s.
        assert await until(remaining, 5.0, holds=lambda left: left > 9000) > 9000


@pytest.mark.parametrize("chunked", [False, True])
async def test_an_answer_over_the_body_limit_still_refunds_its_tenant_down_to_its_usage(make_stack, tmp_path,
                                                                                         chunked):
    # An answer over --max-body-bytes (4 MiB, Envoy's buffer: top_logprobs 20 are ~1.2 KB a token, so 4,000 tokens
    # are ~5 MB), or one without a content-length, was never read for its usage: its tenant kept the worst case
    # charged at admission (here 4,000 tokens for an answer of 50). Read as it comes, its end kept, it is refunded
    # as a buffered one is.
    s = make_stack(policy(tmp_path, tenants=ACME_10K))
    await check_refunded_after_a_large_answer(s, 5_000_000, chunked)


@pytest.mark.parametrize("chunked", [False, True])
async def test_an_answer_read_as_it_comes_under_a_small_body_limit_reaches_a_fail_closed_client_whole(
        make_stack, tmp_path, chunked):
    # Envoy hands such an answer over in pieces of up to 1 MiB (one read from the replica) however small its
    # buffer, and the ext_proc took messages of at most twice --max-body-bytes: under 256 KiB the stream failed,
    # and failing closed Envoy cut the client's answer after its headers.
    s = make_stack(policy(tmp_path, tenants=ACME_10K), extproc_args=["--max-body-bytes", str(256 << 10)],
                   failure_mode_allow=False)
    await check_refunded_after_a_large_answer(s, 3_000_000, chunked)
