"""envoy.yaml without its access log (an operator may remove it): how the ext_proc learns requests' outcomes then.

Without Envoy's completion report the ext_proc has only the stream: the response headers of the requests whose
response it reads (policy `learn_sample`, tokens-per-minute refunds), and the stream's end. Among those headers,
envoy.yaml's `response_attributes` carries Envoy's response code details, which tell the answers Envoy made itself
from the pool's."""

from __future__ import annotations

import json

import aiohttp
import pytest

from extproc.policy.admission import REPORT_WAIT_S
from extproc.tools.stack import Stack
from tests.conftest import policy_file, until
from tests.integration.helpers import chat, equals, healthz, metrics, post, sample, sample_once

DURATIONS = "extproc_request_duration_seconds_count"


class StackWithoutAccessLog(Stack):
    def envoy_config(self) -> dict:
        cfg = super().envoy_config()
        cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"].pop("access_log")
        return cfg


@pytest.fixture
def stack(tmp_path, upstream):
    # llama-70b is routed to a cluster Envoy does not have (a typo in the policy); llama-8b to a real pool. Every
    # response's headers come to the ext_proc (learn_sample 1), and one error opens the class's error breaker.
    models = {"llama-70b": {"cluster": "yes"}, "llama-8b": {"cluster": "vllm_llama8b"}}
    classes = {"interactive": {"max_concurrency": 3, "error_breaker": {"window_s": 30, "min_requests": 1,
                                                                       "cooldown_s": 30}}}
    policy = policy_file(tmp_path, models=models, classes=classes, tenants=[], shed={}, learn_sample=1.0)
    s = StackWithoutAccessLog(tmp_path / "stack", {"vllm_llama70b": [upstream], "vllm_llama8b": [upstream]},
                              policy_path=policy, extproc_args=["--watch-interval", "0"])
    with s:
        yield s


async def test_envoys_own_answer_is_not_routed_and_a_served_request_served_without_the_access_log(stack):
    """Envoy's 503 cluster_not_found, seen only as a 503 in the response headers, ended as the pool's
    upstream_error once no report came (REPORT_WAIT_S): one opened the error breaker of a pool nobody had asked,
    and the next request got the ext_proc's own 503 error_breaker_open. The details say Envoy answered it: it is
    `not_routed`, which no breaker or limit learns from (no latency sample), and a served request stays served."""
    s = stack
    async with aiohttp.ClientSession() as http:
        for attempt in range(2):
            status, headers, text = await post(http, s.url, chat(max_tokens=4))
            assert status == 503 and headers["x-extproc-decision"] == "accept", (attempt, status, text)
            assert json.loads(text)["error"]["code"] == "cluster_not_found", text
            assert await until(lambda: equals(inflight(http, s), 0), timeout=10)
            # Accounted once no report has come for REPORT_WAIT_S (the housekeeping runs every second).
            assert await sample_once(http, s.metrics_url, DURATIONS, attempt + 1, timeout=REPORT_WAIT_S + 10,
                                     outcome="not_routed") == attempt + 1
        ms = await metrics(http, s.metrics_url)
        assert sample(ms, "extproc_breaker_state", kind="error", pool="yes") == 0
        for outcome in ("upstream_error", "ok", "ended"):
            assert sample(ms, DURATIONS, outcome=outcome) == 0, outcome

        status, _, text = await post(http, s.url, chat(model="llama-8b"))
        assert status == 200, text
        ok = await sample_once(http, s.metrics_url, DURATIONS, 1, timeout=REPORT_WAIT_S + 10, outcome="ok")
        ms = await metrics(http, s.metrics_url)
        assert ok == 1, {k[1]: v for k, v in ms.items() if k[0] == DURATIONS}
        assert sample(ms, DURATIONS, outcome="not_routed") == 2


async def test_served_requests_end_ok_and_clients_that_left_mid_answer_end_as_aborts(tmp_path, upstream):
    """Envoy ends the ext_proc stream of a finished request and of a client that left the same way (its end of
    stream and a reset, which grpc.aio delivers in either order). The order decided: 16 of 100 served requests
    ended as client aborts (no latency sample for the limit) and 27 of 30 clients that left mid-answer as served.
    A response whose body is read (learn_sample 1 here) is served if its last message came, else cut short."""
    policy = policy_file(tmp_path, models={"llama-8b": {"cluster": "vllm_llama8b"}},
                         classes={"interactive": {"max_concurrency": 8}}, tenants=[], shed={}, learn_sample=1.0)
    s = StackWithoutAccessLog(tmp_path / "stack", {"vllm_llama8b": [upstream]}, policy_path=policy,
                              extproc_args=["--watch-interval", "0"])
    served, left = 60, 12
    with s:
        async with aiohttp.ClientSession() as http:
            for i in range(served):
                status, _, text = await post(http, s.url, chat(model="llama-8b", stream=i % 2 == 1))
                assert status == 200, text
            for _ in range(left):  # 40 tokens 50 ms apart: the client leaves after its first chunk
                async with http.post(f"{s.url}/v1/chat/completions",
                                     data=json.dumps(chat(model="llama-8b", stream=True, max_tokens=40)),
                                     headers={"content-type": "application/json", "x-test-token-ms": "50"}) as r:
                    assert r.status == 200
                    await r.content.readany()
                    r.close()
            aborts = await sample_once(http, s.metrics_url, DURATIONS, left, timeout=REPORT_WAIT_S + 10,
                                       outcome="client_abort")
            ms = await metrics(http, s.metrics_url)
            ended = {dict(k[1])["outcome"]: v for k, v in ms.items() if k[0] == DURATIONS and v}
            # On a starved CPU Envoy may give up on an answer (message_timeout) and go on without it: the stream is
            # reset while the ext_proc answers, an abort by what the stream saw. Every other end is exact.
            gave_up = await fail_open_count(http, s)
            assert ended.keys() <= {"ok", "client_abort"} and sum(ended.values()) == served + left, ended
            assert served - gave_up <= ended.get("ok", 0) and left <= aborts <= left + gave_up, (ended, gave_up)


async def fail_open_count(http, s) -> int:
    """How many messages Envoy's ext_proc filter went on without (its failure_mode_allowed counter)."""
    async with http.get(f"{s.admin_url}/stats?filter=ext_proc.failure_mode_allowed") as r:
        return sum(int(line.rsplit(":", 1)[1]) for line in (await r.text()).splitlines() if ":" in line)


async def inflight(http, s) -> float:
    return sum(c["inflight"] for c in (await healthz(http, s.metrics_url))["classes"].values())
