"""The floor under the ext_proc's cost: what a Python gRPC server that decides nothing costs Envoy + grpc.aio per
request, for each way Envoy can call out. Run:  python bench/transport.py [--duration 5] [--rounds 2]

Setups, each an Envoy (--concurrency 1) in front of the overhead benchmark's upstream (a second Envoy answering at
once), and one grpc.aio server on uvloop answering every call at once with one header set:
- `alone`: no call-out;
- `ext_proc`: the production lifecycle (request headers + buffered body, the stream held to the response's end);
- `ext_proc headers`: request headers only, the stream held likewise;
- `ext_authz`: a unary Check with the buffered body (what ext_authz can do: route and refuse; not rewrite a body
  nor learn a response);
- `ext_authz headers`: a unary Check without the body;
- `ext_proc sync`: the production lifecycle again, answered by grpcio's threaded (non-asyncio) server in its own
  process: the same protocol without asyncio's event loop and its cross-thread wake-ups;
- `ext_proc uds`: the production lifecycle to the same grpc.aio server over a Unix socket (Envoy's `pipe`
  address) instead of loopback TCP: what a sidecar ext_proc on a shared volume would save.
The server's CPU per request is what grpc.aio (or the threaded server) costs for that transport, before any
policy.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from overhead import WRK_LUA, _median, upstream_config, wrk  # noqa: E402

from extproc.tools.envoyconf import envoy_binary  # noqa: E402
from extproc.tools.stack import exit_on_stop_signals, free_port, wait_http  # noqa: E402

SETUPS = ["alone", "ext_proc", "ext_proc headers", "ext_authz", "ext_authz headers", "ext_proc sync", "ext_proc uds"]
SYNC_THREADS = 256  # the threaded server holds a thread per open stream: more than the most connections run


def _answers():
    """(the header both servers add, the do-nothing answer to one ext_proc message: None when the phase needs
    none). Imported here, not at the top: only the server processes need the protos."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    mark = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="x-admitted", raw_value=b"1"))

    def answer(message):
        phase = message.WhichOneof("request")
        out = ep.ProcessingResponse()
        if phase == "request_headers":
            out.request_headers.response.header_mutation.set_headers.append(mark)
        elif phase == "request_body":
            out.request_body.response.SetInParent()
        else:
            return None
        return out

    return mark, answer


