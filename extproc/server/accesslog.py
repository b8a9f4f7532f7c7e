"""Envoy's gRPC access log as the completion report: status, who ended the request, and its timings.

The ext_proc stream tells us *when* a request ends (its slot is freed then) but not *how*: Envoy closes it the same
way after a normal end and after a client abort, and an HTTP/1 upstream sends no trailers. Envoy's access log knows
(response code, response flags such as downstream or upstream termination, time to first byte), and it arrives in
batches, so one gRPC message carries many requests instead of one extra round trip each.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import AsyncIterator, Callable, Protocol, runtime_checkable

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError

from ..policy.admission import AdmissionController
from ..policy.limits import Completion, Outcome
from .openai import ENDPOINTS
from .saturation import host_port

log = logging.getLogger("extproc.accesslog")

TICKET_HEADER = "x-extproc-ticket"
# The sampled log of envoy.yaml that carries the ext_proc filter's own log of each request (not a completion report).
ANSWERS_LOG = "extproc_answers"
# Envoy keeps the ext_proc filter's per-request log (its calls' latencies, whether it failed open) in the request's
# filter state under the filter's name, and the access log sends it (filter_state_objects_to_log); the attributes
# the filter sends the ext_proc are keyed by it too. envoy.yaml names the filter this; Envoy Gateway adds
# `/envoyextensionpolicy/<ns>/<policy>/...` to it.
EXT_PROC_STATE = "envoy.filters.http.ext_proc"


def under_filter_name(by_filter):
    """What a protobuf map keyed by filter name (the access log's filter state objects, a processing request's
    attributes) holds for the ext_proc filter: under EXT_PROC_STATE, or Envoy Gateway's longer name; None if
    nothing. The exact name first: a map lookup, where a scan of a map's items costs several times more."""
    value = by_filter.get(EXT_PROC_STATE)
    if value is None and by_filter:
        value = next((v for k, v in by_filter.items() if k.startswith(EXT_PROC_STATE)), None)
    return value


def ticket_prefix(worker: int | None) -> str:
    """What a worker's ticket headers start with: `<worker>-` when the ext_proc is one of several workers (Envoy
    then sends each worker's access-log entries to that worker, matched on the prefix: envoyconf.render), else
    nothing. The ticket's id follows."""
    return "" if worker is None else f"{worker}-"


class TicketTags:
    """The ticket header's value, `[<worker>-]<id>.<instance>`, and its parse.

    Ticket ids are counters that start at 1 in every process, so two ext_proc instances behind one Envoy (which
    sends each of its workers' access log to one of them) issue the same ids nearly in step, and a restarted one
    issues the ids its predecessor's last requests still carry: a bare id would hand one request's status and
    timings to another's breakers and pool limit. The instance part, random per process, tells them apart."""

    def __init__(self, worker: int | None = None, instance: str | None = None):
        self.prefix = ticket_prefix(worker)
        self.instance = instance or secrets.token_hex(4)
        self._suffix = "." + self.instance

    def value(self, ticket_id: int) -> str:
        return f"{self.prefix}{ticket_id}{self._suffix}"

    def parse(self, value: str) -> tuple[int, str] | None:
        """(ticket id, process) of any worker's ticket value, the process being `[<worker>-]<instance>`, as
        `process` names this one; None for anything else. A worker of `extproc serve --workers N` can get another
        worker's reports (Envoy's `extproc` cluster listing the N ports under one access log, docs/kubernetes.md),
        and passes them on like another instance's."""
        head, dot, instance = value.partition(".")
        worker, dash, ticket_id = head.rpartition("-")
        # ASCII digits only: str.isdigit() also takes superscripts, which int() refuses.
        if not dot or not instance or not (ticket_id.isascii() and ticket_id.isdigit()) or \
                (dash and not (worker.isascii() and worker.isdigit())):
            return None
        try:
            return int(ticket_id), f"{worker}{dash}{instance}"
        except ValueError:  # past int()'s limit of 4,300 digits: no ticket of anyone's
            return None

    @property
    def process(self) -> str:
        """This process among every instance's workers (the reports channel it listens on)."""
        return self.prefix + self.instance


