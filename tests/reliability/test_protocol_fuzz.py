"""Protocol fuzzing: random but well-typed ProcessingRequest sequences into the ext_proc streams.

Several streams run concurrently against one admission core with tiny caps (so queueing, shedding, degrading and
overflow are all reached), each made of messages in any order — repeated headers, bodies without headers, response
phases before request phases, random bodies (valid and invalid JSON, huge numbers) — and each ending anywhere:
EOF, `read()` raising CancelledError, or a stream that hangs until its task is cancelled (Envoy resetting it).

Two drivers: the sans-async Stream fed in turns without asyncio (fast: the protocol itself, queue waits ended by
the clock and the core's reaper, clients leaving while queued), and the gRPC servicer with fake contexts (the async
driver: shielded reads, cancellation, the message-timeout override).

Properties:
- Process never raises (except CancelledError when cancelled) and never counts a stream error;
- every message read gets exactly one answer, of its own phase or an immediate response (a queued request first
  gets an `override_message_timeout`, which is not an answer);
- when every stream has ended: nothing in flight, nothing queued, no open ticket, no live lease; after the report
  wait every admitted ticket has been accounted exactly once.

~500 sequences in the default suite; `EXTPROC_FUZZ_EXAMPLES=10000 pytest -m fuzz tests/reliability` (or
`make fuzz`) for the dedicated run.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc.aio import EOF
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.policy.admission import REPORT_WAIT_S, AdmissionController, NoEvents
from extproc.policy.schema import load_policy
from extproc.server.final_admission import FinalAdmission
from extproc.server.servicer import ExtProcServicer
from extproc.server.stream import Processor, Stream

PHASES = ("request_headers", "request_body", "request_trailers", "response_headers", "response_body",
          "response_trailers")

POLICY = {
    "classes": {
        "interactive": {"max_concurrency": 1, "max_queue": 1, "max_wait_ms": 3, "on_overflow": "fallback",
                        "fallback": {"action": "degrade", "model": "small", "max_tokens": 8, "max_concurrency": 1},
                        "error_breaker": {"min_requests": 2, "cooldown_s": 0.001}},
        "batch": {"max_concurrency": 1, "max_queue": 2, "max_wait_ms": 2, "max_inflight_gpu_seconds": 50},
        "internal": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0,
                     "fallback": {"action": "canned"}, "on_overflow": "fallback"},
    },
    "default_class": "interactive",
    # Anonymous requests may claim any class (the default caps them to the lowest, which never queues).
    "anonymous": {"max_class": "interactive"},
    "tenants": [{"name": "acme", "api_keys": ["sk-acme"], "max_class": "batch", "default_class": "batch",
                 "requests_per_minute": 100000, "tokens_per_minute": 10**9}],
    "sessions": {"max_inflight_gpu_seconds": 100},
    "models": {"llama": {"cluster": "pool_a", "cost": {"max_context_tokens": 4096}},
               "small": {"cluster": "pool_b"}},
    "learn_sample": 0.5,
}


class CountingEvents(NoEvents):
    """Counts tickets handed out and tickets accounted (each must be accounted exactly once)."""

    def __init__(self) -> None:
        self.admitted: set[int] = set()
        self.accounted: list[int] = []

    def decided(self, d) -> None:
        if d.ticket is not None:
            self.admitted.add(d.ticket.id)

    def finished(self, ticket, outcome, duration_s) -> None:
        self.accounted.append(ticket.id)


class ShiftedClock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class FakeContext:
    """What grpc.aio gives Process: read() the script's messages, then end as scripted; write() records."""

    def __init__(self, messages: list[pb.ProcessingRequest], end: str):
        self.messages = list(messages)
        self.end = end  # "eof" | "cancel" (read raises CancelledError) | "hang" (until the task is cancelled)
        self.read_count = 0
        self.writes: list[pb.ProcessingResponse] = []
        self.blocked = asyncio.Event()

    async def read(self):
        await asyncio.sleep(0)  # interleave with the other streams
        if self.messages:
            self.read_count += 1
            return self.messages.pop(0)
        if self.end == "eof":
            return EOF
        if self.end == "cancel":
            raise asyncio.CancelledError()
        self.blocked.set()
        await asyncio.Event().wait()

    async def write(self, resp) -> None:
        self.writes.append(resp)


# --- strategies: well-typed messages with adversarial contents ---

