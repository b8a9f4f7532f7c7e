"""`extproc check --envoy` on the edits infra teams make to envoy.yaml: each edit that lets a request around
admission (or onto another pool than it was counted against) is an error, each that costs something a warning, and
the shipped config has neither. What each edit does through real Envoy: tests/reliability/test_route_edits_envoy.py."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from extproc.tools import envoyconf
from extproc.tools.envoylint import READS, lint

ROOT = Path(__file__).resolve().parents[2]
POOLS = {"vllm_llama70b", "vllm_llama8b"}
EXT_PROC = "envoy.filters.http.ext_proc"
PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"


def shipped() -> dict:
    return copy.deepcopy(envoyconf.load_source())


def hcm(cfg: dict) -> dict:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def routes(cfg: dict) -> list[dict]:
    return hcm(cfg)["route_config"]["virtual_hosts"][0]["routes"]


def route(cfg: dict, path: str) -> dict:
    return next(r for r in routes(cfg) if r["match"].get("path") == path)


def check_envoy(tmp_path, text: str):
    """`extproc check --envoy` run as a user runs it, on `text` as envoy.yaml: (the file, the finished process)."""
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    run = subprocess.run([sys.executable, "-m", "extproc.cli", "check", "--envoy", str(path),
                          str(ROOT / "policies/default.yaml")], capture_output=True, text=True, timeout=60)
    return path, run


def test_the_shipped_config_and_every_rendered_stack_have_no_findings():
    found = lint(shipped(), POOLS, admitted=2000)
    assert (found.errors, found.warnings) == ([], [])
    rendered = envoyconf.render(shipped(), listen_port=1, admin_port=2, extproc=[("127.0.0.1", 3)],
                                pools={"vllm_llama70b": [("127.0.0.1", 4)], "vllm_llama8b": [("127.0.0.1", 5)]})
    found = lint(rendered, POOLS)
    assert (found.errors, found.warnings) == ([], [])


def disable_on_chat(cfg):
    route(cfg, "/v1/chat/completions")["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE,
                                                                                "disabled": True}}


def body_none_on_completions(cfg):
    route(cfg, "/v1/completions")["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE, "overrides": {
        "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "NONE"}}}}


def catch_all_without_ext_proc(cfg):
    # the default-deny route turned into a pass-through, keeping its per-filter config
    deny = routes(cfg)[-1]
    del deny["direct_response"], deny["response_headers_to_add"]
    deny["route"] = {"cluster": "vllm_llama70b", "timeout": "0s"}


def x_model_route_first(cfg):
    routes(cfg).insert(0, {"match": {"prefix": "/", "headers": [
        {"name": "x-model", "string_match": {"exact": "llama-8b"}}]}, "route": {"cluster": "vllm_llama8b"}})


def authority_vhost_without_pool_route(cfg):
    vh = copy.deepcopy(hcm(cfg)["route_config"]["virtual_hosts"][0])
    vh.update(name="internal", domains=["internal.example"], routes=vh["routes"][1:])
    hcm(cfg)["route_config"]["virtual_hosts"].insert(0, vh)


def weighted_pool_route(cfg):
    routes(cfg)[0]["route"] = {"weighted_clusters": {"clusters": [{"name": "vllm_llama70b", "weight": 90},
                                                                   {"name": "vllm_llama8b", "weight": 10}]},
                               "timeout": "0s"}


def hedged_retries(cfg):
    routes(cfg)[0]["route"].update(retry_policy={"retry_on": "5xx,reset", "num_retries": 3,
                                                 "per_try_timeout": "10s"},
                                   hedge_policy={"hedge_on_per_try_timeout": True})


def filter_after_router(cfg):
    filters = hcm(cfg)["http_filters"]
    filters.append(filters.pop(0))


def observability_mode(cfg):
    hcm(cfg)["http_filters"][0]["typed_config"]["observability_mode"] = True


def trailers_skipped(cfg):
    hcm(cfg)["http_filters"][0]["typed_config"]["processing_mode"]["response_trailer_mode"] = "SKIP"


def no_header_strip(cfg):
    del hcm(cfg)["early_header_mutation_extensions"]


def vhost_disables_ext_proc(cfg):
    hcm(cfg)["route_config"]["virtual_hosts"][0]["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE,
                                                                                          "disabled": True}}


def mirrored_to_a_pool(cfg):
    routes(cfg)[0]["route"]["request_mirror_policies"] = [{"cluster": "vllm_llama8b"}]


def weighted_entry_disables_ext_proc(cfg):
    route(cfg, "/v1/completions")["route"] = {"timeout": "0s", "weighted_clusters": {"clusters": [
        {"name": "vllm_llama70b", "weight": 9},
        {"name": "vllm_llama8b", "weight": 1, "typed_per_filter_config": {EXT_PROC: {"@type": PER_ROUTE,
                                                                                      "disabled": True}}}]}}


def ext_proc_option(**options):
    def edit(cfg):
        hcm(cfg)["http_filters"][0]["typed_config"].update(options)
    edit.__name__ = ",".join(options)
    return edit


def another_processor_on_completions(cfg):
    route(cfg, "/v1/completions")["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE, "overrides": {
        "grpc_service": {"envoy_grpc": {"cluster_name": "policy_staging"}}}}}


def mode_without_trailers_on_completions(cfg):
    route(cfg, "/v1/completions")["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE, "overrides": {
        "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "BUFFERED",
                            "response_trailer_mode": "SEND"}}}}


@pytest.mark.parametrize("edit, words", [
    (mode_without_trailers_on_completions, "(path /v1/completions) overrides the ext_proc's processing mode with "
                                           "request_trailer_mode unset"),
    (another_processor_on_completions, "(path /v1/completions) sends its requests to another processor (cluster "
                                       "'policy_staging')"),
    (ext_proc_option(disable_immediate_response=True), "Envoy ignores its refusals"),
    (ext_proc_option(disable_clear_route_cache=True), "the route on x-extproc-cluster is never chosen"),
    (ext_proc_option(route_cache_action="RETAIN"), "the route on x-extproc-cluster is never chosen"),
    (ext_proc_option(mutation_rules={"disallow_expression": {"regex": "x-extproc-.*"}}),
     "mutation_rules refuse x-extproc-cluster, x-extproc-ticket: admitted requests go upstream without them"),
    (ext_proc_option(mutation_rules={"disallow_all": True, "disallow_is_error": True}),
     "every admitted request is answered 503 header_mutation_set_headers_failed"),
    (ext_proc_option(forward_rules={"allowed_headers": {"patterns": [{"prefix": ":"}, {"exact": "content-type"}]}}),
     "forward_rules keep authorization, api-key, content-encoding, x-request-id from it"),
    (ext_proc_option(forward_rules={"disallowed_headers": {"patterns": [{"safe_regex": {"regex": "auth.*"}}]}}),
     "forward_rules keep authorization from it"),
    (mirrored_to_a_pool, "mirrors its requests to vllm_llama8b: each admitted request runs there too"),
    (weighted_entry_disables_ext_proc, "(path /v1/completions) sends to vllm_llama70b, vllm_llama8b with the "
                                       "ext_proc disabled"),
    (disable_on_chat, "route 1 (path /v1/chat/completions) sends to vllm_llama70b with the ext_proc disabled"),
    (body_none_on_completions, "overrides the ext_proc's processing mode (request_body_mode NONE)"),
    (catch_all_without_ext_proc, "(prefix /) sends to vllm_llama70b with the ext_proc disabled"),
    (x_model_route_first, "route 0 (prefix / with header x-model) comes before the route on the x-extproc-cluster"),
    (authority_vhost_without_pool_route, "virtual host 'internal': no route is on the x-extproc-cluster header"),
    (weighted_pool_route, "virtual host 'openai': no route is on the x-extproc-cluster header, so admitted "
                          "requests run on vllm_llama70b, vllm_llama8b by their path"),
    (hedged_retries, "hedge_on_per_try_timeout starts another attempt"),
    (filter_after_router, "runs the ext_proc filter after the router"),
    (observability_mode, "observability_mode"),
    (no_header_strip, "a client can send x-extproc-cluster and pick a pool"),
    (vhost_disables_ext_proc, "with the ext_proc disabled"),
])
def test_an_edit_that_lets_requests_around_admission_is_an_error(edit, words):
    cfg = shipped()
    edit(cfg)
    errors = lint(cfg, POOLS).errors
    assert any(words in e for e in errors), errors


def retries(cfg):
    routes(cfg)[0]["route"]["retry_policy"] = {"retry_on": "5xx,reset,retriable-status-codes", "num_retries": 2,
                                               "retriable_status_codes": [503], "per_try_timeout": "30s"}


def short_route_timeout(cfg):
    routes(cfg)[0]["route"]["timeout"] = "60s"


def openai_prefix(cfg):
    routes(cfg).insert(1, {"match": {"prefix": "/openai/v1/"},
                           "route": {"cluster": "vllm_llama70b", "prefix_rewrite": "/v1/", "timeout": "0s"}})


def lua_after_ext_proc(cfg):
    hcm(cfg)["http_filters"].insert(1, {"name": "envoy.filters.http.lua", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua", "default_source_code": {
            "inline_string": "function envoy_on_request(h) end"}}})


def health_route_with_ext_proc(cfg):
    routes(cfg).insert(1, {"match": {"path": "/healthz"}, "direct_response": {"status": 200}})


def models_without_ext_proc(cfg):  # the route as envoy.yaml had it before the ext_proc answered the listing
    route(cfg, "/v1/models")["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE, "disabled": True}}


def pool_breaker_lowered(cfg):
    cfg["static_resources"]["clusters"][1]["circuit_breakers"] = {"thresholds": [{"max_requests": 64}]}


def compressor_after_ext_proc(cfg):
    hcm(cfg)["http_filters"].insert(1, {"name": "envoy.filters.http.compressor", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.compressor.v3.Compressor",
        "compressor_library": {"name": "gzip", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.compression.gzip.compressor.v3.Gzip"}}}})


def cors_after_ext_proc(cfg):
    hcm(cfg)["http_filters"].insert(1, {"name": "envoy.filters.http.cors", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"}})


@pytest.mark.parametrize("edit, words", [
    (retries, "retry_policy: a retried request holds one slot and is counted once"),
    (trailers_skipped, "response_trailer_mode is SKIP, not SEND"),
    (cors_after_ext_proc, "answers a browser's preflight (OPTIONS) 405 method_not_allowed"),
    (compressor_after_ext_proc, "the ext_proc gets compressed answers: no usage is learned"),
    (health_route_with_ext_proc, "route 1 (path /healthz): a direct_response with the ext_proc on"),
    (pool_breaker_lowered, "cluster 'vllm_llama70b': circuit_breakers max_connections 1024, max_pending_requests "
                           "1024, max_requests 64 (1024 when unset) below the 2000 requests"),
    (short_route_timeout, "route timeout 60s"),
    (models_without_ext_proc, "GET /v1/models lists the models of vllm_llama70b only"),
    (openai_prefix, "route 1 (prefix /openai/v1/): the ext_proc sees the path before the route's rewrite"),
    (lua_after_ext_proc, "envoy.filters.http.lua runs after the ext_proc"),
])
def test_an_edit_that_keeps_admission_but_costs_something_is_a_warning(edit, words):
    cfg = shipped()
    edit(cfg)
    found = lint(cfg, POOLS, admitted=2000)
    assert found.errors == [] and any(words in w for w in found.warnings), found.warnings


def test_a_queue_longer_than_envoy_holds_a_request_is_an_error_and_a_short_request_timeout_a_warning():
    found = lint(shipped(), POOLS, longest_wait_s=29.0)  # the schema's most, under the shipped 30 s
    assert (found.errors, found.warnings) == ([], [])
    cfg = shipped()
    hcm(cfg)["http_filters"][0]["typed_config"]["max_message_timeout"] = "10s"
    hcm(cfg)["request_timeout"] = "5s"
    found = lint(cfg, POOLS, longest_wait_s=12.0)
    assert found.errors == ["listener 'openai': ext_proc max_message_timeout 10s is below the longest queue wait, "
                            "12s + 0.5s: Envoy ignores the ext_proc's extension, and a request queued past "
                            "message_timeout is forwarded unadmitted (failure_mode_allow: true)"]
    assert found.warnings == ["listener 'openai': request_timeout 5s is below the longest queue wait, 12s + 0.5s: "
                              "queued requests get Envoy's 408 first"]
    del hcm(cfg)["http_filters"][0]["typed_config"]["max_message_timeout"]  # unset: every extension ignored
    assert "max_message_timeout 0s" in lint(cfg, POOLS, longest_wait_s=0.2).errors[0]


@pytest.mark.parametrize("turned_on, admitted", [
    (None, False),
    ({"@type": PER_ROUTE, "overrides": {}}, True),
    ({"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {"@type": PER_ROUTE}}, True),
    ({"@type": PER_ROUTE, "disabled": True}, False)])
def test_an_ext_proc_filter_off_by_default_admits_the_routes_a_per_route_config_turns_it_on_for(turned_on, admitted):
    # Envoy Gateway's pattern: the filter `disabled: true` on the connection manager, turned on where a policy
    # applies. Measured through Envoy 1.40: any ExtProcPerRoute (bare, or wrapped in a FilterConfig) on the virtual
    # host turned it on (x-extproc-decision: accept); none left the request unadmitted.
    cfg = shipped()
    hcm(cfg)["http_filters"][0]["disabled"] = True
    if turned_on is not None:
        hcm(cfg)["route_config"]["virtual_hosts"][0]["typed_per_filter_config"] = {EXT_PROC: turned_on}
    errors = lint(cfg, POOLS).errors
    if admitted:
        assert errors == []
    else:
        assert errors and all("with the ext_proc disabled" in e for e in errors), errors


def test_mutation_rules_refusing_the_other_headers_the_ext_proc_sets():
    # With disallow_is_error any refused header fails the request; without it a dropped replica header only loses
    # the steering away from a hung or slow replica (the tags echoed to clients are cosmetic).
    cfg = shipped()
    tc = hcm(cfg)["http_filters"][0]["typed_config"]
    tc["mutation_rules"] = {"disallow_expression": {"regex": "x-ratelimit-.*|x-extproc-class"}}
    assert lint(cfg, POOLS).errors == [] and lint(cfg, POOLS).warnings == []
    tc["mutation_rules"]["disallow_is_error"] = True
    (error,) = lint(cfg, POOLS).errors
    assert "x-extproc-class, x-ratelimit-limit-requests" in error and "503" in error
    tc["mutation_rules"] = {"disallow_expression": {"regex": "x-extproc-replica"}}
    (warning,) = lint(cfg, POOLS).warnings
    assert "no longer steered away" in warning and lint(cfg, POOLS).errors == []


def test_a_listener_without_the_ext_proc_and_no_route_to_a_pool_is_left_alone_with_a_shared_store():
    # The store-call check read the ext_proc filter of every connection manager, before asking whether it ran one:
    # a second listener without it (no pool behind it) raised, and `check --envoy` called the config unreadable.
    cfg = shipped()
    plain = copy.deepcopy(cfg["static_resources"]["listeners"][0])
    plain["name"] = "plain"
    tc = plain["filter_chains"][0]["filters"][0]["typed_config"]
    tc["http_filters"] = [f for f in tc["http_filters"] if f["name"] != EXT_PROC]
    tc["route_config"] = {"virtual_hosts": [{"name": "x", "domains": ["*"],
                                             "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "other"}}]}]}
    cfg["static_resources"]["listeners"].append(plain)
    found = lint(cfg, POOLS, store_call_s=0.05)
    assert (found.errors, found.warnings) == ([], [])


def test_a_stream_idle_timeout_shorter_than_the_queue_wait_is_a_warning():
    # Measured through Envoy 1.40: stream_idle_timeout 1s, a request queued by the ext_proc (cap 1, max_wait_ms
    # 5000) behind a stream that ran 3 s got 504 stream_idle_timeout at 1.0 s, still queued. A route's idle_timeout
    # overrides it for the route.
    cfg = shipped()
    hcm(cfg)["stream_idle_timeout"] = "10s"
    assert lint(cfg, POOLS, longest_wait_s=9.0).warnings == []
    found = lint(cfg, POOLS, longest_wait_s=12.0)
    assert found.errors == [] and found.warnings == [
        "listener 'openai': stream_idle_timeout 10s is below the longest queue wait, 12s + 0.5s: a request still "
        "queued then gets Envoy's 504 stream_idle_timeout"]
    route = next(r for vh in hcm(cfg)["route_config"]["virtual_hosts"] for r in vh["routes"] if "route" in r)
    route["route"]["idle_timeout"] = "2s"
    assert any("idle_timeout 2s" in w for w in lint(cfg, POOLS, longest_wait_s=3.0).warnings)


def test_a_store_call_that_may_outlast_the_message_timeout_is_a_warning():
    # A request admitted at once waits for one Redis call (up to store.timeout_ms) before the ext_proc's first
    # answer: past message_timeout Envoy applies failure_mode_allow.
    assert lint(shipped(), POOLS, store_call_s=0.05).warnings == []  # the default 50 ms under the shipped 0.5 s
    found = lint(shipped(), POOLS, store_call_s=0.5)
    assert found.errors == [] and len(found.warnings) == 1 and "store.timeout_ms (500 ms)" in found.warnings[0]


def test_edits_that_keep_every_request_admitted_have_no_findings():
    cfg = shipped()
    hcm(cfg)["http_filters"][0]["typed_config"].update(
        mutation_rules={"disallow_expression": {"regex": "x-internal-.*"}},
        forward_rules={"allowed_headers": {"patterns": [{"prefix": ":"}, {"prefix": "x-"}, {"exact": "authorization"},
                                                        {"exact": "api-key"}, {"exact": "content-encoding"}]}})
    rs = routes(cfg)
    # a direct_response health route, and routes to other services, with the ext_proc off
    rs.insert(1, {"match": {"path": "/healthz"}, "direct_response": {"status": 200},
                  "typed_per_filter_config": rs[-1]["typed_per_filter_config"]})
    rs.insert(1, {"match": {"prefix": "/docs"}, "route": {"cluster": "docs"},
                  "typed_per_filter_config": rs[-1]["typed_per_filter_config"]})
    # a weighted fallback route (taken only while the ext_proc fails open), after the route on the header
    route(cfg, "/v1/chat/completions")["route"] = {"weighted_clusters": {"clusters": [
        {"name": "vllm_llama70b", "weight": 1}, {"name": "vllm_llama8b", "weight": 1}]}, "timeout": "0s"}
    # a second virtual host by :authority with the same route table
    vh = copy.deepcopy(hcm(cfg)["route_config"]["virtual_hosts"][0])
    vh.update(name="internal", domains=["internal.example"])
    hcm(cfg)["route_config"]["virtual_hosts"].append(vh)
    found = lint(cfg, POOLS)
    assert (found.errors, found.warnings) == ([], [])


def test_check_exits_1_on_an_envoy_config_with_a_bypass(tmp_path):
    cfg = shipped()
    disable_on_chat(cfg)
    retries(cfg)
    path, run = check_envoy(tmp_path, yaml.safe_dump(cfg))
    assert run.returncode == 1, run.stderr
    assert f"{path}: invalid (requests can reach a model pool without admission" in run.stderr
    assert "with the ext_proc disabled" in run.stderr and f"{path}: warning: " in run.stderr


def test_check_reads_a_malformed_listener_as_invalid_not_a_traceback(tmp_path):
    cfg = shipped()
    routes(cfg)[0] = "not a route"
    _, run = check_envoy(tmp_path, yaml.safe_dump(cfg))
    assert run.returncode == 1 and "not an Envoy config this check can read" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_forward_rules_match_header_names_with_case_as_envoy_does():
    # Envoy hands its matchers the lower-case header name: `exact: Authorization` matches it only with ignore_case.
    keep = [{"prefix": ":"}, {"prefix": "x-"}, {"exact": "api-key"}, {"exact": "content-encoding"}]
    cfg = shipped()
    tc = hcm(cfg)["http_filters"][0]["typed_config"]
    tc["forward_rules"] = {"allowed_headers": {"patterns": keep + [{"exact": "Authorization"}]}}
    assert any("forward_rules keep authorization from it" in e for e in lint(cfg, POOLS).errors)
    tc["forward_rules"] = {"allowed_headers": {"patterns": keep + [{"exact": "Authorization", "ignore_case": True}]}}
    assert lint(cfg, POOLS).errors == []
    tc["forward_rules"] = {"disallowed_headers": {"patterns": [{"prefix": "Api-"}]}}  # blocks nothing
    assert lint(cfg, POOLS).errors == []


@pytest.mark.parametrize("rules", [{"allowed_headers": {"patterns": []}}, {"allowed_headers": {}},
                                   {"disallowed_headers": {"patterns": []}}])
def test_a_forward_rules_list_without_patterns_is_named_as_envoy_refuses_it(rules):
    # Envoy refuses a ListStringMatcher with no patterns (`envoy --mode validate`: "Patterns: value must contain at
    # least 1 item(s)"). An empty allow list read as "forward nothing" (an error naming the key and the path as kept
    # from the ext_proc); one without `patterns`, or an empty disallow list, passed.
    cfg = shipped()
    hcm(cfg)["http_filters"][0]["typed_config"]["forward_rules"] = rules
    errors = lint(cfg, POOLS).errors
    (key,) = rules
    assert any(f"forward_rules.{key} lists no patterns: Envoy refuses the config" in e for e in errors), errors
    assert not any("keep" in e for e in errors), errors
    hcm(cfg)["http_filters"][0]["typed_config"]["forward_rules"] = {key: None}  # null is unset: Envoy loads it
    assert lint(cfg, POOLS).errors == []


def test_any_key_matcher_that_removes_every_x_extproc_header_strips_them():
    def strip(matcher):
        cfg = shipped()
        hcm(cfg)["early_header_mutation_extensions"][0]["typed_config"]["mutations"][0] = {
            "remove_on_match": {"key_matcher": matcher}}
        return [e for e in lint(cfg, POOLS).errors if "early_header_mutation_extensions" in e]

    assert strip({"prefix": "x-extproc"}) == []      # a shorter prefix removes them too
    assert strip({"prefix": "X-ExtProc-", "ignore_case": True}) == []
    assert strip({"prefix": "X-ExtProc-"}) != []     # case-sensitive: removes nothing Envoy holds (lower case)
    assert strip({"prefix": "x-extproc-cluster"}) != []  # leaves the ticket


def test_a_per_route_config_wrapped_in_a_filter_config_is_read_as_envoy_unwraps_it():
    # Envoy applies a FilterConfig's inner `config` as the route's ExtProcPerRoute.
    wrapper = "type.googleapis.com/envoy.config.route.v3.FilterConfig"
    for inner, words in (({"disabled": True}, "with the ext_proc disabled"),
                         ({"overrides": {"processing_mode": {"request_header_mode": "SEND",
                                                             "request_body_mode": "NONE"}}},
                          "overrides the ext_proc's processing mode (request_body_mode NONE)")):
        cfg = shipped()
        route(cfg, "/v1/chat/completions")["typed_per_filter_config"] = {
            EXT_PROC: {"@type": wrapper, "config": {"@type": PER_ROUTE, **inner}}}
        errors = lint(cfg, POOLS).errors
        assert any(words in e for e in errors), errors


def test_mutation_rules_allow_expression_lets_our_headers_through_disallow_all():
    # Envoy's order: disallow_expression refuses, then allow_expression allows, then disallow_all refuses.
    cfg = shipped()
    tc = hcm(cfg)["http_filters"][0]["typed_config"]
    tc["mutation_rules"] = {"disallow_all": True, "disallow_is_error": True,
                            "allow_expression": {"regex": "x-extproc-.*|x-ratelimit-.*|content-(length|type)"}}
    assert lint(cfg, POOLS).errors == []
    tc["mutation_rules"]["disallow_expression"] = {"regex": "x-extproc-ticket"}
    assert any("mutation_rules refuse x-extproc-ticket:" in e for e in lint(cfg, POOLS).errors)


def test_a_tcp_proxy_listener_to_a_pool_is_an_error():
    # A second port passing TCP straight to the replicas: no HTTP filter, the ext_proc included, sees its requests.
    tcp = "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy"
    for proxy in ({"cluster": "vllm_llama8b"},
                  {"weighted_clusters": {"clusters": [{"name": "vllm_llama8b", "weight": 1}]}}):
        cfg = shipped()
        cfg["static_resources"]["listeners"].append({
            "name": "raw", "address": {"socket_address": {"address": "0.0.0.0", "port_value": 8081}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.tcp_proxy",
                                            "typed_config": {"@type": tcp, "stat_prefix": "raw", **proxy}}]}]})
        assert lint(cfg, POOLS).errors == ["listener 'raw': tcp_proxy to vllm_llama8b: its connections reach the "
                                           "replicas with no HTTP filter, the ext_proc included (unadmitted)"]
    cfg = shipped()  # to a cluster no model names: nothing of the policy's
    cfg["static_resources"]["listeners"].append({"name": "db", "filter_chains": [{"filters": [
        {"name": "envoy.filters.network.tcp_proxy", "typed_config": {"@type": tcp, "cluster": "postgres"}}]}]})
    assert lint(cfg, POOLS).errors == []


def test_listeners_from_lds_are_said_to_be_unchecked():
    # Nothing of a listener served by LDS is read: a silent pass said nothing let requests around admission.
    cfg = shipped()
    del cfg["static_resources"]["listeners"]
    cfg["dynamic_resources"] = {"lds_config": {"ads": {}}}
    found = lint(cfg, POOLS)
    assert found.errors == [] and found.warnings == [
        "dynamic_resources.lds_config: its listeners come from LDS and are not checked: check the listeners it "
        "serves against docs/envoy-integration.md"]


def test_a_message_timeout_that_covers_the_queue_wait_needs_no_extension():
    # Envoy ignores an extension past max_message_timeout, and then holds the request for message_timeout itself.
    cfg = shipped()
    tc = hcm(cfg)["http_filters"][0]["typed_config"]
    del tc["max_message_timeout"]
    tc["message_timeout"] = "30s"
    assert lint(cfg, POOLS, longest_wait_s=29.0).errors == []
    tc["message_timeout"] = "10s"
    assert "max_message_timeout 0s is below" in lint(cfg, POOLS, longest_wait_s=12.0).errors[0]


def test_pool_breakers_are_read_at_the_default_priority_routes_use():
    cfg = shipped()
    cfg["static_resources"]["clusters"][1]["circuit_breakers"] = {"thresholds": [
        {"priority": "HIGH", "max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000},
        {"priority": "DEFAULT", "max_connections": 100000, "max_pending_requests": 100000, "max_requests": 64}]}
    assert any("circuit_breakers max_requests 64 (1024 when unset) below the 2000 requests" in w
               for w in lint(cfg, POOLS, admitted=2000).warnings)
    cfg["static_resources"]["clusters"][1]["circuit_breakers"] = {"thresholds": [  # DEFAULT unset: Envoy's 1024
        {"priority": "HIGH", "max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000}]}
    assert any("circuit_breakers max_connections 1024, max_pending_requests 1024, max_requests 1024" in w
               for w in lint(cfg, POOLS, admitted=2000).warnings)


def test_check_counts_what_adaptive_caps_and_degraded_slots_may_admit(tmp_path, capsys):
    # An adaptive cap rises to adaptive.max_limit, and a degrade holds slots of its own besides the class's.
    import argparse

    from extproc.tools import check

    cfg = shipped()
    cfg["static_resources"]["clusters"][1]["circuit_breakers"] = {"thresholds": [{"max_requests": 1000}]}
    envoy = tmp_path / "envoy.yaml"
    envoy.write_text(yaml.safe_dump(cfg))
    policy = tmp_path / "policy.yaml"
    for classes, admitted in (
            ({"a": {"max_concurrency": 10, "slo_p95_ms": 5000,
                    "adaptive": {"enabled": True, "max_limit": 1500}}}, 1500),
            ({"a": {"max_concurrency": 600, "fallback": {"action": "degrade", "model": "llama-8b"}}}, 1200)):
        policy.write_text(yaml.safe_dump({"classes": classes, "models": {"llama-70b": {"cluster": "vllm_llama70b"},
                                                                         "llama-8b": {"cluster": "vllm_llama8b"}}}))
        assert check.run(argparse.Namespace(files=[str(policy)], envoy=str(envoy), max_body_bytes=4 << 20,
                                            max_pending_bodies=10_000)) == 0
        assert f"max_requests 1000 (1024 when unset) below the {admitted} requests" in capsys.readouterr().err


def test_an_early_header_mutation_removing_a_header_the_ext_proc_reads_is_an_error():
    # It runs before any filter: the ext_proc never sees what it removes (envoy.yaml's x-extproc- strip took a
    # policy's `classify.header: x-extproc-tier` from every request, and each claimed nothing).
    found = lint(shipped(), POOLS, reads=(*READS, "x-extproc-tier"))
    assert found.errors == ["listener 'openai': early_header_mutation_extensions remove x-extproc-tier before the "
                            "ext_proc reads it: the policy reads it for a class, session, objective, fairness or "
                            "deadline (name another), or the ext_proc itself for the key, path or request id"]
    cfg = shipped()
    hcm(cfg)["early_header_mutation_extensions"][0]["typed_config"]["mutations"].append({"remove": "x-priority"})
    assert "remove x-priority before" in lint(cfg, POOLS, reads=(*READS, "x-priority")).errors[0]
    assert lint(shipped(), POOLS, reads=(*READS, "x-priority", "x-session-id")).errors == []


def test_envoy_config_names_a_pool_envoy_yaml_lacks_in_one_line(capsys):
    import argparse

    parser = argparse.ArgumentParser()
    envoyconf.add_arguments(parser)
    assert envoyconf.run(parser.parse_args(["--pool", "vllm_typo=127.0.0.1:8000"])) == 2
    assert capsys.readouterr().err == ("extproc envoy-config: envoy.yaml has no cluster 'vllm_typo' (clusters: "
                                       "extproc, vllm_llama70b, vllm_llama8b): name it in the policy's `models` "
                                       "(--policy), or add it to a copy of envoy.yaml (--source)\n")


OWN_FLEET = """
classes: {interactive: {max_concurrency: 4}}
models:
  chat-70b: {cluster: vllm_chat}
  coder-7b: {cluster: vllm_code}
