"""The ext_proc stream's state machine, fed messages without asyncio: one transition or answer per test."""

from __future__ import annotations

import json
import math

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.policy.adaptive import PoolSaturation
from extproc.policy.admission import ACCEPT, REJECT, REPORT_WAIT_S, AdmissionController, RequestFacts
from extproc.policy.limits import Completion, Outcome
from extproc.policy.reasons import R_CLIENT_GONE
from extproc.server import protocol
from extproc.server.final_admission import FinalAdmission
from extproc.server.protocol import CONTINUE, LEARN_BODY, LEARN_HEADERS
from extproc.server.stream import Phase, Processor, Stream
from extproc.server.usage import MAX_PARTIAL, USAGE_TAIL, UsageReader

from ..conftest import RecordedEvents
from .conftest import make_policy

HI = [{"role": "user", "content": "hi"}]  # a chat request is a list of messages: one will do

CHAT = b"/v1/chat/completions"


def request_headers(path: bytes = CHAT, method: bytes = b"POST", eos: bool = False,
                    **headers: bytes | None) -> pb.ProcessingRequest:
    hs = [base_pb2.HeaderValue(key=":method", raw_value=method), base_pb2.HeaderValue(key=":path", raw_value=path)]
    headers = {"content_type": b"application/json", **headers}  # as every client of vLLM's JSON routes sends it
    hs += [base_pb2.HeaderValue(key=k.replace("_", "-"), raw_value=v) for k, v in headers.items() if v is not None]
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs),
                                                               end_of_stream=eos))


def request_body(doc: dict | bytes | None = None) -> pb.ProcessingRequest:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc or {"model": "llama", "messages": HI}).encode()
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))


def response_headers(status: int = 200, content_type: bytes = b"application/json",
                     content_length: int | None = 100, **headers: bytes) -> pb.ProcessingRequest:
    hs = [base_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
          base_pb2.HeaderValue(key="content-type", raw_value=content_type)]
    if content_length is not None and content_type != b"text/event-stream":
        hs.append(base_pb2.HeaderValue(key="content-length", raw_value=str(content_length).encode()))
    hs += [base_pb2.HeaderValue(key=k.replace("_", "-"), raw_value=v) for k, v in headers.items()]
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs)))


def response_body(raw: bytes, eos: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=raw, end_of_stream=eos))


def processor(clock, learn_sample: float = 0.0, events: RecordedEvents | None = None, **policy) -> Processor:
    core = AdmissionController(make_policy(learn_sample=learn_sample, **policy), clock=clock, events=events)
    return Processor(core, max_body_bytes=1000)


def one_class(**interactive) -> dict:
    """Policy overrides: a single class, `interactive`, with this spec."""
    return {"classes": {"interactive": interactive}, "tenants": []}


QUEUE_OF_ONE = one_class(max_concurrency=1, max_queue=1, max_wait_ms=100)


def admitted(p: Processor, doc: dict | None = None, **headers: bytes):
    s = Stream(p)
    s.receive(request_headers(**headers))
    answer = s.receive(request_body(doc))
    assert s.phase is Phase.FORWARDING, answer
    return s, answer


def set_headers(answer: pb.ProcessingResponse) -> dict[str, bytes]:
    mutation = answer.request_body.response.header_mutation
    return {h.header.key: h.header.raw_value for h in mutation.set_headers}


def immediate_status(answer: pb.ProcessingResponse) -> int:
    assert answer.HasField("immediate_response"), answer
    return answer.immediate_response.status.code


def inflight(p: Processor, cls: str = "interactive") -> int:
    return p.core.snapshot()[cls]["inflight"]


# --- request headers ---

def test_a_new_stream_awaits_the_request_headers(clock):
    assert Stream(processor(clock)).phase is Phase.HEADERS


def test_the_headers_of_a_served_post_are_continued_and_the_body_awaited(clock):
    s = Stream(processor(clock))
    assert s.receive(request_headers()) is CONTINUE["request_headers"]
    assert s.phase is Phase.BODY


def test_requests_awaiting_their_body_are_bounded_and_every_way_out_gives_its_place_back(clock):
    # Held streams (headers sent, body withheld) each take one of Envoy's extproc circuit-breaker slots; a full
    # breaker lets requests through unadmitted (found by the HTTP/2 audit: ~1,000 connections x 100 streams).
    p = processor(clock)
    p.max_pending_bodies = 3
    waiting = [Stream(p) for _ in range(3)]
    for s in waiting:
        s.receive(request_headers())
    assert p.pending_bodies == 3
    refused = Stream(p).receive(request_headers())
    assert immediate_status(refused) == 503
    assert {h.header.key: h.header.raw_value for h in refused.immediate_response.headers.set_headers}[
        "retry-after"] == b"1"
    assert json.loads(refused.immediate_response.body)["error"]["code"] == "bodies_pending"
    waiting[0].receive(request_body())  # admitted
    waiting[1].end(False)                # the client left before its body
    assert p.pending_bodies == 1
    waiting[2].fail()                    # our own failure
    assert p.pending_bodies == 0
    s = Stream(p)
    s.receive(request_headers())
    s.receive(request_body(b"not json"))  # refused on its body
    assert p.pending_bodies == 0 and s.phase is Phase.ANSWERED


def test_an_unknown_path_is_refused_404(clock):
    s = Stream(processor(clock))
    assert immediate_status(s.receive(request_headers(path=b"/v1/models"))) == 404
    assert s.phase is Phase.ANSWERED


def test_a_method_other_than_post_is_refused_405(clock):
    s = Stream(processor(clock))
    answer = s.receive(request_headers(method=b"GET"))
    assert immediate_status(answer) == 405
    headers = {h.header.key: h.header.raw_value for h in answer.immediate_response.headers.set_headers}
    assert headers["allow"] == b"POST"  # RFC 9110 (found by an audit)


def test_a_connect_is_refused_405_naming_its_target_not_an_empty_url(clock):
    # A CONNECT has an authority and no :path (RFC 9110 9.3.6): it was answered 404 "Invalid URL (CONNECT )."
    # The shipped envoy.yaml refuses CONNECT itself (403 upgrade_failed, no upgrade_configs), but a config that
    # enables CONNECT upgrades sends it here.
    hs = [base_pb2.HeaderValue(key=":method", raw_value=b"CONNECT"),
          base_pb2.HeaderValue(key=":authority", raw_value=b"example.com:443")]
    s = Stream(processor(clock))
    answer = s.receive(pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs))))
    assert immediate_status(answer) == 405 and s.phase is Phase.ANSWERED
    error = json.loads(answer.immediate_response.body)["error"]
    assert error["code"] == "connect_not_supported" and error["type"] == "invalid_request_error"
    assert "CONNECT example.com:443" in error["message"], error
    headers = {h.header.key: h.header.raw_value for h in answer.immediate_response.headers.set_headers}
    assert headers["allow"] == b"GET, POST"  # what the gateway serves: POST to vLLM's endpoints, GET /v1/models


def test_a_request_without_a_path_is_refused_404_saying_it_has_none(clock):
    hs = [base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
          base_pb2.HeaderValue(key=":authority", raw_value=b"gw")]
    s = Stream(processor(clock))
    answer = s.receive(pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs))))
    assert immediate_status(answer) == 404
    error = json.loads(answer.immediate_response.body)["error"]
    assert error["code"] == "unknown_url" and error["message"] == "Invalid URL (POST without a path).", error


def test_a_switched_off_endpoint_group_is_refused_404(clock):
    s = Stream(processor(clock))
    answer = s.receive(request_headers(path=b"/v1/embeddings"))
    assert immediate_status(answer) == 404
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "unsupported_endpoint"


def test_two_different_api_keys_are_refused_401(clock):
    s = Stream(processor(clock))
    answer = s.receive(request_headers(authorization=b"Bearer sk-acme", api_key=b"sk-other"))
    assert immediate_status(answer) == 401


def test_a_missing_key_is_refused_401_when_anonymous_requests_are_not_allowed(clock):
    s = Stream(processor(clock, anonymous={"allow": False}))
    assert immediate_status(s.receive(request_headers())) == 401
    assert s.phase is Phase.ANSWERED


def test_headers_that_end_the_request_are_refused_as_an_empty_body(clock):
    s = Stream(processor(clock))
    assert immediate_status(s.receive(request_headers(eos=True))) == 400


REQUEST_TRAILERS = pb.ProcessingRequest(request_trailers=pb.HttpTrailers())


def test_trailers_that_end_the_request_before_any_body_are_refused_as_an_empty_body(clock):
    # HTTP/2: HEADERS, then trailers, no DATA. Envoy sends no body message; a CONTINUE let it upstream undecided.
    s = Stream(processor(clock))
    assert s.receive(request_headers()) is CONTINUE["request_headers"]
    answer = s.receive(REQUEST_TRAILERS)
    assert immediate_status(answer) == 400 and s.phase is Phase.ANSWERED
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "invalid_body"


def test_trailers_after_the_body_are_continued(clock):
    s, _ = admitted(processor(clock))
    assert s.receive(REQUEST_TRAILERS) is CONTINUE["request_trailers"]
    assert s.phase is Phase.FORWARDING


def test_the_learned_modes_still_send_the_request_trailers(clock):
    # mode_override replaces the whole mode: a learned request must not lose the trailers check above
    for answer in (LEARN_HEADERS, *LEARN_BODY.values()):
        assert answer.mode_override.request_trailer_mode == answer.mode_override.SEND


@pytest.mark.parametrize("encoding", [b"gzip", b"deflate, br"])
def test_a_compressed_body_is_refused_415(clock, encoding):
    # neither we nor vLLM decompress a request body: refused in words, not as JSON that is "not valid UTF-8"
    s = Stream(processor(clock))
    answer = s.receive(request_headers(content_encoding=encoding))
    assert immediate_status(answer) == 415 and s.phase is Phase.ANSWERED
    err = json.loads(answer.immediate_response.body)["error"]
    assert (err["code"], err["type"]) == ("unsupported_content_encoding", "invalid_request_error")


def test_an_identity_content_encoding_is_no_compression(clock):
    s = Stream(processor(clock))
    assert s.receive(request_headers(content_encoding=b"identity")) is CONTINUE["request_headers"]


@pytest.mark.parametrize("content_type", [None, b"text/plain", b"application/x-www-form-urlencoded", b"",
                                          b"application/vnd.api+json", b"application/json ; charset=utf-8",
                                          b"text/plain; application/json"])
@pytest.mark.parametrize("path", [CHAT, b"/v1/completions", b"/v1/responses", b"/invocations"])
def test_a_body_vllm_would_not_read_as_json_is_refused_400_before_admission(clock, content_type, path):
    # vLLM 0.32's validate_json_request answers these 400 whatever the body (recorded: its message, "Unsupported
    # Media Type: Only 'application/json' is allowed"); admitted, a text/plain chat request held a slot until then.
    p = processor(clock)
    s = Stream(p)
    answer = s.receive(request_headers(path=path, content_type=content_type))
    assert immediate_status(answer) == 400 and s.phase is Phase.ANSWERED and inflight(p) == 0
    err = json.loads(answer.immediate_response.body)["error"]
    assert (err["code"], err["type"], err["param"]) == ("unsupported_media_type", "invalid_request_error", None)
    assert "application/json" in err["message"] and ("no Content-Type" if content_type is None else
                                                     content_type.decode()) in err["message"]
    headers = {h.header.key: h.header.raw_value for h in answer.immediate_response.headers.set_headers}
    assert headers["x-extproc-decision"] == b"invalid"