def header(k: str, v: bytes) -> base_pb2.HeaderValue:
    return base_pb2.HeaderValue(key=k, raw_value=v)


text = st.text(max_size=12)
header_values = st.one_of(text.map(str.encode), st.binary(max_size=16))
request_headers = st.builds(
    lambda method, path, auth, prio, session, ctype, extra, eos: pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
            headers=[h for h in (method, path, auth, prio, session, ctype) if h] + extra), end_of_stream=eos)),
    st.one_of(st.just(header(":method", b"POST")), st.sampled_from([b"GET", b"PUT", b""]).map(
        lambda m: header(":method", m)), st.none()),
    st.one_of(st.sampled_from([b"/v1/chat/completions", b"/v1/completions", b"/v1/chat/completions?x=1",
                               b"/v1/models", b"/"]).map(lambda p: header(":path", p)), st.none()),
    st.one_of(st.sampled_from([b"Bearer sk-acme", b"bearer sk-nobody", b"Basic abc", b"Bearer ", b""]).map(
        lambda a: header("authorization", a)), header_values.map(lambda v: header("authorization", v)),
        st.none()),
    st.one_of(st.sampled_from([b"interactive", b"batch", b"internal", b"INTERNAL ", b"gold", b""]).map(
        lambda c: header("x-priority", c)), header_values.map(lambda v: header("x-priority", v)), st.none()),
    st.one_of(header_values.map(lambda v: header("x-session-id", v)), st.none()),
    st.one_of(st.just(header("content-type", b"application/json")), header_values.map(
        lambda v: header("content-type", v)), st.none()),
    st.lists(st.builds(header, st.sampled_from(["x-priority", "authorization", ":path", "x-request-id",
                                                "content-type", "x-other"]), header_values), max_size=3),
    st.booleans(),
)

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**20), max_value=10**20),
                         st.sampled_from([10**12, 10**400, -1, 0, 2**63]), st.floats(allow_nan=False), text)
body_docs = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.sampled_from(["llama", "small", "gpt-99", ""]), json_scalars),
        "max_tokens": st.one_of(st.integers(min_value=1, max_value=5000), json_scalars,
                                st.just("lots")),
        "max_completion_tokens": json_scalars,
        "stream": st.one_of(st.booleans(), json_scalars),
        "stream_options": st.one_of(st.just({"include_usage": True}), json_scalars),
        "priority": st.one_of(st.sampled_from(["interactive", "batch", "internal", "gold"]), json_scalars),
        "messages": st.one_of(
            st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(text, json_scalars)}),
                     max_size=3), json_scalars),
        "prompt": st.one_of(text, st.lists(st.integers(0, 50000), max_size=5), json_scalars),
    })


def _json(doc) -> bytes:
    return json.dumps(doc).encode()


raw_bodies = st.one_of(
    body_docs.map(_json),
    body_docs.map(lambda d: _json(d)[: max(1, len(_json(d)) // 2)]),  # truncated
    st.sampled_from([b"", b"{", b"[]", b"null", b"\xff\xfe{}", b'{"model": "llama"}' * 2, b"1e999999"]),
    st.binary(max_size=64),
)
request_body = st.builds(lambda b, eos: pb.ProcessingRequest(request_body=pb.HttpBody(body=b, end_of_stream=eos)),
                         raw_bodies, st.booleans())
def _response_headers(status: int, ct: bytes, details: str | None) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[header(":status", str(status).encode()), header("content-type", ct)])))
    if details is not None:  # envoy.yaml's response_attributes: why the response is what it is
        msg.attributes["envoy.filters.http.ext_proc"].fields["response.code_details"].string_value = details
    return msg


response_headers = st.builds(
    _response_headers, st.sampled_from([200, 200, 400, 429, 500, 503]),
    st.sampled_from([b"application/json", b"text/event-stream; charset=utf-8", b""]),
    st.sampled_from([None, "via_upstream", "via_upstream", "cluster_not_found", "direct_response"]))
usage_event = (b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}\n\n'
               b"data: [DONE]\n\n")
response_body = st.builds(
    lambda b, eos: pb.ProcessingRequest(response_body=pb.HttpBody(body=b, end_of_stream=eos)),
    st.one_of(st.sampled_from([usage_event, b'data: {"choices":[{"delta":{}}]}\n\n',
                               b'{"usage":{"prompt_tokens":3,"completion_tokens":4}}',
                               b'{"usage":{"prompt_tokens":"x"}}', b'data: {"choices":[],"usage":',
                               b'{"usage": 5}']), st.binary(max_size=32)),
    st.booleans())
