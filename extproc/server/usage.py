"""Reading a response's token usage: for cost learning (a sample) or a tenant's tokens-per-minute refund."""

from __future__ import annotations

import json
import re

import orjson

from ..policy.outcomes import reads_answer
from .openai import RequestBody, wants_stream_usage

# A chat delta or completion choice with at least one character of text (the role chunk's content is ""), a
# reasoning model's thinking (vLLM's delta.reasoning, reasoning_content before it: its first tokens come there, the
# answer's maybe minutes later), a tool call's arguments (a stream that only calls a tool has no content; not its
# "name": a Responses stream's first event echoes the request's tools), or a Responses API delta event (a chat
# chunk's delta is an object, never a string). Compact as vLLM writes it, or with spaces as another server may.
FIRST_TOKEN = re.compile(rb'"(?:content|text|delta|reasoning|reasoning_content|arguments)"\s*:\s*"[^"]')


class UsageReader:
    """Per stream whose usage is read: why, and how far the response has been read."""

    __slots__ = ("learn", "responses", "sse", "strip", "piecewise", "buffered", "first_token_seen", "partial",
                 "passed")

    def __init__(self, learn: bool) -> None:
        self.learn = learn               # a learning sample; otherwise read (if not streamed) for the refund only
        self.responses = False           # a Responses API answer: its stream's last event carries the usage
        self.sse = False                 # the response is an event stream
        self.strip = False               # ... carrying a usage chunk the client did not ask for
        self.piecewise = False           # a non-streamed body read as it comes (too large for one message)
        self.buffered = b""              # a non-streamed body until its end; read piecewise, only its last bytes
        self.first_token_seen = False
        self.partial = b""               # a stream's last event, held back until its end (blank line) arrives
        self.passed = b""                # the end of a Responses event passed on unfinished, its usage read there

    def reads_usage(self, body: RequestBody) -> bool:
        """Whether this request's real usage will be read (its tokens-per-minute charge is then refunded)."""
        return reads_answer(self.learn, body.stream)

    def ask_for_usage(self, body: RequestBody) -> None:
        """Once admitted. A learned chat or completions stream needs vLLM's usage chunk; the client gets it only if
        it asked. A Responses API stream always ends with its usage: nothing to ask for, nothing to strip."""
        self.responses = body.endpoint.kind == "responses"
        if not (self.learn and body.stream) or self.responses:
            return
        if not wants_stream_usage(body):
            opts = body.doc.get("stream_options")
            # continuous_usage_stats acts only with include_usage: a client that turned include_usage off saw no
            # usage, and must not start getting it in every chunk because we need the last one.
            body.doc["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True,
                                          "continuous_usage_stats": False}
            body.rewrite = True
            self.strip = True

    def answer_usage(self, piece: bytes, last: bool) -> dict | None:
        """A non-streamed answer's usage, once its `last` piece came. Buffered by Envoy it comes whole; read
        piecewise (over --max-body-bytes, or of unknown length) only its end is kept: vLLM writes the usage after
        the choices (or an embeddings batch's data), a few hundred bytes before the object's end."""
        if not self.piecewise:
            self.buffered += piece  # one message (BUFFERED): nothing copied again
            return usage_of(self.buffered) if last else None
        self.buffered = last_bytes(self.buffered, piece, USAGE_TAIL)
        return _usage_near_end(self.buffered) if last else None


# vLLM's event for a generation that failed after its stream began (its engine died, a detokenizer error): the error
# object as a `data:` line of its own, then `[DONE]`, under the 200 already sent. Generated text cannot start a line
# of an event (it is inside a JSON string, its newlines escaped). Another server may write the object pretty-printed,
# its data over several lines: `"error"` then starts the event's second data line.
STREAM_ERROR = re.compile(rb'(?:^|[\r\n])data: ?\{\s*(?:data: ?\s*)?"error"\s*:')


# A partial event held back longer than this is passed on as it is: a stream that never ends its events is not
# ours to buffer without bound.
MAX_PARTIAL = 64 << 10


# An SSE event ends at a blank line. vLLM ends its lines with LF; CRLF line ends (the SSE spec allows them, and
# servers built on sse-starlette write them) are read too. A lone CR, also allowed, is written by no server we know.
# As a pattern: the LF that ends the event's last line (a CR before it is that line's), then an empty line.
BLANK_LINE = re.compile(rb"\n\r?\n")


