"""Generated vLLM answers, cut into Envoy's response_body chunks anywhere, through the servicer's response path.

Each case is a request (chat, completions or Responses, streamed or not, n of 1 or 2, the client's
`stream_options` in every form that matters) admitted by `ExtProcServicer.Process`, then an answer a vLLM 0.32
replica would give to the body as the ext_proc forwarded it (its shapes from tests/fixtures/vllm: the role,
content, finish and usage chunks, `continuous_usage_stats`, `[DONE]`; the Responses API's typed events; non-streamed
JSON; 4xx/5xx error bodies), as vLLM writes them or in another form the SSE format allows (DIALECTS: a server
other than vLLM, or a proxy re-writing its stream), with faults: an error event mid-stream, a stream without `[DONE]` or cut mid-event,
very long events (long text, long instructions echoed), unicode and emoji text, a client that leaves. The answer is
cut at random byte offsets, preferring the awkward ones (inside a multi-byte character, inside `data: `, inside
`\\n\\n`, zero-length chunks, end_of_stream on an empty chunk or on the last data). Three servers: one reading
every answer (the learning sample), one reading a refunded tenant's non-streamed answers only, one whose degrade
turns streaming off (the JSON answer goes back as a stream).

A reference read of the same answer, written here without the server's code, says what must happen:
- what reaches the client is the replica's bytes, less the usage chunk the ext_proc asked for when the client did
  not (docs/envoy-integration.md, `response_body_mode`; usage.py `ask_for_usage`);
- every event is passed on by the chunk that completes it (a client waits for nothing it could use);
- the usage read is the final usage chunk's (or the JSON body's), none where the answer has none or is not read;
- the bytes held back never exceed usage.MAX_PARTIAL;
- the first token is reported once, when an event with text has come;
- a degraded stream gets its answer's choices, and the usage chunk only if it asked;
- the request's end is reported once, with the outcome its stream had; nothing raises.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path

import pytest

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc.aio import EOF

from extproc.policy.admission import AdmissionController
from extproc.policy.limits import Outcome
from extproc.server.servicer import ExtProcServicer
from extproc.server.stream import Stream
from extproc.server.usage import MAX_PARTIAL, USAGE_TAIL

from ..conftest import FakeClock, make_policy

HI = [{"role": "user", "content": "hi"}]  # a chat request is a list of messages: one will do

SEED = 45
CASES = 1000  # per server
MAX_BODY = 192 << 10  # --max-body-bytes: a larger JSON answer is read as it comes (a request body larger is refused)
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
Mode = processing_mode_pb2.ProcessingMode
KEY = "sk-acme"      # a tenant with a tokens-per-minute limit: its non-streamed answers are read for the refund


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def event_bodies(name: str) -> dict[str, dict]:
    """One recorded event body per kind (role, content, finish, usage) of a stream fixture."""
    return {e["kind"]: e["body"] for e in fixture(name)["events"] if "body" in e}


STREAM_EVENTS = {"chat": event_bodies("chat_stream_usage"), "completions": event_bodies("completions_stream_usage")}
CONTINUOUS_USAGE = event_bodies("chat_stream_continuous_usage")["content"]["usage"]
RESPONSES_EVENTS = {e["event"]: e["body"] for e in fixture("responses_stream")["events"]}
ANSWERS = {"chat": fixture("chat")["body"], "completions": fixture("completions")["body"],
           "responses": fixture("api")["responses"]["body"]}
ERRORS = [(r["status"], r["body"]) for r in fixture("errors").values() if r["status"] >= 400] + \
    [(503, fixture("overload")["rejected_chat"]["body"]),
     (500, {"error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError", "param": None,
                      "code": 500}})]
PATHS = {"chat": b"/v1/chat/completions", "completions": b"/v1/completions", "responses": b"/v1/responses"}

# Text a model may generate: multi-byte UTF-8, emoji sequences, JSON escapes, and strings that look like framing.
PIECES = ["Hello", " world", "é", "ß", "中文", "🙂", "👩‍💻", "🇫🇷", "\n", "\r\n", "\"", "\\", "data: ",
          "\"choices\":[]", "\"usage\":{}", "[DONE]", "\u2028", "\x00", " ", "tok"]


# --- the replica: what vLLM answers to the body it was sent ---

def compact(doc: dict) -> bytes:
    """A chunk as vLLM writes it (pydantic's model_dump_json: compact, non-ASCII as UTF-8)."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def text(rng: random.Random, long: bool = False) -> str:
    """Generated text; a long one makes an event about as long as the bytes the ext_proc may hold back."""
    if long:
        piece = rng.choice(PIECES[:8])
        return piece * int(MAX_PARTIAL * rng.uniform(0.5, 2.0) / len(piece.encode()))
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 4)))


