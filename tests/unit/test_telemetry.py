"""Telemetry: every metric's name, type and labels are a contract (rules, dashboard), and each event counts."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc.aio
import pytest
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf import struct_pb2
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from extproc.policy.admission import ACCEPT, DEGRADE, REJECT, AdmissionController, RequestFacts
from extproc.policy.limits import Completion, Outcome
from extproc.policy.schema import load_policy_file
from extproc.server.accesslog import ANSWERS_LOG, EXT_PROC_STATE, TICKET_HEADER, AccessLogReceiver, TicketTags
from extproc.server import main as server_main
from extproc.server.main import Server, add_arguments
from extproc.store.shared_slots import CLOSED, LOCAL, SHARED
from extproc.telemetry import StoreTelemetry, Telemetry

from .conftest import make_policy

# What Prometheus rules, the Grafana dashboard and operators' own queries rely on: changing a name, a type or a
# label set breaks them silently. (Counters are exposed with a _total suffix.)
METRICS = {
    "extproc_breaker_transitions": ("counter", ("class", "pool", "kind", "to")),
    "extproc_canned_responses": ("counter", ("class", "reason", "status")),
    "extproc_class_demotions": ("counter", ("tenant",)),
    "extproc_completion_reports": ("counter", ("result",)),
    "extproc_unadmitted_requests": ("counter", ()),
    "extproc_header_answer_seconds": ("histogram", ()),
    "extproc_event_loop_lag_seconds": ("histogram", ()),
    "extproc_config_last_reload_successful": ("gauge", ()),
    "extproc_config_reload": ("counter", ("result",)),
    "extproc_policy_unknown_clusters": ("gauge", ("cluster",)),
    "extproc_cost_estimate_error_ratio": ("histogram", ("class",)),
    "extproc_learned_tokens": ("counter", ("model", "kind")),
    "extproc_pool_yields": ("counter", ("pool", "class")),
    "extproc_pool_limit_moves": ("counter", ("pool", "action")),
    "extproc_queue_entries": ("counter", ("class",)),
    "extproc_queue_wait_seconds": ("histogram", ("class",)),
    "extproc_ratelimit_decisions": ("counter", ("tenant", "kind", "result")),
    "extproc_request_duration_seconds": ("histogram", ("class", "outcome")),
    "extproc_requests": ("counter", ("class", "decision", "reason")),
    "extproc_session_rejections": ("counter", ("tenant", "reason")),
    "extproc_shadow_decisions": ("counter", ("class", "would", "reason")),
    "extproc_stream_errors": ("counter", ()),
    "extproc_tenant_queue_wait_seconds": ("histogram", ("class", "tenant")),
    "extproc_time_to_first_byte_seconds": ("histogram", ("class",)),
    "extproc_time_to_first_token_seconds": ("histogram", ("class",)),
    "extproc_unknown_class_claims": ("counter", ("tenant",)),
}
STORE_METRICS = {
    "extproc_store_leases_lost": ("counter", ()),
    "extproc_store_state": ("gauge", ("state",)),
    "extproc_store_switches": ("counter", ("to",)),
}


def defined(owner) -> dict[str, tuple[str, tuple[str, ...]]]:
    """name: (type, label names) of every metric an object holds (labelled ones as their cached children)."""
    metrics = [getattr(v, "metric", v) for v in vars(owner).values()]
    return {m._name: (m._type, tuple(m._labelnames)) for m in metrics if isinstance(m, MetricWrapperBase)}


def test_every_metric_keeps_its_name_type_and_labels():
    assert defined(Telemetry()) == METRICS
    assert defined(StoreTelemetry(CollectorRegistry())) == STORE_METRICS


def limited_core(telemetry: Telemetry, **tenant) -> AdmissionController:
    policy = make_policy(tenants=[{"name": "acme", "api_keys": ["k"], **tenant},
                                  {"name": "free", "api_keys": ["kf"]}],
                         sessions={"max_inflight_gpu_seconds": 1.0}, shed={},
                         classes={"batch": {"max_concurrency": 100}}, default_class="batch")
    return AdmissionController(policy, clock=lambda: 1000.0, events=telemetry)


def sample(t: Telemetry, name: str, **labels) -> float:
    return t.registry.get_sample_value(name, labels) or 0.0


def test_the_series_an_alert_takes_increase_of_exist_at_zero_from_the_start():
    # An operator audit: a counter child first created at 1 gives increase() 0, so ExtprocConfigReloadFailed and
    # ExtprocLeaseExpired missed the first bad reload or expiry of every process (every pod restart).
    t = Telemetry()
    core = AdmissionController(make_policy(), clock=lambda: 0.0, events=t)
    t.watch(core)
    text = generate_latest(t.registry).decode()
    assert 'extproc_config_reload_total{result="invalid"} 0.0' in text
    for cls in core.policy.classes:
        for outcome in ("lease_expired", "upstream_error", "not_routed"):
            assert f'extproc_request_duration_seconds_count{{class="{cls}",outcome="{outcome}"}} 0.0' in text


def test_breaker_transitions_exist_at_zero_from_the_breakers_creation():
    """A transition series born at 1 gives rate() nothing: the dashboard's Breaker transitions panel missed the first
    open, half-open and close of every breaker of every process (in a long run read back from Prometheus, the
    increase over the run counted 12 opens of 14)."""
    t = Telemetry()
    policy = make_policy(classes={"interactive": {"max_concurrency": 4, "slo_p95_ms": 1000}}, tenants=[])
    core = AdmissionController(policy, clock=lambda: 0.0, events=t)
    t.watch(core)
    core.decide(RequestFacts(model="llama"))  # the class's breakers on the model's pool are created on first use
    text = generate_latest(t.registry).decode()
    for kind in ("latency", "error"):
        for to in ("open", "half_open", "closed"):
            assert (f'extproc_breaker_transitions_total{{class="interactive",kind="{kind}",pool="pool_a",to="{to}"}}'
                    f' 0.0') in text, (kind, to)


def test_pool_limit_moves_yields_and_queue_entries_exist_at_zero_before_the_first():
    """A move or yield series born at 1 gives increase() nothing: the dashboard's "Limit moves and lower classes
    yielding" panel missed the first cut of each kind of every process (an incident's first cut_saturated), and
    the first yield of each class, in a real run read back from Prometheus (tests/ops/test_dashboard_panels.py);
    "Queue entries" the first request of each class to queue (seen there: batch's first sample read 1)."""
    t = Telemetry()
    policy = make_policy(classes={"interactive": {"max_concurrency": 4, "slo_p95_ms": 1000},
                                  "batch": {"max_concurrency": 4}}, tenants=[],
                         pools={"pool_a": {"limit": {"enabled": True, "unit": "requests"}}})
    core = AdmissionController(policy, clock=lambda: 0.0, events=t)
    t.watch(core)
    text = generate_latest(t.registry).decode()
    for cls in ("interactive", "batch"):  # the "Queue entries" panel's, likewise
        assert f'extproc_queue_entries_total{{class="{cls}"}} 0.0' in text, cls
    for action in ("cut_saturated", "cut_latency", "raise", "settle", "onset_cap"):
        assert f'extproc_pool_limit_moves_total{{action="{action}",pool="pool_a"}} 0.0' in text, action
    core.decide(RequestFacts(model="llama"))  # interactive's breakers on the pool, its latency breaker among them
    text = generate_latest(t.registry).decode()
    assert 'extproc_pool_yields_total{class="interactive",pool="pool_a"} 0.0' in text


def test_a_classs_refusals_and_degrades_for_load_exist_at_zero_before_the_first():
    """The refused and degraded share rates extproc_requests_total: a burst of a spike's degrades within one scrape
    was a series born at its total, and the share read 0.0 over the whole spike (a CI run of
    tests/ops/test_dashboard_panels.py). Each class's refusals for load start at 0: as refusals, as its fallback's
    answers (decision degrade, for a degrade or canned fallback), and as shed where a class sheds it."""
    t = Telemetry()
    policy = make_policy(classes={"interactive": {"max_concurrency": 4, "on_overflow": "fallback",
                                                  "fallback": {"action": "degrade", "max_tokens": 8}},
                                  "batch": {"max_concurrency": 4}}, tenants=[])
    core = AdmissionController(policy, clock=lambda: 0.0, events=t)
    t.watch(core)
    text = generate_latest(t.registry).decode()

    def zero(cls: str, decision: str, reason: str) -> bool:
        return f'extproc_requests_total{{class="{cls}",decision="{decision}",reason="{reason}"}} 0.0' in text

    for reason in ("queue_full", "deadline_unmeetable", "queue_timeout", "latency_breaker_open", "error_breaker_open"):
        assert zero("interactive", "degrade", reason) and zero("interactive", "reject", reason), reason
        assert zero("batch", "reject", reason) and not zero("batch", "degrade", reason), reason
    assert zero("interactive", "reject", "degraded_capacity_full")
    assert zero("batch", "shed", "higher_class_saturated") and not zero("interactive", "shed", "higher_class_saturated")


def test_breaker_state_of_an_idle_class_moves_on_with_time():
    """The state gauge read the breaker's state as the last request left it: a class whose traffic stopped while
    its breaker was open showed 2 (open) for ever, and ExtprocBreakerNotClosed fired on an idle class."""
    clock = [0.0]
    t = Telemetry()
    policy = make_policy(classes={"interactive": {"max_concurrency": 4, "slo_p95_ms": 1000}}, tenants=[])
    core = AdmissionController(policy, clock=lambda: clock[0], events=t)
    t.watch(core)
    core.decide(RequestFacts(model="llama"))
    err = next(b for b in core.pool_breakers("interactive", "pool_a") if b.kind == "error")
    for _ in range(err.min_requests):
        err.observe(0.0, True, False)
    assert err.state == "open"
    line = 'extproc_breaker_state{class="interactive",kind="error",pool="pool_a"}'
    assert f"{line} 2.0" in generate_latest(t.registry).decode()
    clock[0] = err.cooldown_s + err.trickle_s + 1.0  # nobody asked since
    assert f"{line} 0.0" in generate_latest(t.registry).decode()


def test_a_reload_that_removes_a_pool_ends_its_breaker_series():
    """A pool no model routes to any more kept its breakers' series, an open one at 2, until a restart: dashboards
    showed a breaker of a pool the operator had removed. Its request still running ends without bringing them back."""
    t = Telemetry()
    policy = make_policy(classes={"interactive": {"max_concurrency": 4, "slo_p95_ms": 1000}}, tenants=[])
    core = AdmissionController(policy, clock=lambda: 0.0, events=t)
    t.watch(core)
    core.decide(RequestFacts(model="llama"))
    d = core.decide(RequestFacts(model="small"))  # on pool_b
    err = next(b for b in core.pool_breakers("interactive", "pool_b") if b.kind == "error")
    for _ in range(err.min_requests):
        err.observe(0.0, True, False)
    assert 'extproc_breaker_state{class="interactive",kind="error",pool="pool_b"} 2.0' in generate_latest(
        t.registry).decode()
    core.apply(make_policy(classes={"interactive": {"max_concurrency": 4, "slo_p95_ms": 1000}},
                           tenants=[], models={"llama": {"cluster": "pool_a"}}))
    t.policy_reloaded(applied=True)
    core.report(d.ticket.id, Completion(Outcome.UPSTREAM_ERROR, 503, None, 1.0))
    core.finish(d.ticket, Outcome.UPSTREAM_ERROR)
    text = generate_latest(t.registry).decode()
    assert 'pool="pool_b"' not in text
    assert 'extproc_breaker_state{class="interactive",kind="error",pool="pool_a"} 0.0' in text


def test_a_reload_that_turns_a_breaker_off_ends_its_transition_series():
    """The class keeps its pool, so its error breaker's series stay; its latency breaker's transitions (the state
    gauge goes with the breaker) stayed at their last counts for the process's life."""
    t = Telemetry()
    slo = make_policy(classes={"interactive": {"max_concurrency": 4, "slo_p95_ms": 1000}}, tenants=[])
    core = AdmissionController(slo, clock=lambda: 0.0, events=t)
    t.watch(core)
    core.decide(RequestFacts(model="llama"))
    core.apply(make_policy(classes={"interactive": {"max_concurrency": 4}}, tenants=[]))  # no SLO: no latency one
    t.policy_reloaded(applied=True)
    text = generate_latest(t.registry).decode()
    assert 'kind="latency"' not in text
    assert 'extproc_breaker_transitions_total{class="interactive",kind="error",pool="pool_a",to="open"} 0.0' in text


def test_a_reload_ends_the_yield_and_limit_move_series_of_the_pools_it_removed():
    """A pool no model routes to any more, or whose pool-wide limit the policy dropped, kept its
    extproc_pool_yields_total and extproc_pool_limit_moves_total series for the process's life."""
    from tests.unit.test_pool_limit import pool_policy
    t = Telemetry()
    core = AdmissionController(pool_policy(), clock=lambda: 0.0, events=t)
    t.watch(core)
    t.pool_yielded("pool_a", "interactive")
    t.pool_yielded("pool_b", "interactive")
    t.pool_limit_moved("pool_a", "raise", 4.0, 5.0, 4.0, 4.0)
    core.apply(make_policy(models={"llama": {"cluster": "pool_a"}}))  # pool_b gone, pool_a without its limit
    t.policy_reloaded(applied=True)
    text = generate_latest(t.registry).decode()
    assert 'pool="pool_b"' not in text and "extproc_pool_limit_moves_total{" not in text
    assert sample(t, "extproc_pool_yields_total", pool="pool_a", **{"class": "interactive"}) == 1


def test_rate_limit_checks_are_counted_by_tenant_limit_and_result():
    t = Telemetry()
    core = limited_core(t, requests_per_minute=60, burst_s=2)  # a bucket of 2 requests
    kinds = [core.decide(RequestFacts(api_key="k", model="llama")).kind for _ in range(3)]
    assert kinds == [ACCEPT, ACCEPT, REJECT]
    core.decide(RequestFacts(api_key="kf", model="llama"))  # a tenant without limits is not checked
    assert sample(t, "extproc_ratelimit_decisions_total", tenant="acme", kind="all", result="allowed") == 2
    assert sample(t, "extproc_ratelimit_decisions_total", tenant="acme", kind="requests", result="limited") == 1
    assert sample(t, "extproc_ratelimit_decisions_total", tenant="free", kind="all", result="allowed") == 0


def test_a_token_limit_is_counted_under_kind_tokens():
    t = Telemetry()
    core = limited_core(t, tokens_per_minute=100, burst_s=60)
    kinds = [core.decide(RequestFacts(api_key="k", model="llama", max_tokens=500)).kind for _ in range(2)]
    assert kinds == [ACCEPT, REJECT]  # the first empties the bucket
    assert sample(t, "extproc_ratelimit_decisions_total", tenant="acme", kind="tokens", result="limited") == 1


def test_session_refusals_are_counted_by_tenant_and_reason():
    t = Telemetry()
    core = limited_core(t)
    big = RequestFacts(api_key="kf", model="llama", max_tokens=100, session_id="s1",
                       doc={"prompt": "x" * 40000})  # ~10k prompt tokens: most of the session's budget
    decisions = [core.decide(big) for _ in range(3)]
    refused = [d for d in decisions if d.kind == REJECT]
    assert refused and all(d.reason == "session_inflight_budget" for d in refused)
    assert sample(t, "extproc_session_rejections_total", tenant="free",
                  reason="session_inflight_budget") == len(refused)


def test_decisions_and_durations_are_counted_under_the_same_labels_as_before():
    t = Telemetry()
    core = limited_core(t)
    for _ in range(3):
        d = core.decide(RequestFacts(api_key="kf", model="llama"))
        core.finish(d.ticket, Outcome.OK)
        core.report(d.ticket.id, Completion(Outcome.OK, 200, 0.25, 1.0))
    assert sample(t, "extproc_requests_total", **{"class": "batch", "decision": "accept",
                                                  "reason": "slot_free"}) == 3
    assert sample(t, "extproc_request_duration_seconds_count", **{"class": "batch", "outcome": "ok"}) == 3
    assert sample(t, "extproc_time_to_first_byte_seconds_count", **{"class": "batch"}) == 3


def test_completion_reports_count_matched_and_unmatched_from_zero():
    t = Telemetry()
    assert sample(t, "extproc_completion_reports_total", result="matched") == 0.0
    assert t.registry.get_sample_value("extproc_completion_reports_total", {"result": "unmatched"}) == 0.0
    t.completions_reported(matched=3, unmatched=1)
    t.completions_reported(matched=0, unmatched=2)
    assert sample(t, "extproc_completion_reports_total", result="matched") == 3
    assert sample(t, "extproc_completion_reports_total", result="unmatched") == 3


def test_policy_reloads_set_the_result_counter_and_the_last_reload_gauge():
    t = Telemetry()
    t.policy_reloaded(applied=False)
    assert sample(t, "extproc_config_reload_total", result="invalid") == 1
    assert t.registry.get_sample_value("extproc_config_last_reload_successful") == 0
    t.policy_reloaded(applied=True)
    assert sample(t, "extproc_config_reload_total", result="applied") == 1
    assert t.registry.get_sample_value("extproc_config_last_reload_successful") == 1


def test_store_state_shows_every_state_and_counts_switches_and_lost_leases():
    registry = CollectorRegistry()
    s = StoreTelemetry(registry)
    s.store_state(SHARED, switched=False)
    state = {st: registry.get_sample_value("extproc_store_state", {"state": st}) for st in (SHARED, LOCAL, CLOSED)}
    assert state == {SHARED: 1, LOCAL: 0, CLOSED: 0}
    # Not a switch; every `to` is exported at 0 before its first (or increase() would never see that one).
    assert {st: registry.get_sample_value("extproc_store_switches_total", {"to": st})
            for st in (SHARED, LOCAL, CLOSED)} == {SHARED: 0, LOCAL: 0, CLOSED: 0}
    s.store_state(LOCAL, switched=True)
    assert registry.get_sample_value("extproc_store_state", {"state": LOCAL}) == 1
    assert registry.get_sample_value("extproc_store_state", {"state": SHARED}) == 0
    assert registry.get_sample_value("extproc_store_switches_total", {"to": LOCAL}) == 1
    s.store_leases_lost(2)
    assert registry.get_sample_value("extproc_store_leases_lost_total") == 2


class AccessLogStream:
    """The receiving end of Envoy's access log stream: hands out `messages`, then EOF."""

    def __init__(self, *messages):
        self.messages = list(messages)

    async def read(self):
        return self.messages.pop(0) if self.messages else grpc.aio.EOF


def log_entries(*tickets: str | None) -> als_pb2.StreamAccessLogsMessage:
    msg = als_pb2.StreamAccessLogsMessage()
    for ticket in tickets:
        entry = msg.http_logs.log_entry.add()
        entry.response.response_code.value = 200
        if ticket is not None:
            entry.request.request_headers[TICKET_HEADER] = ticket
    return msg


def ended_request(t: Telemetry) -> tuple[AdmissionController, TicketTags, str]:
    """A core, its ticket tags and the ticket header of a request that ended and awaits its completion report."""
    core = limited_core(t)
    d = core.decide(RequestFacts(api_key="kf", model="llama"))
    core.finish(d.ticket, Outcome.ENDED)
    tags = TicketTags(instance="a1")
    return core, tags, tags.value(d.ticket.id)


def test_the_access_log_receiver_reports_matched_and_unmatched_completions():
    t = Telemetry()
    core, tags, ticket = ended_request(t)
    receiver = AccessLogReceiver(core, t, tags)
    stream = AccessLogStream(log_entries(ticket, tags.value(999999), None), log_entries(ticket))
    asyncio.run(receiver.StreamAccessLogs(None, stream))
    assert sample(t, "extproc_completion_reports_total", result="matched") == 1
    assert sample(t, "extproc_completion_reports_total", result="unmatched") == 2  # once reported, a ticket is gone
    # No ticket at all: a request Envoy let through unadmitted (envoy.yaml's second logger sends only those).
    assert sample(t, "extproc_unadmitted_requests_total") == 1
    assert sample(t, "extproc_request_duration_seconds_count", **{"class": "batch", "outcome": "ok"}) == 1


def test_the_sampled_answers_log_feeds_the_answer_histogram_and_is_no_completion_report():
    t = Telemetry()
    core, tags, ticket = ended_request(t)
    first, second = log_entries(ticket, None), log_entries(None)
    first.identifier.log_name = ANSWERS_LOG  # only a stream's first message names its log
    for entry, us in zip([*first.http_logs.log_entry, *second.http_logs.log_entry], (700, 350_000, 500_000)):
        state = struct_pb2.Struct()
        state.fields["request_header_latency_us"].number_value = us
        entry.common_properties.filter_state_objects[EXT_PROC_STATE].Pack(state)
    asyncio.run(AccessLogReceiver(core, t, tags).StreamAccessLogs(None, AccessLogStream(first, second)))
    assert sample(t, "extproc_header_answer_seconds_count") == 3
    assert sample(t, "extproc_header_answer_seconds_bucket", le="0.001") == 1
    # Nothing counted as a completion, unmatched or unadmitted: the ticket still gets its own report.
    assert not sample(t, "extproc_completion_reports_total", result="matched")
    assert not sample(t, "extproc_completion_reports_total", result="unmatched")
    assert not sample(t, "extproc_unadmitted_requests_total")


def test_an_unticketed_request_to_a_cluster_no_model_names_is_not_counted_unadmitted():
    # Found through Envoy: three GETs to a docs service a team routed beside the API (ext_proc off) raised
    # extproc_unadmitted_requests_total to 3 and the alert with it.
    t = Telemetry()
    receiver = AccessLogReceiver(limited_core(t), t, TicketTags(instance="a1"))
    msg = log_entries(None, None, None, None, None)
    for entry, cluster, path in zip(msg.http_logs.log_entry, ("docs", "pool_a", "", "auth", "other_vllm"),
                                    ("/docs", "/v1/chat/completions", "/x", "/login?next=/", "/v1/completions?a")):
        entry.common_properties.upstream_cluster = cluster
        entry.request.path = path
    asyncio.run(receiver.StreamAccessLogs(None, AccessLogStream(msg)))
    # the pool's, one whose cluster is unknown, and a compute path on a cluster the policy does not name
    assert sample(t, "extproc_unadmitted_requests_total") == 3
    assert sample(t, "extproc_completion_reports_total", result="unmatched") == 0


def test_a_worker_reports_only_the_tickets_it_issued():
    t = Telemetry()
    core = limited_core(t)
    d = core.decide(RequestFacts(api_key="kf", model="llama"))
    core.finish(d.ticket, Outcome.ENDED)
    receiver = AccessLogReceiver(core, t, TicketTags(1, instance="a1"))
    stream = AccessLogStream(log_entries(f"0-{d.ticket.id}.a1", f"{d.ticket.id}.a1", f"1-{d.ticket.id}.a1"))
    asyncio.run(receiver.StreamAccessLogs(None, stream))
    assert sample(t, "extproc_completion_reports_total", result="matched") == 1
    assert sample(t, "extproc_completion_reports_total", result="unmatched") == 2


class RecordingRelay:
    def __init__(self):
        self.sent: list[tuple[str, list[list]]] = []
        self.handlers = {}

    def relay(self, instance, reports, heard):
        self.sent.append((instance, reports))
        heard(instance in self.handlers)  # as PUBLISH answers: heard only where an instance subscribes

    def on_reports(self, instance, callback):
        self.handlers[instance] = callback


def two_instances(relay=None):
    """Two instances' cores whose tickets carry the same ids, as two ext_procs' counters run nearly in step."""
    out = []
    for name in ("a1", "b2"):
        t = Telemetry()
        core = limited_core(t)
        ticket = core.decide(RequestFacts(api_key="kf", model="llama")).ticket
        if out:
            ticket.id = out[0][2].id
        core.finish(ticket, Outcome.ENDED)
        out.append((t, core, ticket, AccessLogReceiver(core, t, TicketTags(instance=name), relay=relay)))
    return out


def test_another_instances_report_never_lands_on_a_ticket_with_the_same_id():
    (ta, _, ticket_a, receiver_a), (_, _, ticket_b, receiver_b) = two_instances()
    assert ticket_b.id == ticket_a.id  # the counters collide
    # Envoy's access log reaches instance a only; the entry is b's request (an upstream error).
    msg = log_entries(receiver_b.tags.value(ticket_b.id))
    msg.http_logs.log_entry[0].response.response_code.value = 503
    asyncio.run(receiver_a.StreamAccessLogs(None, AccessLogStream(msg)))
    assert sample(ta, "extproc_completion_reports_total", result="matched") == 0
    assert sample(ta, "extproc_completion_reports_total", result="unmatched") == 1
    assert ticket_a.completion is None  # before: a's request took b's 503


def test_reports_for_another_instance_are_relayed_to_it_and_matched_there():
    relay = RecordingRelay()
    (ta, _, ticket_a, receiver_a), (tb, _, ticket_b, _) = two_instances(relay)
    msg = log_entries(TicketTags(instance="b2").value(ticket_b.id), TicketTags(instance="a1").value(ticket_a.id))
    msg.http_logs.log_entry[0].common_properties.time_to_last_downstream_tx_byte.FromMilliseconds(1250)
    asyncio.run(receiver_a.StreamAccessLogs(None, AccessLogStream(msg)))
    assert sample(ta, "extproc_completion_reports_total", result="matched") == 1
    assert sample(ta, "extproc_completion_reports_total", result="relayed") == 1
    assert sample(ta, "extproc_completion_reports_total", result="unmatched") == 0
    [(instance, reports)] = relay.sent
    assert instance == "b2"
    relay.handlers["b2"](reports + [["junk"], [1, "no such outcome", 200, None, None], [2, "ok", 200, "x", None]])
    assert sample(tb, "extproc_completion_reports_total", result="matched") == 1
    assert sample(tb, "extproc_completion_reports_total", result="unmatched") == 3
    assert ticket_b.completion.outcome is Outcome.OK and ticket_b.completion.total_s == 1.25
    assert sample(tb, "extproc_request_duration_seconds_sum", **{"class": "batch", "outcome": "ok"}) == 1.25


def test_reports_relayed_to_an_instance_nobody_hears_count_as_unmatched():
    """An instance restarted (a new id) or stopped while its requests ran: their reports go to a channel nobody
    listens on. They counted as `relayed` before, so the unmatched panel missed every report that ended nowhere."""
    relay = RecordingRelay()
    (ta, _, ticket_a, receiver_a), _ = two_instances(relay)
    msg = log_entries(TicketTags(instance="gone").value(7), TicketTags(instance="b2").value(7),
                      TicketTags(instance="a1").value(ticket_a.id))
    asyncio.run(receiver_a.StreamAccessLogs(None, AccessLogStream(msg)))
    assert [instance for instance, _ in relay.sent] == ["gone", "b2"]
    assert sample(ta, "extproc_completion_reports_total", result="matched") == 1
    assert sample(ta, "extproc_completion_reports_total", result="relayed") == 1
    assert sample(ta, "extproc_completion_reports_total", result="unmatched") == 1


def test_an_instance_steering_its_pool_learns_its_replicas_failures_from_relayed_reports():
    """While a pool is steered, each instance leaves out a replica whose last answers failed (Envoy takes a named
    host even when its outlier detection ejected it). The instance Envoy's access log does not reach learned none
    of them: it went on naming the failing replica for every one of its requests."""
    from extproc.policy.steering import FAILURES
    relay = RecordingRelay()
    (_, _, _, receiver_a), (_, core_b, ticket_b, _) = two_instances(relay)
    core_b.steering.update("pool", (("10.0.0.1:8000", 0.0, 1.0), ("10.0.0.2:8000", 5.0, 1.0)))
    assert core_b.steering.pick("pool", 1000.0).startswith("10.0.0.1:8000")
    msg = log_entries(*[TicketTags(instance="b2").value(ticket_b.id + i) for i in range(FAILURES)])
    for entry in msg.http_logs.log_entry:
        entry.response.response_code.value = 503
        entry.common_properties.upstream_remote_address.socket_address.address = "10.0.0.1"
        entry.common_properties.upstream_remote_address.socket_address.port_value = 8000
    asyncio.run(receiver_a.StreamAccessLogs(None, AccessLogStream(msg)))
    [(instance, reports)] = relay.sent
    relay.handlers[instance](reports)
    assert core_b.steering.pick("pool", 1001.0) == "10.0.0.2:8000"
    relay.handlers[instance]([[1, "ok", 200, None, None]])  # an older instance's report, without the replica


def test_ticket_tags_parse_any_workers_values_and_name_the_process():
    tags = TicketTags(3, instance="ab12")
    assert tags.value(17) == "3-17.ab12" and tags.process == "3-ab12"
    assert tags.parse("3-17.ab12") == (17, "3-ab12")
    assert tags.parse("3-17.other") == (17, "3-other")
    assert tags.parse("13-17.ab12") == (17, "13-ab12")  # another worker's: relayed to it
    assert tags.parse("17.ab12") == (17, "ab12") and TicketTags(instance="ab12").process == "ab12"
    for value in ("3-17", "3-17.", "3-x.ab12", "3--1.ab12", "3-.ab12", "-17.ab12", "x-17.ab12", ".ab12"):
        assert tags.parse(value) is None, value
    # Digits str.isdigit() takes and int() does not (a superscript, past int()'s 4,300 digits) raised ValueError
    # out of the access log handler: every report of the batch after it was lost and the stream failed.
    for value in ("\u00b2.ab12", "3-\u00b9.ab12", "1" * 5000 + ".ab12"):
        assert tags.parse(value) is None, value[:20]


def test_a_worker_relays_another_workers_reports_to_it():
    """`extproc serve --workers N` whose N ports Envoy's `extproc` cluster lists under one access log
    (docs/kubernetes.md): a worker gets the other workers' reports, and dropped them as not its own."""
    relay = RecordingRelay()
    cores = []
    for worker in (0, 1):
        t = Telemetry()
        core = limited_core(t)
        ticket = core.decide(RequestFacts(api_key="kf", model="llama")).ticket
        core.finish(ticket, Outcome.ENDED)
        cores.append((t, ticket, AccessLogReceiver(core, t, TicketTags(worker, instance=f"w{worker}"), relay)))
    (t0, _, receiver0), (t1, ticket1, receiver1) = cores
    asyncio.run(receiver0.StreamAccessLogs(None, AccessLogStream(log_entries(receiver1.tags.value(ticket1.id)))))
    [(process, reports)] = relay.sent
    assert process == "1-w1" and sample(t0, "extproc_completion_reports_total", result="relayed") == 1
    relay.handlers[process](reports)
    assert ticket1.completion is not None and ticket1.completion.outcome is Outcome.OK
    assert sample(t1, "extproc_completion_reports_total", result="matched") == 1


def test_envoy_config_for_workers_gives_each_its_own_access_log():
    from extproc.tools import envoyconf
    cfg = envoyconf.render(envoyconf.load_source(), listen_port=1, admin_port=2, extproc=[("h", 5), ("h", 6)],
                           pools={"vllm_llama70b": [("u", 7)]}, workers=True)
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    logs = [(log["filter"].get("header_filter", {}).get("header", {}).get("string_match", {}).get("prefix"),
             log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"])
            for log in hcm["access_log"]]
    # The unadmitted requests' log (no ticket) and the sampled answers' go to any worker: each counts what it
    # gets, Prometheus sums them.
    assert logs == [(None, "extproc"), (None, "extproc"), ("0-", "extproc_worker_0"), ("1-", "extproc_worker_1")]
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    port = clusters["extproc_worker_1"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert port["address"]["socket_address"]["port_value"] == 6
    assert len(clusters["extproc"]["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2


def serve(tmp_path, policy: str) -> Server:
    path = tmp_path / "policy.yaml"
    path.write_text(policy)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return Server(str(path), load_policy_file(str(path)), parser.parse_args(["--policy", str(path)]))


def test_serve_exports_the_store_metrics_with_a_shared_store_only(tmp_path):
    policy = "classes: {interactive: {max_concurrency: 1}}\nmodels: {llama: {cluster: pool_a}}\n"
    local = generate_latest(serve(tmp_path, policy).telemetry.registry).decode()
    assert "# TYPE extproc_store_" not in local
    assert 'extproc_completion_reports_total{result="unmatched"} 0.0' in local
    shared = serve(tmp_path, policy + "store: {kind: redis, url: 'redis://127.0.0.1:1'}\n")  # not started here
    exposed = generate_latest(shared.telemetry.registry).decode()
    assert 'extproc_store_state{state="shared"} 1.0' in exposed
    assert 'extproc_store_state{state="local"} 0.0' in exposed
    assert "extproc_store_leases_lost_total 0.0" in exposed


def test_flows_are_exported_per_tenant_with_keys_from_a_header_folded_into_other():
    t = Telemetry()
    policy = make_policy(tenants=[{"name": "acme", "api_keys": ["k"]}],
                         classify={"fairness_header": "x-gateway-inference-fairness-id"},
                         classes={"batch": {"max_concurrency": 1, "max_queue": 5, "max_wait_ms": 1000,
                                            "fairness": {"mode": "fair", "key": "header"}}}, default_class="batch")
    now = [1000.0]
    core = AdmissionController(policy, clock=lambda: now[0], events=t)
    t.watch(core)
    first = core.decide(RequestFacts(api_key="k", model="llama", fairness_id="acme"))
    core.decide(RequestFacts(model="llama", fairness_id="team-7"))  # no API key: the header names the flow
    assert sample(t, "extproc_tenant_inflight", **{"class": "batch", "tenant": "acme"}) == 1
    assert sample(t, "extproc_tenant_waiting", **{"class": "batch", "tenant": "other"}) == 1
    served = sample(t, "extproc_tenant_served_gpu_seconds", **{"class": "batch", "tenant": "acme"})
    assert served > 0
    assert sample(t, "extproc_tenant_charged_gpu_seconds_total", **{"class": "batch", "tenant": "acme"}) == served
    assert sample(t, "extproc_tenant_refunded_gpu_seconds_total", **{"class": "batch", "tenant": "acme"}) == 0
    # acme holds the one slot and the other flow's request waits for it: one has all so far
    assert sample(t, "extproc_class_fairness_index", **{"class": "batch"}) == 0.5
    now[0] += 0.5
    core.finish(first.ticket, Outcome.OK)
    assert sample(t, "extproc_tenant_queue_waited_seconds_total", **{"class": "batch", "tenant": "other"}) == 0.5
    assert sample(t, "extproc_tenant_queue_wait_seconds_count", **{"class": "batch", "tenant": "anonymous"}) == 1


def test_refusals_past_the_log_budget_are_summed_up_in_one_line_not_written_each(caplog):
    """A spike refuses thousands of requests a second: at most `log_per_s` lines a second per (class, decision,
    reason), then one `decisions_suppressed` line with the count; the metric still counts every refusal."""
    now = [0.0]
    t = Telemetry(log_per_s=3, clock=lambda: now[0])
    core = limited_core(t)
    facts = RequestFacts(api_key="kf", model="nope")  # 404 unknown_model, a refusal each
    caplog.set_level("INFO", logger="extproc.decisions")
    for _ in range(10):
        core.decide(facts)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "extproc.decisions"]
    assert [line["event"] for line in lines] == ["decision"] * 3
    now[0] = 1.5
    core.decide(facts)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "extproc.decisions"]
    summary = lines[3]
    assert (summary["event"], summary["count"]) == ("decisions_suppressed", 7)
    assert [line["event"] for line in lines[4:]] == ["decision"]
    assert sample(t, "extproc_requests_total", **{"class": summary["class"] or "unclassified",
                                                  "decision": summary["decision"], "reason": summary["reason"]}) == 11


def test_a_burst_that_stops_is_still_summed_up_by_the_flush(caplog):
    """The key never recurs after its burst: the once-a-second flush writes its summary instead."""
    now = [0.0]
    t = Telemetry(log_per_s=2, clock=lambda: now[0])
    core = limited_core(t)
    caplog.set_level("INFO", logger="extproc.decisions")
    for _ in range(5):
        core.decide(RequestFacts(api_key="kf", model="nope"))
    now[0] = 0.5
    t.log_budget.flush()  # its second has not ended: nothing yet
    assert [json.loads(r.getMessage())["event"] for r in caplog.records] == ["decision"] * 2
    now[0] = 1.2
    t.log_budget.flush()
    t.log_budget.flush()  # once only
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "extproc.decisions"]
    assert [(x["event"], x.get("count")) for x in lines[2:]] == [("decisions_suppressed", 3)]


def test_a_log_budget_of_zero_logs_every_refusal(caplog):
    t = Telemetry(log_per_s=0)
    core = limited_core(t)
    caplog.set_level("INFO", logger="extproc.decisions")
    for _ in range(30):
        core.decide(RequestFacts(api_key="kf", model="nope"))
    assert sum(1 for r in caplog.records if r.name == "extproc.decisions") == 30


def class_limits(t: Telemetry) -> dict[tuple[str, str], float]:
    """(class, scope) -> extproc_class_limit."""
    return {(s.labels["class"], s.labels["scope"]): s.value for fam in t.registry.collect()
            if fam.name == "extproc_class_limit" for s in fam.samples}


def test_a_cap_of_its_own_is_exported_with_scope_instance():
    t = Telemetry()
    t.watch(limited_core(t))
    assert class_limits(t) == {("batch", "instance"): 100}


def test_a_cap_shared_through_redis_is_exported_with_scope_fleet(tmp_path):
    policy = "classes: {interactive: {max_concurrency: 24}}\nmodels: {llama: {cluster: pool_a}}\n"
    server = serve(tmp_path, policy + "store: {kind: redis, url: 'redis://127.0.0.1:1', instances: 2}\n")
    assert class_limits(server.telemetry) == {("interactive", "fleet"): 24}


def test_a_cap_the_workers_of_one_host_share_is_exported_with_scope_host():
    t = Telemetry()
    core = limited_core(t)
    core.gate_on_store(True)  # what SharedSlots does with the workers' host store (store kind memory)
    t.watch(core)
    assert class_limits(t) == {("batch", "host"): 100}


def duration_sum(t: Telemetry, cls: str = "interactive") -> float:
    return sample(t, "extproc_request_duration_seconds_sum", **{"class": cls, "outcome": "ok"})


def queued_core(t: Telemetry, clock) -> AdmissionController:
    policy = make_policy(classes={"interactive": {"max_concurrency": 1, "max_queue": 5, "max_wait_ms": 5000}},
                         tenants=[])
    return AdmissionController(policy, clock=clock, events=t)


def test_the_request_duration_includes_the_time_queued_before_admission():
    """A request that waited 1.2 s for a slot and then ran 1.1 s: the client waited 2.3 s."""
    now = [1000.0]
    t = Telemetry()
    core = queued_core(t, lambda: now[0])
    first = core.decide(RequestFacts(model="llama"))
    second = core.decide(RequestFacts(model="llama"))
    now[0] += 1.2
    core.finish(first.ticket, Outcome.OK)
    assert second.waiter.result.ticket.waited_s == pytest.approx(1.2)
    now[0] += 1.1
    core.finish(second.waiter.result.ticket, Outcome.OK)
    now[0] += 60.0  # past the wait for a completion report: accounted from the ticket's own times
    core.reap()
    assert duration_sum(t) == pytest.approx(1.2 + 2.3)


def test_the_request_duration_is_envoys_total_time_when_the_report_has_it():
    now = [1000.0]
    t = Telemetry()
    core = queued_core(t, lambda: now[0])
    d = core.decide(RequestFacts(model="llama"))
    now[0] += 1.0
    core.finish(d.ticket, Outcome.OK)
    core.report(d.ticket.id, Completion(Outcome.OK, 200, 0.2, 1.05))
    assert duration_sum(t) == pytest.approx(1.05)


def test_canned_answers_are_counted_by_the_status_sent():
    t = Telemetry()
    policy = make_policy(classes={"interactive": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0,
                                                  "on_overflow": "fallback",
                                                  "fallback": {"action": "canned", "status": 503}}},
                         tenants=[])
    core = AdmissionController(policy, clock=lambda: 1000.0, events=t)
    core.decide(RequestFacts(model="llama"))
    assert core.decide(RequestFacts(model="llama")).kind == DEGRADE
    labels = {"class": "interactive", "reason": "queue_full"}
    assert sample(t, "extproc_canned_responses_total", **labels, status="503") == 1
    assert sample(t, "extproc_requests_total", **labels, decision="degrade") == 1


def test_a_refusal_before_any_charge_logs_the_clients_request_id(caplog):
    """Invalid requests (an unknown model, a bad body) are refused before the request is charged: their log line
    must still carry the x-request-id an operator greps for."""
    t = Telemetry()
    core = limited_core(t)
    caplog.set_level("INFO", logger="extproc.decisions")
    core.decide(RequestFacts(api_key="kf", model="nope", request_id="req-123"))
    core.invalid(400, "invalid_body", "bad", RequestFacts(api_key="kf", request_id="req-456"))
    ids = [json.loads(r.getMessage())["request_id"] for r in caplog.records if r.name == "extproc.decisions"]
    assert ids == ["req-123", "req-456"]


def test_the_decision_log_names_the_adapter_a_request_asked_for_and_no_metric_does(caplog):
    """Aliases and LoRA adapters are admitted and counted as their model; the log line keeps the name sent."""
    t = Telemetry(log_per_s=0, log_accept_sample=1.0)
    policy = make_policy(models={"llama": {"cluster": "pool_a", "aliases": ["sql-lora"]}}, tenants=[])
    core = AdmissionController(policy, clock=lambda: 1000.0, events=t)
    caplog.set_level("INFO", logger="extproc.decisions")
    core.decide(RequestFacts(header_class="batch", model="sql-lora"))
    core.decide(RequestFacts(header_class="batch", model="llama"))
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "extproc.decisions"]
    assert [(x["model"], x.get("model_alias")) for x in lines] == [("llama", "sql-lora"), ("llama", None)]
    assert b"sql-lora" not in generate_latest(t.registry)


