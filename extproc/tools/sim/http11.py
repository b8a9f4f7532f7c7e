"""A lean HTTP/1.1 server protocol for the simulator: keep-alive, Content-Length and chunked bodies, streams.

aiohttp costs tens of microseconds per write; a simulated replica writes one SSE event per token, so this
protocol does the little HTTP the simulator needs with one transport.write per response part.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024
HEX_DIGITS = b"0123456789abcdefABCDEF"
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 413: "Payload Too Large",
           500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass
class HttpRequest:
    """One parsed request; header names are lower-case."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes


class ProtocolError(Exception):
    """The peer sent something this server will not parse; answer 400 and close."""


class ResponseWriter:
    """Writes one response on a connection: a whole body, or a chunked stream of parts."""

    __slots__ = ("_conn", "_keep_alive", "_streaming", "done", "on_disconnect")

    def __init__(self, conn: HttpServerProtocol, keep_alive: bool):
        self._conn = conn
        self._keep_alive = keep_alive
        self._streaming = False
        self.done = False
        self.on_disconnect: Callable[[], None] | None = None  # set by the handler to abort its work

    @property
    def disconnected(self) -> bool:
        return self._conn.transport is None

    def _head(self, status: int, content_type: str | None, extra: str) -> str:
        # Keep-alive is HTTP/1.1's default: like vLLM's server, say `connection` only when closing.
        connection = "" if self._keep_alive else "connection: close\r\n"
        ctype = f"content-type: {content_type}\r\n" if content_type else ""
        return f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\n{ctype}{connection}{extra}"

    def send(self, status: int, body: bytes = b"", content_type: str | None = "application/json",
             headers: dict[str, str] | None = None) -> None:
        """Send a complete response with Content-Length."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = self._head(status, content_type if body else None, f"{extra}content-length: {len(body)}\r\n\r\n")
        self._conn.write(head.encode("latin-1") + body)
        self._finish()

    def start_stream(self, status: int = 200, content_type: str = "text/event-stream; charset=utf-8") -> None:
        """Send headers for a chunked response; follow with write_chunk() calls and end_stream()."""
        self._streaming = True
        self._conn.write(self._head(status, content_type, "transfer-encoding: chunked\r\n\r\n").encode("latin-1"))

    def write_chunk(self, data: bytes) -> None:
        """One HTTP chunk (one write), e.g. one or more SSE events."""
        if data:
            self._conn.write(b"%x\r\n%b\r\n" % (len(data), data))

    def end_stream(self, last: bytes = b"") -> None:
        """Optionally a final chunk, then the terminating zero-length chunk, in one write."""
        tail = b"%x\r\n%b\r\n0\r\n\r\n" % (len(last), last) if last else b"0\r\n\r\n"
        self._conn.write(tail)
        self._finish()

    def _finish(self) -> None:
        self.done = True
        self._conn.response_finished(self._keep_alive)


Handler = Callable[[HttpRequest, ResponseWriter], None]


class HttpServerProtocol(asyncio.Protocol):
    """One connection: parses requests one at a time (pipelined bytes wait) and hands them to the handler."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.current: ResponseWriter | None = None
        self._continued = False  # "100 Continue" sent for the request at the head of the buffer
        self._paused = False  # reading paused: the peer sent a whole request's worth while one was being answered

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        writer, self.current = self.current, None
        if writer is not None and not writer.done and writer.on_disconnect is not None:
            writer.on_disconnect()

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.current is None:
            self._process()
        elif len(self.buffer) > MAX_HEADER_BYTES + MAX_BODY_BYTES and not self._paused:
            # Bytes behind the request being answered wait here: stop reading (as uvicorn does) or they grow unbounded
            self._paused = True
            self.transport.pause_reading()

    def response_finished(self, keep_alive: bool) -> None:
        self.current = None
        if self.transport is None:
            return
        if not keep_alive:
            self.transport.close()
            return
        if self._paused:
            self._paused = False
            self.transport.resume_reading()
        if self.buffer:  # a pipelined request arrived while we were answering
            asyncio.get_running_loop().call_soon(self._process)

    def _process(self) -> None:
        if self.transport is None or self.current is not None:
            return
        try:
            request = self._parse()
        except ProtocolError as exc:
            self.current = ResponseWriter(self, keep_alive=False)
            body = ('{"error":{"message":"%s","type":"BadRequestError","param":null,"code":400}}' % exc).encode()
            self.current.send(400, body)
            return
        if request is None:
            return
        version_keep_alive = self._keep_alive(request)
        self.current = ResponseWriter(self, version_keep_alive)
        self.handler(request, self.current)

    def _keep_alive(self, request: HttpRequest) -> bool:
        connection = request.headers.get("connection", "").lower()
        if request.headers.get(":version") == "HTTP/1.0":
            return connection == "keep-alive"
        return connection != "close"

    def _parse(self) -> HttpRequest | None:
        """Take one complete request off the buffer, or None while it is incomplete."""
        buf = self.buffer
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEADER_BYTES:
                raise ProtocolError("request headers too large")
            return None
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ")
        except ValueError:
            raise ProtocolError("malformed request line") from None
        headers = {":version": version}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ProtocolError("malformed header line")
            headers[name.strip().lower()] = value.strip()
        start = end + 4
        if "chunked" in headers.get("transfer-encoding", "").lower():
            parsed = _parse_chunked(buf, start)
            if parsed is None:
                return self._await_body(headers)
            body, consumed = parsed
        else:
            field = headers.get("content-length", "0")
            # Digits only: int() takes "-5" (an empty body, then the headers' last bytes parsed as a second request)
            if not field.isascii() or not field.isdigit():
                raise ProtocolError("bad content-length")
            length = int(field)
            if length > MAX_BODY_BYTES:
                raise ProtocolError("request body too large")
            if len(buf) < start + length:
                return self._await_body(headers)
            body, consumed = bytes(buf[start:start + length]), start + length
        del buf[:consumed]
        self._continued = False
        path, _, query = target.partition("?")
        return HttpRequest(method, path, query, headers, body)

    def _await_body(self, headers: dict[str, str]) -> None:
        """The headers are in, the body is not: answer `Expect: 100-continue` (once), as uvicorn does for vLLM when
        the app reads the body; a client waiting for it (curl) would otherwise send the body only after a timeout."""
        if (not self._continued and headers.get("expect", "").lower() == "100-continue"
                and headers[":version"] == "HTTP/1.1"):
            self._continued = True
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None


