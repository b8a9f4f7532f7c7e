"""ext_proc protobuf in and out: ProcessingRequest fields as plain values, answers as ProcessingResponse."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2

from ..policy.admission import Decision, Refusal
from ..policy.reasons import R_ADMISSION_ERROR, R_CONNECT, say
from .accesslog import TICKET_HEADER, not_routed, under_filter_name
from .openai import BadRequest, RequestBody, canned_body, error_body

# `extproc serve`'s defaults for the request bodies it takes (extproc check --envoy compares Envoy's limits with them).
MAX_BODY_BYTES = 4 << 20
MAX_PENDING_BODIES = 10_000


def grpc_receive_limit(max_body_bytes: int) -> int:
    """The largest message taken from Envoy: a request body (within --max-body-bytes, Envoy's buffer at most), or a
    piece of an answer read as it comes (STREAMED): what Envoy held while the response headers' answer was on its
    way, or one read from the replica, 1 MiB seen under a 256 KiB buffer. A larger one fails the stream, and failing
    closed Envoy cuts the client's answer: under 8 MiB the bound is the one --max-body-bytes' default has."""
    return max(2 * max_body_bytes, 8 << 20) + (64 << 10)


CLUSTER_HEADER = "x-extproc-cluster"
# The replicas of the pool to send to, read by the pool clusters' override_host load balancing (envoy.yaml); set
# only while one of them is stalled (policy.steering).
REPLICA_HEADER = "x-extproc-replica"
_Mode = processing_mode_pb2.ProcessingMode

# Constant answers, built once (grpc serialises them on send; they are never mutated).
CONTINUE = {
    "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}
# A request whose usage is learned: also send the response headers (the body mode is picked there).
# mode_override replaces the whole mode, so every phase is spelled out (an unset one means NONE/SKIP).
LEARN_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=_Mode(
    request_header_mode=_Mode.SEND, request_body_mode=_Mode.BUFFERED, request_trailer_mode=_Mode.SEND,
    response_header_mode=_Mode.SEND, response_body_mode=_Mode.NONE, response_trailer_mode=_Mode.SEND))
LEARN_BODY = {sse: pb.ProcessingResponse(response_headers=pb.HeadersResponse(), mode_override=_Mode(
    request_header_mode=_Mode.SEND, request_body_mode=_Mode.BUFFERED, request_trailer_mode=_Mode.SEND,
    response_header_mode=_Mode.SEND, response_body_mode=_Mode.STREAMED if sse else _Mode.BUFFERED,
    response_trailer_mode=_Mode.SEND)) for sse in (False, True)}


# --- in: the fields we read, as plain values ---

class RequestHead:
    """What the request headers message says, decoded (Envoy sends header values only in `raw_value`)."""

    __slots__ = ("path", "method", "authority", "authorization", "api_key", "claim", "request_id", "session",
                 "end_of_stream", "objective", "fairness_id", "deadline_ms", "content_encoding", "content_type")

    def __init__(self) -> None:
        self.path: str | None = None      # without the query string
        self.method: str | None = None
        self.authority: str | None = None  # read for a CONNECT's refusal only (its target; it has no :path)
        self.authorization: list[str] = []
        self.api_key: list[str] = []
        self.claim: str | None = None     # the class header, stripped and lower-cased; None when absent or empty
        self.request_id = ""
        self.session: str | None = None
        self.end_of_stream = False        # no body follows
        self.objective: str | None = None     # the policy's objective header (Gateway API), when it names one
        self.fairness_id: str | None = None   # the policy's fairness header, when it names one
        self.deadline_ms: float | None = None  # the policy's deadline header: a number of ms >= 0, else None
        self.content_encoding: str | None = None  # other than identity: a compressed body we cannot read
        self.content_type: bytes | None = None  # the first Content-Type, as vLLM's server reads it; None: absent


class HeaderNames:
    """The request headers a policy asks us to read besides the fixed ones (None: not read)."""

    __slots__ = ("claim", "session", "objective", "fairness", "deadline")

    def __init__(self, claim: str, session: str, objective: str | None = None, fairness: str | None = None,
                 deadline: str | None = None):
        self.claim, self.session = claim, session
        self.objective, self.fairness, self.deadline = objective, fairness, deadline

    @classmethod
    def of(cls, policy) -> HeaderNames:
        c = policy.classify
        return cls(c.header, policy.sessions.header, c.objective_header, c.fairness_header, c.deadline_header)


def read_request_headers(msg: pb.HttpHeaders, names: HeaderNames) -> RequestHead:
    head = RequestHead()
    class_header, session_header = names.claim, names.session
    for h in msg.headers.headers:
        k = h.key
        if k == ":path":
            head.path = h.raw_value.decode("latin-1").split("?", 1)[0]
        elif k == ":method":
            head.method = h.raw_value.decode("latin-1")
        elif k == ":authority":
            head.authority = h.raw_value[:256].decode("latin-1")
        elif k == "authorization":
            head.authorization.append(h.raw_value.decode("latin-1"))
        elif k == "api-key":
            head.api_key.append(h.raw_value.decode("latin-1"))
        elif k == class_header:
            head.claim = h.raw_value.decode("latin-1").strip().lower() or None
        elif k == "x-request-id":  # the client's own, if Envoy kept it: every refusal's log line carries it
            head.request_id = h.raw_value[:256].decode("latin-1")
        elif k == session_header:
            head.session = h.raw_value.decode("latin-1")[:256] or None
        elif k == names.objective:
            head.objective = h.raw_value.decode("latin-1").strip()[:256] or None
        elif k == names.fairness:
            head.fairness_id = h.raw_value.decode("latin-1")[:256] or None
        elif k == names.deadline:
            head.deadline_ms = deadline_ms(h.raw_value)
        elif k == "content-type" and head.content_type is None:
            head.content_type = h.raw_value
        elif k == "content-encoding" and h.raw_value.strip().lower() not in (b"", b"identity"):
            head.content_encoding = h.raw_value.decode("latin-1")[:64]
    head.end_of_stream = msg.end_of_stream
    return head


def unbuffered_body_mode(req: pb.ProcessingRequest) -> str | None:
    """The request body mode Envoy reports on a stream's first message, when it is not BUFFERED (None: buffered, or
    not reported, as older Envoys do not). A route's per-filter override can change it."""
    if not req.HasField("protocol_config"):
        return None
    mode = req.protocol_config.request_body_mode
    return None if mode == _Mode.BUFFERED else _Mode.BodySendMode.Name(mode)


