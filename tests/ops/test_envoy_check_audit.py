"""An audit of `extproc check --envoy` from an infra engineer's chair: edits to envoy/envoy.yaml that ordinary work
produces (a second port, a renamed filter, a bigger buffer, an internal route, a canary, a forward proxy), each run
through the checker as a user runs it (`python -m extproc.cli check --envoy FILE policies/default.yaml`).

Each variant's test asserts the checker's verdict. Twelve variants it accepted were shown through real Envoy 1.40
to let a request reach a replica without the ext_proc's admission (or run it on another pool than it was counted
against); it refuses each since (their `bypass` says what was shown, `error` what the check now says). A bypass
found later and not closed yet is listed with `refused=False` and its `bypass`: marked `xfail(strict=True)`, it
documents the gap and fails once the check refuses it. A third round (same day, after the twelve fixes) tried 18
more edits: 14 accepted edits were shown to bypass (aggregate, EDS and respelled-endpoint clusters over a pool, a
route-table mirror, a second ext_proc ahead of ours, per-route configs that Envoy merges field by field, a
per-route failure_mode_allow, quoted numbers, a runtime_fraction on the header route, a lower-case ORIGINAL_DST,
inline scoped routes, the generic proxy); they are the xfail(strict) entries at the end of VARIANTS.
The live proofs are in tests/ops/envoy_audit_live.py (`python -m tests.ops.envoy_audit_live`), which applies these
same edits to a local stack's rendered config.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from extproc.tools import envoyconf

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "policies/default.yaml"
EXT_PROC = "envoy.filters.http.ext_proc"
PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = {"name": "envoy.filters.http.router",
          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
OFF = {EXT_PROC: {"@type": PER_ROUTE, "disabled": True}}


# --- where things are in envoy.yaml ------------------------------------------------------------------------------

def listener(cfg: dict) -> dict:
    return cfg["static_resources"]["listeners"][0]


def hcm(cfg: dict) -> dict:
    return listener(cfg)["filter_chains"][0]["filters"][0]["typed_config"]


def vhost(cfg: dict) -> dict:
    return hcm(cfg)["route_config"]["virtual_hosts"][0]


def routes(cfg: dict) -> list[dict]:
    return vhost(cfg)["routes"]


def route(cfg: dict, path: str) -> dict:
    return next(r for r in routes(cfg) if r["match"].get("path") == path)


def ext_filter(cfg: dict) -> dict:
    return next(f for f in hcm(cfg)["http_filters"] if f["name"] == EXT_PROC)


def cluster(cfg: dict, name: str) -> dict:
    return next(c for c in cfg["static_resources"]["clusters"] if c["name"] == name)


def sibling_cluster(cfg: dict, of: str, name: str) -> dict:
    """A copy of pool `of` under another name: the same replicas (as a second Service over the same pods)."""
    c = copy.deepcopy(cluster(cfg, of))
    c["name"] = name
    c["load_assignment"]["cluster_name"] = name
    cfg["static_resources"]["clusters"].append(c)
    return c


def second_listener(cfg: dict, name: str, port: int, hcm_config: dict, **extra) -> dict:
    new = {"name": name, "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                           "typed_config": hcm_config}]}], **extra}
    cfg["static_resources"]["listeners"].append(new)
    return new


def plain_hcm(prefix: str, routes_: list[dict], filters: list[dict] | None = None) -> dict:
    return {"@type": HCM_TYPE, "stat_prefix": prefix, "codec_type": "AUTO",
            "route_config": {"name": prefix, "virtual_hosts": [{"name": prefix, "domains": ["*"],
                                                                "routes": routes_}]},
            "http_filters": [*(filters or []), ROUTER]}


# --- the variants: each edits envoy.yaml as loaded (a dict) in place; `port` is a free port for a new listener ------

def tls_listener_copy_without_ext_proc(cfg: dict, port: int = 8443) -> None:
    """A TLS port beside the cleartext one, its connection manager copied and the ext_proc left out ('TLS clients
    are internal')."""
    copy_ = copy.deepcopy(hcm(cfg))
    copy_["stat_prefix"] = "openai_tls"
    copy_["http_filters"] = [f for f in copy_["http_filters"] if f["name"] != EXT_PROC]
    second_listener(cfg, "openai_tls", port, copy_)


def tls_listener_full_copy(cfg: dict, port: int = 8443) -> None:
    """The same, keeping every filter: safe."""
    copy_ = copy.deepcopy(hcm(cfg))
    copy_["stat_prefix"] = "openai_tls"
    second_listener(cfg, "openai_tls", port, copy_)


def vhost_by_domain_without_ext_proc(cfg: dict, port: int = 0) -> None:
    """A virtual host for an internal domain, with the whole route table, the ext_proc switched off on it."""
    internal = copy.deepcopy(vhost(cfg))
    internal.update(name="internal", domains=["batch.internal", "batch.internal:*"], typed_per_filter_config=OFF)
    hcm(cfg)["route_config"]["virtual_hosts"].insert(0, internal)


def per_route_disabled_in_filter_config(cfg: dict, port: int = 0) -> None:
    route(cfg, "/v1/embeddings")["typed_per_filter_config"] = {EXT_PROC: {
        "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": True}}


def override_header_skip(cfg: dict, port: int = 0) -> None:
    route(cfg, "/v1/completions")["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE, "overrides": {
        "processing_mode": {"request_header_mode": "SKIP", "request_body_mode": "BUFFERED",
                            "request_trailer_mode": "SEND"}}}}


def override_body_streamed(cfg: dict, port: int = 0) -> None:
    route(cfg, "/v1/chat/completions")["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE, "overrides": {
        "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "STREAMED",
                            "request_trailer_mode": "SEND"}}}}


