"""Prometheus metrics and decision logs, fed by the admission core's events (the core does not import this)."""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily

from .policy.admission import ACCEPT, Decision
from .policy.limits import Outcome, Ticket, Waiter

# LLM requests last from tens of milliseconds (a rejection, a short completion) to minutes (long generations).
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
                   90.0, 120.0)
# Queue waits are bounded by max_wait_ms (interactive ~200 ms, batch ~5 s).
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0)

decision_log = logging.getLogger("extproc.decisions")
disable_created_metrics()  # the *_created series double every counter for no operational value


class Telemetry:
    """Implements the core's AdmissionEvents; keeps label children cached so the hot path is a dict lookup."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("extproc_requests", "Final admission decisions by class, decision and reason.",
                                ["class", "decision", "reason"], registry=r)
        self.queue_entries = Counter("extproc_queue_entries", "Requests that had to wait in a class queue.",
                                     ["class"], registry=r)
        self.queue_wait = Histogram("extproc_queue_wait_seconds", "Time queued requests waited for a decision.",
                                    ["class"], buckets=WAIT_BUCKETS, registry=r)
        self.duration = Histogram("extproc_request_duration_seconds",
                                  "Admission to end of response, by class and how the request ended.",
                                  ["class", "outcome"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("extproc_time_to_first_byte_seconds",
                              "Request start to the first response byte sent to the client (for streams: the "
                              "first token, as vLLM sends headers with it), from Envoy's access log.",
                              ["class"], buckets=LATENCY_BUCKETS, registry=r)
        self.demotions = Counter("extproc_class_demotions", "Requests that claimed a class above their tenant's "
                                 "max_class and were demoted.", ["tenant"], registry=r)
        self.unknown_class = Counter("extproc_unknown_class_claims", "Requests that claimed a class the policy "
                                     "does not define (given the default).", ["tenant"], registry=r)
        self.reloads = Counter("extproc_config_reload", "Policy reloads by result.", ["result"], registry=r)
        self.stream_errors = Counter("extproc_stream_errors", "ext_proc gRPC streams that ended in an error in "
                                     "our handler (bugs; should stay 0).", registry=r)
        self._decision_children: dict[tuple[str, str, str], Any] = {}
        self._wait_children: dict[str, Any] = {}
        self._duration_children: dict[tuple[str, str], Any] = {}

    # --- AdmissionEvents ---

    def decided(self, d: Decision) -> None:
        key = (d.cls or "unclassified", d.kind, d.reason)
        child = self._decision_children.get(key)
        if child is None:
            child = self._decision_children[key] = self.requests.labels(*key)
        child.inc()
        c = d.classification
        if c is not None:
            if c.demoted:
                self.demotions.labels(c.tenant).inc()
            elif c.unknown:
                self.unknown_class.labels(c.tenant).inc()
        if d.waited_s > 0.0:
            w = self._wait_children.get(d.cls)
            if w is None:
                w = self._wait_children[d.cls] = self.queue_wait.labels(d.cls)
            w.observe(d.waited_s)
        if d.kind != ACCEPT and decision_log.isEnabledFor(logging.INFO):
            decision_log.info(json.dumps({"event": "decision", "class": d.cls, "tenant": d.tenant,
                                          "decision": d.kind, "reason": d.reason, "status": d.status,
                                          "retry_after": d.retry_after, "waited_s": round(d.waited_s, 4)}))

    def queued(self, waiter: Waiter) -> None:
        self.queue_entries.labels(waiter.limiter.name).inc()

    def finished(self, ticket: Ticket, outcome: Outcome, duration_s: float) -> None:
        key = (ticket.cls, outcome.value)
        h = self._duration_children.get(key)
        if h is None:
            h = self._duration_children[key] = self.duration.labels(*key)
        h.observe(duration_s)
        c = ticket.completion
        if c is not None and c.first_byte_s is not None and outcome is Outcome.OK:
            self.ttft.labels(ticket.cls).observe(c.first_byte_s)

    # --- scrape-time gauges ---

    def watch(self, snapshot: Callable[[], dict[str, dict[str, float]]]) -> None:
        """Register gauges read from the core at scrape time (no per-request gauge updates)."""
        self.registry.register(_CoreGauges(snapshot))


class _CoreGauges:
    def __init__(self, snapshot: Callable[[], dict[str, dict[str, float]]]):
        self._snapshot = snapshot

    def describe(self):  # no describe-time scrape: the snapshot is cheap but needs a running core
        return []

    def collect(self):
        inflight = GaugeMetricFamily("extproc_inflight", "Admitted requests not yet ended.", labels=["class"])
        queue = GaugeMetricFamily("extproc_queue_depth", "Requests waiting in the class queue.", labels=["class"])
        limit = GaugeMetricFamily("extproc_class_limit", "Current concurrency cap of the class.",
                                  labels=["class"])
        for cls, s in self._snapshot().items():
            inflight.add_metric([cls], s["inflight"])
            queue.add_metric([cls], s["queue"])
            limit.add_metric([cls], s["limit"])
        return [inflight, queue, limit]