def test_a_reload_that_removes_tenants_ends_their_series():
    # Tenants come and go by reloads: every tenant ever configured kept its series (rate-limit checks, demotions,
    # unknown-class claims, queue waits, its flows' counters and gauges) for the life of the process. A churn soak through Envoy
    # (20 new tenants every 8 s, 150 s) grew /metrics from 125 to 1343 series, 381 tenant label values.
    t = Telemetry()
    def policy(name):
        return make_policy(tenants=[{"name": name, "api_keys": [f"key-{name}"], "requests_per_minute": 600,
                                     "max_class": "batch"}], shed={},
                           classes={"interactive": {"max_concurrency": 10},
                                    "batch": {"max_concurrency": 2}},
                           default_class="batch")
    now = [1000.0]
    core = AdmissionController(policy("gen-0"), clock=lambda: now[0], events=t)
    t.watch(core)
    for gen in range(1, 4):
        key = f"key-gen-{gen - 1}"
        first = core.decide(RequestFacts(api_key=key, model="llama", header_class="interactive"))  # demoted
        second = core.decide(RequestFacts(api_key=key, model="llama", header_class="nope"))      # unknown class
        core.finish(first.ticket, Outcome.OK)
        core.finish(second.ticket, Outcome.OK)
        core.apply(policy(f"gen-{gen}"))
        t.policy_reloaded(applied=True)
        assert sample(t, "extproc_tenant_inflight", **{"class": "batch", "tenant": f"gen-{gen}"}) == 0  # no flow yet
    text = generate_latest(t.registry).decode()
    assert not [line for line in text.splitlines() if 'tenant="gen-' in line]
    core.decide(RequestFacts(api_key="key-gen-3", model="llama", header_class="interactive"))
    assert sample(t, "extproc_class_demotions_total", tenant="gen-3") == 1
    assert sample(t, "extproc_tenant_inflight", **{"class": "batch", "tenant": "gen-3"}) == 1


