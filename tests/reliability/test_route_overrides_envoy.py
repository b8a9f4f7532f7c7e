"""Edits infra teams make to envoy.yaml, through real Envoy: a per-route override of the ext_proc's processing mode
must never let a request reach a replica without a decision."""

from __future__ import annotations

import json

import aiohttp
import pytest

from extproc.tools.stack import Stack
from tests.conftest import policy_file
from tests.integration.helpers import metrics, sample, upstream_reset, upstream_stats

PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
# What each overridden route's mode leaves out of what the ext_proc is sent.
OVERRIDES = {
    "/v1/completions": {"request_header_mode": "SEND", "request_body_mode": "NONE",
                        "response_trailer_mode": "SEND"},
    "/v1/responses": {"request_header_mode": "SKIP", "request_body_mode": "BUFFERED",
                      "response_trailer_mode": "SEND"},
    "/tokenize": {"request_header_mode": "SEND", "request_body_mode": "STREAMED",
                  "response_trailer_mode": "SEND"},
}


class OverriddenModeStack(Stack):
    """envoy.yaml with routes whose `typed_per_filter_config` overrides the ext_proc's processing mode, as a team
    does to 'skip the body' on a route it thinks cheap."""

    def envoy_config(self) -> dict:
        cfg = super().envoy_config()
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
            mode = OVERRIDES.get(route["match"].get("path"))
            if mode is not None:
                route["typed_per_filter_config"] = {"envoy.filters.http.ext_proc": {
                    "@type": PER_ROUTE, "overrides": {"processing_mode": mode}}}
        return cfg


@pytest.fixture
def overridden(tmp_path, upstream):
    policy = policy_file(tmp_path, endpoints={"tokenize": True})
    with OverriddenModeStack(tmp_path / "stack", {"vllm_llama70b": [upstream], "vllm_llama8b": [upstream]},
                             policy_path=policy) as s:
        yield s


@pytest.mark.parametrize("path", sorted(OVERRIDES))
async def test_a_route_that_does_not_send_headers_and_whole_body_is_refused_not_passed(overridden, upstream, path):
    """Before: a route whose override sent no body (or no headers) went upstream without a ticket, and with a
    streamed body the ext_proc never saw the request end either; the ext_proc answered the one message it got
    with `continue`. Now it reads the mode Envoy reports on the stream's first message and refuses (500)."""
    body = {"model": "llama-70b", "prompt": "hello", "input": "hello", "max_tokens": 4}
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        async with http.post(f"{overridden.url}{path}", json=body) as r:
            status, text = r.status, await r.read()
        assert status == 500, (status, text)
        assert json.loads(text)["error"]["code"] == "request_not_sent", text
        stats = await upstream_stats(http, upstream)
        assert stats["served"] == 0 and stats["unticketed"] == 0, stats
        if OVERRIDES[path]["request_header_mode"] == "SEND":
            seen = await (await http.get(f"http://{upstream[0]}:{upstream[1]}/test/seen")).json()
            assert [s for s in seen if s["path"] == path] == [], seen
        # else Envoy sends the headers upstream at once, holding the body for us: the replica sees a request
        # start and then its reset, never a body to run (served 0 above).
        ms = await metrics(http, overridden.metrics_url)
        assert sample(ms, "extproc_requests_total", reason="request_not_sent") == 1
        assert sample(ms, "extproc_unadmitted_requests_total") == 0