def _parse_chunked(buf: bytearray, pos: int) -> tuple[bytes, int] | None:
    """Decode a chunked body starting at pos: (body, end offset), or None while incomplete."""
    parts = []
    size_total = 0
    while True:
        line_end = buf.find(b"\r\n", pos)
        if line_end < 0:
            return None
        field = bytes(buf[pos:line_end]).split(b";")[0].rstrip(b" \t")
        # Hex digits only: int() also takes a sign, 0x and underscores, and a negative size moved pos backwards
        # (-6 back to this very line: the loop never ended).
        if not field or field.strip(HEX_DIGITS):
            raise ProtocolError("bad chunk size")
        size = int(field, 16)
        size_total += size
        if size_total > MAX_BODY_BYTES:
            raise ProtocolError("request body too large")
        pos = line_end + 2
        if size == 0:
            trailer_end = buf.find(b"\r\n", pos)  # skip (empty) trailers up to the blank line
            while trailer_end > pos:
                pos = trailer_end + 2
                trailer_end = buf.find(b"\r\n", pos)
            if trailer_end < 0:
                return None
            return b"".join(parts), trailer_end + 2
        if len(buf) < pos + size + 2:
            return None
        if buf[pos + size:pos + size + 2] != b"\r\n":  # a wrong size: the bytes past it would be dropped unread
            raise ProtocolError("bad chunk")
        parts.append(bytes(buf[pos:pos + size]))
        pos += size + 2