def test_the_tenants_of_a_removed_class_stay_exported_while_its_requests_run():
    """A reload that removed a class left its running requests in extproc_inflight{class} but dropped them from
    extproc_tenant_inflight{class, tenant} at once: the dashboard's per-tenant in-flight no longer added up to the
    class's until they ended (found by tests/unit/test_telemetry_model.py)."""
    t = Telemetry()
    both = {"interactive": {"max_concurrency": 2}, "batch": {"max_concurrency": 2}}
    core = AdmissionController(make_policy(classes=both, shed={}), clock=lambda: 1000.0, events=t)
    t.watch(core)
    d = core.decide(RequestFacts(api_key="sk-acme", model="llama", header_class="batch"))
    core.apply(make_policy(classes={"interactive": both["interactive"]}, shed={},
                           tenants=[{"name": "acme", "api_keys": ["sk-acme"]}]))
    t.policy_reloaded(applied=True)
    assert sample(t, "extproc_inflight", **{"class": "batch"}) == 1
    assert sample(t, "extproc_tenant_inflight", **{"class": "batch", "tenant": "acme"}) == 1
    core.apply(make_policy(classes={"interactive": both["interactive"]}, shed={}, tenants=[]))  # acme removed too
    t.policy_reloaded(applied=True)
    assert 'tenant="acme"' not in generate_latest(t.registry).decode()  # its request runs on, under "other"
    assert sample(t, "extproc_tenant_inflight", **{"class": "batch", "tenant": "other"}) == 1
    core.finish(d.ticket, Outcome.OK)
    text = generate_latest(t.registry).decode()
    assert 'class="batch"' not in text.split("extproc_tenant_inflight", 1)[1].split("# HELP", 1)[0]


