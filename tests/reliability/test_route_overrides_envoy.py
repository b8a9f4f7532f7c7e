"""Edits infra teams make to envoy.yaml, through real Envoy: a per-route override of the ext_proc's processing mode
must never let a request reach a replica without a decision."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import aiohttp
import pytest

from extproc.tools.envoylint import lint
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
        assert r.headers.get("x-should-retry") == "false"  # the OpenAI SDKs retry a 500 otherwise
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


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _header(name: str, value: str) -> bytes:
    """HPACK: a literal field with a new name, not indexed, no Huffman (short names and values only)."""
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


def trailers_without_body(port: int, path: str) -> None:
    """An HTTP/2 POST that is HEADERS then a trailers frame, no DATA (nghttp is not everywhere: frames by hand).
    Returns once Envoy answered, reset it or closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        head = b"".join(_header(k, v) for k, v in ((":method", "POST"), (":scheme", "http"), (":path", path),
                                                   (":authority", "x"), ("content-type", "application/json")))
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b"") + _frame(1, 0x4, 1, head) +
                  _frame(1, 0x5, 1, _header("x-trailer", "1")))  # END_HEADERS, then END_HEADERS|END_STREAM
        got = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                got += chunk
                if _answered(got):
                    return


def _answered(data: bytes) -> bool:
    """Whether the frames so far hold stream 1's response headers or reset."""
    while len(data) >= 9:
        size, kind, stream = int.from_bytes(data[:3], "big"), data[3], int.from_bytes(data[5:9], "big")
        if kind in (1, 3) and stream == 1:
            return True
        data = data[9 + size:]
    return False


class TrailerlessOverrideStack(Stack):
    """envoy.yaml with a route whose override spells out the body mode but not request_trailer_mode: an override
    replaces the whole mode, so that route's request trailers mode is Envoy's default, SKIP."""

    def envoy_config(self) -> dict:
        cfg = super().envoy_config()
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        route = next(r for r in hcm["route_config"]["virtual_hosts"][0]["routes"]
                     if r["match"].get("path") == "/v1/completions")
        route["typed_per_filter_config"] = {"envoy.filters.http.ext_proc": {"@type": PER_ROUTE, "overrides": {
            "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "BUFFERED",
                                "response_trailer_mode": "SEND"}}}}
        return cfg


async def test_a_route_override_without_request_trailers_lets_a_bodiless_http2_request_through(tmp_path,
                                                                                               upstream):
    """What section 2 measured for the filter, on one route: check said nothing about the override."""
    with TrailerlessOverrideStack(tmp_path / "stack", {"vllm_llama70b": [upstream], "vllm_llama8b": [upstream]},
                                  policy_path=policy_file(tmp_path)) as s:
        async with aiohttp.ClientSession() as http:
            for path in ("/v1/chat/completions", "/v1/completions"):
                await upstream_reset(http, upstream)
                await asyncio.to_thread(trailers_without_body, s.listen_port, path)
                seen = await (await http.get(f"http://{upstream[0]}:{upstream[1]}/test/seen")).json()
                # the filter's own mode refuses it (400, empty body); the overridden route sends it on undecided
                assert [x["ticket"] for x in seen if x["path"] == path] == \
                    ([] if path == "/v1/chat/completions" else [False]), seen
        errors = lint(s.envoy_config(), {"vllm_llama70b", "vllm_llama8b"}).errors
    assert any("(path /v1/completions) overrides the ext_proc's processing mode with request_trailer_mode unset"
               in e for e in errors), errors