def events_end(chunk: bytes) -> int:
    """Where the last complete event of `chunk` ends (after its blank line); 0 if none ends in it."""
    lf = chunk.rfind(b"\n\n")
    crlf = chunk.rfind(b"\n\r\n", max(lf, 0))  # one before the last LF one cannot be the last
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


def split_events(chunk: bytes) -> list[bytes]:
    """The events of `chunk`, each with its own blank line (the last one maybe without)."""
    events, start = [], 0
    for blank in BLANK_LINE.finditer(chunk):
        events.append(chunk[start:blank.end()])
        start = blank.end()
    if start < len(chunk):
        events.append(chunk[start:])
    return events


def whole_events(r: UsageReader, chunk: bytes, last: bool) -> bytes:
    """The complete SSE events of `chunk` after what was held back; the trailing incomplete one is held back for the
    next chunk (a usage event split over two writes must still be found and stripped). A client cannot use an
    event before its blank line anyway, so holding it costs it nothing."""
    if r.partial:
        chunk, r.partial = r.partial + chunk, b""
    if last:
        return chunk
    end = events_end(chunk)
    if len(chunk) - end > MAX_PARTIAL:
        # Passed on, but for its last line end: it may be the first half of the event's blank line, and the event
        # after it (the usage event) is found only from its start.
        end = len(chunk.rstrip(b"\r\n"))
    r.partial = chunk[end:]
    return chunk[:end]


# Chat and completions name them prompt and completion tokens; the Responses API input and output tokens.
USAGE_NAMES = (("prompt_tokens", "completion_tokens"), ("input_tokens", "output_tokens"))


def token_counts(usage: object) -> tuple[int, int] | None:
    """(prompt, completion) tokens of a usage object, or None for one we do not understand."""
    if not isinstance(usage, dict):
        return None
    try:
        for prompt, completion in USAGE_NAMES:
            if prompt in usage:
                return int(usage[prompt]), int(usage[completion])
        if "total_tokens" in usage:  # vLLM's rerank: {"total_tokens": N}, all of it prefill
            return int(usage["total_tokens"]), 0
    except (KeyError, TypeError, ValueError, OverflowError):
        return None
    return None


