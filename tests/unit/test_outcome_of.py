"""How an admitted request ended, read from Envoy's access log entry (extproc/server/accesslog.py: outcome_of)."""

from envoy.data.accesslog.v3 import accesslog_pb2

from extproc.policy.limits import Outcome
from extproc.server.accesslog import outcome_of


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
