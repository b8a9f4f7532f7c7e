"""`extproc check --envoy`: the edits to an Envoy config that let a request reach a model pool without admission, or
admitted against another pool than the one it runs on. Reads the parsed bootstrap (a dict); no I/O.

Each finding was measured through Envoy 1.40 (docs/envoy-integration.md, section 7). Errors: requests
pass unadmitted, run on a pool they were not counted against, or are admitted once and run several times at once.
Warnings: admission holds, but the edit costs what the docs say.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

from envoy.extensions.filters.http.ext_proc.v3.ext_proc_pb2 import ExternalProcessor
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode

from extproc.policy.schema import READ_HEADERS
from extproc.server.accesslog import TICKET_HEADER
from extproc.server.protocol import (CLUSTER_HEADER, MAX_BODY_BYTES, MAX_PENDING_BODIES, REPLICA_HEADER,
                                     grpc_receive_limit)
from extproc.server.servicer import QUEUE_GRACE_S
from extproc.tools.envoyconf import seconds

EXT_PROC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
TCP_PROXY_TYPE = "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
# Read-only vLLM endpoints that skip the ext_proc by design (envoy.yaml), each matched exactly and for GET only.
READ_ONLY = frozenset({"/v1/models", "/health", "/ping", "/version"})
# Filters that can change the body, the path or the headers a route is chosen on: after the ext_proc decided,
# what they change is not what was admitted.
REWRITERS = ("envoy.filters.http.lua", "envoy.filters.http.wasm", "envoy.filters.http.golang",
             "envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc")


class Findings:
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []


# Headers the ext_proc reads whatever the policy (protocol.read_request_headers); check adds the policy's own.
READS = READ_HEADERS
# Headers the ext_proc sets on an admitted request: the pool to route to, and the ticket its report is matched by.
SETS = (CLUSTER_HEADER, TICKET_HEADER)
# ...and the others it sets on some: the replicas to use (steering), and the tags echoed to the client.
TAGS = (REPLICA_HEADER, "x-extproc-class", "x-extproc-decision", "x-extproc-queue-wait-ms", "x-extproc-degraded",
        "x-extproc-shadow", *(f"x-ratelimit-{what}-{unit}" for unit in ("requests", "tokens")
                              for what in ("limit", "remaining", "reset")))


def lint(cfg: dict[str, Any], pools: set[str], admitted: int = 0, longest_wait_s: float = 0.0,
         reads: tuple[str, ...] = READS, store_call_s: float = 0.0, max_body_bytes: int = MAX_BODY_BYTES,
         max_pending_bodies: int = MAX_PENDING_BODIES) -> Findings:
    """What in `cfg` lets requests for the clusters in `pools` (the policy's) around admission; `admitted` is how
    many requests the policy admits at once at most (check._most_held summed), `longest_wait_s` the longest a
    request may queue (its classes' max_wait_ms), `reads` the request headers the ext_proc reads, `store_call_s` the
    longest a shared store's call may take (`store.timeout_ms`; 0: no shared store); `max_body_bytes` and
    `max_pending_bodies` are `extproc serve`'s flags of those names."""
    found = Findings()
    refused: list[str] = []
    cfg = as_envoy_reads(cfg, refused)
    for what in refused:
        found.errors.append(f"{what}: not a value Envoy takes there, so Envoy refuses the config (see `envoy --mode "
                            "validate -c`); this check would read it as unset")
    if (cfg.get("dynamic_resources") or {}).get("lds_config") is not None:
        found.warnings.append("dynamic_resources.lds_config: its listeners come from LDS and are not checked: check "
                              "the listeners it serves against docs/envoy-integration.md")
    reaching = pool_clusters(cfg, pools)
    unseen = eds_clusters(cfg, pools)
    if unseen:
        found.warnings.append(f"clusters {', '.join(unseen)}: their endpoints come from EDS, so this check cannot "
                              "tell whether they are a pool's replicas: a route to one with the ext_proc off "
                              "reaches them unadmitted if they are (measured with a second cluster over the 70B "
                              "replicas)")
    for where, hcm in _connection_managers(cfg):
        _lint_hcm(where, hcm, reaching, longest_wait_s, reads, store_call_s, found)
    _lint_tcp_proxies(cfg, reaching, found)
    _lint_pool_breakers(cfg, pools, admitted, found)
    _lint_buffers(cfg, reaching, grpc_receive_limit(max_body_bytes), found)
    _lint_ext_proc_breakers(cfg, reaching, admitted + max_pending_bodies, found)
    found.errors = list(dict.fromkeys(found.errors))  # a route read once for each ext_proc filter says it once
    found.warnings = list(dict.fromkeys(found.warnings))
    return found


# Cluster types that pick their host per request (from the request's Host, or its original destination): a route
# to one reaches any address, a pool's replicas included.
ANY_HOST = frozenset({"envoy.clusters.dynamic_forward_proxy", "ORIGINAL_DST"})
AGGREGATE = "envoy.clusters.aggregate"
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})


def pool_clusters(cfg: dict[str, Any], pools: set[str]) -> set[str]:
    """The clusters that reach a pool's replicas: the policy's, any other with one of their endpoints (a second
    Service over the same pods: an /internal/ route to one, the ext_proc off, reached the 70B replicas
    unadmitted), and any that picks its host per request (an egress port's dynamic forward proxy took
    `Host: <replica>` to the replica unadmitted; both measured through Envoy 1.40)."""
    clusters = [c for c in (cfg.get("static_resources") or {}).get("clusters") or [] if isinstance(c, dict)]
    ends = {c.get("name"): _endpoints(c) for c in clusters}
    pooled = {e for name in pools for e in ends.get(name, ())}
    out = set(pools)
    grew = True
    while grew:  # an aggregate over an aggregate over a pool reaches it too
        grew = False
        for c in clusters:
            name = c.get("name")
            if isinstance(name, str) and name not in out and (
                    ends[name] & pooled or _any_host(c) or set(_aggregated(c)) & out):
                out.add(name)
                grew = True
    return out


def _aggregated(c: dict[str, Any]) -> list[str]:
    """The clusters an aggregate cluster sends to (a failover group: measured, an /internal/ route to one over
    the 70B pool, the ext_proc off, reached its replicas unadmitted)."""
    kind = c.get("cluster_type") or {}
    if kind.get("name") != AGGREGATE:
        return []
    children = (kind.get("typed_config") or {}).get("clusters") or []
    return [x for x in children if isinstance(x, str)]


def eds_clusters(cfg: dict[str, Any], pools: set[str]) -> list[str]:
    """Clusters whose endpoints come from EDS, other than the pools: this check cannot tell whose replicas they
    are."""
    return [c.get("name", "?") for c in (cfg.get("static_resources") or {}).get("clusters") or []
            if isinstance(c, dict) and str(c.get("type", "")).upper() == "EDS" and c.get("name") not in pools]