@pytest.mark.parametrize("content_type", [b"application/json", b"application/json; charset=utf-8",
                                          b"Application/JSON", b"APPLICATION/JSON;charset=UTF-8",
                                          b"application/json;"])
def test_every_content_type_vllm_reads_as_json_is_admitted(clock, content_type):
    p = processor(clock)
    s, _ = admitted(p, content_type=content_type)
    assert inflight(p) == 1


def test_a_second_content_type_is_not_the_one_read(clock):
    # vLLM's server reads the first of two (Starlette's headers.get): so does the gateway
    s = Stream(processor(clock))
    msg = request_headers()
    msg.request_headers.headers.headers.add(key="content-type", raw_value=b"text/plain")
    assert s.receive(msg) is CONTINUE["request_headers"]
    s = Stream(processor(clock))
    msg = request_headers(content_type=b"text/plain")
    msg.request_headers.headers.headers.add(key="content-type", raw_value=b"application/json")
    assert immediate_status(s.receive(msg)) == 400


def test_a_learning_sample_asks_for_the_response_headers(clock):
    s = Stream(processor(clock, learn_sample=1.0))
    assert s.receive(request_headers()) is LEARN_HEADERS


def test_a_second_headers_message_is_continued_and_changes_nothing(clock):
    s = Stream(processor(clock))
    s.receive(request_headers())
    assert s.receive(request_headers(path=b"/v1/models")) is CONTINUE["request_headers"]
    assert s.phase is Phase.BODY


# --- request body ---

@pytest.mark.parametrize("message", [request_body(), REQUEST_TRAILERS])
def test_a_body_or_trailers_without_headers_are_refused_not_continued(clock, message):
    # request_header_mode SKIP (a route's typed_per_filter_config override): a CONTINUE sent the request
    # upstream undecided (found by an infra-team audit of envoy.yaml edits, through Envoy 1.40)
    p = processor(clock)
    s = Stream(p)
    answer = s.receive(message)
    assert immediate_status(answer) == 500 and s.phase is Phase.ANSWERED and inflight(p) == 0
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "request_not_sent"
    # Retrying cannot help: the OpenAI SDKs retried it twice by default (found by an application-team audit)
    sent = {h.header.key: h.header.raw_value for h in answer.immediate_response.headers.set_headers}
    assert sent["x-should-retry"] == b"false" and "retry-after" not in sent


@pytest.mark.parametrize("mode", ["NONE", "STREAMED", "BUFFERED_PARTIAL"])
def test_a_stream_whose_body_is_not_sent_buffered_is_refused_at_its_headers(clock, mode):
    # Envoy reports the route's body mode on the first message; with NONE the request went upstream undecided
    Mode = protocol._Mode
    req = request_headers()
    req.protocol_config.request_body_mode = Mode.BodySendMode.Value(mode)
    p = processor(clock)
    s = Stream(p)
    answer = s.receive(req)
    assert immediate_status(answer) == 500 and s.phase is Phase.ANSWERED and p.pending_bodies == 0
    assert f"request_body_mode {mode}" in json.loads(answer.immediate_response.body)["error"]["message"]


def test_a_stream_reported_buffered_is_decided_as_usual(clock):
    req = request_headers()
    req.protocol_config.request_body_mode = protocol._Mode.BUFFERED
    s = Stream(processor(clock))
    assert s.receive(req) is CONTINUE["request_headers"]
    assert s.receive(request_body()) is not None and s.phase is Phase.FORWARDING


def test_a_body_with_a_free_slot_is_forwarded_to_its_pool(clock):
    p = processor(clock)
    s, answer = admitted(p)
    hs = set_headers(answer)
    assert answer.request_body.response.clear_route_cache
    assert (hs[protocol.CLUSTER_HEADER], hs["x-extproc-class"], hs["x-extproc-decision"]) == \
        (b"pool_a", b"interactive", b"accept")
    assert inflight(p) == 1 and p.live == {s.held}


def test_while_a_replica_of_its_pool_is_stalled_the_others_are_named_for_envoy(clock):
    p = processor(clock)
    assert protocol.REPLICA_HEADER not in set_headers(admitted(p)[1])  # none stalled: Envoy's balancer picks
    sat = PoolSaturation()
    sat.stalled, sat.working = 1, (("10.0.0.2:8000", 1.0, 1.0), ("10.0.0.3:8000", 0.0, 1.0))
    p.core.set_saturation("pool_a", sat)
    assert set_headers(admitted(p)[1])[protocol.REPLICA_HEADER] == b"10.0.0.3:8000,10.0.0.2:8000"


def test_a_body_refused_413_after_admission_is_taken_back_as_never_run(clock):
    # It was released as a client abort of a request that ran: a completion for the class's drain rate, the
    # tenant charged its prompt and expected output, and a report awaited from Envoy that never comes.
    p = processor(clock, tenants=[{"name": "acme", "api_keys": ["sk-acme"], "tokens_per_minute": 10**6}])
    raw = b'{"model": "llama", "messages": [{"role": "user"}], "priority": -100, "x": [' + \
        b",".join([b"1e15"] * 150) + b"]}"
    s = Stream(p)
    s.receive(request_headers(authorization=b"Bearer sk-acme"))
    bucket = p.core.tenant_limits["acme"].tokens
    assert immediate_status(s.receive(request_body(raw))) == 413
    lim = p.core.limiters["interactive"]
    assert bucket.refill(clock()) == bucket.capacity and lim.drain._count == 0.0
    assert inflight(p) == 0 and not p.core.tickets and not p.core._unreported


def test_a_rewritten_body_carries_its_new_content_length(clock):
    p = processor(clock)
    _, answer = admitted(p, {"model": "llama", "messages": HI, "priority": "batch"})  # the claim is stripped
    body = answer.request_body.response.body_mutation.body
    assert "priority" not in json.loads(body) and set_headers(answer)["content-length"] == str(len(body)).encode()


def test_a_body_over_the_size_limit_is_refused_413(clock):
    s = Stream(processor(clock))
    s.receive(request_headers())
    assert immediate_status(s.receive(request_body(b"{" + b" " * 2000 + b"}"))) == 413


def test_a_tenants_body_limit_refuses_its_larger_bodies_413_before_they_are_parsed(clock):
    # Parsing is the per-request cost that grows with the body: a low-priority tenant's cap keeps its 4 MiB bodies
    # (~60 ms of the event loop each when full of numbers) from stalling everyone's admission.
    p = Processor(AdmissionController(make_policy(
        tenants=[{"name": "acme", "api_keys": ["sk-acme"], "max_body_bytes": 2048}],
        anonymous={"max_class": "interactive", "max_body_bytes": 1024}), clock=clock), max_body_bytes=4096)
    body = {"model": "llama", "messages": [{"role": "user", "content": "x" * 1500}]}
    for headers, status in (({}, 413), ({"authorization": b"Bearer sk-acme"}, None)):
        s = Stream(p)
        s.receive(request_headers(**headers))
        answer = s.receive(request_body(body))
        assert (immediate_status(answer) if status else s.phase) == (status or Phase.FORWARDING), answer
        s.end(normal_end=True)
    s = Stream(p)
    s.receive(request_headers(authorization=b"Bearer sk-acme"))
    answer = s.receive(request_body(b'{"model": "llama", "messages": [{"role": "user"}], "x": "' + b"y" * 2100 + b'"}'))
    assert immediate_status(answer) == 413 and b"2048 bytes" in answer.immediate_response.body
    assert p.core.body_limit("sk-unknown", 4096) == 1024 and p.core.body_limit("sk-acme", 1500) == 1500


def test_a_body_that_grows_over_the_limit_when_rewritten_is_refused_413_and_its_slot_given_back(clock):
    # 1e15 is re-encoded as 1000000000000000.0: within the limit as sent, over it as it would be forwarded. A
    # failed write of the admission would let Envoy's failure_mode_allow forward the original unadmitted.
    p = processor(clock, **one_class(max_concurrency=1))
    raw = b'{"model": "llama", "messages": [{"role": "user"}], "priority": -100, "x": [' + \
        b",".join([b"1e15"] * 150) + b"]}"
    assert len(raw) < p.max_body_bytes
    s = Stream(p)
    s.receive(request_headers())
    answer = s.receive(request_body(raw))
    assert immediate_status(answer) == 413 and s.phase is Phase.ANSWERED
    assert b"re-encoded" in answer.immediate_response.body
    assert inflight(p) == 0 and not p.live
    s.end(normal_end=True)
    admitted(p)  # the one slot is free again


def test_a_body_that_is_not_json_is_refused_400(clock):
    s = Stream(processor(clock))
    s.receive(request_headers())
    assert immediate_status(s.receive(request_body(b"{nope"))) == 400
    assert s.phase is Phase.ANSWERED


def test_an_unknown_model_is_refused_404(clock):
    s = Stream(processor(clock))
    s.receive(request_headers())
    assert immediate_status(s.receive(request_body({"model": "gpt-99", "messages": HI}))) == 404


def test_the_class_vllm_priority_is_written_into_the_body(clock):
    p = processor(clock, **one_class(max_concurrency=1, vllm_priority=7))
    _, answer = admitted(p)
    assert json.loads(answer.request_body.response.body_mutation.body)["priority"] == 7


def test_a_degrade_rewrites_the_body_and_says_what_changed(clock):
    p = processor(clock, **one_class(max_concurrency=1, max_queue=0, on_overflow="fallback",
                                     fallback={"action": "degrade", "model": "small", "max_tokens": 8}))
    admitted(p)
    s, answer = admitted(p, {"model": "llama", "messages": HI, "max_tokens": 100})
    assert set_headers(answer)["x-extproc-degraded"] == b"model=small,max_tokens=8; reason=queue_full"
    assert json.loads(answer.request_body.response.body_mutation.body)["model"] == "small"


def over_a_full_class_canned(clock, status: int) -> tuple[Stream, pb.ProcessingResponse]:
    """A request over a full class whose overflow gets the canned fallback with `status`: (its stream, the answer)."""
    p = processor(clock, **one_class(max_concurrency=1, max_queue=0, on_overflow="fallback",
                                     fallback={"action": "canned", "status": status, "message": "busy"}))
    admitted(p)
    s = Stream(p)
    s.receive(request_headers())
    return s, s.receive(request_body())


def test_a_canned_fallback_answers_in_the_endpoints_shape_without_a_slot(clock):
    s, answer = over_a_full_class_canned(clock, 200)
    assert immediate_status(answer) == 200 and s.phase is Phase.ANSWERED and s.held is None
    assert json.loads(answer.immediate_response.body)["choices"][0]["message"]["content"] == "busy"


def test_a_canned_error_status_says_its_reason_as_every_refusal_does(clock):
    # An audit of what clients see: a canned fallback's 503 carried x-extproc-decision and the body's code but no
    # x-extproc-reason, which the README promises on every refusal.
    s, answer = over_a_full_class_canned(clock, 503)
    assert immediate_status(answer) == 503 and s.held is None
    headers = {h.header.key: h.header.raw_value for h in answer.immediate_response.headers.set_headers}
    assert headers["x-extproc-reason"] == b"queue_full"
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "queue_full"


# --- the final admission ---