def catch_all_pool_after_header_route(cfg: dict, port: int = 0) -> None:
    """`prefix: /` to the pool right after the header route, ahead of the guarded paths, ext_proc on: it decides."""
    routes(cfg).insert(1, {"match": {"prefix": "/"}, "route": {"cluster": "vllm_llama70b", "timeout": "0s"}})


def catch_all_pool_before_header_route(cfg: dict, port: int = 0) -> None:
    routes(cfg).insert(0, {"match": {"prefix": "/"}, "route": {"cluster": "vllm_llama70b", "timeout": "0s"}})


def regex_route_without_ext_proc(cfg: dict, port: int = 0) -> None:
    routes(cfg).insert(1, {"match": {"safe_regex": {"regex": "/v1/(chat/)?completions"}},
                           "route": {"cluster": "vllm_llama70b", "timeout": "0s"}, "typed_per_filter_config": OFF})


def separated_prefix_without_ext_proc(cfg: dict, port: int = 0) -> None:
    routes(cfg).insert(1, {"match": {"path_separated_prefix": "/v1/embeddings"},
                           "route": {"cluster": "vllm_llama70b", "timeout": "0s"}, "typed_per_filter_config": OFF})


def uri_template_route(cfg: dict, port: int = 0) -> None:
    """A URI-template route (path_match_policy) to the pool, the ext_proc on: it decides."""
    routes(cfg).insert(1, {"match": {"path_match_policy": {
        "name": "envoy.path.match.uri_template.uri_template_matcher",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.path.match.uri_template.v3."
                                  "UriTemplateMatchConfig", "path_template": "/v1/{kind}/completions"}}},
        "route": {"cluster": "vllm_llama70b", "timeout": "0s"}})


def openai_prefix_rewrite(cfg: dict, port: int = 0) -> None:
    routes(cfg).insert(1, {"match": {"prefix": "/openai/v1/"},
                           "route": {"cluster": "vllm_llama70b", "timeout": "0s", "prefix_rewrite": "/v1/"}})


def regex_rewrite_on_header_route(cfg: dict, port: int = 0) -> None:
    routes(cfg)[0]["route"]["regex_rewrite"] = {"pattern": {"regex": "^/openai(/.*)$"}, "substitution": "\\1"}


def host_rewrite_on_header_route(cfg: dict, port: int = 0) -> None:
    routes(cfg)[0]["route"]["host_rewrite_literal"] = "vllm.internal"


def cluster_header_route_after(cfg: dict, port: int = 0) -> None:
    """A route on a client's `x-pool` header, after the ext_proc's: only what fails open takes it."""
    routes(cfg).insert(1, {"match": {"prefix": "/", "headers": [{"name": "x-pool", "present_match": True}]},
                           "route": {"cluster_header": "x-pool", "timeout": "0s"}})


def weighted_static_route(cfg: dict, port: int = 0) -> None:
    route(cfg, "/v1/chat/completions")["route"] = {"timeout": "0s", "weighted_clusters": {"clusters": [
        {"name": "vllm_llama70b", "weight": 90}, {"name": "vllm_llama8b", "weight": 10}]}}


def weighted_entry_by_header_without_ext_proc(cfg: dict, port: int = 0) -> None:
    """A weighted route whose entry picks its cluster by header (`cluster_header`), the ext_proc off on it."""
    route(cfg, "/v1/completions")["route"] = {"timeout": "0s", "weighted_clusters": {"clusters": [
        {"cluster_header": "x-pool", "weight": 1, "typed_per_filter_config": OFF}]}}


def mirror_to_pool(cfg: dict, port: int = 0) -> None:
    routes(cfg)[0]["route"]["request_mirror_policies"] = [{"cluster": "vllm_llama8b"}]


def mirror_to_shadow_cluster(cfg: dict, port: int = 0) -> None:
    sibling_cluster(cfg, "vllm_llama70b", "vllm_shadow")
    routes(cfg)[0]["route"]["request_mirror_policies"] = [{"cluster": "vllm_shadow"}]


def internal_redirects(cfg: dict, port: int = 0) -> None:
    routes(cfg)[0]["route"]["internal_redirect_policy"] = {"max_internal_redirects": 2,
                                                           "redirect_response_codes": [301, 302, 307]}


def retry_other_hosts(cfg: dict, port: int = 0) -> None:
    routes(cfg)[0]["route"]["retry_policy"] = {
        "retry_on": "5xx,reset", "num_retries": 2,
        "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
        "retry_priority": {"name": "envoy.retry_priorities.previous_priorities", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.retry.priority.previous_priorities.v3."
                     "PreviousPrioritiesConfig", "update_frequency": 2}}}


def hedge_on_vhost_retry_on_route(cfg: dict, port: int = 0) -> None:
    vhost(cfg)["hedge_policy"] = {"hedge_on_per_try_timeout": True}
    routes(cfg)[0]["route"]["retry_policy"] = {"retry_on": "5xx", "num_retries": 2, "per_try_timeout": "1s"}