def serve_sync(port: int) -> None:
    """The do-nothing ext_proc on grpcio's threaded server (`python bench/transport.py --serve-sync PORT`)."""
    from concurrent import futures

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    _, answer = _answers()

    class Processor(ep_grpc.ExternalProcessorServicer):
        def Process(self, request_iterator, context):
            for message in request_iterator:
                if (out := answer(message)) is not None:
                    yield out

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=SYNC_THREADS),
                         maximum_concurrent_rpcs=SYNC_THREADS)
    ep_grpc.add_ExternalProcessorServicer_to_server(Processor(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def _socket(port: int) -> str:
    """The Unix socket the do-nothing server also listens on (named after its TCP port: one per run)."""
    return f"{tempfile.gettempdir()}/extproc-transport-{port}.sock"


def serve(port: int) -> None:
    """The do-nothing server (run in its own process: `python bench/transport.py --serve PORT`)."""
    import grpc
    import uvloop
    from envoy.service.auth.v3 import external_auth_pb2 as auth, external_auth_pb2_grpc as auth_grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    mark, answer = _answers()

    class Authorization(auth_grpc.AuthorizationServicer):
        async def Check(self, request, context):
            answer = auth.CheckResponse()
            answer.ok_response.headers.append(mark)
            return answer

    class Processor(ep_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator, context):
            async for message in request_iterator:
                if (out := answer(message)) is not None:
                    yield out

    async def main() -> None:
        server = grpc.aio.server()
        auth_grpc.add_AuthorizationServicer_to_server(Authorization(), server)
        ep_grpc.add_ExternalProcessorServicer_to_server(Processor(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.add_insecure_port(f"unix:{_socket(port)}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(main())


def call_out(setup: str) -> list[dict]:
    """The HTTP filter each setup puts before the router."""
    if setup == "alone":
        return []
    service = {"envoy_grpc": {"cluster_name": "side"}}
    if setup.startswith("ext_proc"):
        mode = {"request_header_mode": "SEND", "request_body_mode": "BUFFERED", "request_trailer_mode": "SKIP",
                "response_header_mode": "SKIP", "response_body_mode": "NONE", "response_trailer_mode": "SEND"}
        if setup.endswith("headers"):
            mode["request_body_mode"] = "NONE"
        return [{"name": "envoy.filters.http.ext_proc", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": service, "processing_mode": mode, "message_timeout": "0.5s"}}]
    authz = {"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
             "grpc_service": service, "transport_api_version": "V3", "clear_route_cache": True}
    if not setup.endswith("headers"):
        authz["with_request_body"] = {"max_request_bytes": 65536, "allow_partial_message": False}
    return [{"name": "envoy.filters.http.ext_authz", "typed_config": authz}]


def cluster(name: str, port: int, http2: bool = False, pipe: str | None = None) -> dict:
    address = {"pipe": {"path": pipe}} if pipe else {"socket_address": {"address": "127.0.0.1", "port_value": port}}
    c = {"name": name, "type": "STATIC", "connect_timeout": "1s", "load_assignment": {
        "cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}]},
        "circuit_breakers": {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000,
                                             "max_requests": 100000}]}}
    if http2:
        c["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}}
    return c


def front(setup: str, port: int, admin: int, upstream: int, side: int, side_sync: int) -> dict:
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                    "HttpConnectionManager",
           "stat_prefix": "front",
           "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
               {"match": {"prefix": "/"}, "route": {"cluster": "upstream"}}]}]},
           "http_filters": call_out(setup) + [{"name": "envoy.filters.http.router", "typed_config": {
               "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
            "static_resources": {
                "listeners": [{"name": "front", "address": {"socket_address": {"address": "127.0.0.1",
                                                                               "port_value": port}},
                               "filter_chains": [{"filters": [{
                                   "name": "envoy.filters.network.http_connection_manager",
                                   "typed_config": hcm}]}]}],
                "clusters": [cluster("upstream", upstream),
                             cluster("side", side_sync if setup.endswith("sync") else side, http2=True,
                                     pipe=_socket(side) if setup.endswith("uds") else None)]}}


def envoy(config: Path, admin: int) -> subprocess.Popen:
    return subprocess.Popen([envoy_binary(), "-c", str(config), "--concurrency", "1", "--log-level", "error",
                             "--base-id", str(admin), "--disable-hot-restart"], start_new_session=True)


def main() -> int:
    exit_on_stop_signals()  # a bench stopped by `timeout` stops what it started
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=int, default=5, help="seconds per wrk run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--connections", type=int, nargs="+", default=[64, 1])
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-sync", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    if args.serve_sync:
        serve_sync(args.serve_sync)
        return 0
    work = Path(tempfile.mkdtemp(prefix="extproc-transport-"))
    script = work / "post.lua"
    script.write_text(WRK_LUA)
    up, up_admin, side, side_sync = free_port(), free_port(), free_port(), free_port()
    (work / "upstream.yaml").write_text(yaml.safe_dump(upstream_config(up, up_admin)))
    procs = [envoy(work / "upstream.yaml", up_admin)]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(side)], start_new_session=True)
    threaded = subprocess.Popen([sys.executable, __file__, "--serve-sync", str(side_sync)], start_new_session=True)
    procs += [server, threaded]
    urls = {}
    try:
        for setup in SETUPS:
            port, admin = free_port(), free_port()
            path = work / f"{setup.replace(' ', '_')}.yaml"
            path.write_text(yaml.safe_dump(front(setup, port, admin, up, side, side_sync)))
            procs.append(envoy(path, admin))
            wait_http(f"http://127.0.0.1:{admin}/ready")
            urls[setup] = f"http://127.0.0.1:{port}"
        wait_http(f"http://127.0.0.1:{up_admin}/ready")
        time.sleep(1)
        results: dict[tuple[str, int], list[dict]] = {}
        for _ in range(args.rounds):
            for c in args.connections:
                for setup in SETUPS:
                    wrk(urls[setup], 4, 1, script)
                    pid = None if setup == "alone" else (threaded if setup.endswith("sync") else server).pid
                    r = wrk(urls[setup], c, args.duration, script, pid)
                    results.setdefault((setup, c), []).append(r)
                    print(f"  {setup:18s} c={c:<3d} {r['rps']:8.0f} req/s  p50 {r['p50']:.3f} ms  "
                          f"CPU {r['cpu_us']:.0f} us/req  non2xx {r['non2xx']}", flush=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        Path(_socket(side)).unlink(missing_ok=True)
    print(render(results, args))
    return 0


def render(results: dict, args) -> str:
    lines = [f"A do-nothing grpc.aio server (ext_proc sync: grpcio's threaded server) behind Envoy; wrk -t1, {args.duration}s per run, median of {args.rounds} "
             "rounds.", "",
             "| connections | call-out | req/s | p50 ms | added p50 ms | server CPU per request |",
             "|---:|---|---:|---:|---:|---:|"]
    for c in args.connections:
        base = _median([r["p50"] for r in results[("alone", c)]])
        for setup in SETUPS:
            m = {k: _median([r[k] for r in results[(setup, c)]]) for k in ("rps", "p50", "cpu_us")}
            added = "" if setup == "alone" else f"{m['p50'] - base:+.3f}"
            cpu = "" if setup == "alone" else f"{m['cpu_us']:.0f} us"
            lines.append(f"| {c} | {setup} | {m['rps']:.0f} | {m['p50']:.3f} | {added} | {cpu} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
