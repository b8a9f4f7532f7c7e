"""The simulator's HTTP/1.1 protocol, driven without sockets: request framing and what goes back on the wire."""

import asyncio

import pytest

from extproc.tools.sim.http11 import HttpServerProtocol, ProtocolError, _parse_chunked


class FakeTransport:
    def __init__(self):
        self.sent = bytearray()
        self.closed = False
        self.paused = False

    def write(self, data: bytes) -> None:
        self.sent += data

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


def connection(answer=None):
    """A protocol on a fake transport whose handler answers each request with its body (or `answer`)."""
    seen = []

    def handler(request, writer):
        seen.append(request)
        writer.send(200, answer if answer is not None else request.body)

    protocol = HttpServerProtocol(handler)
    transport = FakeTransport()
    protocol.connection_made(transport)
    return protocol, transport, seen


@pytest.mark.timeout(5)
@pytest.mark.parametrize("size,data", [(b"-6", b"abc"), (b"-1", b"abc"), (b"+3", b"abc"), (b"0x3", b"abc"),
                                       (b" 3", b"abc"), (b"1_0", b"0123456789abcdef")])
def test_a_chunk_size_that_is_not_hex_digits_is_refused(size, data):
    # Python's int() takes signs, 0x and underscores: "-6" sent the parser back to where it started, forever (one
    # request hung the replica's event loop), the others framed a body no HTTP/1.1 peer would.
    with pytest.raises(ProtocolError):
        _parse_chunked(bytearray(size + b"\r\n" + data + b"\r\n0\r\n\r\n"), 0)


def test_hex_chunk_sizes_and_extensions_still_parse():
    assert _parse_chunked(bytearray(b"A;name=v\r\n0123456789\r\n3\r\nabc\r\n0\r\n\r\n"), 0) == (b"0123456789abc", 35)


@pytest.mark.parametrize("length", [b"-5", b"+2", b"1_0", b" ", b"2, 2"])
async def test_a_content_length_that_is_not_digits_is_refused_with_one_response(length):
    # "-5" took the body as empty, handed the request on, then cut 5 bytes short of the headers' end: the leftover
    # parsed as a second request, so one request got two responses.
    protocol, transport, seen = connection()
    protocol.data_received(b"POST /v1/completions HTTP/1.1\r\ncontent-length: " + length + b"\r\n\r\nab")
    await asyncio.sleep(0)  # a pipelined request would be taken on the loop's next turn
    assert seen == []
    assert transport.sent.count(b"HTTP/1.1 ") == 1 and transport.sent.startswith(b"HTTP/1.1 400 ")
    assert transport.closed


async def test_pipelined_requests_with_content_lengths_are_answered_in_order():
    protocol, transport, seen = connection()
    protocol.data_received(b"POST /a HTTP/1.1\r\ncontent-length: 3\r\n\r\nonePOST /b HTTP/1.1\r\ncontent-length: 0"
                           b"\r\n\r\nGET /c HTTP/1.1\r\n\r\n")
    for _ in range(3):
        await asyncio.sleep(0)
    assert [(r.path, r.body) for r in seen] == [("/a", b"one"), ("/b", b""), ("/c", b"")]
    assert transport.sent.count(b"HTTP/1.1 200 OK") == 3 and not transport.closed


@pytest.mark.parametrize("framing", [b"content-length: 5", b"transfer-encoding: chunked"])
def test_expect_100_continue_is_answered_before_the_body_once(framing):
    # Like uvicorn under vLLM: without the interim answer, curl (which sends Expect for large bodies) waits 1 s
    # before sending the body of every request.
    protocol, transport, seen = connection(answer=b"{}")
    protocol.data_received(b"POST /v1/completions HTTP/1.1\r\nExpect: 100-continue\r\n" + framing + b"\r\n\r\n")
    assert transport.sent == b"HTTP/1.1 100 Continue\r\n\r\n" and seen == []
    protocol.data_received(b"5\r\nhel" if b"chunked" in framing else b"hel")
    assert transport.sent == b"HTTP/1.1 100 Continue\r\n\r\n"  # once per request
    protocol.data_received(b"lo\r\n0\r\n\r\n" if b"chunked" in framing else b"lo")
    assert [r.body for r in seen] == [b"hello"]
    assert transport.sent.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")


def test_no_100_continue_when_the_body_came_with_the_headers():
    protocol, transport, seen = connection(answer=b"{}")
    protocol.data_received(b"POST /v1/completions HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\nhi")
    assert [r.body for r in seen] == [b"hi"] and transport.sent.startswith(b"HTTP/1.1 200 OK\r\n")


async def test_bytes_sent_while_a_response_is_under_way_are_not_buffered_without_bound():
    # While a request is being answered, what the peer sends next waits in the buffer: it grew with whatever came
    # (a client streaming garbage behind a long answer filled the memory). Like uvicorn, stop reading, resume after.
    held = []
    protocol = HttpServerProtocol(lambda request, writer: held.append(writer))
    transport = FakeTransport()
    protocol.connection_made(transport)
    protocol.data_received(b"GET /long HTTP/1.1\r\n\r\n")
    assert len(held) == 1
    for _ in range(20):
        protocol.data_received(b"x" * (1024 * 1024))
    assert transport.paused
    held[0].send(200, b"{}")
    assert not transport.paused


def test_chunk_data_not_followed_by_crlf_is_refused():
    # The two bytes after a chunk's data were skipped unread: "3" before "abcXY" framed "abc" and dropped "XY".
    with pytest.raises(ProtocolError):
        _parse_chunked(bytearray(b"3\r\nabcXY0\r\n\r\n"), 0)