def _endpoints(c: dict[str, Any]) -> set[tuple[str, Any]]:
    """(host, port) of a cluster's static endpoints (a DNS name for STRICT_DNS / LOGICAL_DNS), the host as
    _host_key reads it and the port as a number (Envoy reads "8000" as 8000)."""
    out = set()
    for group in (c.get("load_assignment") or {}).get("endpoints") or []:
        for lb in group.get("lb_endpoints") or []:
            sock = (((lb.get("endpoint") or {}).get("address") or {}).get("socket_address") or {})
            if sock.get("address") is not None:
                port = sock.get("port_value")
                port = int(port) if isinstance(port, str) and port.strip().isdigit() else port
                out.add((_host_key(str(sock["address"])), port))
    return out


def _host_key(host: str) -> str:
    """A host as it names a replica set: loopback however it is spelled, and a DNS name by its first label (a
    Service's short name and its cluster-local FQDN, `vllm-70b` and `vllm-70b.default.svc.cluster.local`, are
    the same pods: measured, a second cluster naming them by the FQDN reached them unadmitted). Two namespaces'
    Services of one name read as one: an error this check then says too often, never too seldom."""
    host = host.strip().lower().rstrip(".")
    if host in LOOPBACK or host.startswith("127."):
        return "loopback"
    if host.replace(".", "").isdigit() or ":" in host:
        return host  # an IP address
    return host.split(".", 1)[0]


def _any_host(c: dict[str, Any]) -> bool:
    kind = c.get("cluster_type") or {}
    return str(c.get("type", "")).upper() in ANY_HOST or kind.get("name") in ANY_HOST or \
        str((kind.get("typed_config") or {}).get("@type", "")).endswith("dynamic_forward_proxy.v3.ClusterConfig")


def _lint_buffers(cfg: dict[str, Any], pools: set[str], receive: int, found: Findings) -> None:
    """Envoy buffers a request body up to the listener's per_connection_buffer_limit_bytes (or a route's
    request_body_buffer_limit) and sends it to the ext_proc in one message. One past the ext_proc's gRPC receive
    limit fails its stream, and failure_mode_allow sends the request on undecided (32 MiB for base64 images: a
    9 MiB chat body reached the replica unadmitted, measured through Envoy 1.40)."""
    for listener in (cfg.get("static_resources") or {}).get("listeners") or []:
        where = f"listener {listener.get('name', '?')!r}"
        own = listener.get("per_connection_buffer_limit_bytes", 1 << 20)
        for hcm in _hcms_of(listener):
            if not _fails_open(hcm) or not _reaches(hcm, pools):
                continue
            limits = [("per_connection_buffer_limit_bytes", own)]
            for vh in (hcm.get("route_config") or {}).get("virtual_hosts") or []:
                for scope in (vh, *(vh.get("routes") or [])):
                    for key in ("request_body_buffer_limit", "per_request_buffer_limit_bytes"):
                        if key in scope:
                            limits.append((f"{key} of {_scope_name(scope)}", scope[key]))
            for key, value in limits:
                if isinstance(value, int) and value > receive:
                    found.errors.append(
                        f"{where}: {key} {value:,} is past the ext_proc's gRPC receive limit ({receive:,} bytes at "
                        "its --max-body-bytes): a body that large fails the ext_proc's stream, and "
                        "failure_mode_allow sends the request on unadmitted. Keep it at or below --max-body-bytes "
                        "(raise that flag, and pass it to this check, for larger bodies)")


def _lint_ext_proc_breakers(cfg: dict[str, Any], pools: set[str], need: int, found: Findings) -> None:
    """Each request holds an ext_proc stream from its headers to its end, a body that never comes too; past the
    ext_proc cluster's circuit breaker Envoy does not ask the ext_proc, and failure_mode_allow sends the request on
    (Envoy's default of 1,024: past 1,024 held uploads a chat request reached the replica unadmitted, measured).
    The breaker must stay above what the ext_proc holds before it refuses new requests itself
    (--max-pending-bodies) plus what it admits."""
    clusters = {c.get("name"): c for c in (cfg.get("static_resources") or {}).get("clusters") or []
                if isinstance(c, dict)}
    seen = set()
    for where, hcm in _connection_managers(cfg):
        if not _fails_open(hcm) or not _reaches(hcm, pools):
            continue
        name = ((_ext_proc_config(hcm).get("grpc_service") or {}).get("envoy_grpc") or {}).get("cluster_name")
        if name not in clusters or name in seen:
            continue
        seen.add(name)
        low = _breakers_below(clusters[name], need)
        if low:
            found.errors.append(
                f"cluster {name!r} (the ext_proc's): circuit_breakers {', '.join(f'{k} {v}' for k, v in low.items())} "
                f"(1024 when unset) below {need:,}, the requests the ext_proc may hold (--max-pending-bodies plus "
                "what the policy admits): past its breaker Envoy does not ask the ext_proc, and failure_mode_allow "
                "sends requests on unadmitted (envoy.yaml sets 100,000)")


