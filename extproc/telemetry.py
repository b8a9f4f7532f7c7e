"""Prometheus metrics and decision logs, fed by the admission core's events (the core does not import this)."""

from __future__ import annotations

import json
import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily

from .policy.admission import ACCEPT, AdmissionController, Decision
from .policy.breakers import STATE_VALUES, Breaker, LatencyBreaker
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
        self.shadow_decisions = Counter("extproc_shadow_decisions", "Shadow mode: what enforce mode would have "
                                        "decided for requests it did not simply accept.",
                                        ["class", "would", "reason"], registry=r)
        self.breaker_transitions = Counter("extproc_breaker_transitions", "Breaker state changes.",
                                           ["class", "pool", "kind", "to"], registry=r)
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

    def shadow(self, cls: str, would: str, reason: str) -> None:
        self.shadow_decisions.labels(cls, would, reason).inc()
        if decision_log.isEnabledFor(logging.INFO):
            decision_log.info(json.dumps({"event": "shadow", "class": cls, "would": would, "reason": reason}))

    def breaker_changed(self, cls: str, pool: str, breaker: Breaker, state: str) -> None:
        self.breaker_transitions.labels(cls, pool, breaker.kind, state).inc()
        logging.getLogger("extproc.breakers").warning(json.dumps(
            {"event": "breaker", "class": cls, "pool": pool, "kind": breaker.kind, "state": state}))

    # --- scrape-time gauges ---

    def watch(self, core: AdmissionController) -> None:
        """Register gauges read from the core at scrape time (no per-request gauge updates)."""
        self.registry.register(_CoreGauges(core))


class _CoreGauges:
    def __init__(self, core: AdmissionController):
        self._core = core

    def describe(self):  # no describe-time scrape: the snapshot is cheap but needs a running core
        return []

    def collect(self):
        inflight = GaugeMetricFamily("extproc_inflight", "Admitted requests not yet ended.", labels=["class"])
        degraded = GaugeMetricFamily("extproc_degraded_inflight", "Degraded requests (on a fallback) not yet "
                                     "ended.", labels=["class"])
        queue = GaugeMetricFamily("extproc_queue_depth", "Requests waiting in the class queue.", labels=["class"])
        limit = GaugeMetricFamily("extproc_class_limit", "Current concurrency cap of the class.",
                                  labels=["class"])
        for cls, s in self._core.snapshot().items():
            inflight.add_metric([cls], s["inflight"])
            degraded.add_metric([cls], s["degraded_inflight"])
            queue.add_metric([cls], s["queue"])
            limit.add_metric([cls], s["limit"])
        yield from (inflight, degraded, queue, limit)
        yield from self._breakers()

    def _breakers(self):
        labels = ["class", "pool", "kind"]
        state = GaugeMetricFamily("extproc_breaker_state", "Breaker state: 0 closed, 1 half-open, 2 open.",
                                  labels=labels)
        p95 = GaugeMetricFamily("extproc_breaker_window_p95_seconds", "p95 latency over the latency breaker's "
                                "window.", labels=["class", "pool"])
        err = GaugeMetricFamily("extproc_breaker_window_error_ratio", "Failed share of the error breaker's "
                                "window.", labels=["class", "pool"])
        now = self._core.clock()
        for (cls, pool), breakers in list(self._core.breakers.items()):
            for b in breakers:
                state.add_metric([cls, pool, b.kind], STATE_VALUES[b.state])
                if isinstance(b, LatencyBreaker):
                    p95.add_metric([cls, pool], b.p95(now))
                else:
                    err.add_metric([cls, pool], b.error_ratio(now))
        yield from (state, p95, err)
