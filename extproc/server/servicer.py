"""The ext_proc adapter: ProcessingRequest -> admission core calls -> ProcessingResponse."""

from __future__ import annotations

import asyncio
import logging
import re

import orjson

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2
from grpc.aio import EOF, InternalError

from ..policy.admission import ACCEPT, DEGRADE, QUEUE, AdmissionController, Decision, RequestFacts
from ..policy.classify import ConflictingKeys, presented_key
from ..policy.limits import Outcome, Ticket, Waiter
from ..policy.reasons import (R_ADMISSION_ERROR, R_BODY_TOO_LARGE, R_CONFLICTING_KEYS, R_METHOD_NOT_ALLOWED,
                              R_UNKNOWN_URL, R_UNSUPPORTED_ENDPOINT, say)
from ..store.shared import SharedSlots
from .accesslog import TICKET_HEADER
from .openai import (ENDPOINTS, BadRequest, Endpoint, RequestBody, canned_body, degrade_body, dump_json,
                     error_body, parse_body)

log = logging.getLogger("extproc.server")

CLUSTER_HEADER = "x-extproc-cluster"
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
    request_header_mode=_Mode.SEND, request_body_mode=_Mode.BUFFERED, request_trailer_mode=_Mode.SKIP,
    response_header_mode=_Mode.SEND, response_body_mode=_Mode.NONE, response_trailer_mode=_Mode.SEND))
LEARN_BODY = {sse: pb.ProcessingResponse(response_headers=pb.HeadersResponse(), mode_override=_Mode(
    request_header_mode=_Mode.SEND, request_body_mode=_Mode.BUFFERED, request_trailer_mode=_Mode.SKIP,
    response_header_mode=_Mode.SEND, response_body_mode=_Mode.STREAMED if sse else _Mode.BUFFERED,
    response_trailer_mode=_Mode.SEND)) for sse in (False, True)}


def _header(key: str, value: str | bytes) -> base_pb2.HeaderValueOption:
    raw = value if isinstance(value, bytes) else value.encode()
    # Envoy reads raw_value; `value` alone arrives as an empty header.
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=raw),
                                      append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def immediate(status: int, body: bytes, headers: list[tuple[str, str]], details: str,
              content_type: str = "application/json") -> pb.ProcessingResponse:
    hs = [_header("content-type", content_type)] + [_header(k, v) for k, v in headers]
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=pb.HeaderMutation(set_headers=hs), body=body,
        details=details))


def decision_response(d: Decision) -> pb.ProcessingResponse:
    """A terminal refusal as Envoy's immediate response with an OpenAI-style body."""
    headers = [("x-extproc-class", d.cls), ("x-extproc-decision", d.kind), ("x-extproc-reason", d.reason),
               *d.headers]
    if d.retry_after:
        headers.append(("retry-after", str(d.retry_after)))
    return immediate(d.status, error_body(d.status, d.message, d.reason), headers, f"extproc_{d.reason}")


# A request-phase failure of ours: refused, never failed open (see Process).
INTERNAL_ERROR = immediate(500, error_body(500, say(R_ADMISSION_ERROR), R_ADMISSION_ERROR),
                           [("x-extproc-decision", "invalid")], f"extproc_{R_ADMISSION_ERROR}")


def _wait_override(seconds: float) -> pb.ProcessingResponse:
    whole = int(seconds)
    return pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(
        seconds=whole, nanos=int((seconds - whole) * 1e9)))