def test_an_admission_waiting_for_the_shared_stores_slot_is_its_tenants_waiting_not_in_flight():
    """With a shared store, an admission waiting for a global slot counts as queued (extproc_queue_depth), not in
    flight; the tenant gauges counted it in flight: in a class held by its fleet cap, extproc_tenant_inflight
    summed over tenants read more than extproc_inflight, and extproc_tenant_waiting less than the queue (found by
    tests/unit/test_telemetry_model.py)."""
    t = Telemetry()
    core = AdmissionController(make_policy(), clock=lambda: 1000.0, events=t)
    t.watch(core)
    core.gate_on_store(True)
    d = core.decide(RequestFacts(api_key="sk-acme", model="llama"))
    core.await_store(d)
    batch, acme = {"class": "batch"}, {"class": "batch", "tenant": "acme"}
    assert (sample(t, "extproc_inflight", **batch), sample(t, "extproc_queue_depth", **batch)) == (0, 1)
    assert (sample(t, "extproc_tenant_inflight", **acme), sample(t, "extproc_tenant_waiting", **acme)) == (0, 1)
    core.confirm(d, 0.05)
    assert (sample(t, "extproc_tenant_inflight", **acme), sample(t, "extproc_tenant_waiting", **acme)) == (1, 0)


async def test_a_small_scrape_is_written_on_the_loop_so_its_counters_and_gauges_are_one_moment(tmp_path, monkeypatch):
    # Written in a thread, a scrape's counters ran on past the core's gauges read before it: an integration test
    # read a request counted as dequeued beside the pool gauges of before its dequeue. A scrape known to be quick
    # is written on the loop; only the first (size unknown) and big ones go to a thread.
    server = serve(tmp_path, "classes: {interactive: {max_concurrency: 1}}\nmodels: {llama: {cluster: pool_a}}\n")
    threaded = []
    real = asyncio.to_thread

    async def to_thread(fn, *args):
        threaded.append(fn)
        return await real(fn, *args)

    monkeypatch.setattr(asyncio, "to_thread", to_thread)
    # Any first scrape counts as quick: on a busy machine the threaded one took over SCRAPE_ON_LOOP_S of wall time
    # (CI beside other work), and the test then failed on timing, not on what it checks.
    monkeypatch.setattr(server_main, "SCRAPE_ON_LOOP_S", 1e9)
    first = (await server._metrics(None)).body
    second = (await server._metrics(None)).body
    assert len(threaded) == 1 and b"extproc_class_limit" in first and b"extproc_class_limit" in second


