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

from tests.conftest import policy_file, until
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


# --- a client that ignores the limits Envoy announces (raw frames: nghttp and h2load keep to them) ---

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, GOAWAY, CONTINUATION = 0x0, 0x1, 0x3, 0x4, 0x7, 0x9
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal field, not indexed, no Huffman (names and values under 127 bytes)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


REQUEST_HEAD = b"".join(literal(k, v) for k, v in (
    (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/v1/chat/completions"), (b":authority", b"test"),
    (b"content-type", b"application/json")))


async def read_frames(reader: asyncio.StreamReader, seconds: float, stop=lambda kind, payload: False) -> list:
    """(type, payload) of the frames Envoy sends, up to one that `stop`s, for at most `seconds` or until it closes
    the connection."""
    frames = []
    try:
        async with asyncio.timeout(seconds):
            while True:
                head = await reader.readexactly(9)
                frames.append((head[3], await reader.readexactly(int.from_bytes(head[:3], "big"))))
                if stop(*frames[-1]):
                    break
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        pass
    return frames


async def envoy_stat(http: aiohttp.ClientSession, admin_url: str, name: str) -> int:
    async with http.get(f"{admin_url}/stats", params={"filter": f"^{re.escape(name)}$"}) as r:
        return int((await r.text()).split(":")[1])


async def test_one_connection_holds_at_most_100_streams_undecided(make_stack, tmp_path):
    """Before: Envoy's default of 1,024 concurrent streams per HTTP/2 connection. A stream whose body never comes
    holds an ext_proc stream for request_timeout (120 s): measured 22 KiB in the ext_proc and 30 KiB in Envoy each,
    so 98 connections fill the ext_proc cluster's 100,000-request circuit breaker, past which Envoy skips the
    ext_proc and failure_mode_allow sends every request upstream unadmitted (seen with the breaker lowered to 40).
    HTTP/1.1 cannot get there under the 50,000-connection cap. Now Envoy announces 100 (its edge guidance), and a
    client that opens more anyway loses the connection, and with it every stream it held."""
    # No sampled answer-time log: its access-log stream to the same cluster would count among the streams held.
    s = make_stack(policy_file(tmp_path), answer_sample_percent=0)
    reader, writer = await asyncio.open_connection("127.0.0.1", s.listen_port)
    async with aiohttp.ClientSession() as http:
        async def held() -> int:
            return await envoy_stat(http, s.admin_url, "cluster.extproc.upstream_rq_active")

        try:
            writer.write(PREFACE + frame(SETTINGS, 0, 0))
            (kind, settings), = (await read_frames(reader, 5.0, lambda kind, p: kind == SETTINGS and p))[-1:]
            assert kind == SETTINGS, kind
            announced = {int.from_bytes(settings[i:i + 2], "big"): int.from_bytes(settings[i + 2:i + 6], "big")
                         for i in range(0, len(settings), 6)}
            assert announced.get(0x3) == 100, announced  # SETTINGS_MAX_CONCURRENT_STREAMS
            # Acknowledged, so the limit applies; then 100 requests that send their headers and never a body.
            writer.write(frame(SETTINGS, ACK, 0))
            writer.write(b"".join(frame(HEADERS, END_HEADERS, 2 * i + 1, REQUEST_HEAD) for i in range(100)))
            await writer.drain()
            assert await until(held, holds=lambda n: n == 100) == 100
            writer.write(frame(HEADERS, END_HEADERS, 201, REQUEST_HEAD))  # one more
            await writer.drain()
            await read_frames(reader, 5.0)  # until Envoy closes the connection (a second's delayed close)
            assert reader.at_eof()
            assert await envoy_stat(http, s.admin_url, "http.openai.downstream_cx_protocol_error") == 1
            assert await until(held, holds=lambda n: n == 0) == 0
        finally:
            writer.close()


async def test_held_bodies_are_refused_past_the_bound_not_let_through_unadmitted(make_stack, upstream, tmp_path):
    """100 streams per connection still let ~1,000 connections fill the extproc cluster's circuit breaker with
    streams whose body never comes, and past it Envoy skips the ext_proc (failure_mode_allow: unadmitted). The
    ext_proc now bounds the requests awaiting their body (--max-pending-bodies) and refuses new ones past it with
    503 bodies_pending, which ends their streams: the breaker stays out of reach, and admission fails closed."""
    s = make_stack(policy_file(tmp_path), extproc_args=["--max-pending-bodies", "5"], answer_sample_percent=0)
    reader, writer = await asyncio.open_connection("127.0.0.1", s.listen_port)
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        try:
            writer.write(PREFACE + frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0))
            writer.write(b"".join(frame(HEADERS, END_HEADERS, 2 * i + 1, REQUEST_HEAD) for i in range(5)))
            await writer.drain()
            held = lambda: envoy_stat(http, s.admin_url, "cluster.extproc.upstream_rq_active")  # noqa: E731
            assert await until(held, holds=lambda n: n == 5) == 5
            headers = await nghttp(f"{s.url}/v1/chat/completions", json.dumps(chat()).encode(), tmp_path)
            assert (headers[":status"], headers.get("x-extproc-reason"), headers.get("retry-after")) == (
                "503", "bodies_pending", "1"), headers
            assert await seen_upstream(http, upstream) == []
        finally:
            writer.close()
        # The held streams gone, requests are admitted again.
        assert await until(held, holds=lambda n: n == 0) == 0
        headers = await nghttp(f"{s.url}/v1/chat/completions", json.dumps(chat()).encode(), tmp_path)
        assert (headers[":status"], headers.get("x-extproc-decision")) == ("200", "accept"), headers


async def test_a_malformed_stream_is_reset_alone_not_with_its_connection(make_stack, upstream, tmp_path):
    """Before: one stream whose `:path` does not start with "/" made Envoy drop the whole connection (no GOAWAY):
    the two good requests beside it lost their answers, the first after the replica had run it. Now that stream
    alone is reset (PROTOCOL_ERROR) and the others are answered. Found by test_edge_generated.py."""
    s = make_stack(policy_file(tmp_path))
    body = json.dumps(chat()).encode()

    def request(stream: int, path: bytes) -> bytes:
        head = b"".join(literal(k, v) for k, v in ((b":method", b"POST"), (b":scheme", b"http"), (b":path", path),
                                                   (b":authority", b"test"), (b"content-type", b"application/json"),
                                                   (b"x-test-delay-ms", b"300")))
        return frame(HEADERS, END_HEADERS, stream, head) + frame(DATA, END_STREAM, stream, body)

    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        reader, writer = await asyncio.open_connection("127.0.0.1", s.listen_port)
        ended: dict[int, int] = {}  # stream: the frame type that ended it
        try:
            writer.write(PREFACE + frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0) + request(1, b"/v1/chat/completions")
                         + request(3, b"%5Cv1/chat/completions") + request(5, b"/v1/chat/completions"))

            async with asyncio.timeout(5):
                while len(ended) < 3:  # Envoy's reset of the connection raises here, and the test fails
                    head = await reader.readexactly(9)
                    kind, flags, stream = head[3], head[4], int.from_bytes(head[5:9], "big")
                    await reader.readexactly(int.from_bytes(head[:3], "big"))
                    if kind == RST_STREAM or (kind in (HEADERS, DATA) and flags & END_STREAM):
                        ended[stream] = kind
        finally:
            writer.close()
        assert ended == {1: DATA, 3: RST_STREAM, 5: DATA}, ended
        assert [r["ticket"] for r in await seen_upstream(http, upstream)] == [True, True]
        await wait_idle(http, s.metrics_url)
