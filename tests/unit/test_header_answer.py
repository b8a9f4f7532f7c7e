"""Envoy's wait for the ext_proc's answer to a request's headers, read from its access log entry
(extproc/server/accesslog.py: header_answer_seconds)."""

from envoy.data.accesslog.v3 import accesslog_pb2
from google.protobuf import struct_pb2

from extproc.server.accesslog import EXT_PROC_STATE, header_answer_seconds


def entry(key: str = EXT_PROC_STATE, **fields) -> accesslog_pb2.HTTPAccessLogEntry:
    e = accesslog_pb2.HTTPAccessLogEntry()
    state = struct_pb2.Struct()
    for name, value in fields.items():
        state.fields[name].number_value = value
    e.common_properties.filter_state_objects[key].Pack(state)
    return e


def test_the_header_call_latency_is_read_in_seconds():
    assert header_answer_seconds(entry(request_header_latency_us=1500, request_body_total_latency_us=9e5)) == 0.0015


def test_envoy_gateways_name_for_the_filter_is_read_too():
    key = "envoy.filters.http.ext_proc/envoyextensionpolicy/llm-edge/extproc-admission/extproc/0"
    assert header_answer_seconds(entry(key, request_header_latency_us=800)) == 0.0008
    assert header_answer_seconds(entry("envoy.filters.http.lua", request_header_latency_us=800)) is None


def test_an_entry_without_the_filters_state_or_its_header_call_reads_none():
    assert header_answer_seconds(accesslog_pb2.HTTPAccessLogEntry()) is None
    assert header_answer_seconds(entry(request_body_total_latency_us=300)) is None


def test_a_state_that_does_not_decode_reads_none():
    e = accesslog_pb2.HTTPAccessLogEntry()
    e.common_properties.filter_state_objects[EXT_PROC_STATE].value = b"\xff\xff\xff"
    assert header_answer_seconds(e) is None