@runtime_checkable
class ReportRelay(Protocol):
    """Carries completion reports to the ext_proc instance that admitted the request, through the store the
    instances share (Redis): Envoy streams each of its workers' access log to one instance, whichever admitted
    the request. Reports are [ticket id, outcome name, status, first byte s, total s, replica] lists (replica:
    the answering one's IP:PORT, or null; a report without it, from an older instance, is taken too)."""

    # Fire and forget; `heard(False)` once it is known that no instance heard them: the store was away, or nobody
    # listens on that instance's channel (it restarted or stopped: its tickets died with it). `heard` never raises.
    def relay(self, instance: str, reports: list[list], heard: Callable[[bool], None]) -> None: ...

    def on_reports(self, instance: str, callback: Callable[[list[list]], None]) -> None: ...

_ANSWERED = (Outcome.OK, Outcome.UPSTREAM_ERROR)  # a client abort says nothing about the replica

# Response flags meaning the upstream side failed the request (it may still have sent a 200 first).
_UPSTREAM_FLAGS = ("upstream_remote_reset", "upstream_connection_failure", "upstream_connection_termination",
                   "upstream_request_timeout", "no_healthy_upstream", "upstream_overflow", "upstream_protocol_error",
                   "upstream_max_stream_duration_reached", "stream_idle_timeout")
_CLIENT_FLAGS = ("downstream_connection_termination", "downstream_remote_reset")
# Envoy's response code details when its ext_proc filter failed the request: with failure_mode_allow: false, a
# failed stream or an answer past message_timeout (504), which Envoy answers itself.
_EXTPROC_FAILED = "ext_proc_error"
# Envoy's response code details (and flags) when its router answered an admitted request itself because of its own
# configuration, without asking a replica: no cluster of the name the ext_proc routed to (503, flag NC: a typo in
# the policy's models.<name>.cluster, or a cluster not deployed yet), no route or route table after the ext_proc
# cleared the route cache (404, flag NR), a route's direct_response, or a cluster put in maintenance mode (503,
# flag UO, which Envoy also sets for its circuit breakers' overflow: the details tell them apart). Not the
# replicas': a typo must not open a healthy pool's error breaker, nor teach its limit an instant's latency.
# Envoy's other local replies after an admission are the pool's (no_healthy_upstream, upstream timeouts and
# resets, its circuit breakers) or come with a flag above (a client's reset).
_NOT_ROUTED = frozenset(("cluster_not_found", "route_not_found", "route_configuration_not_found", "direct_response",
                         "maintenance_mode"))
_NOT_ROUTED_FLAGS = ("no_cluster_found", "no_route_found")


def not_routed(details: str) -> bool:
    """Whether Envoy's response code details say it answered the request itself, from its own configuration (the
    list above). Also read off the response headers' attributes when no access log reports the request
    (Stream._on_response_headers): Envoy sets these details with the NC and NR flags, so the details alone decide."""
    return details in _NOT_ROUTED


def outcome_of(entry: accesslog_pb2.HTTPAccessLogEntry) -> tuple[Outcome, int]:
    flags = entry.common_properties.response_flags
    status = entry.response.response_code.value
    if any(getattr(flags, f) for f in _CLIENT_FLAGS):
        return Outcome.CLIENT_ABORT, status
    details = entry.response.response_code_details
    if details.startswith(_EXTPROC_FAILED):
        return Outcome.EXTPROC_ERROR, status
    if not_routed(details) or any(getattr(flags, f) for f in _NOT_ROUTED_FLAGS):
        return Outcome.NOT_ROUTED, status
    if status >= 500 or any(getattr(flags, f) for f in _UPSTREAM_FLAGS):
        return Outcome.UPSTREAM_ERROR, status
    return Outcome.OK, status


def _seconds(d) -> float | None:
    return d.seconds + d.nanos / 1e9 if d.seconds or d.nanos else None


