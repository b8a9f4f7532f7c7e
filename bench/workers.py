"""`extproc serve --workers N` behind one Envoy, caps shared through this host's memory (policy store `memory`) or
Redis: are the caps held exactly, and what do the workers do to requests/s?
Run:  python bench/workers.py [--duration 8] [--workers 1 2] [--stores memory redis]

Two parts, each worker count side by side in one run (Envoy --concurrency 1, wrk -t1 -c64):
- caps: a class capped at --cap, 50 ms requests to tests/upstream.py, which records the most requests it ever had
  in service at once: that must never pass the cap, and should reach it.
- throughput: the overhead benchmark's setup (an upstream Envoy answering at once, a cap nothing reaches); the
  workers' CPU per request is summed over all of them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from overhead import WRK_LUA, _children, cpu_seconds, upstream_config, wrk  # noqa: E402

from extproc.tools.local_redis import RedisServer  # noqa: E402
from extproc.tools import envoyconf  # noqa: E402
from extproc.tools.stack import exit_on_stop_signals, free_port, free_ports, wait_http  # noqa: E402


def cpu_of_children(parent: int) -> float:
    """User + system CPU seconds of `parent` and its children (the workers)."""
    return cpu_seconds(parent) + sum(cpu_seconds(pid) for pid in _children(parent))


@contextlib.contextmanager
def edge(work: Path, workers: int, policy: dict, pool: tuple[str, int]):
    """`extproc serve --workers N` + Envoy rendered for it: (url, supervisor pid)."""
    work.mkdir(parents=True)
    policy_path = work / "policy.yaml"
    policy_path.write_text(yaml.safe_dump(policy))
    grpc, metrics = free_ports(workers), free_ports(workers)
    sup = subprocess.Popen([sys.executable, "-m", "extproc.cli", "serve", "--policy", str(policy_path),
                            "--grpc", f"127.0.0.1:{grpc}", "--metrics", f"127.0.0.1:{metrics}", "--drain-s", "0",
                            "--grace-s", "2", "--workers", str(workers), "--log-level", "WARNING"],
                           stdout=subprocess.DEVNULL, stderr=open(work / "extproc.log", "wb"), start_new_session=True)
    listen, admin = free_port(), free_port()
    cfg = envoyconf.render(envoyconf.load_source(), listen_port=listen, admin_port=admin,
                           extproc=[("127.0.0.1", grpc + i) for i in range(workers)], pools={"vllm_llama70b": [pool]},
                           workers=workers > 1)
    (work / "envoy.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    envoy = subprocess.Popen([envoyconf.envoy_binary(), "-c", str(work / "envoy.yaml"), "--concurrency", "1",
                              "--log-level", "error", "--base-id", str(admin), "--disable-hot-restart"],
                             start_new_session=True)
    try:
        for i in range(workers):
            wait_http(f"http://127.0.0.1:{metrics + i}/healthz", timeout=30, proc=sup)
        wait_http(f"http://127.0.0.1:{admin}/ready", proc=envoy)
        time.sleep(2.5)  # Envoy's health check marks every worker healthy (1 s interval)
        yield f"http://127.0.0.1:{listen}", sup.pid
    finally:
        envoy.terminate()
        envoy.wait(10)
        sup.send_signal(signal.SIGTERM)
        sup.wait(20)


def upstream_stats(port: int, reset: bool = False) -> dict:
    if reset:
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/test/reset", method="POST")).read()
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/test/stats").read())


def main() -> int:
    exit_on_stop_signals()  # a bench stopped by `timeout` stops what it started
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=int, default=8)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cap", type=int, default=16)
    ap.add_argument("--stores", nargs="+", choices=["memory", "redis"], default=["memory", "redis"],
                    help="memory: one worker alone, several through the host's shared table")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="extproc-workers-"))
    redis = RedisServer(work).start()
    models = {"llama-70b": {"cluster": "vllm_llama70b"}}
    slow = work / "slow.lua"
    slow.write_text(WRK_LUA + 'wrk.headers["x-test-delay-ms"] = "50"\n')
    fast = work / "fast.lua"
    fast.write_text(WRK_LUA)
    up_port = free_port()
    upstream = subprocess.Popen([sys.executable, str(ROOT / "tests" / "upstream.py"), str(up_port)],
                                start_new_session=True)
    direct, direct_admin = free_port(), free_port()
    (work / "direct.yaml").write_text(yaml.safe_dump(upstream_config(direct, direct_admin)))
    direct_envoy = subprocess.Popen([envoyconf.envoy_binary(), "-c", str(work / "direct.yaml"), "--concurrency",
                                     "1", "--log-level", "error", "--base-id", str(direct_admin),
                                     "--disable-hot-restart"], start_new_session=True)
    rows = []
    try:
        wait_http(f"http://127.0.0.1:{up_port}/health")
        wait_http(f"http://127.0.0.1:{direct_admin}/ready")
        setups = [(n, kind) for kind in args.stores for n in args.workers]
        for n, kind in setups:
            store = {"kind": "redis", "url": redis.url} if kind == "redis" else {"kind": "memory"}
            capped = {"classes": {"interactive": {"max_concurrency": args.cap, "max_queue": 1000,
                                                  "max_wait_ms": 10_000}}, "models": models, "store": store}
            with edge(work / f"caps{n}{kind}", n, capped, ("127.0.0.1", up_port)) as (url, _):
                upstream_stats(up_port, reset=True)
                r = wrk(url, 64, args.duration, slow)
                st = upstream_stats(up_port)
            open_ = {"classes": {"interactive": {"max_concurrency": 100_000, "max_queue": 0, "max_wait_ms": 0}},
                     "models": models, "store": store}
            with edge(work / f"rps{n}{kind}", n, open_, ("127.0.0.1", direct)) as (url, pid):
                wrk(url, 4, 2, fast)
                cpu0 = cpu_of_children(pid)
                t = wrk(url, 64, args.duration, fast)
                cpu = (cpu_of_children(pid) - cpu0) / max(t["rps"] * args.duration, 1) * 1e6
            rows.append((f"{n} ({kind})", st["max_in_service"], r["rps"], r["non2xx"], t["rps"], t["p50"], t["p99"], cpu))
            print(f"  workers={n} {kind}: most in service {st['max_in_service']} (cap {args.cap}), capped {r['rps']:.0f} "
                  f"req/s non2xx {r['non2xx']}; open {t['rps']:.0f} req/s p50 {t['p50']:.2f} ms "
                  f"p99 {t['p99']:.2f} ms, {cpu:.0f} us CPU/req", flush=True)
    finally:
        for p in (upstream, direct_envoy):
            p.terminate()
            p.wait(10)
        redis.stop()
    print(f"\n| workers (store) | most in service at the upstream (cap {args.cap}) | capped req/s (50 ms requests) | "
          "non-2xx | uncapped req/s | p50 ms | p99 ms | ext_proc CPU per request (all workers) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, most, crps, bad, rps, p50, p99, cpu in rows:
        print(f"| {n} | {most} | {crps:.0f} | {bad} | {rps:.0f} | {p50:.2f} | {p99:.2f} | {cpu:.0f} us |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