def queued(p: Processor, **headers: bytes):
    """(the stream holding the class's one slot, a stream queued behind it with `headers`, its final admission)"""
    first, _ = admitted(p)
    s = Stream(p)
    s.receive(request_headers(**headers))
    return first, s, s.receive(request_body())


def test_a_full_class_returns_the_final_admission_to_wait_for(clock):
    p = processor(clock, **QUEUE_OF_ONE)
    _, s, answer = queued(p)
    assert isinstance(answer, FinalAdmission) and answer.queued
    assert s.phase is Phase.ADMITTING and s.held is answer


def test_a_message_while_waiting_for_the_final_admission_is_a_driver_error(clock):
    p = processor(clock, **QUEUE_OF_ONE)
    _, s, _ = queued(p)
    with pytest.raises(RuntimeError, match="waiting for the final admission"):
        s.receive(response_headers())


def test_the_queue_verdict_goes_back_in_and_says_how_long_it_waited(clock):
    p = processor(clock, **QUEUE_OF_ONE)
    first, s, wait = queued(p)
    clock.advance(0.0625)
    first.end(normal_end=True)
    answer = s.admitted(wait.waiter.result)
    assert s.phase is Phase.FORWARDING and set_headers(answer)["x-extproc-queue-wait-ms"] == b"62"


def test_a_queue_timeout_is_answered_429(clock):
    p = processor(clock, **QUEUE_OF_ONE)
    _, s, wait = queued(p)
    clock.advance(0.2)
    p.core.reap()
    assert immediate_status(s.admitted(wait.waiter.result)) == 429 and s.phase is Phase.ANSWERED


# --- the response ---

def test_response_phases_before_the_admission_are_continued(clock):
    s = Stream(processor(clock))
    s.receive(request_headers())
    assert s.receive(response_headers()) is CONTINUE["response_headers"]
    assert s.receive(response_body(b"{}")) is CONTINUE["response_body"]
    assert s.phase is Phase.BODY


def test_trailers_are_continued_in_every_phase(clock):
    s, _ = admitted(processor(clock))
    trailers = pb.ProcessingRequest(response_trailers=pb.HttpTrailers())
    assert s.receive(trailers) is CONTINUE["response_trailers"]


def test_a_learned_200_response_switches_to_reading_its_usage(clock):
    s, _ = admitted(processor(clock, learn_sample=1.0))
    assert s.receive(response_headers()) is LEARN_BODY[False]
    assert s.phase is Phase.READING_USAGE


def test_a_response_that_is_not_learned_is_only_forwarded(clock):
    s, _ = admitted(processor(clock))
    assert s.receive(response_headers()) is CONTINUE["response_headers"]
    assert s.phase is Phase.FORWARDING


def test_an_error_response_is_not_read_for_usage(clock):
    s, _ = admitted(processor(clock, learn_sample=1.0))
    assert s.receive(response_headers(503)) is CONTINUE["response_headers"]
    assert s.phase is Phase.FORWARDING


def refunded(clock):
    """A tenant with a tokens-per-minute limit: its non-streamed responses are read for the refund."""
    return processor(clock, tenants=[{"name": "acme", "api_keys": ["sk-acme"], "tokens_per_minute": 10**6}])


def test_a_refund_reads_a_buffered_response(clock):
    s, _ = admitted(refunded(clock), authorization=b"Bearer sk-acme")
    assert s.receive(response_headers()) is LEARN_BODY[False]


@pytest.mark.parametrize("learn_sample", [0.0, 1.0])
def test_a_beam_search_answer_is_not_read_for_usage(clock, learn_sample):
    # vLLM's beam search runs n beams to max_tokens whatever EOS says, but its usage counts only the beams it
    # answers with (short ones where they ended at EOS): read, it refunded the tenant's up-front charge of n x cap.
    p = processor(clock, learn_sample=learn_sample,
                  tenants=[{"name": "acme", "api_keys": ["sk-acme"], "tokens_per_minute": 10**6}])
    doc = {"model": "llama", "messages": HI, "use_beam_search": True, "n": 4, "max_tokens": 500}
    s, _ = admitted(p, doc, authorization=b"Bearer sk-acme")
    assert s.receive(response_headers()) is CONTINUE["response_headers"]
    assert s.phase is Phase.FORWARDING
    assert not s.request.facts.reads_usage


def test_an_event_stream_is_read_only_for_a_learning_sample(clock):
    s, _ = admitted(refunded(clock), {"model": "llama", "messages": HI, "stream": True},
                    authorization=b"Bearer sk-acme")
    assert s.receive(response_headers(content_type=b"text/event-stream")) is CONTINUE["response_headers"]
    assert s.phase is Phase.FORWARDING


def answer_with_usage(usage: dict, size: int) -> bytes:
    """A non-streamed chat answer of about `size` bytes (logprobs) as vLLM writes it: compact, usage after the
    choices, then the fields that follow it."""
    logprobs = {"content": [{"token": "tok", "logprob": -0.5}] * (size // 32)}
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "see logprobs"}, "logprobs": logprobs}],
        "usage": usage, "prompt_logprobs": None, "kv_transfer_params": None}, separators=(",", ":")).encode()


@pytest.mark.parametrize("length", [1001, None])
def test_a_response_over_the_buffer_limit_or_of_unknown_size_is_read_as_it_comes(clock, length):
    # Envoy buffers a body it hands over whole only up to its limit (past it the client got a 500 for an answer
    # the replica had computed): such an answer was not read at all, and its tenant kept the worst case charged at
    # admission. Now each piece is passed on as it is, and the usage read from the end kept.
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "max_tokens": 100})
    assert s.receive(response_headers(content_length=length)) is LEARN_BODY[True]  # STREAMED, headers unchanged
    raw = answer_with_usage({"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}, 20_000)
    pieces = [raw[i:i + 999] for i in range(0, len(raw), 999)]
    for i, piece in enumerate(pieces):
        assert s.receive(response_body(piece, eos=i == len(pieces) - 1)) is CONTINUE["response_body"]
        assert s.held.usage is None or i == len(pieces) - 1
    assert s.held.usage == (5, 7)
    assert s.usage.buffered == raw[-USAGE_TAIL:]  # only the end was kept


def test_a_large_response_that_is_not_json_is_not_read(clock):
    s, _ = admitted(processor(clock, learn_sample=1.0))
    assert s.receive(response_headers(content_type=b"text/plain", content_length=5000)) is \
        CONTINUE["response_headers"]
    assert s.phase is Phase.FORWARDING


def read_in_pieces(raw: bytes, cuts: list[int]) -> dict | None:
    """The usage a piecewise reader finds in `raw` handed over in pieces cut at `cuts`."""
    r = UsageReader(learn=False)
    r.piecewise = True
    edges = [0, *cuts, len(raw)]
    found = [r.answer_usage(raw[a:b], b == len(raw)) for a, b in zip(edges, edges[1:])]
    assert not any(found[:-1])  # nothing before the end
    assert len(r.buffered) <= USAGE_TAIL
    return found[-1]


USAGE = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


def test_the_tail_reader_finds_the_usage_wherever_the_pieces_are_cut():
    raw = answer_with_usage(USAGE, 50_000)
    at = raw.index(b'"usage"')
    for cuts in ([at + 3], [at + 9, at + 20], list(range(at - 100, len(raw), 7)), [100, 40_000],
                 list(range(1, len(raw), USAGE_TAIL + 1))):
        assert read_in_pieces(raw, cuts) == USAGE, cuts
    indented = json.dumps({"data": ["x" * 10_000], "usage": USAGE}, indent=2).encode()  # `"usage": {`
    assert read_in_pieces(indented, [5000]) == USAGE


@pytest.mark.parametrize("raw", [
    json.dumps({"choices": [{"message": {"content": "x" * 9000}}]}).encode(),  # no usage at all
    json.dumps({"choices": [{"message": {"content": 'x' * 9000 + '"usage":{"prompt_tokens":1}'}}]}).encode(),
    b"\xff\xfe" * 5000 + b'"usage":{"prompt_tokens":',  # garbage, a usage never closed
    b'"usage":{"prompt_tokens":5,"completion_tokens":7}' + b"y" * USAGE_TAIL,  # out of the end kept
    b'{"usage":[1,2]}'])
def test_the_tail_reader_finds_no_usage_where_there_is_none_to_read(raw):
    assert read_in_pieces(raw, [len(raw) // 2]) is None


def test_a_buffered_response_usage_is_learned_at_its_end(clock):
    s, _ = admitted(processor(clock, learn_sample=1.0))
    s.receive(response_headers())
    s.receive(response_body(b'{"usage":{"prompt_tokens":3,'))
    assert s.held.usage is None
    s.receive(response_body(b'"completion_tokens":4}}', eos=True))
    assert s.held.usage == (3, 4)


SSE = b"text/event-stream"
USAGE_EVENT = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}'


@pytest.mark.parametrize("content_type", [b"application/json", SSE])
def test_a_compressed_response_is_not_read_for_usage(clock, content_type):
    # Compressed by something between vLLM and Envoy: no usage can be found in it, and read as an event stream
    # its bytes (with no blank line in them) were held back until 64 KiB had come, the client seeing nothing.
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI,
                                                         "stream": content_type == SSE})
    answer = s.receive(response_headers(content_type=content_type, content_encoding=b"gzip"))
    assert answer is CONTINUE["response_headers"] and s.phase is Phase.FORWARDING
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI})
    assert s.receive(response_headers(content_encoding=b"identity")) is LEARN_BODY[False]


def test_a_learned_stream_asks_vllm_for_its_usage_chunk(clock):
    _, answer = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "stream": True})
    body = json.loads(answer.request_body.response.body_mutation.body)
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}


def test_a_learned_stream_does_not_turn_on_the_clients_continuous_usage(clock):
    # continuous_usage_stats acts only with include_usage: the client saw no usage and must not get it per chunk
    doc = {"model": "llama", "messages": HI, "stream": True,
           "stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    _, answer = admitted(processor(clock, learn_sample=1.0), doc)
    body = json.loads(answer.request_body.response.body_mutation.body)
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}


def test_the_usage_chunk_the_client_did_not_ask_for_is_stripped(clock):
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "stream": True})
    assert s.receive(response_headers(content_type=SSE)) is LEARN_BODY[True]
    answer = s.receive(response_body(USAGE_EVENT + b"\n\ndata: [DONE]\n\n"))
    assert answer.response_body.response.body_mutation.body == b"data: [DONE]\n\n"
    assert s.held.usage == (5, 7)


def test_a_usage_event_split_over_two_chunks_is_still_stripped_and_learned(clock):
    # the replica wrote it in two writes: the client must not get a "choices":[] chunk it never asked for
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "stream": True})
    s.receive(response_headers(content_type=SSE))
    token = b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
    first = s.receive(response_body(token + USAGE_EVENT[:30]))
    assert first.response_body.response.body_mutation.body == token  # the incomplete event is held back
    second = s.receive(response_body(USAGE_EVENT[30:] + b"\n\ndata: [DONE]\n\n", eos=True))
    assert second.response_body.response.body_mutation.body == b"data: [DONE]\n\n"
    assert s.held.usage == (5, 7)


def test_a_stream_ending_on_its_usage_event_without_a_blank_line_keeps_the_event_before_it_whole(clock):
    # the stripped usage event took the blank line before it along: the client got the last token's event
    # unterminated, which an SSE client never dispatches
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "stream": True})
    s.receive(response_headers(content_type=SSE))
    token = b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
    answer = s.receive(response_body(token + USAGE_EVENT, eos=True))
    assert answer.response_body.response.body_mutation.body == token
    assert s.held.usage == (5, 7)