async def test_a_big_scrape_does_not_hold_the_event_loop(tmp_path):
    # /metrics was written on the event loop: with 2,000 tenants in two classes (4.3 MB, ~50,000 series) a scrape
    # took 0.6-1.1 s, and through Envoy the requests of those moments waited past message_timeout (0.5 s; p99
    # 12 ms -> 518 ms), where failure_mode_allow sends them on unadmitted. The core is read on the loop (~40 ms);
    # the text is written in a thread.
    tenants = "".join(f"  - {{name: t{i}, api_keys: [k{i}]}}\n" for i in range(1500))
    server = serve(tmp_path, "classes: {interactive: {max_concurrency: 1}, batch: {max_concurrency: 1}}\n"
                             "models: {llama: {cluster: pool_a}}\ntenants:\n" + tenants)
    t = server.telemetry
    for i in range(1500):
        for cls in ("interactive", "batch"):
            t.tenant_wait[cls, f"t{i}"].observe(0.01)
    gaps, done = [], asyncio.Event()

    async def ticker():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    response = await server._metrics(None)
    took = time.perf_counter() - started
    done.set()
    await tick
    text = response.body.decode()
    assert 'extproc_tenant_queue_wait_seconds_count{class="batch",tenant="t1499"} 1.0' in text
    assert 'extproc_class_limit{class="batch",scope="instance"} 1.0' in text  # the core's gauges, read on the loop
    assert max(gaps) < took / 2, (max(gaps), took)