"""


def test_envoy_config_and_stack_take_the_pools_their_policy_names(tmp_path, capsys):
    # A fleet of one's own (a platform-engineer session, 2026-12-06): `extproc envoy-config --pool vllm_chat=...`
    # and `extproc stack --policy mine.yaml --pool vllm_chat=...` refused every pool name envoy.yaml lacks, so
    # the local stack ran only the shipped two-pool fleet. The pools the policy names get a cloned cluster now;
    # a name nobody names is still refused (a typo).
    import argparse

    from extproc.tools import stack

    policy = tmp_path / "mine.yaml"
    policy.write_text(OWN_FLEET)
    parser = argparse.ArgumentParser()
    envoyconf.add_arguments(parser)
    out = tmp_path / "envoy.yaml"
    args = ["--pool", "vllm_chat=127.0.0.1:8001,127.0.0.1:8002", "--pool", "vllm_code=127.0.0.1:8003", "-o", str(out)]
    assert envoyconf.run(parser.parse_args(args)) == 2
    assert "no cluster 'vllm_chat', 'vllm_code'" in capsys.readouterr().err
    assert envoyconf.run(parser.parse_args([*args, "--policy", str(policy)])) == 0
    cfg = yaml.safe_load(out.read_text())
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    assert sorted(clusters) == ["extproc", "vllm_chat", "vllm_code"]
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"]
             for e in clusters["vllm_chat"]["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert ports == [8001, 8002] and clusters["vllm_code"]["health_checks"]  # cloned as shipped, then addressed
    assert lint(cfg, ["vllm_chat", "vllm_code"]).errors == []
    assert envoyconf.run(parser.parse_args([*args, "--pool", "vllm_typo=127.0.0.1:1", "--policy", str(policy)])) == 2
    assert "no cluster 'vllm_typo' (" in capsys.readouterr().err

    parser = argparse.ArgumentParser()
    stack.add_arguments(parser)
    assert stack.run(parser.parse_args(["--pool", "vllm_typo=127.0.0.1:1", "--policy", str(policy)])) == 2
    assert capsys.readouterr().err.startswith("extproc stack: envoy.yaml has no cluster 'vllm_typo' (")
    assert envoyconf.unknown_pools(envoyconf.load_source(), ["vllm_chat", "vllm_code"], policy) == []


def test_envoy_config_takes_ipv6_endpoints_in_brackets_and_writes_the_address_envoy_reads():
    # socket_address.address is a bare IP: Envoy refuses "[::1]" as malformed.
    import argparse

    parser = argparse.ArgumentParser()
    envoyconf.add_arguments(parser)
    args = parser.parse_args(["--pool", "vllm_llama70b=[::1]:8000", "--extproc", "[::1]:50051", "--listen",
                              "[::]:10000"])
    assert (args.pool, args.extproc, args.listen) == (["vllm_llama70b=[::1]:8000"], [("::1", 50051)], ("::", 10000))
    assert envoyconf._endpoint("[::1]:8000") == ("::1", 8000)


def test_request_header_mode_default_sends_the_headers():
    # HeaderSendMode DEFAULT is the field's default: SEND for request headers (SKIP for trailers).
    cfg = shipped()
    hcm(cfg)["http_filters"][0]["typed_config"]["processing_mode"]["request_header_mode"] = "DEFAULT"
    route(cfg, "/v1/completions")["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE, "overrides": {
        "processing_mode": {"request_header_mode": "DEFAULT", "request_body_mode": "BUFFERED",
                            "request_trailer_mode": "SEND"}}}}
    assert lint(cfg, POOLS).errors == []
    hcm(cfg)["http_filters"][0]["typed_config"]["processing_mode"]["request_trailer_mode"] = "DEFAULT"
    assert any("request_trailer_mode is DEFAULT, not SEND" in e for e in lint(cfg, POOLS).errors)


def test_a_route_timeout_of_zero_written_with_decimals_is_no_timeout():
    cfg = shipped()
    routes(cfg)[0]["route"]["timeout"] = "0.000s"
    assert lint(cfg, POOLS).warnings == []
    routes(cfg)[0]["route"]["timeout"] = "0.5s"
    assert any("route timeout 0.5s" in w for w in lint(cfg, POOLS).warnings)


def test_mutation_rules_refusing_the_content_length_of_a_rewritten_body_are_an_error():
    # The ext_proc sets content-length with every body it rewrites (a client's `priority` removed, a degrade).
    cfg = shipped()
    hcm(cfg)["http_filters"][0]["typed_config"]["mutation_rules"] = {
        "disallow_all": True, "allow_expression": {"regex": "x-extproc-.*|x-ratelimit-.*"}}
    assert [e for e in lint(cfg, POOLS).errors if "content-length" in e] == [
        "listener 'openai': the ext_proc's mutation_rules refuse content-length, which it sets with each body it "
        "rewrites (a client's `priority` or class field removed, a degrade): Envoy refuses those requests"]


def test_check_reads_an_envoy_config_nested_too_deeply_as_unreadable_not_a_traceback(tmp_path):
    # PyYAML parses nested collections recursively: a deep one raised RecursionError out of `check --envoy`.
    path, run = check_envoy(tmp_path, "static_resources: " + "[" * 5000 + "]" * 5000 + "\n")
    assert run.returncode == 2 and f"{path}: not valid YAML: nested too deeply" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("dynamic", [[{"lds_config": {}}], "ads", 1])
def test_check_reads_dynamic_resources_that_are_not_a_mapping_as_unreadable_not_a_traceback(tmp_path, dynamic):
    # `check` looked for cds_config with .get() before anything caught a wrong shape: AttributeError, a traceback.
    cfg = shipped()
    cfg["dynamic_resources"] = dynamic
    path, run = check_envoy(tmp_path, yaml.safe_dump(cfg))
    assert run.returncode == 2 and f"{path}: dynamic_resources: a " in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("name", [1, ["vllm_llama8b"], None])
def test_check_reads_a_cluster_name_that_is_not_a_string_as_unreadable_not_a_traceback(tmp_path, name):
    # A number among the cluster names raised TypeError sorting them for the message; a list, TypeError hashing it.
    cfg = shipped()
    cfg["static_resources"]["clusters"][1]["name"] = name
    path, run = check_envoy(tmp_path, yaml.safe_dump(cfg))
    assert run.returncode == 2 and f"{path}: static_resources.clusters[1].name: " in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_a_virtual_host_routed_by_a_matcher_tree_is_said_to_be_unchecked_not_passed_silently():
    # Envoy accepts a virtual host whose routes are a matcher tree (validated with Envoy 1.40): none of its routes
    # were read, so one to a pool with the ext_proc disabled passed `check --envoy` with no word at all.
    cfg = shipped()
    vh = hcm(cfg)["route_config"]["virtual_hosts"][0]
    del vh["routes"]
    vh["matcher"] = {"matcher_tree": {
        "input": {"name": "path", "typed_config": {
            "@type": "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput", "header_name": ":path"}},
        "exact_match_map": {"map": {"/v1/chat/completions": {"action": {"name": "chat", "typed_config": {
            "@type": "type.googleapis.com/envoy.config.route.v3.Route", "match": {"prefix": "/"},
            "route": {"cluster": "vllm_llama70b", "timeout": "0s"},
            "typed_per_filter_config": {EXT_PROC: {"@type": PER_ROUTE, "disabled": True}}}}}}}}}
    found = lint(cfg, POOLS)
    said = "virtual host 'openai': its routes come from a matcher tree"
    assert any(said in w for w in found.warnings), found.warnings


def test_an_empty_processing_mode_override_is_read_as_envoy_reads_it_every_field_at_its_default():
    # `processing_mode: {}` sets the override (Envoy's has_processing_mode): body NONE, request trailers SKIP, as
    # the filter's own empty mode is read. It was taken for no override, and the route passed with no word.
    cfg = shipped()
    route(cfg, "/v1/completions")["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE, "overrides": {
        "processing_mode": {}}}}
    found = lint(cfg, POOLS)
    assert any("(path /v1/completions) overrides the ext_proc's processing mode (request_body_mode unset)" in e
               for e in found.errors), found.errors


def test_a_mirror_by_header_may_reach_any_pool_and_is_an_error():
    # `cluster_header: x-extproc-cluster` on a mirror took the header's name for a cluster no model names, a
    # warning; through Envoy 1.40 one admitted request ran twice on its pool, both with the ticket.
    cfg = shipped()
    routes(cfg)[0]["route"]["request_mirror_policies"] = [{"cluster_header": "x-extproc-cluster"}]
    found = lint(cfg, POOLS)
    assert any("mirrors its requests to the cluster named by x-extproc-cluster: each admitted request runs there "
               "too" in e for e in found.errors), (found.errors, found.warnings)


def test_virtual_hosts_from_vhds_are_said_to_be_unchecked_not_passed_silently():
    # Envoy accepts a route table that takes more virtual hosts from VHDS (validated with Envoy 1.40); they were
    # never mentioned, as if the inline ones were all there is.
    cfg = shipped()
    hcm(cfg)["route_config"]["vhds"] = {"config_source": {"resource_api_version": "V3", "api_config_source": {
        "api_type": "DELTA_GRPC", "transport_api_version": "V3", "grpc_services": [{"envoy_grpc": {
            "cluster_name": "extproc"}}]}}}
    found = lint(cfg, POOLS)
    assert any("route_config.vhds: the virtual hosts VHDS serves are not checked" in w for w in found.warnings), \
        found.warnings


def _filter_config(cfg: dict) -> dict:
    return hcm(cfg)["http_filters"][0]["typed_config"]


@pytest.mark.parametrize("spelling", [{"request_header_mode": 1, "request_body_mode": 2, "request_trailer_mode": 1},
                                      {"request_body_mode": "buffered", "request_trailer_mode": "send"},
                                      {"request_header_mode": None}])
def test_a_processing_mode_envoy_reads_as_send_and_buffered_is_clean_however_it_is_spelled(spelling):
    # Envoy's parser takes an enum by number or in lower case, and a null as unset (/config_dump shows SEND and
    # BUFFERED): each was an error, "request_body_mode is 2, not BUFFERED".
    cfg = shipped()
    _filter_config(cfg)["processing_mode"].update(spelling)
    route(cfg, "/v1/completions")["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE, "overrides": {
        "processing_mode": {"request_header_mode": "SEND", "request_body_mode": 2, "request_trailer_mode": 1}}}}
    assert lint(cfg, POOLS).errors == []


@pytest.mark.parametrize("action", [2, "retain", "Retain"])
def test_route_cache_action_retain_by_number_or_in_lower_case_is_an_error(action):
    # /config_dump: 2 and "retain" are RETAIN, which keeps the static route: passed as clean before.
    cfg = shipped()
    _filter_config(cfg)["route_cache_action"] = action
    assert any("keeps the route cache" in e for e in lint(cfg, POOLS).errors)


@pytest.mark.parametrize("spelling", [{"seconds": 2}, {"seconds": "1", "nanos": 500000000}, {}])
def test_a_max_message_timeout_under_the_wait_written_as_seconds_and_nanos_is_an_error(spelling):
    # /config_dump: {seconds: 2, nanos: 500000000} is 2.5s, {} is 0s (every extension ignored): both passed as clean,
    # and a request queued past message_timeout goes upstream unadmitted.
    cfg = shipped()
    _filter_config(cfg)["max_message_timeout"] = spelling
    assert any("max_message_timeout" in e and "below the longest queue wait" in e
               for e in lint(cfg, POOLS, longest_wait_s=5.0).errors)
    _filter_config(cfg)["max_message_timeout"] = {"seconds": 30}
    assert lint(cfg, POOLS, longest_wait_s=5.0).errors == []
    # Large and fine ones too: `g` formatting wrote 1e+06s, which read as a value Envoy refuses.
    for long in ({"seconds": 1000000}, {"seconds": 29, "nanos": 1}):
        _filter_config(cfg)["max_message_timeout"] = long
        assert lint(cfg, POOLS, longest_wait_s=5.0).errors == [], long


def test_a_route_timeout_written_as_seconds_is_read_as_envoy_reads_it():
    cfg = shipped()
    routes(cfg)[0]["route"]["timeout"] = {"seconds": 1}
    assert any("route timeout 1s" in w for w in lint(cfg, POOLS).warnings)
    routes(cfg)[0]["route"]["timeout"] = {"seconds": 0}
    assert lint(cfg, POOLS).warnings == []


@pytest.mark.parametrize("option", ["observability_mode", "disable_immediate_response", "disable_clear_route_cache"])
@pytest.mark.parametrize("off,on", [("false", "true"), ("no", "yes"), ("FALSE", "Y"), ("0", "1")])
def test_an_ext_proc_option_written_as_the_string_false_is_off(option, off, on):
    # /config_dump: "false", "no", "n", "0" (any case) are false. The string read as true here: an error for a
    # config that admits every request.
    cfg = shipped()
    _filter_config(cfg)[option] = off
    assert lint(cfg, POOLS).errors == []
    _filter_config(cfg)[option] = on
    assert lint(cfg, POOLS).errors != []


def test_a_filter_or_hedge_switched_off_with_the_string_false_is_off():
    cfg = shipped()
    hcm(cfg)["http_filters"][0]["disabled"] = "false"
    routes(cfg)[0]["route"].update(retry_policy={"retry_on": "5xx", "num_retries": 2},
                                   hedge_policy={"hedge_on_per_try_timeout": "false"})
    assert lint(cfg, POOLS).errors == []


def test_lists_nested_in_lists_are_read_spliced_in_as_envoy_reads_them():
    # /config_dump: Envoy splices a nested list into its parent (an empty one vanishes). The check raised on the
    # inner list and refused the config as unreadable ("not an Envoy config this check can read"), exit 1.
    cfg = shipped()
    early = hcm(cfg)["early_header_mutation_extensions"][0]["typed_config"]
    early["mutations"] = [early["mutations"][:2], [], early["mutations"][2:]]
    routes(cfg)[1:3] = [routes(cfg)[1:3], []]
    assert lint(cfg, POOLS).errors == []
    early["mutations"] = [early["mutations"][1:]]  # the x-extproc- strip left out, nested
    assert any("no early_header_mutation_extensions removing the prefix x-extproc-" in e
               for e in lint(cfg, POOLS).errors)


def test_the_ext_proc_after_the_router_is_said_to_be_refused_by_envoy_not_to_let_requests_through():
    # `envoy --mode validate`: "terminal filter named envoy.filters.http.router ... must be the last filter". The
    # check said the routes "reach the replicas unadmitted", which Envoy never runs.
    cfg = shipped()
    filter_after_router(cfg)
    assert [e for e in lint(cfg, POOLS).errors if "after the router" in e] == [
        "listener 'openai' runs the ext_proc filter after the router: Envoy refuses the config (the router, a "
        "terminal filter, must be the last HTTP filter); put the ext_proc before it"]


@pytest.mark.parametrize("field,value", [("max_message_timeout", "30"), ("max_message_timeout", "x"),
                                         ("message_timeout", [1]), ("observability_mode", 1),
                                         ("failure_mode_allow", "on")])
def test_a_value_envoy_refuses_in_a_field_the_check_reads_is_an_error_not_read_as_unset(field, value):
    # `envoy --mode validate` refuses each ("Illegal duration format", "invalid JSON ... bool"); the check read the
    # durations as unset and passed the config, and failure_mode_allow: "on" too.
    cfg = shipped()
    _filter_config(cfg)[field] = value
    errors = lint(cfg, POOLS, longest_wait_s=5.0).errors
    assert any(e.startswith("static_resources.listeners[0].filter_chains[0].filters[0].typed_config.http_filters[0]"
                            f".typed_config.{field}: {value!r}: not a value Envoy takes there") for e in errors), errors


def test_a_free_form_json_body_format_is_not_read_as_envoy_fields():
    cfg = shipped()
    mapper = hcm(cfg)["local_reply_config"]["mappers"][0]
    mapper["body_format_override"]["json_format"]["error"].update(timeout="soon", disabled="no")
    assert lint(cfg, POOLS).errors == []


# --- the edits a hostile-eyed audit ran through Envoy 1.40 (tests/ops/test_envoy_check_audit.py runs each through
# the CLI); here what decides each verdict ---

def ext_proc_tc(cfg: dict) -> dict:
    return next(f["typed_config"] for f in hcm(cfg)["http_filters"] if f["name"] == EXT_PROC)


def with_cluster(cfg: dict, name: str, address: str, port: int, **extra) -> None:
    cfg["static_resources"]["clusters"].append({
        "name": name, "type": "STATIC", "connect_timeout": "1s", **extra,
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
            "socket_address": {"address": address, "port_value": port}}}}]}]}})


def test_a_canary_route_ahead_of_the_pool_route_runs_admitted_requests_elsewhere_whatever_its_endpoints():
    cfg = shipped()
    with_cluster(cfg, "canary", "10.9.9.9", 8000)  # replicas of its own: no pool's
    routes(cfg).insert(0, {"match": {"prefix": "/v1/", "headers": [{"name": "x-canary", "present_match": True}]},
                           "route": {"cluster": "canary", "timeout": "0s"}})
    assert any("route 0 (prefix /v1/ with header x-canary) comes before the route on the x-extproc-cluster header "
               "with the ext_proc on: an admitted request it matches runs on canary" in e
               for e in lint(cfg, POOLS).errors)
    routes(cfg)[0]["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE, "disabled": True}}
    assert lint(cfg, POOLS).errors == []  # not admitted and no pool's: another service, not ours to judge


def test_a_cluster_over_a_pools_replicas_or_any_host_is_that_pool():
    cfg = shipped()
    pool = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "vllm_llama70b")
    sock = pool["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    with_cluster(cfg, "same_pods", sock["address"].upper(), sock["port_value"])
    cfg["static_resources"]["clusters"].append({"name": "passthrough", "type": "ORIGINAL_DST",
                                                "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "1s"})
    off = {EXT_PROC: {"@type": PER_ROUTE, "disabled": True}}
    for i, name in enumerate(("same_pods", "passthrough")):
        routes(cfg).insert(1, {"match": {"prefix": f"/internal{i}/"}, "route": {"cluster": name, "timeout": "0s"},
                               "typed_per_filter_config": off})
    errors = lint(cfg, POOLS).errors
    assert any("sends to same_pods with the ext_proc disabled" in e for e in errors), errors
    assert any("sends to passthrough with the ext_proc disabled" in e for e in errors), errors


def test_body_buffers_past_the_ext_procs_receive_limit_fail_open_only_while_it_fails_open():
    cfg = shipped()
    cfg["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] = 32 << 20
    assert any("per_connection_buffer_limit_bytes 33,554,432 is past the ext_proc's gRPC receive limit" in e
               for e in lint(cfg, POOLS).errors)
    assert lint(cfg, POOLS, max_body_bytes=16 << 20).errors == []  # serve --max-body-bytes raised to match
    ext_proc_tc(cfg)["failure_mode_allow"] = False  # a failed stream is then a 503, not a bypass
    assert lint(cfg, POOLS).errors == []


def test_the_ext_proc_clusters_breaker_must_stay_above_what_it_may_hold():
    cfg = shipped()
    extproc = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "extproc")
    extproc["circuit_breakers"] = {"thresholds": [{"max_requests": 20_000, "max_pending_requests": 20_000,
                                                   "max_connections": 20_000}]}
    assert lint(cfg, POOLS, admitted=500).errors == []
    assert any("max_requests 20000" in e for e in lint(cfg, POOLS, admitted=500, max_pending_bodies=30_000).errors)


def test_a_short_message_timeout_fails_open_under_load():
    cfg = shipped()
    ext_proc_tc(cfg)["message_timeout"] = "0.05s"
    assert any("message_timeout 0.05s is under 0.2s" in e for e in lint(cfg, POOLS).errors)
    ext_proc_tc(cfg)["failure_mode_allow"] = False
    assert not any("message_timeout" in e for e in lint(cfg, POOLS).errors)


def test_internal_clients_x_envoy_retry_headers_must_be_removed_early():
    cfg = shipped()
    hcm(cfg)["internal_address_config"] = {"cidr_ranges": [{"address_prefix": "10.0.0.0", "prefix_len": 8}]}
    errors = lint(cfg, POOLS).errors
    assert any("internal_address_config makes some clients internal" in e and "x-envoy-hedge-on-per-try-timeout" in e
               for e in errors), errors
    mutation = hcm(cfg)["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    mutation.append({"remove_on_match": {"key_matcher": {"prefix": "x-envoy-"}}})
    assert lint(cfg, POOLS).errors == []


def test_a_connection_manager_written_as_a_typed_struct_is_read_as_one():
    cfg = shipped()
    plain = copy.deepcopy(hcm(cfg))
    plain["http_filters"] = [f for f in plain["http_filters"] if f["name"] != EXT_PROC]
    del plain["@type"]
    cfg["static_resources"]["listeners"].append({
        "name": "generated", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 8082}},
        "filter_chains": [{"filters": [{"name": "hcm", "typed_config": {
            "@type": "type.googleapis.com/xds.type.v3.TypedStruct",
            "type_url": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                        "HttpConnectionManager", "value": plain}}]}]})
    assert any("listener 'generated' has no ext_proc filter" in e for e in lint(cfg, POOLS).errors)