def ext_proc_behind_matcher(cfg: dict, port: int = 0) -> None:
    """The ext_proc wrapped in ExtensionWithMatcher, skipped for a header."""
    f = ext_filter(cfg)
    inner = f["typed_config"]
    f["typed_config"] = {
        "@type": "type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher",
        "extension_config": {"name": EXT_PROC, "typed_config": inner},
        "xds_matcher": {"matcher_list": {"matchers": [{"predicate": {"single_predicate": {
            "input": {"name": "h", "typed_config": {
                "@type": "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput",
                "header_name": "x-skip"}},
            "value_match": {"exact": "1"}}},
            "on_match": {"action": {"name": "skip", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.common.matcher.action.v3.SkipFilter"}}}}]}}}


def lua_before_ext_proc(cfg: dict, port: int = 0) -> None:
    hcm(cfg)["http_filters"].insert(0, {"name": "envoy.filters.http.lua", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
        "default_source_code": {"inline_string": "function envoy_on_request(h) end"}}})


def fail_closed(cfg: dict, port: int = 0) -> None:
    ext_filter(cfg)["typed_config"]["failure_mode_allow"] = False


def no_path_normalisation(cfg: dict, port: int = 0) -> None:
    h = hcm(cfg)
    h.update(normalize_path=False, merge_slashes=False, path_with_escaped_slashes_action="KEEP_UNCHANGED")


def websocket_upgrades(cfg: dict, port: int = 0) -> None:
    hcm(cfg)["upgrade_configs"] = [{"upgrade_type": "websocket"}]


def connect_route_to_pool(cfg: dict, port: int = 0) -> None:
    h = hcm(cfg)
    h["http2_protocol_options"]["allow_connect"] = True
    h["upgrade_configs"] = [{"upgrade_type": "CONNECT"}]
    routes(cfg).insert(1, {"match": {"connect_matcher": {}}, "route": {"cluster": "vllm_llama70b",
                                                                       "timeout": "0s"}})


def client_replica_header(cfg: dict, port: int = 0) -> None:
    """The pools' override_host reads a header a client may send (the early mutation strips x-extproc-* only)."""
    lb = cluster(cfg, "vllm_llama70b")["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    lb["typed_config"]["override_host_sources"] = [{"header": "x-replica"}]


# --- variants accepted by the checker, suspected of letting requests around admission --------------------------

def renamed_filter_canonical_key_off(cfg: dict, port: int = 0) -> None:
    """The ext_proc filter renamed (`name: admission`, by its role); an ExtProcPerRoute under the extension's own
    name (envoy.yaml's `*no_extproc`, copied onto a route thought cheap). Suspected: Envoy falling back to the
    canonical name. Measured through Envoy 1.40: it does not, the request was decided."""
    ext_filter(cfg)["name"] = "admission"
    route(cfg, "/v1/chat/completions")["typed_per_filter_config"] = copy.deepcopy(OFF)


def override_google_grpc_processor(cfg: dict, port: int = 0) -> None:
    """A route given to a staging processor by `google_grpc` rather than `envoy_grpc` (down: fails open)."""
    route(cfg, "/v1/chat/completions")["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE, "overrides": {
        "grpc_service": {"google_grpc": {"target_uri": f"127.0.0.1:{port or 50052}", "stat_prefix": "staging"},
                         "timeout": "0.25s"}}}}


def bigger_request_buffer(cfg: dict, port: int = 0) -> None:
    """per_connection_buffer_limit_bytes raised for base64 images (32 MiB): a body past the ext_proc's gRPC
    receive limit (8 MiB + 64 KiB) fails its stream, and failure_mode_allow sends the request on."""
    listener(cfg)["per_connection_buffer_limit_bytes"] = 32 << 20


def bigger_route_buffer(cfg: dict, port: int = 0) -> None:
    """The same through the route's own buffer limit, on the header route only."""
    routes(cfg)[0]["request_body_buffer_limit"] = 32 << 20
    route(cfg, "/v1/chat/completions")["request_body_buffer_limit"] = 32 << 20


def ext_proc_breakers_left_out(cfg: dict, port: int = 0) -> None:
    """The ext_proc cluster copied without its circuit_breakers (Envoy's 1,024 concurrent requests)."""
    cluster(cfg, "extproc").pop("circuit_breakers")


def short_message_timeout(cfg: dict, port: int = 0) -> None:
    """message_timeout cut to 10 ms ('decisions take microseconds': README) with max_message_timeout kept."""
    ext_filter(cfg)["typed_config"]["message_timeout"] = "0.01s"


def header_route_narrowed_to_v1(cfg: dict, port: int = 0) -> None:
    """The route on x-extproc-cluster narrowed to `prefix: /v1/` ('every OpenAI path is under /v1')."""
    routes(cfg)[0]["match"]["prefix"] = "/v1/"


def internal_route_to_sibling_cluster(cfg: dict, port: int = 0) -> None:
    """/internal/ for trusted batch jobs, to a second cluster over the same replicas, the ext_proc off (as on the
    read-only routes)."""
    sibling_cluster(cfg, "vllm_llama70b", "vllm_llama70b_internal")
    routes(cfg).insert(1, {"match": {"prefix": "/internal/"},
                           "route": {"cluster": "vllm_llama70b_internal", "prefix_rewrite": "/", "timeout": "0s"},
                           "typed_per_filter_config": OFF})


def canary_route_before_header_route(cfg: dict, port: int = 0) -> None:
    """A canary of the 70B pool by header, first in the table: admitted and counted against a pool, run on the
    canary's replicas (here the small pool's, as a canary Service selecting them would)."""
    canary = sibling_cluster(cfg, "vllm_llama8b", "vllm_llama70b_canary")
    canary.pop("health_checks", None)
    routes(cfg).insert(0, {"match": {"prefix": "/v1/", "headers": [{"name": "x-canary", "present_match": True}]},
                           "route": {"cluster": "vllm_llama70b_canary", "timeout": "0s"}})


def trusted_internal_addresses(cfg: dict, port: int = 0) -> None:
    """use_remote_address with internal_address_config (Envoy's start-up warning asks for it) naming the private
    and loopback ranges: a client there is internal, and its x-envoy-retry-on / per-try-timeout / hedge headers
    are honoured: one admission, several generations at once."""
    hcm(cfg)["use_remote_address"] = True
    hcm(cfg)["internal_address_config"] = {"cidr_ranges": [
        {"address_prefix": p, "prefix_len": n} for p, n in (("10.0.0.0", 8), ("172.16.0.0", 12),
                                                            ("192.168.0.0", 16), ("127.0.0.0", 8))]}


def forward_proxy_listener(cfg: dict, port: int = 8081) -> None:
    """An egress port on the same Envoy: a dynamic forward proxy (tools and the ext_proc reach out through it)."""
    cache = {"name": "egress", "dns_lookup_family": "V4_ONLY"}
    second_listener(cfg, "egress", port, plain_hcm("egress", [
        {"match": {"prefix": "/"}, "route": {"cluster": "dynamic_forward_proxy", "timeout": "60s"}}],
        [{"name": "envoy.filters.http.dynamic_forward_proxy", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_forward_proxy.v3.FilterConfig",
            "dns_cache_config": cache}}]))
    cfg["static_resources"]["clusters"].append({
        "name": "dynamic_forward_proxy", "connect_timeout": "2s", "lb_policy": "CLUSTER_PROVIDED",
        "cluster_type": {"name": "envoy.clusters.dynamic_forward_proxy", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.clusters.dynamic_forward_proxy.v3.ClusterConfig",
            "dns_cache_config": cache}}})


def typed_struct_listener(cfg: dict, port: int = 8082) -> None:
    """A second port whose connection manager is written as a TypedStruct (as some generators write it), routed
    to the pool with no ext_proc."""
    second_listener(cfg, "generated", port, {
        "@type": "type.googleapis.com/xds.type.v3.TypedStruct", "type_url": HCM_TYPE,
        "value": {k: v for k, v in plain_hcm("generated", [
            {"match": {"prefix": "/"}, "route": {"cluster": "vllm_llama70b", "timeout": "0s"}}]).items()
            if k != "@type"}})
    cfg["static_resources"]["listeners"][-1]["filter_chains"][0]["filters"][0]["name"] = "hcm"


# --- a third round (2026-12-07, later): edits accepted by the check after its twelve fixes -----------------------

AGGREGATE_TYPE = "type.googleapis.com/envoy.extensions.clusters.aggregate.v3.ClusterConfig"


def aggregate_cluster(cfg: dict, name: str, children: list[str]) -> dict:
    """An aggregate cluster over `children` (a failover group: Envoy tries them in order)."""
    c = {"name": name, "connect_timeout": "2s", "lb_policy": "CLUSTER_PROVIDED",
         "cluster_type": {"name": "envoy.clusters.aggregate",
                          "typed_config": {"@type": AGGREGATE_TYPE, "clusters": children}}}
    cfg["static_resources"]["clusters"].append(c)
    return c


def respelled(address: str) -> str:
    """Another name for the same address: the Service's cluster-local FQDN (a rendered stack's loopback IP:
    localhost)."""
    return "localhost" if address == "127.0.0.1" else f"{address}.default.svc.cluster.local"


def internal_route(cfg: dict, to: str) -> None:
    routes(cfg).insert(1, {"match": {"prefix": "/internal/"},
                           "route": {"cluster": to, "prefix_rewrite": "/", "timeout": "0s"},
                           "typed_per_filter_config": copy.deepcopy(OFF)})


def internal_route_to_aggregate(cfg: dict, port: int = 0) -> None:
    """/internal/ for trusted batch jobs, ext_proc off, to an aggregate cluster (failover: the 70B pool, then the
    8B one)."""
    aggregate_cluster(cfg, "vllm_failover", ["vllm_llama70b", "vllm_llama8b"])
    internal_route(cfg, "vllm_failover")


def mirror_to_aggregate(cfg: dict, port: int = 0) -> None:
    """A shadow of every admitted request, mirrored to an aggregate cluster over the 70B pool."""
    aggregate_cluster(cfg, "vllm_shadow_group", ["vllm_llama70b"])
    routes(cfg)[0]["route"]["request_mirror_policies"] = [{"cluster": "vllm_shadow_group"}]


def internal_route_to_sibling_by_fqdn(cfg: dict, port: int = 0) -> None:
    """The previous audit's /internal/ route, its second cluster over the 70B replicas naming them by the
    Service's FQDN (what kubectl shows) rather than its short name."""
    c = sibling_cluster(cfg, "vllm_llama70b", "vllm_llama70b_internal")
    c.update(type="STRICT_DNS", dns_lookup_family="V4_ONLY")
    for group in c["load_assignment"]["endpoints"]:
        for lb in group["lb_endpoints"]:
            sock = lb["endpoint"]["address"]["socket_address"]
            sock["address"] = respelled(sock["address"])
    internal_route(cfg, "vllm_llama70b_internal")


def internal_route_to_sibling_port_quoted(cfg: dict, port: int = 0) -> None:
    """The same second cluster, the port written as a string (as a Helm template quoting its values does)."""
    c = sibling_cluster(cfg, "vllm_llama70b", "vllm_llama70b_internal")
    for group in c["load_assignment"]["endpoints"]:
        for lb in group["lb_endpoints"]:
            sock = lb["endpoint"]["address"]["socket_address"]
            sock["port_value"] = str(sock["port_value"])
    internal_route(cfg, "vllm_llama70b_internal")


def route_table_mirror_to_pool(cfg: dict, port: int = 0) -> None:
    """A shadow of all traffic, set once on the route table (RouteConfiguration.request_mirror_policies) rather
    than per route or virtual host."""
    hcm(cfg)["route_config"]["request_mirror_policies"] = [{"cluster": "vllm_llama70b"}]


def guardrail_ext_proc_first(cfg: dict, port: int = 0) -> None:
    """A guardrail processor (PII, prompt injection) added as a second ext_proc, first in the chain (a copy of
    ours pointing at its own cluster), and the /internal/ batch route with OUR ext_proc off."""
    guard = copy.deepcopy(ext_filter(cfg))
    guard["name"] = "guardrail"
    guard["typed_config"]["grpc_service"] = {"envoy_grpc": {"cluster_name": "guardrail"}}
    hcm(cfg)["http_filters"].insert(0, guard)
    g = copy.deepcopy(cluster(cfg, "extproc"))
    g["name"] = g["load_assignment"]["cluster_name"] = "guardrail"
    g.pop("health_checks", None)
    g["type"] = "STATIC"
    g["load_assignment"]["endpoints"] = [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
        "address": "127.0.0.1", "port_value": port or 50061}}}}]}]
    cfg["static_resources"]["clusters"].append(g)
    internal_route(cfg, "vllm_llama70b")