def test_the_decision_log_says_which_pool_and_why_a_queued_request_was_refused(caplog):
    """An on-call reads the log for why a request was refused: "queue_timeout" alone sent them to the class's cap,
    when the pool-wide limit held it. The line carries the pool and the refusal's message (which names it)."""
    from tests.unit.test_pool_limit import pool_policy, req
    now = [0.0]
    t = Telemetry(clock=lambda: now[0])
    core = AdmissionController(pool_policy(), clock=lambda: now[0], events=t)
    for _ in range(4):
        core.decide(req("interactive"))
    waiting = core.decide(req("interactive"))
    caplog.set_level("INFO", logger="extproc.decisions")
    now[0] = 0.3
    core.abandon(waiting.waiter, timed_out=True)
    line = json.loads(caplog.records[-1].getMessage())
    assert (line["decision"], line["reason"], line["pool"]) == ("degrade", "queue_timeout", "pool_b")  # where it went
    assert "on pool 'pool_a' (the limit is full: 4.0 of 4.0 requests held)" in line["message"], line


def test_the_pool_limit_s_moves_are_counted_by_why_and_its_cuts_logged(caplog):
    """An on-call seeing extproc_pool_limit fall could not tell a saturation cut (the replicas' word) from a latency
    cut (the SLO classes' service time) or a settle (no load): nothing exported why the limit moved."""
    from extproc.policy.adaptive import PoolSaturation
    from tests.unit.test_pool_limit import pool_policy, req
    now = [0.0]
    t = Telemetry(clock=lambda: now[0])
    core = AdmissionController(pool_policy(limit=8), clock=lambda: now[0], events=t)
    for _ in range(6):
        core.decide(req("interactive"))
    full = PoolSaturation()
    full.saturated, full.updated_at = True, 0.0
    core.set_saturation("pool_a", full)
    caplog.set_level("INFO", logger="extproc.pool")
    for step in range(3):
        now[0] = step * 0.6
        full.updated_at = now[0]
        core.tick()
    assert sample(t, "extproc_pool_limit_moves_total", pool="pool_a", action="cut_saturated") == 1
    line = json.loads(caplog.records[-1].getMessage())
    assert line == {"event": "pool_limit", "pool": "pool_a", "action": "cut_saturated", "from": 8.0,
                    "to": round(core.gates["pool_a"].limit, 1), "inflight": 6.0, "inflight_now": 6.0}
    assert core.gates["pool_a"].limit < 8