def fill(template: dict, kind: str, model: str) -> dict:
    doc = json.loads(json.dumps(template))
    doc["id"] = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": "resp_"}[kind] + "9f3a"
    doc["created" if kind != "responses" else "created_at"] = 1764900000
    doc["model"] = model
    if "system_fingerprint" in doc:
        doc["system_fingerprint"] = "vllm-0.32.0-ab12"
    return doc


def vllm_usage_options(doc: dict) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) as vLLM reads the stream_options it was sent (the generator writes
    only true, false or absent; include_usage defaults to false, as vLLM 0.32's StreamOptions has it)."""
    opts = doc.get("stream_options")
    if not isinstance(opts, dict):
        return False, False
    include = opts.get("include_usage") is True
    return include, include and opts.get("continuous_usage_stats") is True


class Answer:
    """A replica's answer: status, content-type, the body's events (or the whole JSON body), and its usage."""

    def __init__(self, status: int, sse: bool, events: list[bytes], usage: tuple[int, int] | None,
                 usage_event: int | None = None, sized: bool = True, texts: frozenset[int] = frozenset()):
        self.status = status
        self.sse = sse
        self.events = events              # SSE: each event with its blank line; JSON: one element, the body
        self.usage = usage                # the final usage chunk's or the body's (prompt, completion) tokens
        self.usage_event = usage_event    # the index of the usage chunk among the events
        self.sized = sized                # a JSON answer sent with its content-length
        self.texts = texts                # the events that carry generated text (the first token)
        self.blank_line = b"\n\n"         # what ends each event

    def with_crlf(self) -> Answer:
        """The same answer from a server that ends its lines with CRLF (the SSE spec allows it; vLLM writes LF)."""
        self.events = [e.replace(b"\n", b"\r\n") for e in self.events]  # JSON has no raw LF: the framing's only
        self.blank_line = b"\r\n\r\n"
        return self

    def in_dialect(self, form: str) -> Answer:
        """The same answer from a server other than vLLM, or a proxy re-writing its stream, in another form the SSE
        format and JSON allow (DIALECTS)."""
        self.events = [in_dialect(event, form) for event in self.events]
        return self

    @property
    def raw(self) -> bytes:
        return b"".join(self.events)


DIALECTS = ["JSON with spaces", "no space after the field names", "a comment and an id first",
            "data over several lines"]


def in_dialect(event: bytes, form: str) -> bytes:
    """One event as vLLM writes it (`event: ` and `data: ` lines, compact JSON, a blank line) in another form."""
    lines = []
    for line in event.removesuffix(b"\n\n").split(b"\n"):
        name, _, value = line.partition(b": ")
        if name == b"data" and value != b"[DONE]":
            doc = json.loads(value)
            if form == "JSON with spaces":
                value = json.dumps(doc, ensure_ascii=False).encode()
            elif form == "data over several lines":
                *head, value = [part.encode() for part in json.dumps(doc, indent=1, ensure_ascii=False).split("\n")]
                lines += [b"data: " + part for part in head]
        lines.append(name + (b":" if form == "no space after the field names" else b": ") + value)
    if form == "a comment and an id first":
        lines[:0] = [b": keep-alive", b"id: 7"]
    return b"\n".join(lines) + b"\n\n"


def stream_answer(rng: random.Random, kind: str, doc: dict) -> Answer:
    include, continuous = vllm_usage_options(doc)
    n = doc.get("n", 1)
    templates = STREAM_EVENTS[kind]
    prompt = rng.randint(1, 3000)
    generated = 0
    chunks: list[dict] = []
    texts: set[int] = set()
    if kind == "chat":
        chunks += [fill(templates["role"], kind, doc["model"]) | {"choices": [
            {**templates["role"]["choices"][0], "index": i}]} for i in range(n)]
    steps = rng.randint(0, 12)
    long_at = rng.choice([steps, rng.randrange(steps + 1)]) if rng.random() < 0.1 else -1  # often right before usage
    for step in range(steps + 1):
        last = step == steps
        for i in range(n):
            part = templates["finish" if last else "content"]
            choice = json.loads(json.dumps(part["choices"][0]))
            choice["index"] = i
            value = text(rng, long=step == long_at and i == 0)
            if kind == "chat":
                choice["delta"]["content"] = value
            else:
                choice["text"] = value
            chunks.append(fill(part, kind, doc["model"]) | {"choices": [choice]})
            generated += 1
            if value:
                texts.add(len(chunks) - 1)
            if continuous:
                chunks[-1]["usage"] = {**CONTINUOUS_USAGE, "prompt_tokens": prompt, "completion_tokens": generated,
                                       "total_tokens": prompt + generated}
    events = [b"data: " + compact(c) + b"\n\n" for c in chunks]
    usage, usage_event = None, None
    failed = rng.random() < 0.1
    if failed:  # the engine failed mid-stream: vLLM writes its error as an event, then [DONE], and no usage chunk
        cut = rng.randrange(len(events) + 1)
        texts = {i for i in texts if i < cut}
        error = {"error": {"message": "EngineCore encountered an issue. 🙁", "type": "InternalServerError",
                           "param": None, "code": 500}}
        events = events[:cut] + [b"data: " + json.dumps(error).encode() + b"\n\n"]
    elif include:
        usage = (prompt, generated)
        body = fill(templates["usage"], kind, doc["model"])
        body["usage"] = {"prompt_tokens": usage[0], "total_tokens": sum(usage), "completion_tokens": usage[1]}
        usage_event = len(events)
        events.append(b"data: " + compact(body) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return Answer(200, True, events, usage, usage_event, texts=frozenset(texts))


def responses_stream_answer(rng: random.Random, doc: dict) -> Answer:
    """A Responses API stream as vLLM writes it: typed events (`event:` then `data:`), the request's instructions
    echoed in the response it carries, its usage in the last one (response.completed), no [DONE]."""
    deltas = [text(rng, long=rng.random() < 0.05) for _ in range(rng.randint(0, 8))]
    usage = (rng.randint(1, 3000), len(deltas))
    response = fill(ANSWERS["responses"], "responses", doc["model"]) | {"instructions": doc.get("instructions")}
    response["output"][0]["content"][0]["text"] = "".join(deltas)
    response["usage"] = {**response["usage"], "input_tokens": usage[0], "output_tokens": usage[1],
                         "total_tokens": sum(usage)}
    started = response | {"status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    bodies = [("response.created", {"response": started}), ("response.in_progress", {"response": started}),
              ("response.output_item.added", RESPONSES_EVENTS["response.output_item.added"]),
              ("response.content_part.added", RESPONSES_EVENTS["response.content_part.added"])]
    bodies += [("response.output_text.delta", RESPONSES_EVENTS["response.output_text.delta"] | {"delta": d})
               for d in deltas]
    bodies += [(kind, RESPONSES_EVENTS[kind]) for kind in
               ("response.output_text.done", "response.content_part.done", "response.output_item.done")]
    bodies.append(("response.completed", {"response": response}))
    # the deltas with text, the three events that repeat the whole text, the response that has it
    texts = {4 + i for i, d in enumerate(deltas) if d} | set(range(len(bodies) - 4, len(bodies) - 1))
    texts |= {len(bodies) - 1} if any(deltas) else set()
    events = [b"event: %s\ndata: %s\n\n" % (kind.encode(), compact({**body, "sequence_number": i, "type": kind}))
              for i, (kind, body) in enumerate(bodies)]
    return Answer(200, True, events, usage, usage_event=len(events) - 1, texts=frozenset(texts))


def json_answer(rng: random.Random, kind: str, doc: dict) -> Answer:
    if rng.random() < 0.3:
        status, body = rng.choice(ERRORS)
        return Answer(status, False, [json.dumps(body).encode()], None)
    answer = fill(ANSWERS[kind], kind, doc["model"])
    usage = (rng.randint(1, 3000), rng.randint(0, 4000))
    if kind == "responses":
        answer["output"][0]["content"][0]["text"] = text(rng, long=rng.random() < 0.05)
        answer["usage"] = {**answer["usage"], "input_tokens": usage[0], "output_tokens": usage[1],
                           "total_tokens": sum(usage)}
        return Answer(200, False, [compact(answer)], usage, sized=rng.random() < 0.9)
    choice = answer["choices"][0]
    answer["choices"] = []
    for i in range(doc.get("n", 1)):
        value = text(rng, long=rng.random() < 0.05)
        answer["choices"].append({**choice, "index": i} | (
            {"message": {**choice["message"], "content": value}} if kind == "chat" else {"text": value}))
    answer["usage"] = {**answer["usage"], "prompt_tokens": usage[0], "completion_tokens": usage[1],
                       "total_tokens": sum(usage)}
    return Answer(200, False, [compact(answer)], usage, sized=rng.random() < 0.9)


# --- the client's request ---

OPTIONS = [None, {"include_usage": True}, {"include_usage": False}, {}, {"continuous_usage_stats": True},
           {"include_usage": True, "continuous_usage_stats": True},
           {"include_usage": False, "continuous_usage_stats": True}]


def request(rng: random.Random) -> tuple[str, dict, bool]:
    """(kind, the client's body, whether it presents the refunded tenant's key)."""
    kind = rng.choice(["chat", "completions", "responses"])
    doc: dict = {"model": "llama", "max_tokens": 5000}
    if kind == "chat":
        doc["messages"] = [{"role": "user", "content": text(rng)}]
    elif kind == "completions":
        doc["prompt"] = text(rng) or "hi"
    else:
        doc = {"model": "llama", "input": text(rng) or "hi", "max_output_tokens": 5000}
        if rng.random() < 0.3:  # echoed in the response each of its stream's events carries
            doc["instructions"] = text(rng, long=rng.random() < 0.3)
    if kind != "responses" and rng.random() < 0.3:
        doc["n"] = 2
    if rng.random() < 0.7:
        doc["stream"] = True
        options = rng.choice(OPTIONS) if kind != "responses" else None
        if options is not None:
            doc["stream_options"] = options
    return kind, doc, rng.random() < 0.3


def client_asked_for_usage(doc: dict) -> bool:
    return doc.get("stream") is True and vllm_usage_options(doc)[0]


# --- Envoy: the answer cut into response_body messages ---

CONTINUATION_BYTE = re.compile(rb"[\x80-\xbf]")
INSIDE_PREFIX = re.compile(rb"(?<=a):|(?<=:) ")
BLANK_LINE = re.compile(rb"\r?\n\r?\n")
INSIDE_CRLF = re.compile(rb"(?<=\r)\n")


def awkward(rng: random.Random, raw: bytes, count: int, since: int = 0) -> set[int]:
    """Up to `count` offsets after `since` (each the first after a random place): inside a multi-byte character,
    inside `data: `, between a CR and its LF, before and inside an event's blank line."""
    found = set()
    for _ in range(count):
        pattern = rng.choice([CONTINUATION_BYTE, INSIDE_PREFIX, INSIDE_CRLF, BLANK_LINE])
        m = pattern.search(raw, rng.randrange(since, len(raw)))
        if m:
            found.add(rng.randrange(m.start(), m.end()) if pattern is BLANK_LINE else m.start())
    return found


def offsets(rng: random.Random, raw: bytes, most: int) -> set[int]:
    """Up to `most` offsets into `raw`, at random and at awkward places; often around the last events (the usage
    chunk) and inside the blank line after the longest event (what held it back may have been passed on)."""
    if len(raw) < 2:
        return set()
    found = {rng.randrange(1, len(raw)) for _ in range(rng.randint(0, most))}
    found |= awkward(rng, raw, rng.randint(0, most)) | awkward(rng, raw, rng.randint(0, 2), max(0, len(raw) - 2000))
    blank_lines = list(BLANK_LINE.finditer(raw))
    if blank_lines and rng.random() < 0.5:
        starts = [0] + [m.end() for m in blank_lines]
        longest = max(zip(blank_lines, starts), key=lambda pair: pair[0].start() - pair[1])[0]
        inside = range(longest.start(), longest.end())
        found |= set(rng.sample(inside, rng.randint(1, 2)))
    return found


def cut(rng: random.Random, raw: bytes) -> list[bytes]:
    edges = [0, *sorted(offsets(rng, raw, rng.choice([3, 12])) - {0, len(raw)}), len(raw)]
    parts = [raw[a:b] for a, b in zip(edges, edges[1:])]
    for _ in range(rng.randint(0, 2)):  # zero-length chunks
        parts.insert(rng.randrange(len(parts) + 1), b"")
    if rng.random() < 0.4 or not parts:  # end_of_stream on an empty chunk of its own
        parts.append(b"")
    return parts


def stop_short(rng: random.Random, raw: bytes) -> bytes:
    """The answer as far as a replica that stopped sent it: anywhere, often at or inside the blank line of one of
    its last events (the usage chunk's: its JSON whole, its end not)."""
    ends = [i for m in BLANK_LINE.finditer(raw, max(0, len(raw) - 1000)) for i in range(m.start(), m.end())]
    if ends and rng.random() < 0.5:
        return raw[:rng.choice(ends)]
    return raw[:rng.choice(sorted(offsets(rng, raw, 3) | {len(raw)}))]


def header_map(**headers: bytes) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in headers.items()])


