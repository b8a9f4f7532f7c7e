"""Fail closed (envoy.yaml rendered with failure_mode_allow: false): when the ext_proc is down or too slow, Envoy's
own 503/504 tell the client in words that the admission service failed, in the OpenAI error shape, while the
ext_proc's own answers and direct_response routes keep their bodies untouched."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from extproc.tools.stack import Stack
from tests.conftest import policy_file, until
from tests.integration.helpers import chat, metrics, post, sample, sample_once

ADMISSION_DOWN = "The admission service is unavailable or did not answer in time"
DIRECT_BODY = '{"error": {"message": "Unknown path.", "type": "invalid_request_error", "param": null, "code": "x"}}'


class StackWithDirectRoute(Stack):
    """A stack whose route table starts with a direct_response, as a default-deny route answers: Envoy makes
    that reply itself, with its own JSON body, which the local reply mappers must not wrap again."""

    def envoy_config(self) -> dict:
        cfg = super().envoy_config()
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
        routes.insert(0, {"match": {"path": "/test/direct"},
                          "direct_response": {"status": 404, "body": {"inline_string": DIRECT_BODY}},
                          # as envoy.yaml's own direct routes: the ext_proc would refuse any path it is sent
                          "typed_per_filter_config": routes[-1]["typed_per_filter_config"]})
        return cfg


@pytest.fixture
def closed_stack(tmp_path, upstream):
    policy = policy_file(tmp_path, classes={"interactive": {"max_concurrency": 2, "max_queue": 0,
                                                            "max_wait_ms": 0}}, tenants=[], shed={})
    pools = {"vllm_llama70b": [upstream], "vllm_llama8b": [upstream]}
    s = StackWithDirectRoute(tmp_path / "closed", pools, policy_path=policy, failure_mode_allow=False,
                             extproc_args=["--watch-interval", "0"])
    with s:
        yield s


def admission_failure(status: int, headers, text: bytes) -> dict:
    """The error of an Envoy-made reply for a failed ext_proc, checked for the shape and words clients get."""
    assert headers["content-type"] == "application/json", headers
    assert headers["retry-after"] == "1", headers
    err = json.loads(text)["error"]
    assert err["message"].startswith(ADMISSION_DOWN), err
    assert err["type"] == "server_error" and err["code"].startswith("ext_proc_error"), err
    return err


async def test_the_ext_procs_own_answers_and_direct_responses_are_not_rewrapped(closed_stack):
    async with aiohttp.ClientSession() as http:
        status, headers, text = await post(http, closed_stack.url, chat(model="no-such-model"))
        assert status == 404 and headers["x-extproc-decision"] == "invalid"
        err = json.loads(text)["error"]
        assert err["message"] == "The model `no-such-model` does not exist." and "param" in err, err
        async with http.get(f"{closed_stack.url}/test/direct") as r:
            assert r.status == 404 and await r.text() == DIRECT_BODY


async def test_ext_proc_down_answers_503_saying_admission_is_unavailable(closed_stack):
    async with aiohttp.ClientSession() as http:
        status, headers, _ = await post(http, closed_stack.url, chat())
        assert status == 200 and headers["x-extproc-decision"] == "accept"
        closed_stack.process("extproc").stop(signal.SIGKILL)
        status, headers, text = await post(http, closed_stack.url, chat())
        assert status == 503, text
        err = admission_failure(status, headers, text)
        assert "Connection_refused" in err["code"] or "connection_failure" in err["code"], err
        print(f"\nRELIABILITY fail closed, ext_proc down: {status} {text[:200]!r}")


async def test_ext_proc_message_timeout_answers_504_saying_admission_did_not_answer(closed_stack):
    proc = closed_stack.process("extproc")
    async with aiohttp.ClientSession() as http:
        os.killpg(proc.popen.pid, signal.SIGSTOP)  # frozen past message_timeout (0.5 s)
        try:
            t0 = time.monotonic()
            status, headers, text = await post(http, closed_stack.url, chat())
            waited = time.monotonic() - t0
        finally:
            os.killpg(proc.popen.pid, signal.SIGCONT)
        assert status == 504 and waited >= 0.45, (status, waited, text)
        err = admission_failure(status, headers, text)
        assert err["code"] == "ext_proc_error_per-message_timeout_exceeded", err
        print(f"\nRELIABILITY fail closed, ext_proc frozen: {status} after {waited:.2f}s {text[:200]!r}")


async def inflight(http, metrics_url: str) -> float:
    return sample(await metrics(http, metrics_url), "extproc_inflight", **{"class": "interactive"})


async def test_a_late_answer_after_the_admission_is_the_ext_procs_failure_not_the_replicas(tmp_path, upstream):
    """Admitted, then frozen past message_timeout while Envoy waits for its answer to the response headers (a
    usage-read request): Envoy answers 504 itself. Its access log reported a 504, and the ext_proc filed it as
    the replica's upstream_error: the error breaker counted it, one such freeze tripped it (min_requests 1), and
    the class's new requests were refused error_breaker_open with the replicas healthy. It is `ext_proc_error`."""
    policy = policy_file(tmp_path, classes={"interactive": {
        "max_concurrency": 2, "error_breaker": {"window_s": 30, "min_requests": 1, "cooldown_s": 30}}},
        tenants=[], shed={}, learn_sample=1.0)  # every response's headers come to the ext_proc
    s = Stack(tmp_path / "closed", {"vllm_llama70b": [upstream], "vllm_llama8b": [upstream]}, policy_path=policy,
              failure_mode_allow=False, extproc_args=["--watch-interval", "0"])
    with s:
        pid = s.process("extproc").popen.pid
        async with aiohttp.ClientSession() as http:
            # The replica answers after 1.5 s; the ext_proc is frozen from just after its admission until past it.
            answer = asyncio.create_task(post(http, s.url, chat(), headers={"x-test-delay-ms": "1500"}))
            admitted = await until(lambda: inflight(http, s.metrics_url), timeout=5, holds=lambda n: n == 1)
            assert admitted == 1
            os.killpg(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(2.5)
            finally:
                os.killpg(pid, signal.SIGCONT)
            status, headers, text = await answer
            assert status == 504, (status, text)
            assert admission_failure(status, headers, text)["code"] == "ext_proc_error_per-message_timeout_exceeded"
            assert await sample_once(http, s.metrics_url, "extproc_request_duration_seconds_count", 1,
                                     outcome="ext_proc_error") == 1
            ms = await metrics(http, s.metrics_url)
            assert sample(ms, "extproc_request_duration_seconds_count", outcome="upstream_error") == 0
            status, headers, _ = await post(http, s.url, chat())  # the breaker saw no error of the replica's
            assert status == 200 and headers["x-extproc-decision"] == "accept", (status, dict(headers))
