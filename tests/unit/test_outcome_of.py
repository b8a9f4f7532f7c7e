"""How an admitted request ended, read from Envoy's access log entry (extproc/server/accesslog.py: outcome_of)."""

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2

from extproc.policy.admission import ACCEPT, AdmissionController, RequestFacts
from extproc.policy.limits import Outcome
from extproc.policy.schema import load_policy
from extproc.server.accesslog import completion_of, outcome_of
from tests.conftest import FakeClock


def entry(status: int, details: str = "via_upstream", **flags: bool) -> accesslog_pb2.HTTPAccessLogEntry:
    e = accesslog_pb2.HTTPAccessLogEntry()
    e.response.response_code.value = status
    e.response.response_code_details = details
    for name, value in flags.items():
        setattr(e.common_properties.response_flags, name, value)
    return e


def test_envoys_own_answer_for_a_failed_ext_proc_is_the_ext_procs_error_not_the_replicas():
    """With failure_mode_allow: false Envoy answers an admitted request itself when the ext_proc's stream fails or
    answers late: a 5xx that was filed as upstream_error and counted against the class's error breaker."""
    assert outcome_of(entry(504, "ext_proc_error_per-message_timeout_exceeded")) == (Outcome.EXTPROC_ERROR, 504)
    assert outcome_of(entry(500, "ext_proc_error_gRPC_error_13{boom}")) == (Outcome.EXTPROC_ERROR, 500)


def test_the_replicas_errors_and_the_clients_aborts_stay_theirs():
    assert outcome_of(entry(200)) == (Outcome.OK, 200)
    assert outcome_of(entry(500)) == (Outcome.UPSTREAM_ERROR, 500)
    assert outcome_of(entry(503, "upstream_reset_before_response_started{connection_failure}",
                            upstream_connection_failure=True)) == (Outcome.UPSTREAM_ERROR, 503)
    assert outcome_of(entry(0, "ext_proc_error_gRPC_error_13{boom}", downstream_remote_reset=True)) == \
        (Outcome.CLIENT_ABORT, 0)


def test_envoys_own_answer_from_its_configuration_is_not_the_replicas_error():
    """A model routed to a cluster Envoy lacks (a typo in models.<name>.cluster) is answered 503 cluster_not_found
    (flag NC) by Envoy itself: it was filed as upstream_error and opened the class's error breaker on a healthy
    pool. No route, a route's direct response, a cluster in maintenance mode: Envoy's too, no replica asked."""
    assert outcome_of(entry(503, "cluster_not_found", no_cluster_found=True)) == (Outcome.NOT_ROUTED, 503)
    assert outcome_of(entry(503, "", no_cluster_found=True)) == (Outcome.NOT_ROUTED, 503)  # flag alone
    assert outcome_of(entry(404, "route_not_found", no_route_found=True)) == (Outcome.NOT_ROUTED, 404)
    assert outcome_of(entry(404, "route_configuration_not_found")) == (Outcome.NOT_ROUTED, 404)
    assert outcome_of(entry(503, "direct_response")) == (Outcome.NOT_ROUTED, 503)
    assert outcome_of(entry(200, "direct_response")) == (Outcome.NOT_ROUTED, 200)
    assert outcome_of(entry(503, "maintenance_mode", upstream_overflow=True)) == (Outcome.NOT_ROUTED, 503)
    # The same flag from Envoy's circuit breakers, and the pool's own failures, stay the pool's.
    assert outcome_of(entry(503, "upstream_reset_before_response_started{overflow}", upstream_overflow=True)) == \
        (Outcome.UPSTREAM_ERROR, 503)
    assert outcome_of(entry(503, "no_healthy_upstream", no_healthy_upstream=True)) == (Outcome.UPSTREAM_ERROR, 503)
    assert outcome_of(entry(0, "cluster_not_found", no_cluster_found=True, downstream_remote_reset=True)) == \
        (Outcome.CLIENT_ABORT, 0)


def three_reported(report: accesslog_pb2.HTTPAccessLogEntry):
    """A core whose class has an adaptive cap and both breakers at a hair trigger, after three requests of a
    millisecond each that Envoy's access log reported as `report`: (core, clock, what the cap's limit observed)."""
    clock = FakeClock()
    core = AdmissionController(load_policy({
        "classes": {"interactive": {"max_concurrency": 4, "slo_p95_ms": 100, "adaptive": {"enabled": True},
                                    "error_breaker": {"min_requests": 1}, "latency_breaker": {"min_samples": 1}}},
        "models": {"llama": {"cluster": "vllm"}}}), clock=clock)
    seen = []
    core.limiters["interactive"].controller.observe = lambda *args: seen.append(args)
    for _ in range(3):
        d = core.decide(RequestFacts(model="llama"))
        assert d.kind == ACCEPT
        clock.advance(0.001)
        assert core.report(d.ticket.id, completion_of(report))
        core.finish(d.ticket, Outcome.ENDED)
    return core, clock, seen


def samples_taken(breakers, now: float) -> list[int]:
    """What each breaker's window holds: latency samples, or requests judged."""
    return [b.window.count(now) if b.kind == "latency" else b.window.counts(now)[0] for b in breakers]


@pytest.mark.parametrize("status, details, flag", [(503, "cluster_not_found", "no_cluster_found"),
                                                  (404, "route_not_found", "no_route_found")])
def test_a_request_envoy_answered_without_a_replica_trips_no_breaker_and_teaches_no_limit(status, details, flag):
    """cluster_not_found was an error of the pool (its breaker opened: refused), route_not_found a request the pool
    served (its limit learnt an instant's latency)."""
    core, clock, seen = three_reported(entry(status, details, **{flag: True}))
    breakers = core.state.pool_breakers("interactive", "vllm")
    assert {b.kind: b.state for b in breakers} == {"latency": "closed", "error": "closed"}
    assert samples_taken(breakers, clock()) == [0, 0]
    assert seen == [] and core.decide(RequestFacts(model="llama")).kind == ACCEPT


@pytest.mark.parametrize("status", [400, 404, 413, 422, 429])
def test_a_request_the_replica_refused_with_a_4xx_is_no_evidence_about_the_pool(status):
    """vLLM answers 400 at once for a prompt past its context (a body it cannot run), before running anything.
    Filed ok, each one was a latency sample of a few milliseconds and a success for the error breaker: through real
    Envoy, 240 such 400s before 8 answers of 0.5 s (SLO 300 ms) read a window p95 of 0.013 s and kept the latency
    breaker closed (it opened without them), and 24 replica 500s after them read an error ratio of 0.09 (1.0
    alone): a client sending prompts too long hid a pool that failed or missed its SLO on every generation."""
    core, clock, seen = three_reported(entry(status))
    assert samples_taken(core.state.pool_breakers("interactive", "vllm"), clock()) == [0, 0]
    assert seen == []