def request_messages(kind: str, doc: dict, keyed: bool) -> list[pb.ProcessingRequest]:
    headers = {":method": b"POST", ":path": PATHS[kind], "content-type": b"application/json"}
    if keyed:
        headers["authorization"] = b"Bearer " + KEY.encode()
    return [pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map(**headers))),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=compact(doc), end_of_stream=True))]


def response_headers(answer: Answer) -> pb.ProcessingRequest:
    headers = {":status": str(answer.status).encode()}
    if answer.sse:
        headers |= {"content-type": b"text/event-stream; charset=utf-8", "transfer-encoding": b"chunked"}
    else:
        headers["content-type"] = b"application/json"
        if answer.sized:
            headers["content-length"] = str(len(answer.raw)).encode()
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map(**headers)))


# --- the reference ---

def event_complete(answer: Answer, i: int, received: bytes, ended: bool = True) -> bool:
    """Whether the received bytes hold event `i` whole: its blank line too, unless the answer ended there."""
    end = len(b"".join(answer.events[:i + 1]))
    return len(received) >= end - (len(answer.blank_line) if ended else 0)


def usage_chunk_complete(answer: Answer, received: bytes, ended: bool = True) -> bool:
    return answer.usage_event is not None and event_complete(answer, answer.usage_event, received, ended)


