"""One ext_proc stream as a state machine with no I/O: fed messages, it returns answers (or a wait to await)."""

from __future__ import annotations

import asyncio
import enum
import time
from typing import Callable
from urllib.parse import unquote

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ..policy.admission import QUEUE, AdmissionController, Canned, Decision, Degrade, Queued, Refusal, RequestFacts
from ..policy.classify import ConflictingKeys, presented_key
from ..policy.limits import Outcome, Ticket, Waiter
from ..policy.outcomes import LEARN, UsageSample
from ..policy.reasons import (R_BODIES_PENDING, R_BODY_TOO_LARGE, R_CONFLICTING_KEYS, R_CONNECT,
                              R_DEGRADED_TOO_LARGE, R_METHOD_NOT_ALLOWED,
                              R_REQUEST_NOT_SENT, R_UNKNOWN_MODEL, R_UNKNOWN_URL, R_UNSUPPORTED_ENCODING,
                              R_UNSUPPORTED_ENDPOINT, R_UNSUPPORTED_MEDIA_TYPE, say)
from ..policy.schema import Policy
from ..store.shared_slots import SharedSlots
from . import protocol
from .accesslog import TicketTags
from .final_admission import FinalAdmission
from .openai import (ENDPOINTS, MODELS_PATH, BadRequest, Endpoint, RequestBody, degrade_body, dump_json,
                     empty_body, json_media_type, model_card, models_body, parse_body, sse_error, sse_from_answer,
                     wants_stream_usage)
from .protocol import CONTINUE
from .usage import (FIRST_TOKEN, STREAM_ERROR, UsageReader, may_hold_usage_chunk, responses_usage, split_usage_event,
                    token_counts, usage_of, whole_events)

Answer = pb.ProcessingResponse


class Phase(enum.Enum):
    """Where a stream is. `decided`: its request has had its answer (admitted or refused)."""

    HEADERS = ("awaiting the request headers", False)
    BODY = ("awaiting the request body", False)
    ADMITTING = ("waiting for the final admission", False)
    FORWARDING = ("admitted, forwarding", True)
    READING_USAGE = ("admitted, reading the response for its usage", True)
    ANSWERED = ("answered without admission (refused or canned)", True)
    ENDED = ("ended", True)

    def __init__(self, text: str, decided: bool):
        self.text = text
        self.decided = decided

    __hash__ = object.__hash__  # members are singletons: identity, without Enum's Python-level name hash


class ParsedRequest:
    """The request as read off the stream: the facts the core decides on, the endpoint, the body to forward."""

    __slots__ = ("facts", "endpoint", "body", "arrived")

    def __init__(self, facts: RequestFacts, arrived: float):
        self.facts = facts
        self.endpoint: Endpoint | None = None  # set once the path is known to be served
        self.body: RequestBody | None = None   # set once the body has parsed
        self.arrived = arrived                 # when the request headers reached the ext_proc

    def read_body(self, body: RequestBody, reads_usage: bool) -> None:
        self.body = body
        facts = self.facts
        facts.model, facts.max_tokens, facts.stream = body.model, body.max_tokens, body.stream
        facts.max_tokens_field = body.max_tokens_field
        facts.body_class = body.claimed_class
        facts.doc = body.doc
        facts.sequences, facts.prompts, facts.generates = body.sequences, body.prompts, body.generates
        facts.min_output, facts.prompt_cap = body.min_output, body.prompt_cap
        facts.cannable = body.endpoint.canned
        facts.reads_usage = reads_usage