other = st.sampled_from([pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
                         pb.ProcessingRequest(response_trailers=pb.HttpTrailers())])
a_message = st.one_of(request_headers, request_body, response_headers, response_body, other)
# A request admission gets to decide on: a generation POST with a JSON body naming a known model.
admissible_headers = st.builds(
    lambda path, content_type, extra, eos: pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[header(":method", b"POST"), header(":path", path),
                                            header("content-type", content_type), *extra]), end_of_stream=eos)),
    st.sampled_from([b"/v1/chat/completions", b"/v1/completions"]),
    # every spelling vLLM takes (its media type, lower-cased, cut at `;`), and now and then one it refuses
    st.sampled_from([b"application/json"] * 6 + [b"application/json; charset=utf-8", b"Application/JSON",
                                                  b"text/plain"]),
    st.lists(st.builds(header, st.sampled_from(["x-priority", "authorization", "x-session-id"]),
                       st.sampled_from([b"interactive", b"batch", b"internal", b"Bearer sk-acme", b"s1", b"s2"])),
             max_size=3),
    st.sampled_from([False] * 9 + [True]))
admissible_body = st.builds(
    lambda model, max_tokens, stream, prio, eos: pb.ProcessingRequest(request_body=pb.HttpBody(
        body=_json({"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream,
                    **({"max_tokens": max_tokens} if max_tokens is not None else {}),
                    **({"priority": prio} if prio else {})}), end_of_stream=eos)),
    st.sampled_from(["llama", "small"] * 4 + ["gpt-99"]),
    st.one_of(st.none(), st.integers(1, 5000), st.integers(1, 5000), st.integers(1, 5000),
              st.sampled_from([10**12, 10**400, 2**63, 0, -5, "lots", 1.5])),
    st.booleans(), st.sampled_from([None, "interactive", "batch", "internal", 3]), st.booleans())
# Mostly Envoy-shaped streams (headers, body, then maybe response phases), plus fully random orders.
envoy_shaped = st.tuples(st.one_of(admissible_headers, admissible_headers, admissible_headers, request_headers),
                         st.one_of(admissible_body, admissible_body, admissible_body, request_body),
                         st.lists(st.one_of(response_headers, response_body, other), max_size=4)).map(
    lambda t: [t[0], t[1], *t[2]])
# A stream ends early (cut anywhere) a third of the time; it runs to its last message otherwise.
cut = st.lists(a_message, max_size=7).flatmap(lambda msgs: st.integers(0, len(msgs)).map(lambda n: msgs[:n]))
a_stream = st.tuples(
    st.one_of(*[envoy_shaped] * 6, cut, st.lists(a_message, max_size=7)),
    st.sampled_from(["eof", "eof", "cancel", "hang"]))
scenarios = st.lists(a_stream, min_size=2, max_size=8)


# --- the property ---

def check_answers(ctx: FakeContext, sent: list[pb.ProcessingRequest], left_waiting: bool = False) -> None:
    """`left_waiting`: the client left while its request waited for admission, so its last message has none."""
    answers = [w for w in ctx.writes if w.WhichOneof("response") is not None]
    assert all(w.HasField("override_message_timeout") for w in ctx.writes if w.WhichOneof("response") is None)
    assert len(answers) == ctx.read_count - left_waiting, (len(answers), ctx.read_count, left_waiting)
    for req, resp in zip(sent, answers):
        got = resp.WhichOneof("response")
        assert got in (req.WhichOneof("request"), "immediate_response"), (req, resp)