def _hcms_of(listener: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for f in _filters_of(listener):
        if _is_hcm(f):
            yield f.get("typed_config") or {}


def _filters_of(listener: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A listener's network filters, in every filter chain and its default one."""
    chains = list(listener.get("filter_chains") or [])
    if listener.get("default_filter_chain"):
        chains.append(listener["default_filter_chain"])
    for chain in chains:
        yield from chain.get("filters") or []


def _is_hcm(f: dict[str, Any]) -> bool:
    return f.get("name") == "envoy.filters.network.http_connection_manager" or \
        (f.get("typed_config") or {}).get("@type") == HCM_TYPE


def _fails_open(hcm: dict[str, Any]) -> bool:
    """Whether the connection manager has an ext_proc that sends requests on when it fails (failure_mode_allow),
    on the filter or by a route's, virtual host's or route table's `overrides` (measured: a filter failing closed,
    chat's route overriding it to fail open, a 9 MiB body went on unadmitted)."""
    if any((f.get("typed_config") or {}).get("@type") == EXT_PROC_TYPE and
           (f.get("typed_config") or {}).get("failure_mode_allow") for f in hcm.get("http_filters") or []):
        return True
    rc = hcm.get("route_config") or {}
    scopes = [rc]
    for vh in rc.get("virtual_hosts") or []:
        scopes.append(vh)
        for r in vh.get("routes") or []:
            scopes.append(r)
            scopes.extend(((r.get("route") or {}).get("weighted_clusters") or {}).get("clusters") or [])
    for scope in scopes:
        for per in (scope.get("typed_per_filter_config") or {}).values():
            per = (per.get("config") or {}) if str(per.get("@type", "")).endswith("FilterConfig") else per
            if ((per.get("overrides") or {}).get("failure_mode_allow")) is True:
                return True
    return False


def _reaches(hcm: dict[str, Any], pools: set[str]) -> bool:
    return any(_pool(c, pools) for vh in (hcm.get("route_config") or {}).get("virtual_hosts") or []
               for r in vh.get("routes") or [] for c in _targets(r))


def _scope_name(scope: dict[str, Any]) -> str:
    return f"virtual host {scope['name']!r}" if "domains" in scope else f"route ({_show_match(scope)})"


# Enum fields this check compares by name. Envoy's parser also takes an enum by number and in any case.
ENUMS = {**{f"{way}_{part}_mode": ProcessingMode.HeaderSendMode for way in ("request", "response")
            for part in ("header", "trailer")},
         "request_body_mode": ProcessingMode.BodySendMode, "response_body_mode": ProcessingMode.BodySendMode,
         "route_cache_action": ExternalProcessor.RouteCacheAction}
# Duration fields this check reads. Envoy's parser also takes a Duration as {seconds, nanos}.
DURATIONS = frozenset({"max_message_timeout", "message_timeout", "request_timeout", "stream_idle_timeout", "timeout",
                       "per_try_timeout", "idle_timeout"})
# Bool fields this check reads. Envoy's parser also takes a bool as one of these strings, in any case
# (/config_dump, Envoy 1.40; "on" and "off" it refuses).
TRUE, FALSE = frozenset({"true", "yes", "y", "1"}), frozenset({"false", "no", "n", "0"})
# Integer fields this check reads. Envoy's parser also takes them as strings of digits (a Helm value quoted).
INTS = frozenset({"per_connection_buffer_limit_bytes", "request_body_buffer_limit", "per_request_buffer_limit_bytes",
                  "max_requests", "max_pending_requests", "max_connections", "port_value"})
BOOLS = frozenset({"observability_mode", "disable_immediate_response", "disable_clear_route_cache",
                   "failure_mode_allow", "disabled", "is_optional", "disallow_all", "disallow_is_error",
                   "hedge_on_per_try_timeout", "ignore_case", "invert_match"})


def as_envoy_reads(cfg: Any, refused: list[str] | None = None) -> Any:
    """A copy of `cfg` with the values this check reads spelled the one way it compares them, as Envoy's parser
    reads them (measured in /config_dump, Envoy 1.40): a null is an unset field, an enum given by number or in
    lower case is its name (`request_body_mode: 2` and `buffered` are BUFFERED, `route_cache_action: 2` RETAIN), a
    Duration written as {seconds, nanos} is the string form (`{seconds: 2}` is "2s"), a bool written "false",
    "no" or "0" is False (a non-empty string would read as true here), a list nested in a list is spliced into it
    (`routes: [[a, b], c]` is [a, b, c], an empty one is nothing). Free-form values (a JSON body format, metadata)
    are kept as written. Each of those fields whose value Envoy does not take (`max_message_timeout: 30`,
    `request_body_mode: BUFERED`) is added to `refused` as "its.path: value": read as unset, it would be passed over
    silently.
    Walked without recursion: a config nested as deep as YAML allows must not overflow the stack here."""
    root = [cfg]
    todo: list[tuple[Any, Any, str]] = [(root, 0, "")]
    while todo:
        parent, key, where = todo.pop()
        value = parent[key]
        if isinstance(value, dict):
            value = _unwrapped(value)
            value = {k: _spelled(k, v) for k, v in value.items() if v is not None}
            todo.extend((value, k, f"{where}.{k}".lstrip(".")) for k in value if k not in FREE_FORM)
            if refused is not None:
                refused.extend(f"{where}.{k}".lstrip(".") + f": {v!r}" for k, v in value.items() if not _takes(k, v))
        elif isinstance(value, list):
            value = _flattened(value)
            todo.extend((value, i, f"{where}[{i}]") for i in range(len(value)))
        parent[key] = value
    return root[0]


# A config written as a TypedStruct ({type_url, value}) is the message `type_url` names, with `value`'s fields:
# read as written, a connection manager spelled so was no connection manager here, and a second port routed to a
# pool without the ext_proc passed (measured through Envoy 1.40).
TYPED_STRUCTS = frozenset({"type.googleapis.com/xds.type.v3.TypedStruct",
                           "type.googleapis.com/udpa.type.v1.TypedStruct"})


def _unwrapped(value: dict[str, Any]) -> dict[str, Any]:
    if value.get("@type") not in TYPED_STRUCTS or not isinstance(value.get("value", {}), dict):
        return value
    return {**(value.get("value") or {}), "@type": value.get("type_url", "")}


# google.protobuf.Struct fields: their keys are the user's, not Envoy's field names.
FREE_FORM = frozenset({"json_format", "filter_metadata", "metadata"})
DURATION = re.compile(r"-?\d+(\.\d{1,9})?s")


def _takes(key: Any, value: Any) -> bool:
    """Whether Envoy's parser takes `value` (spelled) for the field `key`, where it is one this check reads."""
    if key in ENUMS:  # a number outside the enum is an open enum's unknown value: Envoy takes it
        return isinstance(value, int) and not isinstance(value, bool) or value in ENUMS[key].keys()
    if key in DURATIONS:
        return isinstance(value, str) and DURATION.fullmatch(value) is not None
    if key in BOOLS:
        return isinstance(value, bool)
    return True


def _flattened(items: list[Any]) -> list[Any]:
    out, todo = [], items[::-1]
    while todo:
        item = todo.pop()
        if isinstance(item, list):
            todo.extend(item[::-1])
        else:
            out.append(item)
    return out


def _spelled(key: Any, value: Any) -> Any:
    if key in INTS and isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if key in DURATIONS and isinstance(value, dict):
        return _duration(value)
    if key in BOOLS and isinstance(value, str) and value.lower() in TRUE | FALSE:
        return value.lower() in TRUE
    enum = ENUMS.get(key)
    if enum is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and value in enum.values():
        return enum.Name(value)
    if isinstance(value, str) and value.upper() in enum.keys():
        return value.upper()
    return value


def _duration(value: dict[str, Any]) -> Any:
    """{seconds, nanos} (either may be left out, or written as a string) as "Ns" ("2.5s"); another shape as it is."""
    try:
        if set(value) <= {"seconds", "nanos"}:
            # Fixed-point, nanoseconds at most: `g` wrote {seconds: 1000000} as "1e+06s", which no Duration reads.
            seconds, nanos = int(value.get("seconds", 0)), int(value.get("nanos", 0))
            return f"{seconds + nanos // 10**9}.{nanos % 10**9:09d}".rstrip("0").rstrip(".") + "s"
    except (TypeError, ValueError):
        pass
    return value


def _lint_pool_breakers(cfg: dict[str, Any], pools: set[str], admitted: int, found: Findings) -> None:
    """Envoy's circuit breakers on a pool refuse admitted requests (503 `overflow`, measured with max_requests 1),
    which the ext_proc counts as the pool's errors: keep them above what admission lets through."""
    for c in (cfg.get("static_resources") or {}).get("clusters") or []:
        if c.get("name") not in pools:
            continue
        low = _breakers_below(c, admitted)
        if low:
            found.warnings.append(
                f"cluster {c['name']!r}: circuit_breakers {', '.join(f'{k} {v}' for k, v in low.items())} (1024 "
                f"when unset) below the {admitted} requests the policy admits at once: Envoy answers the rest 503 "
                "overflow after admission, and the ext_proc counts them as the pool's errors")


def _breakers_below(c: dict[str, Any], need: int) -> dict[str, int]:
    """A cluster's circuit-breaker thresholds under `need` (Envoy's 1,024 where unset). Routes send at the DEFAULT
    priority (unset is DEFAULT); a list without it leaves Envoy's defaults there."""
    thresholds = next((t for t in (c.get("circuit_breakers") or {}).get("thresholds") or []
                       if t.get("priority", "DEFAULT") in ("DEFAULT", 0)), {})
    return {k: thresholds.get(k, 1024) for k in ("max_connections", "max_pending_requests", "max_requests")
            if thresholds.get(k, 1024) < need}


def _network_filters(cfg: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for listener in ((cfg.get("static_resources") or {}).get("listeners")) or []:
        for f in _filters_of(listener):
            yield f"listener {listener.get('name', '?')!r}", f


def _connection_managers(cfg: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for listener in ((cfg.get("static_resources") or {}).get("listeners")) or []:
        for tc in _hcms_of(listener):
            yield f"listener {listener.get('name', '?')!r}", tc


def _lint_tcp_proxies(cfg: dict[str, Any], pools: set[str], found: Findings) -> None:
    """A network filter other than the HTTP connection manager that names a pool: a tcp_proxy passes bytes, the
    generic proxy (its HTTP/1 codec: measured, a POST reached the 70B replica unadmitted) runs its own filters,
    and neither runs the HTTP filters, the ext_proc included."""
    for where, f in _network_filters(cfg):
        if _is_hcm(f):
            continue
        tc = f.get("typed_config") or {}
        reached = sorted(_names_in(tc) & pools)
        if reached:
            kind = "tcp_proxy" if tc.get("@type") == TCP_PROXY_TYPE or \
                f.get("name") == "envoy.filters.network.tcp_proxy" else f.get("name") or tc.get("@type", "?")
            found.errors.append(f"{where}: {kind} to {', '.join(reached)}: its connections reach the replicas "
                                "with no HTTP filter, the ext_proc included (unadmitted)")


def _names_in(tree: Any) -> set[str]:
    """Every string value in a filter's config (walked without recursion): the clusters it may name."""
    out, todo = set(), [tree]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)
        elif isinstance(x, str):
            out.add(x)
    return out


def _lint_hcm(where: str, hcm: dict[str, Any], pools: set[str], longest_wait_s: float, reads: tuple[str, ...],
              store_call_s: float, found: Findings) -> None:
    rc = hcm.get("route_config")
    scoped = ((hcm.get("scoped_routes") or {}).get("scoped_route_configurations_list") or {}).get(
        "scoped_route_configurations") or []
    tables = [c["route_configuration"] for c in scoped if isinstance(c.get("route_configuration"), dict)]
    if rc is None and tables:  # scoped routes with their tables inline: each is a route table of this manager
        for table in tables:
            _lint_hcm(f"{where} (scope {table.get('name', '?')!r})", {**hcm, "route_config": table}, pools,
                      longest_wait_s, reads, store_call_s, found)
        return
    if rc is None:
        found.warnings.append(f"{where}: its routes come from RDS and are not checked: check the route table it "
                              "serves against docs/envoy-integration.md")
        return
    if rc.get("vhds") is not None:  # virtual hosts served on demand beside the inline ones
        found.warnings.append(f"{where}: route_config.vhds: the virtual hosts VHDS serves are not checked: check "
                              "them against docs/envoy-integration.md")
    for vh in rc.get("virtual_hosts") or []:
        if vh.get("matcher") is not None:  # Envoy picks its routes by the matcher tree: no `routes` to read
            found.warnings.append(f"{where}, virtual host {vh.get('name', '?')!r}: its routes come from a matcher tree "
                                  "(matcher) and are not checked: check them against docs/envoy-integration.md")
    name = _ext_proc_filter(where, hcm, rc, pools, found)
    if name is None:
        return
    _lint_waits(where, hcm, longest_wait_s, found)
    _lint_message_timeout(where, hcm, found)
    _lint_store_call(where, hcm, store_call_s, found)
    _lint_internal_addresses(where, hcm, found)
    _lint_headers(where, _ext_proc_config(hcm), reads, found)
    _lint_early_mutation(where, hcm, reads, found)
    # Every ext_proc filter before the router is read as the admission one: this check cannot tell a second one
    # (a guardrail, a copy of ours) from ours, and took the first for ours: with a guardrail first, a route that
    # turned OUR filter off passed as decided, and reached the replica unadmitted (measured through Envoy 1.40).
    for ext in _ext_procs(hcm):
        for vh in rc.get("virtual_hosts") or []:
            _lint_vhost(f"{where}, virtual host {vh.get('name', '?')!r}", vh, rc, ext, pools, found)


def _ext_procs(hcm: dict[str, Any]) -> Iterator[tuple[str, str, bool]]:
    """Each ext_proc filter before the router: (its name, its gRPC cluster, whether it is off unless a per-route
    config turns it on: `disabled: true`)."""
    for f in hcm.get("http_filters") or []:
        if f.get("name") == "envoy.filters.http.router":
            return
        tc = f.get("typed_config") or {}
        if tc.get("@type") == EXT_PROC_TYPE:
            cluster = ((tc.get("grpc_service") or {}).get("envoy_grpc") or {}).get("cluster_name", "")
            yield f.get("name", "envoy.filters.http.ext_proc"), cluster, bool(f.get("disabled"))


def _ext_proc_filter(where: str, hcm: dict[str, Any], rc: dict[str, Any], pools: set[str],
                     found: Findings) -> str | None:
    """The ext_proc filter's name, if it decides this connection manager's requests; else say why not."""
    filters = hcm.get("http_filters") or []
    names = [f.get("name", "") for f in filters]
    i = next((i for i, f in enumerate(filters) if (f.get("typed_config") or {}).get("@type") == EXT_PROC_TYPE), None)
    reaches = sorted({c for vh in rc.get("virtual_hosts") or [] for r in vh.get("routes") or []
                      for c in _targets(r) if _pool(c, pools)})
    if not reaches:
        return None  # no route of it reaches a model pool
    router = next((j for j, n in enumerate(names) if n == "envoy.filters.http.router"), len(names))
    if i is None:
        found.errors.append(f"{where} has no ext_proc filter: its routes to {', '.join(reaches)} reach the replicas "
                            "unadmitted")
        return None
    if i > router:  # measured: Envoy 1.40 does not load it, so it lets nothing through; it is no config to ship
        found.errors.append(f"{where} runs the ext_proc filter after the router: Envoy refuses the config (the "
                            "router, a terminal filter, must be the last HTTP filter); put the ext_proc before it")
        return None
    _lint_filter_config(where, filters[i]["typed_config"], found)
    for n in names[i + 1:router]:
        if n in REWRITERS:
            found.warnings.append(f"{where}: {n} runs after the ext_proc: a body, path or header it changes is not "
                                  "what was admitted (put it before the ext_proc)")
        elif n == "envoy.filters.http.cors":
            found.warnings.append(f"{where}: {n} runs after the ext_proc, which answers a browser's preflight "
                                  "(OPTIONS) 405 method_not_allowed before CORS can (put it before the ext_proc)")
        elif n == "envoy.filters.http.compressor":
            # Responses pass the filters in reverse: it compresses the answer before the ext_proc reads it.
            found.warnings.append(f"{where}: {n} runs after the ext_proc, so the ext_proc gets compressed answers: "
                                  "no usage is learned, and tokens-per-minute tenants are charged the estimate "
                                  "instead of their real usage (put it before the ext_proc)")
    return filters[i].get("name", "envoy.filters.http.ext_proc")


def _lint_filter_config(where: str, tc: dict[str, Any], found: Findings) -> None:
    if tc.get("observability_mode"):
        found.errors.append(f"{where}: the ext_proc runs in observability_mode: Envoy does not wait for its "
                            "decisions, so every request reaches the replicas unadmitted")
    if tc.get("disable_immediate_response"):
        found.errors.append(f"{where}: the ext_proc's disable_immediate_response: Envoy ignores its refusals and "
                            "sends the request on unadmitted (cap 1: three requests ran at once, two without a "
                            "ticket)")
    if tc.get("disable_clear_route_cache") or tc.get("route_cache_action") == "RETAIN":
        found.errors.append(f"{where}: the ext_proc filter keeps the route cache (disable_clear_route_cache or "
                            f"route_cache_action RETAIN): the route on {CLUSTER_HEADER} is never chosen, and a "
                            "request admitted for one pool runs on the static route's (llama-8b ran on the 70B "
                            "pool)")
    mode = tc.get("processing_mode") or {}
    for key, want, why in (
            ("request_header_mode", "SEND", "the ext_proc refuses every request (500 request_not_sent)"),
            ("request_body_mode", "BUFFERED", "the ext_proc refuses every request (500 request_not_sent)"),
            ("request_trailer_mode", "SEND", "an HTTP/2 request that ends with trailers and no body reaches the "
                                             "replica undecided")):
        if _mode(mode, key) != want:
            found.errors.append(f"{where}: ext_proc processing_mode.{key} is {mode.get(key, 'unset')}, not {want}: "
                                f"{why}")
    if mode.get("response_trailer_mode") != "SEND":
        # Not reproduced through Envoy 1.40 with HTTP/1 (the slot was held to the answer's end either way), but
        # the ext_proc frees a slot when its stream ends, and the response trailers are what keep it open.
        found.warnings.append(f"{where}: ext_proc processing_mode.response_trailer_mode is "
                              f"{mode.get('response_trailer_mode', 'unset')}, not SEND: nothing then holds the "
                              "ext_proc's stream open to the answer's end, which frees the slot (section 2)")


def _mode(mode: dict[str, Any], key: str) -> str:
    """A processing_mode field as Envoy runs it: unset or DEFAULT is SEND for headers, SKIP for trailers, NONE for
    a body (`request_header_mode: DEFAULT` sends the headers)."""
    value = mode.get(key, "DEFAULT")
    if value != "DEFAULT":
        return value
    return "SEND" if key.endswith("header_mode") else "SKIP" if key.endswith("trailer_mode") else "NONE"


def _lint_waits(where: str, hcm: dict[str, Any], longest_wait_s: float, found: Findings) -> None:
    """A queued request is held by extending Envoy's message timeout, which Envoy ignores past
    max_message_timeout (unset: 0, every extension ignored). Measured: max_message_timeout 2s, max_wait_ms 6000,
    the queued request went upstream unadmitted after message_timeout, past a full cap."""
    if longest_wait_s <= 0:
        return
    tc = _ext_proc_config(hcm)
    need = longest_wait_s + QUEUE_GRACE_S
    most = seconds(tc.get("max_message_timeout", "0s"))
    own = _message_timeout(tc)  # an ignored extension leaves it running: it may cover the wait itself
    if most is not None and most < need and not (own is not None and own >= need):
        then = ("forwarded unadmitted (failure_mode_allow: true)" if tc.get("failure_mode_allow")
                else "answered 504 (failure_mode_allow: false)")
        found.errors.append(f"{where}: ext_proc max_message_timeout {most:g}s is below the longest queue wait, "
                            f"{longest_wait_s:g}s + {QUEUE_GRACE_S:g}s: Envoy ignores the ext_proc's extension, and "
                            f"a request queued past message_timeout is {then}")
    cut = seconds(hcm.get("request_timeout", "0s"))
    if cut and cut < need:
        found.warnings.append(f"{where}: request_timeout {cut:g}s is below the longest queue wait, "
                              f"{longest_wait_s:g}s + {QUEUE_GRACE_S:g}s: queued requests get Envoy's 408 first")
    # A request the ext_proc holds is silent (measured: 504 at stream_idle_timeout, still queued); a route's
    # idle_timeout overrides the connection manager's for its requests.
    idle = [("stream_idle_timeout", hcm.get("stream_idle_timeout", "300s"))]
    idle += [(f"route {r.get('name') or (r.get('match') or {}).get('prefix', '?')!r} idle_timeout",
              r["route"]["idle_timeout"]) for vh in (hcm.get("route_config") or {}).get("virtual_hosts") or []
             for r in vh.get("routes") or [] if "idle_timeout" in (r.get("route") or {})]
    for name, value in idle:
        cut = seconds(value)
        if cut and cut < need:
            found.warnings.append(f"{where}: {name} {cut:g}s is below the longest queue wait, {longest_wait_s:g}s "
                                  f"+ {QUEUE_GRACE_S:g}s: a request still queued then gets Envoy's 504 "
                                  "stream_idle_timeout")


# The shortest message_timeout a failing-open ext_proc may have: Envoy's own default. A decision takes microseconds,
# but a GC pause or a busy CPU delays its answer: at 10 ms, 246 of 300 concurrent requests against a cap of 3
# reached the replicas unadmitted (shipped 0.5 s: none; measured through Envoy 1.40).
MIN_MESSAGE_TIMEOUT_S = 0.2


def _lint_message_timeout(where: str, hcm: dict[str, Any], found: Findings) -> None:
    tc = _ext_proc_config(hcm)
    own = _message_timeout(tc)
    if tc.get("failure_mode_allow") and own is not None and 0 < own < MIN_MESSAGE_TIMEOUT_S:
        found.errors.append(f"{where}: ext_proc message_timeout {own:g}s is under {MIN_MESSAGE_TIMEOUT_S:g}s: an "
                            "answer delayed past it (a GC pause, a busy CPU) and failure_mode_allow sends the request "
                            "on unadmitted (at 10 ms, 246 of 300 concurrent requests went through unadmitted); "
                            "envoy.yaml sets 0.5s")


# Headers Envoy honours from an internal client (internal_address_config) that make one admitted request run
# several times at once, or be cut and rerun.
ENVOY_RETRY_HEADERS = ("x-envoy-retry-on", "x-envoy-retry-grpc-on", "x-envoy-max-retries",
                       "x-envoy-upstream-rq-per-try-timeout-ms", "x-envoy-hedge-on-per-try-timeout")


def _lint_internal_addresses(where: str, hcm: dict[str, Any], found: Findings) -> None:
    """A client Envoy counts as internal (internal_address_config; by the peer's address with use_remote_address,
    else by the x-forwarded-for it sends) has its x-envoy-* request headers honoured: one admitted request with
    x-envoy-retry-on, a short per-try timeout and x-envoy-hedge-on-per-try-timeout ran three times at once on one
    slot (measured through Envoy 1.40). Unless the connection manager removes those headers first."""
    internal = hcm.get("internal_address_config") or {}
    if not internal.get("cidr_ranges") and not internal.get("unix_sockets"):
        return
    matchers = _early_removals(hcm)
    kept = [h for h in ENVOY_RETRY_HEADERS if not any(_string_matches(m, h) for m in matchers)]
    if kept:
        found.errors.append(f"{where}: internal_address_config makes some clients internal, and Envoy honours their "
                            f"{', '.join(kept)}: one admitted request runs several times at once on one slot (3 "
                            "measured). Remove them with early_header_mutation_extensions (e.g. the prefix "
                            "x-envoy-), or leave internal_address_config out")


def _lint_store_call(where: str, hcm: dict[str, Any], store_call_s: float, found: Findings) -> None:
    """A request admitted at once asks the shared store for its global slot before the ext_proc's first answer,
    with no extension yet (FinalAdmission.settle): Envoy's message_timeout must outlast that call."""
    own = _message_timeout(_ext_proc_config(hcm))
    if store_call_s > 0 and own is not None and own <= store_call_s:
        found.warnings.append(f"{where}: ext_proc message_timeout {own:g}s is not above the policy's store.timeout_ms "
                              f"({store_call_s * 1000:g} ms): a Redis call that slow, made before the ext_proc's "
                              "first answer, outlasts Envoy's wait for it (failure_mode_allow then sends the request "
                              "on unadmitted)")


def _message_timeout(tc: dict[str, Any]) -> float | None:
    """The ext_proc filter's message_timeout, in seconds (Envoy's default 200 ms when unset)."""
    return seconds(tc.get("message_timeout", "0.2s"))


def _ext_proc_config(hcm: dict[str, Any]) -> dict[str, Any]:
    return next(f["typed_config"] for f in hcm["http_filters"]
                if (f.get("typed_config") or {}).get("@type") == EXT_PROC_TYPE)


def _lint_headers(where: str, tc: dict[str, Any], reads: tuple[str, ...], found: Findings) -> None:
    """The headers going to the ext_proc and coming back from it (each measured through Envoy 1.40)."""
    rules = tc.get("forward_rules")
    empty = [key for key in ("allowed_headers", "disallowed_headers")
             if rules and rules.get(key) is not None and not rules[key].get("patterns")]  # null: unset
    for key in empty:  # what Envoy would do with it is moot: it does not load
        found.errors.append(f"{where}: the ext_proc's forward_rules.{key} lists no patterns: Envoy refuses the "
                            f"config (a pattern list needs at least one); leave {key} out instead")
    if rules and not empty:
        unseen = [h for h in reads if not _forwarded(h, rules)]
        if unseen:
            found.errors.append(f"{where}: the ext_proc's forward_rules keep {', '.join(unseen)} from it: without "
                                "the key every request is anonymous (a tenant's batch request ran as interactive, "
                                "past its max_class and limits), without the path every request is refused")
    mutation = tc.get("mutation_rules") or {}

    def refused(h: str) -> bool:  # Envoy's order (mutation_rules.cc): disallow_expression, allow_expression, all
        allowed = _matches_regex((mutation.get("allow_expression") or {}).get("regex"), h)
        return _matches_regex((mutation.get("disallow_expression") or {}).get("regex"), h) or bool(
            mutation.get("disallow_all") and not allowed)

    blocked = [h for h in SETS if refused(h)]
    if blocked:
        then = ("every admitted request is answered 503 header_mutation_set_headers_failed"
                if mutation.get("disallow_is_error") else
                "admitted requests go upstream without them: on the static route's pool, reported by no ticket")
        found.errors.append(f"{where}: the ext_proc's mutation_rules refuse {', '.join(blocked)}: {then}")
    tags = [h for h in TAGS if refused(h)]
    if tags and mutation.get("disallow_is_error"):
        found.errors.append(f"{where}: the ext_proc's mutation_rules refuse {', '.join(tags)} with disallow_is_error: "
                            "each admitted request it sets one of them on is answered 503 "
                            "header_mutation_set_headers_failed")
    elif REPLICA_HEADER in tags:
        found.warnings.append(f"{where}: the ext_proc's mutation_rules refuse {REPLICA_HEADER}: requests are no "
                              "longer steered away from a replica that hangs or runs slow (docs/reliability.md)")
    if refused("content-length"):  # protocol.admit: a new body with the old length is refused by Envoy (500)
        found.errors.append(f"{where}: the ext_proc's mutation_rules refuse content-length, which it sets with each "
                            "body it rewrites (a client's `priority` or class field removed, a degrade): Envoy "
                            "refuses those requests")


def _forwarded(header: str, rules: dict[str, Any]) -> bool:
    allowed = (rules.get("allowed_headers") or {}).get("patterns")
    disallowed = (rules.get("disallowed_headers") or {}).get("patterns") or []
    return (allowed is None or any(_string_matches(p, header) for p in allowed)) and \
        not any(_string_matches(p, header) for p in disallowed)


def _string_matches(p: dict[str, Any], value: str) -> bool:
    """An Envoy StringMatcher against a lower-case header name (as Envoy holds it): a pattern with upper case
    matches only with `ignore_case` (`exact: Authorization` alone forwards no authorization header)."""
    def fold(pattern: str) -> str:
        return pattern.lower() if p.get("ignore_case") else pattern

    if "exact" in p:
        return value == fold(p["exact"])
    if "prefix" in p:
        return value.startswith(fold(p["prefix"]))
    if "suffix" in p:
        return value.endswith(fold(p["suffix"]))
    if "contains" in p:
        return fold(p["contains"]) in value
    return _matches_regex((p.get("safe_regex") or {}).get("regex"), value)


def _matches_regex(regex: str | None, value: str) -> bool:
    """RE2 as Python reads it: close enough for header-name patterns."""
    try:
        return regex is not None and re.fullmatch(regex, value) is not None
    except re.error:
        return False


def _early_removals(hcm: dict[str, Any]) -> list[dict[str, Any]]:
    """The header-name matchers the connection manager's early header mutations remove."""
    mutations = [m for ext in hcm.get("early_header_mutation_extensions") or []
                 for m in (ext.get("typed_config") or {}).get("mutations") or []]
    return [{"exact": m["remove"]} if "remove" in m else ((m.get("remove_on_match") or {}).get("key_matcher") or {})
            for m in mutations]


def _lint_early_mutation(where: str, hcm: dict[str, Any], reads: tuple[str, ...], found: Findings) -> None:
    """Clients must not send our headers. The ext_proc overwrites them on what it admits (measured), so this matters
    while it fails open: then a forged x-extproc-cluster picks the pool. Nor may it remove one the ext_proc reads."""
    matchers = _early_removals(hcm)
    for h in reads:  # (an x-request-id removed this early is generated anew by the connection manager)
        if h != "x-request-id" and any(_string_matches(m, h) for m in matchers):
            found.errors.append(f"{where}: early_header_mutation_extensions remove {h} before the ext_proc reads it: "
                                "the policy reads it for a class, session, objective, fairness or deadline (name "
                                "another), or the ext_proc itself for the key, path or request id")
    # A prefix that "x-extproc-" itself starts with (as Envoy compares it: x-extproc, x-) removes every one of ours.
    if not any("prefix" in m and _string_matches(m, "x-extproc-") for m in matchers):
        found.errors.append(f"{where}: no early_header_mutation_extensions removing the prefix x-extproc-: while "
                            f"the ext_proc fails open, a client can send {CLUSTER_HEADER} and pick a pool, or a "
                            "ticket and go uncounted in extproc_unadmitted_requests_total")


def _lint_vhost(where: str, vh: dict[str, Any], rc: dict[str, Any], ext: tuple[str, str, bool], pools: set[str],
                found: Findings) -> None:
    routes = vh.get("routes") or []
    first = next((i for i, r in enumerate(routes) if _is_pool_route(r)), None)
    static: set[str] = set()  # where admitted requests run without a route on the header
    for i, r in enumerate(routes):
        targets = [c for c in _targets(r) if _pool(c, pools)]
        what = f"{where}, route {i} ({_show_match(r)})"
        off = _ext_proc_off(r, vh, rc, ext)
        if "direct_response" in r and off is None:
            found.warnings.append(f"{what}: a direct_response with the ext_proc on: the ext_proc answers it first, "
                                  "404 unknown_url (disable the ext_proc on it, as envoy.yaml's routes do)")
        if targets and _read_only(r) and (r.get("match") or {}).get("path") == "/v1/models" and off is not None:
            found.warnings.append(f"{what}: the ext_proc is off there, so GET /v1/models lists the models of "
                                  f"{', '.join(targets)} only: leave it on, and it lists every model it routes")
        if not targets and first is not None and i < first and _targets(r) and off is None:
            # A canary by header ahead of the header route: a request it matches is admitted and counted against
            # the pool the ext_proc picked, then runs here (measured through Envoy 1.40).
            found.errors.append(f"{what} comes before the route on the {CLUSTER_HEADER} header with the ext_proc on: "
                                f"an admitted request it matches runs on {', '.join(_targets(r))}, not on the pool "
                                "the ext_proc counted it against (move it after that route, or name the canary's "
                                "cluster as a model's pool in the policy)")
            continue
        if not targets or _read_only(r):  # no admitted request is a GET on those exact paths
            continue
        if off == "disabled":
            named = "" if ext[0] == "envoy.filters.http.ext_proc" else f" (the ext_proc filter named {ext[0]!r})"
            found.errors.append(f"{what} sends to {', '.join(targets)} with the ext_proc disabled{named}: its "
                                "requests reach the replicas unadmitted")
            continue
        _lint_decided_route(what, r, vh, rc, off, pools, found)
        if i == first:
            _lint_route_action(what, r, vh, found)
        elif first is None:
            static.update(targets)
        elif i < first:
            found.errors.append(f"{what} comes before the route on the {CLUSTER_HEADER} header: an admitted request "
                                f"it matches runs on {', '.join(targets)}, not on the pool the ext_proc picked and "
                                "counted it against (move it after)")
    if static:
        found.errors.append(f"{where}: no route is on the {CLUSTER_HEADER} header, so admitted requests run on "
                            f"{', '.join(sorted(static))} by their path, not on the pool the ext_proc picked and "
                            "counted them against (add envoy.yaml's first route, first)")
    if first is not None and not _matches_everything(routes[first]):
        # An error since an audit ran it (Envoy 1.40): narrowed to /v1/, an /invocations request admitted for
        # llama-8b (counted against its pool) ran on the 70B pool's static route.
        found.errors.append(f"{where}, route {first} ({_show_match(routes[first])}): the route on "
                            f"{CLUSTER_HEADER} must match every path (prefix /): admitted requests it misses run "
                            "on a static route's cluster, not on the pool the ext_proc picked and counted them "
                            "against")


def _lint_decided_route(what: str, r: dict[str, Any], vh: dict[str, Any], rc: dict[str, Any], off: str | None,
                        pools: set[str], found: Findings) -> None:
    """A route to a pool with the ext_proc on: what can still go around it."""
    if off is not None:
        found.errors.append(f"{what} {off}")
    _lint_mirrors(what, r, vh, rc, pools, found)
    if any(k in (r.get("route") or {}) for k in ("prefix_rewrite", "regex_rewrite", "path_rewrite_policy")):
        found.warnings.append(f"{what}: the ext_proc sees the path before the route's rewrite and admits only "
                              "vLLM's own paths (others get 404 unknown_url), and an admitted request goes out "
                              f"by the route on {CLUSTER_HEADER}, unrewritten: rewrite before the ext_proc")


def _lint_mirrors(what: str, r: dict[str, Any], vh: dict[str, Any], rc: dict[str, Any], pools: set[str],
                  found: Findings) -> None:
    """A mirrored request is sent on after admission, ticket and all: one slot, two generations (measured; on the
    route table too)."""
    for m in ((r.get("route") or {}).get("request_mirror_policies") or []) + \
            (vh.get("request_mirror_policies") or []) + (rc.get("request_mirror_policies") or []):
        # A mirror by header picks any cluster, as a route by header does (measured: `cluster_header:
        # x-extproc-cluster` ran each admitted request twice on its pool, ticket and all).
        cluster = m.get("cluster") or (f"the cluster named by {m['cluster_header']}" if m.get("cluster_header")
                                       else "?")
        if _pool(cluster, pools):
            found.errors.append(f"{what} mirrors its requests to {cluster}: each admitted request runs there too, "
                                "on the same slot")
        else:
            found.warnings.append(f"{what} mirrors its requests to {cluster}, which no model of the policy names: "
                                  "what runs there is not admitted")


def _lint_route_action(what: str, r: dict[str, Any], vh: dict[str, Any], found: Findings) -> None:
    """The route admitted requests take: what Envoy does to them after admission."""
    action = r.get("route") or {}
    hedge = action.get("hedge_policy") or vh.get("hedge_policy") or {}
    retry = action.get("retry_policy") or vh.get("retry_policy")
    if hedge.get("hedge_on_per_try_timeout") and retry:
        found.errors.append(f"{what}: hedge_on_per_try_timeout starts another attempt at each per_try_timeout "
                            "while the earlier ones run on: one admitted request generates up to num_retries + 1 "
                            "times at once on one slot")
    elif retry:
        found.warnings.append(f"{what}: retry_policy: a retried request holds one slot and is counted once, but "
                              "each attempt repeats its prefill on the pool, a per_try_timeout shorter than a "
                              "non-streamed answer reruns it whole, and retrying 5xx into a saturated pool adds the "
                              "load admission control sheds")
    timeout = action.get("timeout", "15s (unset)")
    if seconds(timeout) != 0:  # 0s, 0.000s: no timeout
        found.warnings.append(f"{what}: route timeout {timeout}: a longer answer is cut mid-stream and counted as "
                              "an upstream error, and enough of them open the class's error breaker; use 0s and "
                              "bound waiting with the policy")


def _ext_proc_off(r: dict[str, Any], vh: dict[str, Any], rc: dict[str, Any], ext: tuple[str, str, bool]) -> str | None:
    """'disabled', what else a per-route config does that keeps the request from our ext_proc (in words), or None
    (it decides). The most specific per-filter config wins: a weighted cluster, the route, its virtual host, the
    route table. `ext` is the filter's name and its gRPC cluster."""
    weighted = ((r.get("route") or {}).get("weighted_clusters") or {}).get("clusters") or []
    # The picked weighted entry's config is the most specific (measured: one disabling it passed).
    for entry in weighted or [None]:
        per = _merged([rc, vh, r] + ([entry] if entry is not None else []), ext[0])
        if per is None:
            # Off by default on the connection manager, and no config here turns it on (measured: any
            # ExtProcPerRoute, bare or in a FilterConfig, does).
            if ext[2]:
                return "disabled"
            continue
        off = _per_route(per, ext[1])
        if off is not None:
            return off
    return None


def _merged(scopes: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """The ExtProcPerRoute Envoy runs for a request, from the route table's, the virtual host's, the route's and
    the weighted entry's (least specific first): `disabled` is the most specific one's, and `overrides` are
    merged field by field, each from the most specific that sets it (measured through Envoy 1.40: a virtual host
    sending to a staging processor, its routes' configs setting only grpc_initial_metadata, kept the staging
    processor). None: none of them configures it."""
    merged: dict[str, Any] | None = None
    for scope in scopes:
        per = (scope.get("typed_per_filter_config") or {}).get(name)
        if per is None:
            continue
        if str(per.get("@type", "")).endswith("/envoy.config.route.v3.FilterConfig"):
            per = {"disabled": True} if per.get("disabled") else (per.get("config") or {})
        merged = {"disabled": bool(per.get("disabled")),
                  "overrides": {**((merged or {}).get("overrides") or {}), **(per.get("overrides") or {})}}
    return merged


def _per_route(per: dict[str, Any], cluster: str) -> str | None:
    if per.get("disabled"):  # ExtProcPerRoute.disabled, or the generic FilterConfig's
        return "disabled"
    if str(per.get("@type", "")).endswith("/envoy.config.route.v3.FilterConfig"):
        return _per_route(per.get("config") or {}, cluster)  # Envoy applies the config it wraps
    overrides = per.get("overrides") or {}
    grpc = overrides.get("grpc_service") or {}
    other = f"cluster {(grpc.get('envoy_grpc') or {}).get('cluster_name', cluster)!r}"
    if "google_grpc" in grpc:  # measured too: a staging processor by target_uri, down, failed open
        other = f"target_uri {(grpc['google_grpc'] or {}).get('target_uri', '?')!r}"
    if other != f"cluster {cluster!r}":  # measured: a dead one failed open, and the request reached the replica
        return (f"sends its requests to another processor ({other}): they are not admitted by this "
                "policy, and while that processor fails open not at all")
    mode = overrides.get("processing_mode")
    if mode is None:  # no override: the filter's own mode holds
        return None
    # An override replaces the whole mode: a field it leaves out is Envoy's default, not the filter's setting (an
    # empty `processing_mode: {}` is an override too, every field at its default).
    bad = [f"{k} {mode.get(k, 'unset')}" for k, want in (("request_header_mode", "SEND"),
                                                          ("request_body_mode", "BUFFERED"))
           if _mode(mode, k) != want]
    if bad:
        return (f"overrides the ext_proc's processing mode ({', '.join(bad)}): the ext_proc refuses its requests "
                "(500 request_not_sent)")
    if mode.get("request_trailer_mode") != "SEND":
        return (f"overrides the ext_proc's processing mode with request_trailer_mode "
                f"{mode.get('request_trailer_mode', 'unset')}: an HTTP/2 request that ends with trailers and no "
                "body reaches the replica undecided (section 2)")
    return None


def _targets(r: dict[str, Any]) -> list[str]:
    """The clusters a route sends to; a cluster picked per request (a header, a plugin) counts as any."""
    action = r.get("route")
    if not action:
        return []  # direct_response, redirect: nothing upstream
    if "cluster" in action:
        return [action["cluster"]]
    if "weighted_clusters" in action:
        return [c["name"] if "name" in c else f"the cluster named by {c.get('cluster_header', '?')}"
                for c in action["weighted_clusters"].get("clusters") or []]
    if "cluster_header" in action:
        return [f"the cluster named by {action['cluster_header']}"]
    return ["a cluster picked per request"]


def _pool(cluster: str, pools: set[str]) -> bool:
    return cluster in pools or cluster.startswith(("the cluster named by", "a cluster picked"))


def _is_pool_route(r: dict[str, Any]) -> bool:
    return (r.get("route") or {}).get("cluster_header") == CLUSTER_HEADER


def _matches_everything(r: dict[str, Any]) -> bool:
    """Whether the route on our header matches every request that has it: `prefix: /` and nothing else to match
    on (a `runtime_fraction` of 50% sent 3 of 8 admitted llama-8b requests to the 70B pool's static route; query
    parameters, TLS, metadata or filter state would miss some too)."""
    m = r.get("match") or {}
    return m.get("prefix") == "/" and set(m) <= {"prefix", "headers", "case_sensitive"} and \
        all(h.get("name") == CLUSTER_HEADER for h in m.get("headers") or [])


def _read_only(r: dict[str, Any]) -> bool:
    """A read-only endpoint route as envoy.yaml writes it: the exact path, GET only."""
    m = r.get("match") or {}
    get = any(h.get("name") == ":method" and (h.get("string_match") or {}).get("exact") == "GET"
              and not h.get("invert_match") for h in m.get("headers") or [])
    return m.get("path") in READ_ONLY and get


def _show_match(r: dict[str, Any]) -> str:
    m = r.get("match") or {}
    where = next((f"{k} {m[k]}" for k in ("path", "prefix", "safe_regex", "path_separated_prefix",
                                           "path_match_policy") if k in m), "any path")
    headers = [h.get("name", "?") for h in m.get("headers") or []]
    return where + (f" with header {', '.join(headers)}" if headers else "")