def deadline_ms(raw: bytes) -> float | None:
    """A deadline header's value: milliseconds from arrival; anything but a finite number >= 0 is ignored."""
    try:
        ms = float(raw)
    except ValueError:
        return None
    return ms if 0.0 <= ms < float("inf") else None


def read_response_headers(msg: pb.HttpHeaders) -> tuple[int, bytes, int | None, bool]:
    """(status, content-type, content-length or None, whether the body is content-encoded) of an upstream
    response."""
    status, content_type, length, encoded = 0, b"", None, False
    for h in msg.headers.headers:
        k = h.key
        if k == ":status":
            status = int(h.raw_value or b"0")
        elif k == "content-type":
            content_type = h.raw_value
        elif k == "content-length" and h.raw_value.isdigit():
            length = int(h.raw_value)
        elif k == "content-encoding" and h.raw_value.strip().lower() not in (b"", b"identity"):
            encoded = True
    return status, content_type, length, encoded


# The attribute envoy.yaml's ext_proc filter sends with each response headers message (`response_attributes`), in
# ProcessingRequest.attributes under the filter's name: why the response is what it is (`via_upstream`, or Envoy's
# own reason for a reply it made itself). Only the requests whose response headers come to the ext_proc carry it.
CODE_DETAILS = "response.code_details"


def not_routed_response(req: pb.ProcessingRequest) -> bool:
    """Whether a response headers message says Envoy answered the request itself, from its own configuration
    (accesslog.not_routed), by its response code details. False without the attribute."""
    attributes = under_filter_name(req.attributes)
    details = attributes.fields.get(CODE_DETAILS) if attributes is not None else None
    return details is not None and not_routed(details.string_value)


# --- out: answers ---

def header(key: str, value: str) -> base_pb2.HeaderValueOption:
    # Envoy reads raw_value; `value` alone arrives as an empty header.
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=_OVERWRITE)


_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def immediate(status: int, body: bytes, headers: list[tuple[str, str]], details: str,
              content_type: str = "application/json") -> pb.ProcessingResponse:
    hs = [header("content-type", content_type)] + [header(k, v) for k, v in headers]
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=pb.HeaderMutation(set_headers=hs), body=body,
        details=details))


def _error(status: int, message: str, code: str, headers: list[tuple[str, str]],
           param: str | None = None) -> pb.ProcessingResponse:
    """An immediate OpenAI-style error; Envoy logs its details as `extproc_<code>`."""
    return immediate(status, error_body(status, message, code, param), headers, f"extproc_{code}")


def refusal(d: Refusal) -> pb.ProcessingResponse:
    """A terminal refusal as Envoy's immediate response with an OpenAI-style body."""
    headers = [("x-extproc-class", d.cls), ("x-extproc-decision", d.kind), ("x-extproc-reason", d.reason),
               *d.headers]
    if d.retry_after:
        headers.append(("retry-after", str(d.retry_after)))
    return _error(d.status, d.message, d.reason, headers, d.param)


