"""A replica that answers oddly but plausibly: raw HTTP/1.1 on loopback, so it can send what aiohttp would not (a
Content-Length longer than the body, a body delimited by the connection's close, a stream without its last chunk).

The request's `x-odd` header picks the answer (Envoy passes it on):

- `ok`, `slow:<s>`: a whole answer with `usage` (after `s` seconds);
- `error200`: status 200 whose JSON is an error object; `nousage`: an answer without `usage`; `truncjson`: JSON cut
  short (its Content-Length agrees); `shortbody`: a Content-Length 100 bytes longer than what is sent before the
  close; `close`: no Content-Length and no chunking, the body ends with the connection (HTTP/1.0 style);
- `status:<code>[:<retry-after>]`: the replica's own error, vLLM's shape;
- `sse`: a stream of three chunks, its usage chunk if asked, `[DONE]`; `sse_nodone`: the same without `[DONE]`;
  `sse_error:<tokens>`: `tokens` chunks, then vLLM's in-stream error event and `[DONE]` (its engine failed mid-
  answer); `sse_stall:<s>`: the headers, then `s` seconds of silence, then the stream.
"""

from __future__ import annotations

import asyncio
import json

USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
ANSWER = {"id": "cmpl-odd", "object": "chat.completion", "model": "llama-70b",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "x x x"}, "finish_reason": "stop"}]}
CHUNK = {"id": "cmpl-odd", "object": "chat.completion.chunk", "model": "llama-70b",
         "choices": [{"index": 0, "delta": {"content": "x "}, "finish_reason": None}]}
REASONS = {200: "OK", 400: "Bad Request", 429: "Too Many Requests", 500: "Internal Server Error",
           502: "Bad Gateway", 503: "Service Unavailable"}


def error_doc(status: int) -> dict:
    return {"error": {"message": "the engine failed", "type": "InternalServerError", "param": None, "code": status}}


def compact(doc) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()  # as vLLM's pydantic models write JSON


def head(status: int, headers: dict) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS[status]}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def json_answer(status: int, raw: bytes, extra: dict | None = None) -> bytes:
    return head(status, {"content-type": "application/json", "content-length": len(raw), **(extra or {})}) + raw


def event(data: bytes) -> bytes:
    """One SSE event as one HTTP/1.1 chunk."""
    payload = b"data: " + data + b"\n\n"
    return f"{len(payload):x}\r\n".encode() + payload + b"\r\n"


async def read_request(reader: asyncio.StreamReader) -> tuple[str, dict, bytes] | None:
    """Path, headers (lower-cased) and body of the next request on the connection; None once it is closed."""
    line = await reader.readline()
    if not line:
        return None
    headers = {}
    while (raw := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = raw.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = b""
    if headers.get("transfer-encoding") == "chunked":
        while size := int((await reader.readline()).split(b";")[0], 16):
            body += await reader.readexactly(size)
            await reader.readline()
        await reader.readline()
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return line.decode("latin-1").split()[1], headers, body


class OddReplica:
    """Serves Envoy's health checks and answers every generation as its `x-odd` header says."""

    def __init__(self) -> None:
        self.answered: list[str] = []  # the x-odd of every generation request received
        self.server: asyncio.Server | None = None
        self.connections: set[asyncio.StreamWriter] = set()

    @property
    def port(self) -> int:
        return self.server.sockets[0].getsockname()[1]

    async def __aenter__(self) -> "OddReplica":
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        """Closed with its connections, each of whose tasks then ends on its own (left to the loop's shutdown, a
        task waiting to read is cancelled and logged as an error)."""
        self.server.close()
        for writer in list(self.connections):
            writer.transport.abort()
        while self.connections:
            await asyncio.sleep(0.01)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections.add(writer)
        try:
            while (request := await read_request(reader)) is not None:
                path, headers, body = request
                if path == "/health":
                    writer.write(json_answer(200, b"{}"))
                    keep = True
                else:
                    self.answered.append(headers.get("x-odd", "ok"))
                    keep = await self.answer(headers.get("x-odd", "ok"), json.loads(body), writer)
                await writer.drain()
                if not keep:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # Envoy closed its end (a client that left)
        finally:
            writer.close()
            self.connections.discard(writer)

    async def answer(self, odd: str, body: dict, w: asyncio.StreamWriter) -> bool:
        """Write the answer `odd` names; False when the connection must close after it."""
        kind, _, arg = odd.partition(":")
        whole = compact({**ANSWER, "usage": USAGE})
        if kind == "slow":
            await asyncio.sleep(float(arg))
        if kind in ("ok", "slow"):
            w.write(json_answer(200, whole))
        elif kind == "error200":
            w.write(json_answer(200, compact(error_doc(500))))
        elif kind == "nousage":
            w.write(json_answer(200, compact(ANSWER)))
        elif kind == "truncjson":
            w.write(json_answer(200, whole[:40]))
        elif kind == "shortbody":
            w.write(head(200, {"content-type": "application/json", "content-length": len(whole) + 100}) + whole)
            return False
        elif kind == "close":
            w.write(head(200, {"content-type": "application/json", "connection": "close"}) + whole)
            return False
        elif kind == "status":
            code, _, retry = arg.partition(":")
            w.write(json_answer(int(code), compact(error_doc(int(code))), {"retry-after": retry} if retry else None))
        else:
            await self.stream(kind, arg, body, w)
        return True

    @staticmethod
    async def stream(kind: str, arg: str, body: dict, w: asyncio.StreamWriter) -> None:
        w.write(head(200, {"content-type": "text/event-stream; charset=utf-8", "transfer-encoding": "chunked"}))
        await w.drain()
        if kind == "sse_stall":
            await asyncio.sleep(float(arg))
        for _ in range(int(arg) if kind == "sse_error" else 3):
            w.write(event(compact(CHUNK)))
        if kind == "sse_error":
            w.write(event(compact(error_doc(500))))  # vLLM: the error as an event, then [DONE]; no usage
        elif (body.get("stream_options") or {}).get("include_usage"):
            w.write(event(compact({**CHUNK, "choices": [], "usage": USAGE})))
        if kind != "sse_nodone":
            w.write(event(b"[DONE]"))
        w.write(b"0\r\n\r\n")