class _Stream:
    """Per-request state of one ext_proc stream."""

    __slots__ = ("facts", "endpoint", "ticket", "waiter", "gated", "body", "cluster", "decision", "status",
                 "queue_wait_ms", "learn", "refund", "sse", "strip_usage", "response_json", "arrived",
                 "first_token", "pending_read")

    def __init__(self) -> None:
        self.facts: RequestFacts | None = None  # set once the request headers are read
        self.endpoint: Endpoint | None = None
        self.ticket: Ticket | None = None
        self.waiter: Waiter | None = None  # set while the request waits in a class queue
        self.gated: Decision | None = None  # an admission waiting for the shared store's global slot
        self.body: RequestBody | None = None
        self.cluster = ""
        self.decision = ""                 # the final decision kind, once made
        self.status = 0
        self.queue_wait_ms = -1
        self.learn = False                 # this response's usage is read for cost learning (sampled)
        self.refund = False                # ... or, if not streamed, for its tenant's tokens-per-minute refund
        self.sse = False                   # the learned response is an event stream
        self.strip_usage = False           # ... from a usage chunk the client did not ask for
        self.response_json = b""           # buffered non-streamed response body
        self.arrived = 0.0                 # when the request headers reached the ext_proc
        self.first_token = False           # a learned stream's first token has been seen
        self.pending_read = None           # the shielded read in flight, once decided


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """One gRPC stream per HTTP request. Every message gets an answer of its own phase; slots are freed once."""

    def __init__(self, core: AdmissionController, max_body_bytes: int = 4 << 20,
                 queue_grace_s: float = 0.5, shared: SharedSlots | None = None) -> None:
        self.core = core
        self.shared = shared                 # global slots from a shared store (policy `store: {kind: redis}`)
        self.max_body_bytes = max_body_bytes
        self.queue_grace_s = queue_grace_s   # added to Envoy's timeout while a request waits in a queue
        self.live: set[Ticket] = set()       # tickets whose stream is still open (their leases get renewed)
        self.errors = 0
        self.on_error = None                 # called once per failed stream (the extproc_stream_errors counter)
        self._learn_credit = 0.0

    async def Process(self, request_iterator, context) -> None:
        # context.read()/write() rather than an async generator: one wrapping layer less per message.
        st = _Stream()
        normal_end = False
        read, write = context.read, context.write
        try:
            while True:
                # Once decided, the next read usually outlives the HTTP request and ends in Envoy's reset.
                req = await (_read_through_reset(st, read) if st.decision else read())
                if req is EOF:
                    break
                phase = req.WhichOneof("request")
                if phase == "request_headers":
                    resp = self._on_request_headers(st, req.request_headers)
                elif phase == "request_body":
                    resp = self._on_request_body(st, req.request_body)
                elif phase == "response_body":
                    resp = self._on_response_body(st, req.response_body)
                elif phase == "response_headers":
                    resp = self._on_response_headers(st, req.response_headers)
                else:
                    resp = CONTINUE[phase]
                if resp is None:  # queued, or waiting for a global slot: answer with the final decision
                    resp = await self._settle(st, write)
                await write(resp)
            normal_end = True
        except asyncio.CancelledError:
            # The reset often lands just after Envoy's end of stream: that is still a normal end.
            normal_end = _read_gave_eof(st.pending_read)
            raise
        except InternalError:
            # A write failed: Envoy reset the stream as the answer went out (its client left at that moment).
            # A client abort, not a failure of ours; the slot is freed below like any other abort.
            log.debug("ext_proc stream reset by the peer during a write")
        except Exception:  # a bug here must never take the stream's slot with it
            self.errors += 1
            if self.on_error is not None:
                self.on_error()
            log.exception("ext_proc stream failed")
            if st.decision:
                raise
            # Undecided: refuse this request rather than fail the stream, which Envoy's failure_mode_allow
            # would turn into an unadmitted request (a body that trips a bug must not buy a way around us).
            st.decision = "invalid"
            await write(INTERNAL_ERROR)
            normal_end = True
        finally:
            self._end(st, normal_end)

    # --- phases ---

    def _on_request_headers(self, st: _Stream, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        path = method = claim = session = None
        authorization, api_key = [], []
        request_id = ""
        class_header = self.core.policy.classify.header
        session_header = self.core.policy.sessions.header
        for h in msg.headers.headers:
            k = h.key
            if k == ":path":
                path = h.raw_value.decode("latin-1").split("?", 1)[0]
            elif k == ":method":
                method = h.raw_value.decode("latin-1")
            elif k == "authorization":
                authorization.append(h.raw_value.decode("latin-1"))
            elif k == "api-key":
                api_key.append(h.raw_value.decode("latin-1"))
            elif k == class_header:
                claim = h.raw_value.decode("latin-1").strip().lower()
            elif k == "x-request-id":
                request_id = h.raw_value.decode("latin-1")
            elif k == session_header:
                session = h.raw_value.decode("latin-1")[:256] or None
        st.arrived = self.core.clock()
        st.facts = RequestFacts(header_class=claim or None, request_id=request_id, session_id=session)
        refusal = self._check_request(st, path, method)
        if refusal is not None:
            return self._refuse(st, refusal)
        try:
            st.facts.api_key = presented_key(authorization, api_key)
        except ConflictingKeys:
            return self._refuse(st, BadRequest(say(R_CONFLICTING_KEYS), code=R_CONFLICTING_KEYS, status=401))
        d = self.core.authenticate(st.facts)
        if d is not None:
            st.decision = d.kind
            return decision_response(d)
        if msg.end_of_stream:  # a POST without a body
            return self._refuse(st, BadRequest("The request body is empty; expected a JSON object."))
        return self._sample_learning(st)

    def _check_request(self, st: _Stream, path: str | None, method: str | None) -> BadRequest | None:
        """Every request the ext_proc sees is admitted or refused, never passed through: a route that sends
        it an unknown path gets the same 404 as envoy.yaml's default route."""
        endpoint = ENDPOINTS.get(path)
        if endpoint is None:
            return BadRequest(say(R_UNKNOWN_URL, method=method, path=(path or "")[:200]), code=R_UNKNOWN_URL,
                              status=404)
        if method != "POST":
            return BadRequest(say(R_METHOD_NOT_ALLOWED, path=path, method=method), code=R_METHOD_NOT_ALLOWED,
                              status=405)
        if not self.core.policy.endpoints.serves(endpoint.group):
            return BadRequest(say(R_UNSUPPORTED_ENDPOINT, path=path, group=endpoint.group),
                              code=R_UNSUPPORTED_ENDPOINT, status=404)
        st.endpoint = endpoint
        return None

    def _on_request_body(self, st: _Stream, msg: pb.HttpBody) -> pb.ProcessingResponse | None:
        if st.endpoint is None or st.decision or st.waiter:
            return CONTINUE["request_body"]  # refused already, or a second body message: nothing to decide
        if len(msg.body) > self.max_body_bytes:
            return self._refuse(st, BadRequest(say(R_BODY_TOO_LARGE, limit=self.max_body_bytes),
                                               code=R_BODY_TOO_LARGE, status=413))
        policy = self.core.policy
        try:
            body = parse_body(msg.body, st.endpoint, policy.classify.body_field, self.core.limiters)
            if not policy.endpoints.serves(body.endpoint.group):  # /invocations with, say, an embeddings body
                raise BadRequest(say(R_UNSUPPORTED_ENDPOINT, path="/invocations with this body",
                                     group=body.endpoint.group), code=R_UNSUPPORTED_ENDPOINT, status=404)
        except BadRequest as e:
            return self._refuse(st, e)
        facts = st.facts
        facts.model, facts.max_tokens, facts.stream = body.model, body.max_tokens, body.stream
        facts.body_class = body.claimed_class
        facts.doc = body.doc
        facts.sequences, facts.generates = body.sequences, body.generates
        facts.degradable, facts.cannable = body.generates, body.endpoint.canned
        facts.reads_usage = st.learn or (st.refund and not body.stream)
        d = self.core.decide(facts, body)
        if d.kind == QUEUE:
            st.cluster = d.cluster
            st.waiter = d.waiter
            return None
        if self.core.gated(d):
            st.gated, st.body = d, body
            return None
        return self._answer(st, d, body)

    def _sample_learning(self, st: _Stream) -> pb.ProcessingResponse:
        """Read this response's usage for cost learning? A deterministic share of requests: those get the
        response-headers phase switched on, where the body mode is chosen from the response's content type."""
        self._learn_credit += self.core.policy.learn_sample
        if self._learn_credit >= 1.0:
            self._learn_credit -= 1.0
            st.learn = True
        elif self.core.reads_usage(st.facts.api_key):
            st.refund = True
        else:
            return CONTINUE["request_headers"]
        return LEARN_HEADERS

    def _ask_for_usage(self, st: _Stream, body: RequestBody) -> None:
        """A learned stream needs vLLM's usage chunk; the client gets it only if it asked."""
        opts = body.doc.get("stream_options")
        if not (isinstance(opts, dict) and opts.get("include_usage")):
            body.doc["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
            body.rewrite = True
            st.strip_usage = True

    def _on_response_body(self, st: _Stream, msg: pb.HttpBody) -> pb.ProcessingResponse:
        if st.ticket is None or not (st.learn or st.refund):
            return CONTINUE["response_body"]
        if not st.sse:
            st.response_json += msg.body
            if msg.end_of_stream:
                self._learn_usage(st, _usage_of(st.response_json))
            return CONTINUE["response_body"]
        chunk = msg.body
        if not st.first_token and _FIRST_TOKEN.search(chunk):
            # Time to first token, measured where the protocol lets us see it: the first body chunk carrying
            # generated text, on the sampled streams whose body the ext_proc reads anyway.
            st.first_token = True
            self.core.first_token(st.ticket, self.core.clock() - st.arrived)
        if b'"usage"' not in chunk or b'"choices":[]' not in chunk:
            return CONTINUE["response_body"]
        kept, usage = _split_usage_event(chunk)
        self._learn_usage(st, usage)
        if not st.strip_usage:
            return CONTINUE["response_body"]
        return pb.ProcessingResponse(response_body=pb.BodyResponse(
            response=pb.CommonResponse(body_mutation=pb.BodyMutation(body=kept))))

    def _learn_usage(self, st: _Stream, usage: dict | None) -> None:
        if usage and st.ticket is not None:
            try:
                self.core.usage(st.ticket, int(usage["prompt_tokens"]), int(usage["completion_tokens"]))
            except (KeyError, TypeError, ValueError):
                pass  # not a usage object we understand; learn nothing

    def _on_response_headers(self, st: _Stream, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        """Sent only for requests whose usage is learned (envoy.yaml skips this phase otherwise)."""
        content_type = b""
        for h in msg.headers.headers:
            if h.key == ":status":
                st.status = int(h.raw_value or b"0")
            elif h.key == "content-type":
                content_type = h.raw_value
        if not (st.learn or st.refund) or st.ticket is None or st.status != 200:
            return CONTINUE["response_headers"]
        st.sse = content_type.startswith(b"text/event-stream")
        if st.sse and not st.learn:
            return CONTINUE["response_headers"]  # a stream's usage costs a message per chunk: sampled ones only
        return LEARN_BODY[st.sse]

    # --- decisions to responses ---

    async def _settle(self, st: _Stream, write) -> pb.ProcessingResponse:
        """Keep Envoy waiting while the request queues here and/or waits for a global slot."""
        extended = False
        if st.waiter is not None:
            grace = max(st.waiter.deadline - self.core.clock(), 0.0) + self.queue_grace_s
            await write(_wait_override(grace))
            extended = True
            body = st.waiter.context
            d = await self._wait(st, st.waiter)
            if not self.core.gated(d):
                return self._answer(st, d, body)
            st.gated, st.body = d, body
        d = await self.shared.try_now(st.gated)
        if d is None:
            if not extended:
                grace = max(self.shared.deadline(st.gated.ticket) - self.core.clock(), 0.0) + self.queue_grace_s
                await write(_wait_override(grace))
            d = await self.shared.wait(st.gated)
        body, st.gated = st.body, None
        if d.waited_s > 0:
            st.queue_wait_ms = int(d.waited_s * 1000)
        return self._answer(st, d, body)

    async def _wait(self, st: _Stream, waiter: Waiter) -> Decision:
        fut = asyncio.get_running_loop().create_future()

        def deliver(d: Decision) -> None:
            if not fut.done():
                fut.set_result(d)

        waiter.on_result = deliver
        try:
            d = await asyncio.wait_for(fut, max(waiter.deadline - self.core.clock(), 0.0))
        except asyncio.TimeoutError:
            d = self.core.abandon(waiter, timed_out=True) or waiter.result
        st.waiter = None
        st.queue_wait_ms = int(d.waited_s * 1000)
        return d

    def _answer(self, st: _Stream, d: Decision, body: RequestBody) -> pb.ProcessingResponse:
        st.decision = d.kind
        if d.kind != ACCEPT and d.ticket is None:
            if d.kind == DEGRADE:  # canned
                return self._canned(st, d, body)
            return decision_response(d)
        st.ticket = d.ticket
        self.live.add(d.ticket)
        if st.learn and body.stream:
            self._ask_for_usage(st, body)
        priority = self.core.policy.classes[d.cls].vllm_priority if d.cls in self.core.policy.classes else None
        if priority is not None:
            body.doc["priority"] = priority
            body.rewrite = True
        common = pb.CommonResponse(clear_route_cache=True)
        headers = common.header_mutation.set_headers
        # The pool to route to; the rest is echoed to the client by the route's response_headers_to_add and
        # ties Envoy's access log entry back to this ticket.
        headers.append(_header(CLUSTER_HEADER, d.cluster))
        headers.append(_header("x-extproc-class", d.cls))
        headers.append(_header("x-extproc-decision", d.kind))
        headers.append(_header(TICKET_HEADER, str(d.ticket.id)))
        if st.queue_wait_ms >= 0:
            headers.append(_header("x-extproc-queue-wait-ms", str(st.queue_wait_ms)))
        for k, v in d.headers:
            headers.append(_header(k, v))
        if d.kind == DEGRADE:
            fb = d.fallback
            changed = degrade_body(body, fb.model, fb.max_tokens, fb.stream)
            headers.append(_header("x-extproc-degraded", f"{','.join(changed) or 'none'}; reason={d.reason}"))
        elif d.shadow_would is not None:
            would = d.shadow_would
            headers.append(_header("x-extproc-shadow", f"would-{would.kind}; reason={would.reason}"))
        if body.rewrite:
            raw = dump_json(body.doc)
            common.body_mutation.body = raw
            headers.append(_header("content-length", str(len(raw))))
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))

    def _canned(self, st: _Stream, d: Decision, body: RequestBody) -> pb.ProcessingResponse:
        headers = [("x-extproc-class", d.cls), ("x-extproc-decision", d.kind),
                   ("x-extproc-degraded", f"canned; reason={d.reason}")]
        if d.retry_after:
            headers.append(("retry-after", str(d.retry_after)))
        if d.status >= 300:
            return immediate(d.status, error_body(d.status, d.message, d.reason), headers, f"extproc_{d.reason}")
        raw, content_type = canned_body(body, d.message)
        return immediate(d.status, raw, headers, f"extproc_{d.reason}", content_type)

    def _refuse(self, st: _Stream, e: BadRequest) -> pb.ProcessingResponse:
        status = e.status
        d = self.core.invalid(status, e.code, e.message, st.facts)
        st.decision = d.kind
        return immediate(status, error_body(status, e.message, e.code, e.param),
                         [("x-extproc-class", d.cls), ("x-extproc-decision", d.kind), ("x-extproc-reason", e.code)],
                         f"extproc_{e.code}")

    # --- the end, however it comes ---

    def _end(self, st: _Stream, normal_end: bool) -> None:
        w = st.waiter
        if w is not None:  # still queued: the client left while waiting
            if not self.core.abandon(w, timed_out=False) and w.result is not None and w.result.ticket:
                if self.core.gated(w.result):  # granted in the same instant, before its global slot
                    self.shared.abandon(w.result)
                else:
                    self.core.finish(w.result.ticket, Outcome.CLIENT_ABORT)
            return
        if st.gated is not None:  # the client left while its admission waited for a global slot
            self.shared.abandon(st.gated)
            return
        t = st.ticket
        if t is None or t.closed:
            return
        self.live.discard(t)
        if st.status >= 500:
            outcome = Outcome.UPSTREAM_ERROR
        elif normal_end:
            outcome = Outcome.OK if st.status else Outcome.ENDED
        else:
            outcome = Outcome.CLIENT_ABORT  # the gRPC stream was cancelled
        self.core.finish(t, outcome)
        if self.shared is not None:
            self.shared.release(t)

    def renew_live(self) -> None:
        """Renew the lease of every ticket whose stream is still open (called periodically)."""
        for t in self.live:
            self.core.renew(t)


async def _read_through_reset(st: _Stream, read):
    """The next message, read so that a stream reset cannot abandon the read half-way.

    Envoy resets most ext_proc streams as their HTTP request ends, and grpc.aio cancels the handler. A read
    cancelled in flight leaks its batch's native op array (grpc/grpc#43360: ~100 bytes a stream, the soak's RSS
    growth). Shielded, the read runs to its end (end of stream) and grpc frees it; only the handler is cancelled.
    """
    task = asyncio.ensure_future(read())
    task.add_done_callback(_retrieve)
    st.pending_read = task
    return await asyncio.shield(task)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # a read that failed after its handler left: nothing to do, but do not warn about it


def _read_gave_eof(task) -> bool:
    return (task is not None and task.done() and not task.cancelled() and task.exception() is None
            and task.result() is EOF)


# A chat delta or completion choice with at least one character of text (the role chunk's content is "").
_FIRST_TOKEN = re.compile(rb'"(?:content|text)":"[^"]')


def _usage_of(raw: bytes) -> dict | None:
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return doc.get("usage") if isinstance(doc, dict) else None


def _split_usage_event(chunk: bytes) -> tuple[bytes, dict | None]:
    """Separate the SSE usage event (`"choices":[]` with `usage`) from the rest of a chunk."""
    kept, usage = [], None
    for event in chunk.split(b"\n\n"):
        if event.startswith(b"data: {") and b'"choices":[]' in event and b'"usage"' in event:
            usage = _usage_of(event[6:])
            if usage is not None:
                continue
        kept.append(event)
    return b"\n\n".join(kept), usage