def test_a_class_held_to_its_min_share_shows_for_how_long_and_why():
    """The rest after a request over the share and the squeeze while a higher class's latency breaker is open keep
    a class to its guarantee, the squeeze even with room on the pool: the on-call asking why batch waits at light
    load saw neither (only the squeeze's yields counter, once per opening)."""
    from tests.unit.test_pool_limit import over_share, pool_policy
    now = [0.0]
    t = Telemetry(clock=lambda: now[0])
    core = AdmissionController(pool_policy(batch={"min_share": 0.1}), clock=lambda: now[0], events=t)
    t.watch(core)
    first = over_share(core)
    now[0] = 10.0
    core.finish(first.ticket, Outcome.OK)  # 2.5x the share for 10 s: the class rests 15 s
    gate = core.gates["pool_a"]
    gate.squeeze(0, 9.0, 14.0)  # interactive's latency breaker, opened at 9 s, cools down at 14 s

    def shown(cls, why):
        return t.registry.get_sample_value("extproc_pool_held_to_share_seconds",
                                           {"pool": "pool_a", "class": cls, "why": why})
    assert shown("batch", "rest") == pytest.approx(15.0)
    assert shown("batch", "squeeze") == pytest.approx(4.0)
    assert shown("internal", "squeeze") == pytest.approx(4.0) and shown("internal", "rest") == 0
    assert shown("interactive", "squeeze") == 0
    now[0] = 26.0
    assert shown("batch", "rest") == 0 and shown("batch", "squeeze") == 0