def test_a_usage_event_after_an_event_too_long_to_hold_back_is_still_stripped_and_learned(clock):
    # An event over MAX_PARTIAL is passed on unfinished; when that ended on the first "\n" of its blank line, the
    # usage event after it began with the second one, was not recognised, and reached a client that never asked
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "stream": True})
    s.receive(response_headers(content_type=SSE))
    long = b'data: {"choices":[{"delta":{"content":"' + b"x" * MAX_PARTIAL + b'"}}]}\n'
    sent = b""
    for part, last in ((long, False), (b"\n" + USAGE_EVENT + b"\n\ndata: [DONE]\n\n", True)):
        answer = s.receive(response_body(part, eos=last)).response_body.response
        sent += answer.body_mutation.body if answer.HasField("body_mutation") else part
    assert sent == long + b"\ndata: [DONE]\n\n"
    assert s.held.usage == (5, 7)


def test_a_stream_whose_lines_end_in_crlf_is_passed_on_event_by_event_and_its_usage_chunk_stripped(clock):
    # The SSE spec lets a server end its lines with CRLF (sse-starlette does): its blank lines were not seen, so a
    # sampled stream reached its client only at 64 KiB or at its end, the usage chunk it never asked for included
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "stream": True})
    s.receive(response_headers(content_type=SSE))
    token = b'data: {"choices":[{"delta":{"content":"Hi"}}]}\r\n\r\n'
    first = s.receive(response_body(token + b"data: {"))
    assert first.response_body.response.body_mutation.body == token
    last = s.receive(response_body(USAGE_EVENT[7:] + b"\r\n\r\ndata: [DONE]\r\n\r\n", eos=True))
    assert last.response_body.response.body_mutation.body == b"data: [DONE]\r\n\r\n"
    assert s.held.usage == (5, 7)


def passed_on(s: Stream, raw: bytes, size: int) -> bytes:
    """What the client gets of a stream's `raw` bytes handed to the ext_proc in pieces of `size` bytes."""
    parts = [raw[i:i + size] for i in range(0, len(raw), size)]
    sent = b""
    for i, part in enumerate(parts):
        answer = s.receive(response_body(part, eos=i == len(parts) - 1)).response_body.response
        sent += answer.body_mutation.body if answer.HasField("body_mutation") else part
    return sent


TOKEN_EVENT = b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
# The usage chunk as a server or proxy that writes JSON with Python's default separators sends it (vLLM writes it
# compact): the choices and usage keys each followed by a space.
SPACED_USAGE_EVENT = b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}}\n\n'


@pytest.mark.parametrize("size", [1, 2, 5, 16, 1000])
def test_a_usage_chunk_written_with_spaces_is_stripped_and_learned(clock, size):
    # It was recognised only as `"choices":[]`: a client that never asked for usage got the chunk (one that reads
    # choices[0] of every chunk fails on it), and the sample learned nothing
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "stream": True})
    s.receive(response_headers(content_type=SSE))
    sent = passed_on(s, TOKEN_EVENT + SPACED_USAGE_EVENT + b"data: [DONE]\n\n", size)
    assert sent == TOKEN_EVENT + b"data: [DONE]\n\n"
    assert s.held.usage == (5, 7)


@pytest.mark.parametrize("size", [1, 2, 5, 16, 1000])
def test_a_usage_chunk_written_with_spaces_that_the_client_asked_for_reaches_it_unchanged(clock, size):
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    s.receive(response_headers(content_type=SSE))
    raw = TOKEN_EVENT + SPACED_USAGE_EVENT + b"data: [DONE]\n\n"
    assert passed_on(s, raw, size) == raw
    assert s.held.usage == (5, 7)


# The usage chunk in the other forms the SSE format allows: `data:` without its space, a comment line or other fields
# in the same event, its data over several `data:` lines (JSON pretty-printed, a line each).
USAGE_EVENT_FORMS = {
    "no space after data:": b'data:{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}\n\n',
    "a comment line first": b': ping\ndata: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}\n\n',
    "an id and a retry": b'id: 9\nretry: 1000\ndata: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}'
                         b'\n\n',
    "an event name": b'event: message\ndata: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}\n\n',
    "data over several lines": b"".join(b"data: %s\n" % line.encode() for line in json.dumps(
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}}, indent=2).split("\n")) + b"\n",
    "CRLF, several lines": b'data: {"choices": [],\r\ndata:"usage": {"prompt_tokens": 5,\r\ndata: '
                          b'"completion_tokens": 7}}\r\n\r\n',
}


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize("form", USAGE_EVENT_FORMS)
def test_a_usage_chunk_in_any_form_the_sse_format_allows_is_stripped_and_learned(clock, form, size):
    # Only an event that began with `data: {` was read: the chunk the gateway asked for reached a client that
    # never asked, and the sample learned nothing
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "stream": True})
    s.receive(response_headers(content_type=SSE))
    sent = passed_on(s, b": keep-alive\n\n" + TOKEN_EVENT + USAGE_EVENT_FORMS[form] + b"data: [DONE]\n\n", size)
    assert sent == b": keep-alive\n\n" + TOKEN_EVENT + b"data: [DONE]\n\n"
    assert s.held.usage == (5, 7)


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize("form", USAGE_EVENT_FORMS)
def test_a_usage_chunk_in_any_form_that_the_client_asked_for_reaches_it_unchanged(clock, form, size):
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    s.receive(response_headers(content_type=SSE))
    raw = b": keep-alive\n\n" + TOKEN_EVENT + USAGE_EVENT_FORMS[form] + b"data: [DONE]\n\n"
    assert passed_on(s, raw, size) == raw
    assert s.held.usage == (5, 7)


def test_events_are_passed_on_whole_and_nothing_is_lost_at_the_end(clock):
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    s.receive(response_headers(content_type=SSE))
    out = [s.receive(response_body(part, eos=last)) for part, last in
           ((b"data: {\"a\":", False), (b"1}\n\ndata: {\"b\"", False), (b":2}\n\n", True))]
    sent = [a.response_body.response.body_mutation.body if a.response_body.response.HasField("body_mutation")
            else part for a, part in zip(out, (b"data: {\"a\":", b"1}\n\ndata: {\"b\"", b":2}\n\n"))]
    assert sent == [b"", b'data: {"a":1}\n\n', b'data: {"b":2}\n\n']


def test_a_held_back_event_as_long_as_the_one_released_does_not_repeat_or_lose_a_byte(clock):
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    s.receive(response_headers(content_type=SSE))
    parts = (b'data: {"a":1', b'0}\n\ndata: {"bb":', b'2}\n\n')  # the second holds back as much as it releases
    out = b""
    for i, part in enumerate(parts):
        answer = s.receive(response_body(part, eos=i == len(parts) - 1)).response_body.response
        out += answer.body_mutation.body if answer.HasField("body_mutation") else part
    assert out == b'data: {"a":10}\n\ndata: {"bb":2}\n\n'


@pytest.mark.parametrize("usage", [{"prompt_tokens": 5, "completion_tokens": 9_000_000_000_000_000_000},
                                   {"prompt_tokens": -1, "completion_tokens": 3},
                                   {"prompt_tokens": 5, "completion_tokens": 1000},
                                   {"input_tokens": 5, "output_tokens": 9_000_000_000_000_000_000},
                                   {"input_tokens": 5}, 5, "5"])
def test_usage_no_answer_to_this_request_could_have_is_not_learned(clock, usage):
    # one absurd answer would lock the tenant's token bucket for ages (Retry-After 1.8e17 s) and skew the model
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "max_tokens": 100})
    s.receive(response_headers())
    s.receive(response_body(json.dumps({"usage": usage}).encode(), eos=True))
    assert s.held.usage is None


def settled(clock, doc: dict, usage: dict, path: bytes = CHAT, endpoints: dict | None = None, **models):
    """A refunded tenant's non-streamed request answered with `usage`: (its ticket, tokens the bucket lost, the model's
    cost profile)."""
    p = processor(clock, tenants=[{"name": "acme", "api_keys": ["sk-acme"], "tokens_per_minute": 10**6}],
                  models={"llama": {"cluster": "pool_a", **models}}, endpoints=endpoints or {})
    s, _ = admitted(p, doc, path=path, authorization=b"Bearer sk-acme")
    bucket = s.held.charge.tenant.tokens
    before = bucket.capacity  # full until this request
    s.receive(response_headers())
    s.receive(response_body(json.dumps({"usage": usage}).encode(), eos=True))
    ticket = s.held
    s.end(normal_end=True)
    p.core.report(ticket.id, Completion(Outcome.OK, 200, 0.1, 1.0))  # Envoy's access log: the usage is settled
    return ticket, before - bucket.level, p.core.cost_models["llama"]


NO_CAP = {"model": "llama", "messages": [{"role": "user", "content": "write a long story"}]}


def test_a_rerank_answers_usage_of_total_tokens_only_settles_the_tenant(clock):
    # vLLM's rerank usage is {"total_tokens": N} (prefill only): read as no usage, the tenant kept the worst case
    # charged up front for every rerank.
    doc = {"model": "llama", "query": "q" * 40, "documents": ["d" * 400]}
    ticket, spent, _ = settled(clock, doc, {"total_tokens": 37}, path=b"/v1/rerank",
                                endpoints={"embeddings": True})
    assert ticket.usage == (37, 0) and spent == pytest.approx(37, abs=1)


def test_usage_past_the_assumed_output_is_charged_and_learned_when_the_client_set_no_cap(clock):
    # vLLM's own default is the rest of the context, not the policy's default_max_tokens (1024 here)
    ticket, spent, model = settled(clock, NO_CAP, {"prompt_tokens": 12, "completion_tokens": 5000})
    assert ticket.charge.estimate.max_tokens == 1024
    assert ticket.usage == (12, 5000)
    assert spent == pytest.approx(5012, abs=1)
    assert model.samples == 1


def test_without_a_cap_usage_past_the_models_context_is_still_not_believed(clock):
    ticket, spent, model = settled(clock, NO_CAP, {"prompt_tokens": 12, "completion_tokens": 9000},
                                   cost={"max_context_tokens": 8192})
    assert ticket.usage is None and model.samples == 0
    ticket, _, _ = settled(clock, NO_CAP, {"prompt_tokens": 12, "completion_tokens": 8000},
                           cost={"max_context_tokens": 8192})
    assert ticket.usage == (12, 8000)


RESPONSES = b"/v1/responses"
RESPONSES_USAGE = {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 3000,
                   "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 3012}


def responses_event(kind: str, **fields) -> bytes:
    """One Responses API stream event as vLLM writes it: a named event, its JSON compact."""
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), json.dumps({"type": kind, **fields},
                                                                       separators=(",", ":")).encode())


def test_a_non_streamed_responses_answer_settles_the_tenant_at_its_real_usage(clock):
    # the Responses API says input/output tokens; its usage was never read, so the worst case stood
    doc = {"model": "llama", "input": "write a long story"}
    ticket, spent, model = settled(clock, doc, RESPONSES_USAGE, path=RESPONSES)
    assert ticket.usage == (12, 3000)
    assert spent == pytest.approx(3012, abs=1)
    assert model.samples == 1


