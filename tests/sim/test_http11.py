"""The simulator's HTTP/1.1 protocol, driven without sockets: request framing and what goes back on the wire."""

import asyncio

import pytest

from extproc.tools.sim.http11 import HttpServerProtocol, ProtocolError, _parse_chunked


class FakeTransport:
    def __init__(self):
        self.sent = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.sent += data

    def close(self) -> None:
        self.closed = True


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