def vhost_processor_under_route_overrides(cfg: dict, port: int = 0) -> None:
    """The virtual host's requests sent to a staging processor (overrides.grpc_service), and every route to a
    pool given its own ExtProcPerRoute that only tags the gRPC stream with the endpoint (grpc_initial_metadata).
    Envoy merges an ExtProcPerRoute with the less specific ones field by field: the route's keeps the virtual
    host's grpc_service."""
    c = copy.deepcopy(cluster(cfg, "extproc"))
    c["name"] = c["load_assignment"]["cluster_name"] = "extproc_staging"
    c.pop("health_checks", None)
    c["type"] = "STATIC"
    c["load_assignment"]["endpoints"] = [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
        "address": "127.0.0.1", "port_value": port or 50062}}}}]}]
    cfg["static_resources"]["clusters"].append(c)
    vhost(cfg)["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE, "overrides": {
        "grpc_service": {"envoy_grpc": {"cluster_name": "extproc_staging"}}}}}
    for r in routes(cfg):
        if "route" in r and "typed_per_filter_config" not in r:
            tag = r["match"].get("path") or r["match"].get("prefix")
            r["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE, "overrides": {
                "grpc_initial_metadata": [{"key": "x-endpoint", "value": tag}]}}}


def original_dst_lower_case(cfg: dict, port: int = 8083) -> None:
    """An egress port to an ORIGINAL_DST cluster by header (x-envoy-original-dst-host), its type written in lower
    case (Envoy's parser takes an enum in any case)."""
    second_listener(cfg, "egress", port, plain_hcm("egress", [
        {"match": {"prefix": "/"}, "route": {"cluster": "egress_original_dst", "timeout": "60s"}}]))
    cfg["static_resources"]["clusters"].append({
        "name": "egress_original_dst", "type": "original_dst", "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "2s", "original_dst_lb_config": {"use_http_header": True}})


def second_filter_chain_by_port(cfg: dict, port: int = 8084) -> None:
    """A second filter chain on the same listener, picked by destination port (an extra address), its connection
    manager without the ext_proc."""
    lst = listener(cfg)
    lst["additional_addresses"] = [{"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}]
    chain = copy.deepcopy(lst["filter_chains"][0])
    chain["filter_chain_match"] = {"destination_port": port}
    tc = chain["filters"][0]["typed_config"]
    tc["http_filters"] = [f for f in tc["http_filters"] if f["name"] != EXT_PROC]
    lst["filter_chains"].append(chain)


def scoped_routes_listener(cfg: dict, port: int = 8085) -> None:
    """A second port whose connection manager routes by scope (scoped_routes, keyed on a header), the scope's
    route table inline, to the 70B pool without the ext_proc."""
    tc = plain_hcm("scoped", [{"match": {"prefix": "/"}, "route": {"cluster": "vllm_llama70b", "timeout": "0s"}}])
    table = tc.pop("route_config")
    tc["scoped_routes"] = {
        "name": "scoped",
        "scope_key_builder": {"fragments": [{"header_value_extractor": {"name": "x-tenant-scope",
                                                                        "element_separator": ",", "index": 0}}]},
        "rds_config_source": {"resource_api_version": "V3", "ads": {}},
        "scoped_route_configurations_list": {"scoped_route_configurations": [
            {"name": "batch", "route_configuration": table, "key": {"fragments": [{"string_key": "batch"}]}}]}}
    second_listener(cfg, "scoped", port, tc)


def rc_level_off_under_route_processing_mode(cfg: dict, port: int = 0) -> None:
    """The route table (route_config) turns the ext_proc off for everything; the routes to a pool override only
    its processing_mode (the filter's own). Envoy merges: `disabled` is the most specific config's (unset)."""
    hcm(cfg)["route_config"]["typed_per_filter_config"] = copy.deepcopy(OFF)
    mode = copy.deepcopy(ext_filter(cfg)["typed_config"]["processing_mode"])
    for r in routes(cfg):
        if "route" in r and "typed_per_filter_config" not in r:
            r["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE, "overrides": {"processing_mode": mode}}}


def route_override_async_mode(cfg: dict, port: int = 0) -> None:
    """The chat route's ExtProcPerRoute with `overrides.async_mode: true` ('do not hold chat on the processor'):
    the per-route twin of the filter's observability_mode, which the check refuses."""
    route(cfg, "/v1/chat/completions")["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE, "overrides": {
        "async_mode": True}}}


def fail_closed_route_fails_open_big_buffer(cfg: dict, port: int = 0) -> None:
    """The filter fails closed (failure_mode_allow: false, section 1's other choice), chat fails open by its
    route (overrides.failure_mode_allow: true: 'chat must stay up'), and the buffer raised to 32 MiB for base64
    images (refused by the check while the filter itself fails open)."""
    ext_filter(cfg)["typed_config"]["failure_mode_allow"] = False
    route(cfg, "/v1/chat/completions")["typed_per_filter_config"] = {EXT_PROC: {"@type": PER_ROUTE, "overrides": {
        "failure_mode_allow": True}}}
    listener(cfg)["per_connection_buffer_limit_bytes"] = 32 << 20


def header_route_runtime_fraction(cfg: dict, port: int = 0) -> None:
    """The route on x-extproc-cluster rolled out gradually by a runtime key (route match `runtime_fraction`, 50%
    by default): the check reads its path and headers only."""
    routes(cfg)[0]["match"]["runtime_fraction"] = {
        "default_value": {"numerator": 50, "denominator": "HUNDRED"}, "runtime_key": "routing.extproc_pools"}


def internal_route_to_eds_cluster(cfg: dict, port: int = 0) -> None:
    """/internal/ to an EDS cluster whose endpoints come from a file the operator maintains (filesystem EDS),
    listing the 70B replicas, the ext_proc off."""
    import atexit
    import os
    import tempfile
    ends = copy.deepcopy(cluster(cfg, "vllm_llama70b")["load_assignment"])
    ends["cluster_name"] = "vllm_llama70b_eds"
    fd, path = tempfile.mkstemp(prefix="eds-", suffix=".yaml")
    with open(fd, "w") as f:
        yaml.safe_dump({"resources": [{"@type": "type.googleapis.com/envoy.config.endpoint.v3."
                                                "ClusterLoadAssignment", **ends}]}, f)
    atexit.register(os.unlink, path)  # read by Envoy while this process runs (the check, or a live stack)
    cfg.setdefault("node", {"id": "envoy", "cluster": "openai"})  # Envoy asks for it with any xDS source
    cfg["static_resources"]["clusters"].append({
        "name": "vllm_llama70b_eds", "type": "EDS", "connect_timeout": "2s",
        "eds_cluster_config": {"eds_config": {"resource_api_version": "V3", "path_config_source": {"path": path}}}})
    internal_route(cfg, "vllm_llama70b_eds")


GENERIC = "type.googleapis.com/envoy.extensions.filters.network.generic_proxy"


def generic_proxy_http1_listener(cfg: dict, port: int = 8086) -> None:
    """A second port served by the generic proxy's HTTP/1 codec (envoy.filters.network.generic_proxy: a light L7
    proxy for an internal batch port) to the 70B pool: not a connection manager, so no HTTP filter runs."""
    route = {"action": {"name": "route", "typed_config": {"@type": f"{GENERIC}.action.v3.RouteAction",
                                                          "cluster": "vllm_llama70b", "timeout": "0s"}}}
    cfg["static_resources"]["listeners"].append({
        "name": "batch_http1", "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.generic_proxy", "typed_config": {
            "@type": f"{GENERIC}.v3.GenericProxy", "stat_prefix": "batch_http1",
            "codec_config": {"name": "envoy.generic_proxy.codecs.http1", "typed_config": {
                "@type": f"{GENERIC}.codecs.http1.v3.Http1CodecConfig"}},
            "filters": [{"name": "envoy.filters.generic.router", "typed_config": {
                "@type": f"{GENERIC}.router.v3.Router"}}],
            "route_config": {"name": "batch_http1", "routes": {"on_no_match": route}}}}]}]})