def test_a_streamed_responses_answer_is_learned_from_its_completed_event_which_reaches_the_client(clock):
    p = processor(clock, learn_sample=1.0)
    s, answer = admitted(p, {"model": "llama", "input": "hi", "stream": True}, path=RESPONSES)
    # its last event always carries the usage: the body goes upstream as the client wrote it
    assert not answer.request_body.response.HasField("body_mutation")
    s.receive(response_headers(content_type=SSE))
    created = responses_event("response.created", sequence_number=0,
                              response={"id": "resp_1", "status": "in_progress", "usage": None})
    delta = responses_event("response.output_text.delta", sequence_number=1, item_id="m1", output_index=0,
                            content_index=0, delta="Hi")
    completed = responses_event("response.completed", sequence_number=2,
                                response={"id": "resp_1", "status": "completed", "usage": RESPONSES_USAGE})
    assert s.receive(response_body(created + delta)) is CONTINUE["response_body"]
    assert s.held.usage is None
    first = s.receive(response_body(completed[:40]))  # split over two writes: held back until whole
    assert first.response_body.response.body_mutation.body == b""
    last = s.receive(response_body(completed[40:], eos=True))
    assert last.response_body.response.body_mutation.body == completed
    assert s.held.usage == (12, 3000)


def test_a_responses_answer_too_long_to_hold_back_is_still_learned_from_its_completed_event(clock):
    # The last event carries the whole response (its output, the request's instructions): past MAX_PARTIAL it is
    # passed on in pieces, and its usage, parsed only from a whole event, was never read
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "input": "hi", "stream": True},
                    path=RESPONSES)
    s.receive(response_headers(content_type=SSE))
    completed = responses_event("response.completed", response={
        "id": "resp_1", "status": "completed", "output": [{"content": [{"text": "y" * MAX_PARTIAL}]}],
        "usage": RESPONSES_USAGE, "user": None}, sequence_number=2)
    at = completed.index(b'"usage":') + 20  # cut inside the usage object too
    parts = (completed[:MAX_PARTIAL // 2], completed[MAX_PARTIAL // 2:at], completed[at:], b"")
    for i, part in enumerate(parts):
        s.receive(response_body(part, eos=i == len(parts) - 1))
    assert s.held.usage == (12, 3000)


def responses_event_as(form: str, kind: str, **fields) -> bytes:
    """A Responses stream event as a server other than vLLM, or a proxy re-writing vLLM's, may send it."""
    doc = {"type": kind, **fields}
    if form == "vLLM":
        return responses_event(kind, **fields)
    if form == "JSON with spaces":
        return b"event: %s\ndata: %s\n\n" % (kind.encode(), json.dumps(doc).encode())
    data = json.dumps(doc, separators=(",", ":")).encode()
    if form == "no space after the field names":
        return b"event:%s\ndata:%s\n\n" % (kind.encode(), data)
    if form == "an id first, CRLF":
        return b"id: 3\r\nevent: %s\r\ndata: %s\r\n\r\n" % (kind.encode(), data)
    assert form == "data over several lines"
    lines = json.dumps(doc, indent=1).split("\n")
    return b"event: %s\n%s\n" % (kind.encode(), b"".join(b"data: %s\n" % line.encode() for line in lines))


RESPONSES_FORMS = ["JSON with spaces", "no space after the field names", "an id first, CRLF", "data over several lines"]


@pytest.mark.parametrize("size", [1, 7, 1 << 20])
@pytest.mark.parametrize("form", RESPONSES_FORMS)
def test_a_responses_stream_in_any_form_the_sse_format_allows_is_learned_and_passed_on_unchanged(clock, form, size):
    # Its completed event was read only as `data: {...}` with `"usage":{` compact: the sample learned nothing
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "input": "hi", "stream": True},
                    path=RESPONSES)
    s.receive(response_headers(content_type=SSE))
    raw = (responses_event_as(form, "response.created", response={"id": "r", "usage": None})
           + responses_event_as(form, "response.output_text.delta", delta="Hi")
           + responses_event_as(form, "response.completed", response={"id": "r", "usage": RESPONSES_USAGE}))
    assert passed_on(s, raw, size) == raw
    assert s.held.usage == (12, 3000)


@pytest.mark.parametrize("form", RESPONSES_FORMS)
def test_a_responses_completed_event_too_long_to_hold_back_in_any_form_is_learned(clock, form):
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "input": "hi", "stream": True},
                    path=RESPONSES)
    s.receive(response_headers(content_type=SSE))
    completed = responses_event_as(form, "response.completed", response={
        "id": "r", "output": [{"content": [{"text": "y" * 2 * MAX_PARTIAL}]}], "usage": RESPONSES_USAGE, "user": None})
    assert passed_on(s, completed, MAX_PARTIAL // 3) == completed
    assert s.held.usage == (12, 3000)


@pytest.mark.parametrize("form", ["vLLM", "JSON with spaces"])
def test_a_responses_stream_reports_its_first_token_at_the_first_delta(clock, form):
    seen = []
    p = processor(clock, learn_sample=1.0)
    p.core.events.first_token = lambda ticket, seconds: seen.append(seconds)
    s, _ = admitted(p, {"model": "llama", "input": "hi", "stream": True}, path=RESPONSES)
    s.receive(response_headers(content_type=SSE))
    s.receive(response_body(responses_event_as(form, "response.created", response={"id": "r", "usage": None})))
    clock.advance(0.5)
    s.receive(response_body(responses_event_as(form, "response.output_text.delta", delta="Hi")))
    assert seen == [0.5]


def test_the_usage_chunk_the_client_asked_for_is_kept(clock):
    s, _ = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    s.receive(response_headers(content_type=SSE))
    assert s.receive(response_body(USAGE_EVENT + b"\n\n")) is CONTINUE["response_body"]
    assert s.held.usage == (5, 7)


@pytest.mark.parametrize("options", [{"include_usage": True}, {"include_usage": "true"}, {"include_usage": 1}])
def test_a_stream_whose_options_turn_vllms_include_usage_on_keeps_its_usage_chunk(clock, options):
    # The client asked for the usage chunk: the gateway must neither strip it nor turn the client's options into
    # its own
    s, answer = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "stream": True,
                                                              "stream_options": options})
    assert not answer.request_body.response.HasField("body_mutation")  # forwarded as the client wrote it
    s.receive(response_headers(content_type=SSE))
    assert s.receive(response_body(USAGE_EVENT + b"\n\ndata: [DONE]\n\n")) is CONTINUE["response_body"]
    assert s.held.usage == (5, 7)


@pytest.mark.parametrize("options", [{"include_usage": False}, {"include_usage": None}, {"include_usage": "false"},
                                     {"include_usage": "no"}, {"include_usage": 0}, {},
                                     {"continuous_usage_stats": True}])
def test_a_stream_whose_options_leave_vllms_include_usage_off_gets_it_asked_for_and_stripped(clock, options):
    # vLLM 0.32's StreamOptions defaults include_usage to false, `{}` included (recorded: tests/fixtures/vllm/
    # differential.json), and pydantic reads "false", "no" and 0 as false: vLLM sends no usage chunk, so the
    # learning sample must ask for it, and strip it. (`{}` and continuous_usage_stats alone were taken to ask for
    # it: the sample's usage never came.)
    s, answer = admitted(processor(clock, learn_sample=1.0), {"model": "llama", "messages": HI, "stream": True,
                                                              "stream_options": options})
    body = json.loads(answer.request_body.response.body_mutation.body)
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    s.receive(response_headers(content_type=SSE))
    answer = s.receive(response_body(USAGE_EVENT + b"\n\ndata: [DONE]\n\n"))
    assert answer.response_body.response.body_mutation.body == b"data: [DONE]\n\n"
    assert s.held.usage == (5, 7)


def streaming(clock):
    """A learned stream past its response headers, and the first-token times it reports."""
    seen = []
    p = processor(clock, learn_sample=1.0)
    p.core.events.first_token = lambda ticket, seconds: seen.append(seconds)
    s, _ = admitted(p, {"model": "llama", "messages": HI, "stream": True})
    s.receive(response_headers(content_type=SSE))
    return s, seen