class Processor:
    """What every stream of one server shares: the core, the shared store, the open tickets, the usage sample."""

    def __init__(self, core: AdmissionController, shared: SharedSlots | None = None,
                 max_body_bytes: int = 4 << 20, tags: TicketTags | None = None, max_pending_bodies: int = 10_000):
        self.core = core
        core.count_on_forward()  # a ticket a stream takes back before forwarding it is no admission (withdraw)
        self.tags = tags or TicketTags()  # how this process names its tickets to Envoy's access log
        self.shared = shared                 # global slots from a shared store (policy `store: {kind: redis}`)
        self.max_body_bytes = max_body_bytes
        # Streams whose request body has not arrived: each holds an Envoy circuit-breaker slot, and a full breaker
        # lets requests through unadmitted (failure_mode_allow); past this bound new requests are refused instead.
        self.max_pending_bodies = max_pending_bodies
        self.pending_bodies = 0
        self.live: set[Ticket] = set()       # tickets whose stream is still open (their leases get renewed)
        self.usage_sample = UsageSample()  # which responses' usage is read
        self._names: tuple[object, protocol.HeaderNames] | None = None
        self._restreams: tuple[object, bool] | None = None
        self._models: tuple[object, Answer] | None = None

    def time_out_on_time(self, w: Waiter) -> None:
        """Time a shadow request's virtual queue place out at its deadline, as a real waiter's is
        (final_admission); the request itself runs now. Left to the housekeeping's reap, once a second, the place
        was held up to a second past max_wait_ms (later arrivals counted as queue_full that enforce queues), and a
        release could grant it after enforce had refused its client."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven without an event loop (unit tests, benchmarks): the reap times it out
            return
        loop.call_later(max(w.deadline - self.core.clock(), 0.0), self.core.abandon, w, True)

    def models_listing(self) -> Answer:
        """GET /v1/models' answer, built again only when the core's catalog changed (a reload, or a pool's
        listings read every models_interval_ms): a client polling it costs a lookup, however many names (building
        the message for 1,000 names took 0.9 ms)."""
        catalog = self.core.model_catalog()
        if self._models is None or self._models[0] is not catalog:
            self._models = (catalog, protocol.immediate(200, models_body(catalog, int(time.time())), [],
                                                        "extproc_models"))
        return self._models[1]

    def header_names(self, policy: Policy) -> protocol.HeaderNames:
        """The headers this policy reads (rebuilt when a reload installs another policy)."""
        if self._names is None or self._names[0] is not policy:
            self._names = (policy, protocol.HeaderNames.of(policy))
        return self._names[1]

    def may_restream(self, policy: Policy) -> bool:
        """Whether a class of this policy degrades with streaming off (rebuilt when a reload installs another)."""
        if self._restreams is None or self._restreams[0] is not policy:
            self._restreams = (policy, any(c.fallback.action == "degrade" and c.fallback.stream is False
                                           for c in policy.classes.values()))
        return self._restreams[1]

    def usage_reader(self, api_key: str | None) -> UsageReader | None:
        """Read this response's usage? A deterministic share of requests for cost learning, and those whose
        tenant has a tokens-per-minute limit (for the refund)."""
        which = self.usage_sample.pick(self.core, api_key)
        return None if which is None else UsageReader(learn=which == LEARN)

    def close(self, ticket: Ticket, outcome: Outcome | None, status: int = 0) -> None:
        """The one release of a ticket a stream held: the core's slot, then the shared store's. `outcome` None:
        the request never went upstream (AdmissionController.withdraw); `status`: the response's, if read."""
        self.live.discard(ticket)
        closed = self.core.finish(ticket, outcome, status) if outcome is not None else self.core.withdraw(ticket)
        if closed and self.shared is not None:
            self.shared.release(ticket)

    def renew_live(self) -> None:
        """Renew the lease of every ticket whose stream is still open (called periodically)."""
        for t in self.live:
            self.core.renew(t)


def endpoint_for(path: str | None, method: str | None, policy: Policy, authority: str | None = None) -> Endpoint:
    """Every request the ext_proc sees is admitted or refused, never passed through: a route that sends it an
    unknown path gets the same 404 as envoy.yaml's default route, a CONNECT (a tunnel to `authority`, usually
    without a path) a 405. Raises BadRequest."""
    if method == "CONNECT":
        raise BadRequest(say(R_CONNECT, target=authority or path or "(no target)"), code=R_CONNECT, status=405)
    endpoint = ENDPOINTS.get(path)
    if endpoint is None:
        shown = path[:200] if path else "without a path"
        raise BadRequest(say(R_UNKNOWN_URL, method=method or "(no method)", path=shown), code=R_UNKNOWN_URL,
                         status=404)
    if method != "POST":
        raise BadRequest(say(R_METHOD_NOT_ALLOWED, path=path, method=method), code=R_METHOD_NOT_ALLOWED, status=405)
    if not policy.endpoints.serves(endpoint.group):
        raise BadRequest(say(R_UNSUPPORTED_ENDPOINT, path=path, group=endpoint.group), code=R_UNSUPPORTED_ENDPOINT,
                         status=404)
    return endpoint


