"""Envoy's gRPC access log as the completion report: status, who ended the request, and its timings.

The ext_proc stream tells us *when* a request ends (its slot is freed then) but not *how*: Envoy closes it the same
way after a normal end and after a client abort, and an HTTP/1 upstream sends no trailers. Envoy's access log knows
(response code, response flags such as downstream or upstream termination, time to first byte), and it arrives in
batches, so one gRPC message carries many requests instead of one extra round trip each.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Protocol

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from ..policy.admission import AdmissionController
from ..policy.limits import Completion, Outcome
from .saturation import host_port

log = logging.getLogger("extproc.accesslog")

TICKET_HEADER = "x-extproc-ticket"


def ticket_prefix(worker: int | None) -> str:
    """What a worker's ticket headers start with: `<worker>-` when the ext_proc is one of several workers (Envoy
    then sends each worker's access-log entries to that worker, matched on the prefix: envoyconf.render), else
    nothing. The ticket's id follows."""
    return "" if worker is None else f"{worker}-"

_ANSWERED = (Outcome.OK, Outcome.UPSTREAM_ERROR)  # a client abort says nothing about the replica

# Response flags meaning the upstream side failed the request (it may still have sent a 200 first).
_UPSTREAM_FLAGS = ("upstream_remote_reset", "upstream_connection_failure", "upstream_connection_termination",
                   "upstream_request_timeout", "no_healthy_upstream", "upstream_overflow", "upstream_protocol_error",
                   "no_cluster_found", "upstream_max_stream_duration_reached", "stream_idle_timeout")
_CLIENT_FLAGS = ("downstream_connection_termination", "downstream_remote_reset")


def outcome_of(entry: accesslog_pb2.HTTPAccessLogEntry) -> tuple[Outcome, int]:
    flags = entry.common_properties.response_flags
    status = entry.response.response_code.value
    if any(getattr(flags, f) for f in _CLIENT_FLAGS):
        return Outcome.CLIENT_ABORT, status
    if status >= 500 or any(getattr(flags, f) for f in _UPSTREAM_FLAGS):
        return Outcome.UPSTREAM_ERROR, status
    return Outcome.OK, status


def _seconds(d) -> float | None:
    return d.seconds + d.nanos / 1e9 if d.seconds or d.nanos else None


def completion_of(entry: accesslog_pb2.HTTPAccessLogEntry) -> Completion:
    outcome, status = outcome_of(entry)
    common = entry.common_properties
    return Completion(outcome, status, _seconds(common.time_to_first_downstream_tx_byte),
                      _seconds(common.time_to_last_downstream_tx_byte))


class CompletionReportEvents(Protocol):
    """What the receiver tells the outside world (telemetry implements it). Must be cheap and never raise."""

    # Once per batch of entries: how many matched a ticket the core knows, how many did not.
    def completions_reported(self, matched: int, unmatched: int) -> None: ...

    # Requests that reached a replica with no ticket: Envoy's failure_mode_allow let them through unadmitted.
    def unadmitted_reported(self, count: int) -> None: ...


class NoCompletionReportEvents:
    def completions_reported(self, matched: int, unmatched: int) -> None:
        pass

    def unadmitted_reported(self, count: int) -> None:
        pass


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):
    """Receives Envoy's access log stream and reports each admitted request's completion to the core."""

    def __init__(self, core: AdmissionController, events: CompletionReportEvents | None = None,
                 worker: int | None = None):
        self.core = core
        self._prefix = ticket_prefix(worker)  # this worker's tickets
        self.events: CompletionReportEvents = events or NoCompletionReportEvents()
        self._closing = asyncio.Event()

    def close(self) -> None:
        """End every access log stream (at the end of a drain). Envoy keeps one open per worker for as long as the
        ext_proc lives, so a graceful stop would otherwise wait out its whole grace period for them; ended, they
        are reopened by Envoy on another instance, and the grace only waits for requests' own streams."""
        self._closing.set()

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context):
        closing = asyncio.ensure_future(self._closing.wait())
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
                self._report(msg)
        finally:
            closing.cancel()
        return als_pb2.StreamAccessLogsResponse()

    def _report(self, msg: als_pb2.StreamAccessLogsMessage) -> None:
        entries = msg.http_logs.log_entry
        matched = unadmitted = 0
        for entry in entries:
            headers = entry.request.request_headers
            if TICKET_HEADER not in headers:  # envoy.yaml logs these only when they reached a replica unadmitted
                unadmitted += 1
                continue
            value = headers[TICKET_HEADER]
            if not value.startswith(self._prefix):
                continue  # another worker's
            try:
                ticket_id = int(value[len(self._prefix):])
            except ValueError:
                continue
            completion = completion_of(entry)
            if self.core.report(ticket_id, completion):
                matched += 1
            if self.core.steering.active and completion.outcome in _ANSWERED:
                self._answered(entry, completion.outcome is Outcome.UPSTREAM_ERROR)
        # The others carry no ticket the core knows: e.g. one issued before a restart, or by another instance.
        self.events.completions_reported(matched, len(entries) - matched - unadmitted)
        if unadmitted:
            self.events.unadmitted_reported(unadmitted)

    def _answered(self, entry: accesslog_pb2.HTTPAccessLogEntry, failed: bool) -> None:
        """Which replica answered matters only while a pool is steered (policy.steering): Envoy's own outlier
        detection does not stop it from taking a host the ext_proc names."""
        upstream = entry.common_properties.upstream_remote_address.socket_address
        if upstream.address:
            self.core.replica_answered(host_port(upstream.address, upstream.port_value), failed)
