"""Clients that speak HTTP/2 to the public listener (`codec_type: AUTO` takes cleartext HTTP/2 with prior
knowledge), through real Envoy: what HTTP/2 can say that HTTP/1.1 cannot must not get a request past admission.
The client is nghttp (Debian's nghttp2-client, which scripts/install-system-deps.sh installs with h2load)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil

import aiohttp
import pytest

from tests.conftest import policy_file
from tests.integration.helpers import chat, metrics, sample, upstream_reset, wait_idle

RECV_HEADER = re.compile(r"recv \(stream_id=\d+\) ([^:\s][^:]*|:status): (.*)$")


async def nghttp(url: str, body: bytes, tmp_path, *args: str) -> dict[str, str]:
    """One HTTP/2 POST of `body` (prior knowledge); the response headers nghttp printed, :status included."""
    if shutil.which("nghttp") is None:
        pytest.skip("nghttp is not installed: run scripts/install-system-deps.sh")
    data = tmp_path / "body"
    data.write_bytes(body)
    proc = await asyncio.create_subprocess_exec(
        "nghttp", "-v", "-H", "content-type: application/json", "-d", str(data), *args, url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 20)
    headers = {}
    for line in out.decode(errors="replace").splitlines():
        if m := RECV_HEADER.search(line):
            headers[m.group(1)] = m.group(2)
    assert ":status" in headers, out.decode(errors="replace")
    return headers


async def seen_upstream(http: aiohttp.ClientSession, upstream) -> list[dict]:
    async with http.get(f"http://{upstream[0]}:{upstream[1]}/test/seen") as r:
        return [s for s in await r.json() if s["path"] != "/health"]  # not Envoy's health checks


@pytest.mark.parametrize("learn_sample", [0.0, 1.0])  # 1.0: every request takes the learned processing mode
async def test_a_request_ended_by_trailers_without_a_body_is_refused_not_passed_unadmitted(
        make_stack, upstream, tmp_path, learn_sample):
    """Before: HEADERS then a trailers HEADERS frame, no DATA. Envoy sent the ext_proc the headers and no body
    message (request trailers were SKIP), the ext_proc had continued the headers waiting for the body, and the
    request went to the default pool undecided: the replica saw it without a ticket, and each one counted in
    extproc_unadmitted_requests_total (alert ExtprocRequestsUnadmitted) with the ext_proc up and healthy."""
    s = make_stack(policy_file(tmp_path, learn_sample=learn_sample))
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        headers = await nghttp(f"{s.url}/v1/chat/completions", b"", tmp_path, "--trailer", "x-checksum: 0")
        assert headers[":status"] == "400", headers
        assert (headers.get("x-extproc-decision"), headers.get("x-extproc-reason")) == ("invalid", "invalid_body")
        assert await seen_upstream(http, upstream) == []
        await asyncio.sleep(1.5)  # the unadmitted report is Envoy's access log, flushed every second
        assert sample(await metrics(http, s.metrics_url), "extproc_unadmitted_requests_total") == 0


async def test_a_body_followed_by_trailers_is_admitted_as_usual(make_stack, upstream, tmp_path):
    """The trailers Envoy now sends the ext_proc come after the body it decided on: they change nothing."""
    s = make_stack(policy_file(tmp_path))
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        headers = await nghttp(f"{s.url}/v1/chat/completions", json.dumps(chat()).encode(), tmp_path,
                               "--trailer", "x-checksum: 0")
        assert (headers[":status"], headers.get("x-extproc-decision")) == ("200", "accept"), headers
        assert [r["ticket"] for r in await seen_upstream(http, upstream)] == [True]
        snap = await wait_idle(http, s.metrics_url)
        assert all(c["inflight"] == 0 for c in snap.values()), snap
