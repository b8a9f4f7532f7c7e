"""HTTP helpers for integration tests: OpenAI requests through Envoy, and reading the ext_proc's state."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import until


def chat(max_tokens: int = 4, stream: bool = False, model: str = "llama-70b", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
            "stream": stream, **extra}


async def post(session: aiohttp.ClientSession, url: str, body, headers: dict | None = None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(f"{url}/v1/chat/completions", data=data,
                            headers={"content-type": "application/json", **(headers or {})}) as r:
        return r.status, r.headers, await r.read()


async def healthz(session: aiohttp.ClientSession, metrics_url: str) -> dict:
    async with session.get(f"{metrics_url}/healthz") as r:
        return await r.json()


async def metrics(session: aiohttp.ClientSession, metrics_url: str) -> dict[tuple, float]:
    """All samples as {(name, frozenset(labels.items())): value}."""
    async with session.get(f"{metrics_url}/metrics") as r:
        text = await r.text()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sample(ms: dict, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in ms.items() if n == name and want <= ls)


async def sample_once(session, metrics_url: str, name: str, expected: float, timeout: float = 5.0,
                      **labels) -> float:
    """The sample once it equals `expected`, or the last one read at `timeout`: how a request ended reaches the
    metrics a moment after its response (Envoy's access log is batched), so tests poll instead of sleeping."""
    async def read() -> float:
        return sample(await metrics(session, metrics_url), name, **labels)

    return await until(read, timeout, holds=lambda value: value == expected)


async def wait_idle(session, metrics_url: str, timeout: float = 2.0) -> dict:
    """Poll until no class has requests in flight (its own or degraded) or queued; return the last snapshot. (A
    client has its answer a moment before Envoy ends the ext_proc's stream, which frees the slot.)"""
    async def classes() -> dict:
        return (await healthz(session, metrics_url))["classes"]

    return await until(classes, timeout, interval=0.02,
                       holds=lambda snap: all(c["inflight"] == 0 and c["queue"] == 0 and
                                              c.get("degraded_inflight", 0) == 0 for c in snap.values()))


async def upstream_stats(session, upstream: tuple[str, int]) -> dict:
    async with session.get(f"http://{upstream[0]}:{upstream[1]}/test/stats") as r:
        return await r.json()


async def upstream_reset(session, upstream: tuple[str, int]) -> None:
    async with session.post(f"http://{upstream[0]}:{upstream[1]}/test/reset") as r:
        await r.read()


async def equals(awaitable, value) -> bool:
    """For until(): `until(lambda: equals(read(), 5))`."""
    return await awaitable == value


async def reloads(session, metrics_url: str, result: str) -> float:
    """extproc_config_reload_total for one result (ok / invalid / ...)."""
    return sample(await metrics(session, metrics_url), "extproc_config_reload_total", result=result)


async def raw_request(port: int, headers: list[tuple[bytes, bytes]], body: bytes, method: bytes = b"POST",
                      path: bytes = b"/v1/chat/completions") -> tuple[int, dict, bytes]:
    """One HTTP/1.1 request with exactly these header bytes and this path, unnormalised (duplicates and
    non-UTF-8 allowed)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = [method + b" " + path + b" HTTP/1.1", b"host: test", b"connection: close",
            b"content-length: " + str(len(body)).encode()] + [k + b": " + v for k, v in headers]
    writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
    data = b""
    try:  # Envoy may answer (413) and close before it has read the whole body
        await writer.drain()
        async with asyncio.timeout(10):
            while (chunk := await reader.read(65536)) and not _complete(data := data + chunk):
                pass
    except ConnectionResetError:
        pass
    writer.close()
    status, hs, rest = _parse_response(data)
    return status, hs, rest


def _parse_response(data: bytes) -> tuple[int, dict, bytes]:
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    hs = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        hs[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    return int(lines[0].split()[1]), hs, rest


def _complete(data: bytes) -> bool:
    """A whole response with a content-length is in: stop reading (Envoy's local replies hold the connection
    open for a second after `connection: close` before it closes it)."""
    if b"\r\n\r\n" not in data:
        return False
    _, hs, rest = _parse_response(data)
    length = hs.get("content-length")
    return length is not None and len(rest) >= int(length)