def usage_object_came(answer: Answer, received: bytes) -> bool:
    """Whether a Responses stream's last event came as far as the end of its response's usage (the keys after it,
    from `user` on, maybe not): an event too long to hold back, read from its end, may have its usage read then."""
    if answer.usage_event is None:
        return False
    after = answer.events[answer.usage_event].rfind(b'"user"')  # the response's own: a quote in text is escaped
    return after >= 0 and len(received) > len(b"".join(answer.events[:answer.usage_event])) + after


def expected_first_tokens(answer: Answer, received: bytes, read: bool, ended: bool) -> range:
    """How many first tokens a stream read reports: one once an event with text has come whole, none before any
    began (one may come from an event passed on before its end, too long to hold back)."""
    if not (read and answer.sse):
        return range(0, 1)
    if any(event_complete(answer, i, received, ended) for i in answer.texts):
        return range(1, 2)
    began = any(len(b"".join(answer.events[:i])) < len(received) for i in answer.texts)
    return range(0, 2 if began else 1)


def expected_output(answer: Answer, received: bytes, strip: bool) -> bytes:
    """What the client must get of `received` (a prefix of the answer): the same bytes, less the usage chunk the
    ext_proc asked for (whole, with its own blank line, once its JSON is complete)."""
    if not (strip and usage_chunk_complete(answer, received)):
        return received
    start = len(b"".join(answer.events[:answer.usage_event]))
    return received[:start] + received[start + len(answer.events[answer.usage_event]):]


