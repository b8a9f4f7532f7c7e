"""A hostile or sloppy HTTP/1.1 client, raw bytes on a socket, through real Envoy: framing (chunked, trailers,
100-continue, lengths that lie), pipelining, compressed bodies. Every answer is an OpenAI-style error or the
replica's, nothing reaches the replica unadmitted, and no slot stays held. HTTP/2 is test_http2_envoy.py's."""

from __future__ import annotations

import asyncio
import gzip
import json

import socket

import aiohttp

from extproc.tools.stack import Stack
from tests.conftest import policy_file, until
from tests.integration.helpers import chat, equals, healthz, metrics, post, sample, upstream_reset

BODY = json.dumps(chat()).encode()
JSON = b"content-type: application/json\r\n"  # as vLLM needs it: without, it answers 400 whatever the body


def request(body: bytes = BODY, headers: bytes = JSON, length: bool = True) -> bytes:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\n" + headers
    if length:
        head += b"content-length: %d\r\n" % len(body)
    return head + b"\r\n" + body


def chunked(body: bytes, size: int, extension: bytes = b"", trailers: bytes = b"") -> bytes:
    chunks = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x%s\r\n%s\r\n" % (len(c), extension, c) for c in chunks) + b"0\r\n" + trailers + b"\r\n"


async def exchange(port: int, data: bytes, responses: int = 1, timeout: float = 10) -> list[tuple[int, dict, bytes]]:
    """Write `data` at once on one connection; read up to `responses` answers (each with a content-length), fewer
    if Envoy closes the connection first."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    out = []
    try:
        async with asyncio.timeout(timeout):
            while len(out) < responses:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
                status = int(lines[0].split()[1])
                if status == 100:
                    continue
                out.append((status, headers, await reader.readexactly(int(headers["content-length"]))))
    except asyncio.IncompleteReadError:
        pass  # closed by Envoy
    writer.close()
    return out


async def seen_upstream(http, upstream) -> list[dict]:
    async with http.get(f"http://{upstream[0]}:{upstream[1]}/test/seen") as r:
        return [x for x in await r.json() if x["path"] != "/health"]  # Envoy's health checks


def openai_error(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


async def test_a_compressed_body_is_refused_as_the_clients_error(make_stack, tmp_path, upstream):
    """Before: the 415 was typed `api_error`, the type OpenAI gives its own failures."""
    s = make_stack(policy_file(tmp_path))
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        for encoding in (b"gzip", b"br", b"identity, deflate"):
            data = request(gzip.compress(BODY), JSON + b"content-encoding: %s\r\n" % encoding)
            [(status, headers, body)] = await exchange(s.listen_port, data)
            err = openai_error(body)
            assert (status, err["code"], err["type"]) == (415, "unsupported_content_encoding",
                                                          "invalid_request_error"), (encoding, err)
            assert "retry-after" not in headers
        assert await seen_upstream(http, upstream) == []


async def test_a_transfer_encoding_envoy_does_not_implement_is_not_worth_a_retry(make_stack, tmp_path, upstream):
    """Before: Envoy's 501 went through envoy.yaml's mapper for its transient 5xx: typed `server_error`, with
    Retry-After: 1 and the message "Not Implemented", inviting the client to send again a request that can never
    succeed."""
    s = make_stack(policy_file(tmp_path))
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        for encoding in (b"gzip, chunked", b"identity", b"chunked, chunked"):
            data = request(chunked(BODY, 16), b"transfer-encoding: %s\r\n" % encoding, length=False)
            [(status, headers, body)] = await exchange(s.listen_port, data)
            err = openai_error(body)
            assert (status, err["code"], err["type"]) == (501, "http1.invalid_transfer_encoding",
                                                          "invalid_request_error"), (encoding, err)
            assert "retry-after" not in headers and "Transfer-Encoding" in err["message"], (headers, err)
        assert await seen_upstream(http, upstream) == []



async def test_refusals_envoy_sends_with_an_empty_body_say_why(make_stack, tmp_path, upstream):
    """Before: an `Upgrade: websocket` (403 upgrade_failed) and an HTTP/1.1 request without Host (400
    missing_host_header) came back as `{"error": {"message": "", ...}}`: Envoy's own body is empty and the catch-all
    mapper copies it. Found by test_edge_generated.py."""
    s = make_stack(policy_file(tmp_path))
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        for case, data, status in [
                ("websocket upgrade", request(BODY, b"content-type: application/json\r\nconnection: upgrade\r\n"
                                                    b"upgrade: websocket\r\n"), 403),
                ("no Host", request().replace(b"host: test\r\n", b""), 400)]:
            [(got, headers, body)] = await exchange(s.listen_port, data)
            err = openai_error(body)
            assert (got, err["type"]) == (status, "invalid_request_error"), (case, got, err)
            assert "upgrade" in err["message"] and "Host" in err["message"], (case, err)
            assert headers["content-type"] == "application/json" and "retry-after" not in headers, (case, headers)
        assert await seen_upstream(http, upstream) == []


async def test_odd_framing_and_pipelining_are_admitted_like_any_request_and_leave_nothing_held(make_stack, tmp_path,
                                                                                              upstream):
    """What an HTTP/1.1 client may do with framing: each request that reaches the replica was admitted, its forged
    trailers go nowhere, a refusal in a pipeline leaves the requests behind it served or cut (never unadmitted),
    and a body that stops coming holds no slot once its client leaves."""
    s = make_stack(policy_file(tmp_path), extproc_args=["--max-pending-bodies", "2"])
    te = JSON + b"transfer-encoding: chunked\r\n"
    forged = b"x-priority: internal\r\nx-extproc-cluster: vllm_llama8b\r\n"
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        for case, data, statuses, read in [
                ("one-byte chunks", request(chunked(BODY, 1), te, length=False), [200], 1),
                ("chunk extensions", request(chunked(BODY, 7, b";ext=1;x"), te, length=False), [200], 1),
                ("trailers", request(chunked(BODY, 16, trailers=forged), te, length=False), [200], 1),
                ("100-continue", request(BODY, JSON + b"expect: 100-continue\r\n"), [200], 1),
                ("pipelined, a 415 at its headers in the middle",
                 request() + request(BODY, JSON + b"content-encoding: gzip\r\n") + request(), [200, 415, 200], 3),
                # Envoy drains an HTTP/1 connection after any 400 it sends, ours included: the third is not read.
                ("pipelined, a 400 in the middle", request() + request(b"{nope") + request(), [200, 400], 3),
                ("a length 5 bytes short, a request after it: the body is cut, 400 and closed",
                 request(BODY).replace(b"length: %d" % len(BODY), b"length: %d" % (len(BODY) - 5)) + request(),
                 [400], 3),
                ("a refused request whose body is a request", request(request(), JSON + b"content-encoding: br\r\n"),
                 [415], 1)]:
            got = await exchange(s.listen_port, data, responses=read, timeout=5)
            assert [g[0] for g in got] == statuses, (case, [(g[0], g[2][:120]) for g in got])
        seen = await seen_upstream(http, upstream)
        assert seen and all(r["ticket"] for r in seen), seen
        assert len(seen) == 7 and not any("x-priority" in r["headers"] for r in seen), seen

        # Bodies that never finish hold a pending-body place (2 here) until their clients leave.
        held = [await asyncio.open_connection("127.0.0.1", s.listen_port) for _ in range(2)]
        for _, writer in held:
            writer.write(request(BODY)[:-5])
            await writer.drain()
        await asyncio.sleep(0.5)
        [(status, headers, body)] = await exchange(s.listen_port, request())
        assert (status, openai_error(body)["code"], headers["retry-after"]) == (503, "bodies_pending", "1")
        for _, writer in held:
            writer.close()

        async def served() -> bool:
            return [g[0] for g in await exchange(s.listen_port, request())] == [200]
        assert await until(served, timeout=5)
        snap = await healthz(http, s.metrics_url)
        assert snap["stream_errors"] == 0
        assert await until(lambda: _idle(http, s.metrics_url), timeout=5)
        assert sample(await metrics(http, s.metrics_url), "extproc_stream_errors_total") == 0


async def _idle(http, metrics_url: str) -> bool:
    return all(c["inflight"] == 0 and c["queue"] == 0 for c in (await healthz(http, metrics_url))["classes"].values())


class QuickIdleStack(Stack):
    """envoy.yaml with stream_idle_timeout at 2 s instead of 300 s, so a test can wait for it."""

    def envoy_config(self) -> dict:
        cfg = super().envoy_config()
        cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
            "stream_idle_timeout"] = "2s"
        return cfg


async def test_an_answer_the_client_stops_reading_is_still_charged_to_its_tenant(tmp_path, upstream):
    """A streamed answer larger than Envoy's buffers (4 MiB), which the client does not read, holds its slot until
    stream_idle_timeout, and the access log reports that like a replica failing mid-answer (200, flag SI). Before:
    such a request was refunded in full, so a tokens-per-minute tenant that read most of each answer and then
    stopped got all of them for free (docs/reliability.md, known limits)."""
    tenants = [{"name": "acme", "api_keys": ["sk-acme-1"], "max_class": "interactive",
                "tokens_per_minute": 6000, "burst_s": 60}]
    policy = policy_file(tmp_path, tenants=tenants, learn_sample=0)
    key = {"authorization": "Bearer sk-acme-1"}
    with QuickIdleStack(tmp_path / "stack", {"vllm_llama70b": [upstream], "vllm_llama8b": [upstream]},
                        policy_path=policy) as s:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never read
        client.connect(("127.0.0.1", s.listen_port))
        client.sendall(request(json.dumps(chat(max_tokens=4000, stream=True)).encode(),
                               b"content-type: application/json\r\nauthorization: Bearer sk-acme-1\r\n"
                               b"x-test-tokens: 60000\r\n"))  # ~8 MB of SSE from the test upstream
        async with aiohttp.ClientSession() as http:
            async def inflight() -> int:
                return (await healthz(http, s.metrics_url))["classes"]["interactive"]["inflight"]
            assert await until(lambda: equals(inflight(), 1), timeout=5)
            assert await until(lambda: equals(inflight(), 0), timeout=10)  # Envoy's reset, ~2 s later
            assert await until(lambda: _reported(http, s.metrics_url), timeout=5)
            status, headers, _ = await post(http, s.url, chat(max_tokens=1), key)
        client.close()
    assert status == 200
    # 4,000 tokens charged for the stream (its expected output) stay charged; the refund gave back 6,000 - 10.
    assert int(headers["x-ratelimit-remaining-tokens"]) < 3000, headers


async def _reported(http, metrics_url: str) -> bool:
    ms = await metrics(http, metrics_url)
    return sample(ms, "extproc_request_duration_seconds_count", outcome="upstream_error") == 1