def test_healthz_shows_each_pool_limit_and_what_holds_it(tmp_path):
    """/healthz showed the classes' caps only: an on-call without Prometheus could not see a pool-wide limit, who
    held it, who waited for it or which class was held to its min_share."""
    import yaml

    from tests.conftest import CORE, policy_doc
    from tests.unit.test_pool_limit import req
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy_doc(CORE, classes={
        "interactive": {"max_concurrency": 10, "max_wait_ms": 200},
        "batch": {"max_concurrency": 10, "max_wait_ms": 5000}}, shed={},
        pools={"pool_a": {"limit": {"enabled": True, "unit": "requests", "initial": 4, "max": 4}}}), sort_keys=False))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    server = Server(str(path), load_policy_file(str(path)), parser.parse_args(["--policy", str(path)]))
    for _ in range(5):
        server.core.decide(req("interactive"))
    pools = json.loads(asyncio.run(server._healthz(None)).body)["pools"]
    assert pools["pool_a"]["limit"] == 4 and pools["pool_a"]["unit"] == "requests"
    assert pools["pool_a"]["classes"]["interactive"] == {"held": 4, "requests": 4, "waiting": 1, "rest_s": 0,
                                                         "squeeze_s": 0}


def test_requests_waiting_for_their_class_cap_are_not_shown_waiting_for_the_pool():
    """extproc_pool_waiting_requests counted every queued request with a pool limit, also those its class's own cap
    held: the dashboard then showed interactive "waiting for the pool" with the pool half empty, which its panel
    calls a priority inversion. Admission itself counts a waiter as waiting for the pool only while its class has
    room (_higher_waits); the gauge (and /healthz) now say the same."""
    from tests.unit.test_pool_limit import pool_policy, req
    t = Telemetry()
    core = AdmissionController(pool_policy(limit=10, interactive={"max_concurrency": 2}), clock=lambda: 0.0,
                               events=t)
    t.watch(core)
    assert [core.decide(req("interactive")).kind for _ in range(3)] == [ACCEPT, ACCEPT, "queue"]
    assert sample(t, "extproc_pool_waiting_requests", pool="pool_a", **{"class": "interactive"}) == 0
    assert core.pools_snapshot()["pool_a"]["classes"]["interactive"]["waiting"] == 0
    for _ in range(8):
        core.decide(req("batch"))  # batch fills its 85% of the pool, then waits for the pool with room in its cap
    assert sample(t, "extproc_pool_waiting_requests", pool="pool_a", **{"class": "batch"}) == 2


def test_the_latency_the_pool_limit_acts_on_is_exported_with_its_calm_baseline_and_target():
    """The limit cuts on a quantile of each SLO class's service time, and only when it is over target x SLO *and*
    LOAD_TOLERANCE over the class's calm baseline: an on-call seeing the p95 over the SLO and the limit not cutting
    (or cutting with the breaker's p95 under the SLO: that one includes queue waits) could see neither number."""
    from tests.unit.test_pool_limit import pool_policy
    now = [0.0]
    t = Telemetry(clock=lambda: now[0])
    core = AdmissionController(pool_policy(limit=8), clock=lambda: now[0], events=t)
    t.watch(core)
    controller = core.gates["pool_a"].controller
    for _ in range(10):
        controller.observe(0, 0.0, 0.0, 1.9)  # slow at any load: 1.9 s, over the 1.7 s target
    core.tick()

    def shown(what):
        return t.registry.get_sample_value("extproc_pool_service_seconds",
                                           {"pool": "pool_a", "class": "interactive", "what": what})
    assert (shown("served"), shown("baseline"), shown("target")) == (1.9, 1.9, pytest.approx(1.7))
    assert t.registry.get_sample_value("extproc_pool_service_seconds",
                                       {"pool": "pool_a", "class": "batch", "what": "target"}) is None  # no SLO


def test_a_latency_cut_s_log_line_shows_the_in_flight_it_was_sized_on(caplog):
    """A latency cut is sized on the in-flight averaged over the latency window (the load its latencies were
    served at), not on what is held at the instant of the cut. The log line printed the instant's: an on-call saw
    'cut_latency 478 -> 96.2, inflight 0.0' and could not tell what the cut measured."""
    from tests.unit.test_pool_limit import pool_policy, req
    now = [0.0]
    t = Telemetry(clock=lambda: now[0])
    core = AdmissionController(pool_policy(limit=20), clock=lambda: now[0], events=t)
    # Ten batch requests hold the pool for 3 s (the load); interactive's latency is what the limit reads. (Held
    # interactive requests would be read as running past the target, and cut for, before they end.)
    tickets = [core.decide(req("batch")).ticket for _ in range(10)]
    controller = core.gates["pool_a"].controller
    for _ in range(10):                         # calm: 1 s each, under the 1.7 s target
        controller.observe(0, 0.0, 0.0, 1.0)
    for step in range(6):
        now[0] = step * 0.5
        core.tick()
    now[0] = 3.0
    for ticket in tickets:                      # the load ends at once
        core.report(ticket.id, Completion(Outcome.OK, 200, 0.1, 3.0))
        core.finish(ticket, Outcome.OK)
    for _ in range(10):                         # interactive served at 3 s meanwhile: over the target, from load
        controller.observe(0, 0.0, 3.0, 3.0)
    caplog.set_level("INFO", logger="extproc.pool")
    core.tick()
    assert controller.last_action == "cut_latency" and core.gates["pool_a"].inflight == 0
    line = json.loads(caplog.records[-1].getMessage())
    assert line["action"] == "cut_latency"
    # What the cut measured: the window's average (about 9), so `to` is `inflight` x the cut's factor.
    assert 8.5 < line["inflight"] < 10 and line["inflight"] == round(controller.sized_on, 1)
    assert line["to"] == pytest.approx(line["inflight"] * 0.8, abs=0.1)
    assert line["inflight_now"] == 0.0
