"""Every Prometheus metric of the ext_proc and its decision log, fed by events (none of their sources imports this).

The admission core reports through `AdmissionEvents`, the shared slot store's adapter through `StoreEvents`, the
access log receiver through `CompletionReportEvents`; each has a no-op default, and `Server` wires these in.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .policy.admission import ACCEPT, AdmissionController, Decision
from .policy.breakers import STATE_VALUES, Breaker, LatencyBreaker
from .policy.decision import DEGRADE, INVALID, REJECT, SHED, Canned
from .policy.reasons import (R_DEADLINE, R_DEGRADED_FULL, R_ERROR_BREAKER, R_HIGHER_SATURATED, R_LATENCY_BREAKER,
                             R_QUEUE_FULL, R_QUEUE_TIMEOUT)
from .policy.sustained import SustainedLoad
from .policy.limits import Outcome, Ticket, Waiter
from .policy.pool import LIMIT_MOVES, LOAD_TOLERANCE
from .policy.schema import LATENCY_BUCKETS
from .store.shared_slots import STORE_STATES

# What a class refuses (or degrades) for load: a full class and queue, a wait it cannot make, a queue timeout, an
# open breaker (Telemetry._refusals_at_zero).
LOAD_REASONS = (R_QUEUE_FULL, R_DEADLINE, R_QUEUE_TIMEOUT, R_LATENCY_BREAKER, R_ERROR_BREAKER)

# The event loop's lateness: ~0-1 ms idle; Envoy's message_timeout (0.5 s in envoy.yaml) is where it lets requests
# through unadmitted.
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Envoy's wait for an answer: ~0.2-1 ms on a quiet loopback; message_timeout (0.5 s) is where it gives up.
ANSWER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Queue waits are bounded by max_wait_ms (interactive ~200 ms, batch ~5 s).
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0)

decision_log = logging.getLogger("extproc.decisions")
# Per scraping thread: the core's gauges as read on the event loop for the scrape that thread writes (exposition()).
_scrape = threading.local()
disable_created_metrics()  # the *_created series double every counter for no operational value


class _Children(dict):
    """A labelled metric's children by label values (a tuple, or the value itself for one label).

    A hit is one dict lookup, where labels() checks its arguments, converts them and takes a lock on every call.
    Bounded like the metric itself: every label value comes from the policy (classes, tenants, pools, models) or a
    fixed set (decisions, reasons, outcomes), never from a request.
    """

    def __init__(self, metric):
        super().__init__()
        self.metric = metric

    def __missing__(self, key):
        child = self[key] = self.metric.labels(*key) if type(key) is tuple else self.metric.labels(key)
        return child


class LogBudget:
    """At most `per_s` decision lines a second for each (class, decision, reason); the rest are counted and
    summed up in one line when that key's next second begins, or at the next `flush()` after its second ended
    (the server flushes once a second, so a burst that stops is still summed up). A spike refuses or degrades
    thousands of requests a second: a line each would cost more CPU than the decisions (the metrics count every
    one). 0: no limit."""

    def __init__(self, per_s: int, clock=time.monotonic):
        self.per_s = per_s
        self.clock = clock
        self._windows: dict[tuple, list] = {}  # key -> [second it counts, lines written, lines suppressed]

    def allow(self, key: tuple) -> bool:
        if not self.per_s:
            return True
        now = self.clock()
        w = self._windows.get(key)
        if w is None or now - w[0] >= 1.0:
            if w is not None and w[2]:
                _suppressed(key, w[2], now - w[0])
            w = self._windows[key] = [now, 0, 0]
        if w[1] < self.per_s:
            w[1] += 1
            return True
        w[2] += 1
        return False

    def flush(self) -> None:
        """Sum up the keys whose second has ended, and forget them (off the request path: the housekeeping)."""
        now = self.clock()
        for key in [k for k, w in self._windows.items() if now - w[0] >= 1.0]:
            w = self._windows.pop(key)
            if w[2]:
                _suppressed(key, w[2], now - w[0])


def _suppressed(key: tuple, count: int, over_s: float) -> None:
    cls, kind, reason = key
    decision_log.info(json.dumps({"event": "decisions_suppressed", "class": cls, "decision": kind, "reason": reason,
                                  "count": count, "over_s": round(over_s, 3)}, separators=(",", ":")))


class Telemetry:
    """Implements the core's AdmissionEvents and the access log's CompletionReportEvents; owns the registry."""

    def __init__(self, registry: CollectorRegistry | None = None, log_accept_sample: float = 0.0,
                 log_per_s: int = 0, clock=time.monotonic):
        self.registry = registry or CollectorRegistry()
        self.log_accept_sample = log_accept_sample  # share of accepted requests logged too (all others are)
        self._accept_credit = 0.0
        self.log_budget = LogBudget(log_per_s, clock)  # decision lines per second per (class, decision, reason)
        self._core: AdmissionController | None = None  # set by watch()
        self._gauges: _CoreGauges | None = None  # set by watch()
        r = self.registry
        # Labelled metrics are kept as their cached children (see _Children); `.metric` is the metric itself.
        self.requests = _Children(Counter(
            "extproc_requests", "Final admission decisions by class, decision and reason.",
            ["class", "decision", "reason"], registry=r))
        self.queue_entries = _Children(Counter(
            "extproc_queue_entries", "Requests that had to wait in a class queue.", ["class"], registry=r))
        self.queue_wait = _Children(Histogram(
            "extproc_queue_wait_seconds", "Time queued requests waited for a decision.", ["class"],
            buckets=WAIT_BUCKETS, registry=r))
        self.tenant_wait = _Children(Histogram(
            "extproc_tenant_queue_wait_seconds", "Time queued requests waited for a decision, by class and tenant "
            "(a configured tenant or anonymous).", ["class", "tenant"], buckets=WAIT_BUCKETS, registry=r))
        self.duration = _Children(Histogram(
            "extproc_request_duration_seconds", "What clients waited for admitted requests, by class and how they "
            "ended: request start to the last response byte, time queued for a slot included (Envoy's access log; "
            "without its report, the time queued plus admission to end of response).",
            ["class", "outcome"], buckets=LATENCY_BUCKETS, registry=r))
        self.ttfb = _Children(Histogram(
            "extproc_time_to_first_byte_seconds", "Request start to the first response byte sent to the client (the "
            "response headers; vLLM sends them before the first token), from Envoy's access log, every request.",
            ["class"], buckets=LATENCY_BUCKETS, registry=r))
        self.ttft = _Children(Histogram(
            "extproc_time_to_first_token_seconds", "Arrival at the ext_proc to the first body chunk carrying "
            "generated text, on the sampled streams whose body is read (policy learn_sample).",
            ["class"], buckets=LATENCY_BUCKETS, registry=r))
        self.demotions = _Children(Counter(
            "extproc_class_demotions", "Requests that claimed a class above their tenant's max_class and were "
            "demoted.", ["tenant"], registry=r))
        self.unknown_class = _Children(Counter(
            "extproc_unknown_class_claims", "Requests that claimed a class the policy does not define (given the "
            "default).", ["tenant"], registry=r))
        self.canned = _Children(Counter(
            "extproc_canned_responses", "Requests answered at once with the class's canned fallback, by class, "
            "reason and the status sent. extproc_requests_total counts them as decision=\"degrade\"; a 4xx or 5xx "
            "status is a refusal to the client.", ["class", "reason", "status"], registry=r))
        self.shadow_decisions = _Children(Counter(
            "extproc_shadow_decisions", "Shadow mode: what enforce mode would have decided for requests it did not "
            "simply accept.", ["class", "would", "reason"], registry=r))
        self.breaker_transitions = _Children(Counter(
            "extproc_breaker_transitions", "Breaker state changes.", ["class", "pool", "kind", "to"], registry=r))
        self.cost_error = _Children(Histogram(
            "extproc_cost_estimate_error_ratio", "Actual GPU-seconds (from real usage) over the admission-time "
            "estimate, for requests whose usage was read.", ["class"],
            buckets=(0.1, 0.2, 0.33, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0), registry=r))
        self.learned_tokens = _Children(Counter(
            "extproc_learned_tokens", "Tokens read from responses' usage for cost learning (the sampled share, see "
            "policy learn_sample).", ["model", "kind"], registry=r))
        self.ratelimit = _Children(Counter(
            "extproc_ratelimit_decisions", "Tenant rate-limit checks by result.", ["tenant", "kind", "result"],
            registry=r))
        self.session_rejections = _Children(Counter(
            "extproc_session_rejections", "Requests refused by an agent-session budget.", ["tenant", "reason"],
            registry=r))
        self.pool_yields = _Children(Counter(
            "extproc_pool_yields", "Times a class's latency breaker would have degraded it on a pool with a "
            "pool-wide limit, and the lower classes gave way instead.", ["pool", "class"], registry=r))
        self.pool_limit_moves = _Children(Counter(
            "extproc_pool_limit_moves", "Moves of a pool-wide limit by why: cut_saturated (the replicas report "
            "saturation), cut_latency (an SLO class's service time over its target), raise (requests wait and the "
            "latency has room), settle (the limit does not bind: down towards the recent peak), onset_cap (a surge of "
            "the first class's arrivals, capped at the load its curve says meets the target).",
            ["pool", "action"], registry=r))
        self.reloads = _Children(Counter(
            "extproc_config_reload", "Policy reloads by result.", ["result"], registry=r))
        self.reload_ok = Gauge("extproc_config_last_reload_successful", "1 if the last policy reload applied, 0 "
                               "if it was refused (the previous policy is still serving).", registry=r)
        self.reload_ok.set(1)
        self.unknown_clusters = Gauge(
            "extproc_policy_unknown_clusters", "1 for each cluster the policy routes a model to "
            "(models.<name>.cluster) that the Envoy admin it names (a pool's envoy_admin) does not list: Envoy "
            "answers that model's admitted requests 503 cluster_not_found. Read at start, at each reload and every "
            "30 s; not exported when the policy names no envoy_admin.", ["cluster"], registry=r)
        self._unknown_clusters: set[str] = set()
        self.stream_errors = Counter("extproc_stream_errors", "ext_proc gRPC streams that ended in an error in "
                                     "our handler (bugs; should stay 0).", registry=r)
        self.completion_reports = Counter(
            "extproc_completion_reports", "Completion reports (Envoy's gRPC access log entries, one per admitted "
            "request) by result: matched (a ticket of this instance: the request's outcome and time to first byte "
            "are learned), relayed (another instance's ticket, sent on to it through the shared Redis store and "
            "heard there, where it counts as matched) or unmatched (a ticket no running instance knows, e.g. "
            "issued before a restart, or by another instance with no Redis store between them or while Redis "
            "was away: that outcome is lost).", ["result"],
            registry=r)
        self._matched = self.completion_reports.labels("matched")  # all exported from the start, at 0
        self._unmatched = self.completion_reports.labels("unmatched")
        self._relayed = self.completion_reports.labels("relayed")
        self.unadmitted = Counter(
            "extproc_unadmitted_requests", "Requests Envoy sent to a model pool (a cluster the policy's models or "
            "pools name, an unknown one, or any on a compute path) without admission (no ticket): "
            "failure_mode_allow let them through while the ext_proc was down, slower than message_timeout, or "
            "failing. From Envoy's access log; those of a whole outage may not be reported.", registry=r)

        self.header_answer = Histogram(
            "extproc_header_answer_seconds", "How long Envoy waited for the ext_proc's answer to a request's headers, "
            "by Envoy's clock, for a sample of requests (envoy.yaml's extproc_answers access log: 1%): gRPC's queue "
            "before the handler, the event loop and the network, not a slot's queue. Envoy gives up at "
            "message_timeout (0.5 s in envoy.yaml) and, with failure_mode_allow, sends the request on unadmitted. "
            "Counted by the instance that receives the log, whichever answered.",
            buckets=ANSWER_BUCKETS, registry=r)
        self.loop_lag = Histogram(
            "extproc_event_loop_lag_seconds", "How late the ext_proc's event loop woke up for a timer, sampled every "
            "0.1 s: what every decision currently waits for the loop. Near Envoy's message_timeout (0.5 s in "
            "envoy.yaml), requests go through unadmitted.", buckets=LOOP_LAG_BUCKETS, registry=r)

    def loop_lagged(self, seconds: float) -> None:
        self.loop_lag.observe(seconds)

    # --- AdmissionEvents ---

    def decided(self, d: Decision) -> None:
        self.requests[d.cls or "unclassified", d.kind, d.reason].inc()
        if type(d) is Canned:
            self.canned[d.cls, d.reason, str(d.status)].inc()
        c = d.classification
        if c is not None:
            if c.demoted:
                self.demotions[c.tenant].inc()
            elif c.unknown:
                self.unknown_class[c.tenant].inc()
        if d.waited_s > 0.0:
            self.queue_wait[d.cls].observe(d.waited_s)
            self.tenant_wait[d.cls, d.tenant].observe(d.waited_s)
        if d.kind != ACCEPT or d.shadow_would is not None or (self.log_accept_sample and self._sample_accept()):
            if self.log_budget.allow((d.cls, d.kind, d.reason)):
                self.log_decision(d)

    def rate_limit_checked(self, tenant: str, exceeded: str | None) -> None:
        if exceeded is None:
            self.ratelimit[tenant, "all", "allowed"].inc()
        else:
            self.ratelimit[tenant, exceeded, "limited"].inc()

    def session_refused(self, tenant: str, reason: str) -> None:
        self.session_rejections[tenant, reason].inc()

    def pool_yielded(self, pool: str, cls: str) -> None:
        self.pool_yields[pool, cls].inc()

    def pool_limit_moved(self, pool: str, action: str, before: float, after: float, sized_on: float,
                         inflight: float) -> None:
        self.pool_limit_moves[pool, action].inc()
        if action.startswith("cut"):  # at most one an interval per pool: the moves an incident review asks about
            # `inflight` is what the cut was sized on (`to` = min(from, inflight) x its factor); a latency cut
            # sizes on the window's average, which the instant's (`inflight_now`) may be far from.
            logging.getLogger("extproc.pool").info(json.dumps(
                {"event": "pool_limit", "pool": pool, "action": action, "from": round(before, 1),
                 "to": round(after, 1), "inflight": round(sized_on, 1), "inflight_now": round(inflight, 1)}))

    def cost_observed(self, ticket: Ticket, estimated_s: float, actual_s: float) -> None:
        if ticket.usage is not None and ticket.charge is not None:
            self.learned_tokens[ticket.charge.model, "prompt"].inc(ticket.usage[0])
            self.learned_tokens[ticket.charge.model, "completion"].inc(ticket.usage[1])
        if estimated_s > 0:
            self.cost_error[ticket.cls].observe(actual_s / estimated_s)

    def _sample_accept(self) -> bool:
        self._accept_credit += self.log_accept_sample
        if self._accept_credit >= 1.0:
            self._accept_credit -= 1.0
            return True
        return False

    @staticmethod
    def log_decision(d: Decision) -> None:
        """One JSON line: who, what and why. Never the API key, never the prompt."""
        if not decision_log.isEnabledFor(logging.INFO):
            return
        request_id = d.charge.request_id if d.charge else d.request_id
        line = {"event": "decision", "request_id": request_id, "tenant": d.tenant, "class": d.cls, "decision": d.kind,
                "reason": d.reason, "status": d.status}
        if d.retry_after:
            line["retry_after"] = d.retry_after
        if d.cluster:
            line["pool"] = d.cluster
        if d.message and d.kind != INVALID:  # what held the request (its cap, or a pool-wide limit and which part of
            # it): the client's text. Not for invalid requests: theirs echo what the client sent (a model name that
            # was an API key leaked it into the log, tests/reliability/test_security_envoy.py).
            line["message"] = d.message
        if d.waited_s:
            line["waited_s"] = round(d.waited_s, 4)
        if d.charge is not None:
            est = d.charge.estimate
            line.update(model=d.charge.model, prompt_tokens=est.prompt_tokens, max_tokens=est.max_tokens,
                        gpu_seconds=round(est.gpu_seconds, 4))
            if d.charge.alias is not None:
                line["model_alias"] = d.charge.alias
        if d.shadow_would is not None:
            line.update(would=d.shadow_would.kind, would_reason=d.shadow_would.reason)
        decision_log.info(json.dumps(line, separators=(",", ":")))

    def first_token(self, ticket: Ticket, seconds: float) -> None:
        self.ttft[ticket.cls].observe(seconds)

    def queued(self, waiter: Waiter) -> None:
        self.queue_entries[waiter.limiter.name].inc()

    def finished(self, ticket: Ticket, outcome: Outcome, latency_s: float) -> None:
        c = ticket.completion
        self.duration[ticket.cls, outcome.value].observe(latency_s)
        if c is not None and c.first_byte_s is not None and outcome is Outcome.OK:
            self.ttfb[ticket.cls].observe(c.first_byte_s)

    def shadow(self, cls: str, would: str, reason: str) -> None:
        self.shadow_decisions[cls, would, reason].inc()  # the request's own log line carries `would`

    def breaker_created(self, cls: str, pool: str, breaker: Breaker) -> None:
        """Its transition series (and a latency breaker's yields) start at 0: one born at 1 gives rate() nothing, and
        the dashboard's transitions panel missed the first trip of every breaker of every process."""
        for state in STATE_VALUES:
            self.breaker_transitions[cls, pool, breaker.kind, state]
        if isinstance(breaker, LatencyBreaker):  # what would trip it may make the lower classes yield instead
            self.pool_yields[pool, cls]

    def breaker_changed(self, cls: str, pool: str, breaker: Breaker, state: str) -> None:
        self.breaker_transitions[cls, pool, breaker.kind, state].inc()
        logging.getLogger("extproc.breakers").warning(json.dumps(
            {"event": "breaker", "class": cls, "pool": pool, "kind": breaker.kind, "state": state}))

    # --- CompletionReportEvents (the access log receiver, once per batch of entries) ---

    def completions_reported(self, matched: int, unmatched: int, relayed: int = 0) -> None:
        if matched:
            self._matched.inc(matched)
        if unmatched:
            self._unmatched.inc(unmatched)
        if relayed:
            self._relayed.inc(relayed)

    def unadmitted_reported(self, count: int) -> None:
        self.unadmitted.inc(count)

    def header_answers_reported(self, seconds: list[float]) -> None:
        observe = self.header_answer.observe
        for s in seconds:
            observe(s)

    # --- the server ---

    def policy_unknown_clusters(self, unknown: set[str]) -> None:
        """The routed clusters Envoy's admin does not list (extproc.server.clusters): 1 each, the rest removed."""
        for cluster in self._unknown_clusters - unknown:
            self.unknown_clusters.remove(cluster)
        for cluster in unknown:
            self.unknown_clusters.labels(cluster).set(1)
        self._unknown_clusters = set(unknown)

    def policy_reloaded(self, applied: bool) -> None:
        """A policy reload was applied, or refused because the file did not validate."""
        self.reloads["applied" if applied else "invalid"].inc()
        self.reload_ok.set(1 if applied else 0)
        if applied and self._core is not None:
            self._alerted_at_zero(self._core)
            self._shown_at_zero(self._core)
            self._end_removed_tenants(set(self._core.classifier.tenant_names))
            self._end_removed_pools(self._core)

    def _end_removed_tenants(self, tenants: set[str]) -> None:
        """End the series of tenants the policy no longer has: tenants come and go by reloads over a process's
        life, and each one ever configured kept its series. (A request of a removed tenant still queued may bring
        one back; the next reload ends it again.)"""
        for children, at in ((self.demotions, 0), (self.unknown_class, 0), (self.ratelimit, 0),
                             (self.session_rejections, 0), (self.tenant_wait, 1)):  # the tenant label's place
            _end_series(children, lambda labels: labels[at] in tenants)

    def _end_removed_pools(self, core: AdmissionController) -> None:
        """End the series of what the reload removed of a pool: the transitions of the breakers it dropped (of a
        removed class or pool, or a kind turned off; extproc_breaker_state drops them with the breakers), the
        yields on a pool no model routes to (or of a removed class) and the moves of a pool-wide limit it no
        longer has. A pool removed kept them for the process's life."""
        routed, classes = set(core.clusters.values()), core.policy.classes
        breakers = {(cls, pool, b.kind) for (cls, pool), bs in core.breakers.items() for b in bs}
        _end_series(self.breaker_transitions, lambda labels: labels[:3] in breakers)
        _end_series(self.pool_yields, lambda labels: labels[0] in routed and labels[1] in classes)
        _end_series(self.pool_limit_moves, lambda labels: labels[0] in core.gates)

    def _alerted_at_zero(self, core: AdmissionController) -> None:
        """Create at 0 the series an alert takes increase() of: one that first appears at 1 gives increase() 0, so
        the first bad reload or lease expiry of a process (every pod restart) went unalerted (an operator audit)."""
        for result in ("applied", "invalid"):
            self.reloads[result]
        for cls in core.policy.classes:
            self.duration[(cls, "lease_expired")]
            self.duration[(cls, "upstream_error")]  # ExtprocUpstreamErrors rates it
            self.duration[(cls, "not_routed")]      # ExtprocRequestsNotRouted

    def _shown_at_zero(self, core: AdmissionController) -> None:
        """Create at 0 the series a dashboard panel takes rate() or increase() of, where they are few: one born at 1
        gives them nothing. "Limit moves and lower classes yielding" missed the first move of each kind (an
        incident's first cut_saturated), "Queue entries" the first request of a class to queue, of every process.
        (The yields start at 0 with the latency breaker: breaker_created.)"""
        for cls, spec in core.policy.classes.items():
            self.queue_entries[cls]
            self._refusals_at_zero(cls, spec.fallback.action, cls in core.state.shed_by)
        for pool in core.gates:
            for action in LIMIT_MOVES:
                self.pool_limit_moves[pool, action]

    def _refusals_at_zero(self, cls: str, fallback: str, shed: bool) -> None:
        """A class's refusals and degrades for load, at 0 (extproc_requests_total): the refused and degraded share
        (recording rules, panel, ExtprocRejectionRatioHigh) rates them, and a burst of degrades within one scrape
        read as a flat series, a share of 0.0 over a whole spike (seen in a CI run of the dashboard test). The
        reasons a full class, its queue or its breakers give, each as the refusal and as the fallback (a degrade or
        a canned answer, both decision `degrade`), which refuses with the same reason when it cannot serve."""
        for reason in LOAD_REASONS:
            self.requests[cls, REJECT, reason]
            if fallback != "reject":
                self.requests[cls, DEGRADE, reason]
        if fallback == "degrade":
            self.requests[cls, REJECT, R_DEGRADED_FULL]
        if shed:
            self.requests[cls, SHED, R_HIGHER_SATURATED]

    # --- scrape-time gauges ---

    def watch(self, core: AdmissionController, sustained: SustainedLoad | None = None) -> None:
        """Register gauges read from the core at scrape time (no per-request gauge updates)."""
        self._core = core
        self._alerted_at_zero(core)
        self._shown_at_zero(core)
        self._gauges = _CoreGauges(core, sustained)
        self.registry.register(self._gauges)

    def core_families(self) -> list:
        """The core's gauges, read now: on the event loop, the only thread that may read the core."""
        return list(self._gauges.read()) if self._gauges is not None else []

    def exposition(self, core_families: list) -> bytes:
        """The /metrics text, with the core's gauges as core_families() read them: for a thread of its own. Written
        on the event loop, 2,000 tenants in two classes (~50,000 series) held it ~1 s a scrape, past Envoy's
        message_timeout; reading the core is ~40 ms of that."""
        _scrape.families = core_families
        try:
            return generate_latest(self.registry)
        finally:
            _scrape.families = None


def _end_series(children: _Children, keep) -> None:
    """Remove the series whose label values `keep` refuses (a reload removed what they count)."""
    for key in list(children):
        labels = key if isinstance(key, tuple) else (key,)  # one label's children are keyed by its value
        if not keep(labels):
            children.metric.remove(*labels)
            del children[key]


def cap_scope(core: AdmissionController) -> str:
    """What a class cap of this ext_proc bounds (extproc_class_limit{scope}): its own slots (`instance`), the slots
    of the workers of one `serve --workers N` through the host's memory (`host`), or those of every ext_proc on
    the same Redis store (`fleet`)."""
    if not core.shared_slots:
        return "instance"
    return "fleet" if core.policy.store.kind == "redis" else "host"


class StoreTelemetry:
    """Implements the shared slot store adapter's StoreEvents: its metrics, registered only where a shared store
    runs (with `store: {kind: redis}`)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.state_gauge = Gauge("extproc_store_state", "1 for the slot store's current state: shared (Redis "
                                 "answers), local (fail open on per-replica caps) or closed (fail closed).",
                                 ["state"], registry=registry)
        self.switches = Counter("extproc_store_switches", "Switches of the slot store's state, by the state "
                                "switched to.", ["to"], registry=registry)
        self.leases_lost = Counter("extproc_store_leases_lost", "Global slots of running requests that expired "
                                   "before their renewal (Redis slow or away longer than lease_ms); re-adopted.",
                                   registry=registry)
        self._states = {s: self.state_gauge.labels(s) for s in STORE_STATES}
        # Every `to` exported from the start at 0: a series born at the first switch holds it in its first sample,
        # and increase() (the dashboard's "shared store -> local" line) never sees that one.
        for s in STORE_STATES:
            self.switches.labels(s)

    def store_state(self, state: str, switched: bool) -> None:
        for s, child in self._states.items():
            child.set(1 if s == state else 0)
        if switched:
            self.switches.labels(state).inc()

    def store_leases_lost(self, count: int) -> None:
        self.leases_lost.inc(count)


class _CoreGauges:
    def __init__(self, core: AdmissionController, sustained: SustainedLoad | None):
        self._core = core
        self._sustained = sustained

    def describe(self):  # no describe-time scrape: the snapshot is cheap but needs a running core
        return []

    def collect(self):
        frozen = getattr(_scrape, "families", None)  # a scrape written in a thread: what the loop read for it
        return iter(frozen) if frozen is not None else self.read()

    def read(self):
        inflight = GaugeMetricFamily("extproc_inflight", "Admitted requests not yet ended.", labels=["class"])
        degraded = GaugeMetricFamily("extproc_degraded_inflight", "Degraded requests (on a fallback) not yet "
                                     "ended.", labels=["class"])
        queue = GaugeMetricFamily("extproc_queue_depth", "Requests waiting in the class queue.", labels=["class"])
        limit = GaugeMetricFamily("extproc_class_limit", "Current concurrency cap of the class, and what it bounds "
                                  "(scope): instance (this ext_proc's slots: the fleet's cap is the sum over "
                                  "instances), host (the workers of one `serve --workers N` share it: count it once "
                                  "per host) or fleet (every ext_proc on the Redis store shares it: count it once; "
                                  "while extproc_store_state{state=\"local\"} is 1 it is this instance's share).",
                                  labels=["class", "scope"])
        gpu = GaugeMetricFamily("extproc_inflight_gpu_seconds", "Estimated GPU-seconds of the class's admitted "
                                "requests not yet ended.", labels=["class"])
        slo = GaugeMetricFamily("extproc_class_slo_seconds", "The class's p95 latency SLO from the policy.",
                                labels=["class"])
        for cls, spec in self._core.policy.classes.items():
            if spec.slo_p95_ms:
                slo.add_metric([cls], spec.slo_p95_ms / 1000.0)
        yield slo
        scope = cap_scope(self._core)
        for cls, s in self._core.snapshot().items():
            gpu.add_metric([cls], s["inflight_cost"])
            inflight.add_metric([cls], s["inflight"])
            degraded.add_metric([cls], s["degraded_inflight"])
            queue.add_metric([cls], s["queue"])
            limit.add_metric([cls, scope], s["limit"])
        yield from (inflight, degraded, queue, limit, gpu)
        if self._sustained is not None:
            yield from self._sustained_load()
        yield from self._breakers()
        yield self._cost_models()
        yield from self._pools()
        yield from self._flows()

    def _flows(self):
        """Each class queue's flows, by metric label: configured tenants, anonymous, and "other" for keys from a
        fairness header that name no tenant (the label set stays bounded); of the classes a reload removed, while
        their requests run."""
        labels = ["class", "tenant"]
        inflight = GaugeMetricFamily("extproc_tenant_inflight", "Admitted requests of the tenant in the class not "
                                     "yet ended.", labels=labels)
        waiting = GaugeMetricFamily("extproc_tenant_waiting", "Requests of the tenant in the class's queue, or "
                                    "holding its slot while they wait for the shared store's.", labels=labels)
        served = GaugeMetricFamily("extproc_tenant_served_gpu_seconds", "Estimated GPU-seconds admitted for the "
                                   "tenant in the class since start, corrected by learned usage (so it may step "
                                   "down): the charged minus the refunded counter. For a rate, rate() those two.",
                                   labels=labels)
        charged = CounterMetricFamily("extproc_tenant_charged_gpu_seconds", "Estimated GPU-seconds admitted for the "
                                      "tenant in the class (each estimate times what the tenant's sampled requests "
                                      "really cost against theirs), plus learned usage above the charges.",
                                      labels=labels)
        refunded = CounterMetricFamily("extproc_tenant_refunded_gpu_seconds", "Learned usage below the charges of "
                                       "the tenant's requests in the class, and the whole charge of those that "
                                       "never ran (their slot taken back before they went upstream), in "
                                       "GPU-seconds (served = charged - refunded).", labels=labels)
        waited = CounterMetricFamily("extproc_tenant_queue_waited_seconds", "Seconds the tenant's granted requests "
                                     "waited in the class's queue.", labels=labels)
        index = GaugeMetricFamily("extproc_class_fairness_index", "Jain's index (1: each got its due, 1/n: one "
                                  "tenant has all) of the GPU-seconds served to the class's tenants (and "
                                  "fairness-header keys of requests without an API key, one by one, each against "
                                  "its part of the anonymous share) over about the last minute, each against its "
                                  "weighted max-min share given what it asked: served, refused or degraded for want "
                                  "of room, and waiting. A tenant that got all it asked reads as fairly served.",
                                  labels=["class"])
        reserved = self._reserved()
        # A removed class's requests run on (extproc_inflight shows them): its tenants' series stay till they end.
        for lim in self._core.class_limiters():
            cls, q = lim.name, lim.queue
            for label, st in list(q.stats.items()):
                held = reserved.get((cls, label), 0)
                inflight.add_metric([cls, label], st.inflight - held)
                waiting.add_metric([cls, label], st.waiting + held)
                served.add_metric([cls, label], st.served_gpu_s)
                charged.add_metric([cls, label], st.charged_gpu_s)
                refunded.add_metric([cls, label], st.refunded_gpu_s)
                waited.add_metric([cls, label], st.waited_s)
            index.add_metric([cls], q.fairness_index())
        yield from (inflight, waiting, served, charged, refunded, waited, index)

    def _reserved(self) -> dict[tuple[str, str], int]:
        """Per class and tenant label, the admissions that hold a slot while they wait for the shared store's
        global slot: queued, not in flight, as extproc_queue_depth and extproc_inflight count them."""
        out: dict[tuple[str, str], int] = {}
        if not any(lim.reserved for lim in self._core.class_limiters()):
            return out  # the usual case: no shared store, or nobody waiting for it
        for t in list(self._core.tickets.values()):
            if t.awaiting_store:
                key = (t.limiter.name, t.limiter.queue.label(t.flow))
                out[key] = out.get(key, 0) + 1
        return out

    def _pools(self):
        sat = GaugeMetricFamily("extproc_pool_saturated", "1 while the pool's replicas report saturation (vLLM "
                                "waiting requests, KV cache, preemptions) or cannot be read.", labels=["pool"])
        kv = GaugeMetricFamily("extproc_pool_kv_cache_usage", "Highest vllm:kv_cache_usage_perc among the pool's "
                               "replicas (0-1).", labels=["pool"])
        waiting = GaugeMetricFamily("extproc_pool_waiting", "Highest vllm:num_requests_waiting among the pool's "
                                    "replicas, less those deferred by the LoRA budget (vLLM's "
                                    "num_requests_waiting_by_reason{reason=\"deferred\"}).", labels=["pool"])
        stalled = GaugeMetricFamily("extproc_pool_stalled_replicas", "Replicas that hold requests while their "
                                    "token counters stood still for the pool's stall_ms (a hung engine).",
                                    labels=["pool"])
        slow = GaugeMetricFamily("extproc_pool_slow_replicas", "Replicas whose inter-token latency is over the "
                                 "pool's slow_ratio times its fastest replica's (classes with an SLO are sent "
                                 "to the others).", labels=["pool"])
        now = self._core.clock()
        for pool in list(self._core.saturation):
            s = self._core.pool_reading(pool, now)  # one nobody refreshes is not shown (nor used)
            if s is None:
                continue
            sat.add_metric([pool], float(s.saturated))
            kv.add_metric([pool], s.kv_usage)
            waiting.add_metric([pool], s.waiting)
            stalled.add_metric([pool], s.stalled)
            slow.add_metric([pool], s.slow)
        yield from (sat, kv, waiting, stalled, slow)
        limit = GaugeMetricFamily("extproc_pool_limit", "The pool-wide limit now, in its unit (tokens: prompt + "
                                  "max_tokens of the requests held; requests).", labels=["pool", "unit"])
        held = GaugeMetricFamily("extproc_pool_inflight", "What each class holds of the pool-wide limit, in its "
                                 "unit.", labels=["pool", "unit", "class"])
        queued = GaugeMetricFamily("extproc_pool_waiting_requests", "Requests queued for room under the pool-wide "
                                   "limit, by class (not those whose class's own cap is full).",
                                   labels=["pool", "class"])
        share = GaugeMetricFamily("extproc_pool_held_to_share_seconds", "Seconds the class still gets no more "
                                  "than its min_share of the pool-wide limit, by why: rest (after a request over its "
                                  "share while the pool was contended) or squeeze (a higher class's latency breaker "
                                  "opened on a full pool; holds even with room).", labels=["pool", "class", "why"])
        service = GaugeMetricFamily("extproc_pool_service_seconds", "What the pool-wide limit reads of each class "
                                    "with an SLO, at its last move: served (the quantile of its service time on "
                                    "the pool, queue wait left out), baseline (its calm level) and target (target x "
                                    "SLO). The limit cuts on latency only when served is over target and over "
                                    f"baseline x {LOAD_TOLERANCE:g}.", labels=["pool", "class", "what"])
        for pool, g in list(self._core.gates.items()):
            unit = g.spec.unit
            limit.add_metric([pool, unit], g.limit)
            c = g.controller
            for rank, slo in c.slos.items():
                cls = g.class_names[rank]
                service.add_metric([pool, cls, "target"], c.spec.target * slo)
                for what, values in (("served", c.served), ("baseline", c.baseline)):
                    if rank in values:
                        service.add_metric([pool, cls, what], values[rank])
            waiters = self._core.waiting_for_pool(g)
            for rank, (cls, units, waiting) in enumerate(zip(g.class_names, g.held, waiters)):
                held.add_metric([pool, unit, cls], units)
                queued.add_metric([pool, cls], waiting)
                rest, squeezed = g.held_to_share(rank, now)
                share.add_metric([pool, cls, "rest"], rest)
                share.add_metric([pool, cls, "squeeze"], squeezed)
        yield from (limit, held, queued, share, service)

    def _sustained_load(self):
        window = f"{self._sustained.window_s:g}s"
        q = GaugeMetricFamily("extproc_queue_depth_avg", "Queue depth averaged over the sustained window: the "
                              "autoscaling signal (bursts are admission control's job).", labels=["class", "window"])
        r = GaugeMetricFamily("extproc_inflight_ratio_avg", "This instance's in-flight / its extproc_class_limit, "
                              "averaged over the sustained window: the fleet's ratio only with one ext_proc (with a "
                              "shared cap, scope fleet or host, the instances' ratios add up).",
                              labels=["class", "window"])
        for cls, (depth, ratio) in self._sustained.averages().items():
            q.add_metric([cls, window], depth)
            r.add_metric([cls, window], ratio)
        yield from (q, r)

    def _cost_models(self):
        fam = GaugeMetricFamily("extproc_cost_model", "Cost coefficients per model: the GPU-second ones as "
                                "configured; the service-time fit (service_*) and the output ratio as learned.",
                                labels=["model", "param"])
        for name, m in self._core.cost_models.items():
            fam.add_metric([name, "prefill_s_per_1k_tokens"], m.prefill_per_token * 1000)
            fam.add_metric([name, "decode_s_per_token"], m.decode_per_token)
            fam.add_metric([name, "decode_s_per_1k_context"], m.context_per_token * 1000)
            fam.add_metric([name, "service_prefill_s_per_1k_tokens"], m.service_prefill * 1000)
            fam.add_metric([name, "service_decode_s_per_token"], m.service_decode)
            fam.add_metric([name, "output_ratio"], m.output_ratio)
            fam.add_metric([name, "samples"], m.samples)
        return fam

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
                state.add_metric([cls, pool, b.kind], STATE_VALUES[b.poll(now)])
                if isinstance(b, LatencyBreaker):
                    p95.add_metric([cls, pool], b.p95(now))
                else:
                    err.add_metric([cls, pool], b.error_ratio(now))
        yield from (state, p95, err)