def bigger_request_buffer_quoted(cfg: dict, port: int = 0) -> None:
    """The previous audit's 32 MiB buffer, written as a string (a Helm value quoted; Envoy reads a UInt32Value
    from a JSON string)."""
    listener(cfg)["per_connection_buffer_limit_bytes"] = str(32 << 20)


def body_without_waiting(cfg: dict, port: int = 0) -> None:
    """The filter's send_body_without_waiting_for_header_response: true ('one round trip less')."""
    ext_filter(cfg)["typed_config"]["send_body_without_waiting_for_header_response"] = True


@dataclass(frozen=True)
class Variant:
    edit: Callable[..., None]
    refused: bool          # the checker's verdict today (exit 1)
    bypass: str = ""       # what was shown through Envoy 1.40 (tests/ops/envoy_audit_live.py); "" if nothing
    warns: str = ""        # a warning the checker prints today, if any
    error: str = ""        # words of the error it prints, for a variant refused


VARIANTS = [
    Variant(tls_listener_copy_without_ext_proc, refused=True),
    Variant(tls_listener_full_copy, refused=False),
    Variant(vhost_by_domain_without_ext_proc, refused=True),
    Variant(per_route_disabled_in_filter_config, refused=True),
    Variant(override_header_skip, refused=True),
    Variant(override_body_streamed, refused=True),
    Variant(catch_all_pool_after_header_route, refused=False),
    Variant(catch_all_pool_before_header_route, refused=True),
    Variant(regex_route_without_ext_proc, refused=True),
    Variant(separated_prefix_without_ext_proc, refused=True),
    Variant(uri_template_route, refused=False),
    Variant(openai_prefix_rewrite, refused=False, warns="the ext_proc sees the path before the route's rewrite"),
    Variant(regex_rewrite_on_header_route, refused=False, warns="the ext_proc sees the path before the route's"),
    Variant(host_rewrite_on_header_route, refused=False),
    Variant(cluster_header_route_after, refused=False),
    Variant(weighted_static_route, refused=False),
    Variant(mirror_to_pool, refused=True),
    # Its shadow cluster is a copy of the 70B pool's (the same replicas): each admitted request runs twice there.
    # A warning until stop 56 (the check compared cluster names); an error since it compares endpoints.
    Variant(mirror_to_shadow_cluster, refused=True, error="mirrors its requests to vllm_shadow: each admitted"),
    Variant(internal_redirects, refused=False),
    Variant(retry_other_hosts, refused=False, warns="retry_policy: a retried request holds one slot"),
    Variant(hedge_on_vhost_retry_on_route, refused=True),
    Variant(ext_proc_behind_matcher, refused=True),
    Variant(lua_before_ext_proc, refused=False),
    Variant(fail_closed, refused=False),
    Variant(no_path_normalisation, refused=False),
    Variant(websocket_upgrades, refused=False),
    Variant(connect_route_to_pool, refused=False),
    Variant(client_replica_header, refused=False),
    # Envoy 1.40 did NOT fall back to the canonical name: the chat request was decided (ticket), and the catch-all's
    # config no longer applies either (the check warns so): suspected, not a bypass.
    Variant(renamed_filter_canonical_key_off, refused=False, warns="a direct_response with the ext_proc on"),
    # Accepted by the check until stop 56; each was shown through Envoy 1.40 to let requests around admission (the
    # `bypass` text), and each is an error now (the `error` text).
    Variant(override_google_grpc_processor, refused=True, error="another processor (target_uri", bypass=(
        "overrides.grpc_service.google_grpc to a dead staging processor: failure_mode_allow sent the POST on "
        "without a ticket; the check read only envoy_grpc.cluster_name")),
    Variant(bigger_request_buffer, refused=True, error="per_connection_buffer_limit_bytes 33,554,432 is past",
            bypass=("per_connection_buffer_limit_bytes 32 MiB: a 9 MiB chat body is past the ext_proc's gRPC "
                    "receive limit (8 MiB + 64 KiB), its stream fails, Envoy fails open: no decision")),
    Variant(bigger_route_buffer, refused=True, error="request_body_buffer_limit of route", bypass=(
        "route request_body_buffer_limit 32 MiB: as above, per route")),
    Variant(ext_proc_breakers_left_out, refused=True, error="(the ext_proc's): circuit_breakers", bypass=(
        "the ext_proc cluster at Envoy's 1,024 requests: past 1,024 held uploads a chat request reached the replica "
        "without a ticket")),
    Variant(short_message_timeout, refused=True, error="message_timeout 0.01s is under", bypass=(
        "message_timeout 10 ms: 300 concurrent chats against a cap of 3, 246 reached the replica without a ticket "
        "(shipped 0.5 s: 0)")),
    Variant(header_route_narrowed_to_v1, refused=True, error="must match every path", bypass=(
        "route on x-extproc-cluster narrowed to /v1/: /invocations admitted for llama-8b (counted against "
        "vllm_llama8b) ran on vllm_llama70b; only a warning, exit 0")),
    Variant(internal_route_to_sibling_cluster, refused=True, error="vllm_llama70b_internal with the ext_proc "
            "disabled", bypass=(
        "/internal/ to a second cluster over the 70B replicas, ext_proc off: POST /internal/v1/chat/completions "
        "reached the replica without a ticket, uncounted even as unadmitted")),
    Variant(canary_route_before_header_route, refused=True,
            error="comes before the route on the x-extproc-cluster header", bypass=(
        "a canary route (x-canary) ahead of the header route: admitted as llama-70b, ran on the canary cluster's "
        "replicas; the check compared only the policy's pool names")),
    Variant(trusted_internal_addresses, refused=True, error="internal_address_config makes some clients internal",
            bypass=("use_remote_address + internal_address_config 127/8: a client's x-envoy-retry-on, "
                    "x-envoy-upstream-rq-per-try-timeout-ms and x-envoy-hedge-on-per-try-timeout ran one admitted "
                    "request 3 times at once")),
    Variant(forward_proxy_listener, refused=True, error="'egress' has no ext_proc filter", bypass=(
        "an egress listener with a dynamic forward proxy: Host: <replica>:<port> reached the replica without a "
        "ticket")),
    Variant(typed_struct_listener, refused=True, error="'generated' has no ext_proc filter", bypass=(
        "a second listener whose HCM is a TypedStruct, routed to the pool without the ext_proc: the check did not "
        "recognise it; the POST reached the replica without a ticket")),
    Variant(weighted_entry_by_header_without_ext_proc, refused=True, error="with the ext_proc disabled", bypass=(
        "a weighted_clusters entry by cluster_header with the ext_proc off: x-pool: vllm_llama70b, POST "
        "/v1/completions reached the replica without a ticket")),
    # The third round (2026-12-07, after the twelve fixes): each run through the check and, where accepted, through
    # Envoy 1.40 with tests/ops/envoy_audit_live.py. Safe (the request was decided, with its ticket):
    Variant(second_filter_chain_by_port, refused=True, error="has no ext_proc filter"),
    Variant(rc_level_off_under_route_processing_mode, refused=False),
    Variant(route_override_async_mode, refused=False),   # Envoy 1.40 does not apply overrides.async_mode: decided
    Variant(body_without_waiting, refused=False),
    # A third audit (stop 56): accepted by the check and shown through Envoy 1.40 to let requests around admission,
    # onto another pool, or run twice on one slot. Refused since, but for one left open (refused=False): an EDS
    # cluster's endpoints are not known here (a warning says so).
    Variant(internal_route_to_aggregate, refused=True, bypass=(
        "/internal/ (ext_proc off) to an aggregate cluster over vllm_llama70b and vllm_llama8b: POST "
        "/internal/v1/chat/completions reached the 70B replica without a ticket (decided 0, unadmitted 1); the "
        "check reads only load_assignment endpoints, and an aggregate cluster has none")),
    Variant(mirror_to_aggregate, refused=True, error="mirrors its requests to vllm_shadow_group", bypass=(
        "a mirror on the header route to an aggregate cluster over vllm_llama70b: one admission (accepted 1), two "
        "generations at once on the 70B replica, both with the ticket (max_in_service 2); only a warning")),
    Variant(internal_route_to_sibling_by_fqdn, refused=True, bypass=(
        "the previous audit's second cluster over the 70B replicas, named by another spelling of the same host "
        "(FQDN; localhost for 127.0.0.1 on the stack): POST /internal/v1/chat/completions reached the replica "
        "without a ticket; the check compares endpoint names as written")),
    Variant(internal_route_to_sibling_port_quoted, refused=True, bypass=(
        "the same second cluster with port_value quoted (\"8000\"): Envoy reads it as the number, the check "
        "compared (host, \"8000\") with (host, 8000): POST /internal/v1/chat/completions reached the replica "
        "without a ticket")),
    Variant(internal_route_to_eds_cluster, refused=False, bypass=(
        "/internal/ to an EDS cluster whose endpoints (the 70B replicas) come from a file: POST "
        "/internal/v1/chat/completions reached the replica without a ticket; EDS endpoints are not read (a "
        "warning now says so)"), warns="their endpoints come from EDS"),
    Variant(route_table_mirror_to_pool, refused=True, bypass=(
        "route_config.request_mirror_policies to vllm_llama70b: one admission, the chat ran twice at once on the "
        "70B replica with the ticket (max_in_service 2); the check reads mirrors on routes and virtual hosts only")),
    Variant(guardrail_ext_proc_first, refused=True, warns="envoy.filters.http.ext_proc runs after the ext_proc",
            error="sends to vllm_llama70b with the ext_proc disabled",
            bypass=("a second ext_proc (a guardrail) first in the chain: the check takes the first ext_proc for "
                    "ours, so /internal/ with OUR filter disabled passed as decided; POST "
                    "/internal/v1/chat/completions reached the replica without a ticket (the guardrail, down here, "
                    "failed open)")),
    Variant(vhost_processor_under_route_overrides, refused=True, bypass=(
        "a staging processor on the virtual host (overrides.grpc_service), each route's own ExtProcPerRoute "
        "setting grpc_initial_metadata only: Envoy merges per-route configs field by field and kept the virtual "
        "host's grpc_service; the staging processor down, POST /v1/chat/completions reached the replica without a "
        "ticket. The check reads the most specific config alone")),
    Variant(fail_closed_route_fails_open_big_buffer, refused=True, bypass=(
        "the filter failing closed, the chat route overriding failure_mode_allow: true, a 32 MiB buffer: a 9 MiB "
        "chat body failed the ext_proc's stream and went on undecided (the test upstream's own 413, decided 0, "
        "unadmitted 1; shipped: Envoy's 413). The check's fail-open checks read the filter's flag only")),
    Variant(bigger_request_buffer_quoted, refused=True, bypass=(
        "per_connection_buffer_limit_bytes \"33554432\" (quoted): a 9 MiB chat body reached the replica undecided "
        "(the test upstream's own 413, decided 0, unadmitted 1; shipped: Envoy's 413); the check compares only "
        "an int")),
    Variant(header_route_runtime_fraction, refused=True, bypass=(
        "the header route matched by runtime_fraction 50%: of 8 chats admitted for llama-8b (counted against "
        "vllm_llama8b, ticket and all), 3 ran on the 70B pool by the static route; the check reads path and "
        "headers of that route only")),
    Variant(original_dst_lower_case, refused=True, bypass=(
        "an egress port to an ORIGINAL_DST cluster written `type: original_dst` (Envoy takes it): "
        "x-envoy-original-dst-host: <replica> reached the replica without a ticket; the check matches the "
        "upper-case spelling only")),
    Variant(scoped_routes_listener, refused=True, error="(scope 'scoped') has no ext_proc filter", bypass=(
        "a second port with scoped_routes whose scope's route table is inline (no RDS involved), to the 70B pool "
        "without the ext_proc: x-tenant-scope: batch reached the replica without a ticket, uncounted; a warning "
        "that calls it RDS, exit 0")),
    Variant(generic_proxy_http1_listener, refused=True, bypass=(
        "a second port served by envoy.filters.network.generic_proxy (HTTP/1 codec) to vllm_llama70b: POST "
        "/v1/chat/completions reached the replica without a ticket, uncounted; the check knows only the "
        "connection manager and tcp_proxy")),
]