def complete_events(answer: Answer, received: bytes) -> bytes:
    """The received bytes up to the end of the last complete event."""
    end = received.rfind(answer.blank_line)
    return received[:end + len(answer.blank_line)] if end >= 0 else b""


def expected_usage(answer: Answer, received: bytes, read: bool, ended: bool) -> set:
    """The usage that may be read: a stream's once its usage chunk is whole, a JSON answer's once it has all come.
    A stream cut after the usage chunk's JSON but before its blank line may have it read or not (an event too long
    to hold back was passed on, and read, without it), as may a Responses stream cut after its usage object."""
    if not read or answer.status != 200:
        return {None}
    if answer.sse:
        if usage_chunk_complete(answer, received, ended):
            return {answer.usage}
        came = usage_chunk_complete(answer, received) or usage_object_came(answer, received)
        return {None, answer.usage} if came else {None}
    if not (ended and len(received) == len(answer.raw)):
        return {None}
    if answer.sized and len(answer.raw) <= MAX_BODY:
        return {answer.usage}  # buffered by Envoy: read whole
    # read as it comes, only its end kept: vLLM writes the usage a few hundred bytes before it
    return {answer.usage if answer.raw.rfind(b'"usage":{') >= len(answer.raw) - USAGE_TAIL else None}


# --- one case, through the servicer ---

