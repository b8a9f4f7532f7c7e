"""A hostile or sloppy HTTP/1.1 client, raw bytes on a socket, through real Envoy: framing (chunked, trailers,
100-continue, lengths that lie), pipelining, compressed bodies. Every answer is an OpenAI-style error or the
replica's, nothing reaches the replica unadmitted, and no slot stays held. HTTP/2 is test_http2_envoy.py's."""

from __future__ import annotations

import asyncio
import gzip
import json

import aiohttp

from tests.conftest import policy_file
from tests.integration.helpers import chat, healthz, metrics, sample, upstream_reset, wait_idle

BODY = json.dumps(chat()).encode()


def request(body: bytes = BODY, headers: bytes = b"content-type: application/json\r\n", length: bool = True) -> bytes:
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
            data = request(gzip.compress(BODY), b"content-encoding: %s\r\n" % encoding)
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