def api_key_of(head: protocol.RequestHead) -> str | None:
    """The API key the request presents, if any; two different ones are refused (401)."""
    try:
        return presented_key(head.authorization, head.api_key)
    except ConflictingKeys:
        raise BadRequest(say(R_CONFLICTING_KEYS), code=R_CONFLICTING_KEYS, status=401) from None


class Stream:
    """Per-request state of one ext_proc stream; see TRANSITIONS for what each message does in each phase.

    receive() answers every message with exactly one answer of its own phase or an immediate response, except
    the request body it must admit when the core queues it or the shared store gates it: then it returns the
    FinalAdmission, whose decision goes back in through admitted(). end() gives back what the request holds,
    once, however the stream ended.
    """

    __slots__ = ("processor", "phase", "request", "held", "usage", "status", "not_routed", "restream",
                 "sees_response", "response_done", "_handlers")

    def __init__(self, processor: Processor):
        self.processor = processor
        self.request: ParsedRequest | None = None
        # What the request holds: ADMITTING the FinalAdmission, FORWARDING/READING_USAGE its Ticket, else
        # nothing (or a ticket whose answer failed to build: the stream failed before it was decided).
        self.held: Ticket | FinalAdmission | None = None
        self.usage: UsageReader | None = None  # set when this response's usage is read
        self.status = 0                         # the upstream response status, once seen
        self.not_routed = False                 # its response headers say Envoy answered it itself
        self.restream: Restream | None = None   # a streamed request a degrade answered without streaming
        self.sees_response = False              # its headers' answer asked Envoy for the response headers
        self.response_done = False              # the response's end came to us (its last body message)
        self.phase = Phase.HEADERS
        self._handlers = TRANSITIONS[Phase.HEADERS]

    def _enter(self, phase: Phase) -> None:
        if self.phase is Phase.BODY:  # its body came, or the stream ended or failed without it
            self.processor.pending_bodies -= 1
        self.phase = phase
        self._handlers = TRANSITIONS[phase]

    # --- driving it ---

    def receive(self, req: pb.ProcessingRequest) -> Answer | FinalAdmission:
        name = req.WhichOneof("request")
        if self.phase is Phase.HEADERS:  # the first message says what Envoy will send us of this request
            mode = protocol.unbuffered_body_mode(req)
            if mode is not None:
                return self._not_sent("body", f"request_body_mode {mode}")
        handler = self._handlers.get(name)
        if handler is None:
            return CONTINUE[name]  # nothing to decide in this phase
        return handler(self, req)

    def admitted(self, d: Decision) -> Answer:
        """The answer for the final admission's decision."""
        if self.phase is not Phase.ADMITTING:
            raise RuntimeError(f"a final admission while the stream is {self.phase.text}")
        waited = self.held.queued or d.waited_s > 0
        self.held = None
        return self._answer(d, int(d.waited_s * 1000) if waited else None)

    def fail(self) -> Answer:
        """Our own failure before the request was decided: refuse it (500). A failed stream would be passed on
        unadmitted by Envoy's failure_mode_allow, so the caller fails the stream only once decided."""
        if self.phase.decided:
            raise RuntimeError(f"a failure to answer while the stream is {self.phase.text}")
        if isinstance(self.held, Ticket):  # taken by an answer that failed to build: it never went upstream
            ticket, self.held = self.held, None
            self.processor.close(ticket, None)
        self._enter(Phase.ANSWERED)  # a final admission it waits for is given back at the end
        return protocol.INTERNAL_ERROR

    def end(self, normal_end: bool, failed: bool = False) -> None:
        """The stream is over (`normal_end`: Envoy's end of stream or its reset; not: a write that failed, or a
        message Envoy sent and did not wait for; `failed`: our own handler raised after the request was decided):
        give back what it holds.

        Envoy closes a stream the same way when its HTTP request is done and when the client leaves (end of stream,
        then a reset, which grpc may deliver first): the two look alike. Only a response whose body we read tells
        them apart, by whether its last message came."""
        cut = self.phase is Phase.READING_USAGE and not self.response_done
        held, self.held = self.held, None
        self._enter(Phase.ENDED)
        if isinstance(held, FinalAdmission):  # the client left (or we failed) while the request waited
            held.give_back()  # nothing went upstream: whatever the queue granted meanwhile is taken back
            return
        if self.not_routed:  # Envoy's own answer (its response headers' details): neither the pool's nor served
            ticket, outcome = held, Outcome.NOT_ROUTED
        elif self.status >= 500:
            ticket, outcome = held, Outcome.UPSTREAM_ERROR
        elif failed:  # not the client's abort, nor the replica's error; Envoy's report, if one comes, says more
            ticket, outcome = held, Outcome.EXTPROC_ERROR
        elif normal_end and not cut:
            ticket, outcome = held, Outcome.OK if self.status else Outcome.ENDED
        else:
            ticket, outcome = held, Outcome.CLIENT_ABORT  # the response was cut, or Envoy left mid-exchange
        if ticket is not None:
            self.processor.close(ticket, outcome, self.status)

    # --- the request ---

    def _out_of_turn(self, req: pb.ProcessingRequest) -> Answer:
        raise RuntimeError(f"a {req.WhichOneof('request')} message while the stream is {self.phase.text}")

    def _on_request_headers(self, req: pb.ProcessingRequest) -> Answer:
        core = self.processor.core
        policy = core.policy
        head = protocol.read_request_headers(req.request_headers, self.processor.header_names(policy))
        facts = RequestFacts(header_class=head.claim, request_id=head.request_id, session_id=head.session,
                             objective=head.objective, fairness_id=head.fairness_id, deadline_ms=head.deadline_ms)
        self.request = ParsedRequest(facts, core.clock())
        if head.method == "GET" and head.path is not None and head.path.startswith(MODELS_PATH) and \
                head.path[len(MODELS_PATH):len(MODELS_PATH) + 1] in ("", "/"):
            # As vLLM with --api-key guards every /v1 path, the list included.
            refused = None if policy.anonymous.allow else self._refused_key(head, facts)
            return self._models(head.path) if refused is None else refused
        try:
            self.request.endpoint = endpoint_for(head.path, head.method, policy, head.authority)
        except BadRequest as e:
            return self._refuse(e)
        refused = self._refused_key(head, facts)
        if refused is not None:
            return refused
        if not json_media_type(head.content_type):
            # vLLM answers this 400 whatever the body (or its absence, or its encoding): admitted, the request held
            # a slot until the replica did.
            shown = "this request has no Content-Type" if head.content_type is None else \
                f"this request's Content-Type is `{head.content_type[:64].decode('latin-1')}`"
            return self._refuse(BadRequest(say(R_UNSUPPORTED_MEDIA_TYPE, content_type=shown),
                                           code=R_UNSUPPORTED_MEDIA_TYPE))
        if head.end_of_stream:  # a POST without a body
            return self._refuse(empty_body())
        if head.content_encoding is not None:
            return self._refuse(BadRequest(say(R_UNSUPPORTED_ENCODING, encoding=head.content_encoding),
                                           code=R_UNSUPPORTED_ENCODING, status=415))
        processor = self.processor
        if processor.pending_bodies >= processor.max_pending_bodies:
            return self._refuse(BadRequest(say(R_BODIES_PENDING, held=processor.pending_bodies),
                                           code=R_BODIES_PENDING, status=503))
        self.usage = processor.usage_reader(facts.api_key)
        self._enter(Phase.BODY)
        processor.pending_bodies += 1
        # A response whose usage is read needs its headers phase, where the body mode is picked; so does one a
        # degrade may answer without streaming (Envoy takes a mode change only in a headers phase, and whether the
        # request streams and is degraded is known only from its body).
        if self.usage is None and not self.processor.may_restream(policy):
            return CONTINUE["request_headers"]
        self.sees_response = True
        return protocol.LEARN_HEADERS

    def _refused_key(self, head: protocol.RequestHead, facts: RequestFacts) -> Answer | None:
        """The answer to a request whose API key is malformed or not allowed (core.authenticate); None: go on."""
        try:
            facts.api_key = api_key_of(head)
        except BadRequest as e:
            return self._refuse(e)
        d = self.processor.core.authenticate(facts)
        if d is None:
            return None
        return self._answered(protocol.refusal(d))

    def _models(self, path: str) -> Answer:
        """GET /v1/models[/{id}], answered here: the replicas behind one route know their own pool's names only.
        Like vLLM's, without admission; a known key only under `anonymous.allow: false` (vLLM's --api-key)."""
        catalog = self.processor.core.model_catalog()
        if path == MODELS_PATH:
            return self._answered(self.processor.models_listing())
        name = unquote(path[len(MODELS_PATH) + 1:])  # the SDK quotes an id; Envoy unescapes %2F only
        fields = catalog.get(name)
        if fields is None:
            return self._refuse(BadRequest(say(R_UNKNOWN_MODEL, model=name[:200]), param="model",
                                           code=R_UNKNOWN_MODEL, status=404))
        return self._answered(protocol.immediate(200, orjson.dumps(model_card(name, fields, int(time.time()))), [],
                                                 "extproc_models"))

    def _headless(self, req: pb.ProcessingRequest) -> Answer:
        return self._not_sent("headers", "request_header_mode SKIP")

    def _not_sent(self, part: str, setting: str) -> Answer:
        """A route that overrides the ext_proc's processing mode (typed_per_filter_config) can keep the headers
        or the whole body from us; answered `continue`, Envoy would send the request upstream undecided."""
        if self.request is None:
            self.request = ParsedRequest(RequestFacts(), self.processor.core.clock())
        return self._refuse(BadRequest(say(R_REQUEST_NOT_SENT, part=part, setting=setting),
                                       code=R_REQUEST_NOT_SENT, status=500))

    def _on_request_body(self, req: pb.ProcessingRequest) -> Answer | FinalAdmission:
        msg = req.request_body
        p = self.processor
        core, request = p.core, self.request
        limit = core.body_limit(request.facts.api_key, p.max_body_bytes)
        if len(msg.body) > limit:  # before the parse, the one cost that grows with the body
            return self._refuse(BadRequest(say(R_BODY_TOO_LARGE, limit=limit), code=R_BODY_TOO_LARGE, status=413))
        policy = core.policy
        try:
            body = parse_body(msg.body, request.endpoint, policy.classify.body_field, core.limiters)
            if not policy.endpoints.serves(body.endpoint.group):  # /invocations with, say, an embeddings body
                raise BadRequest(say(R_UNSUPPORTED_ENDPOINT, path="/invocations with this body",
                                     group=body.endpoint.group), code=R_UNSUPPORTED_ENDPOINT, status=404)
        except BadRequest as e:
            return self._refuse(e)
        if body.beam_search:
            # Its usage is the answer's beams (those that ended at EOS short), while vLLM ran every beam to the
            # cap: read, it refunded a tokens-per-minute tenant and settled the fair queue at a fraction of the
            # work. Its estimate stands, as for an answer that cannot be read.
            self.usage = None
        request.read_body(body, self.usage is not None and self.usage.reads_usage(body))
        d = core.decide(request.facts)
        if type(d) is Queued or core.gated(d):  # queued, or waiting for a global slot
            self.held = FinalAdmission(core, p.shared, d)
            self._enter(Phase.ADMITTING)
            return self.held
        return self._answer(d, None)

    def _on_request_trailers(self, req: pb.ProcessingRequest) -> Answer:
        # An HTTP/2 request may end with trailers and no DATA at all; Envoy then sends no body message, and a
        # CONTINUE here would let it upstream undecided. It has no body: refuse it as an empty one.
        return self._refuse(empty_body())

    def _answer(self, d: Decision, queue_wait_ms: int | None) -> Answer:
        body = self.request.body
        if type(d) is Refusal:
            return self._answered(protocol.refusal(d))
        if type(d) is Canned:
            return self._answered(protocol.canned(d, body))
        self.held = d.ticket  # from here on end() gives it back, whatever fails below
        usage_asked = wants_stream_usage(body)  # by the client: the usage reader may add it, a degrade drop it
        if self.usage is not None:
            self.usage.ask_for_usage(body)
        cls = self.processor.core.policy.classes.get(d.cls)
        if cls is not None and cls.vllm_priority is not None:
            body.doc["priority"] = cls.vllm_priority
            body.rewrite = True
        note = None
        if type(d) is Degrade:
            fb = d.fallback
            # Streaming goes off only where the response comes back to us to be turned into a stream again: a
            # reload between the headers and the decision can bring a degrade the headers' answer did not ask for.
            changed = degrade_body(body, fb.model, fb.max_tokens, fb.stream if self.sees_response else None,
                                   d.context_tokens)
            if "stream=off" in changed:
                self.restream = Restream(body.endpoint.kind, usage_asked)
            note = ("x-extproc-degraded", f"{','.join(changed) or 'none'}; reason={d.reason}")
        elif d.shadow_would is not None:
            note = ("x-extproc-shadow", f"would-{d.shadow_would.kind}; reason={d.shadow_would.reason}")
        rewritten = dump_json(body.doc) if body.rewrite else None
        if rewritten is not None and len(rewritten) > self.processor.max_body_bytes:
            return self._too_large_rewritten(len(rewritten))
        self.processor.live.add(d.ticket)
        core = self.processor.core
        # The name it goes upstream with (a degrade's model, if it names one): a LoRA adapter's prefers a replica
        # running it (policy.steering).
        model = (type(d) is Degrade and d.fallback.model) or self.request.facts.model
        answer = protocol.forward(d, queue_wait_ms, note, rewritten, self.processor.tags.value(d.ticket.id),
                                  core.replicas_for(d.cluster, d.cls, model))
        core.forwarded(d)  # counted as admitted now, once nothing can take it back unforwarded
        would = d.shadow_would
        if would is not None and would.kind == QUEUE and would.waiter.pending:
            self.processor.time_out_on_time(would.waiter)  # shadow: enforce would have queued it
        self._enter(Phase.FORWARDING)
        return answer

    def _too_large_rewritten(self, size: int) -> Answer:
        """Re-encoding can lengthen a body (orjson writes 1e15 as 1000000000000000.0). Over the limit it would
        fail the gRPC write or Envoy's buffer after admission, and a failed ext_proc answer lets Envoy's
        failure_mode_allow forward the client's original body unadmitted: give the slot back and refuse."""
        ticket, self.held = self.held, None
        self.processor.close(ticket, None)  # it never went upstream: no latency, no error, nothing charged
        limit = self.processor.max_body_bytes
        return self._refuse(BadRequest(
            f"{say(R_BODY_TOO_LARGE, limit=limit)} (the body as forwarded to the model server, re-encoded by the "
            f"gateway, is {size} bytes; numbers written as 1e15 grow when re-encoded).",
            code=R_BODY_TOO_LARGE, status=413))

    def _refuse(self, e: BadRequest) -> Answer:
        d = self.processor.core.invalid(e.status, e.code, e.message, self.request.facts)
        return self._answered(protocol.bad_request(e, d))

    def _answered(self, answer: Answer) -> Answer:
        """An answer given here, built before the phase is entered (the argument is): a failure building it leaves
        the request undecided, refused 500 by the driver rather than a failed stream that failure_mode_allow
        passes on unadmitted."""
        self._enter(Phase.ANSWERED)
        return answer

    # --- the response (only requests whose usage is read send these phases) ---

    def _on_response_headers(self, req: pb.ProcessingRequest) -> Answer:
        self.status, content_type, length, encoded = protocol.read_response_headers(req.response_headers)
        self.response_done = req.response_headers.end_of_stream  # a response without a body ends here
        if req.attributes and protocol.not_routed_response(req):
            # Envoy answered it itself (no such cluster, ...): no replica's answer, nothing to read or restream.
            # Its outcome, should no access log report it, is not the pool's (end()).
            self.not_routed = True
            return CONTINUE["response_headers"]
        rs = self.restream
        if rs is not None and self.phase is Phase.FORWARDING:
            if self.status == 200 and content_type.startswith(b"application/json"):
                self._enter(Phase.READING_USAGE)  # the whole answer, to send it on as the stream asked for
                if length is not None and length <= self.processor.max_body_bytes and not encoded:
                    return protocol.LEARN_BODY[False]  # Envoy buffers it: one message
                # Too large for Envoy to buffer, of unknown length, or compressed: read here as it comes, under
                # the stream's headers. Sent on as it was, a JSON body reads as an empty stream to an OpenAI client
                # (no event, no error); one that cannot be made a stream ends it with an error event instead.
                rs.piecewise, rs.readable = True, not encoded
                return AS_STREAM
            self.restream = None  # an error goes to the client as it is
        r = self.usage
        # A body compressed on its way (content-encoding) holds no usage we can read; an event stream of it would
        # be held back for a blank line that compressed bytes do not carry.
        if self.phase is not Phase.FORWARDING or r is None or self.status != 200 or encoded:
            return CONTINUE["response_headers"]
        r.sse = content_type.startswith(b"text/event-stream")
        if r.sse and not r.learn:
            return CONTINUE["response_headers"]  # a stream's usage costs a message per chunk: sampled ones only
        if not r.sse and (length is None or length > self.processor.max_body_bytes):
            # Envoy buffers a body it hands us whole only up to its buffer limit (past it the client got a 500 for
            # an answer the replica had computed), and one of unknown length may pass it: read as it comes instead,
            # each piece passed on, its usage from the end kept. Unread, a tenant kept the worst case charged at
            # admission for its largest answers (top_logprobs, embeddings batches).
            if not content_type.startswith(b"application/json"):
                return CONTINUE["response_headers"]
            r.piecewise = True
        self._enter(Phase.READING_USAGE)
        return protocol.LEARN_BODY[r.sse or r.piecewise]

    def _on_response_body(self, req: pb.ProcessingRequest) -> Answer:
        msg = req.response_body
        self.response_done = msg.end_of_stream
        if self.restream is not None:
            return self._restreamed(msg)
        r = self.usage
        if not r.sse:
            self._learn_usage(r.answer_usage(msg.body, msg.end_of_stream))
            return CONTINUE["response_body"]
        chunk = whole_events(r, msg.body, msg.end_of_stream)
        # Events held back, or earlier ones released: compared by content, since a release and a hold of the same
        # length leave the length as it was.
        rewritten = chunk != msg.body
        if not r.first_token_seen and FIRST_TOKEN.search(chunk):
            # Time to first token, measured where the protocol lets us see it: the first body chunk carrying
            # generated text, on the sampled streams whose body the ext_proc reads anyway.
            r.first_token_seen = True
            core = self.processor.core
            core.first_token(self.held, core.clock() - self.request.arrived)
        if b'"error"' in chunk and not r.responses and STREAM_ERROR.search(chunk):
            self.processor.core.answer_failed(self.held)  # passed on as it is: the client reads vLLM's error
        if r.responses:
            # the client's own last event: never stripped
            self._learn_usage(responses_usage(r, chunk, msg.end_of_stream))
        elif may_hold_usage_chunk(chunk):
            kept, usage = split_usage_event(chunk)
            self._learn_usage(usage)
            if r.strip:
                return protocol.replace_response_body(kept)
        return protocol.replace_response_body(chunk) if rewritten else CONTINUE["response_body"]

    def _restreamed(self, msg: pb.HttpBody) -> Answer:
        """The degraded answer, whole (Envoy buffers it, or it is read here piece by piece up to the same limit), as
        the event stream its client asked for."""
        rs = self.restream
        limit = self.processor.max_body_bytes
        if rs.readable:
            rs.buffered += msg.body
            if len(rs.buffered) > limit:
                rs.readable = False
                rs.buffered.clear()
        if not msg.end_of_stream:
            return protocol.HOLD_RESPONSE_BODY if rs.piecewise else CONTINUE["response_body"]
        if self.usage is not None and rs.readable:
            self._learn_usage(usage_of(rs.buffered))
        events = sse_from_answer(rs.kind, rs.buffered, rs.include_usage) if rs.readable else None
        if events is None:
            if not rs.piecewise:
                return CONTINUE["response_body"]  # not an answer: sent on as it is, with its own headers
            events = sse_error(say(R_DEGRADED_TOO_LARGE, limit=limit) if not rs.readable else
                               "The model's answer could not be read as one to send on as a stream.",
                               R_DEGRADED_TOO_LARGE)
        if rs.piecewise:
            return protocol.replace_response_body(events)
        return protocol.replace_response(events, SSE_CONTENT_TYPE)

    def _learn_usage(self, usage: object) -> None:
        counts = token_counts(usage)
        if counts is not None and self._plausible(*counts):  # else not a usage object we understand: learn nothing
            self.processor.core.usage(self.held, *counts)

    def _plausible(self, prompt: int, completion: int) -> bool:
        """Usage a replica could have produced for this request. One absurd answer (a completion of 9e18 tokens)
        would otherwise lock its tenant's token bucket for ages and teach the cost model nonsense. Without a
        client cap the bound is the context, not the policy's assumed default_max_tokens: vLLM generates up to
        the rest of the context, and a real answer past the assumption must be charged and learned."""
        charge = self.held.charge
        est = charge.estimate if charge is not None else None
        most_output = est.most_output if est is not None and est.most_output else USAGE_CEILING
        return 0 <= prompt <= USAGE_CEILING and 0 <= completion <= most_output