def check(tmp_path: Path, cfg: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return subprocess.run([sys.executable, "-m", "extproc.cli", "check", "--envoy", str(path), str(POLICY)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def edited(v: Variant) -> dict[str, Any]:
    cfg = copy.deepcopy(envoyconf.load_source())
    v.edit(cfg)
    return cfg


def _param(v: Variant):
    # A demonstrated bypass the check still accepts documents the gap: strict, it fails once the check refuses it.
    marks = [pytest.mark.xfail(strict=True, reason=f"checker accepts a demonstrated bypass: {v.bypass}")] \
        if v.bypass and not v.refused else []
    return pytest.param(v, id=v.edit.__name__, marks=marks)


@pytest.mark.parametrize("variant", [_param(v) for v in VARIANTS])
def test_check_verdict(tmp_path, variant: Variant):
    run = check(tmp_path, edited(variant))
    assert run.returncode in (0, 1), run.stderr
    if variant.bypass and not variant.refused:  # what the check should say: refuse the config
        assert run.returncode == 1, f"accepted:\n{run.stdout}{run.stderr}"
        return
    assert (run.returncode == 1) == variant.refused, f"{run.stdout}{run.stderr}"
    if variant.warns:
        assert variant.warns in run.stderr, run.stderr
    if variant.error:
        assert variant.error in run.stderr, run.stderr


def test_the_shipped_config_is_accepted(tmp_path):
    run = check(tmp_path, copy.deepcopy(envoyconf.load_source()))
    assert run.returncode == 0 and "warning" not in run.stderr, run.stderr
