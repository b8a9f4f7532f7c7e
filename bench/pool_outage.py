"""A pool whose only replica dies under steady load and comes back on the same port: the pool-wide limit and the
answers per second around the outage (real Envoy + the ext_proc + `extproc sim` processes, speed 4).

`python bench/pool_outage.py [--down-at 15] [--up-at 30] [--until 60] [--clients 24] [--kill extproc]` prints one
row a second: the limit (tokens) as the ext_proc's /metrics reads it, and the 200s that ended in that second. The
replica is a process killed with SIGKILL (nothing listens: its scrapes are refused), then started again; the
clients loop on llama-70b chat requests of ~200 prompt tokens and 100 output tokens (a refusal or a 503 is retried
after 50 ms). `--kill extproc` SIGKILLs the ext_proc at --down-at instead and starts it again at once (Envoy lets
requests through unadmitted meanwhile: failure_mode_allow). docs/reliability.md item 26 has the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from extproc.tools.sim.fleet import SimFleet
from extproc.tools.stack import Stack, exit_on_stop_signals, free_port

SPEED = 4.0
BODY = {"model": "llama-70b", "max_tokens": 100, "messages": [{"role": "user", "content": "hello " * 200}]}


def policy(port: int) -> dict:
    """One class, no breakers (what is measured is the limit), the 70B pool scraped and its limit on."""
    interactive = {"max_concurrency": 64, "max_queue": 32, "max_wait_ms": 500, "slo_p95_ms": 4000,
                   "latency_breaker": {"enabled": False}, "error_breaker": {"enabled": False}}
    return {"classes": {"interactive": interactive}, "default_class": "interactive", "tenants": [], "shed": {},
            "anonymous": {"max_class": "interactive"},
            "models": {"llama-70b": {"cluster": "vllm_llama70b"}, "llama-8b": {"cluster": "vllm_llama8b"}},
            "pools": {"vllm_llama70b": {"scrape_interval_ms": 100, "replicas": [f"127.0.0.1:{port}"],
                                        "limit": {"enabled": True}}}}


def start_replica(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "extproc.cli", "sim", "--profile", "h100-llama70b-awq",
                             "--replicas", "1", "--port", str(port), "--speed", str(SPEED),
                             "--model-name", "llama-70b"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def healthy(http: aiohttp.ClientSession, port: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with http.get(f"http://127.0.0.1:{port}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the replica on port {port} did not start")


async def pool_limit(http: aiohttp.ClientSession, metrics_url: str) -> float:
    async with http.get(f"{metrics_url}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("extproc_pool_limit{"):
                return float(line.split()[-1])
    return float("nan")


async def run(args) -> list[tuple[int, float, int]]:
    port, work = free_port(), Path(tempfile.mkdtemp(prefix="pool-outage-"))
    (work / "policy.yaml").write_text(yaml.safe_dump(policy(port)), encoding="utf-8")
    replica, served, rows, stop = start_replica(port), [], [], asyncio.Event()
    small = SimFleet("h100-llama8b", replicas=1, speed=SPEED, model_names=["llama-8b"])
    stack = None
    try:
        async with small, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            await healthy(http, port)
            pools = {"vllm_llama70b": [("127.0.0.1", port)], "vllm_llama8b": [("127.0.0.1", small.ports[0])]}
            stack = Stack(work, pools, policy_path=work / "policy.yaml")
            await asyncio.to_thread(stack.start)
            t0 = time.monotonic()

            async def client() -> None:
                while not stop.is_set():
                    try:
                        async with http.post(f"{stack.url}/v1/chat/completions", json=BODY) as r:
                            await r.read()
                            ok = r.status == 200
                    except aiohttp.ClientError:
                        ok = False
                    if ok:
                        served.append(time.monotonic() - t0)
                    else:
                        await asyncio.sleep(0.05)

            clients = [asyncio.create_task(client()) for _ in range(args.clients)]
            for second in range(args.until):
                if second == args.down_at and args.kill == "extproc":
                    stack.process("extproc").stop(signal.SIGKILL)
                    await asyncio.to_thread(stack.start_extproc)
                elif second == args.down_at:
                    replica.kill()
                    replica.wait()
                if second == args.up_at and args.kill == "replica":
                    replica = start_replica(port)
                await asyncio.sleep(t0 + second + 1 - time.monotonic())
                done = sum(1 for t in served if second <= t < second + 1)
                rows.append((second, await pool_limit(http, stack.metrics_url), done))
            stop.set()
            await asyncio.gather(*clients, return_exceptions=True)
    finally:
        replica.kill()
        replica.wait()
        if stack is not None:
            stack.stop()
    return rows


def main() -> None:
    exit_on_stop_signals()  # a bench stopped by `timeout` stops what it started
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--down-at", type=int, default=15, help="second the replica is killed")
    p.add_argument("--up-at", type=int, default=30, help="second it is started again")
    p.add_argument("--until", type=int, default=60, help="seconds in all")
    p.add_argument("--clients", type=int, default=24)
    p.add_argument("--kill", choices=("replica", "extproc"), default="replica", help="what dies at --down-at")
    args = p.parse_args()
    print("| second | pool limit (tokens) | 200s in that second |")
    print("|---:|---:|---:|")
    for second, limit, done in asyncio.run(run(args)):
        down = args.down_at <= second < (args.up_at if args.kill == "replica" else args.down_at + 1)
        state = f" ({args.kill} down)" if down else ""
        print(f"| {second}{state} | {limit:,.0f} | {done} |")


if __name__ == "__main__":
    main()