class Restream:
    """A streamed chat or completions request whose degrade turned streaming off upstream: its JSON answer is
    buffered and sent on as an event stream (an OpenAI client reading a stream finds nothing in a JSON body)."""

    __slots__ = ("kind", "include_usage", "buffered", "piecewise", "readable")

    def __init__(self, kind: str, include_usage: bool):
        self.kind = kind                    # chat | completions
        self.include_usage = include_usage  # the client asked for the usage chunk
        self.buffered = bytearray()  # read piecewise, up to --max-body-bytes: bytes += bytes copied it all each time
        self.piecewise = False  # read chunk by chunk (STREAMED), under the stream's headers
        self.readable = True    # what came so far can still be read (within the limit, not compressed)


SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"  # as vLLM sends it
AS_STREAM = protocol.answer_as_stream(SSE_CONTENT_TYPE)


# More tokens than any model's context (prompt, or output when neither the request's cap nor the model's context
# is known): usage past it is not a real answer's.
USAGE_CEILING = 1 << 22

# Each gets the whole message (the response headers' handler reads its attributes too).
Handler = Callable[[Stream, pb.ProcessingRequest], "Answer | FinalAdmission"]

# The driver awaits the final admission before it reads on, and reads nothing once the stream ended: a message
# then is the driver's bug, raised.
_NO_MESSAGES = dict.fromkeys(("request_headers", "request_body", "request_trailers", "response_headers",
                              "response_body", "response_trailers"), Stream._out_of_turn)

# What each message does in each phase; a message not listed is answered CONTINUE (of its own phase) and
# changes nothing.
TRANSITIONS: dict[Phase, dict[str, Handler]] = {
    Phase.HEADERS: {"request_headers": Stream._on_request_headers,     # -> BODY, or ANSWERED (refused)
                    "request_body": Stream._headless,                  # -> ANSWERED (headers not sent)
                    "request_trailers": Stream._headless},
    Phase.BODY: {"request_body": Stream._on_request_body,              # -> FORWARDING, ANSWERED or ADMITTING
                 "request_trailers": Stream._on_request_trailers},     # -> ANSWERED (no body came)
    Phase.ADMITTING: _NO_MESSAGES,                                     # admitted() -> FORWARDING or ANSWERED
    Phase.FORWARDING: {"response_headers": Stream._on_response_headers},  # -> READING_USAGE (usage read)
    Phase.READING_USAGE: {"response_headers": Stream._on_response_headers,
                          "response_body": Stream._on_response_body},
    Phase.ANSWERED: {},
    Phase.ENDED: _NO_MESSAGES,
}