class Context:
    """grpc.aio's side of one ext_proc stream: messages from a script that sees every answer written so far; then
    EOF, or a cancel (the client left): as Envoy's reset, the handler cancelled while the read waits on."""

    def __init__(self) -> None:
        self.writes: list[pb.ProcessingResponse] = []
        self.script = iter(())
        self.cancel = False
        self.handler: asyncio.Task | None = None

    async def read(self):
        if self.handler is None:  # the first read is the handler's own (the decided stream's are shielded tasks)
            self.handler = asyncio.current_task()
        message = next(self.script, None)
        if message is not None:
            return message
        if self.cancel:
            self.handler.cancel()
            await asyncio.get_running_loop().create_future()  # never ends: the reset leaves it waiting
        return EOF

    async def write(self, answer: pb.ProcessingResponse) -> None:
        self.writes.append(answer)


class Server:
    """One servicer (reading every answer's usage, or only a refunded tenant's non-streamed ones), with what the
    cases check recorded: the usage readers it made, the tickets it closed."""

    def __init__(self, learn_sample: float, degrades: bool = False) -> None:
        tenants = [{"name": "acme", "api_keys": [KEY], "tokens_per_minute": 10**9, "max_class": "interactive"}]
        caps = {"max_concurrency": 1000, "max_queue": 0, "max_wait_ms": 0}
        if degrades:  # one request holds the class's one slot: every other is degraded (each asks for 5000 tokens,
            # so each is clamped, a change whether it streams or not), its streaming turned off
            caps |= {"max_concurrency": 1, "on_overflow": "fallback",
                     "fallback": {"action": "degrade", "max_tokens": 4999, "stream": False}}
        self.learns = learn_sample == 1.0
        self.core = AdmissionController(make_policy(classes={"interactive": caps}, tenants=tenants,
                                                    learn_sample=learn_sample), clock=FakeClock())
        self.servicer = ExtProcServicer(self.core, max_body_bytes=MAX_BODY)
        processor = self.servicer.processor
        self.holder = Stream(processor)
        if degrades:
            for message in request_messages("chat", {"model": "llama", "messages": HI}, False):
                self.holder.receive(message)
        self.inflight = self.core.snapshot()["interactive"]["inflight"]
        self.readers: list = []
        self.closed: list = []
        self.first_tokens: list = []
        self.core.first_token = lambda ticket, seconds: self.first_tokens.append(ticket)
        make_reader, close = processor.usage_reader, processor.close

        def usage_reader(key):
            self.readers.append(make_reader(key))
            return self.readers[-1]

        def closing(ticket, outcome, status=0):
            self.closed.append((ticket, outcome))
            close(ticket, outcome, status)

        processor.usage_reader, processor.close = usage_reader, closing

    def held(self) -> int:
        """Bytes the stream's usage reader holds (an event held back, a JSON answer buffered, the end of a long
        event kept to read its usage)."""
        return sum(len(r.partial) + len(r.buffered) + len(r.passed) for r in self.readers)