def test_the_first_token_is_reported_once_from_arrival(clock):
    s, seen = streaming(clock)
    clock.advance(0.25)
    s.receive(response_body(b'data: {"choices":[{"delta":{"content":""}}]}\n\n'))  # the role chunk: no text
    s.receive(response_body(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'))
    s.receive(response_body(b'data: {"choices":[{"delta":{"content":"!"}}]}\n\n'))
    assert seen == [0.25]


def test_a_first_token_written_with_spaces_is_reported(clock):
    # Read only as vLLM's compact `"content":"H`: a server or proxy writing `"content": "Hi"` never reported one
    s, seen = streaming(clock)
    clock.advance(0.25)
    s.receive(response_body(b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'))
    clock.advance(0.25)
    s.receive(response_body(b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n'))
    assert seen == [0.5]


@pytest.mark.parametrize("field", [b"reasoning", b"reasoning_content"])
def test_a_reasoning_models_first_token_is_its_first_reasoning_delta(clock, field):
    # vLLM streams a reasoning model's thinking as delta.reasoning (reasoning_content before 0.11): its first
    # token, not the first answer token minutes of thinking later
    s, seen = streaming(clock)
    clock.advance(0.25)
    s.receive(response_body(b'data: {"choices":[{"delta":{"%s":"Let me"}}]}\n\n' % field))
    clock.advance(5.0)
    s.receive(response_body(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'))
    assert seen == [0.25]


def test_a_tool_calls_first_token_is_its_first_generated_argument(clock):
    # A stream that only calls a tool never sends content: its time to first token went unobserved. The function's
    # name is not read as one: a Responses stream's first event echoes the request's tools, names included.
    s, seen = streaming(clock)
    s.receive(response_body(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'))
    clock.advance(0.4)
    s.receive(response_body(b'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"name":"get",'
                            b'"arguments":""}}]}}]}\n\n'))
    clock.advance(0.1)
    s.receive(response_body(b'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":'
                            b'{"arguments":"{\\"city"}}]}}]}\n\n'))
    assert seen == [pytest.approx(0.5)]


# --- the end ---

def ended_outcome(s, normal_end: bool):
    ticket = s.held
    s.end(normal_end)
    return ticket.stream_outcome


def test_a_normal_end_after_the_response_closes_the_ticket_ok(clock):
    p = processor(clock, learn_sample=1.0)
    s, _ = admitted(p)
    s.receive(response_headers())
    s.receive(response_body(b"{}", eos=True))
    assert ended_outcome(s, normal_end=True) is Outcome.OK
    assert s.phase is Phase.ENDED and inflight(p) == 0 and not p.live


def test_a_normal_end_without_a_response_status_is_ended(clock):
    s, _ = admitted(processor(clock))
    assert ended_outcome(s, normal_end=True) is Outcome.ENDED


def test_a_5xx_response_ends_as_an_upstream_error(clock):
    s, _ = admitted(processor(clock, learn_sample=1.0))
    s.receive(response_headers(502))
    assert ended_outcome(s, normal_end=True) is Outcome.UPSTREAM_ERROR


def with_details(msg: pb.ProcessingRequest, details: str, filter_name: str = "envoy.filters.http.ext_proc"):
    """The message with envoy.yaml's response attribute, as Envoy sends it (a Struct under the filter's name)."""
    msg.attributes[filter_name].fields[protocol.CODE_DETAILS].string_value = details
    return msg


@pytest.mark.parametrize("details", ["cluster_not_found", "route_not_found", "direct_response"])
def test_a_response_envoy_answered_itself_ends_not_routed_and_is_not_read(clock, details):
    """Where no access log reports the request, its response headers' code details are all that tells Envoy's own
    503 cluster_not_found (a policy routing to a cluster Envoy lacks) from the pool's: it ended as the pool's
    upstream_error, and one opened the class's error breaker."""
    s, _ = admitted(processor(clock, learn_sample=1.0))
    assert s.receive(with_details(response_headers(503), details)) is CONTINUE["response_headers"]
    assert s.phase is Phase.FORWARDING  # nothing of Envoy's own answer is read for usage
    assert ended_outcome(s, normal_end=True) is Outcome.NOT_ROUTED


def test_envoys_own_200_is_not_routed_either_and_its_body_is_not_read(clock):
    s, _ = admitted(processor(clock, learn_sample=1.0))
    msg = with_details(response_headers(200), "direct_response", "envoy.filters.http.ext_proc/envoyextensionpolicy/x")
    assert s.receive(msg) is CONTINUE["response_headers"]
    assert ended_outcome(s, normal_end=True) is Outcome.NOT_ROUTED


@pytest.mark.parametrize(("status", "details", "outcome"), [
    (200, "via_upstream", Outcome.OK), (503, "via_upstream", Outcome.UPSTREAM_ERROR),
    (503, "no_healthy_upstream", Outcome.UPSTREAM_ERROR), (504, "upstream_response_timeout", Outcome.UPSTREAM_ERROR)])
def test_a_response_of_the_pool_ends_as_before_with_its_details(clock, status, details, outcome):
    s, _ = admitted(processor(clock, learn_sample=1.0))
    s.receive(with_details(response_headers(status), details))
    if s.phase is Phase.READING_USAGE:
        s.receive(response_body(b"{}", eos=True))
    assert ended_outcome(s, normal_end=True) is outcome


def test_a_stream_cut_before_its_end_is_a_client_abort(clock):
    s, _ = admitted(processor(clock))
    assert ended_outcome(s, normal_end=False) is Outcome.CLIENT_ABORT


@pytest.mark.parametrize("sse", [False, True])
def test_a_response_read_to_its_end_is_ok_and_one_cut_short_is_a_client_abort(clock, sse):
    """Envoy closes the stream the same way when the request is done and when its client leaves: only a body we
    read tells them apart, by whether its last message came."""
    p = processor(clock, learn_sample=1.0)
    for last in (True, False):
        s, _ = admitted(p, {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "stream": sse})
        s.receive(response_headers(content_type=b"text/event-stream" if sse else b"application/json"))
        assert s.phase is Phase.READING_USAGE
        s.receive(response_body(b'data: {"choices":[]}\n\n' if sse else b"{}", eos=last))
        assert ended_outcome(s, normal_end=True) is (Outcome.OK if last else Outcome.CLIENT_ABORT)
    assert inflight(p) == 0


def test_a_response_without_a_body_ends_at_its_headers(clock):
    s, _ = admitted(processor(clock, learn_sample=1.0))
    msg = response_headers(content_length=0)
    msg.response_headers.end_of_stream = True
    s.receive(msg)
    assert s.phase is Phase.READING_USAGE
    assert ended_outcome(s, normal_end=True) is Outcome.OK


def test_ending_twice_releases_once(clock):
    p = processor(clock)
    s, _ = admitted(p)
    other, _ = admitted(p)
    s.end(normal_end=True)
    s.end(normal_end=True)
    assert inflight(p) == 1


def test_a_client_leaving_while_queued_leaves_the_queue(clock):
    p = processor(clock, **QUEUE_OF_ONE)
    _, s, wait = queued(p)
    waiter = wait.waiter
    s.end(normal_end=False)
    assert waiter.result.status == 499 and p.core.snapshot()["interactive"]["queue"] == 0


@pytest.mark.parametrize("ends", ["client_left", "handler_failed"])
def test_a_slot_granted_in_the_instant_the_client_left_is_counted_as_leaving_the_queue(clock, ends):
    # The queue grants the slot (another request's end, in the same loop turn) before the stream's wait has
    # resumed, and the stream ends first: the request never went upstream. Closed as a client abort, it was an
    # admission with a client_abort outcome and duration, a drain-rate completion, its tenant charged its expected
    # output and a report awaited that never comes. Taken back without a count (886553e, reverted), the admission
    # counted when granted had no outcome. Now it is what a client leaving a moment earlier is: one 499.
    events = RecordedEvents()
    p = processor(clock, events=events, **{**QUEUE_OF_ONE, "tenants": [
        {"name": "acme", "api_keys": ["sk-acme"], "tokens_per_minute": 10**6}]})
    first, s, wait = queued(p, authorization=b"Bearer sk-acme")  # the first is anonymous: acme pays the second
    bucket = p.core.tenant_limits["acme"].tokens
    assert bucket.refill(clock()) < bucket.capacity  # charged while it waits
    first.end(normal_end=True)  # the queue grants the slot; the stream has not been handed it yet
    granted = wait.waiter.result.ticket
    drained = p.core.limiters["interactive"].drain._count
    if ends == "handler_failed":
        assert s.fail() is protocol.INTERNAL_ERROR
    s.end(normal_end=False)
    assert granted.closed and inflight(p) == 0 and not p.core.tickets and not p.live
    assert bucket.refill(clock()) == bucket.capacity  # its charge given back (the clock has not moved)
    assert p.core.limiters["interactive"].drain._count == drained
    assert p.core.limiters["interactive"].queue.stats["acme"].served_gpu_s == pytest.approx(0.0)  # nothing served
    clock.advance(REPORT_WAIT_S + 1)
    p.core.reap()  # every ticket still awaiting Envoy's report is accounted now
    admission, left = events.decisions  # the first's admission; the second's one decision
    assert admission.kind == ACCEPT and (left.kind, left.reason, left.status) == (REJECT, R_CLIENT_GONE, 499)
    assert events.accounted == [(admission.ticket, Outcome.ENDED)]  # the first's alone


def test_every_admission_counted_has_exactly_one_outcome_however_its_stream_ends(clock, monkeypatch):
    # extproc_requests_total's admissions and the outcomes (extproc_request_duration_seconds) must match one to one
    # (tests/reliability: the abort storm through Envoy, the protocol fuzz). An admission the stream takes back
    # before forwarding it had none: the 413 of a body re-encoded past the limit, an answer that failed to build,
    # and (886553e) a grant that came as the client left.
    events = RecordedEvents()
    p = processor(clock, events=events, **QUEUE_OF_ONE)

    def granted_as_it_ends(how: str) -> None:
        first, s, _ = queued(p)
        first.end(normal_end=True)
        if how == "failed":
            s.fail()
        elif how == "forwarded":
            s.admitted(s.held.waiter.result)
        s.end(normal_end=False)

    granted_as_it_ends("left")
    granted_as_it_ends("failed")
    granted_as_it_ends("forwarded")  # taken and forwarded: an admission, ended as a client abort
    grows = (b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "priority": -100, "x": ['
             + b",".join([b"1e15"] * 150) + b"]}")
    s = Stream(p)
    s.receive(request_headers())
    assert immediate_status(s.receive(request_body(grows))) == 413
    s.end(normal_end=True)
    with monkeypatch.context() as m:
        m.setattr(protocol, "forward", lambda *a: 1 / 0)
        s = Stream(p)
        s.receive(request_headers())
        with pytest.raises(ZeroDivisionError):
            s.receive(request_body())
        s.fail()
        s.end(normal_end=False)
    first, s, _ = queued(p)
    s.end(normal_end=False)  # left while queued
    first.end(normal_end=True)
    clock.advance(REPORT_WAIT_S + 1)
    p.core.reap()
    admissions = [d.ticket for d in events.decisions if d.ticket is not None]
    assert sorted(t.id for t in admissions) == sorted(t.id for t, _ in events.accounted)
    assert len(admissions) == 5  # the three firsts, the forwarded grant, the last first
    assert sum(d.kind == REJECT and d.status == 499 for d in events.decisions) == 3
    assert inflight(p) == 0 and not p.core.tickets and not p.core._unreported


# --- our own failures ---

def test_a_failure_before_the_decision_is_refused_500(clock):
    s = Stream(processor(clock))
    s.receive(request_headers())
    assert s.fail() is protocol.INTERNAL_ERROR and s.phase is Phase.ANSWERED


def test_our_own_failure_says_its_reason_like_every_other_refusal():
    """docs/troubleshooting.md: `x-extproc-reason` on every invalid answer, the body's error.code the same. The 500
    of our own failure carried `x-extproc-decision: invalid` and no reason header: a log or dashboard keyed on
    the header saw it as no refusal of ours."""
    answer = protocol.INTERNAL_ERROR.immediate_response
    headers = {h.header.key: h.header.raw_value for h in answer.headers.set_headers}
    assert answer.status.code == 500 and headers["x-extproc-decision"] == b"invalid"
    assert headers.get("x-extproc-reason") == b"admission_error"
    assert json.loads(answer.body)["error"]["code"] == "admission_error"


def test_a_failure_after_the_decision_is_not_the_streams_to_answer(clock):
    s, _ = admitted(processor(clock))
    with pytest.raises(RuntimeError, match="admitted, forwarding"):
        s.fail()


def test_a_slot_taken_by_an_answer_that_failed_to_build_is_given_back(clock, monkeypatch):
    p = processor(clock)
    s = Stream(p)
    s.receive(request_headers())
    monkeypatch.setattr(protocol, "forward", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        s.receive(request_body())
    assert s.fail() is protocol.INTERNAL_ERROR
    s.end(normal_end=False)
    assert inflight(p) == 0 and not p.live and not p.core.tickets


def test_a_slot_taken_by_an_answer_that_failed_to_build_is_taken_back_as_never_run(clock, monkeypatch):
    # The client got our 500 and the request never went upstream: released as a client abort of a request that
    # ran, it was a drain-rate completion, its tenant charged its expected output and a report awaited that never
    # comes (as the 413 after admission was).
    p = processor(clock, tenants=[{"name": "acme", "api_keys": ["sk-acme"], "tokens_per_minute": 10**6}])
    s = Stream(p)
    s.receive(request_headers(authorization=b"Bearer sk-acme"))
    monkeypatch.setattr(protocol, "forward", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        s.receive(request_body())
    ticket = s.held
    s.fail()
    s.end(normal_end=False)
    bucket = p.core.tenant_limits["acme"].tokens
    assert bucket.refill(clock()) == bucket.capacity and p.core.limiters["interactive"].drain._count == 0.0
    assert ticket.closed and not p.core._unreported and inflight(p) == 0 and not p.live


# --- Gateway API Inference Extension headers and the deadline header (read only where the policy names them) ---

GIE_CLASSIFY = {"objective_header": "x-gateway-inference-objective",
                "fairness_header": "x-gateway-inference-fairness-id", "deadline_header": "x-request-deadline-ms",
                "objectives": {"best-effort": "batch"}}
HEADERS_ONLY = {k: v for k, v in GIE_CLASSIFY.items() if k != "objectives"}


def test_the_objective_header_claims_the_class_when_the_policy_reads_it(clock):
    p = processor(clock, classify=GIE_CLASSIFY)
    _, answer = admitted(p, x_gateway_inference_objective=b"best-effort")
    assert set_headers(answer)["x-extproc-class"] == b"batch"
    _, answer = admitted(processor(clock), x_gateway_inference_objective=b"best-effort")
    assert set_headers(answer)["x-extproc-class"] == b"interactive"  # not read: the default class


def test_the_fairness_id_header_names_the_flow_of_a_class_keyed_by_header(clock):
    p = processor(clock, classify=HEADERS_ONLY, classes={"interactive": {
        "max_concurrency": 1, "max_queue": 1, "max_wait_ms": 100, "fairness": {"mode": "fair", "key": "header"}}},
        tenants=[])
    admitted(p, x_gateway_inference_fairness_id=b"team-7")
    flows = p.core.limiters["interactive"].queue
    assert flows.virtual_time("anonymous\x00team-7") > 0.0  # no API key: inside the anonymous tenant


def test_the_deadline_header_bounds_the_wait_of_a_queued_request(clock):
    p = processor(clock, classify=HEADERS_ONLY, **QUEUE_OF_ONE)
    admitted(p)
    s = Stream(p)
    s.receive(request_headers(x_request_deadline_ms=b"20"))
    held = s.receive(request_body())
    assert isinstance(held, FinalAdmission)
    assert held.waiter.deadline == pytest.approx(clock() + 0.02)


def test_a_deadline_that_is_not_a_number_is_ignored():
    assert protocol.deadline_ms(b"soon") is None and protocol.deadline_ms(b"-5") is None
    assert protocol.deadline_ms(b"inf") is None and protocol.deadline_ms(b"250") == 250.0


def test_a_list_of_prompts_is_clamped_to_the_context_one_prompt_at_a_time(clock):
    # vLLM runs each prompt of a completions list as its own request, each with its own context: three 1,000-token
    # prompts with max_tokens 1,000 in a 2,048 context make 3,000 tokens of output. Clamped against the prompts'
    # sum (3,000 > 2,048) the estimate was 3 tokens of output, and the batch was admitted almost for free.
    models = {"llama": {"cluster": "pool_a", "cost": {"max_context_tokens": 2048}}, "small": {"cluster": "pool_b"}}
    p = Processor(AdmissionController(make_policy(models=models), clock=clock), max_body_bytes=100_000)
    prompt = "word " * 800  # 4,000 characters: 1,000 tokens at the default 4 characters a token
    s, _ = admitted(p, {"model": "llama", "prompt": [prompt] * 3, "max_tokens": 1000},
                    path=b"/v1/completions")
    est = s.held.charge.estimate
    assert (est.prompt_tokens, est.max_tokens) == (3000, 3000)
    assert est.tokens == 6000  # what a tokens-per-minute tenant is charged up front


NO_STREAMING = one_class(max_concurrency=1, max_queue=0, on_overflow="fallback",
                         fallback={"action": "degrade", "max_tokens": 2, "stream": False})
# A degraded request's answer, as vLLM sends it without streaming.
ANSWER = {"id": "c1", "object": "chat.completion", "created": 1, "model": "llama",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def test_a_policy_that_may_turn_streaming_off_asks_for_every_response_headers(clock):
    # Envoy takes a mode change only in a headers phase, and whether a request streams and is degraded is known
    # only from its body: the response headers are the last place to ask for the degraded answer's body.
    s = Stream(processor(clock, **NO_STREAMING))
    assert s.receive(request_headers()) is LEARN_HEADERS
    assert Stream(processor(clock)).receive(request_headers()) is CONTINUE["request_headers"]


def test_a_stream_degraded_to_no_streaming_gets_its_answer_back_as_a_stream(clock):
    p = processor(clock, **NO_STREAMING)
    admitted(p)
    s, answer = admitted(p, {"model": "llama", "messages": HI, "max_tokens": 50, "stream": True,
                             "stream_options": {"include_usage": True}})
    forwarded = json.loads(answer.request_body.response.body_mutation.body)
    assert forwarded["stream"] is False and "stream_options" not in forwarded
    assert s.receive(response_headers(200, b"application/json", 200)) is LEARN_BODY[False]
    out = s.receive(response_body(json.dumps(ANSWER).encode(), eos=True)).response_body.response
    headers = {h.header.key: h.header.raw_value for h in out.header_mutation.set_headers}
    sse = out.body_mutation.body
    assert headers == {"content-type": b"text/event-stream; charset=utf-8", "content-length": str(len(sse)).encode()}
    events = [json.loads(e[6:]) for e in sse.split(b"\n\n")[:-2]]
    assert sse.endswith(b"data: [DONE]\n\n")
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "hi"}
    assert events[1]["choices"] == [] and events[1]["usage"]["completion_tokens"] == 2
    s.end(True)
    assert inflight(p) == 1  # the first request still holds its slot; the degraded one gave its own back


def test_an_error_to_a_stream_degraded_to_no_streaming_is_passed_on_as_it_is(clock):
    p = processor(clock, **NO_STREAMING)
    admitted(p)
    s, _ = admitted(p, {"model": "llama", "messages": HI, "stream": True})
    assert s.receive(response_headers(400, b"application/json", 80)) is CONTINUE["response_headers"]


def piecewise(s: Stream, headers: pb.ProcessingRequest, body: bytes) -> bytes:
    """What the client reads of an answer to a degraded stream that Envoy cannot buffer: read chunk by chunk under
    the stream's headers, each held back, the stream sent at the end."""
    answer = s.receive(headers)
    assert answer.mode_override.response_body_mode == protocol._Mode.STREAMED
    mutation = answer.response_headers.response.header_mutation
    assert [(h.header.key, h.header.raw_value) for h in mutation.set_headers] == [
        ("content-type", b"text/event-stream; charset=utf-8")]
    assert set(mutation.remove_headers) == {"content-length", "content-encoding"}
    cut = len(body) // 2
    assert s.receive(response_body(body[:cut])) is protocol.HOLD_RESPONSE_BODY
    out = s.receive(response_body(body[cut:], eos=True)).response_body.response
    assert not out.HasField("header_mutation")
    return out.body_mutation.body


def test_an_answer_of_unknown_length_to_a_stream_degraded_to_no_streaming_is_still_sent_as_a_stream(clock):
    # Envoy buffers only an answer whose length it is told is within the limit: a chunked one was passed on as the
    # JSON it was, which an OpenAI client reading a stream takes for an empty answer, without an error.
    p = processor(clock, **NO_STREAMING)
    admitted(p)
    s, _ = admitted(p, {"model": "llama", "messages": HI, "stream": True})
    sse = piecewise(s, response_headers(200, b"application/json", None), json.dumps(ANSWER).encode())
    assert json.loads(sse.split(b"\n\n")[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": "hi"}
    assert sse.endswith(b"data: [DONE]\n\n")
    s.end(True)
    assert inflight(p) == 1


@pytest.mark.parametrize("case", ["compressed", "too large", "too large, its length unknown"])
def test_an_answer_to_a_degraded_stream_that_cannot_become_one_ends_it_with_an_error_event(clock, case):
    # its JSON cannot be read to be turned into events: sent on, it reads as an empty stream, without an error
    p = processor(clock, **NO_STREAMING)  # max_body_bytes 1000
    admitted(p)
    s, _ = admitted(p, {"model": "llama", "messages": HI, "stream": True})
    body = json.dumps({**ANSWER, "system_fingerprint": "x" * 1000}).encode() if "large" in case else b"\x1b\x00br"
    headers = response_headers(200, b"application/json", None if "unknown" in case else len(body),
                               **({"content_encoding": b"br"} if case == "compressed" else {}))
    sse = piecewise(s, headers, body)
    event, done, end = sse.split(b"\n\n")
    assert (done, end) == (b"data: [DONE]", b"")
    error = json.loads(event.removeprefix(b"data: "))["error"]
    assert (error["code"], error["type"]) == ("degraded_answer_too_large", "server_error")
    assert "1000 bytes" in error["message"] and "without `stream`" in error["message"]
    assert len(s.restream.buffered) <= 1000
    s.end(True)
    assert inflight(p) == 1


def canned_answer(clock, doc: dict, path: bytes = CHAT) -> bytes:
    p = processor(clock, **one_class(max_concurrency=1, max_queue=0, on_overflow="fallback",
                                     fallback={"action": "canned", "status": 200, "message": "busy"}))
    admitted(p)
    s = Stream(p)
    s.receive(request_headers(path=path))
    return s.receive(request_body(doc)).immediate_response.body


def test_a_canned_answer_has_every_choice_the_client_asked_for(clock):
    # An SDK client reads choices[i] for its i-th sequence (n) or prompt (a completions list): with one choice
    # only, the rest were silently missing (an IndexError, or prompts without answers).
    chat = json.loads(canned_answer(clock, {"model": "llama", "messages": HI, "n": 2}))
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    listed = json.loads(canned_answer(clock, {"model": "llama", "prompt": ["a", "b", "c"], "n": 2},
                                      b"/v1/completions"))
    assert [c["index"] for c in listed["choices"]] == list(range(6))


def test_a_canned_stream_ends_with_the_usage_chunk_when_the_client_asked_for_it(clock):
    raw = canned_answer(clock, {"model": "llama", "messages": HI, "stream": True, "n": 2,
                                "stream_options": {"include_usage": True}})
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert {c["index"] for e in events for c in e["choices"]} == {0, 1}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 0
    plain = canned_answer(clock, {"model": "llama", "messages": HI, "stream": True})
    assert b'"usage"' not in plain
    # vLLM 0.32's include_usage defaults to false, `{}` included, and reads "false" as false
    implicit = canned_answer(clock, {"model": "llama", "messages": HI, "stream": True, "stream_options": {}})
    assert b'"usage"' not in implicit
    off = canned_answer(clock, {"model": "llama", "messages": HI, "stream": True,
                                "stream_options": {"include_usage": "false"}})
    assert b'"usage"' not in off


# --- GET /v1/models[/{id}]: answered by the ext_proc for the whole edge ---

def test_get_models_lists_every_model_the_policy_routes_and_retrieves_one(clock):
    p = processor(clock, models={"llama": {"cluster": "pool_a"}, "small": {"cluster": "pool_b", "aliases": ["s/8b"]}})
    s = Stream(p)
    answer = s.receive(request_headers(path=b"/v1/models", method=b"GET", eos=True))
    assert immediate_status(answer) == 200 and s.phase is Phase.ANSWERED
    doc = json.loads(answer.immediate_response.body)
    assert doc["object"] == "list" and [c["id"] for c in doc["data"]] == ["llama", "small", "s/8b"]
    assert {c["object"] for c in doc["data"]} == {"model"} and doc["data"][2]["root"] == "small"
    # The SDK quotes the id in the path; Envoy unescapes %2F only.
    answer = Stream(p).receive(request_headers(path=b"/v1/models/s%2F8b?x=1", method=b"GET", eos=True))
    assert immediate_status(answer) == 200
    assert json.loads(answer.immediate_response.body)["id"] == "s/8b"
    answer = Stream(p).receive(request_headers(path=b"/v1/models/nope", method=b"GET", eos=True))
    assert immediate_status(answer) == 404
    assert json.loads(answer.immediate_response.body)["error"] == {
        "message": "The model `nope` does not exist.", "type": "invalid_request_error", "param": "model",
        "code": "unknown_model"}
    # Not a listing: another method, or a path that only starts alike.
    for method, path in ((b"POST", b"/v1/models"), (b"GET", b"/v1/modelsx"), (b"DELETE", b"/v1/models/llama")):
        assert immediate_status(Stream(p).receive(request_headers(path=path, method=method, eos=True))) in (404, 405)


def test_get_models_needs_a_known_key_when_anonymous_requests_are_not_allowed(clock):
    # Found running a SaaS edge with `anonymous.allow: false`: every name it serves was listed to callers with no
    # key, where vLLM started with --api-key refuses them on every /v1 path (401), listing included.
    p = processor(clock, anonymous={"allow": False})
    for path in (b"/v1/models", b"/v1/models/llama"):
        assert immediate_status(Stream(p).receive(request_headers(path=path, method=b"GET", eos=True))) == 401
        wrong = request_headers(path=path, method=b"GET", eos=True, authorization=b"Bearer sk-nobody")
        assert immediate_status(Stream(p).receive(wrong)) == 401
        known = request_headers(path=path, method=b"GET", eos=True, authorization=b"Bearer sk-acme")
        assert immediate_status(Stream(p).receive(known)) == 200
    # Allowed anonymous callers read it without a key, as from vLLM without --api-key.
    anon = Stream(processor(clock)).receive(request_headers(path=b"/v1/models", method=b"GET", eos=True))
    assert immediate_status(anon) == 200


def test_a_reload_between_the_headers_and_the_body_does_not_turn_streaming_off_unseen(clock):
    # The headers were answered under a policy that turns no stream off, so Envoy sends us no response phase: a
    # degrade the reload brought in that turned streaming off would hand the streaming client a bare JSON body.
    p = processor(clock, **one_class(max_concurrency=1, max_queue=0, on_overflow="fallback",
                                     fallback={"action": "degrade", "max_tokens": 2}))
    admitted(p)
    s = Stream(p)
    assert s.receive(request_headers()) is CONTINUE["request_headers"]
    p.core.apply(make_policy(**NO_STREAMING))
    answer = s.receive(request_body({"model": "llama", "messages": HI, "max_tokens": 50, "stream": True}))
    assert s.phase is Phase.FORWARDING
    forwarded = json.loads(answer.request_body.response.body_mutation.body)
    assert forwarded["stream"] is True and forwarded["max_tokens"] == 2
    assert b"stream=off" not in set_headers(answer)["x-extproc-degraded"]


@pytest.mark.parametrize("path, doc, field", [
    (b"/v1/responses", {"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    (CHAT, {"messages": HI, "max_completion_tokens": 5000}, "max_completion_tokens"),
    (CHAT, {"messages": HI, "max_tokens": 1, "max_completion_tokens": 5000}, "max_completion_tokens"),
    (CHAT, {"messages": HI, "max_tokens": 0, "max_completion_tokens": 5000}, "max_completion_tokens"),
    (CHAT, {"messages": HI, "max_tokens": 5000, "max_completion_tokens": None}, "max_tokens"),
    (CHAT, {"messages": HI, "max_tokens": 5000}, "max_tokens"),
    (b"/v1/completions", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    (b"/invocations", {"messages": HI, "max_completion_tokens": 5000}, "max_completion_tokens"),
])
def test_an_output_cap_beyond_the_context_is_refused_naming_the_field_the_client_sent(clock, path, doc, field):
    # vLLM 0.32 names the field it read (`max_output_tokens=5000 cannot be greater than max_model_len=...`,
    # parameter=max_output_tokens); the gateway's refusal said `max_tokens 5000` to a Responses API client that
    # never sent a max_tokens.
    models = {"llama": {"cluster": "pool_a", "cost": {"max_context_tokens": 2048}}}
    p = Processor(AdmissionController(make_policy(models=models), clock=clock), max_body_bytes=100_000)
    s = Stream(p)
    s.receive(request_headers(path))
    answer = s.receive(request_body({"model": "llama", **doc}))
    assert immediate_status(answer) == 400
    error = json.loads(answer.immediate_response.body)["error"]
    assert error["code"] == "max_tokens_too_large" and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{field} 5000 exceeds the model's context of 2048 tokens"), error
    assert error["param"] == field


@pytest.mark.parametrize("path, doc, field", [
    (b"/v1/responses", {"input": "x" * 4000, "max_output_tokens": 1000}, "max_output_tokens"),
    (b"/v1/responses", {"input": "x" * 40000}, "max_output_tokens"),  # none sent: the endpoint's own name
    (CHAT, {"messages": [{"role": "user", "content": "x" * 4000}], "max_completion_tokens": 1000},
     "max_completion_tokens"),
    # vLLM ignores a max_tokens of -1 beside max_completion_tokens (differential.json): charged the one it obeys
    (CHAT, {"messages": [{"role": "user", "content": "x" * 4000}], "max_tokens": -1, "max_completion_tokens": 1000},
     "max_completion_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 4000}], "max_tokens": 1000}, "max_tokens"),
    (b"/v1/completions", {"prompt": "x" * 4000, "max_tokens": 1000}, "max_tokens"),
    (b"/invocations", {"messages": [{"role": "user", "content": "x" * 4000}], "max_completion_tokens": 1000},
     "max_completion_tokens"),
])
def test_a_request_over_the_class_budget_is_told_to_lower_the_field_the_client_sent(clock, path, doc, field):
    # request_too_large said "lower max_tokens" to a Responses API client, whose output cap is max_output_tokens
    # (a max_tokens there is ignored), and to a chat client that had sent max_completion_tokens.
    models = {"llama": {"cluster": "pool_a",
                        "cost": {"prefill_s_per_1k_tokens": 0.1, "decode_s_per_token": 0.001}}}
    classes = {"interactive": {"max_concurrency": 10, "max_queue": 5, "max_wait_ms": 1000,
                               "max_inflight_gpu_seconds": 0.5}}
    policy = make_policy(models=models, classes=classes, tenants=[], default_class="interactive")
    s = Stream(Processor(AdmissionController(policy, clock=clock), max_body_bytes=100_000))
    s.receive(request_headers(path))
    answer = s.receive(request_body({"model": "llama", **doc}))
    assert immediate_status(answer) == 413
    error = json.loads(answer.immediate_response.body)["error"]
    assert error["code"] == "request_too_large", error
    assert error["message"].endswith(f"shorten the prompt or lower {field}"), error


VLLM_STREAM_ERROR = (b'data: {"error":{"message":"EngineCore encountered an issue. See stack trace (above) for the '
                     b'root cause.","type":"InternalServerError","param":null,"code":500}}\n\n')


def test_a_stream_that_ends_on_vllms_error_event_is_the_replicas_failure_not_a_whole_answer(clock):
    """vLLM ends a stream whose generation failed (its engine died mid-answer) with the error as an event, then
    `[DONE]`, under the 200 it sent first; no usage chunk comes. Envoy's access log reports a 200, so a stream the
    ext_proc read to its end was counted `ok` (through Envoy: three tokens, the error event, `[DONE]`), the error
    breaker counted a success, and its tokens-per-minute tenant kept the worst case charged (3,000 of max_tokens
    for 3 tokens made). The replica ran it: charged the expected output, as an answer that broke off."""
    events = RecordedEvents()
    acme = {"name": "acme", "api_keys": ["sk-acme"], "tokens_per_minute": 6000, "burst_s": 60}
    p = processor(clock, learn_sample=1.0, events=events, tenants=[acme], shed={})
    p.core.cost_models["llama"].output_ratio = 0.5  # as learned: answers use half their max_tokens
    s, _ = admitted(p, {"model": "llama", "messages": HI, "stream": True, "max_tokens": 3000},
                    authorization=b"Bearer sk-acme")
    ticket = s.held
    assert s.receive(response_headers(content_type=SSE)) is LEARN_BODY[True]
    token = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
    answer = s.receive(response_body(token * 3 + VLLM_STREAM_ERROR + b"data: [DONE]\n\n", eos=True))
    assert answer is CONTINUE["response_body"]  # the client reads the error event as vLLM sent it
    s.end(normal_end=True)
    p.core.report(ticket.id, Completion(Outcome.OK, 200, 0.01, 0.05))
    assert events.accounted == [(ticket, Outcome.UPSTREAM_ERROR)]
    error_breaker = [b for b in p.core.state.pool_breakers(ticket.cls, ticket.pool) if b.kind == "error"][0]
    assert error_breaker.window.counts(clock()) == (1, 1)
    probe = p.core.decide(RequestFacts(api_key="sk-acme", model="llama", max_tokens=1))
    left = int(dict(probe.headers)["x-ratelimit-remaining-tokens"]) + probe.charge.tokens
    est = ticket.charge.estimate
    assert left == 6000 - (est.prompt_tokens + math.ceil(est.expected_output)) > 6000 - ticket.charge.tokens


@pytest.mark.parametrize("error", [
    b'data:{"error":{"message":"EngineCore encountered an issue.","code":500}}\r\n\r\n',
    b"".join(b"data: %s\n" % line.encode() for line in json.dumps(
        {"error": {"message": "EngineCore encountered an issue.", "code": 500}}, indent=2).split("\n")) + b"\n"])
def test_an_error_event_in_any_form_the_sse_format_allows_is_the_replicas_failure(clock, error):
    # Pretty-printed over several data lines, the error event was read as a whole answer: counted ok
    events = RecordedEvents()
    p = processor(clock, learn_sample=1.0, events=events)
    s, _ = admitted(p, {"model": "llama", "messages": HI, "stream": True})
    ticket = s.held
    s.receive(response_headers(content_type=SSE))
    raw = TOKEN_EVENT + error + b"data: [DONE]\n\n"
    assert passed_on(s, raw, 7) == raw
    s.end(normal_end=True)
    p.core.report(ticket.id, Completion(Outcome.OK, 200, 0.01, 0.05))
    assert events.accounted == [(ticket, Outcome.UPSTREAM_ERROR)]


def test_without_the_access_log_a_replicas_4xx_refunds_its_tenant_and_is_no_evidence_about_the_pool(clock):
    """Without Envoy's access log the core learns a request's status only from its stream, which read this one's
    response headers (every non-streamed answer of a tokens-per-minute tenant is read): a replica's 400 (a prompt
    past its context) ended `ok` with no status, so its tenant kept the worst case charged (through real Envoy
    without the access log: 2,948 of 3,000 max_tokens left charged, where the replica's 500 left nothing) and it
    was a latency sample and a success for the breakers, as with the log before the fix for that."""
    acme = {"name": "acme", "api_keys": ["sk-acme"], "tokens_per_minute": 6000, "burst_s": 60}
    interactive = {"max_concurrency": 4, "slo_p95_ms": 100, "latency_breaker": {"min_samples": 1},
                   "error_breaker": {"min_requests": 1}}
    p = processor(clock, tenants=[acme], shed={}, classes={"interactive": interactive})
    s, _ = admitted(p, {"model": "llama", "messages": HI, "max_tokens": 3000}, authorization=b"Bearer sk-acme")
    ticket, bucket = s.held, p.core.tenant_limits["acme"].tokens
    assert s.receive(response_headers(status=400)) is CONTINUE["response_headers"]
    s.end(normal_end=True)
    clock.advance(REPORT_WAIT_S + 1)  # no report comes: accounted from what the stream saw
    p.core.reap()
    assert ticket.closed and not p.core.tickets
    assert bucket.refill(clock()) == bucket.capacity  # all given back (the refill alone would leave ~2,400 short)
    breakers = p.core.state.pool_breakers(ticket.cls, ticket.pool)
    assert [b.window.count(clock()) if b.kind == "latency" else b.window.counts(clock())[0]
            for b in breakers] == [0, 0]