def _seconds_or_none(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("seconds")
    return float(value)


def header_answer_seconds(entry: accesslog_pb2.HTTPAccessLogEntry) -> float | None:
    """How long Envoy waited for the ext_proc's answer to the request's headers, by its own clock: the stream's
    start, its wait in gRPC core for the event loop, the handler and the way back. The headers are answered at
    once (the decision and any queueing for a slot come with the body), so this is what the ext_proc itself costs
    a request, however busy it is. None when the entry does not carry the filter's state."""
    state = under_filter_name(entry.common_properties.filter_state_objects)
    if state is None:
        return None
    try:
        latency = struct_pb2.Struct.FromString(state.value).fields.get("request_header_latency_us")
    except DecodeError:
        return None
    return latency.number_value / 1e6 if latency is not None else None


def completion_of(entry: accesslog_pb2.HTTPAccessLogEntry) -> Completion:
    outcome, status = outcome_of(entry)
    common = entry.common_properties
    return Completion(outcome, status, _seconds(common.time_to_first_downstream_tx_byte),
                      _seconds(common.time_to_last_downstream_tx_byte))


class CompletionReportEvents(Protocol):
    """What the receiver tells the outside world (telemetry implements it). Must be cheap and never raise."""

    # Once per batch of entries: how many matched a ticket the core knows, how many did not.
    # `relayed`: entries of another instance's tickets that reached it (it counts them as matched there); those
    # nobody heard count as unmatched, later, in a call of their own.
    def completions_reported(self, matched: int, unmatched: int, relayed: int = 0) -> None: ...

    # Requests that reached a replica with no ticket: Envoy's failure_mode_allow let them through unadmitted.
    def unadmitted_reported(self, count: int) -> None: ...

    # Once per batch of the sampled answers log: how long Envoy waited for the answers to its requests' headers
    # (header_answer_seconds), whichever instance answered them.
    def header_answers_reported(self, seconds: list[float]) -> None: ...


class NoCompletionReportEvents:
    def completions_reported(self, matched: int, unmatched: int, relayed: int = 0) -> None:
        pass

    def unadmitted_reported(self, count: int) -> None:
        pass

    def header_answers_reported(self, seconds: list[float]) -> None:
        pass


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):
    """Receives Envoy's access log stream and reports each admitted request's completion to the core."""

    def __init__(self, core: AdmissionController, events: CompletionReportEvents | None = None,
                 tags: TicketTags | None = None, relay: ReportRelay | None = None):
        self.core = core
        self.tags = tags or TicketTags()  # this process's tickets
        self.events: CompletionReportEvents = events or NoCompletionReportEvents()
        self.relay = relay
        self._pools: tuple[object, set[str]] | None = None  # the policy's pool clusters (rebuilt on a reload)
        if relay is not None:
            relay.on_reports(self.tags.process, self._relayed_in)
        self._closing = asyncio.Event()

    def close(self) -> None:
        """End every access log stream (at the end of a drain). Envoy keeps one open per worker for as long as the
        ext_proc lives, so a graceful stop would otherwise wait out its whole grace period for them; ended, they
        are reopened by Envoy on another instance, and the grace only waits for requests' own streams."""
        self._closing.set()

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context):
        closing = asyncio.ensure_future(self._closing.wait())
        handle = self._report
        try:
            while True:
                # One read at a time, raced with close(): a batch arrives every buffer_flush_interval at most.
                read = asyncio.ensure_future(context.read())
                await asyncio.wait((read, closing), return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    read.cancel()
                    break
                msg = read.result()
                if msg is grpc.aio.EOF:
                    break
                if msg.HasField("identifier"):  # a stream's first message names its log
                    handle = self._answers if msg.identifier.log_name == ANSWERS_LOG else self._report
                handle(msg)
        finally:
            closing.cancel()
        return als_pb2.StreamAccessLogsResponse()

    def _report(self, msg: als_pb2.StreamAccessLogsMessage) -> None:
        entries = msg.http_logs.log_entry
        matched = unadmitted = sent = elsewhere = 0
        others: dict[str, list[list]] | None = None  # another instance's reports, by instance
        for entry in entries:
            headers = entry.request.request_headers
            if TICKET_HEADER not in headers:  # envoy.yaml logs these only when they reached a replica unadmitted
                if self._a_pool(entry.common_properties.upstream_cluster, entry.request.path):
                    unadmitted += 1
                else:
                    elsewhere += 1
                continue
            tag = self.tags.parse(headers[TICKET_HEADER])
            if tag is None:
                continue  # not a ticket of ours at all
            ticket_id, instance = tag
            completion = completion_of(entry)
            if instance == self.tags.process:
                matched += self.core.report(ticket_id, completion)
            elif self.relay is not None:
                if others is None:
                    others = {}
                others.setdefault(instance, []).append(
                    [ticket_id, completion.outcome.value, completion.status, completion.first_byte_s,
                     completion.total_s, _replica(entry)])
                sent += 1
            if self.core.steering.active and completion.outcome in _ANSWERED:
                self._answered(_replica(entry), completion.outcome is Outcome.UPSTREAM_ERROR)
        if others:
            for instance, reports in others.items():
                self.relay.relay(instance, reports, self._relay_result(len(reports)))
        # The rest carry no ticket the core knows: e.g. one issued before a restart, or by another instance while
        # no store relays reports between instances. Those sent on are counted when the store says who heard them.
        self.events.completions_reported(matched, len(entries) - matched - unadmitted - elsewhere - sent)
        if unadmitted:
            self.events.unadmitted_reported(unadmitted)

    def _answers(self, msg: als_pb2.StreamAccessLogsMessage) -> None:
        """The sampled log of how long Envoy waited for the ext_proc's answers: no completion in it."""
        answers = [s for s in map(header_answer_seconds, msg.http_logs.log_entry) if s is not None]
        if answers:
            self.events.header_answers_reported(answers)

    def _a_pool(self, cluster: str, path: str) -> bool:
        """Whether an unticketed request went to a model pool: envoy.yaml's logger cannot tell a route a team added
        to another service (its own docs, an auth server: the ext_proc off, as it should be) from one to a pool,
        and counting those raised the unadmitted-requests alert for nothing. Counted as well: no cluster known,
        and a compute path (a pool the policy does not name is still a model server)."""
        policy = self.core.policy
        if self._pools is None or self._pools[0] is not policy:
            self._pools = (policy, {m.cluster for m in policy.models.values()} | set(policy.pools))
        return not cluster or cluster in self._pools[1] or path.split("?", 1)[0] in ENDPOINTS

    def _relay_result(self, count: int) -> Callable[[bool], None]:
        """Counts a relayed batch once its fate is known: `relayed` if its instance heard it, else `unmatched`
        (published to a channel nobody listens on, an old process's after a restart, or lost with the store),
        so the unmatched panel still shows reports that ended nowhere."""
        def heard(delivered: bool) -> None:
            self.events.completions_reported(0, 0 if delivered else count, count if delivered else 0)
        return heard

    def _relayed_in(self, reports: list[list]) -> None:
        """Reports another instance received for this one's tickets. Never raises (it runs in the store's
        subscriber): a malformed report counts as unmatched."""
        matched = 0
        for report in reports:
            try:
                ticket_id, outcome, status, first_byte_s, total_s, *rest = report
                completion = Completion(Outcome(outcome), int(status), _seconds_or_none(first_byte_s),
                                        _seconds_or_none(total_s))
                ticket_id = int(ticket_id)
            except (TypeError, ValueError):
                continue
            matched += self.core.report(ticket_id, completion)
            # This instance steers its own requests: it must see its replicas fail wherever the log arrived.
            replica = rest[0] if rest and isinstance(rest[0], str) else None
            if self.core.steering.active and completion.outcome in _ANSWERED:
                self._answered(replica, completion.outcome is Outcome.UPSTREAM_ERROR)
        self.events.completions_reported(matched, len(reports) - matched)

    def _answered(self, replica: str | None, failed: bool) -> None:
        """Which replica answered matters only while a pool is steered (policy.steering): Envoy's own outlier
        detection does not stop it from taking a host the ext_proc names."""
        if replica:
            self.core.replica_answered(replica, failed)


def _replica(entry: accesslog_pb2.HTTPAccessLogEntry) -> str | None:
    """IP:PORT of the replica that answered (as Envoy names its hosts), or None when none did."""
    upstream = entry.common_properties.upstream_remote_address.socket_address
    return host_port(upstream.address, upstream.port_value) if upstream.address else None