def bad_request(e: BadRequest, d: Decision) -> pb.ProcessingResponse:
    """A request refused before admission (`d` is the core's count of it)."""
    headers = [("x-extproc-class", d.cls), ("x-extproc-decision", d.kind), ("x-extproc-reason", e.code)]
    if e.status == 405:
        # RFC 9110: a 405 names the methods the resource takes; a CONNECT's target is the gateway itself.
        headers.append(("allow", "GET, POST" if e.code == R_CONNECT else "POST"))
    elif e.status == 503:
        headers.append(("retry-after", "1"))  # load of the gateway's own (bodies_pending): try again shortly
    elif e.status >= 500:
        # A gateway misconfiguration (request_not_sent) answers every retry the same: the OpenAI SDKs retry a
        # 500 twice by default unless told not to.
        headers.append(("x-should-retry", "false"))
    return _error(e.status, e.message, e.code, headers, e.param)


def canned(d: Decision, body: RequestBody) -> pb.ProcessingResponse:
    """A `canned` fallback: the policy's own answer in the endpoint's shape, or its error status."""
    headers = [("x-extproc-class", d.cls), ("x-extproc-decision", d.kind),
               ("x-extproc-degraded", f"canned; reason={d.reason}"), *d.headers]  # x-ratelimit-*, as on every answer
    if d.retry_after:
        headers.append(("retry-after", str(d.retry_after)))
    if d.status >= 300:  # the client is refused: the reason in its header too, as on every refusal
        return _error(d.status, d.message, d.reason, [*headers, ("x-extproc-reason", d.reason)])
    raw, content_type = canned_body(body, d.message)
    return immediate(d.status, raw, headers, f"extproc_{d.reason}", content_type)


def forward(d: Decision, queue_wait_ms: int | None, note: tuple[str, str] | None,
            body: bytes | None, ticket: str, replicas: str | None = None) -> pb.ProcessingResponse:
    """An admission: route to `d.cluster`, tag the request, and send `body` instead of the client's if given;
    `ticket`: the ticket header's value (accesslog.TicketTags); `replicas`: the pool's replicas to use, first
    choice first (policy.steering), None to let Envoy pick."""
    # The pool to route to; the rest is echoed to the client by the route's response_headers_to_add and ties
    # Envoy's access log entry back to this ticket.
    headers = [header(CLUSTER_HEADER, d.cluster), header("x-extproc-class", d.cls),
               header("x-extproc-decision", d.kind), header(TICKET_HEADER, ticket)]
    if queue_wait_ms is not None:
        headers.append(header("x-extproc-queue-wait-ms", str(queue_wait_ms)))
    for k, v in d.headers:
        headers.append(header(k, v))
    if note is not None:  # x-extproc-degraded or x-extproc-shadow
        headers.append(header(*note))
    if replicas is not None:
        headers.append(header(REPLICA_HEADER, replicas))
    common = pb.CommonResponse(clear_route_cache=True)
    if body is not None:
        common.body_mutation.body = body
        headers.append(header("content-length", str(len(body))))  # or Envoy answers 500
    common.header_mutation.set_headers.extend(headers)
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))


def answer_as_stream(content_type: str) -> pb.ProcessingResponse:
    """The response headers of an answer the ext_proc reads as it comes and sends on as an event stream: its
    Content-Type, without the answer's own length or encoding, and each body chunk sent to us (STREAMED)."""
    mutation = pb.HeaderMutation(set_headers=[header("content-type", content_type)],
                                 remove_headers=["content-length", "content-encoding"])
    return pb.ProcessingResponse(
        response_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation)),
        mode_override=LEARN_BODY[True].mode_override)


# A chunk of the response body that the client does not get (what replaces it is sent later).
HOLD_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse(
    response=pb.CommonResponse(body_mutation=pb.BodyMutation(clear_body=True))))


def replace_response_body(body: bytes) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_body=pb.BodyResponse(
        response=pb.CommonResponse(body_mutation=pb.BodyMutation(body=body))))


def replace_response(body: bytes, content_type: str) -> pb.ProcessingResponse:
    """A buffered response's body replaced by another kind of content: its headers, not yet sent while Envoy
    buffers the body, say so (and the new length, or Envoy's client sees a truncated or hanging body)."""
    mutation = pb.HeaderMutation(set_headers=[header("content-type", content_type),
                                              header("content-length", str(len(body)))])
    return pb.ProcessingResponse(response_body=pb.BodyResponse(
        response=pb.CommonResponse(header_mutation=mutation, body_mutation=pb.BodyMutation(body=body))))


def wait_override(seconds: float) -> pb.ProcessingResponse:
    """Extend Envoy's message timeout: not an answer, the stream's request still waits for one."""
    whole = int(seconds)
    return pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(
        seconds=whole, nanos=int((seconds - whole) * 1e9)))


# A request-phase failure of ours: refused, never failed open (see ExtProcServicer.Process).
INTERNAL_ERROR = _error(500, say(R_ADMISSION_ERROR), R_ADMISSION_ERROR,
                        [("x-extproc-decision", "invalid"), ("x-extproc-reason", R_ADMISSION_ERROR)])