async def run_scenario(streams: list[tuple[list, str]]) -> None:
    clock = ShiftedClock()
    events = CountingEvents()
    core = AdmissionController(load_policy(POLICY), clock=clock, events=events)
    errors = []
    servicer = ExtProcServicer(core, max_body_bytes=600, queue_grace_s=0.0, on_error=lambda: errors.append(1))
    contexts = [FakeContext(msgs, end) for msgs, end in streams]
    tasks = [asyncio.create_task(servicer.Process(None, ctx)) for ctx in contexts]
    # Hanging streams stay open until every other stream is done, then Envoy resets them (task cancel).
    hanging = [t for t, ctx in zip(tasks, contexts) if ctx.end == "hang"]
    others = [t for t, ctx in zip(tasks, contexts) if ctx.end != "hang"]
    async with asyncio.timeout(10):
        await asyncio.gather(*others, return_exceptions=True)
        for t, ctx in zip(tasks, contexts):
            if ctx.end == "hang":
                await asyncio.wait([t, asyncio.ensure_future(ctx.blocked.wait())],
                                   return_when=asyncio.FIRST_COMPLETED)
    for t in hanging:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for (msgs, end), ctx, res in zip(streams, contexts, results):
        if isinstance(res, asyncio.CancelledError):
            assert end in ("cancel", "hang"), "cancelled without being cancelled"
        else:
            assert res is None, f"Process raised {res!r}"
        check_answers(ctx, msgs)
    assert errors == []
    check_released(core, servicer.live, events, clock)


def check_released(core: AdmissionController, live: set, events: CountingEvents, clock: ShiftedClock) -> None:
    assert not live, "a lease is still being renewed for an ended stream"
    assert not core.tickets, f"open tickets after every stream ended: {core.tickets}"
    for cls, s in core.snapshot().items():
        assert s["inflight"] == 0 and s["queue"] == 0 and s["degraded_inflight"] == 0, (cls, s)
        assert abs(s["inflight_cost"]) < 1e-6, (cls, s)
    # No completion reports come here: after the report wait each ticket is accounted from its stream end.
    clock.offset += REPORT_WAIT_S + 1
    core.reap()
    assert sorted(events.accounted) == sorted(events.admitted), "a ticket was lost or accounted twice"


class FedStream:
    """One scripted stream fed to a sans-async Stream: what was read and written, as FakeContext records it."""

    def __init__(self, processor: Processor, messages: list[pb.ProcessingRequest], end: str):
        self.stream = Stream(processor)
        self.messages = list(messages)
        self.end = end
        self.read_count = 0
        self.writes: list[pb.ProcessingResponse] = []
        self.waiting: FinalAdmission | None = None

    def step(self) -> bool:
        """Feed the next message, or hand over a queue's verdict; False when it cannot move now."""
        if self.waiting is not None:
            d = self.waiting.waiter.result  # no shared store here: the queue's verdict is the final admission
            if d is None:
                return False
            self.waiting = None
            self.writes.append(self.stream.admitted(d))
            return True
        if not self.messages:
            return False
        self.read_count += 1
        answer = self.stream.receive(self.messages.pop(0))
        if isinstance(answer, FinalAdmission):
            self.waiting = answer
        else:
            self.writes.append(answer)
        return True


def run_scenario_sans_async(streams: list[tuple[list, str]]) -> None:
    """Streams fed in turns. When none can move: clients of "hang" streams leave (the queued ones too), the rest
    run to their end; then the clock passes the queue deadlines and the reaper times the waiters out."""
    clock = ShiftedClock()
    events = CountingEvents()
    core = AdmissionController(load_policy(POLICY), clock=clock, events=events)
    processor = Processor(core, max_body_bytes=600)
    fed = [FedStream(processor, msgs, end) for msgs, end in streams]
    open_ = list(fed)
    while open_:
        if any([f.step() for f in open_]):
            continue
        done = [f for f in open_ if f.waiting is None or f.end == "hang"]
        for f in done:
            f.stream.end(normal_end=f.end == "eof")
            open_.remove(f)
        if not done:
            clock.offset += 1.0
            core.reap()
    for (msgs, _), f in zip(streams, fed):
        check_answers(f, msgs, left_waiting=f.waiting is not None)
    check_released(core, processor.live, events, clock)


EXAMPLES = int(os.environ.get("EXTPROC_FUZZ_EXAMPLES", "500"))


def _fuzz(examples: int):
    @settings(max_examples=examples, deadline=None, derandomize=examples <= 500,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(scenarios)
    def prop(streams):
        asyncio.run(run_scenario(streams))
    return prop


@settings(max_examples=min(EXAMPLES, 500), deadline=None, derandomize=EXAMPLES <= 500,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios)
def test_streams_survive_random_messages_without_asyncio(streams):
    run_scenario_sans_async(streams)


test_servicer_survives_random_streams = _fuzz(min(EXAMPLES, 500))
test_servicer_survives_random_streams_long = pytest.mark.timeout(7200)(
    pytest.mark.fuzz(pytest.mark.slow(_fuzz(max(EXAMPLES, 10_000)))))