def _json_object(raw: bytes) -> dict | None:
    """A JSON object, or None for anything else (not JSON, or another JSON value)."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def usage_of(raw: bytes) -> dict | None:
    doc = _json_object(raw)
    return doc.get("usage") if doc is not None else None


# The usage chunk's empty choices as vLLM writes them (`"choices":[]`) and as a server or proxy writing JSON with
# spaces does (`"choices": []`): missed, the chunk the gateway asked for reached a client that never did. Outside a
# string: a quote inside one is escaped.
EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


def may_hold_usage_chunk(chunk: bytes) -> bool:
    """Whether `chunk` may hold a usage chunk: a cheap test of every chunk (a token's has no usage key, so the
    pattern runs on few), the events themselves parsed only where it passes."""
    return b'"usage"' in chunk and EMPTY_CHOICES.search(chunk) is not None


def split_usage_event(chunk: bytes) -> tuple[bytes, dict | None]:
    """Separate the SSE usage event (empty `choices` with `usage`) from the rest of a chunk. It goes with its own
    blank line, not the one before it: a stream that ends on the event without one keeps the event before it
    terminated."""
    kept, usage = [], None
    for event in split_events(chunk):
        if may_hold_usage_chunk(event):
            usage = usage_of(event_data(event))
            if usage is not None:
                continue
        kept.append(event)
    return b"".join(kept), usage


# An SSE line ends with CRLF, LF or CR.
LINE_END = re.compile(rb"\r\n|\r|\n")


def event_data(event: bytes) -> bytes:
    """An SSE event's data as a client reads it: the values of its `data` fields, the one space after the colon
    dropped, joined by LF; comment lines and other fields (`event:`, `id:`, `retry:`) left out. vLLM writes one
    `data: ` line an event; another server may write `data:` without the space, or JSON over several lines.
    Called only on the few events that may be the usage chunk."""
    values = []
    for line in LINE_END.split(event):
        if line.startswith(b"data:"):
            values.append(line[6:] if line[5:6] == b" " else line[5:])
        elif line == b"data":  # a field name alone: an empty value
            values.append(b"")
    return b"\n".join(values)


# Kept of a Responses stream's last event passed on unfinished (longer than MAX_PARTIAL: an answer of some 16K
# tokens, or long instructions, which every event carrying the response echoes): vLLM writes the response's usage
# after its output, instructions and tools, a few hundred bytes before the event's end.
USAGE_TAIL = 4 << 10

# The start of a Responses stream's last event, the one whose response has its usage (vLLM names every event, in its
# first line; a server re-writing the stream may put comment, id or retry lines first, or no space after the colon).
LAST_EVENT = re.compile(rb"(?:(?::|id|retry)[^\r\n]*(?:\r\n|\r|\n))*"
                        rb"event: ?response\.(?:completed|incomplete|failed)(?:\r\n|\r|\n)")
_DECODER = json.JSONDecoder()


def responses_usage(r: UsageReader, chunk: bytes, last: bool) -> dict | None:
    """The usage in the events passed on in `chunk` (completed_usage); a last event too long to hold back, passed
    on in pieces, is read from the end kept of it once it ends."""
    if r.passed:
        blank = BLANK_LINE.search(chunk)
        if blank is None and not last:
            r.passed = last_bytes(r.passed, chunk, USAGE_TAIL)
            return None
        end = len(chunk) if blank is None else blank.start()
        tail, r.passed = r.passed + chunk[:end], b""
        return _usage_near_end(tail_data(tail)) or completed_usage(chunk[end:])
    usage = completed_usage(chunk)
    start = events_end(chunk)
    if chunk and not last and start < len(chunk):  # an event passed on unfinished
        if LAST_EVENT.match(chunk, start):
            r.passed = chunk[-USAGE_TAIL:]
    return usage


def completed_usage(chunk: bytes) -> dict | None:
    """The usage in a Responses API stream's last event (response.completed, .incomplete or .failed: the whole
    response). vLLM writes each event as `event: <type>` then `data: <compact json>`, another server maybe with
    spaces or over several data lines; the earlier events that carry the response have a null usage, so only the
    last one is parsed."""
    if b'"usage"' not in chunk or USAGE_KEY.search(chunk) is None:  # a delta event has no usage key: one test
        return None
    for event in split_events(chunk):
        if USAGE_KEY.search(event) is not None:
            usage = _response_usage(event_data(event))
            if usage is not None:
                return usage
    return None


def tail_data(tail: bytes) -> bytes:
    """The data of the end of one event (`tail`, from inside its data): its first line, partial, as it is, then the
    values of its data lines (an event with its data over several lines has a `data:` on each)."""
    first, *rest = LINE_END.split(tail, 1)
    return first + b"\n" + event_data(rest[0]) if rest else first


def last_bytes(kept: bytes, piece: bytes, size: int) -> bytes:
    """The last `size` bytes of `kept` then `piece`, copying at most `size` of them: a body read piece by piece
    keeps its end at a cost linear in its length, however small its pieces."""
    if len(piece) >= size:
        return piece[-size:]
    return kept[-(size - len(piece)):] + piece


# A usage key as a compact writer (vLLM's, Starlette's JSONResponse) or an indenting one writes it. Outside a string:
# a quote inside one is escaped.
USAGE_KEY = re.compile(rb'"usage"\s*:\s*(?=\{)')


def _usage_near_end(tail: bytes) -> dict | None:
    """The usage object in the end of a JSON document (a non-streamed answer, a Responses stream's last event):
    its last `"usage":{`, decoded to the object's close."""
    keys = list(USAGE_KEY.finditer(tail))
    if not keys:
        return None
    try:
        usage, _ = _DECODER.raw_decode(tail[keys[-1].end():].decode("utf-8", "replace"))
    except ValueError:
        return None
    return usage if isinstance(usage, dict) else None


def _response_usage(raw: bytes) -> dict | None:
    doc = _json_object(raw)
    response = doc.get("response") if doc is not None else None
    usage = response.get("usage") if isinstance(response, dict) else None
    return usage if isinstance(usage, dict) else None