def forwarded_body(answer: pb.ProcessingResponse, client: dict) -> dict:
    mutation = answer.request_body.response.body_mutation
    return json.loads(mutation.body) if mutation.body else client


def sent_on(answer: pb.ProcessingResponse, chunk: bytes) -> bytes:
    """What Envoy sends the client for a response_body message so answered."""
    response = answer.response_body.response
    return response.body_mutation.body if response.HasField("body_mutation") else chunk


def asks_for(answer: pb.ProcessingResponse, field: str) -> int:
    return getattr(answer.mode_override, field) if answer.HasField("mode_override") else 0


class Case:
    """One generated request and answer, and what the ext_proc did with it."""

    def __init__(self, rng: random.Random, server: Server) -> None:
        self.rng, self.server = rng, server
        self.kind, self.doc, self.keyed = request(rng)
        self.answer: Answer | None = None
        self.raw = b""            # the answer's bytes as the replica sent them (all, or up to where it stopped)
        self.restreamed = False   # a stream the degrade turned off: its JSON answer goes back as a stream
        self.received = b""       # the replica's bytes that reached the ext_proc (or went past it)
        self.sent = b""           # what Envoy sent the client
        self.read = False         # the body was sent to the ext_proc to read
        self.strip = False
        self.cancel = rng.random() < 0.1   # the client leaves mid-answer
        self.ctx = Context()

    def script(self):
        ctx, rng = self.ctx, self.rng
        yield from request_messages(self.kind, self.doc, self.keyed)
        forwarded = forwarded_body(ctx.writes[1], self.doc)
        self.check_options(forwarded)
        stream = forwarded.get("stream") is True
        self.restreamed = self.doc.get("stream") is True and not stream
        if not stream or rng.random() < 0.1:
            answer = json_answer(rng, self.kind, forwarded)
        else:
            answer = responses_stream_answer(rng, forwarded) if self.kind == "responses" else \
                stream_answer(rng, self.kind, forwarded)
        if answer.sse and rng.random() < 0.2:
            answer.in_dialect(rng.choice(DIALECTS))
        if answer.sse and rng.random() < 0.15:
            answer.with_crlf()
        self.answer = answer
        raw = answer.raw
        if rng.random() < 0.15 or self.cancel:  # the replica stopped (no [DONE], or mid-event), or the client left
            raw = stop_short(rng, raw)
        self.raw = raw
        if asks_for(ctx.writes[0], "response_header_mode") != Mode.SEND:
            self.received = self.sent = raw  # Envoy sends no response phase: the answer goes by untouched
            return
        yield response_headers(answer)
        body_mode = asks_for(ctx.writes[-1], "response_body_mode")
        if body_mode == Mode.NONE:
            self.received = self.sent = raw
            return
        self.read = True
        self.strip = client_asked_for_usage(self.doc) != vllm_usage_options(forwarded)[0]
        parts = [raw] if body_mode == Mode.BUFFERED else cut(rng, raw)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1 and not self.cancel
            yield pb.ProcessingRequest(response_body=pb.HttpBody(body=part, end_of_stream=last))
            self.received += part
            self.sent += sent_on(ctx.writes[-1], part)
            self.check_progress(last)

    def check_options(self, forwarded: dict) -> None:
        """A sampled chat or completions stream asks vLLM for its usage chunk, never for a usage in every chunk the
        client did not ask for (a Responses stream's last event always has it)."""
        include, continuous = vllm_usage_options(forwarded)
        if forwarded.get("stream") is True and self.server.learns and self.kind != "responses":
            assert include, forwarded
        if continuous:
            assert vllm_usage_options(self.doc)[1], (self.doc, forwarded)

    def check_progress(self, last: bool) -> None:
        assert self.server.held() <= MAX_PARTIAL + MAX_BODY + USAGE_TAIL
        for r in self.server.readers:
            assert len(r.partial) <= MAX_PARTIAL and len(r.passed) <= USAGE_TAIL, (len(r.partial), len(r.passed))
        if not self.answer.sse:
            return
        total = expected_output(self.answer, self.raw, self.strip)
        assert total.startswith(self.sent), "sent bytes the client must not get"
        came = self.received if last else complete_events(self.answer, self.received)
        due = expected_output(self.answer, came, self.strip)
        assert self.sent.startswith(due), "held back an event the client could use"

    def run(self) -> None:
        server = self.server
        server.readers.clear()
        server.closed.clear()
        server.first_tokens.clear()
        self.ctx.script = self.script()
        self.ctx.cancel = self.cancel
        try:
            asyncio.run(server.servicer.Process(None, self.ctx))
        except asyncio.CancelledError:
            assert self.cancel
        self.check_end()

    def check_end(self) -> None:
        answer, doc = self.answer, self.doc
        restreamed = self.restreamed and self.read and answer.status == 200
        # One Envoy cannot buffer (too large or its length unknown) is read as it comes, under the stream's headers.
        piecewise = restreamed and not (answer.sized and len(answer.raw) <= MAX_BODY)
        readable = restreamed and self.raw == answer.raw and len(answer.raw) <= MAX_BODY
        if readable and not self.cancel:
            self.check_restreamed()
        elif piecewise and not self.cancel:  # an answer that cannot become the stream: an error event ends it
            error = json.loads(self.sent.removesuffix(b"\n\ndata: [DONE]\n\n").removeprefix(b"data: "))["error"]
            assert error["code"] == "degraded_answer_too_large", self.sent[:200]
        elif not self.cancel:
            assert self.sent == expected_output(answer, self.received, self.strip), "the client got other bytes"
        (ticket, outcome), = self.server.closed  # the request's end, reported once
        # Envoy's end of a request and a client leaving look alike, except in a body we read and whose end never came.
        seen = self.read or asks_for(self.ctx.writes[0], "response_header_mode") == Mode.SEND
        assert outcome is (Outcome.UPSTREAM_ERROR if seen and answer.status >= 500 else
                           Outcome.CLIENT_ABORT if self.cancel and self.read else
                           Outcome.OK if seen else Outcome.ENDED), outcome
        usage = {answer.usage} if readable and not self.cancel else \
            expected_usage(answer, self.received, self.read, not self.cancel)
        assert ticket.usage in usage, (ticket.usage, doc)
        assert len(self.server.first_tokens) in expected_first_tokens(answer, self.received, self.read,
                                                                      not self.cancel)
        assert self.server.core.snapshot()["interactive"]["inflight"] == self.server.inflight


    def check_restreamed(self) -> None:
        """The whole JSON answer, sent on as the stream its client asked for: a chunk per choice with its text, the
        usage chunk if it asked, [DONE]."""
        events = self.sent.split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""], self.sent[-100:]
        chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
        answer = json.loads(self.answer.raw)
        chat = self.kind == "chat"
        assert [c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"]
                for c in chunks if c["choices"]] == [
            c["message"]["content"] if chat else c["text"] for c in answer["choices"]]
        assert [c["usage"] for c in chunks if not c["choices"]] == (
            [answer["usage"]] if client_asked_for_usage(self.doc) else [])


SERVERS = {"reading every answer": lambda: Server(1.0),
           "reading a refunded tenant's answers": lambda: Server(0.0),
           "turning streams off": lambda: Server(1.0, degrades=True)}


@pytest.mark.parametrize("server", SERVERS)
def test_generated_answers_reach_the_client_as_the_replica_sent_them_and_their_usage_is_read(server):
    make = SERVERS[server]
    rng = random.Random(f"{SEED} {server}")
    serving = make()
    for i in range(CASES):
        seed = rng.getrandbits(64)
        try:
            Case(random.Random(seed), serving).run()
        except AssertionError as e:
            raise AssertionError(f"case {i}: Case(random.Random({seed}), ...)") from e
